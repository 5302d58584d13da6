"""Local files as an async two-stage dataset, read through aiofiles.

``FileDataset(paths)`` makes ``fetch(i)`` read ``paths[i]`` whole, off the event loop, and
``decode`` turn the bytes into a sample off the loop too (see :mod:`._base`).

Sharp edges:

- aiofiles runs each blocking call (open, read, close) in the event loop's default executor, so
  ``io_concurrency`` file reads need as many executor threads to really overlap; the default
  executor has ``min(32, cpu_count + 4)``. Local disks rarely gain from more.
- The length check compares the bytes read with the size ``fstat`` reported when the file was
  opened: a file cut short while being read is an error, a file that grew is read as far as
  it had grown. Files without a meaningful size (pipes, ``/proc``) are not checked.
- ``max_object_bytes`` bounds what one :meth:`FileDataset.fetch` holds: a regular file over
  it is refused by its size before a byte is read; a pipe or device, as soon as what it gave
  passes the bound. Paths are shown masked (:mod:`._redact`), as URLs are.
- No retries: a local read that fails does so for a reason another try will not fix.
- A glob, a path ending with a separator, or a directory given alone (``FileDataset("shards")``)
  is refused at construction (it would read as one item and fail only then):
  :meth:`FileDataset.from_prefix` lists it. A name with ``*`` or ``?`` that exists as a file is
  accepted as it is: those are legal in file names. In a list of paths, a directory named
  without a trailing separator is not looked for (a million paths would cost a million
  ``stat`` calls): it fails when read, with an ``IsADirectoryError`` naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import glob
import os
import stat
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any, Self

from ._base import (
    MAX_OBJECT_BYTES,
    Source,
    as_names,
    byte_limit,
    has_glob,
    is_pattern,
    read_bounded,
    too_large,
)
from ._redact import masked, redact

__all__ = ["FileDataset", "list_local"]

LISTING_HINT = "FileDataset.from_prefix(path_or_glob) or aioloader.sources.list_objects(...)"

#: Bytes per read of :meth:`FileDataset.stream` (one executor round trip each).
STREAM_CHUNK = 1 << 20


class FileDataset(Source):
    """Local files, one sample per file, read asynchronously.

    Example::

        ds = FileDataset(sorted(glob.glob("shards/*.npy")), decode=lambda b: np.load(io.BytesIO(b)))
        async with DataLoader(ds, batch_size=32) as loader:
            async for batch in loader: ...

    Args:
        paths: the files, as strings or path-like objects (one string counts as one file).
        decode: turns a file's bytes into a sample, off the event loop; ``None`` keeps bytes.
            Must be picklable to be used with worker processes.
        max_object_bytes: the most bytes one :meth:`fetch` holds: a larger file is an
            ``OSError`` (``errno.EFBIG``) naming the path, the size and this setting, skipped
            under ``on_error="skip"``. ``None``: no bound. :meth:`stream` is not bounded by it.

    Raises:
        TypeError: ``paths`` is not a sequence of paths, or ``decode`` is not callable.
        ValueError: a path is a glob or ends with a separator (a directory), or the one path
            given is a directory, naming it.
    """

    def __init__(
        self,
        paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str],
        decode: Callable[[bytes], Any] | None = None,
        *,
        max_object_bytes: int | None = MAX_OBJECT_BYTES,
    ) -> None:
        super().__init__(decode)
        self._paths = as_names(paths, "paths", paths=True)
        self._max_object_bytes = byte_limit("max_object_bytes", max_object_bytes)
        for position, path in enumerate(self._paths):
            # Only names that look like patterns are looked at on disk, so a million plain
            # paths cost no stat.
            if is_pattern(path) and not os.path.isfile(path):
                raise ValueError(
                    f"paths[{position}]={redact(path)!r} is a directory or a glob, not one file; "
                    f"list the files first: {LISTING_HINT}"
                )
        if isinstance(paths, str | os.PathLike) and os.path.isdir(self._paths[0]):
            raise ValueError(
                f"paths={redact(self._paths[0])!r} is a directory, not one file; list the files "
                f"first: {LISTING_HINT}"
            )

    @classmethod
    def from_prefix(
        cls, path_or_glob: str | os.PathLike[str], decode: Callable[[bytes], Any] | None = None
    ) -> Self:
        """The files under a directory, or matching a glob, sorted by path (see
        :func:`list_local`).

        Example::

            ds = FileDataset.from_prefix("shards/**/*.npy", decode=load_npy)

        Raises:
            FileNotFoundError: nothing matches (the message names the pattern).
        """
        return cls(list_local(path_or_glob), decode)

    @property
    def paths(self) -> tuple[str, ...]:
        """The files, in index order."""
        return self._paths

    def item_name(self, index: int) -> str:
        """Where item ``index`` comes from, for the notes of its errors (masked)."""
        return redact(self._paths[index])

    def __len__(self) -> int:
        return len(self._paths)

    def __repr__(self) -> str:
        first = f", first={redact(self._paths[0])!r}" if self._paths else ""
        return f"FileDataset({len(self._paths)} files{first})"

    async def fetch(self, index: int) -> bytes:
        """Read file ``index`` whole.

        Raises:
            FileNotFoundError: the file does not exist (the message names the path).
            PermissionError: the file cannot be read.
            OSError: the file shrank while it was read, is over ``max_object_bytes``
                (``errno.EFBIG``), or another read error.
        """
        path = self._paths[self._check_index(index)]
        try:
            return await self._read(path)
        except OSError as exc:
            masked(exc)  # an OSError's text is its fields: masked in place
            raise

    async def _read(self, path: str) -> bytes:
        import aiofiles  # a core dependency; imported here to keep package import light

        limit = self._max_object_bytes
        async with aiofiles.open(path, "rb") as file:
            # fstat on an open descriptor reads cached metadata: cheap enough for the loop.
            info = os.fstat(file.fileno())
            regular = stat.S_ISREG(info.st_mode)
            if limit is not None and regular and info.st_size > limit:
                raise self._too_large(path, info.st_size)
            if regular or limit is None:
                data: bytes = await file.read()
            else:  # a pipe or a device: no size to go by
                data = await read_bounded(file.read, limit, lambda: self._too_large(path, None))
        if regular and len(data) < info.st_size:
            raise OSError(
                errno.EIO,
                f"short read: got {len(data)} of {info.st_size} bytes (file changed while read)",
                path,
            )
        return data

    def _too_large(self, path: str, size: int | None) -> OSError:
        assert self._max_object_bytes is not None
        message = too_large(redact(path), size, "max_object_bytes", self._max_object_bytes)
        return OSError(errno.EFBIG, message)

    async def stream(
        self, index: int, chunk_size: int = STREAM_CHUNK
    ) -> AsyncGenerator[bytes, None]:
        """File ``index`` in chunks, each read off the event loop, for files too large to hold
        (tar shards). Close the iterator (``aclosing``) if it is not read to its end.

        Raises:
            FileNotFoundError: the file does not exist (the message names the path).
            OSError: the file shrank while it was read, or another read error.
        """
        path = self._paths[self._check_index(index)]
        async with contextlib.aclosing(self._chunks(path, chunk_size)) as chunks:
            try:
                async for chunk in chunks:
                    yield chunk
            except OSError as exc:
                masked(exc)
                raise

    async def _chunks(self, path: str, chunk_size: int) -> AsyncGenerator[bytes, None]:
        loop = asyncio.get_running_loop()
        opening = loop.run_in_executor(None, open, path, "rb")
        try:
            # Shielded: a cancellation while the thread opens the file must still close it
            # (aiofiles would leak it).
            file = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(_close_opened)
            raise
        with file:
            info = os.fstat(file.fileno())
            received = 0
            while chunk := await loop.run_in_executor(None, file.read, chunk_size):
                received += len(chunk)
                yield chunk
        if stat.S_ISREG(info.st_mode) and received < info.st_size:
            raise OSError(
                errno.EIO,
                f"short read: got {received} of {info.st_size} bytes (file changed while read)",
                path,
            )


def _close_opened(opening: asyncio.Future[Any]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


def list_local(path_or_glob: str | os.PathLike[str]) -> list[str]:
    """The files a local pattern names, sorted by path.

    - a glob (``*``, ``?``, ``[...]``; ``**`` crosses directories): the files it matches,
      with Python's :func:`glob.glob` rules (a wildcard does not match a leading dot);
    - a directory: every file under it, at any depth, hidden ones included;
    - a file: that file.

    A ``file://`` prefix is accepted and dropped. Blocking (it walks the disk).

    Raises:
        FileNotFoundError: nothing matches, naming the pattern.
    """
    pattern = os.fsdecode(path_or_glob)
    if pattern.startswith("file://"):
        pattern = pattern[len("file://") :]
    if has_glob(pattern):
        found = [path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path)]
    elif os.path.isdir(pattern):
        found = [
            os.path.join(root, name)
            for root, _, names in os.walk(pattern)
            for name in names
            if os.path.isfile(os.path.join(root, name))
        ]
    else:
        found = [pattern] if os.path.isfile(pattern) else []
    if not found:
        raise FileNotFoundError(
            errno.ENOENT,
            "no files match (a missing directory, or an empty listing)",
            redact(pattern),
        )
    return sorted(found)
