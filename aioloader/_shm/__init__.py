"""Shared-memory slots: how a batch collated in a worker reaches the main process uncopied.

This package is the only code that touches POSIX shared memory. The main process owns a
:class:`SlotPool` of segments ("slots") and is the only process that creates or unlinks them::

    main: SlotPool.lease(nbytes) ──Slot(name, size, lease_id)──▶ worker: attach(slot) (cached)
                                                                  SlotWriter(buf).alloc(...)
                                                                  collate straight into the slot
    main: SlotPool.open(slot, tree) ◀──Encoded(tree of ArrayRef)── SlotWriter.encode(batch)
          numpy / torch views of the segment, zero copies
    last view garbage-collected ──▶ weakref.finalize ──▶ the slot is free for the next lease

A batch that does not fit its slot comes back inline (pickled by the executor) with
``needed_bytes`` set, so the caller can lease bigger slots from then on. Tiny batches
(under :data:`INLINE_MAX_BYTES`) always come back inline.

One job per module:

- ``_segment``: one segment's system calls: its name, creating it with its pages reserved,
  mapping it through libc, attaching an existing one, unlinking; the :class:`Slot` record;
  :func:`free_bytes` and :func:`shm_available`; the :func:`janitor` for segments of dead
  processes (it reads the names made there).
- ``_pool``: :class:`SlotPool`, the main process's state machine over its segments (free,
  leased, held), and its :class:`ShmStats`.
- ``_attach``: the worker side: :func:`attach`, its bounded cache, :func:`detach_all`.

Imports go one way (``_pool`` and ``_attach`` use ``_segment``; neither uses the other) and no
module reads another's ``_private`` names. How a batch is laid out in a slot and read back
(:class:`SlotWriter`, :class:`Encoded`, :class:`ArrayRef`, the tree walks) lives in
:mod:`aioloader._shm._descriptors`, which only works on buffers mapped here. This module only
re-exports, those names included, so callers import everything from ``_shm``.

Sharp edges, and what this module does about them:

- **Resource tracker (Python 3.11).** ``SharedMemory(name)`` registers every segment it
  attaches with the resource tracker, and ``forkserver``/``spawn`` workers share the parent's
  tracker process. The tracker keeps one entry per name (a set, not a count), so a worker that
  unregisters right after attaching deletes the *owner's* entry: the owner's own unregister
  then makes the tracker print a ``KeyError`` traceback, and an owner crash leaks the segment.
  ``SharedMemory.__del__`` also reports a ``BufferError`` when views outlive it. So neither side
  uses ``SharedMemory``: both call ``_posixshmem.shm_open`` and libc's ``mmap`` directly. Only the
  owner registers its segments with the tracker (and unregisters on unlink), so if the owner is
  killed, the tracker unlinks them once the owner's workers are gone (printing a "leaked" warning,
  which is then true). Workers never talk to the tracker.
- **SIGBUS on a full tmpfs.** Pages of a segment are allocated when first touched; on a full
  ``/dev/shm`` (Docker's default is 64 MiB) that touch kills the process with SIGBUS. A new
  segment's pages are reserved up front with ``os.posix_fallocate`` (or, where the file system
  lacks it, by writing zeros), so a full ``/dev/shm`` raises :class:`SharedMemoryError` at
  ``lease`` time, naming the bytes asked and the bytes free. tmpfs pages are charged to the
  memory cgroup of the process that allocates them: a tight container limit can still OOM-kill.
- **A segment cut shorter than its mapping.** A worker makes the segment of a loader's first
  batches at the batch's first large allocation, with room to spare, and cuts it to the batch's
  size once packed (:func:`shrink`): its own mapping then reaches past the file, and a touch
  there is a SIGBUS. Nothing touches it: the batch lies below the cut, and its writer refuses
  to allocate after packing.
- **A mapping lives as long as its last view.** A segment is mapped into a plain buffer object
  (made in ``_segment``) that every numpy view of it keeps alive; a finalizer unmaps it when the
  last reference goes, so nothing can unmap memory that a view still reads (Python's ``mmap.close``
  would refuse with ``BufferError`` instead). :meth:`SlotPool.close` unlinks every segment at
  once and drops its own references; a batch still alive keeps its mapping until it dies.
- **Unlinked is not freed.** A segment's memory lives until every mapping of it is gone, in
  every process. Workers cache their mappings; on each new attach they drop mappings of
  segments that no longer exist, and the cache is bounded (:data:`ATTACH_CACHE_MAX`).
- **Removed behind our back.** systemd-logind (``RemoveIPC=yes``, its default) removes a
  user's segments when that user's last session ends; cleanup scripts and container restarts
  empty ``/dev/shm`` too. Mappings survive it, so only a worker opening the slot for the first
  time notices: :func:`attach` raises ``FileNotFoundError`` naming those likely causes, the
  worker sends that batch inline, and the pool forgets the segment (:meth:`SlotPool.forget`).
- **Names.** ``aiol_<pid>_<8 hex>``: at most 21 characters, under macOS's 31-character limit.
  The pid lets :func:`janitor` find segments of dead processes. Two caveats: a dead owner's pid
  may be reused (its segments then wait for the new process to die too), and processes in
  another PID namespace that share ``/dev/shm`` look dead; segments of other users cannot be
  unlinked (``/dev/shm`` is sticky) and are skipped.
- **File descriptors.** A mapping needs no open file: the descriptor from ``shm_open`` is
  closed as soon as the segment is mapped, so a live batch, a slot of the pool and a worker's
  cached attachment hold none, and ``list(loader)`` may keep thousands of batches under
  ``ulimit -n 1024``. Python's ``mmap.mmap`` would keep a duplicate of the descriptor for the
  mapping's life (until 3.13's ``trackfd=False``), which is why ``_segment`` calls libc through
  ``ctypes``. A descriptor is still needed for a moment to create or attach a segment; if the
  process has none left, :class:`SharedMemoryError` names the slot's size, the limit and
  ``ulimit -n``.
- **Timing of returns.** A slot comes back when the last view of its batch is collected; views
  caught in a reference cycle wait for the cycle collector. Returns are queued by the finalizer
  and applied by the next pool call, so finalizers never take a lock (they may run inside a GC
  pass that interrupted a pool method on the same thread).
- **Forked children.** A pool only unlinks segments in the process that created it, so a
  ``fork``-ed child that drops its copy of the pool does not destroy the parent's slots.
"""

from __future__ import annotations

from ._attach import ATTACH_CACHE_MAX as ATTACH_CACHE_MAX
from ._attach import attach as attach
from ._attach import attached as attached
from ._attach import detach_all as detach_all
from ._descriptors import ALIGN as ALIGN
from ._descriptors import BYTES_IN_SLOT_MIN as BYTES_IN_SLOT_MIN
from ._descriptors import HUGE_BYTES_MIN as HUGE_BYTES_MIN
from ._descriptors import INLINE_MAX_BYTES as INLINE_MAX_BYTES
from ._descriptors import ArrayRef as ArrayRef
from ._descriptors import Encoded as Encoded
from ._descriptors import SlotWriter as SlotWriter
from ._descriptors import alloc_args as alloc_args
from ._descriptors import in_slot_bytes as in_slot_bytes
from ._descriptors import new_bytes as new_bytes
from ._descriptors import slot_nbytes as slot_nbytes
from ._descriptors import storable_dtype as storable_dtype
from ._pool import BUDGET_FRACTION as BUDGET_FRACTION
from ._pool import BUDGET_MAX as BUDGET_MAX
from ._pool import GROWTH as GROWTH
from ._pool import MIN_SLOT_BYTES as MIN_SLOT_BYTES
from ._pool import ShmStats as ShmStats
from ._pool import SlotPool as SlotPool
from ._pool import budget as budget
from ._pool import slot_size as slot_size
from ._segment import SHM_DIR as SHM_DIR
from ._segment import SHM_PREFIX as SHM_PREFIX
from ._segment import TURN_WAIT_S as TURN_WAIT_S
from ._segment import Slot as Slot
from ._segment import as_bytes as as_bytes
from ._segment import create_segment as create_segment
from ._segment import discard as discard
from ._segment import drop_pages as drop_pages
from ._segment import free_bytes as free_bytes
from ._segment import janitor as janitor
from ._segment import map_private as map_private
from ._segment import new_name as new_name
from ._segment import page_round as page_round
from ._segment import segment_exists as segment_exists
from ._segment import shm_available as shm_available
from ._segment import shrink as shrink
from ._segment import turn as turn
from ._segment import unlink as unlink

__all__ = [
    "ALIGN",
    "ATTACH_CACHE_MAX",
    "BUDGET_FRACTION",
    "BUDGET_MAX",
    "BYTES_IN_SLOT_MIN",
    "GROWTH",
    "HUGE_BYTES_MIN",
    "INLINE_MAX_BYTES",
    "MIN_SLOT_BYTES",
    "SHM_DIR",
    "SHM_PREFIX",
    "TURN_WAIT_S",
    "ArrayRef",
    "Encoded",
    "ShmStats",
    "Slot",
    "SlotPool",
    "SlotWriter",
    "alloc_args",
    "as_bytes",
    "attach",
    "attached",
    "budget",
    "create_segment",
    "detach_all",
    "discard",
    "drop_pages",
    "free_bytes",
    "in_slot_bytes",
    "janitor",
    "map_private",
    "new_bytes",
    "new_name",
    "page_round",
    "segment_exists",
    "shm_available",
    "shrink",
    "slot_nbytes",
    "slot_size",
    "storable_dtype",
    "turn",
    "unlink",
]
