"""HTTPDataset and the retry machinery, against a real aiohttp server on 127.0.0.1.

Each fault of RELIABILITY.md rows 14-17 is injected by ``tests/http_server.py`` and the tests
assert the exact number of requests the server saw, the error type and message, and the waits
between attempts (recorded through the injectable ``sleep``, so no test waits for a backoff).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import hashlib
import logging
import math
import os
import pickle
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from helpers import Sleeps, collect, notes_of, until
from http_server import Fault, FaultServer, payload
from hypothesis import given
from hypothesis import strategies as st

import aioloader
import aioloader.sources as sources
from aioloader._errors import (
    RemoteError,
    RemoteNotFoundError,
    RemotePermissionError,
    RemoteTimeoutError,
    RetriesExhaustedError,
)
from aioloader._stats._counters import Counters, current_counters
from aioloader.sources import HTTPDataset, RetryableError, RetryPolicy, parse_retry_after, retrying

FAST = RetryPolicy(max_attempts=3, backoff_initial=0.01, backoff_max=1.0, jitter=False)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def dataset(server: FaultServer, indices: range | list[int], **kwargs: Any) -> HTTPDataset:
    kwargs.setdefault("retry", FAST)
    return HTTPDataset([server.obj_url(i) for i in indices], **kwargs)


# -- success ---------------------------------------------------------------------------------


async def test_many_concurrent_fetches_return_the_right_bytes() -> None:
    sizes = [0, 1, 1000, 70_000, 300_000]
    async with FaultServer() as server:
        urls = [server.obj_url(i, size=sizes[i % len(sizes)]) for i in range(300)]
        async with HTTPDataset(urls, retry=FAST, max_connections=32) as ds:
            gate = asyncio.Semaphore(64)

            async def one(i: int) -> bytes:
                async with gate:
                    return await ds.fetch(i)

            got = await asyncio.gather(*(one(i) for i in range(len(ds))))
    want = [payload(i, sizes[i % len(sizes)]) for i in range(300)]
    assert [digest(b) for b in got] == [digest(b) for b in want]
    assert all(server.count(f"/obj/{i}") == 1 for i in range(300))


async def test_getitem_decodes_and_negative_index_counts_from_the_end() -> None:
    async with FaultServer() as server, dataset(server, range(4), decode=digest) as ds:
        assert await ds[1] == digest(payload(1))
        assert await ds[-1] == digest(payload(3))
        assert ds.decode(b"abc") == digest(b"abc")


# -- retryable faults -------------------------------------------------------------------------


async def test_503_then_success_backs_off_exponentially() -> None:
    sleeps = Sleeps()
    async with FaultServer() as server, dataset(server, [7], sleep=sleeps) as ds:
        server.fail("/obj/7", Fault.http(503), Fault.http(503))
        assert await ds.fetch(0) == payload(7)
    assert server.count("/obj/7") == 3
    assert sleeps == pytest.approx([0.01, 0.02])


async def test_503_forever_exhausts_retries_and_lists_every_attempt() -> None:
    sleeps = Sleeps()
    async with FaultServer() as server, dataset(server, [3], sleep=sleeps) as ds:
        server.fail_always("/obj/3", Fault.http(503))
        with pytest.raises(RetriesExhaustedError) as info:
            await ds.fetch(0)
    error = info.value
    url = server.obj_url(3)
    assert not isinstance(error, TimeoutError)
    assert server.count("/obj/3") == 3 == len(error.attempts)
    assert error.url == url
    message = str(error)
    assert url in message
    assert "max_attempts=3" in message
    for number in (1, 2, 3):
        assert f"attempt {number} (" in message
    assert message.count("HTTP 503 Service Unavailable") == 3
    assert len(sleeps) == 2  # no wait after the last attempt
    assert isinstance(error.__cause__, RetryableError)


async def test_429_honours_retry_after_seconds() -> None:
    sleeps = Sleeps()
    async with FaultServer() as server, dataset(server, [1], sleep=sleeps) as ds:
        server.fail("/obj/1", Fault.http(429, retry_after="0.75"))
        assert await ds.fetch(0) == payload(1)
    assert server.count("/obj/1") == 2
    assert sleeps == pytest.approx([0.75])


async def test_retry_after_as_http_date_and_capped_by_backoff_max() -> None:
    sleeps = Sleeps()
    policy = RetryPolicy(max_attempts=3, backoff_initial=0.01, backoff_max=5.0, jitter=False)
    when = email.utils.format_datetime(datetime.now(UTC) + timedelta(seconds=3), usegmt=True)
    async with FaultServer() as server, dataset(server, [1], retry=policy, sleep=sleeps) as ds:
        server.fail("/obj/1", Fault.http(503, retry_after=when), Fault.http(429, "3600"))
        assert await ds.fetch(0) == payload(1)
    assert server.count("/obj/1") == 3
    assert 1.5 <= sleeps[0] <= 3.0  # the date has one-second resolution
    assert sleeps[1] == 5.0  # an hour asked, backoff_max granted


async def test_retry_after_ignored_when_the_policy_says_so() -> None:
    sleeps = Sleeps()
    policy = RetryPolicy(backoff_initial=0.01, jitter=False, respect_retry_after=False)
    async with FaultServer() as server, dataset(server, [1], retry=policy, sleep=sleeps) as ds:
        server.fail("/obj/1", Fault.http(429, retry_after="3"))
        assert await ds.fetch(0) == payload(1)
    assert sleeps == pytest.approx([0.01])


async def test_reset_mid_body_is_retried_and_the_whole_object_read_again() -> None:
    async with FaultServer(size=200_000) as server, dataset(server, [5], sleep=Sleeps()) as ds:
        server.fail("/obj/5", Fault.reset())
        assert await ds.fetch(0) == payload(5, 200_000)
    assert server.count("/obj/5") == 2


async def test_short_body_never_reaches_decode() -> None:
    decoded: list[bytes] = []
    async with FaultServer() as server:
        ds = dataset(server, [2], decode=decoded.append, sleep=Sleeps())
        server.fail_always("/obj/2", Fault.short())
        with pytest.raises(RetriesExhaustedError) as info:
            await ds[0]
        await ds.aclose()
    assert decoded == []
    assert server.count("/obj/2") == 3
    assert str(info.value).count("truncated body") == 3


async def test_short_body_then_success() -> None:
    async with FaultServer() as server, dataset(server, [2], sleep=Sleeps()) as ds:
        server.fail("/obj/2", Fault.short(), Fault.reset())
        assert await ds.fetch(0) == payload(2)
    assert server.count("/obj/2") == 3


# A body longer than its Content-Length, sent with it: a small one reaches aiohttp in the same
# read as the headers, whose parser then fails on the extra bytes before there is a response; a
# large one is read in many pieces, so the promised half completes a response of its own and the
# extra bytes trip the parser only afterwards.
LONG_BODIES = pytest.mark.parametrize(
    ("size", "reason"),
    [(1024, "malformed response"), (4 << 20, "longer than its Content-Length")],
    ids=["one-read", "many-reads"],
)


@LONG_BODIES
async def test_long_body_once_is_retried_and_read_whole(size: int, reason: str) -> None:
    async with FaultServer(size=size) as server, dataset(server, [6], sleep=Sleeps()) as ds:
        server.fail("/obj/6", Fault.long())
        assert await ds.fetch(0) == payload(6, size)
    assert server.count("/obj/6") == 2


@LONG_BODIES
async def test_long_body_never_reaches_decode(size: int, reason: str) -> None:
    decoded: list[bytes] = []
    async with FaultServer(size=size) as server:
        ds = dataset(server, [6], decode=decoded.append, sleep=Sleeps())
        server.fail_always("/obj/6", Fault.long())
        with pytest.raises(RetriesExhaustedError) as info:
            await ds[0]
        await ds.aclose()
    assert decoded == []
    error = info.value
    assert isinstance(error, RemoteError)
    assert error.url == server.obj_url(6)
    assert server.count("/obj/6") == 3 == len(error.attempts)
    assert all(reason in attempt for attempt in error.attempts), error.attempts
    assert len(str(error)) < 2000  # the parser's dump of the stray bytes is cut short
    assert isinstance(error.__cause__, Exception)


async def test_bytes_following_a_complete_body_later_never_break_the_next_read() -> None:
    # The promised half of object 1 completes a response; the rest comes 0.2 s later on the
    # same kept-alive connection. That response cannot be told from a correct one (its length
    # is the one promised: see the module's sharp edges), but the stray bytes must not reach
    # the next request on that connection as data, nor as a raw aiohttp error.
    async with FaultServer(size=1024) as server:
        server.fail("/obj/1", Fault.long_late(0.2))
        async with dataset(server, [1, 2], max_connections=1, sleep=Sleeps()) as ds:
            first = await ds.fetch(0)
            second = await ds.fetch(1)  # at once: it may go out on the same connection
            await asyncio.sleep(0.3)  # the stray bytes have arrived by now
            third = await ds.fetch(1)
    assert first == payload(1, 1024)[:512]
    assert second == third == payload(2, 1024)


async def test_stall_after_headers_is_caught_by_read_timeout() -> None:
    policy = RetryPolicy(max_attempts=2, backoff_initial=0.01, jitter=False)
    async with FaultServer() as server:
        ds = dataset(server, [4], retry=policy, read_timeout=0.2, sleep=Sleeps())
        server.fail_always("/obj/4", Fault.stall(30))
        started = time.monotonic()
        with pytest.raises(RemoteTimeoutError) as info:
            await ds.fetch(0)
        elapsed = time.monotonic() - started
        await ds.aclose()
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, RetriesExhaustedError)
    assert server.count("/obj/4") == 2 == len(info.value.attempts)
    assert str(info.value).count("timeout: SocketTimeoutError") == 2
    assert elapsed < 10  # two read timeouts, not the 30 s stall


async def test_stall_once_then_success() -> None:
    async with FaultServer() as server, dataset(server, [4], read_timeout=0.2) as ds:
        server.fail("/obj/4", Fault.stall(30))
        assert await ds.fetch(0) == payload(4)
    assert server.count("/obj/4") == 2


async def test_a_slow_but_flowing_response_is_not_a_timeout() -> None:
    async with FaultServer() as server, dataset(server, [4], read_timeout=1.0) as ds:
        server.fail("/obj/4", Fault.latency(0.3))
        assert await ds.fetch(0) == payload(4)
    assert server.count("/obj/4") == 1


async def test_item_deadline_bounds_all_attempts() -> None:
    async with FaultServer() as server:
        ds = dataset(server, [6], read_timeout=30, item_deadline=0.3, sleep=Sleeps())
        server.fail_always("/obj/6", Fault.stall(30))
        started = time.monotonic()
        with pytest.raises(RemoteTimeoutError, match="deadline") as info:
            await ds.fetch(0)
        elapsed = time.monotonic() - started
        await ds.aclose()
    assert server.count("/obj/6") == 1
    assert server.obj_url(6) in str(info.value)
    assert elapsed < 5


async def test_connection_refused_is_retried_then_reported() -> None:
    with socket.socket() as probe:  # a port that nobody listens on once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/obj/1"
    sleeps = Sleeps()
    async with HTTPDataset([url], retry=FAST, sleep=sleeps) as ds:
        with pytest.raises(RetriesExhaustedError, match="connection failed") as info:
            await ds.fetch(0)
    assert len(info.value.attempts) == 3
    assert len(sleeps) == 2
    assert isinstance(info.value.__cause__, OSError)


# -- final failures ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (404, RemoteNotFoundError),
        (401, RemotePermissionError),
        (403, RemotePermissionError),
        (400, RemoteError),
        (418, RemoteError),
    ],
)
async def test_final_statuses_are_not_retried(status: int, error: type[RemoteError]) -> None:
    sleeps = Sleeps()
    async with FaultServer() as server, dataset(server, [8], sleep=sleeps) as ds:
        server.fail_always("/obj/8", Fault.http(status))
        with pytest.raises(error) as info:
            await ds.fetch(0)
    assert type(info.value) is error
    assert server.count("/obj/8") == 1
    assert sleeps == []
    assert server.obj_url(8) in str(info.value)
    assert f"HTTP {status}" in str(info.value)
    assert info.value.url == server.obj_url(8)
    assert len(info.value.attempts) == 1
    if status == 404:
        assert isinstance(info.value, FileNotFoundError)
    if status in (401, 403):
        assert isinstance(info.value, PermissionError)


async def test_not_found_after_retries_lists_the_earlier_attempts() -> None:
    async with FaultServer() as server, dataset(server, [9], sleep=Sleeps()) as ds:
        server.fail("/obj/9", Fault.http(503), Fault.http(404))
        with pytest.raises(RemoteNotFoundError) as info:
            await ds.fetch(0)
    assert server.count("/obj/9") == 2
    assert len(info.value.attempts) == 2
    assert "HTTP 503" in info.value.attempts[0]
    assert any("HTTP 503" in note for note in info.value.__notes__)


# -- with the DataLoader ----------------------------------------------------------------------


async def test_the_loader_fetches_on_the_loop_and_decodes_off_it() -> None:
    decoded_in: set[str] = set()

    def decode(raw: bytes) -> str:
        decoded_in.add(threading.current_thread().name)
        return digest(raw)

    async with FaultServer() as server:
        server.fail("/obj/5", Fault.http(503))  # retried inside fetch, invisible to the loader
        ds = dataset(server, range(50), decode=decode)
        async with aioloader.DataLoader(
            ds, batch_size=8, io_concurrency=16, collate_fn=list
        ) as loader:
            batches = [batch async for batch in loader]
        assert "open_sessions=0" in repr(ds)  # the loader closed the dataset's sessions
    assert [d for batch in batches for d in batch] == [digest(payload(i)) for i in range(50)]
    assert server.count("/obj/5") == 2
    assert threading.current_thread().name not in decoded_in


async def test_the_loader_reports_a_missing_object() -> None:
    async with FaultServer() as server:
        server.fail_always("/obj/3", Fault.http(404))
        ds = dataset(server, range(8))
        async with aioloader.DataLoader(ds, batch_size=4, collate_fn=list) as loader:
            with pytest.raises(RemoteNotFoundError) as info:
                async for _ in loader:
                    pass
    assert server.obj_url(3) in str(info.value)
    assert server.count("/obj/3") == 1


async def test_a_decode_error_names_the_url_beside_the_index() -> None:
    def decode(raw: bytes) -> bytes:
        if raw == payload(3):
            raise ValueError("corrupt image")
        return raw

    async with FaultServer() as server:
        ds = dataset(server, range(8), decode=decode)
        async with aioloader.DataLoader(ds, batch_size=4, collate_fn=list) as loader:
            with pytest.raises(ValueError, match="corrupt image") as info:
                await collect(loader)
    assert f"sample index 3 ({server.obj_url(3)}) of batch 0" in notes_of(info.value)


async def test_requests_waiting_for_a_connection_are_neither_in_flight_nor_stalls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "aioloader.remote")
    async with FaultServer() as server:
        server.fail("/obj/0", Fault.hold())  # half its body, then silence: a real stall
        ds = dataset(server, range(2), max_connections=1, stall_warning=0.2, read_timeout=60)
        async with aioloader.DataLoader(
            ds, batch_size=2, io_concurrency=2, collate_fn=list
        ) as loader:
            epoch = asyncio.ensure_future(collect(loader))
            await until(lambda: loader.statistics().remote_stalls > 0)
            # /obj/1 has waited for the only connection as long as /obj/0 has been silent,
            # and waits on: give a false stall warning time to come.
            await asyncio.sleep(0.5)
            assert loader.statistics().requests_in_flight == 1  # /obj/0 alone is on the wire
            server.release()
            batches = await epoch
            stats = loader.statistics()
    assert batches == [[payload(0), payload(1)]]
    messages = [r.getMessage() for r in caplog.records if r.name == "aioloader.remote"]
    [stall] = [m for m in messages if " stalls: " in m]
    assert server.obj_url(0) in stall
    assert stats.remote_stalls == 1
    [busy] = [m for m in messages if "connections are busy" in m]  # the cap is said, once
    assert "max_connections=1" in busy
    assert stats.requests_in_flight == 0


def _allow_open_files(count: int) -> None:
    """Raise this process's soft limit on open files to ``count`` where it is lower (macOS
    gives 256), up to the hard limit; skip the test if even that is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count:
        if hard != resource.RLIM_INFINITY and hard < count:
            pytest.skip(f"needs {count} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, hard))


async def test_connections_follow_an_io_concurrency_above_the_default_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # io_concurrency=260 asks for more requests on the wire than the 256 connections a session
    # opens by default; with max_connections left unset, the loader's session opens enough.
    # Every response is held half sent, so all of them are on the wire at once, for sure.
    caplog.set_level(logging.WARNING, "aioloader.remote")
    wanted = 260
    _allow_open_files(4 * wanted)  # each connection's two ends, and room for the rest
    async with FaultServer() as server:
        for i in range(wanted):
            server.fail(f"/obj/{i}", Fault.hold())
        ds = dataset(server, range(wanted))
        async with aioloader.DataLoader(
            ds, batch_size=wanted, io_concurrency=wanted, collate_fn=list
        ) as loader:
            epoch = asyncio.ensure_future(collect(loader))
            await until(lambda: server.holding >= 256)
            async with asyncio.timeout(10):  # capped at 256, the rest would wait for ever
                await until(lambda: server.holding == wanted)
            assert loader.statistics().requests_in_flight == wanted
            server.release()
            batches = await epoch
    assert batches == [[payload(i) for i in range(wanted)]]
    assert not [r for r in caplog.records if "connections are busy" in r.getMessage()]


async def test_an_explicit_max_connections_caps_the_wire_below_io_concurrency() -> None:
    async with FaultServer() as server:
        for i in range(8):
            server.fail(f"/obj/{i}", Fault.hold())
        ds = dataset(server, range(8), max_connections=3)
        async with aioloader.DataLoader(
            ds, batch_size=8, io_concurrency=8, collate_fn=list
        ) as loader:
            epoch = asyncio.ensure_future(collect(loader))
            await until(lambda: server.holding == 3)
            await asyncio.sleep(0.2)  # time for a fourth request, were it let through
            assert server.holding == 3
            server.release()
            assert await epoch == [[payload(i) for i in range(8)]]


# -- streams (tar shards) ---------------------------------------------------------------------


async def read_stream(ds: HTTPDataset, into: bytearray) -> None:
    async with contextlib.aclosing(ds.stream(0)) as chunks:
        async for chunk in chunks:
            into += chunk


async def test_a_stream_that_keeps_breaking_off_backs_off_and_gives_up_as_fetch_does() -> None:
    body = payload(0, 200_000)
    async with FaultServer() as server:
        server.files["big"] = body
        server.fail_always("/files/big", Fault.reset())
        sleeps = Sleeps()
        received = bytearray()
        async with HTTPDataset([server.file_url("big")], retry=FAST, sleep=sleeps) as ds:
            with pytest.raises(RetriesExhaustedError) as info:
                await read_stream(ds, received)
    assert type(info.value) is RetriesExhaustedError  # not a timeout: nothing timed out
    assert server.count("/files/big") == 3 == len(info.value.attempts)  # FAST.max_attempts
    assert sleeps == [0.01, 0.02]  # FAST's backoff, as fetch() waits it
    assert all("broke off after" in attempt for attempt in info.value.attempts)
    assert server.file_url("big") in str(info.value)
    assert info.value.__cause__ is not None
    assert received == body[: len(received)]  # no byte handed out twice


async def test_a_stream_whose_reader_lags_is_not_a_stall(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "aioloader.remote")
    body = payload(1, 4 << 20)  # far more than aiohttp buffers before it stops reading
    async with FaultServer() as server:
        server.files["big"] = body
        async with HTTPDataset([server.file_url("big")], stall_warning=0.2) as ds:
            received = bytearray()
            lags = 0
            async with contextlib.aclosing(ds.stream(0)) as chunks:
                async for chunk in chunks:
                    received += chunk
                    if lags < 2:  # the reader's own time, four stall_warnings each
                        lags += 1
                        await asyncio.sleep(0.8)
    assert received == body
    assert not [r for r in caplog.records if r.name == "aioloader.remote"]


# -- construction, indices, pickling, sessions ------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "ftp://host/file",
        "s3://bucket/key",
        "file:///etc/hosts",
        "no-scheme",
        "http://",
        "http:///no/host",
        "https://?query",
        "http://#fragment",
        "http//host/x",
    ],
)
def test_unsupported_urls_are_refused_at_construction(url: str) -> None:
    with pytest.raises(ValueError, match="urls\\[1\\]") as info:
        HTTPDataset(["http://127.0.0.1/ok", url])
    assert repr(url) in str(info.value)


@pytest.mark.parametrize(
    "url",
    ["http://h", "HTTPS://host:8443/a?b#c", "http://user:pw@host/x", " http://host/x", "Http://h/"],
)
def test_http_urls_of_every_form_are_taken_as_urlsplit_reads_them(url: str) -> None:
    parts = urllib.parse.urlsplit(url)
    assert parts.scheme.lower() in ("http", "https")  # what the check means
    assert parts.netloc
    assert HTTPDataset([url]).urls == (url,)


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("connect_timeout", 0),
        ("connect_timeout", -1.0),
        ("read_timeout", math.inf),
        ("read_timeout", math.nan),
        ("item_deadline", True),
        ("item_deadline", "5"),
        ("max_connections", 0),
        ("max_connections", 2.5),
    ],
)
def test_bad_arguments_are_refused_naming_them(argument: str, value: Any) -> None:
    with pytest.raises(ValueError, match=argument) as info:
        HTTPDataset(["http://127.0.0.1/x"], **{argument: value})
    assert repr(value) in str(info.value)


def test_bad_types_are_refused() -> None:
    with pytest.raises(TypeError, match="retry"):
        HTTPDataset(["http://127.0.0.1/x"], retry={"max_attempts": 3})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="decode"):
        HTTPDataset(["http://127.0.0.1/x"], decode=42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"urls\[1\]"):
        HTTPDataset(["http://127.0.0.1/x", 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="urls"):
        HTTPDataset(42)  # type: ignore[arg-type]


def test_a_single_url_is_one_item() -> None:
    assert len(HTTPDataset("http://127.0.0.1/x")) == 1


async def test_bad_indices() -> None:
    ds = HTTPDataset(["http://127.0.0.1/a", "http://127.0.0.1/b"])
    with pytest.raises(IndexError, match="index 2 is out of range for 2 items"):
        await ds.fetch(2)
    with pytest.raises(IndexError, match="-3"):
        await ds.fetch(-3)
    with pytest.raises(TypeError, match="index must be an int"):
        await ds.fetch(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="index must be an int"):
        await ds.fetch(True)
    assert "open_sessions=0" in repr(ds)  # a refused index opens nothing


async def test_pickles_without_its_session_and_works_after() -> None:
    async with FaultServer() as server:
        ds = dataset(server, range(3), decode=digest)
        assert await ds[0] == digest(payload(0))
        assert "open_sessions=1" in repr(ds)
        clone = pickle.loads(pickle.dumps(ds))
        assert "open_sessions=0" in repr(clone)
        decode = pickle.loads(pickle.dumps(ds.decode))  # what a worker process receives
        assert decode(b"abc") == digest(b"abc")
        assert clone.urls == ds.urls
        assert await clone[2] == digest(payload(2))
        await clone.aclose()
        await ds.aclose()
        assert "open_sessions=0" in repr(ds)


async def test_one_session_per_loop_and_aclose_closes_them_all() -> None:
    other = asyncio.new_event_loop()
    thread = threading.Thread(target=other.run_forever, name="other-loop", daemon=True)
    thread.start()
    try:
        async with FaultServer() as server:
            ds = dataset(server, range(4))
            here = await ds.fetch(0)
            there = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(ds.fetch(1), other))
            assert (here, there) == (payload(0), payload(1))
            assert "open_sessions=2" in repr(ds)
            await ds.aclose()  # closes this loop's session and asks the other loop to close its
            assert "open_sessions=0" in repr(ds)
            await ds.aclose()  # idempotent
            assert await ds.fetch(2) == payload(2)  # reopens lazily
            await ds.aclose()
    finally:
        other.call_soon_threadsafe(other.stop)
        thread.join(10)
        other.close()


def test_sessions_work_across_separate_runs_when_closed() -> None:
    async def run(ds: HTTPDataset, server: FaultServer, i: int) -> bytes:
        async with ds:
            return await ds.fetch(i)

    with FaultServer().in_thread() as server:
        ds = dataset(server, range(2))
        assert asyncio.run(run(ds, server, 0)) == payload(0)
        assert asyncio.run(run(ds, server, 1)) == payload(1)


def test_a_session_closes_with_the_loop_that_opened_it() -> None:
    # asyncio.run(train()) per epoch, and loader.close() only at the end, or never: each
    # run's session must not outlive its loop (aiohttp: "Unclosed client session").
    with FaultServer().in_thread() as server:
        ds = dataset(server, range(8))
        loader = aioloader.DataLoader(ds, batch_size=4)

        async def train() -> int:
            n = sum([len(b) async for b in loader])
            assert "open_sessions=1" in repr(ds)  # kept across the epoch's batches
            return n

        try:
            assert asyncio.run(train()) == 8
            assert "open_sessions=0" in repr(ds)
            assert asyncio.run(train()) == 8  # a new loop opens its own
            assert "open_sessions=0" in repr(ds)
        finally:
            loader.close()


# A script as torch users write one: a module-level loader, never closed, read by asyncio.run.
NEVER_CLOSED = """
import asyncio, aioloader
from http_server import FaultServer
from aioloader.sources import HTTPDataset

async def train(loader):
    return sum([len(b) async for b in loader])

with FaultServer().in_thread() as server:
    ds = HTTPDataset([server.obj_url(i) for i in range(8)])
    loader = aioloader.DataLoader(ds, batch_size=4, collate_fn=list)
    print(asyncio.run(train(loader)))
    print(asyncio.run(train(loader)))
"""


def run_in_dev_mode(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter under ``-X dev`` (resource warnings shown), with the
    tests' modules importable; it must succeed."""
    from framework_data import child_pythonpath

    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", code],
        env={**os.environ, "PYTHONPATH": child_pythonpath()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_a_loader_never_closed_leaves_no_unclosed_session_at_exit() -> None:
    done = run_in_dev_mode(NEVER_CLOSED)
    assert done.stdout.split() == ["8", "8"]
    assert "unclosed" not in done.stderr.lower(), done.stderr  # sessions, sockets, transports


# A loop closed by hand, without loop.shutdown_asyncgens(), then the source collected: the hook
# that closes a session at its loop's shutdown is collected unfinished, and must go quietly.
CLOSED_BY_HAND = """
import asyncio, gc
from http_server import FaultServer
from aioloader.sources import HTTPDataset

with FaultServer().in_thread() as server:
    ds = HTTPDataset([server.obj_url(0)])
    loop = asyncio.new_event_loop()
    print(len(loop.run_until_complete(ds.fetch(0))))
    loop.close()
    del ds
    gc.collect()
    print("collected")
"""


def test_a_source_collected_after_its_loop_was_closed_by_hand_raises_nothing() -> None:
    done = run_in_dev_mode(CLOSED_BY_HAND)
    assert done.stdout.split() == ["1024", "collected"]
    assert "Exception ignored" not in done.stderr, done.stderr


def test_import_is_lazy_and_the_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    code = (
        "import sys, aioloader, aioloader.sources\n"
        "bad = {'aiohttp', 'fsspec', 's3fs', 'pyarrow'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    with pytest.raises(ImportError, match=r"pip install 'aioloader\[remote\]'"):
        HTTPDataset(["http://127.0.0.1/x"])


def test_public_names() -> None:
    assert sources.__all__ == sorted(sources.__all__)
    public = {name for name in dir(sources) if not name.startswith("_")}
    assert set(sources.__all__) <= public
    for name in sources.__all__:
        assert getattr(sources, name).__module__ == "aioloader.sources"


# -- RetryPolicy ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_attempts", 0),
        ("max_attempts", 2.0),
        ("max_attempts", True),
        ("backoff_initial", -0.1),
        ("backoff_initial", math.nan),
        ("backoff_max", math.inf),
        ("backoff_max", 0.05),  # below backoff_initial=0.1
        ("backoff_multiplier", 0.5),
        ("jitter", 1),
        ("respect_retry_after", "yes"),
        ("retry_statuses", frozenset({503, 404})),
        ("retry_statuses", frozenset({99})),
        ("retry_statuses", 503),
    ],
)
def test_retry_policy_validates_naming_field_and_value(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"RetryPolicy.{field}") as info:
        RetryPolicy(**{field: value})
    assert repr(value) in str(info.value)


def test_retry_policy_defaults_and_normalisation() -> None:
    policy = RetryPolicy(retry_statuses={500, 503})  # type: ignore[arg-type]
    assert policy.retry_statuses == frozenset({500, 503})
    assert RetryPolicy().retry_statuses == frozenset({408, 425, 429, 500, 502, 503, 504})
    assert pickle.loads(pickle.dumps(policy)) == policy
    with pytest.raises(AttributeError):
        policy.max_attempts = 9  # type: ignore[misc]


@given(
    initial=st.floats(0, 5),
    extra=st.floats(0, 100),
    multiplier=st.floats(1, 10),
    failures=st.integers(1, 5000),
    jitter=st.booleans(),
    u=st.floats(0, 1, exclude_max=True),
    retry_after=st.none() | st.floats(0, 1e6),
)
def test_backoff_stays_within_its_bounds(
    initial: float,
    extra: float,
    multiplier: float,
    failures: int,
    jitter: bool,
    u: float,
    retry_after: float | None,
) -> None:
    policy = RetryPolicy(
        backoff_initial=initial,
        backoff_max=initial + extra,
        backoff_multiplier=multiplier,
        jitter=jitter,
    )
    steady = RetryPolicy(
        backoff_initial=initial,
        backoff_max=initial + extra,
        backoff_multiplier=multiplier,
        jitter=False,
    )
    # Without jitter: starts at backoff_initial, never shrinks, never passes backoff_max.
    assert steady.backoff(1) == initial
    assert initial <= steady.backoff(failures) <= steady.backoff(failures + 1) <= policy.backoff_max
    # Full jitter scales the steady wait by a uniform draw.
    wait = policy.backoff(failures, rand=lambda: u)
    assert wait == pytest.approx(
        steady.backoff(failures) * u if jitter else steady.backoff(failures)
    )
    # Retry-After raises the wait to what the server asked, up to backoff_max.
    delay = policy.delay(failures, retry_after, rand=lambda: u)
    assert 0.0 <= delay <= policy.backoff_max
    if retry_after is None:
        assert delay == wait
    else:
        assert delay == max(wait, min(retry_after, policy.backoff_max))


@pytest.mark.parametrize(
    ("header", "expected"),
    [("3", 3.0), (" 1.5 ", 1.5), ("0", 0.0), ("-1", None), ("inf", None), ("soon", None)],
)
def test_parse_retry_after_seconds(header: str, expected: float | None) -> None:
    assert parse_retry_after(header) == expected


def test_parse_retry_after_dates() -> None:
    now = datetime(2030, 1, 1, 12, 0, 0, tzinfo=UTC)
    later = email.utils.format_datetime(now + timedelta(seconds=90), usegmt=True)
    earlier = email.utils.format_datetime(now - timedelta(seconds=90), usegmt=True)
    assert parse_retry_after(later, now=now) == 90.0
    assert parse_retry_after(earlier, now=now) == 0.0
    assert parse_retry_after(None) is None


# -- retrying() with fakes --------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


def failing(times: int, then: bytes = b"ok", **kwargs: Any) -> Callable[[], Awaitable[bytes]]:
    calls = 0

    async def op() -> bytes:
        nonlocal calls
        calls += 1
        if calls <= times:
            raise RetryableError(f"flaky {calls}", **kwargs)
        return then

    return op


async def test_retrying_stops_before_a_wait_that_would_pass_the_deadline() -> None:
    clock = FakeClock()
    policy = RetryPolicy(max_attempts=100, backoff_initial=0.4, backoff_multiplier=1, jitter=False)
    with pytest.raises(RemoteTimeoutError, match=r"would pass the 1\.0 s deadline") as info:
        await retrying(
            failing(1000),
            policy=policy,
            describe="thing",
            deadline=1.0,
            sleep=clock.sleep,
            clock=clock,
        )
    # attempts at t=0, 0.4 and 0.8; the next wait would end at 1.2
    assert len(info.value.attempts) == 3
    assert clock.now == pytest.approx(0.8)


async def test_retrying_last_timeout_makes_a_timeout_error() -> None:
    with pytest.raises(RemoteTimeoutError) as info:
        await retrying(failing(5, timed_out=True), policy=FAST, describe="x", sleep=Sleeps())
    assert isinstance(info.value, TimeoutError)
    assert info.value.attempts[-1].endswith("flaky 3")


async def test_retrying_passes_other_errors_through_with_the_history() -> None:
    calls = 0

    async def op() -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RetryableError("flaky")
        raise KeyError("a bug")

    with pytest.raises(KeyError) as info:
        await retrying(op, policy=FAST, describe="x", sleep=Sleeps())
    assert calls == 2
    assert "attempt 1" in "\n".join(info.value.__notes__)


async def test_retrying_lets_cancellation_through_at_once() -> None:
    calls = 0

    async def op() -> bytes:
        nonlocal calls
        calls += 1
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await retrying(op, policy=FAST, describe="x", sleep=Sleeps())
    assert calls == 1


async def test_retrying_rejects_a_bad_deadline() -> None:
    with pytest.raises(ValueError, match="deadline"):
        await retrying(failing(0), policy=FAST, describe="x", deadline=-1)


async def test_a_stream_cancelled_while_it_opens_leaves_nothing_in_flight() -> None:
    # Cancelled after its request was sent and before any answer (a consumer's break, an epoch
    # closing): it stayed counted in flight for ever, and was later warned about as a stall.
    answered = asyncio.Event()

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1000)
        answered.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    counters = Counters()
    current_counters.set(counters)
    dataset = HTTPDataset([f"http://127.0.0.1:{port}/x.tar"], stall_warning=0.2)

    async def read() -> None:
        async for _ in dataset.stream(0):
            pass

    task = asyncio.create_task(read())
    async with asyncio.timeout(10):
        await answered.wait()
        await until(lambda: counters.remote_in_flight == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.4)  # past stall_warning: a request left on the wire would count
    assert counters.remote_in_flight == 0
    assert counters.remote_stalls == 0
    await dataset.aclose()
    server.close()
    await server.wait_closed()
