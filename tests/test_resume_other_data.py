"""A resume state meets other data with the same counts: TarDataset over other shards (as
many), ParquetDataset over other files (as many row groups and rows). Loading it would
repeat some samples and lose others without a word, so it is refused, naming what differs
and both values; a state saved before states carried the digest still loads (its counts are
checked), and a shard list signed again (presigned URLs) is the same shard list.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, cast

import pytest
from datasets import parquet_bytes, tar_shard
from helpers import BOUND_S, assert_raises_naming, collect

from aioloader.sources import ParquetDataset, TarDataset


async def cut_at(dataset: Any, n: int, key: str) -> tuple[list[Any], dict[str, Any]]:
    """The first ``n`` records' ``key`` and the state after them (the epoch closed)."""
    head = []
    epoch = cast(AsyncGenerator[Any, None], aiter(dataset))
    async with asyncio.timeout(BOUND_S), contextlib.aclosing(epoch) as records:
        async for record in records:
            head.append(record[key])
            if len(head) == n:
                break
    return head, dataset.state_dict()


# -- tar shards ------------------------------------------------------------------------------


def tar_files(directory: Path, names: dict[str, int]) -> dict[str, str]:
    """``{name: path}`` of shards ``name`` -> one of :func:`tar_shard`'s (by its number)."""
    paths = {}
    for name, shard in names.items():
        path = directory / name
        path.write_bytes(tar_shard(shard, 6))
        paths[name] = str(path)
    return paths


async def test_a_tar_state_of_other_shards_as_many_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    paths = tar_files(tmp_path, {"a.tar": 0, "b.tar": 1, "c.tar": 2})
    saved = TarDataset([paths["a.tar"], paths["b.tar"]], shards_in_flight=1)
    _, state = await cut_at(saved, 3, "__key__")
    for others in ([paths["c.tar"], paths["b.tar"]], [paths["b.tar"], paths["a.tar"]]):
        ds = TarDataset(others, shards_in_flight=1)
        assert_raises_naming(
            lambda ds=ds: ds.load_state_dict(state),  # type: ignore[misc]
            ValueError,
            [
                "TarDataset.load_state_dict",
                f"shard_list={state['shard_list']!r}",
                f"shard_list={ds.state_dict()['shard_list']!r}",
                "other shards",
            ],
        )


async def test_a_tar_state_resumes_its_own_shards_and_an_older_one_still_loads(
    tmp_path: Path,
) -> None:
    paths = tar_files(tmp_path, {"a.tar": 0, "b.tar": 1})
    urls = [paths["a.tar"], paths["b.tar"]]

    def make() -> TarDataset:
        return TarDataset(urls, shuffle=True, shuffle_buffer=4, seed=1, shards_in_flight=1)

    whole = [raw["__key__"] for raw in await collect(make())]
    head, state = await cut_at(make(), 5, "__key__")
    # As the current code writes it, and as a state saved before states had a shard list
    # (the format the docs describe: epoch, samples yielded, samples of each ended shard).
    for loaded in (state, {k: v for k, v in state.items() if k != "shard_list"}):
        ds = make()
        ds.load_state_dict(loaded)
        assert head + [raw["__key__"] for raw in await collect(ds)] == whole


def test_presigned_shards_signed_again_are_the_same_shard_list() -> None:
    def signed(stamp: str) -> list[str]:
        return [
            f"https://bucket.example/train-{i}.tar?X-Amz-Date={stamp}&X-Amz-Signature={stamp}f"
            for i in range(3)
        ]

    state = TarDataset(signed("20260101"), shards_in_flight=2).state_dict()
    TarDataset(signed("20260202"), shards_in_flight=2).load_state_dict(state)  # no error
    other = [url.replace("train-2", "train-9") for url in signed("20260101")]
    with pytest.raises(ValueError, match="other shards"):
        TarDataset(other, shards_in_flight=2).load_state_dict(state)


# -- Parquet ---------------------------------------------------------------------------------


def parquet_dir(directory: Path) -> None:
    directory.mkdir()
    (directory / "a.parquet").write_bytes(parquet_bytes(0, 10, 5))
    (directory / "b.parquet").write_bytes(parquet_bytes(1, 10, 5))


async def test_a_parquet_state_of_other_files_as_many_rows_is_refused_naming_both(
    tmp_path: Path,
) -> None:
    data = tmp_path / "t"
    parquet_dir(data)
    head, state = await cut_at(ParquetDataset(f"{data}/", row_groups_in_flight=1), 5, "id")
    assert [int(i) for i in head] == [0, 1, 2, 3, 4]
    # a.parquet renamed: now listed after b.parquet, with the same row groups and rows.
    os.rename(data / "a.parquet", data / "c.parquet")
    resumed = ParquetDataset(f"{data}/", row_groups_in_flight=1)
    resumed.load_state_dict(state)  # not listed yet: refused when the iteration starts
    with pytest.raises(ValueError, match="other files") as caught:
        await collect(resumed)
    listed = ParquetDataset(f"{data}/", row_groups_in_flight=1)
    await collect(listed)  # listed: refused by load_state_dict itself
    digest = listed.state_dict()["catalog"]
    assert f"catalog={state['catalog']!r}" in str(caught.value)
    assert f"catalog={digest!r}" in str(caught.value)
    assert_raises_naming(
        lambda: listed.load_state_dict(state),
        ValueError,
        ["ParquetDataset.load_state_dict", repr(state["catalog"]), repr(digest)],
    )


async def test_a_parquet_state_resumes_its_own_files_and_an_older_one_still_loads(
    tmp_path: Path,
) -> None:
    data = tmp_path / "t"
    parquet_dir(data)

    def make() -> ParquetDataset:
        return ParquetDataset(f"{data}/", shuffle=True, shuffle_buffer=4, row_groups_in_flight=2)

    whole = [int(row["id"]) for row in await collect(make())]
    head, state = await cut_at(make(), 7, "id")
    for loaded in (state, {k: v for k, v in state.items() if k != "catalog"}):
        ds = make()
        ds.load_state_dict(loaded)
        assert [int(i) for i in head] + [int(row["id"]) for row in await collect(ds)] == whole
