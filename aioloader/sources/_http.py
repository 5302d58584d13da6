"""Objects over HTTP(S) as an async two-stage dataset, through aiohttp.

``HTTPDataset(urls)`` makes ``fetch(i)`` GET ``urls[i]`` with retries::

    fetch(i) ──▶ retrying(policy, deadline) ──▶ one attempt on the loop's pooled session
                                                  │
      2xx, length == Content-Length ──────────────┼──▶ bytes
      Content-Length, or the body, over the bound ┼──▶ RemoteError, no retry
      timeout (connect, or read silence) ─────────┼──▶ RetryableError(timed_out)
      reset, short body, payload error ───────────┼──▶ RetryableError
      long body, bytes that are not HTTP ─────────┼──▶ RetryableError
      policy.retry_statuses (408/425/429/500/ ────┼──▶ RetryableError(Retry-After)
        502/503/504 by default; other 5xx final)  │
      404 ────────────────────────────────────────┼──▶ RemoteNotFoundError, no retry
      401/403 ────────────────────────────────────┼──▶ RemotePermissionError, no retry
      any other status ───────────────────────────┴──▶ RemoteError, no retry

Timeouts are per attempt: ``connect_timeout`` bounds opening a socket (waiting for a free
connection of the pool is not a failure and is not bounded), ``read_timeout`` bounds the silence
between two reads, so a server that sends headers and then stalls is caught without limiting
how long a large but flowing body may take. ``item_deadline`` bounds all attempts of one item.
``max_object_bytes`` bounds what one fetch holds: a ``Content-Length`` over it is refused
before the body is read, and a body without one is refused as soon as it passes it (a server
that streams without end, a URL that names a far larger object than meant). URLs are shown
masked (:mod:`._redact`): the request carries them as given.
Before a timeout, ``stall_warning`` seconds without a byte (headers or body, counted from the
moment the request has a connection) log a WARNING on ``aioloader.remote``, once per attempt,
and count in the loader's ``statistics().remote_stalls``: a read that hangs is visible while it
hangs. A request counts in ``statistics().requests_in_flight`` from the moment it has a
connection until its body is read (see :mod:`._inflight`): at most ``max_connections`` at once
(by default as many as the loader's ``io_concurrency``, 256 at least); the first request of a
session that has to wait for a connection logs one WARNING saying so.

Sharp edges:

- One ``aiohttp.ClientSession`` per event loop (see :mod:`._base`), created on first use: the
  dataset pickles without it, and the sessions are closed by ``aclose()``, or when their loop
  shuts down (``asyncio.run`` ending: see :class:`._base.PerLoop`).
- Requests ask for ``Accept-Encoding: identity``: ``fetch`` returns the object's bytes as stored,
  and their length can be checked against ``Content-Length``. If a server compresses anyway,
  aiohttp decompresses and the length check is skipped (the header counts compressed bytes).
- A body longer than its ``Content-Length`` is only visible as bytes after the response: aiohttp
  reads exactly the promised length and hands what follows to its parser as the next response.
  If the extra bytes arrive with the headers, the parser fails before there is a response
  (``ClientResponseError`` caused by ``HttpProcessingError``): retried as a malformed response.
  If they arrive with the end of a body read in several pieces, the promised part completes
  and would pass the length check; the connection's parser has failed meanwhile, so the body
  is refused and the read retried. Extra bytes that arrive only after the body was returned
  cannot be told from a correct response; they fail the next request on that connection, as
  a malformed response, which is retried.
- aiohttp is imported when the first dataset is made, not when :mod:`aioloader` is imported:
  it is the ``remote`` extra.
- HTTP cannot list a directory: :func:`read_index` reads an *index file* instead, a text file
  with one URL per line (relative ones are resolved against the index's URL), fetched with
  the same retries and length check as a sample. :meth:`HTTPDataset.from_index` builds a
  dataset from one.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

from .._errors import RemoteError, RemoteNotFoundError, RemotePermissionError
from .._stats import current_counters
from .._validate import callable_or_none, positive_int, seconds, value_errors
from ._base import (
    MAX_OBJECT_BYTES,
    Source,
    as_names,
    byte_limit,
    read_bounded,
    require,
    run_sync,
    too_large,
)
from ._inflight import Wire, wire_trace
from ._redact import MARKER, redact
from ._retry import (
    Attempts,
    RetryableError,
    RetryPolicy,
    parse_retry_after,
    raise_final,
    retrying,
)

if TYPE_CHECKING:
    import aiohttp

__all__ = ["HTTPDataset", "read_index"]

SCHEMES = frozenset({"http", "https"})

#: Seconds without a byte before an attempt is said to stall (``stall_warning``): long enough
#: that a slow but live server is not reported (a first byte rarely takes seconds), short
#: enough to be seen well before the default ``read_timeout`` of 30 s ends the attempt.
STALL_WARNING_S = 10.0

#: The ``chunk_size`` of :meth:`HTTPDataset.stream`, for a signature like the other sources'
#: (over HTTP, chunks are handed over as they are received, whatever their size).
STREAM_CHUNK = 1 << 20

#: Connections per event loop when ``max_connections`` is not given and no loader asked for more
#: (each is a socket and a file descriptor).
DEFAULT_MAX_CONNECTIONS = 256

#: Default headers; the user's ``headers`` override them.
BASE_HEADERS: Mapping[str, str] = {"Accept-Encoding": "identity"}


#: What may not begin the authority of the common form: it names no host then.
_NO_HOST = ("", "/", "?", "#", ":")


def _check_url(url: str, position: int) -> str:
    # The common form, "http(s)://host...", told by string tests: urlsplit costs about 2 us a
    # URL, seconds for the millions of URLs of a large remote set. Anything else is judged by
    # urlsplit, as before (the host is what follows "//" up to the first "/", "?" or "#").
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in SCHEMES and "@" not in rest and rest[:1] not in _NO_HOST:
        return url
    parts = urllib.parse.urlsplit(url)
    if "@" in url and _bad_userinfo(parts):
        # Shown up to its last "@" masked: where the password ends cannot be told.
        shown = f"{parts.scheme}://{MARKER}@{url.rpartition('@')[2]}"
        raise ValueError(
            f"urls[{position}]={shown!r} has a user info with an unescaped '/', '?' or '#' (or "
            "names no port after its ':'): percent-encode them in the password (%2F, %3F, "
            "%23), or give the credentials as headers"
        )
    try:
        host = parts.hostname
    except ValueError:  # a malformed bracketed host
        host = None
    if parts.scheme.lower() in SCHEMES and parts.netloc and not host:
        raise ValueError(f"urls[{position}]={redact(url)!r} names no host (like http://host/x)")
    if parts.scheme.lower() not in SCHEMES or not host:
        raise ValueError(
            f"urls[{position}]={redact(url)!r} is not an http:// or https:// URL; HTTPDataset "
            "reads only those (FsspecDataset reads s3://, gs:// and others)"
        )
    return url


def _bad_userinfo(parts: urllib.parse.SplitResult) -> bool:
    """Whether a URL with an "@" was cut inside its user info: a password's "/", "?" or "#"
    ends the authority early, so what is left of it reads as a host with a port that is no
    number, or the "@" lands in the fragment."""
    if "@" in parts.fragment:
        return True
    try:
        parts.port  # noqa: B018 (raises for a port that is no number)
    except ValueError:
        return "@" not in parts.netloc  # "user:pa" read as host and port
    return False


# aiohttp's parse errors quote the bytes they could not read; the attempt list keeps this much.
_MESSAGE_MAX = 120
_QUOTED = ("b'", 'b"')  # how aiohttp quotes the bytes it could not parse


def _name(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _parse_failure(message: str) -> str:
    """The gist of an aiohttp parse error: its words, without the quoted bytes and the caret."""
    lines = (line.strip() for line in message.splitlines())
    words = (line for line in lines if line.strip("^ ") and not line.startswith(_QUOTED))
    text = " ".join(words)
    return text if len(text) <= _MESSAGE_MAX else text[: _MESSAGE_MAX - 3] + "..."


class HTTPDataset(Source):
    """Objects over HTTP(S), one sample per URL, fetched concurrently with retries.

    Example::

        urls = [f"https://data.example.com/img/{i}.jpg" for i in range(100_000)]
        ds = HTTPDataset(urls, decode=decode_jpeg, retry=RetryPolicy(max_attempts=8))
        async with DataLoader(ds, batch_size=256, io_concurrency=256) as loader:
            async for batch in loader: ...

    Args:
        urls: the objects' URLs (http or https; one string counts as one URL).
        decode: turns an object's bytes into a sample, off the event loop; ``None`` keeps
            bytes. Must be picklable to be used with worker processes.
        retry: attempts, backoff and Retry-After handling.
        connect_timeout: seconds to open a connection, per attempt (``None``: no limit).
        read_timeout: longest silence between two reads, per attempt (``None``: no limit).
        item_deadline: seconds for all attempts of one item, waits included (``None``: no
            limit).
        max_connections: connections open at once per event loop: the most requests on the
            wire. Requests beyond it wait for a free connection (said once per session by a
            WARNING; the wait is neither in flight nor a stall). ``None``: 256, or the
            ``io_concurrency`` of the loaders reading the dataset where that is more (the
            most of those made before the loop's session opened).
        stall_warning: seconds an attempt may go without receiving a byte once it has a
            connection before a WARNING is logged (once per attempt), or ``None`` for never.
            Below ``read_timeout``, so a hang is said before it is retried.
        headers: extra request headers (authorisation, user agent).
        max_object_bytes: the most bytes one :meth:`fetch` holds: an object whose
            ``Content-Length`` is larger is refused before its body is read, one without a
            length as soon as its body passes it (a ``RemoteError`` naming the masked URL, the
            size and this setting; not retried; skipped under ``on_error="skip"``). ``None``:
            no bound. :meth:`stream` hands chunks on and is not bounded by it (a tar shard's
            members are: ``TarDataset``'s ``max_member_bytes``).
        sleep: awaited between attempts with the delay in seconds; for tests to record the
            delays instead of waiting them. ``None`` means :func:`asyncio.sleep`.

    Raises:
        ValueError: a URL that is not http(s) or names no host (``http://:80/x``), or a
            timeout or ``max_connections`` out of range or of the wrong type (then also a
            ``TypeError``), naming the argument and the value.
        TypeError: ``urls``, ``retry``, ``headers`` (or a header's name or value that is not
            a ``str``; the message names the header, never its value), ``decode`` or
            ``sleep`` of the wrong type.
        ImportError: aiohttp is not installed (``pip install 'aioloader[remote]'``).
    """

    def __init__(
        self,
        urls: Iterable[str] | str,
        decode: Callable[[bytes], Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        connect_timeout: float | None = 10.0,
        read_timeout: float | None = 30.0,
        item_deadline: float | None = None,
        max_connections: int | None = None,
        headers: Mapping[str, str] | None = None,
        sleep: Callable[[float], Awaitable[object]] | None = None,
        stall_warning: float | None = STALL_WARNING_S,
        max_object_bytes: int | None = MAX_OBJECT_BYTES,
    ) -> None:
        super().__init__(decode)
        require("aiohttp", "HTTPDataset")
        names = as_names(urls, "urls")
        self._urls = tuple(_check_url(url, i) for i, url in enumerate(names))
        if retry is None:
            retry = RetryPolicy()
        if not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy, got {retry!r}")
        self._retry = retry
        with value_errors():  # ValueError for any bad timeout, as always (also a TypeError)
            self._connect_timeout = seconds("connect_timeout", connect_timeout, positive=True)
            self._read_timeout = seconds("read_timeout", read_timeout, positive=True)
            self._item_deadline = seconds("item_deadline", item_deadline, positive=True)
            self._max_connections = (
                None
                if max_connections is None
                else positive_int("max_connections", max_connections)
            )
            self._stall_warning = seconds("stall_warning", stall_warning, positive=True)
        self._max_object_bytes = byte_limit("max_object_bytes", max_object_bytes)
        if headers is not None and not isinstance(headers, Mapping):
            # The type only, never the value: a list of pairs holds the credentials themselves.
            raise TypeError(
                f"headers must be a mapping of str to str, got a {type(headers).__name__}"
            )
        for name, value in (headers or {}).items():
            if not isinstance(name, str) or not isinstance(value, str):
                # The type only, never the value: a header's value is often a credential.
                raise TypeError(
                    f"headers must map str to str; headers[{name!r}] is a {type(value).__name__}"
                    if isinstance(name, str)
                    else f"headers must map str to str; a name is a {type(name).__name__}"
                )
        self._headers = {**BASE_HEADERS, **(headers or {})}
        self._sleep = callable_or_none("sleep", sleep)
        self._expected_in_flight = 0  # the most fetches a loader said it may have in flight

    @classmethod
    def from_index(
        cls, index_url: str, decode: Callable[[bytes], Any] | None = None, **options: Any
    ) -> Self:
        """A dataset of the URLs an index file lists, in the file's order (see
        :func:`read_index`). The index is read with the same options as the samples.

        Blocking; in async code, build the dataset from ``await read_index(...)`` (or
        ``await aioloader.sources.alist_objects(index_url)``).

        Example::

            ds = HTTPDataset.from_index("https://data.example.com/train/index.txt")

        Raises:
            RemoteNotFoundError: the index does not exist or lists no URL; names its URL.
        """
        return cls(run_sync(lambda: read_index(index_url, **options)), decode, **options)

    @property
    def urls(self) -> tuple[str, ...]:
        """The URLs, in index order."""
        return self._urls

    @property
    def retry(self) -> RetryPolicy:
        """The retry policy every fetch follows."""
        return self._retry

    def item_name(self, index: int) -> str:
        """Where item ``index`` comes from, for the notes of its errors (masked)."""
        return redact(self._urls[index])

    def __len__(self) -> int:
        return len(self._urls)

    def __repr__(self) -> str:
        first = f", first={redact(self._urls[0])!r}" if self._urls else ""
        return f"HTTPDataset({len(self._urls)} urls{first}, open_sessions={len(self._pools)})"

    async def fetch(self, index: int) -> bytes:
        """GET ``urls[index]`` with retries and return the body, its length checked.

        Raises:
            RemoteNotFoundError: HTTP 404 (also a ``FileNotFoundError``); not retried.
            RemotePermissionError: HTTP 401/403 (also a ``PermissionError``); not retried.
            RemoteTimeoutError: every attempt failed and the last one timed out, or the item
                deadline passed (also a ``TimeoutError``).
            RetriesExhaustedError: every attempt failed; the message lists them.
            RemoteError: a status that is neither success nor retryable, or an object over
                ``max_object_bytes``.
        """
        url = self._urls[self._check_index(index)]
        # The session is taken per attempt: one closed under a request (the dataset's
        # aclose()) fails that attempt, and the next opens a new one.
        return await retrying(
            lambda: self._attempt(self._pool(), url),
            policy=self._retry,
            describe=url,
            deadline=self._item_deadline,
            sleep=asyncio.sleep if self._sleep is None else self._sleep,
            count_in_flight=False,  # Wire counts it once it has a connection
        )

    async def stream(
        self, index: int, chunk_size: int = STREAM_CHUNK
    ) -> AsyncGenerator[bytes, None]:
        """The body of ``urls[index]`` in chunks as they arrive (of any size: ``chunk_size``
        is not used here), for objects too large to hold (tar shards).

        Retried as :meth:`fetch` is, with the same backoff and the same final errors. A body
        that breaks off (a reset, a timeout, a short body) is one failed attempt; the next is
        asked from the byte it stopped at with a ``Range`` header (a server that ignores it
        answers 200, and the bytes already handed out are skipped): the bytes handed out are
        never handed out twice, and opening and breaking off share ``max_attempts``.

        A resumed read never joins two versions of an object: it sends ``If-Range`` with the
        first answer's strong ``ETag`` (or its ``Last-Modified`` where it has no ETag), and an
        answer of another version (a 200 to ``If-Range``, another ETag, Last-Modified or
        size) fails with a ``RemoteError`` saying the object changed while it was read (not
        retried: the rest of the new version cannot complete the old one). A server that
        gives neither header cannot be asked: its resumed bytes are taken as they come, as
        long as the size it states (``Content-Range``) is the same. The read
        counts in ``requests_in_flight`` until its body ends, and a body that goes
        ``stall_warning`` seconds without a byte while its reader waits for one is warned
        about as in :meth:`fetch` (time the reader spends on the previous chunk is not a
        stall). ``item_deadline`` bounds each opening (up to the headers): a large shard's
        body may take any time. Close the iterator (``aclosing``) if it is not read to its end.

        Raises:
            RemoteNotFoundError, RemotePermissionError, RemoteError: as :meth:`fetch`.
            RemoteError: the object changed between an attempt that broke off and its resumed
                read, naming the masked URL and both versions.
            RemoteTimeoutError: the attempts ran out and the last one timed out, or an opening
                passed ``item_deadline`` (also a ``TimeoutError``).
            RetriesExhaustedError: the attempts ran out; the message lists each, with the
                bytes received before each break.
        """
        import aiohttp

        url = self._urls[self._check_index(index)]
        counters = current_counters.get()
        sleep = asyncio.sleep if self._sleep is None else self._sleep
        attempts = Attempts(self._retry, url)
        received = 0
        version: _Version | None = None  # what the bytes handed out were cut from
        while True:
            began = attempts.begin()
            wire = Wire(url, self._stall_warning)
            error: BaseException | None = None
            try:
                async with asyncio.timeout(self._item_deadline) as scope:
                    response = await self._open(self._pool(), url, received, version, wire)
            except RetryableError as exc:
                wire.close()
                await sleep(attempts.failed(exc, began))
                continue
            except Exception as exc:
                wire.close()
                expired = scope.expired()
                error = attempts.expired(began, exc) if expired else attempts.final(exc, began)
                if error is exc:
                    raise
            except BaseException:  # cancelled while opening: off the wire, never a stall
                wire.close()
                raise
            if error is not None:
                raise_final(error)  # outside the except clause (see raise_final)
            failure: RetryableError | None = None
            try:
                if received:
                    skip, version = _resumed(url, response, received, version)
                else:
                    skip, version = 0, _Version.of(response, 0)
                wire.reading(response.content)
                # As received, one buffer at a time, never joined: joining is a copy of every
                # byte, and the consumer (a tar parser) takes pieces of any size. (iter_any
                # joins what arrived since the last read: all of it, when the consumer lags.)
                async for chunk, _ in response.content.iter_chunks():
                    if skip:
                        cut, skip = min(skip, len(chunk)), max(0, skip - len(chunk))
                        chunk = chunk[cut:]
                        if not chunk:
                            continue
                    received += len(chunk)
                    if counters is not None:
                        counters.remote_bytes += len(chunk)
                    wire.hold()  # the reader has the chunk: its time is not the server's
                    yield chunk
                    wire.wait()
                total = version.total
                if total is None or received == total:
                    return
                failure = RetryableError(f"short body: {received} of {total} bytes")
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
                timed_out = isinstance(exc, TimeoutError)
                failure = RetryableError(
                    f"broke off after {received} bytes: {_name(exc)}", timed_out=timed_out
                )
                failure.__cause__ = exc
            except RemoteError as exc:  # another object, or other bytes, than those begun
                error = attempts.final(exc, began)
                if error is exc:
                    raise
            finally:
                response.release()
                wire.close()
            if error is not None:
                raise_final(error)
            assert failure is not None
            await sleep(attempts.failed(failure, began))

    async def _open(
        self,
        session: aiohttp.ClientSession,
        url: str,
        start: int,
        version: _Version | None,
        wire: Wire,
    ) -> aiohttp.ClientResponse:
        """One GET up to its headers (for :meth:`stream`), from byte ``start`` on, only if the
        object is still ``version`` (``If-Range``), classified as :meth:`_attempt` classifies."""
        headers: dict[str, str] | None = None
        if start:
            headers = {"Range": f"bytes={start}-"}
            if version is not None and version.validator is not None:
                headers["If-Range"] = version.validator[1]
        with _classified():
            response = await session.get(url, headers=headers, trace_request_ctx=wire)
        if not 200 <= response.status < 300:
            error = self._status_error(url, response)
            response.release()
            raise error
        return response

    async def _attempt(self, session: aiohttp.ClientSession, url: str) -> bytes:
        """One GET; classifies each failure as retryable or final (see the module diagram)."""
        from aiohttp.http_exceptions import HttpProcessingError

        wire = Wire(url, self._stall_warning)
        try:
            with _classified():
                async with session.get(url, trace_request_ctx=wire) as response:
                    wire.reading(response.content)
                    if not 200 <= response.status < 300:
                        raise self._status_error(url, response)
                    connection = response.connection  # released when the body is read
                    protocol = connection.protocol if connection is not None else None
                    expected = _expected_length(response)
                    limit = self._max_object_bytes
                    if limit is not None and expected is not None and expected > limit:
                        raise self._too_large(url, expected)  # before a byte of the body
                    body = await read_bounded(
                        response.content.read, limit, lambda: self._too_large(url, None)
                    )
                    # Invariant: a body of the wrong length is never returned, so a truncated
                    # buffer (or one cut at a Content-Length that promised too little) cannot
                    # reach decode.
                    if expected is not None and len(body) != expected:
                        raise RetryableError(
                            f"truncated body: got {len(body)} of {expected} bytes (Content-Length)"
                        )
                    stray = protocol.exception() if protocol is not None else None
                    if isinstance(stray, HttpProcessingError):
                        promised = (
                            "it" if expected is None else f"its Content-Length ({expected} bytes)"
                        )
                        raise RetryableError(
                            f"body longer than {promised}: more bytes followed"
                        ) from stray
                    return body
        finally:
            wire.close()

    def _too_large(self, url: str, size: int | None) -> RemoteError:
        assert self._max_object_bytes is not None
        message = too_large(redact(url), size, "max_object_bytes", self._max_object_bytes)
        return RemoteError(message, url=url)

    def _status_error(self, url: str, response: aiohttp.ClientResponse) -> Exception:
        status = response.status
        reason = f"HTTP {status} {response.reason or ''}".rstrip()
        shown = redact(url)
        if status == 404:
            return RemoteNotFoundError(f"{shown}: {reason}", url=url)
        if status in (401, 403):
            return RemotePermissionError(f"{shown}: {reason}", url=url)
        if status in self._retry.retry_statuses:
            header = response.headers.get("Retry-After")
            if header is not None:
                reason = f"{reason} (Retry-After: {header})"
            return RetryableError(reason, retry_after=parse_retry_after(header))
        return RemoteError(f"{shown}: {reason} (not a retryable status)", url=url)

    # -- the per-loop session ------------------------------------------------------------

    def expect_in_flight(self, fetches: int) -> None:
        """Size the sessions opened from now on for ``fetches`` requests at once, where
        ``max_connections`` was left to its default (see :meth:`Source.expect_in_flight`)."""
        self._expected_in_flight = max(self._expected_in_flight, fetches)

    def _connection_limit(self) -> int:
        if self._max_connections is not None:
            return self._max_connections
        return max(DEFAULT_MAX_CONNECTIONS, self._expected_in_flight)

    def _open_pool(self) -> aiohttp.ClientSession:
        import aiohttp

        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=None,  # waiting for a pooled connection is back-pressure, not a fault
            sock_connect=self._connect_timeout,
            sock_read=self._read_timeout,
        )
        limit = self._connection_limit()
        connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0)
        return aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            headers=self._headers,
            raise_for_status=False,
            trace_configs=[wire_trace(limit)],
        )

    async def _close_pool(self, pool: aiohttp.ClientSession) -> None:
        await pool.close()

    def _discard_pool(self, pool: aiohttp.ClientSession) -> None:
        # The session's loop is closed or idle, so nothing can be awaited: close the sockets
        # synchronously (aiohttp's connector has no public sync close) and mark the session
        # closed, so it does not warn "Unclosed client session" when collected.
        connector = pool.connector
        close_now = getattr(connector, "_close", None)
        if callable(close_now):
            with contextlib.suppress(RuntimeError):  # a closed loop took its sockets along
                close_now()
        pool.detach()


@contextlib.contextmanager
def _classified() -> Iterator[None]:
    """Each aiohttp failure of a request as retryable (:class:`RetryableError`) or final (see
    the module diagram): the one classification of :meth:`HTTPDataset._attempt` and
    :meth:`HTTPDataset._open`."""
    import aiohttp
    from aiohttp.http_exceptions import HttpProcessingError

    try:
        yield
    except aiohttp.ClientResponseError as exc:
        if not isinstance(exc.__cause__, HttpProcessingError):
            raise  # not a parse error (too many redirects, a proxy's refusal)
        # Bytes that are not HTTP where a response should begin: most often the excess of
        # a body longer than its Content-Length, read together with the headers.
        raise RetryableError(
            "malformed response (bytes that are not HTTP, e.g. the excess of a body longer "
            f"than its Content-Length): {_parse_failure(exc.message)}"
        ) from exc
    except aiohttp.ServerTimeoutError as exc:  # before ClientConnectionError: a subclass
        raise RetryableError(f"timeout: {_name(exc)}", timed_out=True) from exc
    except aiohttp.ClientConnectorCertificateError:
        raise  # a certificate does not become valid by asking again
    except aiohttp.ClientPayloadError as exc:
        raise RetryableError(f"truncated body: {_name(exc)}") from exc
    except aiohttp.ClientConnectionError as exc:
        raise RetryableError(f"connection failed: {_name(exc)}") from exc
    except TimeoutError as exc:  # e.g. a resolver's own timeout
        raise RetryableError(f"timeout: {_name(exc)}", timed_out=True) from exc


@dataclass(frozen=True, slots=True)
class _Version:
    """Which version of an object a stream's bytes come from: the header that names it
    (``validator``: a strong ``ETag``, else ``Last-Modified``; ``None`` where the server gives
    neither) and its size in bytes (``None``: unknown, a chunked body)."""

    validator: tuple[str, str] | None
    total: int | None

    @classmethod
    def of(cls, response: aiohttp.ClientResponse, start: int) -> _Version:
        """The version ``response`` (a body from byte ``start`` on) says it carries."""
        etag = response.headers.get("ETag")
        modified = response.headers.get("Last-Modified")
        validator: tuple[str, str] | None = None
        if etag and not etag.startswith("W/"):  # a weak ETag cannot be used in If-Range
            validator = ("ETag", etag)
        elif modified:
            validator = ("Last-Modified", modified)
        total = _expected_length(response)
        if response.status == 206:
            # The size after "/" in Content-Range; Content-Length counts only the rest.
            size = response.headers.get("Content-Range", "").rpartition("/")[2].strip()
            total = int(size) if size.isdigit() else None if total is None else start + total
        return cls(validator, total)


def _resumed(
    url: str, response: aiohttp.ClientResponse, received: int, version: _Version | None
) -> tuple[int, _Version]:
    """How many bytes of ``response``, the answer to a read resumed at byte ``received`` of
    ``version``, to skip (the Range was ignored), and the version read from now on.

    Raises:
        RemoteError: the answer is another version of the object (another validator or size,
            or a 200 to ``If-Range``) or another range than asked: joining its bytes to those
            handed out would make a body that never existed.
    """
    shown = redact(url)
    answered = response.headers.get("Content-Range", f"bytes {received}-")
    if response.status == 206 and not answered.startswith(f"bytes {received}-"):
        raise RemoteError(f"{shown}: asked for bytes {received}- and got {answered!r}", url=url)
    now = _Version.of(response, received)
    before = version if version is not None else _Version(None, None)
    changed = ""
    if before.validator is not None:
        name, value = before.validator
        given = response.headers.get(name)
        # A 206 without the header is trusted: it answers If-Range, which asked the server to
        # compare. A 200 answers "changed" to If-Range, unless its validator is the same (a
        # server that ignores Range and sends the whole object).
        if (given is not None or response.status == 200) and given != value:
            changed = f"{name} was {value}, now {given or 'not given'}"
    if not changed and before.total is not None and now.total not in (None, before.total):
        changed = f"size was {before.total} bytes, now {now.total}"
    if changed:
        raise RemoteError(
            f"{shown}: the object changed while it was read ({changed}); {received} bytes of "
            "the earlier version were handed out, and the rest of another cannot be joined "
            "to them. Read it again from its start (a new epoch), or keep objects unchanged "
            "while they are read",
            url=url,
        )
    skip = received if response.status == 200 else 0  # the Range was not honoured
    total = before.total if before.total is not None else now.total
    return skip, _Version(before.validator or now.validator, total)


def _expected_length(response: aiohttp.ClientResponse) -> int | None:
    """The body length the headers promise, when it is comparable with what read() returns."""
    encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        return None  # aiohttp decompressed; Content-Length counts the compressed bytes
    return response.content_length


async def read_index(index_url: str, **options: Any) -> list[str]:
    """The URLs an index file lists, in its order.

    The file is UTF-8 text, one URL per line; blank lines and lines starting with ``#`` are
    skipped, surrounding spaces dropped, and relative URLs (``shard-0001.tar``,
    ``/data/x.tar``) resolved against ``index_url`` as a browser resolves links. The order is
    the file's own: an index is a list its author chose; it is not sorted.

    Args:
        index_url: the index file's http:// or https:// URL.
        options: :class:`HTTPDataset`'s keyword arguments (``retry``, ``headers``, timeouts).

    Raises:
        RemoteNotFoundError: the index does not exist (404) or lists no URL; names its URL.
        ValueError: ``index_url`` is not http(s), or the index is not UTF-8 text (naming the
            line).
        RemoteError: as for any read (permission, retries exhausted, timeout).
    """
    async with HTTPDataset([index_url], **options) as index:
        raw = await index.fetch(0)
    urls = []
    for number, line in enumerate(raw.splitlines(), 1):
        try:
            text = line.decode("utf-8-sig" if number == 1 else "utf-8").strip()
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"index {redact(index_url)}: line {number} is not UTF-8 text ({exc}); an index "
                "lists one URL per line"
            ) from None
        if text and not text.startswith("#"):
            urls.append(urllib.parse.urljoin(index_url, text))
    if not urls:
        raise RemoteNotFoundError(f"{redact(index_url)}: the index lists no URL", url=index_url)
    return urls
