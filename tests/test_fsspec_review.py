"""FsspecDataset.stream at the start of an S3 object, Retry-After through fsspec, listings of
http(s) prefixes, and the stream of a filesystem without streamed files.

Against moto's S3 server and ``tests/http_server.py`` on 127.0.0.1. S3 faults are injected
inside the real client by a botocore ``before-call`` hook (as ``test_sources_fsspec.py`` does),
so s3fs and botocore handle them as they handle a real store's answers.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiobotocore.session
import pytest
from aiohttp import web
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.http import HTTPFileSystem
from helpers import Sleeps
from http_server import Fault, FaultServer, payload
from s3_server import moto_s3, s3_options

from aioloader._errors import RemoteNotFoundError, RetriesExhaustedError
from aioloader.sources import FsspecDataset, HTTPDataset, RetryPolicy, TarDataset, list_objects
from aioloader.sources._fsspec import list_fsspec

BUCKET = "aiol-review"
SIZE = 5000
FAST = RetryPolicy(max_attempts=3, backoff_initial=0.01, backoff_max=30.0, jitter=False)


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    with moto_s3({BUCKET: {f"obj-{i}": payload(i, SIZE) for i in range(4)}}) as endpoint:
        yield endpoint


class S3Faults:
    """A before-call hook: the first GetObject calls get ``errors`` (code, status, headers),
    in order, then moto answers."""

    def __init__(self, *errors: tuple[str, int, dict[str, str]]) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self, **_: Any) -> tuple[Any, dict[str, Any]] | None:
        self.calls += 1
        if self.calls > len(self.errors):
            return None
        code, status, headers = self.errors[self.calls - 1]
        http = types.SimpleNamespace(status_code=status, headers=headers, content=b"")
        return http, {
            "Error": {"Code": code, "Message": f"injected {code}"},
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": headers},
        }

    def options(self, endpoint: str) -> dict[str, Any]:
        session = aiobotocore.session.AioSession()
        session.register("before-call.s3.GetObject", self)
        return s3_options(endpoint, session=session)


async def streamed(ds: FsspecDataset, index: int = 0) -> bytes:
    got = bytearray()
    async with contextlib.aclosing(ds.stream(index, 1024)) as chunks:
        async for chunk in chunks:
            got += chunk
    return bytes(got)


# -- the start of a streamed S3 object is retried as fetch retries it -------------------------


async def test_a_slowdown_at_the_start_of_a_stream_is_retried(moto_endpoint: str) -> None:
    faults = S3Faults(("SlowDown", 503, {}), ("InternalError", 500, {}))
    sleeps = Sleeps()
    url = f"s3://{BUCKET}/obj-1"
    options = faults.options(moto_endpoint)
    async with FsspecDataset([url], retry=FAST, sleep=sleeps, storage_options=options) as ds:
        assert await streamed(ds) == payload(1, SIZE)
    assert faults.calls == 3
    assert sleeps == pytest.approx([0.01, 0.02])


async def test_slowdown_forever_at_the_start_of_a_stream_lists_every_attempt(
    moto_endpoint: str,
) -> None:
    faults = S3Faults(*[("SlowDown", 503, {})] * 5)
    url = f"s3://{BUCKET}/obj-2"
    options = faults.options(moto_endpoint)
    async with FsspecDataset([url], retry=FAST, sleep=Sleeps(), storage_options=options) as ds:
        with pytest.raises(RetriesExhaustedError) as info:
            await streamed(ds)
    assert faults.calls == 3
    assert all("SlowDown (HTTP 503)" in attempt for attempt in info.value.attempts)


async def test_a_missing_object_streamed_is_not_found_without_retry(moto_endpoint: str) -> None:
    url = f"s3://{BUCKET}/no-such-key"
    sleeps = Sleeps()
    options = s3_options(moto_endpoint)
    async with FsspecDataset([url], retry=FAST, sleep=sleeps, storage_options=options) as ds:
        with pytest.raises(RemoteNotFoundError, match="no-such-key"):
            await streamed(ds)
    assert sleeps == []


# -- Retry-After through fsspec ----------------------------------------------------------------


async def test_s3_retry_after_is_honoured(moto_endpoint: str) -> None:
    faults = S3Faults(("SlowDown", 503, {"retry-after": "7"}))
    sleeps = Sleeps()
    url = f"s3://{BUCKET}/obj-3"
    options = faults.options(moto_endpoint)
    async with FsspecDataset([url], retry=FAST, sleep=sleeps, storage_options=options) as ds:
        assert await ds.fetch(0) == payload(3, SIZE)
    assert sleeps == [7.0]


async def test_http_retry_after_through_fsspec_is_honoured() -> None:
    async with FaultServer() as server:
        server.fail("/obj/4", Fault.http(429, retry_after="5"), Fault.http(503, retry_after="3"))
        sleeps = Sleeps()
        async with FsspecDataset([server.obj_url(4)], retry=FAST, sleep=sleeps) as ds:
            assert await ds.fetch(0) == payload(4, server.size)
    assert sleeps == [5.0, 3.0]


async def test_a_status_outside_retry_statuses_is_final() -> None:
    async with FaultServer() as server:
        server.fail("/obj/5", Fault.http(522))
        sleeps = Sleeps()
        async with FsspecDataset([server.obj_url(5)], retry=FAST, sleep=sleeps) as ds:
            with pytest.raises(Exception, match="522"):
                await ds.fetch(0)
        assert server.count("/obj/5") == 1
    assert sleeps == []


# -- listings of http(s) prefixes keep one scheme ----------------------------------------------


@contextlib.asynccontextmanager
async def html_directory(names: list[str]) -> AsyncIterator[str]:
    """A server with ``names`` under ``/d/`` and an HTML page of links to them at ``/d``."""
    page = "".join(f'<a href="{name}">{name}</a> ' for name in names)

    async def listing(request: web.Request) -> web.Response:
        return web.Response(text=f"<html>{page}</html>", content_type="text/html")

    async def item(request: web.Request) -> web.Response:
        return web.Response(body=request.match_info["name"].encode())

    app = web.Application()
    app.router.add_get("/d", listing)
    app.router.add_get("/d/", listing)
    app.router.add_get("/d/{name}", item)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{int(runner.addresses[0][1])}/d/"
    finally:
        await runner.cleanup()


async def test_an_http_prefix_lists_urls_with_one_scheme() -> None:
    async with html_directory(["a.bin", "b.bin", "c.txt"]) as prefix:
        listed = await list_fsspec(prefix)
        globbed = await list_fsspec(prefix + "*.bin")
        async with FsspecDataset(globbed) as ds:
            bodies = [await ds.fetch(i) for i in range(len(ds))]
    assert listed == [prefix + name for name in ("a.bin", "b.bin", "c.txt")]
    assert globbed == [prefix + "a.bin", prefix + "b.bin"]
    assert bodies == [b"a.bin", b"b.bin"]


def test_listed_names_of_other_stores_get_their_protocol_back(moto_endpoint: str) -> None:
    names = list_objects(f"s3://{BUCKET}/", storage_options=s3_options(moto_endpoint))
    assert names == [f"s3://{BUCKET}/obj-{i}" for i in range(4)]


# -- a filesystem without streamed files: the object whole, without the fetch bound -----------


async def test_a_stream_without_open_async_is_read_whole_past_max_object_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The fault: a filesystem without streamed files (fsspec's default open_async).
    monkeypatch.setattr(HTTPFileSystem, "open_async", AsyncFileSystem.open_async)
    async with FaultServer() as server:
        url = server.obj_url(6, size=50_000)
        async with FsspecDataset([url], retry=FAST, max_object_bytes=1000) as ds:
            assert await streamed(ds) == payload(6, 50_000)
            with pytest.raises(Exception, match="max_object_bytes=1000"):
                await ds.fetch(0)  # fetch keeps its bound


# -- storage_options only where an fsspec filesystem takes them ------------------------------


@pytest.mark.parametrize(
    ("shards", "where"),
    [(["http://127.0.0.1/a.tar"], "http\\(s\\) URLs"), (["/tmp/a.tar"], "local files")],
)
def test_tar_storage_options_without_a_filesystem_are_refused(
    shards: list[str], where: str
) -> None:
    with pytest.raises(ValueError, match=f"keys \\['key'\\].*these shards are {where}") as info:
        TarDataset(shards, storage_options={"key": "S3CR3T"})
    assert "S3CR3T" not in str(info.value)


def test_tar_storage_options_beside_a_source_are_refused() -> None:
    source = HTTPDataset(["http://127.0.0.1/a.tar"])
    with pytest.raises(TypeError, match="storage_options or a source, not both"):
        TarDataset(None, source=source, storage_options={"anon": True})
