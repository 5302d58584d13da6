"""Objects in object stores (s3://, gs://, http(s)://, ...) as an async two-stage dataset.

``FsspecDataset(urls)`` reads each URL whole through fsspec's *asynchronous* filesystems
(``await fs._cat_file(url)``), with the same retries and error contract as
:class:`~aioloader.sources.HTTPDataset`::

    fetch(i) ──▶ retrying(policy) ──▶ fs._cat_file(url) on the loop's own filesystem
                                        │ raises: classified by classify() (:mod:`._classify`)
      FileNotFoundError, NoSuchKey, 404 ─┼──▶ RemoteNotFoundError, no retry
      PermissionError, AccessDenied, 403 ┼──▶ RemotePermissionError, no retry
      SlowDown, throttling, 503 ─────────┼──▶ RetryableError, waiting Retry-After
       (statuses: policy.retry_statuses) │
      timeouts, resets, short reads ─────┼──▶ RetryableError (timeouts marked as such)
      anything else ─────────────────────┴──▶ propagates unchanged

Sharp edges:

- All URLs share one protocol, because ``storage_options`` are the options of one filesystem
  class (credentials for S3 mean nothing to GCS). Use one dataset per store.
- Our :class:`RetryPolicy` is the only retry layer. For S3, s3fs's own retry loop is turned
  off, and botocore's too unless ``storage_options["config_kwargs"]["retries"]`` says
  otherwise; else attempts would multiply (5 x 5 x 5) and go unlisted.
- A filesystem is made per event loop with ``skip_instance_cache=True``: fsspec caches
  instances per thread, and a cached async instance holds a session bound to the loop that
  first used it. ``aclose()`` closes the sessions (s3fs's client, an aiohttp session).
- ``max_object_bytes`` bounds what one :meth:`FsspecDataset.fetch` holds. On S3 the object's
  size comes with its one GET (``ContentLength``), and on fsspec's HTTP filesystem with the
  response (``Content-Length``): an object over the bound is refused before its body is read,
  and a body without a length as soon as it passes the bound. Those two reads call the
  backends below fsspec's ``_cat_file`` (s3fs's ``_call_s3``, the HTTP filesystem's session),
  which hold the whole body before returning. Other filesystems are read through
  ``_cat_file`` and checked after: the bound still refuses the object, but only once it was
  held.
- URLs are shown masked (:mod:`._redact`) in errors, warnings and ``repr``.
- The length of the bytes is checked by the backend (botocore and aiohttp both fail a body
  shorter than its Content-Length); such failures are retried here. A ranged read's length is
  checked here: a server that ignores ``Range`` sends the whole object, and the range is cut
  from it (see :meth:`FsspecDataset.fetch_range`).
- A URL that is a prefix (ends with ``/``) or a glob (``*``, ``?``) is refused at
  construction: it would be one item that fails only when read, with a 404. The names a
  listing returns are objects, never refused, whatever characters their keys hold (they are
  ``ListedName``). :meth:`FsspecDataset.from_prefix` and :func:`list_fsspec` list a URL::

      list_fsspec("s3://b/train/*.tar") ──▶ retrying(policy) ──▶ fs._glob / fs._find
          (one listing: the store's pages, 1,000 keys each on S3, read by the backend in turn)
          ──▶ files only, "s3://" put back, sorted ──▶ empty: RemoteNotFoundError
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from typing import Any, Self, TypeVar

from .._errors import RemoteError, RemoteNotFoundError
from .._log import remote_log
from .._stats import current_counters
from .._validate import callable_or_none, seconds, value_errors
from ._base import (
    MAX_OBJECT_BYTES,
    ListedName,
    Source,
    as_names,
    byte_limit,
    has_glob,
    read_bounded,
    refuse_patterns,
    require,
    run_sync,
    too_large,
)
from ._classify import classify
from ._redact import masked, redact
from ._retry import RetryableError, RetryPolicy, raise_final, retrying

__all__ = ["FsspecDataset", "list_fsspec"]

T = TypeVar("T")

LISTING_HINT = "FsspecDataset.from_prefix(url_or_glob) or aioloader.sources.list_objects(...)"

#: Bytes asked per read by :meth:`FsspecDataset.stream` (see ``_http.STREAM_CHUNK``).
STREAM_CHUNK = 1 << 20

#: Bytes of the first read of :meth:`FsspecDataset.stream`, the one retried and bounded by
#: ``item_deadline`` with the opening (s3fs sends its GetObject at the first read): small, so
#: the deadline bounds the opening and the first bytes, not a megabyte's transfer.
FIRST_READ = 64 << 10

#: Options per protocol, under the user's storage_options. For S3: botocore's retries are off
#: (our policy retries), and ``max_concurrency=1`` makes a read one GET instead of a HEAD (for
#: the size) then parallel ranged GETs: the loader already keeps ``io_concurrency`` objects in
#: flight, and the HEAD would double each object's latency.
PROTOCOL_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "s3": {"max_concurrency": 1, "config_kwargs": {"retries": {"total_max_attempts": 1}}},
}

#: Attributes set on a new filesystem, per protocol. s3fs's own retry loop is a class
#: attribute, not an option; with ``retries=1`` it makes one attempt and leaves retrying to us,
#: so attempts do not multiply (5 of ours x 5 of s3fs's) and each one is listed.
PROTOCOL_ATTRIBUTES: Mapping[str, Mapping[str, Any]] = {"s3": {"retries": 1}}

#: Protocols whose URLs may carry a query (``?`` is no wildcard there).
HTTP = frozenset({"http", "https"})

#: s3fs's protocols: their objects are read with the size bound checked up front.
S3 = frozenset({"s3", "s3a"})


def _merge(defaults: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` over ``defaults``, merging one level of nested mappings."""
    merged = dict(defaults)
    for key, value in given.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _protocols(cls: Any) -> tuple[str, ...]:
    names = getattr(cls, "protocol", ())
    return (names,) if isinstance(names, str) else tuple(names)


class FsspecDataset(Source):
    """Objects behind fsspec's asynchronous filesystems, one sample per URL, with retries.

    Example::

        ds = FsspecDataset([f"s3://bucket/shard-{i:05d}.bin" for i in range(1024)],
                           storage_options={"anon": True})

    Args:
        urls: the objects' URLs, all of one protocol (one string counts as one URL).
        decode: turns an object's bytes into a sample, off the event loop; ``None`` keeps
            bytes. Must be picklable to be used with worker processes.
        retry: attempts, backoff and Retry-After handling.
        storage_options: keyword arguments of the filesystem (credentials, endpoint).
        item_deadline: seconds for all attempts of one item, waits included (``None``: no
            limit).
        sleep: awaited between attempts with the delay in seconds (for tests).
        max_object_bytes: the most bytes one :meth:`fetch` holds (see the module's sharp
            edges): an object over it is a ``RemoteError`` naming the masked URL, the size and
            this setting; not retried; skipped under ``on_error="skip"``. ``None``: no bound.
            Ranged reads and :meth:`stream` hand on what they were asked for and are not
            bounded by it.

    Raises:
        ValueError: a URL without a protocol, with a protocol fsspec does not know or has no
            async filesystem for, or mixing protocols; names the URL. An ``item_deadline`` that
            is not a positive finite number of seconds (of the wrong type, also a ``TypeError``).
            A URL that is a prefix (ends with ``/``) or a glob (``*``, ``?``): list it with
            :meth:`from_prefix` (the names a listing returns are never refused).
        TypeError: ``retry``, ``storage_options`` or ``sleep`` of the wrong type.
        ImportError: fsspec, or the package of the protocol (s3fs, gcsfs), is not installed.
    """

    def __init__(
        self,
        urls: Iterable[str] | str,
        decode: Callable[[bytes], Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        storage_options: Mapping[str, Any] | None = None,
        item_deadline: float | None = None,
        sleep: Callable[[float], Awaitable[object]] | None = None,
        max_object_bytes: int | None = MAX_OBJECT_BYTES,
    ) -> None:
        super().__init__(decode)
        require("fsspec", "FsspecDataset")
        self._urls = as_names(urls, "urls")
        self._protocol = _one_protocol(self._urls)
        refuse_patterns(self._urls, "urls", LISTING_HINT, query=self._protocol in HTTP)
        if retry is None:
            retry = RetryPolicy()
        if not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy, got {retry!r}")
        self._retry = retry
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a mapping, got {storage_options!r}")
        self._options: dict[str, Any] = dict(storage_options or {})
        self._attributes: dict[str, Any] = {}
        if self._protocol is not None:
            cls = filesystem_class(self._protocol, f"urls[0]={redact(self._urls[0])!r}")
            self._options, self._attributes = filesystem_settings(cls, self._options)
        with value_errors():  # ValueError for any bad deadline, as always (also a TypeError)
            self._item_deadline = seconds("item_deadline", item_deadline, positive=True)
        self._sleep = callable_or_none("sleep", sleep)
        self._max_object_bytes = byte_limit("max_object_bytes", max_object_bytes)
        self._range_ignored = False  # a server ignored Range (warned once)

    @classmethod
    def from_prefix(
        cls,
        url_or_glob: str,
        decode: Callable[[bytes], Any] | None = None,
        **options: Any,
    ) -> Self:
        """A dataset of the objects under a prefix, or matching a glob, sorted by URL.

        Lists with :func:`list_fsspec` (blocking; in async code, build the dataset from
        ``await aioloader.sources.alist_objects(...)``) using the same ``storage_options``,
        ``retry`` and ``sleep`` as the dataset's reads.

        Example::

            ds = FsspecDataset.from_prefix("s3://bucket/train/*.npy", decode=load_npy,
                                           storage_options={"anon": True})

        Args:
            url_or_glob: ``s3://bucket/train/`` (every object under it, at any depth) or
                ``s3://bucket/train/*.npy`` (``**`` crosses ``/``).
            decode: as for the constructor.
            options: the constructor's keyword arguments.

        Raises:
            RemoteNotFoundError: nothing matches, or the bucket does not exist; names the URL.
        """
        urls = run_sync(
            lambda: list_fsspec(
                url_or_glob,
                storage_options=options.get("storage_options"),
                retry=options.get("retry"),
                sleep=options.get("sleep"),
            )
        )
        return cls(urls, decode, **options)

    @property
    def urls(self) -> tuple[str, ...]:
        """The URLs, in index order."""
        return self._urls

    @property
    def protocol(self) -> str | None:
        """The protocol of every URL (``None`` for an empty dataset)."""
        return self._protocol

    def item_name(self, index: int) -> str:
        """Where item ``index`` comes from, for the notes of its errors (masked)."""
        return redact(self._urls[index])

    def __len__(self) -> int:
        return len(self._urls)

    def __repr__(self) -> str:
        first = f", first={redact(self._urls[0])!r}" if self._urls else ""
        return f"FsspecDataset({len(self._urls)} urls{first}, open_filesystems={len(self._pools)})"

    async def fetch(self, index: int) -> bytes:
        """Read ``urls[index]`` whole, with retries.

        Raises:
            RemoteNotFoundError: the object does not exist; not retried.
            RemotePermissionError: access refused; not retried.
            RemoteTimeoutError: every attempt failed and the last one timed out.
            RetriesExhaustedError: every attempt failed; the message lists them.
            RemoteError: the object is over ``max_object_bytes``; not retried.
        """
        url = self._urls[self._check_index(index)]
        return await self._retried(url, lambda fs: self._read_whole(fs, url))

    async def _read_whole(self, fs: Any, url: str) -> bytes:
        """One attempt of :meth:`fetch`: the object, held against ``max_object_bytes``."""
        limit = self._max_object_bytes
        if limit is not None and self._protocol in S3:
            data = await self._s3_get(fs, url, limit)
        elif limit is not None and self._protocol in HTTP:
            data = await self._http_get(fs, url, limit)
        else:
            data = await fs._cat_file(url)
            if limit is not None and len(data) > limit:
                raise self._too_large(url, len(data))
        return bytes(data) if not isinstance(data, bytes) else data

    async def _s3_get(self, fs: Any, url: str, limit: int) -> bytes:
        """s3fs's ``_cat_file`` for one whole object (one GetObject, the version of the URL if
        it names one), refused by its ``ContentLength`` before its body is read."""
        bucket, key, version = fs.split_path(url)
        versioned = {"VersionId": version} if version else {}
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key, **versioned)
        body = response["Body"]
        try:
            size = response.get("ContentLength")
            if isinstance(size, int) and size > limit:
                raise self._too_large(url, size)
            return await read_bounded(body.read, limit, lambda: self._too_large(url, None))
        finally:
            body.close()

    async def _http_get(self, fs: Any, url: str, limit: int) -> bytes:
        """fsspec's HTTP ``_cat_file``, refused by its ``Content-Length`` (compressed or not:
        a body never shrinks when decompressed) before its body is read, or while read."""
        session = await fs.set_session()
        async with session.get(fs.encode_url(url), **fs.kwargs) as response:
            fs._raise_not_found_for_status(response, url)
            size = response.content_length
            if size is not None and size > limit:
                raise self._too_large(url, size)
            return await read_bounded(
                response.content.read, limit, lambda: self._too_large(url, None)
            )

    def _too_large(self, url: str, size: int | None) -> RemoteError:
        assert self._max_object_bytes is not None
        message = too_large(redact(url), size, "max_object_bytes", self._max_object_bytes)
        return RemoteError(message, url=url)

    async def fetch_range(self, index: int, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` (exclusive) of ``urls[index]``, retried as :meth:`fetch`
        is (one ranged GET): for formats read in parts, like Parquet's.

        A server that ignores ``Range`` answers with the whole object (fsspec's HTTP
        filesystem hands that on as it is): the range is cut from it, every byte that came is
        counted in the statistics, and a warning says so once per dataset.

        Raises:
            RemoteError: as :meth:`fetch`; or the answer is neither ``end - start`` bytes nor
                the whole object (a range past the object's end, a server that misbehaves),
                naming the URL, the range asked and the length received; not retried.
        """
        url = self._urls[self._check_index(index)]
        return await self._retried(url, lambda fs: self._read_range(fs, url, start, end))

    async def _read_range(self, fs: Any, url: str, start: int, end: int) -> bytes:
        """One attempt of :meth:`fetch_range`."""
        data = await fs._cat_file(url, start=start, end=end)
        data = bytes(data) if not isinstance(data, bytes) else data
        if len(data) == end - start:
            return data
        # More than asked and at least up to ``end``: the whole object, if its size says so
        # (one more request, only from a server that ignores Range).
        if len(data) > end - start and len(data) >= end:
            size = (await fs._info(url)).get("size")
            if size == len(data):
                counters = current_counters.get()
                if counters is not None:  # retrying counts the bytes returned, not the rest
                    counters.remote_bytes += len(data) - (end - start)
                if not self._range_ignored:
                    self._range_ignored = True
                    remote_log.warning(
                        "%s: the server ignores Range and sends the whole object (%d bytes) "
                        "for each range asked; reading on, at the cost of those bytes",
                        redact(url),
                        len(data),
                    )
                return data[start:end]
        raise RemoteError(
            f"{redact(url)}: asked for bytes {start}-{end} ({end - start} bytes) and received "
            f"{len(data)} bytes, neither the range nor the whole object",
            url=url,
        )

    async def size(self, index: int) -> int:
        """The size in bytes of ``urls[index]``, retried as :meth:`fetch` is."""
        url = self._urls[self._check_index(index)]
        info = await self._retried(url, lambda fs: fs._info(url))
        return int(info["size"])

    async def stream(
        self, index: int, chunk_size: int = STREAM_CHUNK
    ) -> AsyncGenerator[bytes, None]:
        """``urls[index]`` in chunks as it arrives (``fs.open_async``: one streamed GET on
        s3fs), for objects too large to hold (tar shards). Opening and the first read are
        retried as :meth:`fetch` is, within ``item_deadline`` (the first read asks for
        ``FIRST_READ``, 64 KiB, at most; s3fs asks for the object at the first read, so a
        ``SlowDown`` or a 404 there is retried or reported as :meth:`fetch` reports it); a
        read that fails after bytes were handed out raises. A filesystem without streamed
        files is read whole, as one chunk, retried as :meth:`fetch` is but not bounded by
        ``max_object_bytes`` (a stream has no bound: the object is held once, whole). The
        bytes count in the loader's ``statistics().bytes_read`` as they arrive. Close the
        iterator (``aclosing``) if it is not read to its end.

        Raises:
            RemoteNotFoundError, RemotePermissionError: as :meth:`fetch`, also when found
                after bytes were handed out.
            RemoteError: as :meth:`fetch`, naming the URL; or the read broke off after bytes
                were handed out (a stream is not resumed here).
        """
        url = self._urls[self._check_index(index)]
        fs = self._pool()
        sleep = asyncio.sleep if self._sleep is None else self._sleep
        counters = current_counters.get()  # the loader's, as HTTPDataset.stream counts
        try:
            file, chunk = await retrying(
                lambda: self._open_file(fs, url, chunk_size),
                policy=self._retry,
                describe=url,
                deadline=self._item_deadline,
                sleep=sleep,
            )
        except NotImplementedError:
            data = await self._retried(url, lambda fs: fs._cat_file(url))
            yield data if isinstance(data, bytes) else bytes(data)
            return
        try:
            while chunk:
                if counters is not None:
                    counters.remote_bytes += len(chunk)
                yield bytes(chunk)
                error: BaseException | None = None
                try:
                    chunk = await file.read(chunk_size)
                except Exception as exc:
                    error = self._broke_off(url, exc)
                    if error is exc:
                        raise
                if error is not None:
                    raise_final(error)  # outside the except clause (see raise_final)
        finally:
            with contextlib.suppress(Exception):
                await file.close()

    def _broke_off(self, url: str, exc: Exception) -> BaseException:
        """What to raise for ``exc``, a read of :meth:`stream` that failed after bytes were
        handed out: not found or refused as :meth:`fetch` says it, anything else a
        ``RemoteError`` saying the read broke off (or ``exc`` itself, unknown and showing no
        secret); the cause masked."""
        ours = classify(exc, url, self._retry)
        shown = masked(exc)
        if ours is None and shown is exc:
            return exc
        if ours is None or isinstance(ours, RetryableError):
            ours = RemoteError(f"{redact(url)}: the read broke off: {ours or shown}", url=url)
        ours.__cause__ = shown
        return ours

    async def _open_file(self, fs: Any, url: str, chunk_size: int) -> tuple[Any, bytes]:
        """One attempt of opening :meth:`stream`: the open file and its first chunk (s3fs
        sends its GetObject at the first read, not at the opening)."""
        try:
            file = await fs.open_async(url, "rb")
        except NotImplementedError:
            raise
        except Exception as exc:
            ours = classify(exc, url, self._retry)
            if ours is None:
                raise
            raise ours from exc
        try:
            first = await file.read(min(chunk_size, FIRST_READ))
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await file.close()
            ours = classify(exc, url, self._retry) if isinstance(exc, Exception) else None
            if ours is None:
                raise
            raise ours from exc
        return file, first

    async def _retried(self, url: str, op: Callable[[Any], Awaitable[T]]) -> T:
        """``await op(fs)`` with the loop's filesystem, each failure classified, retried."""
        fs = self._pool()

        async def attempt() -> T:
            try:
                return await op(fs)
            except Exception as exc:
                ours = classify(exc, url, self._retry)
                if ours is None:
                    raise
                raise ours from exc

        return await retrying(
            attempt,
            policy=self._retry,
            describe=url,
            deadline=self._item_deadline,
            sleep=asyncio.sleep if self._sleep is None else self._sleep,
        )

    # -- the per-loop filesystem ---------------------------------------------------------

    def _open_pool(self) -> Any:
        assert self._protocol is not None  # an empty dataset has no index to fetch
        return open_filesystem(self._protocol, self._options, self._attributes)

    async def _close_pool(self, pool: Any) -> None:
        await close_filesystem(pool)

    def _discard_pool(self, pool: Any) -> None:
        """Nothing can be awaited without the pool's loop: drop it (best effort)."""


def filesystem_settings(
    cls: Any, storage_options: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(options, attributes)`` of a new filesystem of class ``cls``: the user's
    ``storage_options`` over :data:`PROTOCOL_DEFAULTS`, and :data:`PROTOCOL_ATTRIBUTES`."""
    for name in _protocols(cls):
        if name in PROTOCOL_DEFAULTS or name in PROTOCOL_ATTRIBUTES:
            options = _merge(PROTOCOL_DEFAULTS.get(name, {}), storage_options)
            return options, dict(PROTOCOL_ATTRIBUTES.get(name, {}))
    return dict(storage_options), {}


def open_filesystem(
    protocol: str,
    options: Mapping[str, Any],
    attributes: Mapping[str, Any],
    *,
    asynchronous: bool = True,
) -> Any:
    """A new filesystem instance of ``protocol`` (never fsspec's cached one; see the module)."""
    import fsspec

    extra = {"asynchronous": True} if asynchronous else {}
    fs = fsspec.filesystem(protocol, skip_instance_cache=True, **extra, **options)
    for name, value in attributes.items():
        setattr(fs, name, value)
    return fs


async def close_filesystem(fs: Any) -> None:
    """Close the sessions an async filesystem holds (on the loop that opened them)."""
    # fsspec has no common close for async filesystems: close what the known ones hold.
    creator = getattr(fs, "_s3creator", None)  # s3fs: the aiobotocore client context
    if creator is not None:
        if hasattr(creator, "__aexit__"):
            await creator.__aexit__(None, None, None)
        elif hasattr(creator, "clear"):  # s3fs with cache_regions=True
            await creator.clear()
        fs._s3creator = None
        fs._s3 = None
    session = getattr(fs, "_session", None)  # fsspec's http, gcsfs: aiohttp session
    if session is not None and hasattr(session, "close") and not session.closed:
        await session.close()


async def list_fsspec(
    url_or_glob: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    sleep: Callable[[float], Awaitable[object]] | None = None,
) -> list[str]:
    """The objects under a prefix, or matching a glob, of any fsspec filesystem, sorted.

    - a glob (``*``, ``?``, ``[...]``; ``**`` crosses ``/``): the objects it matches;
    - anything else is a prefix: every object under it at any depth (``s3://b/train/``),
      or the one object it names.

    Paginated by the backend (S3 answers 1,000 keys a page; s3fs asks for the next page until
    the last). The whole listing is one attempt of ``retry``: a transient failure on any page
    lists again, a missing bucket fails at once. Directory markers are left out. Synchronous
    filesystems (fsspec's local, memory, ...) list in a thread.

    Returns:
        The objects' URLs with the protocol given, sorted by URL (code point order); each a
        ``ListedName``, so a key that holds ``*`` or ``?`` is read as the object it is.

    Raises:
        RemoteNotFoundError: nothing matches (a missing prefix or bucket), naming the URL.
        ValueError: no protocol, or one fsspec does not know.
        RemotePermissionError, RetriesExhaustedError: as for a read.
    """
    from fsspec.core import split_protocol

    protocol, _ = split_protocol(url_or_glob)
    if protocol is None:
        raise ValueError(
            f"url={redact(url_or_glob)!r} has no protocol (like s3://); list local files with "
            "FileDataset.from_prefix or aioloader.sources.list_objects"
        )
    if retry is None:
        retry = RetryPolicy()
    cls = filesystem_class(protocol, f"url={redact(url_or_glob)!r}", need_async=False)
    options, attributes = filesystem_settings(cls, storage_options or {})
    asynchronous = bool(getattr(cls, "async_impl", False))
    fs = open_filesystem(protocol, options, attributes, asynchronous=asynchronous)

    async def attempt() -> list[str]:
        try:
            if asynchronous:
                return await _find(fs, url_or_glob)
            return await asyncio.to_thread(_find_sync, fs, url_or_glob)
        except Exception as exc:
            ours = classify(exc, url_or_glob, retry)
            if ours is None:
                raise
            raise ours from exc

    try:
        names = await retrying(
            attempt,
            policy=retry,
            describe=url_or_glob,
            sleep=asyncio.sleep if sleep is None else sleep,
        )
    finally:
        if asynchronous:
            await close_filesystem(fs)
    if not names:
        raise RemoteNotFoundError(
            f"{redact(url_or_glob)}: no objects match (a missing prefix, or an empty listing)",
            url=url_or_glob,
        )
    # Listed names are objects, even where a key looks like a glob (ListedName). Most
    # filesystems list paths without their protocol (s3fs: "bucket/key"); fsspec's HTTP
    # filesystem lists whole URLs, which keep theirs.
    return sorted(ListedName(_with_protocol(protocol, name)) for name in names)


def _with_protocol(protocol: str, name: str) -> str:
    from fsspec.core import split_protocol

    if split_protocol(name)[0] is not None:
        return name
    return f"{protocol}://{name.lstrip('/')}"


async def _find(fs: Any, url: str) -> list[str]:
    path = fs._strip_protocol(url)
    if has_glob(path):
        found = await fs._glob(path, detail=True)
        return [name for name, info in found.items() if info.get("type") == "file"]
    return [name for name in await fs._find(path) if not name.endswith("/")]


def _find_sync(fs: Any, url: str) -> list[str]:
    path = fs._strip_protocol(url)
    if has_glob(path):
        found = fs.glob(path, detail=True)
        return [name for name, info in found.items() if info.get("type") == "file"]
    return [name for name in fs.find(path) if not name.endswith("/")]


def _one_protocol(urls: tuple[str, ...]) -> str | None:
    from fsspec.core import split_protocol

    protocol: str | None = None
    for position, url in enumerate(urls):
        found, _ = split_protocol(url)
        if found is None:
            raise ValueError(
                f"urls[{position}]={redact(url)!r} has no protocol (like s3://); use FileDataset "
                "for local files"
            )
        if protocol is None:
            protocol = found
        elif found != protocol:
            raise ValueError(
                f"urls[{position}]={redact(url)!r} is a {found!r} URL but urls[0] is {protocol!r}; "
                "one FsspecDataset reads one protocol (make one dataset per store)"
            )
    return protocol


def filesystem_class(protocol: str, where: str, *, need_async: bool = True) -> Any:
    """fsspec's filesystem class for ``protocol``; errors begin with ``where`` (the argument
    and its value, like ``urls[0]='s3://b/k'``).

    Raises:
        ValueError: fsspec does not know the protocol, or (``need_async``) its filesystem is
            not asynchronous.
        ImportError: the protocol's package is not installed.
    """
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ValueError as exc:
        raise ValueError(f"{where}: fsspec does not know protocol {protocol!r}") from exc
    except ImportError as exc:
        raise ImportError(f"{where}: the {protocol!r} filesystem is not installed: {exc}") from exc
    if need_async and not getattr(cls, "async_impl", False):
        raise ValueError(
            f"{where}: fsspec's {protocol!r} filesystem is not asynchronous; "
            "FsspecDataset needs one that is (s3, gs, http, ...); use FileDataset for local files"
        )
    return cls
