"""An HTTP server on loopback with fault injection, for tests and benchmarks.

``FaultServer`` serves deterministic synthetic objects, ``GET /obj/{i}`` -> ``payload(i, size)``
(``?size=N`` overrides the default size), and given files, ``GET /files/{name}`` ->
``files[name]``, on ``127.0.0.1`` at an ephemeral port. Faults are
injected per path, either for the next requests (``fail(path, f1, f2)``: the next request to
``path`` gets ``f1``, the one after ``f2``, then service is normal) or for every request
(``fail_always(path, f)``). ``requests[path]`` counts the requests per path, so tests can
assert exact attempt counts, and ``received`` lists each request's path with its query and its
``Authorization`` header (what a signed or ``user:password@`` URL sent). ``Fault.hold()``
keeps a response half sent until the test calls ``release()``, so a test can look at the
client while a read is surely in the middle of a body (``holding`` counts the responses held
now), with no timing involved. ``latency`` delays every
response (``jitter`` spreads it around that mean). ``put(path, body)`` serves fixed bytes at any
other path (an index file); other paths answer 404 (status faults apply to them too). ``Range``
headers are ignored (200 and the whole body, as some servers answer) unless ``ranges=True``:
then ``Range: bytes=a-b`` (or ``a-``) of an object or file is answered 206 with those bytes and
a ``Content-Range``, as S3 and most servers do.

Three ways to run it:

- in the test's own loop: ``async with FaultServer() as server: ...``;
- in a background thread with its own loop: ``with FaultServer().in_thread() as server: ...``;
- as a process: ``python tests/http_server.py --size 65536 --latency 0.02`` (``--jitter 0.25``
  to spread the latency) prints ``PORT <n>`` once it listens and serves until SIGTERM / SIGINT
  or stdin closes (``--files DIR`` serves DIR's files too, read into memory first).

Every wait inside a handler (latency, stalls) ends when the server stops, so stopping never
waits for a stall to run out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import random
import sys
import threading
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from aiohttp import web

HOST = "127.0.0.1"
#: How long stopping waits for handlers still running; they all wake on stop, so it is short.
SHUTDOWN_TIMEOUT_S = 1.0
#: How long starting or stopping the background thread may take before the test fails.
THREAD_TIMEOUT_S = 10.0
DEFAULT_SIZE = 1024

#: ``Fault.endless()``: the body's pieces, and the most it sends before it gives up on a client
#: that never stops reading (a test must end even if the client's bound fails).
ENDLESS_PIECE = 64 << 10
ENDLESS_CAP = 256 << 20


#: Objects are windows into one random block per size, shifted by up to this many bytes.
PAYLOAD_WINDOW = 4096


@functools.lru_cache(maxsize=64)
def _block(size: int) -> bytes:
    return random.Random(size).randbytes(size + PAYLOAD_WINDOW)


def payload(index: int, size: int = DEFAULT_SIZE) -> bytes:
    """The bytes of object ``index``: deterministic, pseudo-random, different per index.

    Eight bytes of ``index`` and then a window of a random block, shifted by ``index``: as
    cheap as a copy, so the server spends its time serving, not generating (a fresh random
    64 KiB costs ~0.4 ms, more than the whole request).
    """
    head = (index % 2**64).to_bytes(8, "little")
    shift = (index * 2654435761) % PAYLOAD_WINDOW
    return (head + _block(size)[shift : shift + size])[:size]


@dataclass(frozen=True, slots=True)
class Fault:
    """What to do to one response instead of serving it normally.

    Kinds: ``status`` (answer ``status`` with an optional ``Retry-After``), ``latency`` (serve
    normally after ``seconds``), ``reset`` (send half the body, then abort the connection),
    ``short`` (promise the full Content-Length, send half, then close cleanly), ``long``
    (promise a Content-Length of half the body, send all of it, then close cleanly),
    ``long_late`` (promise half, send that half, and the rest ``seconds`` later on the same
    connection, kept open), ``stall`` (send the headers, then stay silent for ``seconds``,
    then send the body), ``hold`` (send the headers and half the body, then wait until
    :meth:`FaultServer.release` is called, then send the rest), ``endless`` (a chunked body
    without ``Content-Length`` that goes on until the client leaves, up to ``ENDLESS_CAP``).
    """

    kind: str
    status: int = 200
    seconds: float = 0.0
    retry_after: str | None = None

    @classmethod
    def http(cls, status: int, retry_after: str | None = None) -> Fault:
        return cls("status", status=status, retry_after=retry_after)

    @classmethod
    def latency(cls, seconds: float) -> Fault:
        return cls("latency", seconds=seconds)

    @classmethod
    def reset(cls) -> Fault:
        return cls("reset")

    @classmethod
    def short(cls) -> Fault:
        return cls("short")

    @classmethod
    def long(cls) -> Fault:
        return cls("long")

    @classmethod
    def long_late(cls, seconds: float = 0.2) -> Fault:
        return cls("long_late", seconds=seconds)

    @classmethod
    def stall(cls, seconds: float = 30.0) -> Fault:
        return cls("stall", seconds=seconds)

    @classmethod
    def hold(cls) -> Fault:
        return cls("hold")

    @classmethod
    def endless(cls) -> Fault:
        return cls("endless")


class FaultServer:
    """The server; see the module docstring.

    Args:
        size: default object size in bytes.
        latency: seconds added before every response.
        jitter: spread of that latency, as a fraction of it: each response waits a time drawn
            uniformly from ``latency * (1 - jitter)`` to ``latency * (1 + jitter)``, from one
            seeded generator (the same sequence of waits each time the server starts, given to
            requests in the order they come). 0 makes every wait equal.
        ranges: honour ``Range`` headers (see the module docstring); ignored by default.
    """

    def __init__(
        self,
        *,
        size: int = DEFAULT_SIZE,
        latency: float = 0.0,
        jitter: float = 0.0,
        ranges: bool = False,
    ) -> None:
        if not 0.0 <= jitter <= 1.0:
            raise ValueError(f"jitter must be from 0 to 1, got {jitter!r}")
        self.size = size
        self.latency = latency
        self.jitter = jitter
        self._draws = random.Random(0)
        self.ranges = ranges
        self.requests: Counter[str] = Counter()
        self.received: list[tuple[str, str | None]] = []  # (path and query, Authorization)
        self.files: dict[str, bytes] = {}  # served at /files/{name}
        self.active = 0  # requests being answered now
        self.most_active = 0  # the most at once so far
        self.holding = 0  # responses held by Fault.hold now
        self._lock = threading.Lock()  # the test thread and the server thread both touch state
        self._script: dict[str, deque[Fault]] = {}
        self._always: dict[str, Fault] = {}
        self._files: dict[str, bytes] = {}
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None
        self._released: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def next_latency(self) -> float:
        """The wait added before the next response: ``latency``, spread by ``jitter``."""
        if not self.jitter:
            return self.latency
        return self.latency * (1.0 + self.jitter * (2.0 * self._draws.random() - 1.0))

    # -- configuration (any thread) ------------------------------------------------------

    def url(self, path: str) -> str:
        return f"http://{HOST}:{self.port}{path}"

    def obj_url(self, index: int, *, size: int | None = None) -> str:
        query = f"?size={size}" if size is not None else ""
        return self.url(f"/obj/{index}{query}")

    def file_url(self, name: str) -> str:
        return self.url(f"/files/{name}")

    def fail(self, path: str, *faults: Fault) -> None:
        """The next requests to ``path`` get ``faults``, one each, in order."""
        with self._lock:
            self._script.setdefault(path, deque()).extend(faults)

    def fail_always(self, path: str, fault: Fault) -> None:
        """Every request to ``path`` gets ``fault``."""
        with self._lock:
            self._always[path] = fault

    def put(self, path: str, body: bytes) -> str:
        """Serve ``body`` at ``path`` from now on; returns its URL."""
        with self._lock:
            self._files[path] = body
        return self.url(path)

    def release(self) -> None:
        """Let every held response (``Fault.hold``) finish, and those held from now on."""
        assert self._loop is not None
        assert self._released is not None
        self._loop.call_soon_threadsafe(self._released.set)

    def count(self, path: str) -> int:
        with self._lock:
            return self.requests[path]

    def _next_fault(self, path: str) -> Fault | None:
        with self._lock:
            self.requests[path] += 1
            script = self._script.get(path)
            if script:
                return script.popleft()
            return self._always.get(path)

    # -- serving -------------------------------------------------------------------------

    async def _pause(self, seconds: float) -> None:
        """Sleep up to ``seconds``, or less if the server stops meanwhile."""
        assert self._stopping is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    def _receive(self, request: web.Request) -> None:
        with self._lock:
            self.received.append((request.path_qs, request.headers.get("Authorization")))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self._receive(request)
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            return await self._answer(request)
        finally:
            self.active -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        fault = self._next_fault(request.path)
        if self.latency:
            # A plain sleep: cheaper than _pause's wait_for, and short enough not to delay stop.
            await asyncio.sleep(self.next_latency())
        name = request.match_info.get("name")
        if name is not None:
            if name not in self.files:
                return web.Response(status=404, text="no such file")
            body = self.files[name]
        else:
            index = int(request.match_info["index"])
            body = payload(index, int(request.query.get("size", self.size)))
        if fault is None:
            return self._whole_or_range(request, body)
        if fault.kind == "status":
            headers = {"Retry-After": fault.retry_after} if fault.retry_after is not None else {}
            return web.Response(
                status=fault.status, text=f"injected {fault.status}", headers=headers
            )
        if fault.kind == "latency":
            await self._pause(fault.seconds)
            return self._whole_or_range(request, body)
        if fault.kind == "endless":
            return await self._endless(request)
        response = web.StreamResponse()
        long = fault.kind in ("long", "long_late")
        response.content_length = len(body) // 2 if long else len(body)
        await response.prepare(request)  # sends the status line and headers now
        if fault.kind == "stall":
            await self._pause(fault.seconds)
            transport = request.transport
            if transport is None or transport.is_closing():
                raise asyncio.CancelledError  # the client gave up meanwhile: nothing to send
            await response.write(body)
            return response
        if fault.kind == "hold":
            await response.write(body[: len(body) // 2])
            assert self._released is not None
            assert self._stopping is not None
            waits = [asyncio.ensure_future(e.wait()) for e in (self._released, self._stopping)]
            self.holding += 1
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.holding -= 1
                for wait in waits:
                    wait.cancel()
            await response.write(body[len(body) // 2 :])
            return response
        if fault.kind not in ("reset", "short", "long", "long_late"):  # pragma: no cover
            raise ValueError(f"unknown fault kind {fault.kind!r}")
        transport = request.transport
        if fault.kind == "long_late" and transport is not None:
            # The promised half completes a response; the rest follows on the connection
            # the client keeps for its next request.
            transport.write(body[: len(body) // 2])
            await self._pause(fault.seconds)
            if not transport.is_closing():
                transport.write(body[len(body) // 2 :])
            await self._pause(30.0)  # keep it open: the stray bytes wait there
            raise asyncio.CancelledError
        if fault.kind == "long":
            if transport is not None:
                # Straight to the socket, in one write: aiohttp's writer would stop at the
                # Content-Length it announced.
                transport.write(body)
                transport.close()
            raise asyncio.CancelledError
        await response.write(body[: len(body) // 2])
        if transport is not None:
            if fault.kind == "reset":
                transport.abort()  # RST: the peer sees a reset, buffered bytes are dropped
            else:
                transport.close()  # FIN after the half already written: a clean short body
        # The connection is gone; end the handler without aiohttp writing the rest.
        raise asyncio.CancelledError

    async def _endless(self, request: web.Request) -> web.StreamResponse:
        """A chunked body that goes on while the client reads (``Fault.endless``)."""
        assert self._stopping is not None
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        if request.method == "HEAD":
            return response
        piece = bytes(ENDLESS_PIECE)
        for _ in range(ENDLESS_CAP // ENDLESS_PIECE):
            transport = request.transport
            if transport is None or transport.is_closing() or self._stopping.is_set():
                break
            try:
                await response.write(piece)
            except ConnectionError:
                break
        raise asyncio.CancelledError  # the client left (or the cap): nothing more to send

    def _whole_or_range(self, request: web.Request, body: bytes) -> web.Response:
        """``body``, or with ``ranges`` the one range ``Range: bytes=a-b`` asks for."""
        asked = request.headers.get("Range", "") if self.ranges else ""
        first, dash, last = asked.removeprefix("bytes=").partition("-")
        if not (asked.startswith("bytes=") and dash and first.isdigit()):
            return web.Response(body=body, content_type="application/octet-stream")
        start, end = int(first), min(int(last) if last.isdigit() else len(body), len(body) - 1)
        if start >= len(body):
            return web.Response(status=416, headers={"Content-Range": f"bytes */{len(body)}"})
        return web.Response(
            status=206,
            body=body[start : end + 1],
            content_type="application/octet-stream",
            headers={"Content-Range": f"bytes {start}-{end}/{len(body)}"},
        )

    async def _handle_file(self, request: web.Request) -> web.StreamResponse:
        self._receive(request)
        fault = self._next_fault(request.path)
        if fault is not None and fault.kind == "status":
            return web.Response(status=fault.status, text=f"injected {fault.status}")
        with self._lock:
            body = self._files.get(request.path)
        if body is None:
            return web.Response(status=404, text="not found")
        return web.Response(body=body, content_type="text/plain")

    async def start(self) -> None:
        """Listen on 127.0.0.1 at an ephemeral port (``self.port``)."""
        self._stopping = asyncio.Event()
        self._released = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        app = web.Application()
        app.router.add_get("/obj/{index}", self._handle)
        app.router.add_get("/files/{name}", self._handle)
        app.router.add_get("/{path:.*}", self._handle_file)  # put(): after the routes above
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT_S
        )
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, HOST, 0).start()
            self.port = int(self._runner.addresses[0][1])
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Wake every waiting handler, then close the listener and every connection."""
        if self._stopping is not None:
            self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- in a background thread ----------------------------------------------------------

    @contextlib.contextmanager
    def in_thread(self) -> Iterator[Self]:
        """Serve from a thread with its own event loop while the ``with`` block runs."""
        ready = threading.Event()
        stop: list[asyncio.Event] = []
        failure: list[BaseException] = []

        async def serve() -> None:
            await self.start()
            done = asyncio.Event()
            stop.append(done)
            ready.set()
            try:
                await done.wait()
            finally:
                await self.stop()

        def run() -> None:
            try:
                asyncio.run(serve())
            except BaseException as exc:  # reported to the test thread below
                failure.append(exc)
                ready.set()

        thread = threading.Thread(target=run, name="fault-http-server", daemon=True)
        thread.start()
        if not ready.wait(THREAD_TIMEOUT_S) or failure:
            raise RuntimeError(f"the test server did not start: {failure}")
        try:
            yield self
        finally:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(stop[0].set)
            thread.join(THREAD_TIMEOUT_S)
            if thread.is_alive():  # pragma: no cover - a bug in the server
                raise RuntimeError("the test server thread did not stop")


def _read_files(directory: str) -> dict[str, bytes]:
    files = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            files[name] = f.read()
    return files


async def _main(args: argparse.Namespace) -> None:
    import signal

    server = FaultServer(size=args.size, latency=args.latency, jitter=args.jitter)
    if args.files:
        server.files.update(_read_files(args.files))  # before serving: blocking is fine here
    await server.start()
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    # Stdin closing (the parent died) also stops the server.
    loop.add_reader(sys.stdin.fileno(), lambda: done.set() if not sys.stdin.read(1) else None)
    print(f"PORT {server.port}", flush=True)
    try:
        await done.wait()
    finally:
        loop.remove_reader(sys.stdin.fileno())
        await server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=DEFAULT_SIZE, help="object size in bytes")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added per response")
    parser.add_argument(
        "--jitter", type=float, default=0.0, help="latency spread, a fraction of --latency"
    )
    parser.add_argument("--uvloop", action="store_true", help="serve on uvloop")
    parser.add_argument("--files", help="serve the files of this directory at /files/{name}")
    arguments = parser.parse_args()
    if arguments.uvloop:
        import uvloop

        uvloop.run(_main(arguments))
    else:
        asyncio.run(_main(arguments))
