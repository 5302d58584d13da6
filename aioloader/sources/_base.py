"""What every source shares: the two-stage protocol, index checks and per-loop resources.

A source is an async map-style dataset that splits reading a sample into two stages, because
the loader runs them in different places::

    loader ──await fetch(i)──▶ IO on the event loop (hundreds in flight) ──▶ raw bytes
      │                                                                        │
      └──────────── decode(raw) in a thread or worker process ◀────────────────┘

``fetch`` returns bytes whose length was checked, so a truncated body never reaches ``decode``.
``await dataset[i]`` does both, for use without the loader.

Sharp edges:

- A source is pickled to worker processes (and to Ray's object store), with everything it
  needs to read: its URLs as given, headers and ``storage_options``, credentials included
  (masked only where shown; see docs/guides/secrets-and-size-bounds.md). Connection pools
  (an ``aiohttp.ClientSession``, an fsspec filesystem) belong to one event loop and cannot
  travel, so they are created lazily on the loop that first needs them, kept in
  :class:`PerLoop`, and left out of the pickle.
- Pools are keyed by loop: a source used from the loader's loop and from a synchronous
  iteration thread's loop holds two pools, never one shared across loops (aiohttp forbids it).
- ``aclose()`` closes the pool of the running loop normally, asks a pool's loop that is still
  running in another thread to close it, and drops the pools of loops that are gone, best
  effort (an fsspec filesystem is only forgotten). A pool is also closed when its loop shuts
  down through ``asyncio.run``, ``uvloop.run`` or :func:`aioloader.run`, which finish the
  loop's async generators first (see :class:`PerLoop`). A loop closed by hand without
  ``loop.shutdown_asyncgens()`` leaves its pools to be dropped later: an HTTP session's
  sockets then close only when collected. Close a source on its loop before closing the loop,
  as the loader does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import inspect
import operator
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Mapping
from types import ModuleType, TracebackType
from typing import Any, Generic, Self, TypeVar, cast

from .._validate import callable_or_none, positive_int, value_errors
from ._redact import add_credential_parameters, parameters_state, redact

__all__ = [
    "CLOSE_TIMEOUT_S",
    "MAX_OBJECT_BYTES",
    "WILDCARDS",
    "ListedName",
    "PerLoop",
    "Source",
    "as_names",
    "byte_limit",
    "has_glob",
    "is_pattern",
    "read_bounded",
    "refuse_patterns",
    "require",
    "run_sync",
    "too_large",
]

R = TypeVar("R")

#: How long ``aclose()`` waits for another thread's loop to close its pool. Longer protects a
#: slow but live loop's sockets; shorter bounds how long closing can hang on a stuck loop.
CLOSE_TIMEOUT_S = 5.0

REMOTE_EXTRA_HINT = "pip install 'aioloader[remote]'"

#: The default bound on one object a source holds whole (``max_object_bytes``; a tar member's
#: ``max_member_bytes``): 1 GiB. Larger than any image, audio clip, tensor file or video clip
#: that is one sample, so real data never meets it; small enough that a URL pointing at a far
#: larger object, or a body without end, is refused before it takes the host's memory (the
#: loader holds up to ``io_concurrency`` objects at once). A bound at the real largest object
#: protects more; ``None`` removes it.
MAX_OBJECT_BYTES = 1 << 30

#: Bytes asked per read while a body is held against a bound.
BOUNDED_CHUNK = 1 << 20


def byte_limit(name: str, value: object) -> int | None:
    """``value`` as a bound in bytes: a positive int, or ``None`` for no bound.

    Raises:
        ValueError: naming ``name`` and the value (of the wrong type, also a ``TypeError``).
    """
    if value is None:
        return None
    with value_errors():
        return positive_int(name, value)


def _size_text(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.1f} {unit}"
    return f"{size} bytes"


def too_large(what: str, size: int | None, setting: str, limit: int) -> str:
    """The message of an object refused for its size: ``what`` (its masked name) ``size``
    bytes (``None``: a body without a length that passed the bound), ``setting`` and its
    ``limit``, and what to do."""
    if size is None:
        amount = f"a body without a length that passed {limit} bytes while read"
    else:
        amount = f"{size} bytes ({_size_text(size)})"
    return (
        f"{what} is {amount}, over {setting}={limit} ({_size_text(limit)}); refused to "
        f"protect this process's memory. If objects this large are meant, raise {setting} "
        "(None: no bound); otherwise the URL names another object than meant"
    )


async def read_bounded(
    read: Callable[[int], Awaitable[bytes]], limit: int | None, refuse: Callable[[], Exception]
) -> bytes:
    """Everything ``read(n)`` returns until it returns ``b""``, refused with ``refuse()`` as
    soon as more than ``limit`` bytes arrived (never holding more than ``limit`` plus one
    read); ``limit=None`` reads to the end."""
    pieces: list[bytes] = []
    held = 0
    while chunk := await read(BOUNDED_CHUNK):
        held += len(chunk)
        if limit is not None and held > limit:
            pieces.clear()
            raise refuse()
        pieces.append(chunk)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def require(module: str, feature: str) -> ModuleType:
    """Import an optional dependency, or say which extra provides it.

    Raises:
        ImportError: naming ``feature``, the missing module and the install command.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"{feature} needs the {module!r} package, which is not installed: {REMOTE_EXTRA_HINT}"
        ) from exc


class PerLoop(Generic[R]):
    """One resource per running event loop, created on first use by that loop.

    Thread-safe: the loader's loop and a synchronous iteration thread's loop may ask at once.
    Invariant: every entry's loop object is held, so ``id(loop)`` cannot be reused while the
    entry exists.

    With ``close``, a resource is also closed when its loop shuts down (``asyncio.run`` and
    ``uvloop.run`` finish the loop's async generators before closing it): a program that
    iterates in ``asyncio.run(main())`` and closes the source later, or never, does not leave a
    session to a loop that is gone (aiohttp's "Unclosed client session", unclosed sockets).
    Each entry holds an async generator suspended at its ``yield``, registered with its loop
    as any async generator is on first use; the loop's shutdown resumes it with
    ``GeneratorExit`` and its ``finally`` closes the resource on that loop, unless the entry
    was taken meanwhile (``take_all``, a dead loop's discard), which finishes it at once.
    """

    def __init__(self, close: Callable[[R], Awaitable[None]] | None = None) -> None:
        self._lock = threading.Lock()
        # Weakly, when a method of the resources' owner: the owner holds this, which holds
        # the hooks, whose frames would hold the owner again (a cycle only GC could break).
        self._close: Callable[[], Callable[[R], Awaitable[None]] | None] | None = None
        if close is not None:
            self._close = weakref.WeakMethod(close) if inspect.ismethod(close) else lambda: close
        self._entries: dict[int, tuple[asyncio.AbstractEventLoop, R, Any]] = {}

    def get(self, create: Callable[[], R], discard: Callable[[R], None]) -> R:
        """The running loop's resource, made with ``create()`` the first time.

        Resources of loops that have been closed meanwhile are passed to ``discard`` (and
        forgotten) on the way, so a program that runs ``asyncio.run`` repeatedly does not
        accumulate them.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._entries.get(id(loop))
            if entry is not None:
                return entry[1]
            dead = [key for key, (other, _, _) in self._entries.items() if other.is_closed()]
            stale = [self._entries.pop(key) for key in dead]
            resource = create()
            try:
                watch = self._watch(id(loop), resource)
            except Exception:  # e.g. asked for during the loop's shutdown, warnings as errors
                watch = None  # the resource is still closed by take_all
            self._entries[id(loop)] = (loop, resource, watch)
        for _, old, watch in stale:
            _finish(watch)
            discard(old)
        return resource

    def take_all(self) -> list[tuple[asyncio.AbstractEventLoop, R]]:
        """Remove and return every entry (for closing)."""
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
        for _, _, watch in entries:
            _finish(watch)
        return [(loop, resource) for loop, resource, _ in entries]

    def __len__(self) -> int:
        return len(self._entries)

    def _watch(self, key: int, resource: R) -> Any:
        """The running loop's shutdown hook for ``resource`` (see the class docstring)."""
        if self._close is None:
            return None
        watch = self._until_loop_ends(key, resource)
        with contextlib.suppress(StopIteration):  # registered with the loop, at the yield
            cast(Any, watch.__anext__()).send(None)
        return watch

    async def _until_loop_ends(self, key: int, resource: R) -> AsyncIterator[None]:
        try:
            yield
        finally:
            with self._lock:
                entry = self._entries.get(key)
                ours = entry is not None and entry[1] is resource
                if ours:
                    del self._entries[key]
            close = self._close() if self._close is not None and ours else None
            if close is not None:  # the loop is shutting down with the resource still open
                with contextlib.suppress(Exception):
                    await close(resource)


def _finish(watch: Any) -> None:
    """End a shutdown hook whose entry was taken: its ``finally`` finds nothing to close and
    awaits nothing, so it completes here, on any thread, with no loop."""
    if watch is not None:
        with contextlib.suppress(StopIteration, RuntimeError):
            watch.aclose().send(None)


class Source(ABC):
    """Base of the sources: length, index checks, the decode stage, pools and closing.

    Subclasses implement :meth:`fetch`, and for pooled IO :meth:`_open_pool`,
    :meth:`_close_pool` and :meth:`_discard_pool`.
    """

    def __init__(self, decode: Callable[[bytes], Any] | None) -> None:
        self._decode_fn: Callable[[bytes], Any] | None = callable_or_none("decode", decode)
        self._pools: PerLoop[Any] = PerLoop(self._close_pool)

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    async def fetch(self, index: int) -> bytes:
        """Read the raw bytes of item ``index`` (the IO stage, awaited on the event loop)."""

    def expect_in_flight(self, fetches: int) -> None:
        """Told by a loader, before its first fetch, how many fetches it may have in flight at
        once (its ``io_concurrency``). A source whose pools cap their connections sizes the
        pools opened afterwards for the most it was told. The base does nothing."""
        del fetches  # no pool here to size

    def decode(self, raw: bytes) -> Any:
        """Turn raw bytes into a sample (the CPU stage, run off the event loop).

        The identity when the source was made with ``decode=None``.
        """
        if self._decode_fn is None:
            return raw
        return self._decode_fn(raw)

    async def __getitem__(self, index: int) -> Any:
        """``decode(await fetch(index))``: both stages, for use without the loader."""
        return self.decode(await self.fetch(index))

    def _check_index(self, index: int) -> int:
        """``index`` as a non-negative int; negative indices count from the end, like a list.

        Raises:
            TypeError: ``index`` is not an integer.
            IndexError: ``index`` is out of range, naming it and the length.
        """
        # Python's indexing protocol (``__index__``), as a list takes it, not _validate's int
        # rule: a 0-d integer tensor is a valid index; a bool never is.
        if isinstance(index, bool):
            raise TypeError(f"index must be an int, got {index!r}")
        try:
            position = operator.index(index)
        except TypeError:
            raise TypeError(f"index must be an int, got {index!r}") from None
        size = len(self)
        if not -size <= position < size:
            raise IndexError(f"index {position} is out of range for {size} items")
        return position + size if position < 0 else position

    # -- pools ---------------------------------------------------------------------------

    def _open_pool(self) -> Any:
        """Create the running loop's pool (sync: called under a lock, on the loop)."""
        raise NotImplementedError

    async def _close_pool(self, pool: Any) -> None:
        """Close a pool on its own loop. The default holds nothing to close."""
        return None

    def _discard_pool(self, pool: Any) -> None:
        """Release a pool whose loop is gone or idle, without awaiting anything."""
        return None

    def _pool(self) -> Any:
        return self._pools.get(self._open_pool, self._discard_pool)

    async def aclose(self) -> None:
        """Close every pool this source opened; the source stays usable (pools reopen lazily).

        Safe to call more than once, and from any loop.
        """
        current = asyncio.get_running_loop()
        for loop, pool in self._pools.take_all():
            if loop is current:
                await self._close_pool(pool)
            elif loop.is_running():
                future = asyncio.run_coroutine_threadsafe(self._close_pool(pool), loop)
                try:
                    await asyncio.wait_for(asyncio.wrap_future(future), CLOSE_TIMEOUT_S)
                except TimeoutError:
                    self._discard_pool(pool)
            else:
                self._discard_pool(pool)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- pickling ------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_pools"]  # bound to this process's loops; reopened lazily after unpickling
        # A worker masks what it shows (decode errors' notes) as this process does.
        state["_credential_parameters"] = parameters_state()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        add_credential_parameters(*state.pop("_credential_parameters", ()))
        self.__dict__.update(state)
        self._pools = PerLoop(self._close_pool)


def as_names(items: object, argument: str, *, paths: bool = False) -> tuple[str, ...]:
    """Validate a sequence of URLs (or paths) and return it as a tuple of str.

    A single string counts as one item, for convenience.

    Raises:
        TypeError: ``items`` is not a sequence of strings (or path-likes when ``paths``).
    """
    single = (str, os.PathLike) if paths else (str,)
    if isinstance(items, single):
        items = [items]
    if not isinstance(items, Iterable) or isinstance(items, bytes | Mapping):
        raise TypeError(f"{argument} must be a sequence of strings, got {items!r}")
    names = []
    for position, item in enumerate(items):
        if isinstance(item, str):
            names.append(item)
        elif paths and isinstance(item, os.PathLike):
            names.append(os.fsdecode(item))
        else:
            raise TypeError(f"{argument}[{position}] must be a string, got {item!r}")
    return tuple(names)


class ListedName(str):
    """A name that a listing returned: one object that exists, taken literally.

    Object stores allow any character in a key, so a listed key can look like a glob
    (``a?b.bin``, ``d*e.bin``). :func:`refuse_patterns` refuses a pattern given where one
    object is expected, but never a name of this type: it came out of a listing. Otherwise a
    plain ``str`` (equal, hashed, sorted and pickled as its text); a string made from one
    (``+``, a slice, an f-string) is a plain ``str`` again, and is checked.
    """

    __slots__ = ()


#: Characters that make a name a glob where one object is expected. ``[`` opens a glob class
#: too, but it is common in real object names (``img[1].png``), so it alone is not refused.
WILDCARDS = frozenset("*?")


def has_glob(path: str) -> bool:
    """Whether ``path`` holds a glob character (``*``, ``?``, ``[``), as fsspec's glob reads it."""
    return any(char in path for char in "*?[")


def is_pattern(name: str, *, query: bool = False) -> bool:
    """Whether ``name`` is a glob or a prefix (ends with ``/``) rather than one object.

    ``query``: ``?`` begins a URL's query (http), so it does not count as a wildcard. An
    S3 object version (``s3://b/k?versionId=...``, s3fs's syntax) is no wildcard either.
    """
    path = name.split("://", 1)[-1].replace("?versionId=", "")
    chars = WILDCARDS - {"?"} if query else WILDCARDS
    return path.endswith(("/", os.sep)) or any(char in path for char in chars)


def refuse_patterns(
    names: tuple[str, ...], argument: str, listing: str, *, query: bool = False
) -> None:
    """Refuse a glob or a prefix where one object per name is expected.

    Without this, ``FsspecDataset("s3://b/train/")`` is a dataset of one item that fails
    only when read, with a 404 that does not say why. A :class:`ListedName` is never refused:
    a listing found it. A name typed by hand that holds ``*`` or ``?`` is, although the store
    may hold such an object: only a request could tell, and a constructor makes none.

    Args:
        names: the names given, in order.
        argument: the argument's name, for the message.
        listing: the call that lists such a pattern, for the message.
        query: see :func:`is_pattern`.

    Raises:
        ValueError: naming the first pattern, its position and ``listing``.
    """
    for position, name in enumerate(names):
        if is_pattern(name, query=query) and not isinstance(name, ListedName):
            raise ValueError(
                f"{argument}[{position}]={redact(name)!r} is a prefix or a glob, not one object; "
                f"list the objects first (the names a listing returns are read as they are, "
                f"whatever characters they hold): {listing}"
            )


def run_sync(make: Callable[[], Coroutine[Any, Any, R]]) -> R:
    """Run the coroutine ``make()`` to its end from synchronous code, and return its result.

    Without a running loop in this thread, on a new one (``asyncio.run``). With one (a
    notebook, sync code called from a coroutine), ``asyncio.run`` cannot nest: the coroutine
    runs on a new loop in a helper thread while this thread waits, blocking its loop as any
    synchronous call does; async code should await the async variant instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aioloader-sync") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()
