"""The worker side: mapping the slots the pool leased, cached per process.

A worker attaches the slot of each job it runs (:func:`attach`). Mapping a segment costs a
system call and page-table set-up, and the pool hands the same few slots out again and again,
so a worker keeps its mappings in a small cache keyed by name. A cached mapping holds no
descriptor but pins its segment's memory even after the owner unlinks it, so the cache is
bounded (:data:`ATTACH_CACHE_MAX`) and drops mappings of unlinked segments whenever a new name
arrives. Workers never talk to the resource tracker.
"""

from __future__ import annotations

import collections
import os
import threading

import numpy as np
import numpy.typing as npt

from ._segment import Slot, map_existing, segment_exists

__all__ = ["ATTACH_CACHE_MAX", "attach", "attached", "detach_all"]

# Mappings a worker keeps. Each pins its segment's memory even after the owner unlinks it (but
# holds no descriptor); the pool normally has about prefetch-depth slots, well under this.
ATTACH_CACHE_MAX = 32

# name -> whole-segment uint8 view (which keeps the mapping alive); most recently used last.
# Invariant: holds no descriptor; a dropped entry is unmapped once no batch views it.
attached: collections.OrderedDict[str, npt.NDArray[np.uint8]] = collections.OrderedDict()
_attach_lock = threading.Lock()


def _new_attach_lock() -> None:
    # A parent's thread may have held it (mapping a slot) as the process forked: a forked
    # worker maps slots too, so it starts with its own lock.
    global _attach_lock
    _attach_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_attach_lock)


def attach(slot: Slot) -> npt.NDArray[np.uint8]:
    """Map a slot in a worker, without the resource tracker; cached per process by name.

    Args:
        slot: the slot sent with the job.

    Returns:
        A writable ``uint8`` array over the whole segment.

    Raises:
        FileNotFoundError: if the owner has unlinked the segment (pool closed).
        ValueError: if the segment's size differs from ``slot.size``.
        SharedMemoryError: if this process has no file descriptor left to open the segment.
    """
    with _attach_lock:
        hit = attached.get(slot.name)
        if hit is not None and hit.size == slot.size:
            attached.move_to_end(slot.name)
            return hit
        if hit is not None:
            del attached[slot.name]
        # A new name: the pool may have unlinked slots we still map, pinning their memory.
        for name in [n for n in attached if not segment_exists(n)]:
            del attached[name]
        buf = map_existing(slot)
        attached[slot.name] = buf
        while len(attached) > ATTACH_CACHE_MAX:
            attached.popitem(last=False)
        return buf


def detach_all() -> None:
    """Drop every cached mapping (worker shutdown); each is unmapped once no batch views it."""
    with _attach_lock:
        attached.clear()
