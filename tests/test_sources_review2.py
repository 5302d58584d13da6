"""A second review's findings in the sources: masking that must not fail itself, passwords
with an unescaped ``#``, ``/`` or ``?``, TarDataset's arguments (an empty
``storage_options``, a value that is no mapping, a directory given alone), the digests a
resume compares (shards told apart by their query, the same shards at another mount,
presigned URLs signed again, also for Parquet), headers given as pairs, and the size of
the fsspec stream's first read, the one ``item_deadline`` bounds.

Servers are real, on 127.0.0.1 (``tests/http_server.py``); an exception's broken property
or ``__str__``, and a spy on fsspec's file reads, are the faults injected.
"""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, cast

import pytest
from datasets import parquet_bytes, tar_shard
from fsspec.implementations.http import AsyncStreamFile
from helpers import BOUND_S, assert_raises_naming
from http_server import FaultServer, payload

from aioloader.sources import (
    FsspecDataset,
    HTTPDataset,
    ParquetDataset,
    RetryPolicy,
    TarDataset,
)
from aioloader.sources._fsspec import FIRST_READ
from aioloader.sources._redact import MaskedError, masked, redact
from aioloader.sources._retry import Attempts

SECRET = "s3cr3tVALUE"


# -- masked() never fails itself ---------------------------------------------------------------


class RequestUnset(Exception):
    """As httpx's errors: ``.request`` raises while it is not set."""

    @property
    def request(self) -> Any:
        raise RuntimeError("The .request property has not been set.")


class BrokenStr(Exception):
    request = "kept"  # a request kept: always stood in for

    def __str__(self) -> str:
        raise ValueError("broken __str__")


def test_masking_an_error_whose_request_property_raises_stands_in_masked() -> None:
    error = RequestUnset(f"GET https://h/x?token={SECRET} failed")
    shown = masked(error)  # raised RuntimeError before
    assert isinstance(shown, MaskedError)
    assert SECRET not in "".join(traceback.format_exception(shown))
    assert "RequestUnset" in str(shown)


def test_masking_an_error_whose_str_raises_stands_in_without_failing() -> None:
    shown = masked(BrokenStr(SECRET))
    assert isinstance(shown, MaskedError)
    assert "BrokenStr" in str(shown)
    assert SECRET not in "".join(traceback.format_exception(shown))


@pytest.mark.parametrize("kind", [RequestUnset, BrokenStr])
def test_a_final_failure_that_cannot_be_read_is_said_masked(kind: type[Exception]) -> None:
    # What retrying() does with a failure it does not retry: the error it returns stands in
    # for it (a RemoteError over its masked stand-in), never a failure of the masking.
    attempts = Attempts(RetryPolicy(), f"https://h/x?token={SECRET}")
    failure = kind(f"GET https://h/x?token={SECRET} failed")
    shown = attempts.final(failure, attempts.begin())
    assert shown is not failure
    assert isinstance(shown.__cause__, MaskedError)
    assert kind.__name__ in str(shown)
    assert SECRET not in "".join(traceback.format_exception(shown))


# -- passwords with an unescaped '#', '/' or '?' -------------------------------------------------


@pytest.mark.parametrize("cut", ["#", "/", "?"])
def test_a_password_with_an_unescaped_delimiter_is_refused_masked(cut: str) -> None:
    url = f"https://alice:s3c{cut}{SECRET}@127.0.0.1:9/x.bin"
    with pytest.raises(ValueError, match="percent-encode") as caught:
        HTTPDataset([url])
    message = str(caught.value)
    assert "urls[0]" in message
    for secret in (SECRET, "s3c", "alice"):
        assert secret not in message
    assert "127.0.0.1:9/x.bin" in message  # which URL, after the last '@'
    with pytest.raises(ValueError, match="percent-encode"):
        TarDataset([url.replace("x.bin", "a.tar")])


@pytest.mark.parametrize("cut", ["#", "/", "?"])
def test_redact_masks_a_password_with_an_unescaped_delimiter(cut: str) -> None:
    shown = redact(f"failed: https://alice:s3c{cut}{SECRET}@127.0.0.1:9/x.bin (3 attempts)")
    assert "s3c" not in shown
    assert shown == "failed: https://alice:REDACTED@127.0.0.1:9/x.bin (3 attempts)"


@pytest.mark.parametrize(
    "url",
    [
        "https://127.0.0.1:8080/a@b/x.bin",  # an '@' in a path after a port
        "https://127.0.0.1/p@th/x.bin",
        "https://u:pw@127.0.0.1:8080/x.bin",
    ],
)
def test_urls_with_an_at_sign_elsewhere_are_still_accepted(url: str) -> None:
    assert HTTPDataset([url]).urls == (url,)
    assert redact("https://127.0.0.1:8080/a@b/x.bin") == "https://127.0.0.1:8080/a@b/x.bin"


# -- TarDataset's arguments ------------------------------------------------------------------


@pytest.mark.parametrize("shards", [["https://127.0.0.1/a.tar"], ["/tmp/a.tar"]])
def test_an_empty_storage_options_is_none(shards: list[str]) -> None:
    assert TarDataset(shards, storage_options={}).urls == tuple(shards)


@pytest.mark.parametrize(
    ("options", "kind"), [(f"hf_{SECRET}", "str"), ([("token", SECRET)], "list")]
)
def test_storage_options_that_is_no_mapping_is_named_by_its_type_only(
    options: Any, kind: str
) -> None:
    for shards in (["https://127.0.0.1/a.tar"], ["s3://bucket/a.tar"]):
        with pytest.raises(TypeError) as caught:
            TarDataset(shards, storage_options=options)
        message = str(caught.value)
        assert (
            f"storage_options must be a mapping of the fsspec filesystem's options, got a {kind}"
            == message
        )
        assert "'t'" not in message


def test_a_directory_given_alone_is_refused_as_file_dataset_does(tmp_path: Path) -> None:
    (tmp_path / "a.tar").write_bytes(tar_shard(0, 3))
    for given in (str(tmp_path), tmp_path):
        assert_raises_naming(
            lambda given=given: TarDataset(given),  # type: ignore[misc]
            ValueError,
            [str(tmp_path), "is a directory", "FileDataset.from_prefix"],
        )
    # In a list, and one file given alone, as before.
    assert TarDataset(str(tmp_path / "a.tar")).urls == (str(tmp_path / "a.tar"),)


# -- headers given as pairs --------------------------------------------------------------------


def test_headers_given_as_pairs_are_named_by_their_type_only() -> None:
    with pytest.raises(TypeError) as caught:
        HTTPDataset(
            ["https://127.0.0.1/x"],
            headers=[("Authorization", f"Bearer {SECRET}")],  # type: ignore[arg-type]
        )
    message = str(caught.value)
    assert message == "headers must be a mapping of str to str, got a list"


# -- what a resume compares --------------------------------------------------------------------


def test_shards_told_apart_by_their_query_are_other_shards() -> None:
    def urls(split: str) -> list[str]:
        return [f"https://api.example.com/download?file={split}-{i:04d}.tar" for i in range(4)]

    state = TarDataset(urls("train"), shards_in_flight=2).state_dict()
    TarDataset(urls("train"), shards_in_flight=2).load_state_dict(state)
    for others in (urls("eval"), urls("train")[::-1]):
        with pytest.raises(ValueError, match="other shards") as caught:
            TarDataset(others, shards_in_flight=2).load_state_dict(state)
        assert '"shard_list" to None' in str(caught.value)  # the way around it, named


def test_presigned_and_expiring_parameters_do_not_count_others_do() -> None:
    def signed(stamp: str, part: str = "a") -> list[str]:
        return [
            f"https://b.example/t-{i}.tar?part={part}&X-Amz-Date={stamp}&X-Amz-Expires=60"
            f"&X-Amz-Credential=K{stamp}&X-Amz-Signature={stamp}&Expires={stamp}"
            f"&sig={stamp}&se={stamp}&token={stamp}"
            for i in range(3)
        ]

    state = TarDataset(signed("1"), shards_in_flight=2).state_dict()
    TarDataset(signed("2"), shards_in_flight=2).load_state_dict(state)  # signed again
    with pytest.raises(ValueError, match="other shards"):
        TarDataset(signed("1", part="b"), shards_in_flight=2).load_state_dict(state)


def test_the_same_shards_at_another_mount_or_mirror_resume() -> None:
    names = [f"train-{i:04d}.tar" for i in range(4)]
    state = TarDataset([f"/mnt/nodeA/data/{n}" for n in names]).state_dict()
    TarDataset([f"/scratch/job42/data/{n}" for n in names]).load_state_dict(state)
    remote = TarDataset([f"https://a.example/ds/{n}" for n in names]).state_dict()
    TarDataset([f"https://mirror.example/x/ds/{n}" for n in names]).load_state_dict(remote)
    with pytest.raises(ValueError, match="other shards"):
        TarDataset([f"/scratch/job42/data/{n}" for n in names[::-1]]).load_state_dict(state)


def parquet_server(server: FaultServer) -> None:
    for i in range(2):
        server.files[f"p{i}.parquet"] = parquet_bytes(i, 20, 5)


async def cut_at(dataset: Any, n: int) -> dict[str, Any]:
    epoch = cast(AsyncGenerator[Any, None], aiter(dataset))
    async with asyncio.timeout(BOUND_S), contextlib.aclosing(epoch) as records:
        for _ in range(n):
            await anext(records)
    return cast(dict[str, Any], dataset.state_dict())


async def test_parquet_resumes_from_presigned_urls_signed_again() -> None:
    with FaultServer().in_thread() as served:
        parquet_server(served)

        def signed(stamp: str) -> list[str]:
            return [
                served.file_url(f"p{i}.parquet") + f"?X-Amz-Date={stamp}&X-Amz-Signature={stamp}"
                for i in range(2)
            ]

        saved = ParquetDataset(signed("1"))
        state = await cut_at(saved, 7)
        await saved.aclose()
        resumed = ParquetDataset(signed("2"))
        try:
            resumed.load_state_dict(state)
            async with asyncio.timeout(BOUND_S):
                rest = [row async for row in resumed]
        finally:
            await resumed.aclose()
    assert len(rest) == 40 - 7


# -- the fsspec stream's first read, under item_deadline ---------------------------------------


async def test_the_first_read_of_an_fsspec_stream_is_small(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first read is retried and bounded by item_deadline with the opening: it asks for
    # FIRST_READ bytes at most, not a whole chunk, so the deadline bounds the opening and the
    # first bytes rather than a megabyte's transfer. A spy on the file's reads records what
    # each asks for; the stream's bytes are the object's all the same.
    asked: list[int] = []
    read = AsyncStreamFile.read

    async def spy(self: Any, num: int = -1) -> Any:
        asked.append(num)
        return await read(self, num)

    monkeypatch.setattr(AsyncStreamFile, "read", spy)
    size = 3 << 20
    async with FaultServer() as server:
        url = server.obj_url(4, size=size)
        async with FsspecDataset([url], item_deadline=BOUND_S) as ds:
            got = bytearray()
            async with asyncio.timeout(BOUND_S), contextlib.aclosing(ds.stream(0)) as chunks:
                async for chunk in chunks:
                    got += chunk
    assert bytes(got) == payload(4, size)
    assert FIRST_READ < 1 << 20
    assert asked[0] == FIRST_READ, asked[:3]
    assert max(asked) == 1 << 20  # the rest in whole chunks
