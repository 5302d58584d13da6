"""HTTPDataset.stream resumed against objects that change, chunked bodies and malformed
answers; secrets in the repr of what the HTTP source raises; bad arguments.

Each server here is a real aiohttp server (or raw asyncio server, for bytes that are not HTTP)
on 127.0.0.1 whose answers a test scripts one request at a time: the first answer of a stream
breaks off mid-body, and the next one answers the resumed ``Range`` as the test needs (the same
object, another version, a chunked body). Backoff waits are recorded (``Sleeps``), never waited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from helpers import Sleeps
from http_server import Fault, FaultServer

from aioloader._errors import (
    RemoteError,
    RemoteNotFoundError,
    RemotePermissionError,
    RetriesExhaustedError,
)
from aioloader.sources import FileDataset, FsspecDataset, HTTPDataset, RetryPolicy
from aioloader.sources._redact import MARKER, redact

FAST = RetryPolicy(max_attempts=3, backoff_initial=0.01, backoff_max=1.0, jitter=False)
OLD = bytes(range(256)) * 400  # 102400 bytes
NEW = bytes(reversed(range(256))) * 400
CUT = 40_000  # bytes of the first answer before it breaks off
SECRET = "S3CR3T-SIGNATURE"

Answer = Callable[[web.Request], Awaitable[web.StreamResponse]]


def cut(body: bytes, headers: dict[str, str], *, chunked: bool = False) -> Answer:
    """An answer that sends ``CUT`` bytes of ``body`` and then closes the connection."""

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers=headers)
        if not chunked:
            response.content_length = len(body)
        await response.prepare(request)
        await response.write(body[:CUT])
        await response.drain()
        await asyncio.sleep(0.05)  # the bytes leave before the connection closes
        assert request.transport is not None
        request.transport.close()
        raise asyncio.CancelledError  # the connection is gone: nothing more to send

    return answer


def ranged(body: bytes, headers: dict[str, str]) -> Answer:
    """An answer of 206 with the asked range of ``body`` (If-Range not looked at)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        start = int(request.headers["Range"].removeprefix("bytes=").rstrip("-"))
        return web.Response(
            status=206,
            body=body[start:],
            headers={**headers, "Content-Range": f"bytes {start}-{len(body) - 1}/{len(body)}"},
        )

    return answer


def whole(body: bytes, headers: dict[str, str]) -> Answer:
    async def answer(request: web.Request) -> web.StreamResponse:
        return web.Response(body=body, headers=headers)

    return answer


class Script:
    """A server whose n-th request gets the n-th answer; records each request's headers."""

    def __init__(self, *answers: Answer) -> None:
        self.answers = list(answers)
        self.requests: list[dict[str, str]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(dict(request.headers))
        return await self.answers[len(self.requests) - 1](request)


@contextlib.asynccontextmanager
async def serving(script: Script) -> AsyncIterator[str]:
    """The URL of ``script``'s object (with a signature in its query, to be masked)."""
    app = web.Application()
    app.router.add_get("/x", script.handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = int(runner.addresses[0][1])
        yield f"http://127.0.0.1:{port}/x?X-Amz-Signature={SECRET}"
    finally:
        await runner.cleanup()


async def read_all(ds: HTTPDataset, into: bytearray) -> None:
    async with asyncio.timeout(20), contextlib.aclosing(ds.stream(0)) as chunks:
        async for chunk in chunks:
            into += chunk


def shows_no_secret(exc: BaseException) -> None:
    for link in (exc, exc.__cause__, exc.__context__):
        if link is not None:
            assert SECRET not in str(link)
            assert SECRET not in repr(link)


# -- a resumed stream never joins two versions of an object (If-Range) ------------------------


@pytest.mark.parametrize(
    "second",
    [
        ranged(NEW, {"ETag": '"v2"'}),  # a server that ignores If-Range
        whole(NEW, {"ETag": '"v2"'}),  # If-Range honoured: the whole new object
    ],
    ids=["206-of-another-etag", "200-to-if-range"],
)
async def test_a_stream_resumed_on_a_replaced_object_fails_naming_it(second: Answer) -> None:
    script = Script(cut(OLD, {"ETag": '"v1"'}), second)
    received = bytearray()
    async with serving(script) as url, HTTPDataset([url], retry=FAST, sleep=Sleeps()) as ds:
        with pytest.raises(RemoteError, match="changed while it was read") as info:
            await read_all(ds, received)
    assert type(info.value) is RemoteError  # final: another try reads the same new version
    message = str(info.value)
    assert '"v1"' in message
    assert '"v2"' in message
    assert f"{CUT} bytes" in message
    assert "X-Amz-Signature=REDACTED" in message
    shows_no_secret(info.value)
    assert info.value.url == url
    assert received == OLD[:CUT]  # no byte of the new version was handed out
    assert script.requests[1]["Range"] == f"bytes={CUT}-"
    assert script.requests[1]["If-Range"] == '"v1"'


async def test_a_stream_resumed_on_the_same_object_sends_if_range_and_completes() -> None:
    script = Script(cut(OLD, {"ETag": '"v1"'}), ranged(OLD, {"ETag": '"v1"'}))
    received = bytearray()
    async with serving(script) as url, HTTPDataset([url], retry=FAST, sleep=Sleeps()) as ds:
        await read_all(ds, received)
    assert received == OLD
    assert "If-Range" not in script.requests[0]
    assert script.requests[1]["If-Range"] == '"v1"'


async def test_without_an_etag_the_last_modified_date_is_the_validator() -> None:
    stamp = {"Last-Modified": "Mon, 07 Dec 2026 10:00:00 GMT"}
    later = {"Last-Modified": "Mon, 07 Dec 2026 11:00:00 GMT"}
    script = Script(cut(OLD, stamp), ranged(NEW, later))
    async with serving(script) as url, HTTPDataset([url], retry=FAST, sleep=Sleeps()) as ds:
        with pytest.raises(RemoteError, match="Last-Modified was Mon, 07 Dec 2026 10:00:00"):
            await read_all(ds, bytearray())
    assert script.requests[1]["If-Range"] == stamp["Last-Modified"]


async def test_a_weak_etag_is_not_sent_as_if_range() -> None:
    weak = {"ETag": 'W/"v1"'}
    script = Script(cut(OLD, weak), ranged(OLD, weak))
    received = bytearray()
    async with serving(script) as url, HTTPDataset([url], retry=FAST, sleep=Sleeps()) as ds:
        await read_all(ds, received)
    assert received == OLD
    assert "If-Range" not in script.requests[1]  # If-Range allows strong validators only


async def test_a_server_that_ignores_range_but_keeps_the_etag_is_skipped_as_before() -> None:
    script = Script(cut(OLD, {"ETag": '"v1"'}), whole(OLD, {"ETag": '"v1"'}))
    received = bytearray()
    async with serving(script) as url, HTTPDataset([url], retry=FAST, sleep=Sleeps()) as ds:
        await read_all(ds, received)
    assert received == OLD


async def test_a_resumed_answer_of_another_size_is_another_object_even_without_validator() -> None:
    script = Script(cut(OLD, {}), ranged(OLD + b"more", {}))
    async with serving(script) as url, HTTPDataset([url], retry=FAST, sleep=Sleeps()) as ds:
        with pytest.raises(RemoteError, match="size was 102400 bytes, now 102404"):
            await read_all(ds, bytearray())


async def test_without_any_validator_a_stream_resumes_as_documented() -> None:
    # Nothing tells the versions apart: the resumed bytes are taken (the guide says so).
    script = Script(cut(OLD, {}), ranged(OLD, {}))
    received = bytearray()
    async with serving(script) as url, HTTPDataset([url], retry=FAST, sleep=Sleeps()) as ds:
        await read_all(ds, received)
    assert received == OLD
    assert "If-Range" not in script.requests[1]


# -- a chunked first answer, resumed by a 206: the size comes from Content-Range ---------------


async def test_a_chunked_body_resumed_by_a_206_is_read_whole_once() -> None:
    script = Script(cut(OLD, {}, chunked=True), ranged(OLD, {}))
    received = bytearray()
    sleeps = Sleeps()
    async with serving(script) as url, HTTPDataset([url], retry=FAST, sleep=sleeps) as ds:
        await read_all(ds, received)
    assert received == OLD
    assert len(script.requests) == 2
    assert len(sleeps) == 1


# -- a malformed answer while a stream opens is retried, as fetch retries it -------------------


@contextlib.asynccontextmanager
async def garbage_then(body: bytes, garbage: int) -> AsyncIterator[tuple[str, list[int]]]:
    """A raw server whose first ``garbage`` answers are not HTTP, then ``body``."""
    count = [0]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            count[0] += 1
            if count[0] <= garbage:
                writer.write(b"GARBAGE NOT HTTP\r\n\r\n")
            else:
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n"
                writer.write(head.encode() + b"Connection: close\r\n\r\n" + body)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}/x", count
    finally:
        server.close()
        await server.wait_closed()


async def test_a_stream_retries_a_malformed_answer_as_fetch_does() -> None:
    async with garbage_then(OLD, garbage=1) as (url, count):
        sleeps = Sleeps()
        received = bytearray()
        async with HTTPDataset([url], retry=FAST, sleep=sleeps) as ds:
            await read_all(ds, received)
    assert received == OLD
    assert count[0] == 2
    assert sleeps == [0.01]


async def test_a_stream_of_malformed_answers_gives_up_listing_them() -> None:
    async with (
        garbage_then(OLD, garbage=10) as (url, count),
        HTTPDataset([url], retry=FAST, sleep=Sleeps()) as ds,
    ):
        with pytest.raises(RetriesExhaustedError) as info:
            await read_all(ds, bytearray())
    assert count[0] == 3
    assert all("malformed response" in attempt for attempt in info.value.attempts)


# -- no secret in the str, repr or traceback of what the sources raise, nor in their logs ------

TOKEN = "Bearer T0KEN-IN-A-HEADER"


def every_link(exc: BaseException) -> list[BaseException]:
    """``exc`` and every cause and context under it, each once."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo and len(seen) < 50:
        link = todo.pop()
        if any(link is other for other in seen):
            continue
        seen.append(link)
        todo += [x for x in (link.__cause__, link.__context__) if x is not None]
    return seen


def assert_hidden(exc: BaseException, secret: str) -> None:
    assert secret not in "".join(traceback.format_exception(exc))
    for link in every_link(exc):
        assert secret not in str(link)
        assert secret not in repr(link)
        assert secret not in repr(getattr(link, "args", ()))


async def test_an_authorization_header_never_shows_in_what_fetch_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, "aioloader")

    async def loop_redirect(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(location=str(request.url))  # redirects forever

    script = Script(*[loop_redirect] * 40)
    async with serving(script) as url:
        headers = {"Authorization": TOKEN}
        async with HTTPDataset([url], retry=FAST, sleep=Sleeps(), headers=headers) as ds:
            with pytest.raises(RemoteError) as info:
                await ds.fetch(0)
    assert script.requests[0]["Authorization"] == TOKEN  # the request carries it
    assert "TooManyRedirects" in str(info.value)  # what failed stays said
    assert_hidden(info.value, TOKEN)
    assert_hidden(info.value, SECRET)
    assert TOKEN not in caplog.text


async def test_an_authorization_header_never_shows_in_what_a_stream_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, "aioloader")
    async with garbage_then(OLD, garbage=10) as (url, _):
        headers = {"Authorization": TOKEN}
        async with HTTPDataset([url], retry=FAST, sleep=Sleeps(), headers=headers) as ds:
            with pytest.raises(RetriesExhaustedError) as info:
                await read_all(ds, bytearray())
    assert "malformed response" in str(info.value)
    assert_hidden(info.value, TOKEN)
    assert TOKEN not in caplog.text


async def test_an_authorization_header_never_shows_in_what_fsspec_http_raises() -> None:
    async with FaultServer() as server:
        server.fail_always("/obj/1", Fault.http(403))
        options = {"headers": {"Authorization": TOKEN}}
        async with FsspecDataset([server.obj_url(1)], storage_options=options) as ds:
            with pytest.raises(RemotePermissionError) as info:
                await ds.fetch(0)
        assert server.received[-1][1] == TOKEN
    assert_hidden(info.value, TOKEN)


# -- the masking rule: a password with "@" in it, a token as the user name, a fragment ---------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("https://user:p@ss@host/a.bin", f"https://user:{MARKER}@host/a.bin"),
        ("https://u:a@b@c@host:81/x?y=1", f"https://u:{MARKER}@host:81/x?y=1"),
        ("https://ghp_T0KEN@github.com/o/r.tar", f"https://{MARKER}@github.com/o/r.tar"),
        ("url='https://T0KEN@h/x' failed", f"url='https://{MARKER}@h/x' failed"),
        ("https://h/a.bin#access_token=T0KEN", f"https://h/a.bin#access_token={MARKER}"),
        ("s3://bucket/key@v2 and https://h/x@y", "s3://bucket/key@v2 and https://h/x@y"),
        ("https://h/a#section", "https://h/a#section"),
    ],
)
def test_the_rule_masks_every_part_of_a_userinfo(given: str, expected: str) -> None:
    assert redact(given) == expected


async def test_a_token_given_as_the_user_name_is_sent_and_never_shown() -> None:
    async with FaultServer() as server:
        server.fail_always("/obj/1", Fault.http(404))
        url = server.obj_url(1).replace("://", "://T0KEN-AS-USER@", 1)
        async with HTTPDataset([url], retry=FAST, sleep=Sleeps()) as ds:
            with pytest.raises(RemoteNotFoundError) as info:
                await ds.fetch(0)
            assert "T0KEN-AS-USER" not in repr(ds)
        assert server.received[-1][1] is not None  # sent, as Basic credentials
    assert f"{MARKER}@127.0.0.1" in str(info.value)
    assert_hidden(info.value, "T0KEN-AS-USER")


# -- bad arguments are refused at construction, naming them ---------------------------------


def test_a_url_without_a_host_is_refused() -> None:
    with pytest.raises(ValueError, match=r"urls\[1\]='http://:80/x' names no host"):
        HTTPDataset(["http://127.0.0.1/ok", "http://:80/x"])
    with pytest.raises(ValueError, match=r"urls\[0\]='https://u:REDACTED@/x' names no host"):
        HTTPDataset(["https://u:pw@/x"])


def test_a_header_that_is_not_a_string_is_refused_without_its_value() -> None:
    with pytest.raises(TypeError, match=r"headers\['Authorization'\] is a bytes") as info:
        HTTPDataset(["http://127.0.0.1/x"], headers={"Authorization": b"Bearer T0KEN"})  # type: ignore[dict-item]
    assert "T0KEN" not in str(info.value)
    with pytest.raises(TypeError, match="a name is a int"):
        HTTPDataset(["http://127.0.0.1/x"], headers={1: "x"})  # type: ignore[dict-item]


@pytest.mark.parametrize("make", [HTTPDataset, FsspecDataset])
def test_a_sleep_that_is_not_callable_is_refused(make: Any) -> None:
    with pytest.raises(TypeError, match="sleep must be callable, got 5"):
        make(["http://127.0.0.1/x"], sleep=5)


def test_a_directory_given_alone_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a directory, not one file") as info:
        FileDataset(str(tmp_path))
    assert repr(str(tmp_path)) in str(info.value)
    with pytest.raises(ValueError, match="is a directory"):
        FileDataset(tmp_path)
    (tmp_path / "a.bin").write_bytes(b"a")
    assert FileDataset(str(tmp_path / "a.bin")).paths == (str(tmp_path / "a.bin"),)
