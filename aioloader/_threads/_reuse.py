"""Memory that large batches made on the loader's threads are collated into, and reused.

A batch made on a thread of this process (``num_workers=0``, ``thread_pool=True``) is stacked
into fresh memory, as torch's ``num_workers=0`` stacks it. Freed by the consumer's thread and
allocated again by the loader's, a batch of megabytes goes back to the kernel between the two:
glibc trims a thread's arena, numpy and torch unmap large blocks. Every batch then faults each
of its pages in again, zeroed by the kernel: a 9.6 MB batch took 5 ms to stack on a loader
thread, where the same stack into memory already faulted in took 0.7 ms (2 cores). Worker
processes never pay this: they collate into shared-memory slots that are reused.

:class:`ReusedBuffers` is that reuse for threads: collation asks it for each leaf's array
(``alloc``, the same hook a worker's slot answers), and a leaf of at least
:data:`REUSE_MIN_BYTES` gets a view of an anonymous mapping the pool keeps. The view's root is
an array over the mapping (views of views collapse to it, and ``torch.from_numpy`` keeps it),
so the mapping comes back to the pool only when the last array or tensor of that leaf is
collected; a batch the user keeps is never written again. Smaller leaves get plain arrays.

Bounds: at most ``keep`` free mappings are kept (the runner asks for its batches in flight,
twice: two large leaves a batch), and never more bytes than were out with batches at one time;
beyond that the oldest are unmapped, so a consumer that once held a hundred batches does not
leave a hundred mappings behind. Mappings come back when the next leaf is asked for (a
finalizer cannot take the lock). After :meth:`ReusedBuffers.close`, they are dropped.

Private: a child forked while a batch is alive (``multiprocessing`` with ``fork``) gets its own
copy of it, as of any other memory, never a view the parent will write into.

Thread-safety: ``alloc`` runs on any loader thread, under a lock. A finalizer (any thread, at
any allocation: the garbage collector) only appends to a deque, never takes the lock: a
collection inside ``alloc`` would otherwise wait on itself.
"""

from __future__ import annotations

import collections
import math
import mmap
import threading
import weakref
from typing import Any

import numpy as np

__all__ = ["REUSE_MIN_BYTES", "ReusedBuffers"]

#: Leaves smaller than this get plain arrays: glibc's heap serves them from memory it keeps
#: (its mmap threshold grows to 32 MiB after the first large free), so reuse gains nothing.
REUSE_MIN_BYTES = 1 << 20

#: A free mapping is reused for a leaf only if that leaf fills at least this share of it: the
#: last, smaller batch of an epoch gets its own mapping rather than pinning a larger one.
_MIN_FILL = 0.5

_PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


class ReusedBuffers:
    """Arrays for large collated leaves, over mappings reused once their batch is collected."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep!r}: at least one free mapping must be kept")
        self._keep = keep
        self._lock = threading.Lock()
        self._free: collections.deque[mmap.mmap] = collections.deque()  # oldest first
        self._free_bytes = 0
        self._returned: collections.deque[mmap.mmap] = collections.deque()  # by finalizers
        self._out_bytes = 0  # mappings held by batches now
        self._peak_bytes = 0  # the most ever held at once: the bound of what is kept free
        self._closed = False
        self.made = 0  # mappings created (each faults its pages in once)

    def alloc(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        """A writable C-contiguous array of ``shape`` and ``dtype``: over a reused mapping
        from :data:`REUSE_MIN_BYTES` on, else a plain one."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < REUSE_MIN_BYTES:
            return np.empty(shape, dtype)
        with self._lock:
            self._drain()
            mapping = self._take(nbytes)
            if mapping is None:
                mapping = mmap.mmap(-1, nbytes, flags=_PRIVATE)
                self.made += 1
            self._out_bytes += len(mapping)
            self._peak_bytes = max(self._peak_bytes, self._out_bytes)
        root = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
        finalizer = weakref.finalize(root, self._returned.append, mapping)
        finalizer.atexit = False
        return root.view(dtype).reshape(shape)

    def close(self) -> None:
        """Unmap the free mappings; those still held are dropped when their batch goes."""
        with self._lock:
            self._closed = True
            self._drain()
            self._free.clear()
            self._free_bytes = 0

    @property
    def free_bytes(self) -> int:
        with self._lock:
            self._drain()
            return self._free_bytes

    def _take(self, nbytes: int) -> mmap.mmap | None:
        # Lock held. The smallest free mapping the leaf fills enough of.
        fits = [m for m in self._free if nbytes <= len(m) and nbytes >= _MIN_FILL * len(m)]
        if not fits:
            return None
        best = min(fits, key=len)
        self._free.remove(best)
        self._free_bytes -= len(best)
        return best

    def _drain(self) -> None:
        # Lock held. Mappings whose batch was collected: free again, within the bound.
        while self._returned:
            mapping = self._returned.popleft()
            self._out_bytes -= len(mapping)
            if self._closed:
                continue
            self._free.append(mapping)
            self._free_bytes += len(mapping)
        while self._free and (
            len(self._free) > self._keep or self._free_bytes > self._peak_bytes - self._out_bytes
        ):
            dropped = self._free.popleft()
            self._free_bytes -= len(dropped)
