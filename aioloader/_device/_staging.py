"""Pinned staging buffers: where pageable leaves are copied before they go to the device.

A copy from pageable host memory is synchronous in CUDA; from page-locked memory it is not. So
:class:`DeviceStage` memcpys each pageable leaf of a batch into one pinned buffer leased from
:class:`StagingPool`, and copies to the device from there. The pool is a synchronous state
machine: it never waits for the device; the stage tells it when a buffer's copies completed.

Sharp edges:

- Invariant: a staging buffer is leased by at most one copy in flight. It returns to the pool
  only after the event recorded after its copies completed; a buffer whose copy failed on the
  device is discarded, never reused.
- Pinned memory is locked RAM the rest of the machine cannot page: free buffers beyond
  :data:`MAX_POOLED_STAGING_BYTES` are released (smallest first).
- Buffer sizes are rounded up to :data:`STAGING_GRANULE` so batches of slightly different size
  reuse one buffer; each leaf starts at a multiple of :data:`STAGING_ALIGN` inside it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

__all__ = [
    "MAX_POOLED_STAGING_BYTES",
    "STAGING_ALIGN",
    "STAGING_GRANULE",
    "StagingPool",
    "align_up",
]

# Each leaf starts at a multiple of this many bytes inside a batch's staging buffer: enough for
# any dtype's alignment and for efficient DMA, at a cost of < 512 bytes per leaf.
STAGING_ALIGN = 512
# Staging buffers are allocated in multiples of this, so batches of slightly different size
# (the last batch, variable-length samples) reuse the same buffers; wastes < 1 MiB per buffer.
STAGING_GRANULE = 1 << 20
# Free staging buffers beyond this many bytes are released. Pinned memory is locked RAM that
# the rest of the machine cannot page; the pool normally holds (copies in flight + 1) buffers,
# so the cap only matters when batch sizes keep changing. (A released buffer goes back to
# torch's caching host allocator, which keeps it pinned for torch's own reuse.)
MAX_POOLED_STAGING_BYTES = 1 << 30


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`STAGING_ALIGN`: where the next leaf may start."""
    return -(-n // STAGING_ALIGN) * STAGING_ALIGN


class StagingPool:
    """Pinned staging buffers, reused across batches; a sync state machine.

    Invariant: every buffer the pool allocated is either in ``_free`` (sorted by size) or
    leased, and ``_bytes`` is the sum over both.
    """

    def __init__(self, alloc: Callable[[int], torch.Tensor], max_free_bytes: int) -> None:
        self._alloc = alloc
        self._max_free_bytes = max_free_bytes
        self._free: list[torch.Tensor] = []
        self._leased: dict[int, torch.Tensor] = {}
        self._bytes = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """Lease the smallest free buffer that fits, or allocate one rounded up to the granule."""
        sizes = [buf.numel() for buf in self._free]
        i = bisect.bisect_left(sizes, nbytes)
        if i < len(self._free):
            buf = self._free.pop(i)
        else:
            size = -(-nbytes // STAGING_GRANULE) * STAGING_GRANULE
            buf = self._alloc(size)
            self._bytes += buf.numel()
        self._leased[id(buf)] = buf
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Return a leased buffer whose copies have completed."""
        if self._leased.pop(id(buf), None) is None:
            return
        bisect.insort(self._free, buf, key=lambda b: b.numel())
        free_bytes = sum(b.numel() for b in self._free)
        while free_bytes > self._max_free_bytes and self._free:
            # The smallest buffers serve the fewest requests: drop them first.
            dropped = self._free.pop(0)
            free_bytes -= dropped.numel()
            self._bytes -= dropped.numel()

    def discard(self, buf: torch.Tensor) -> None:
        """Forget a leased buffer that must not be reused (its copy failed on the device)."""
        if self._leased.pop(id(buf), None) is not None:
            self._bytes -= buf.numel()

    def clear(self) -> None:
        """Drop every free buffer and forget leased ones (they die with their last user)."""
        self._free.clear()
        self._leased.clear()
        self._bytes = 0

    @property
    def buffers(self) -> int:
        return len(self._free) + len(self._leased)

    @property
    def nbytes(self) -> int:
        return self._bytes
