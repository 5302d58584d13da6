"""The numbers a pool and its workers share: one small mapping, three arrays in it.

Each worker publishes, in its own cell of each array, what the pool reads without asking it:

- ``current``: the running job's tag (``_wire.running_tag``), 0 when idle;
- ``loading``: ``time.monotonic()`` when a dataset copy's load began, 0.0 when none;
- ``started``: its pid, once its initializer ran (the pool's sign that it is up).

``multiprocessing``'s shared arrays would do, but the first one a process makes imports its
heap and makes an arena file: about a millisecond on the way to the first batch, more while the
workers just forked compete for the CPU. One anonymous file (``memfd``, else an unlinked
temporary file) is mapped instead. A worker forked from this process inherits the mapping; one
started through the forkserver or ``spawn`` gets the file descriptor with its arguments and
maps it again (see :meth:`Cells.__reduce__`). A cell is one aligned 8-byte word, written whole.

No buffer of the mapping is ever lent out (each access packs or unpacks one word), so that
:meth:`Cells.close` can unmap it, and with it the descriptor ``mmap`` keeps: a closed pool
holds no descriptor. What is read or written after that is a private copy of the last values.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import threading
import weakref
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any, Generic, TypeVar

__all__ = ["Cells"]

_WORD = 8  # bytes in a cell

N = TypeVar("N", int, float)


class Column(Generic[N]):
    """One array of cells: ``column[i]`` reads cell ``i``, ``column[i] = x`` writes it."""

    def __init__(self, cells: Cells, offset: int, code: str, zero: N) -> None:
        self._cells: Cells = cells
        self._offset: int = offset
        self._code: str = code
        self._last: list[N] = [zero] * cells.n  # the values once the mapping is closed

    def __getitem__(self, i: int) -> N:
        at = self._at(i)
        try:
            value: N = struct.unpack_from(self._code, self._cells._map, at)[0]
        except ValueError:  # closed: the copy taken as it closed
            return self._last[i]
        return value

    def __setitem__(self, i: int, value: N) -> None:
        at = self._at(i)
        with self._cells._lock:  # not lost between close()'s copy and its unmapping
            if self._cells._map.closed:
                self._last[i] = value
            else:
                struct.pack_into(self._code, self._cells._map, at, value)

    def _at(self, i: int) -> int:
        if not 0 <= i < self._cells.n:
            raise IndexError(f"cell {i} out of range for {self._cells.n} cells")
        return self._offset + i * _WORD

    def _keep(self) -> None:
        self._last = [self[i] for i in range(self._cells.n)]


class Cells:
    """``current``, ``loading`` and ``started``: ``n`` cells each, shared with child processes.

    Args:
        n: cells in each array (the pool's workers).
        fd: a descriptor of an existing mapping (a child's copy, see :meth:`__reduce__`);
            default a new one, zeroed.

    Raises:
        ValueError: ``n`` is not positive.
    """

    def __init__(self, n: int, fd: int | None = None) -> None:
        if n <= 0:
            raise ValueError(f"n must be positive, got {n}")
        self.n = n
        size = 3 * n * _WORD
        given = fd is not None
        fd = _anonymous_file(size) if fd is None else fd
        try:
            self._map = mmap.mmap(fd, size)  # keeps a descriptor of its own until closed
        except BaseException:
            os.close(fd)
            raise
        if given:  # a child's copy: the mapping is all it needs
            os.close(fd)
            self._fd: int | None = None
            self._close_fd: Callable[[], Any] = lambda: None
        else:  # the descriptor goes at close(), or with this object if nobody closes it
            self._fd = fd
            self._close_fd = weakref.finalize(self, os.close, fd)
        self._lock = threading.Lock()  # close() against a write: see Column.__setitem__
        step = n * _WORD
        self.current: Column[int] = Column(self, 0, "q", 0)
        self.loading: Column[float] = Column(self, step, "d", 0.0)
        self.started: Column[int] = Column(self, 2 * step, "q", 0)

    def __reduce__(self) -> tuple[Any, ...]:
        """For a child started through the forkserver or ``spawn``: the descriptor travels with
        the process's arguments (as ``multiprocessing``'s own arenas do)."""
        if self._fd is None:
            raise RuntimeError("these cells are a child's copy or closed: they cannot be sent on")
        return (_rebuild, (self.n, reduction.DupFd(self._fd)))

    def close(self) -> None:
        """Close the descriptor and the mapping: no child can be given the cells from now on,
        and what reads or writes them from now on sees a private copy of their last values.
        Idempotent."""
        with self._lock:
            self._fd = None
            self._close_fd()
            if not self._map.closed:
                for column in (self.current, self.loading, self.started):
                    column._keep()
                self._map.close()


def _rebuild(n: int, dup: Any) -> Cells:
    return Cells(n, dup.detach())


def _anonymous_file(size: int) -> int:
    """A descriptor of a new zeroed file of ``size`` bytes that no name leads to."""
    try:
        fd = os.memfd_create("aioloader-cells", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # not Linux; a kernel before 3.17, or a seccomp filter
        fd = _unlinked_file()
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlinked_file() -> int:
    fd, path = tempfile.mkstemp(prefix=f"aioloader-cells-{os.getpid()}-")
    os.unlink(path)
    return fd
