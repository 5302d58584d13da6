"""A request's time on the wire: counted in flight and watched for stalls once it has a connection.

aiohttp's trace signals tell when a request has a connection (its headers are sent), so the
two measures a user reads while a remote read runs start there, not when the request was
made::

    fetch / stream ─▶ session.get ─▶ wait for a pooled connection ─▶ headers sent ─▶ body ─▶ close
                                     (max_connections busy:            │                      │
                                      said once, not in flight,        └── requests_in_flight ┘
                                      not a stall)                         and the stall watch

Sharp edges:

- Waiting for a connection is back-pressure of ``max_connections``, not a fault of the server:
  it is neither counted in ``requests_in_flight`` nor reported as a stall (a loader asking for
  more requests than there are connections would otherwise warn of stalls against a healthy
  server). The first wait of a session logs one WARNING, so the cap is never silent.
- The watch is one timer per request, not work per chunk; a stream's reader that holds a chunk
  stops its clock (:meth:`Wire.hold`), as aiohttp stops reading a socket whose buffer is full.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from .._log import remote_log
from .._stats import current_counters
from ._redact import redact

if TYPE_CHECKING:
    import aiohttp

__all__ = ["Wire", "wire_trace"]


def wire_trace(limit: int) -> aiohttp.TraceConfig:
    """The trace that tells each request's :class:`Wire` when it has a connection, and says
    once per session that requests wait for one (all ``max_connections`` are busy)."""
    import aiohttp

    trace = aiohttp.TraceConfig()
    said = False

    async def queued(*_: object) -> None:
        nonlocal said
        if not said:
            said = True
            remote_log.warning(
                "all max_connections=%d connections are busy: further requests wait for one "
                "(neither in requests_in_flight nor stalls while they wait); raise "
                "HTTPDataset's max_connections to have more on the wire",
                limit,
            )

    async def sent(_: object, context: Any, __: object) -> None:
        wire = context.trace_request_ctx
        if isinstance(wire, Wire):
            wire.sent()

    trace.on_connection_queued_start.append(queued)
    trace.on_request_headers_sent.append(sent)
    return trace


class Wire:
    """One request's time on the wire: counted in ``requests_in_flight`` and watched for
    stalls from the moment its headers are sent (it has a connection; aiohttp's trace calls
    :meth:`sent`) until :meth:`close`. Waiting for a pooled connection is neither:
    ``max_connections`` is back-pressure, not a fault of the server.

    The watch warns once if the request goes ``after`` seconds without a byte. Progress is
    the response's arrival, then the body's byte count (aiohttp's ``StreamReader.total_bytes``),
    sampled every quarter of ``after`` by one timer on the loop: nothing is done per chunk,
    and the warning comes between ``after`` and ``1.25 * after`` seconds into a silence. While
    a stream's reader holds a chunk (:meth:`hold` to :meth:`wait`) the clock stands still:
    aiohttp stops reading a socket whose buffer is full, and that is the reader's lag.
    """

    def __init__(self, url: str, after: float | None) -> None:
        self._url = url
        self._after = after
        self._loop = asyncio.get_running_loop()
        self._counters = current_counters.get()
        self._reader: aiohttp.StreamReader | None = None
        self._on_wire = False
        self._held = False
        self._seen = -1  # progress at the last check: -1 before the response
        self._since = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def sent(self) -> None:
        """The request has a connection and its headers are sent (again, after a redirect)."""
        if self._on_wire:
            return
        self._on_wire = True
        if self._counters is not None:
            self._counters.remote_in_flight += 1
        if self._after is not None:
            self._since = self._loop.time()
            self._handle = self._loop.call_later(self._after / 4, self._check)

    def reading(self, reader: aiohttp.StreamReader) -> None:
        """The response arrived: from now on, its body's bytes are the progress."""
        self._reader = reader

    def hold(self) -> None:
        """The reader is busy with a chunk: the silence that follows is not the server's."""
        self._held = True

    def wait(self) -> None:
        """The reader waits for the next chunk again: the clock runs from now."""
        self._held = False
        self._since = self._loop.time()

    def _check(self) -> None:
        assert self._after is not None
        now = self._loop.time()
        seen = -1 if self._reader is None else self._reader.total_bytes
        if seen != self._seen or self._held:
            self._seen, self._since = seen, now
        elif now - self._since >= self._after:
            self._handle = None
            if self._counters is not None:
                self._counters.remote_stalls += 1
            what = "no response" if seen < 0 else f"no byte after {seen} bytes of the body"
            remote_log.warning(
                "%s stalls: %s for %.1f s (stall_warning=%s s); the read timeout ends it",
                redact(self._url),
                what,
                now - self._since,
                self._after,
            )
            return
        self._handle = self._loop.call_later(self._after / 4, self._check)

    def close(self) -> None:
        """The request is over (its body read or released): off the wire, unwatched."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._on_wire:
            self._on_wire = False
            if self._counters is not None:
                self._counters.remote_in_flight -= 1
