"""FsspecDataset against moto's S3-compatible server on 127.0.0.1, and fsspec's HTTP filesystem
against the fault-injecting test server.

S3 faults (SlowDown, InternalError, AccessDenied) are injected inside the real client: a
``before-call`` hook on the aiobotocore session answers the first GetObject calls with an S3
error response, and the rest go to moto. So s3fs's own error translation runs on them, and the
hook counts every GetObject the client made, including any retry s3fs would add on its own.
"""

from __future__ import annotations

import asyncio
import errno
import pickle
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiobotocore.session
import aiohttp
import botocore.exceptions
import pytest
from datasets import keep, tar_shard
from helpers import Sleeps
from http_server import Fault, FaultServer, payload
from hypothesis import given
from hypothesis import strategies as st
from s3_server import moto_s3, s3_options

from aioloader import DataLoader
from aioloader._errors import (
    RemoteError,
    RemoteNotFoundError,
    RemotePermissionError,
    RemoteTimeoutError,
    RetriesExhaustedError,
)
from aioloader.sources import (
    FsspecDataset,
    RetryableError,
    RetryPolicy,
    TarDataset,
    list_objects,
)
from aioloader.sources._classify import classify

BUCKET = "aiol-test"
OBJECTS = 20
SIZE = 3000
FAST = RetryPolicy(max_attempts=3, backoff_initial=0.01, backoff_max=1.0, jitter=False)


#: Tar shards in BUCKET beside the objects, under ``tars/``.
SHARDS = {f"tars/{shard}.tar": tar_shard(shard, 30, size=500) for shard in range(2)}

#: Keys that hold glob characters, under ``odd/``: objects like any other.
ODD = {f"odd/{name}": name.encode() for name in ("a?b.bin", "d*e.bin", "[x].bin", "plain.bin")}


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server on an ephemeral loopback port, with BUCKET holding OBJECTS objects
    (and SHARDS and ODD)."""
    objects = {f"obj-{i}": payload(i, SIZE) for i in range(OBJECTS)}
    with moto_s3({BUCKET: {**objects, **SHARDS, **ODD}}) as endpoint:
        yield endpoint


def urls(*indices: int) -> list[str]:
    return [f"s3://{BUCKET}/obj-{i}" for i in indices]


class S3Faults:
    """A before-call hook: the first GetObject calls get ``errors``, in order, then moto."""

    def __init__(self, *errors: tuple[str, int]) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self, **_: Any) -> tuple[Any, dict[str, Any]] | None:
        self.calls += 1
        if self.calls > len(self.errors):
            return None  # no answer: the request goes to the server
        code, status = self.errors[self.calls - 1]
        http = types.SimpleNamespace(status_code=status, headers={}, content=b"")
        return http, {
            "Error": {"Code": code, "Message": f"injected {code}"},
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": {}},
        }

    def session(self) -> aiobotocore.session.AioSession:
        session = aiobotocore.session.AioSession()
        session.register("before-call.s3.GetObject", self)
        return session


# -- reads ------------------------------------------------------------------------------------


async def test_reads_objects_concurrently(moto_endpoint: str) -> None:
    ds = FsspecDataset(urls(*range(OBJECTS)), storage_options=s3_options(moto_endpoint))
    async with ds:
        got = await asyncio.gather(*(ds.fetch(i) for i in range(len(ds))))
        assert "open_filesystems=1" in repr(ds)
    assert got == [payload(i, SIZE) for i in range(OBJECTS)]
    assert "open_filesystems=0" in repr(ds)


async def test_getitem_decodes(moto_endpoint: str) -> None:
    async with FsspecDataset(
        urls(4, 5), decode=len, storage_options=s3_options(moto_endpoint)
    ) as ds:
        assert await ds[1] == SIZE
        assert ds.protocol == "s3"


@pytest.mark.parametrize("url", [f"s3://{BUCKET}/missing", "s3://no-such-bucket/obj-0"])
async def test_missing_object_is_not_found_without_retry(moto_endpoint: str, url: str) -> None:
    faults = S3Faults()
    sleeps = Sleeps()
    ds = FsspecDataset(
        [url],
        retry=FAST,
        sleep=sleeps,
        storage_options=s3_options(moto_endpoint, session=faults.session()),
    )
    async with ds:
        with pytest.raises(RemoteNotFoundError) as info:
            await ds.fetch(0)
    assert isinstance(info.value, FileNotFoundError)
    assert url in str(info.value)
    assert info.value.url == url
    assert len(info.value.attempts) == 1
    assert faults.calls == 1
    assert sleeps == []


async def test_streamed_shards_count_their_bytes_in_the_statistics(moto_endpoint: str) -> None:
    # TarDataset reads S3 shards through FsspecDataset.stream, as it reads HTTP shards through
    # HTTPDataset.stream; both count what they read.
    ds = TarDataset(
        [f"s3://{BUCKET}/{key}" for key in SHARDS],
        decode=len,
        storage_options=s3_options(moto_endpoint),
    )
    async with DataLoader(ds, batch_size=10, collate_fn=keep) as loader:
        samples = [sample async for batch in loader for sample in batch]
        stats = loader.statistics()
    assert len(samples) == 60
    assert stats.remote_requests == len(SHARDS)
    # Every byte up to each shard's last member was read and counted; the zero padding of the
    # archive's last record may be left unread (the reader stops at the end-of-archive mark,
    # so how much of it arrived depends on where the last chunk ended).
    members = sum(len(shard.rstrip(b"\0")) for shard in SHARDS.values())
    assert members <= stats.bytes_read <= sum(map(len, SHARDS.values()))
    assert stats.epoch_stats.bytes_read == stats.bytes_read
    assert stats.epoch_stats.read_bytes_per_s > 0


def test_listed_keys_that_hold_glob_characters_are_read_as_objects(moto_endpoint: str) -> None:
    options = s3_options(moto_endpoint)
    odd = sorted(f"s3://{BUCKET}/{key}" for key in ODD)
    by_prefix = FsspecDataset.from_prefix(f"s3://{BUCKET}/odd/", storage_options=options)
    names = list_objects(f"s3://{BUCKET}/odd/", storage_options=options)
    listed = FsspecDataset(names, storage_options=options)
    assert by_prefix.urls == listed.urls == tuple(odd)

    async def read(ds: FsspecDataset) -> list[bytes]:
        async with ds:
            return [await ds.fetch(i) for i in range(len(ds))]

    copy = pickle.loads(pickle.dumps(by_prefix))  # as worker processes get it
    for ds in (by_prefix, listed, copy):
        assert asyncio.run(read(ds)) == [ODD[url.split("/", 3)[3]] for url in odd]
    # The same text typed by hand cannot be told from a glob without asking the store.
    with pytest.raises(ValueError, match="is a prefix or a glob"):
        FsspecDataset([f"s3://{BUCKET}/odd/a?b.bin"], storage_options=options)


# -- injected S3 faults -----------------------------------------------------------------------


async def test_slowdown_then_success_is_retried_exactly(moto_endpoint: str) -> None:
    faults = S3Faults(("SlowDown", 503), ("InternalError", 500))
    sleeps = Sleeps()
    ds = FsspecDataset(
        urls(7),
        retry=FAST,
        sleep=sleeps,
        storage_options=s3_options(moto_endpoint, session=faults.session()),
    )
    async with ds:
        assert await ds.fetch(0) == payload(7, SIZE)
    assert faults.calls == 3
    assert sleeps == pytest.approx([0.01, 0.02])


async def test_slowdown_forever_lists_every_attempt(moto_endpoint: str) -> None:
    faults = S3Faults(*[("SlowDown", 503)] * 10)
    ds = FsspecDataset(
        urls(1),
        retry=FAST,
        sleep=Sleeps(),
        storage_options=s3_options(moto_endpoint, session=faults.session()),
    )
    async with ds:
        with pytest.raises(RetriesExhaustedError) as info:
            await ds.fetch(0)
    # Three attempts of ours and no hidden ones: s3fs's and botocore's retries are off.
    assert faults.calls == 3
    assert len(info.value.attempts) == 3
    assert all("SlowDown (HTTP 503)" in line for line in info.value.attempts)
    assert urls(1)[0] in str(info.value)
    assert not isinstance(info.value, TimeoutError)


async def test_access_denied_is_a_permission_error_without_retry(moto_endpoint: str) -> None:
    faults = S3Faults(("AccessDenied", 403))
    ds = FsspecDataset(
        urls(2),
        retry=FAST,
        sleep=Sleeps(),
        storage_options=s3_options(moto_endpoint, session=faults.session()),
    )
    async with ds:
        with pytest.raises(RemotePermissionError) as info:
            await ds.fetch(0)
    assert isinstance(info.value, PermissionError)
    assert faults.calls == 1
    assert urls(2)[0] in str(info.value)


async def test_request_timeout_code_makes_a_timeout_error(moto_endpoint: str) -> None:
    faults = S3Faults(*[("RequestTimeout", 400)] * 3)
    ds = FsspecDataset(
        urls(2),
        retry=FAST,
        sleep=Sleeps(),
        storage_options=s3_options(moto_endpoint, session=faults.session()),
    )
    async with ds:
        with pytest.raises(RemoteTimeoutError):
            await ds.fetch(0)
    assert faults.calls == 3


# -- lifetime ---------------------------------------------------------------------------------


async def test_pickles_without_its_filesystem(moto_endpoint: str) -> None:
    ds = FsspecDataset(urls(0, 1), decode=len, storage_options=s3_options(moto_endpoint))
    async with ds:
        assert await ds[0] == SIZE
        clone = pickle.loads(pickle.dumps(ds))
        assert "open_filesystems=0" in repr(clone)
        async with clone:
            assert await clone.fetch(1) == payload(1, SIZE)


def test_separate_runs_each_get_a_filesystem(moto_endpoint: str) -> None:
    ds = FsspecDataset(urls(0, 1), storage_options=s3_options(moto_endpoint))

    async def read(i: int) -> bytes:
        async with ds:
            return await ds.fetch(i)

    assert asyncio.run(read(0)) == payload(0, SIZE)
    assert asyncio.run(read(1)) == payload(1, SIZE)


# -- fsspec's HTTP filesystem ------------------------------------------------------------------


async def test_http_through_fsspec_retries_and_maps_not_found() -> None:
    sleeps = Sleeps()
    async with FaultServer() as server:
        ds = FsspecDataset([server.obj_url(1), server.obj_url(2)], retry=FAST, sleep=sleeps)
        async with ds:
            server.fail("/obj/1", Fault.http(503), Fault.http(502))
            assert await ds.fetch(0) == payload(1)
            server.fail_always("/obj/2", Fault.http(404))
            with pytest.raises(RemoteNotFoundError):
                await ds.fetch(1)
    assert server.count("/obj/1") == 3
    assert server.count("/obj/2") == 1
    assert sleeps == pytest.approx([0.01, 0.02])


async def test_http_through_fsspec_size_retries_a_503_that_info_wraps_as_not_found() -> None:
    # fsspec's HTTP _info tries HEAD, then GET, and wraps any failure of both in
    # FileNotFoundError: a 503 must still be retried, and only a real 404 be "not found".
    sleeps = Sleeps()
    async with FaultServer() as server:
        ds = FsspecDataset([server.obj_url(1), server.obj_url(2)], retry=FAST, sleep=sleeps)
        async with ds:
            server.fail("/obj/1", Fault.http(503), Fault.http(503))
            assert await ds.size(0) == len(payload(1))
            assert server.count("/obj/1") == 3  # HEAD and GET of attempt 1, HEAD of attempt 2
            assert sleeps == pytest.approx([0.01])
            server.fail_always("/obj/2", Fault.http(404))
            with pytest.raises(RemoteNotFoundError) as info:
                await ds.size(1)
    assert len(info.value.attempts) == 1
    assert server.count("/obj/2") == 2  # HEAD and GET of the one attempt
    assert sleeps == pytest.approx([0.01])


class Ranges:
    """An async iterable dataset of byte ranges ``spans`` of object 0 of ``source``."""

    def __init__(self, source: FsspecDataset, spans: list[tuple[int, int]]) -> None:
        self.source = source
        self.spans = spans

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for start, end in self.spans:
            yield await self.source.fetch_range(0, start, end)


@pytest.mark.parametrize("honoured", [True, False])
async def test_ranged_reads_are_exact_whether_or_not_the_server_honours_range(
    honoured: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # A server that ignores Range answers 200 with the whole object: the range asked is cut
    # from it, and the statistics count every byte that came.
    spans = [(0, 100), (100, 4000), (4999, 5000)]
    async with FaultServer(ranges=honoured) as server:
        source = FsspecDataset([server.obj_url(3, size=5000)], retry=FAST, sleep=Sleeps())
        async with (
            source,
            DataLoader(Ranges(source, spans), batch_size=3, collate_fn=keep) as loader,
        ):
            (pieces,) = [batch async for batch in loader]
            stats = loader.statistics()
    whole = payload(3, 5000)
    assert pieces == [whole[a:b] for a, b in spans]
    assert stats.remote_requests == len(spans)
    assert stats.bytes_read == (sum(b - a for a, b in spans) if honoured else 3 * len(whole))
    # Ignored: each read also asks for the size (a HEAD), to be sure the body is all of it.
    assert server.count("/obj/3") == (3 if honoured else 6)
    warned = [r for r in caplog.records if "ignores Range" in r.getMessage()]
    assert len(warned) == (0 if honoured else 1)  # once per dataset


@pytest.mark.parametrize("honoured", [True, False])
async def test_a_range_answered_with_other_bytes_is_an_error_naming_what_came(
    honoured: bool,
) -> None:
    async with FaultServer(ranges=honoured) as server:
        url = server.obj_url(3, size=5000)
        async with FsspecDataset([url], retry=FAST, sleep=Sleeps()) as source:
            with pytest.raises(RemoteError) as info:
                await source.fetch_range(0, 4000, 6000)  # past the object's end
    received = 1000 if honoured else 5000
    assert str(info.value).startswith(
        f"{url}: asked for bytes 4000-6000 (2000 bytes) and received {received} bytes"
    )
    assert info.value.url == url
    assert len(info.value.attempts) == 1  # the same question gets the same answer
    assert server.count("/obj/3") == 1


async def test_http_through_fsspec_stall_is_a_timeout() -> None:
    timeout = aiohttp.ClientTimeout(sock_read=0.2)
    async with FaultServer() as server:
        ds = FsspecDataset(
            [server.obj_url(3)],
            retry=RetryPolicy(max_attempts=2, backoff_initial=0.01, jitter=False),
            sleep=Sleeps(),
            storage_options={"client_kwargs": {"timeout": timeout}},
        )
        server.fail_always("/obj/3", Fault.stall(30))
        async with ds:
            with pytest.raises(RemoteTimeoutError) as info:
                await ds.fetch(0)
    assert server.count("/obj/3") == 2
    assert len(info.value.attempts) == 2


# -- construction -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_urls", "match"),
    [
        (["bucket/key"], r"urls\[0\]='bucket/key' has no protocol"),
        (["nosuchproto://a/b"], r"urls\[0\]='nosuchproto://a/b'.*does not know"),
        (["s3://a/b", "gs://c/d"], r"urls\[1\]='gs://c/d' is a 'gs' URL"),
        (["memory://a/b"], r"urls\[0\]='memory://a/b'.*not asynchronous"),
    ],
)
def test_bad_urls_are_refused_at_construction(given_urls: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FsspecDataset(given_urls)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="storage_options"):
        FsspecDataset(["s3://a/b"], storage_options=[("anon", True)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="retry"):
        FsspecDataset(["s3://a/b"], retry=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="item_deadline"):
        FsspecDataset(["s3://a/b"], item_deadline=-1)
    assert len(FsspecDataset([])) == 0


# -- classification of backend errors ----------------------------------------------------------


def client_error(code: str, status: int) -> botocore.exceptions.ClientError:
    response: Any = {"Error": {"Code": code, "Message": code}}
    response["ResponseMetadata"] = {"HTTPStatusCode": status}
    return botocore.exceptions.ClientError(response, "GetObject")


def translated(code: str, status: int) -> Exception:
    from s3fs.errors import translate_boto_error

    error: Exception = translate_boto_error(client_error(code, status))
    return error


def http_error(status: int) -> aiohttp.ClientResponseError:
    info: Any = types.SimpleNamespace(real_url="http://x", method="GET")
    return aiohttp.ClientResponseError(info, (), status=status)


def wrapped(inner: Exception) -> Exception:
    """``inner`` wrapped as fsspec's HTTP ``_info`` wraps every failure."""
    try:
        raise FileNotFoundError("http://x") from inner
    except FileNotFoundError as exc:
        return exc


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda: translated("SlowDown", 503), "retry"),
        (lambda: translated("ServiceUnavailable", 503), "retry"),
        (lambda: translated("InternalError", 500), "retry"),
        (lambda: translated("NoSuchKey", 404), "missing"),
        (lambda: translated("AccessDenied", 403), "denied"),
        (lambda: translated("InvalidRange", 416), "final"),
        (lambda: client_error("Throttling", 400), "retry"),
        (lambda: OSError(errno.EBUSY, "busy"), "retry"),
        (lambda: botocore.exceptions.EndpointConnectionError(endpoint_url="http://x"), "retry"),
        (lambda: botocore.exceptions.ReadTimeoutError(endpoint_url="http://x"), "timeout"),
        (lambda: aiohttp.ServerDisconnectedError(), "retry"),
        (lambda: aiohttp.ClientPayloadError("short"), "retry"),
        (lambda: TimeoutError(), "timeout"),
        (lambda: FileNotFoundError("x"), "missing"),
        (lambda: wrapped(http_error(503)), "retry"),
        (lambda: wrapped(http_error(429)), "retry"),
        (lambda: wrapped(aiohttp.ServerDisconnectedError()), "retry"),
        (lambda: wrapped(TimeoutError()), "timeout"),
        (lambda: wrapped(http_error(404)), "missing"),
        (lambda: wrapped(http_error(400)), "missing"),
        (lambda: wrapped(ValueError("bad URL")), "missing"),
        (lambda: PermissionError("x"), "denied"),
        (lambda: ValueError("a bug"), "final"),
        (lambda: KeyError("a bug"), "final"),
    ],
)
def test_classify(make: Any, kind: str) -> None:
    result = classify(make(), "s3://b/k", FAST)
    if kind == "final":
        assert result is None
    elif kind == "missing":
        assert isinstance(result, RemoteNotFoundError)
        assert result.url == "s3://b/k"
    elif kind == "denied":
        assert isinstance(result, RemotePermissionError)
    else:
        assert isinstance(result, RetryableError)
        assert result.timed_out == (kind == "timeout")


@given(status=st.integers(100, 599), retry=st.sets(st.sampled_from([408, 429, 500, 503, 599])))
def test_classify_http_statuses_follows_the_policy(status: int, retry: set[int]) -> None:
    policy = RetryPolicy(retry_statuses=frozenset(retry))
    result = classify(http_error(status), "http://x", policy)
    if status == 404:
        assert isinstance(result, RemoteNotFoundError)
    elif status in (401, 403):
        assert isinstance(result, RemotePermissionError)
    elif status in retry:
        assert isinstance(result, RetryableError)
    else:
        assert result is None
