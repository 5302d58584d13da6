"""ParquetDataset: rows of local files and of a moto S3 server, row groups as the unit of
sharding and shuffling, exact resume, and clear errors for missing and corrupt files.

Files are tiny (a few rows per row group), so each test takes well under a second of its own;
the loader tests with worker processes are the slow part.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from datasets import keep, parquet_bytes, parquet_row
from helpers import assert_raises_naming
from http_server import FaultServer
from hypothesis import given, settings
from hypothesis import strategies as st
from s3_server import moto_s3, s3_options

import aioloader
from aioloader import DataLoader, RemoteNotFoundError, ShardError
from aioloader.sources import BrokenRowGroup, ParquetDataset

#: Rows per file: uneven, so files have different numbers of row groups (of 3 rows, the last
#: one shorter): 2, 3, 1 and 3 row groups, 24 rows in all.
ROWS = (5, 7, 3, 9)
GROUP = 3


def write_files(directory: Path) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for file, rows in enumerate(ROWS):
        path = directory / f"part-{file:03d}.parquet"
        path.write_bytes(parquet_bytes(file, rows, GROUP))
        paths.append(str(path))
    return paths


def every_id(files: int = len(ROWS)) -> list[int]:
    return [file * 1000 + i for file in range(files) for i in range(ROWS[file])]


def groups_of(ids: list[int]) -> dict[tuple[int, int], int]:
    """Rows per (file, row group) among ``ids``."""
    out: dict[tuple[int, int], int] = {}
    for i in ids:
        key = (i // 1000, i % 1000 // GROUP)
        out[key] = out.get(key, 0) + 1
    return out


def group_size(file: int, group: int) -> int:
    return min(GROUP, ROWS[file] - group * GROUP)


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    return write_files(tmp_path / "data")


async def raw_ids(dataset: ParquetDataset) -> list[int]:
    return [int(row["id"]) async for row in dataset]


def ids_of(batches: list[list[dict[str, Any]]]) -> list[int]:
    return [row["id"] for batch in batches for row in batch]


# -- the dataset on its own ------------------------------------------------------------------


async def test_every_row_arrives_once_as_a_dict_of_its_columns(tmp_path: Path) -> None:
    paths = write_files(tmp_path / "data")
    (tmp_path / "data" / "_SUCCESS").write_bytes(b"")  # left out of a directory's listing
    ds = ParquetDataset(tmp_path / "data", row_groups_in_flight=2)
    rows = [row async for row in ds]
    assert ds.files == tuple(paths)
    assert sorted(int(r["id"]) for r in rows) == every_id()
    row = next(r for r in rows if r["id"] == 1005)
    assert set(row) == {"id", "emb", "tag", "vec"}
    assert isinstance(row["id"], np.int64)  # numbers keep their dtype
    assert row["emb"].dtype == np.float32
    assert row["emb"].tolist() == [1005.0, -1005.0]
    assert row["vec"].tolist() == [5.0, 5.0]  # a list of numbers: an array of its length
    assert row["tag"] == "f1r5"
    plain = [int(r["id"]) for r in rows]
    assert plain[:4] == [0, 3, 1, 4]  # round-robin between the open row groups, in order
    await ds.aclose()


async def test_a_large_row_group_is_made_rows_a_slice_at_a_time_intact(tmp_path: Path) -> None:
    path = tmp_path / "big.parquet"
    path.write_bytes(parquet_bytes(0, 600, 600))  # one row group, three slices of rows
    rows = [row async for row in ParquetDataset(path)]
    assert [int(r["id"]) for r in rows] == list(range(600))
    assert all(r["vec"].tolist() == [float(i)] * (i % 3) for i, r in enumerate(rows))
    assert all(r["emb"].tolist() == [i, -i] for i, r in enumerate(rows))


async def test_columns_selects_what_is_read(files: list[str]) -> None:
    rows = [row async for row in ParquetDataset(files, columns=["tag", "id"])]
    assert all(set(row) == {"tag", "id"} for row in rows)
    assert len(rows) == len(every_id())
    missing = ParquetDataset(files, columns=["id", "nope"])
    with pytest.raises(ValueError, match=r"has no column 'nope'") as info:
        await raw_ids(missing)
    assert files[0] in str(info.value)


async def test_shuffling_depends_on_seed_and_epoch_only(files: list[str]) -> None:
    def make(seed: int) -> ParquetDataset:
        return ParquetDataset(files, shuffle=True, shuffle_buffer=5, seed=seed)

    a, b = make(0), make(0)
    first, second = await raw_ids(a), await raw_ids(a)  # epochs 0 and 1
    assert first == await raw_ids(b)
    assert first != second
    assert sorted(first) == sorted(second) == every_id()
    assert first != await raw_ids(make(1))
    a.set_epoch(0)
    assert await raw_ids(a) == first


async def test_ranks_read_whole_row_groups_each_once(files: list[str]) -> None:
    shares = []
    for rank in range(2):
        ds = ParquetDataset(files, shuffle=True, seed=3, row_groups_in_flight=2)
        ds.set_rank(rank, 2)
        shares.append(await raw_ids(ds))
    assert sorted(shares[0] + shares[1]) == every_id()
    for share in shares:  # whole row groups: a rank has all of a row group's rows or none
        for (file, group), n in groups_of(share).items():
            assert n == group_size(file, group)


@settings(max_examples=10, deadline=None)
@given(cut=st.integers(0, 24), slots=st.integers(1, 3), buffer=st.sampled_from([0, 4, 40]))
def test_a_state_resumes_exactly_where_any_cut_left_off(
    tmp_path_factory: pytest.TempPathFactory, cut: int, slots: int, buffer: int
) -> None:
    asyncio.run(resume_at(shared_files(tmp_path_factory), cut, slots, buffer))


async def resume_at(paths: list[str], cut: int, slots: int, buffer: int) -> None:
    options: dict[str, Any] = {"row_groups_in_flight": slots, "seed": 5}
    if buffer:
        options.update(shuffle=True, shuffle_buffer=buffer)
    ds = ParquetDataset(paths, **options)
    ds.set_epoch(1)
    full = await raw_ids(ds)
    assert sorted(full) == every_id()
    ds.set_epoch(1)
    it = aiter(ds)
    head = [int((await anext(it))["id"]) for _ in range(cut)]
    state = ds.state_dict()
    await it.aclose()  # type: ignore[attr-defined]
    resumed = ParquetDataset(paths, **options)  # a new process: lists and reads footers again
    resumed.load_state_dict(state)
    assert head + await raw_ids(resumed) == full
    assert resumed.state_dict()["epoch"] == 2  # the epoch ran to its end


_SHARED: dict[str, list[str]] = {}


def shared_files(factory: pytest.TempPathFactory) -> list[str]:
    """The four files, written once per session, for the Hypothesis examples."""
    if "paths" not in _SHARED:
        _SHARED["paths"] = write_files(factory.mktemp("parquet"))
    return _SHARED["paths"]


async def test_a_state_of_other_data_or_settings_is_refused(tmp_path: Path) -> None:
    files = write_files(tmp_path / "a")
    state = ParquetDataset(files, shuffle=True, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1, this dataset has seed=2"):
        ParquetDataset(files, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="lacks"):
        ParquetDataset(files).load_state_dict({"epoch": 0})
    ds = ParquetDataset(files)
    it = aiter(ds)
    await anext(it)
    state = ds.state_dict()
    await it.aclose()  # type: ignore[attr-defined]
    fewer = ParquetDataset(files[1:])
    fewer.load_state_dict(state)  # the row groups are known once the iteration starts ...
    with pytest.raises(ValueError, match="row_groups=9, and the files have 7 now"):
        await raw_ids(fewer)  # ... and must be the same


@pytest.mark.parametrize(
    ("kwargs", "error", "needles"),
    [
        ({"row_groups_in_flight": 0}, ValueError, ["row_groups_in_flight", "0"]),
        ({"shuffle_buffer": -1}, ValueError, ["shuffle_buffer", "-1"]),
        ({"decode": 3}, TypeError, ["decode", "3"]),
        ({"seed": "x"}, TypeError, ["seed", "'x'"]),
        ({"columns": "id"}, TypeError, ["columns", "'id'"]),
        ({"columns": [1]}, TypeError, ["columns[0]", "1"]),
        ({"retry": 3}, TypeError, ["retry", "3"]),
    ],
)
def test_bad_arguments_are_named(
    files: list[str], kwargs: dict[str, Any], error: type[Exception], needles: list[str]
) -> None:
    assert_raises_naming(lambda: ParquetDataset(files, **kwargs), error, needles)


def test_without_pyarrow_the_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"pip install 'aioloader\[parquet\]'"):
        ParquetDataset("x.parquet")


# -- errors ------------------------------------------------------------------------------------


async def test_a_missing_path_is_an_error_naming_it(files: list[str], tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere" / "*.parquet")
    with pytest.raises(FileNotFoundError, match="no files match") as info:
        await raw_ids(ParquetDataset([files[0], missing]))
    assert missing in str(info.value)


def corrupt_row_group(path: str, group: int) -> None:
    """Overwrite the first page header of ``group``'s first column chunk with garbage."""
    column = pq.read_metadata(path).row_group(group).column(0)
    data = bytearray(Path(path).read_bytes())
    start = column.data_page_offset
    if column.has_dictionary_page:
        start = column.dictionary_page_offset
    data[start : start + 16] = b"\xff" * 16
    Path(path).write_bytes(bytes(data))


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_corrupt_row_group_is_named_or_skipped(files: list[str], on_error: str) -> None:
    corrupt_row_group(files[1], 1)
    ds = ParquetDataset(files, decode=parquet_row)
    options: dict[str, Any] = {"on_error": on_error}
    if on_error == "skip":
        options["max_failures"] = 1
    with DataLoader(ds, batch_size=4, collate_fn=keep, **options) as loader:
        if on_error == "raise":
            with pytest.raises(ShardError, match=f"Parquet file {files[1]} failed at row group 1"):
                list(loader)
            return
        ids = ids_of(list(loader))
        assert loader.statistics().skipped_count == 1
    assert sorted(ids) == [i for i in every_id() if i // 1000 != 1 or i % 1000 // GROUP != 1]


async def test_a_file_that_is_not_parquet_is_a_shard_error_naming_it(files: list[str]) -> None:
    await asyncio.to_thread(Path(files[2]).write_bytes, b"not a parquet file at all")
    raws = [raw async for raw in ParquetDataset(files)]
    broken = [raw for raw in raws if isinstance(raw, BrokenRowGroup)]
    assert len(broken) == 1
    assert len(raws) == len(every_id()) - ROWS[2] + 1  # the rest is read
    error = broken[0].error()
    assert (error.url, error.row_group) == (files[2], None)
    assert f"Parquet file {files[2]} failed at its footer" in str(error)
    with pytest.raises(ShardError, match="footer"):
        ParquetDataset(files).decode(broken[0])


# -- through the loader ------------------------------------------------------------------------


@pytest.mark.slow
def test_workers_decode_and_resume_is_exact_under_another_number_of_workers(
    files: list[str],
) -> None:
    def loader(workers: int) -> DataLoader:
        ds = ParquetDataset(files, decode=parquet_row, shuffle=True, shuffle_buffer=6, seed=9)
        return DataLoader(ds, batch_size=3, num_workers=workers, collate_fn=keep, prefetch=4)

    with loader(0) as whole:
        full = ids_of(list(whole))
    assert sorted(full) == every_id()
    with loader(2) as stopped:
        it = iter(stopped)
        head = [next(it) for _ in range(3)]
        state = stopped.state_dict()
    assert os.getpid() not in {row["pid"] for batch in head for row in batch}  # in workers
    with loader(0) as resumed:
        resumed.load_state_dict(state)
        assert ids_of(head) + ids_of(list(resumed)) == full


def test_default_collate_stacks_numbers_and_embeddings(files: list[str]) -> None:
    ds = ParquetDataset(files[:1], columns=["id", "emb", "tag"])
    with DataLoader(ds, batch_size=4) as loader:
        batch = next(iter(loader))
    assert batch["id"].tolist() == [0, 3, 1, 4]
    assert tuple(batch["emb"].shape) == (4, 2)
    assert batch["tag"] == ["f0r0", "f0r3", "f0r1", "f0r4"]


# -- HTTP --------------------------------------------------------------------------------------


@pytest.mark.parametrize("honoured", [True, False])
async def test_http_files_read_exactly_whether_or_not_the_server_honours_range(
    honoured: bool,
) -> None:
    # Footers and column chunks are byte ranges; a server that ignores Range sends the whole
    # file each time, and the ranges are cut from it (before, pyarrow got the wrong bytes).
    async with FaultServer(ranges=honoured) as server:
        for file, rows in enumerate(ROWS):
            server.files[f"part-{file}.parquet"] = parquet_bytes(file, rows, GROUP)
        urls = [server.file_url(f"part-{file}.parquet") for file in range(len(ROWS))]
        ds = ParquetDataset(urls, columns=["id", "vec"], shuffle=True)
        raws = [raw async for raw in ds]
        await ds.aclose()
    assert not [raw for raw in raws if isinstance(raw, BrokenRowGroup)]
    assert sorted(int(raw["id"]) for raw in raws) == every_id()
    for raw in raws:
        assert raw["vec"].tolist() == [float(raw["id"] % 1000)] * (raw["id"] % 1000 % 3)


# -- S3 (moto) ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto_parquet() -> Iterator[str]:
    objects = {
        f"train/part-{f:03d}.parquet": parquet_bytes(f, n, GROUP) for f, n in enumerate(ROWS)
    }
    objects["train/_SUCCESS"] = b""
    objects["broken/part-000.parquet"] = parquet_bytes(0, ROWS[0], GROUP)
    objects["broken/part-001.parquet"] = b"PAR1 and then not a Parquet file"
    objects["odd/x?y.parquet"] = parquet_bytes(0, ROWS[0], GROUP)  # keys that look like globs
    objects["odd/[1]*.parquet"] = parquet_bytes(1, ROWS[1], GROUP)
    with moto_s3({"tables": objects}) as endpoint:
        yield endpoint


@pytest.mark.parametrize("pattern", ["s3://tables/train/", "s3://tables/train/*.parquet"])
def test_s3_prefixes_and_globs_through_moto(moto_parquet: str, pattern: str) -> None:
    ds = ParquetDataset(
        pattern,
        decode=parquet_row,
        shuffle=True,
        storage_options=s3_options(moto_parquet),
        row_groups_in_flight=3,
    )
    with DataLoader(ds, batch_size=5, collate_fn=keep) as loader:
        first, second = ids_of(list(loader)), ids_of(list(loader))
    assert sorted(first) == sorted(second) == every_id()
    assert first != second
    assert ds.files == tuple(f"s3://tables/train/part-{f:03d}.parquet" for f in range(4))


async def test_s3_columns_are_read_from_their_byte_ranges_alone(moto_parquet: str) -> None:
    ds = ParquetDataset(
        "s3://tables/train/", columns=["vec", "id"], storage_options=s3_options(moto_parquet)
    )
    rows = [row async for row in ds]
    await ds.aclose()
    assert sorted(int(r["id"]) for r in rows) == every_id()
    for row in rows:
        assert set(row) == {"vec", "id"}
        assert row["vec"].tolist() == [float(row["id"] % 1000)] * (row["id"] % 1000 % 3)


async def test_s3_keys_that_hold_glob_characters_are_files_like_any_other(
    moto_parquet: str,
) -> None:
    ds = ParquetDataset("s3://tables/odd/", storage_options=s3_options(moto_parquet))
    raws = [raw async for raw in ds]
    await ds.aclose()
    assert not [raw for raw in raws if isinstance(raw, BrokenRowGroup)]
    assert sorted(int(raw["id"]) for raw in raws) == every_id(2)
    assert ds.files == ("s3://tables/odd/[1]*.parquet", "s3://tables/odd/x?y.parquet")


async def test_an_s3_object_that_is_not_parquet_is_a_shard_error_naming_it(
    moto_parquet: str,
) -> None:
    ds = ParquetDataset("s3://tables/broken/", storage_options=s3_options(moto_parquet))
    raws = [raw async for raw in ds]
    await ds.aclose()
    assert sorted(int(r["id"]) for r in raws if isinstance(r, dict)) == every_id(1)
    (broken,) = [r for r in raws if isinstance(r, BrokenRowGroup)]
    error = broken.error()
    assert (error.url, error.row_group) == ("s3://tables/broken/part-001.parquet", None)
    assert "not a Parquet file" in str(error)


async def test_a_missing_s3_prefix_is_an_error_naming_it(moto_parquet: str) -> None:
    url = "s3://tables/nothing-here/"
    ds = ParquetDataset(url, storage_options=s3_options(moto_parquet))
    with pytest.raises(RemoteNotFoundError) as info:
        await raw_ids(ds)
    assert url.rstrip("/") in str(info.value)
    await ds.aclose()


def test_exported() -> None:
    assert aioloader.sources.ParquetDataset is ParquetDataset
    assert aioloader.sources.BrokenRowGroup is BrokenRowGroup
