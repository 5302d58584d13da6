"""The slot pool: the main process's segments, leased to workers and held by batches.

:class:`SlotPool` is the only owner of segments: it creates them on demand (through
:mod:`._segment`), leases them one batch at a time, rebuilds a worker's batch as views of its
slot, takes a slot back when the last view dies, and unlinks every segment on ``close``.
Invariant: every segment is FREE, LEASED to a worker, or HELD by a live batch, and the sizes of
all segments, plus the bytes reserved for segments workers are making (:meth:`SlotPool.reserve`),
sum to at most ``max_bytes``.

Free slots are kept for reuse, but only as many as an epoch in flight needs: the most slots
ever leased at once (:attr:`SlotPool.keep`; it follows ``prefetch``) and :data:`KEEP_SPARE`
for the consumer's own. A burst that held more
(``list(loader)`` of an evaluation pass) gives the rest back: at once when every slot is free
(no batch being made and none held: the burst was dropped and nothing runs), else once they
were free for :data:`IDLE_GRACE_S` (a slot freed while others are in use is leased again at
once in an epoch, so it is not given back then). The check runs at every call of the pool,
and when a batch's last view dies (:func:`_on_return`), so a burst dropped by a program that
calls the loader no more is given back too.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import math
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from .._tree import iter_leaves, map_tree
from ._descriptors import ArrayRef, Encoded, import_torch, ref_end, view_leaf
from ._segment import (
    SHM_DIR,
    SegmentMapping,
    Slot,
    as_bytes,
    create_segment,
    discard,
    free_bytes,
    janitor_once,
    map_shared,
    page_round,
    unlink,
)

__all__ = [
    "BUDGET_FRACTION",
    "BUDGET_MAX",
    "GROWTH",
    "IDLE_GRACE_S",
    "KEEP_SPARE",
    "MIN_SLOT_BYTES",
    "ShmStats",
    "SlotPool",
    "budget",
    "slot_size",
]

# A new segment is the size of the batch that asked for it (whole pages), until a batch larger
# than every slot made before asks: batch sizes vary (variable-length samples), and from then on
# a new segment gets this much headroom, so that batches a little larger still reuse it instead
# of re-creating it. With default collation of fixed-shape samples every batch has one size,
# and headroom made from the start was never used: 25% more of every slot, in /dev/shm and in
# the PSS of every process that maps it. Higher wastes /dev/shm once sizes vary; lower
# re-creates segments (slow first writes: page faults) more often.
GROWTH = 1.25

# The smallest segment created. Larger wastes memory on small batches; smaller creates more
# segments while batch sizes are still being learned.
MIN_SLOT_BYTES = 1 << 20

# The default budget of a pool (``shm_max_bytes`` not given): a quarter of /dev/shm's free
# space, at most 4 GiB. Larger: more batches the consumer keeps (a ``list(loader)``) stay
# zero-copy; smaller: more room left for other loaders and ranks on the node. Above the budget,
# batches travel pickled rather than failing.
BUDGET_FRACTION = 0.25
BUDGET_MAX = 4 << 30

# How long a free slot beyond what an epoch in flight needs (:attr:`SlotPool.keep`) is kept
# while batches are being made, in case a burst comes again (a consumer that holds a few steps'
# batches, then lets them go). Longer: fewer segments made afresh (slow first writes); shorter:
# /dev/shm and memory given back sooner. With nothing leased they go at once.
IDLE_GRACE_S = 5.0

# Free slots kept beyond the most ever leased at once: the batch the consumer holds and the one
# before it, which a loop drops only as it takes the next (or at an epoch's end, when nothing
# is leased). Without them every epoch of a training loop gave back a slot at its end and made
# it again at the next, its pages faulted in afresh: a quarter of the large-batch rate. More:
# a burst leaves more behind; fewer: that churn.
KEEP_SPARE = 2


def slot_size(nbytes: int, *, headroom: bool = False, min_slot_bytes: int = MIN_SLOT_BYTES) -> int:
    """The size of a new segment for a batch of ``nbytes`` bytes in a slot, its alignment
    counted (:func:`in_slot_bytes` of its leaves): whole pages, at least ``min_slot_bytes``,
    and with :data:`GROWTH` of headroom where ``headroom`` (batch sizes vary). The one rule,
    for the pool's segments and those a worker makes for a loader's first batches."""
    wanted = math.ceil(nbytes * GROWTH) if headroom else nbytes
    return page_round(max(wanted, min_slot_bytes))


def budget(max_bytes: int | None, free: int | None = None) -> int:
    """The bytes a slot pool may hold: ``max_bytes`` as given (``shm_max_bytes``), else the
    default: :data:`BUDGET_FRACTION` of ``free`` (what /dev/shm has free now, when None), at
    most :data:`BUDGET_MAX`. The one rule, for a loader's own pool, a shared one and the
    doctor's report alike."""
    if max_bytes is not None:
        return max_bytes
    if free is None:
        free = free_bytes()
    return int(min(BUDGET_MAX, free * BUDGET_FRACTION))


@dataclass(frozen=True, slots=True)
class ShmStats:
    """A snapshot of a :class:`SlotPool`.

    Attributes:
        slots: segments alive (``free + leased + held``).
        free: ready for the next lease.
        leased: sent to a worker, not yet opened or released.
        held: holding a batch whose views are still alive.
        bytes_total: bytes of all segments (at most ``max_bytes``).
        max_bytes: the pool's cap.
    """

    slots: int
    free: int
    leased: int
    held: int
    bytes_total: int
    max_bytes: int


class _State(Enum):
    FREE = "free"
    LEASED = "leased"  # sent to a worker; only release() or open() may change it
    HELD = "held"  # views of a batch are alive; only their finalizer may free it


@dataclass(slots=True)
class _Segment:
    name: str
    size: int
    mapping: SegmentMapping
    state: _State = _State.FREE
    lease_id: int = 0
    freed_at: float = 0.0  # when it last became FREE (the pool's clock)


def _destroy(segments: dict[str, _Segment]) -> None:
    for seg in segments.values():
        unlink(seg.name)
    segments.clear()  # our mappings go now; those of live batches go with their last view


def _finalize_pool(segments: dict[str, _Segment], owner: int) -> None:
    # Runs when an unclosed pool is collected or at interpreter exit.
    if os.getpid() != owner:
        return
    if segments:
        warnings.warn(
            f"SlotPool with {len(segments)} shared-memory segment(s) was never closed; "
            "unlinking them now. Call close() (the loader's aclose()).",
            ResourceWarning,
            stacklevel=1,
        )
    _destroy(segments)


def _on_return(
    returned: collections.deque[tuple[str, int]],
    pool: weakref.ref[SlotPool],
    item: tuple[str, int],
) -> None:
    """A held batch's last view died (a finalizer: any thread, any time): queue its slot's
    return (``deque.append`` is atomic), and apply it now if the pool is free to take it, so a
    burst a program dropped is given back without another call (see :meth:`SlotPool._trim`).
    The pool is referenced weakly: a live batch does not keep a pool alive."""
    returned.append(item)
    alive = pool()
    if alive is not None:
        alive.drain_nowait()
        alive.wake_watchers()


class SlotPool:
    """The main process's pool of shared-memory slots, reused from batch to batch.

    Segments are created on demand, kept after use, and handed out again, because a fresh
    segment is written several times slower than a reused one (page faults). Methods are
    thread-safe.

    Args:
        max_bytes: cap on the bytes of all segments together (free, leased and held).
        min_slot_bytes: the smallest segment created.
        shm_dir: the tmpfs behind POSIX shared memory, for free-space checks and the janitor.
        on_map: called with ``(address, size)`` of each new segment's mapping, e.g. to register
            it as page-locked memory for device copies (best effort: errors are ignored).
        on_unmap: called with the address before a segment is unlinked and unmapped.
        clock: the clock of :data:`IDLE_GRACE_S` (tests pass a fake one).
        keep_spare: free slots kept beyond the most ever leased at once (:data:`KEEP_SPARE`).

    Raises:
        ValueError: if a size is not a positive int or ``min_slot_bytes > max_bytes``.
        OSError: where POSIX shared memory does not exist (check :func:`shm_available`).
    """

    def __init__(
        self,
        max_bytes: int,
        *,
        min_slot_bytes: int = MIN_SLOT_BYTES,
        shm_dir: str = SHM_DIR,
        on_map: Callable[[int, int], Any] | None = None,
        on_unmap: Callable[[int], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        keep_spare: int = KEEP_SPARE,
    ) -> None:
        for arg, value in (("max_bytes", max_bytes), ("min_slot_bytes", min_slot_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        if min_slot_bytes > max_bytes:
            raise ValueError(
                f"min_slot_bytes={min_slot_bytes} must not exceed max_bytes={max_bytes}"
            )
        if sys.platform == "win32":  # pragma: no cover
            raise OSError("POSIX shared memory is not available here; check shm_available()")
        self.max_bytes = max_bytes
        self.min_slot_bytes = min_slot_bytes
        self.shm_dir = shm_dir
        self._on_map = on_map
        self._on_unmap = on_unmap
        self._clock = clock
        self.keep = 1  # the most slots ever leased at once (see _trim)
        self._largest = 0  # the largest size a segment was made for: past it, headroom (GROWTH)
        self._keep_spare = keep_spare
        # Invariant: every segment is FREE, LEASED to a worker, or HELD by a live batch, and the
        # sizes of all segments plus _reserved sum to at most max_bytes.
        self._segments: dict[str, _Segment] = {}
        self._reserved = 0  # bytes promised to segments workers make (reserve(), adopt())
        self._lock = threading.Lock()
        self._lease_ids = itertools.count(1)
        # (name, lease_id) of held batches whose views died; appended by finalizers (any thread,
        # any time, lock-free: deque.append is atomic), applied under the lock by _drain().
        self._returned: collections.deque[tuple[str, int]] = collections.deque()
        # Callbacks of leases waiting for a held slot to come back (watch()); popped and called
        # by the finalizer of a returning batch (any thread, lock-free) or by close().
        self._watchers: collections.deque[Callable[[], Any]] = collections.deque()
        self._closed = False
        self._unlinking: str | None = None  # the segment close() was unlinking, if it was cut
        self._owner = os.getpid()
        self._finalizer = weakref.finalize(self, _finalize_pool, self._segments, self._owner)
        janitor_once(shm_dir)

    def __repr__(self) -> str:
        s = self.stats()
        state = "closed" if self._closed else "open"
        return (
            f"<SlotPool {state} slots={s.slots} free={s.free} leased={s.leased} "
            f"held={s.held} bytes={s.bytes_total}/{s.max_bytes}>"
        )

    def reuse(self, nbytes: int) -> Slot | None:
        """Lease a free slot of at least ``nbytes`` if there is one; never creates a segment.

        Cheap (no system call), so the event loop may call it; when it returns None, call
        :meth:`lease` from a thread, since creating a segment takes a while.
        """
        return self._lease(nbytes, create=False)

    def watch(self, nbytes: int, wake: Callable[[], Any]) -> tuple[Slot | None, bool]:
        """Lease a free slot of at least ``nbytes`` if there is one (as :meth:`reuse`); if not,
        and two batches or more are held, one in a slot that fits, call ``wake`` (once, from
        any thread) when a held batch's slot comes back, until :meth:`unwatch`; then
        :meth:`reuse` may find it. ``wake`` must not block and should not raise.

        A ``for`` loop holds its last batch while it asks for the next, and the lease of the
        batch that then goes into production comes before the loop drops that last batch: a
        lease that waits for it (microseconds) takes its slot instead of making one more.

        Returns:
            ``(slot, False)`` with a free slot; ``(None, True)`` with ``wake`` registered (it
            may have been called already); ``(None, False)`` with nothing to wait for.
        """
        with self._lock:
            slot = self._lease_locked(nbytes, create=False)
            if slot is not None:
                return slot, False
            held = [s for s in self._segments.values() if s.state is _State.HELD]
            if len(held) < 2 or not any(s.size >= nbytes for s in held):
                # One batch held is the one the consumer works on: it is not about to go.
                return None, False
            self._watchers.append(wake)
            # A return its finalizer queued while we held the lock (drain_nowait could not
            # apply it) woke nobody: apply it now. One after this calls ``wake``.
            slot = self._lease_locked(nbytes, create=False)
            if slot is not None:
                self.unwatch(wake)
                return slot, False
            return None, True

    def unwatch(self, wake: Callable[[], Any]) -> None:
        """Forget ``wake`` (registered by :meth:`watch`) if it was not called yet."""
        with contextlib.suppress(ValueError):
            self._watchers.remove(wake)

    def wake_watchers(self) -> None:
        """Call every registered ``wake`` once (a held slot came back, or the pool closed).
        Never blocks: a finalizer calls it."""
        while True:
            try:
                wake = self._watchers.popleft()
            except IndexError:
                return
            with contextlib.suppress(Exception):
                wake()

    def lease(self, nbytes: int) -> Slot | None:
        """Lease a slot of at least ``nbytes`` for one batch.

        Prefers the smallest free slot that fits; otherwise creates a segment of ``nbytes``
        (whole pages; with headroom, :data:`GROWTH`, once a batch larger than every slot made
        before asked), first unlinking free slots that are too small if the cap requires.
        Creating blocks while the segment's pages are reserved and mapped (a fraction of a
        second per GB; call it from a thread if that matters).

        Args:
            nbytes: bytes the batch needs (e.g. the largest ``needed_bytes`` seen).

        Returns:
            The slot, or None if it cannot fit under ``max_bytes``: send the batch inline.

        Raises:
            ValueError: if ``nbytes`` is not a non-negative int.
            RuntimeError: if the pool is closed.
            SharedMemoryError: if ``/dev/shm`` has no room for the segment.
        """
        return self._lease(nbytes, create=True)

    def _lease(self, nbytes: int, *, create: bool) -> Slot | None:
        with self._lock:
            return self._lease_locked(nbytes, create=create)

    def _lease_locked(self, nbytes: int, *, create: bool) -> Slot | None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        if self._closed:
            raise RuntimeError("SlotPool is closed")
        self._drain()
        best = min(
            (s for s in self._segments.values() if s.state is _State.FREE and s.size >= nbytes),
            key=lambda s: s.size,
            default=None,
        )
        if best is None:
            best = self._make_room_and_create(nbytes) if create else None
            if best is None:
                return None
        best.state = _State.LEASED
        best.lease_id = next(self._lease_ids)
        self._count_leased()
        return Slot(best.name, best.size, best.lease_id)

    def _make_room_and_create(self, nbytes: int) -> _Segment | None:
        # Called with the lock held, when no free slot is big enough.
        free = sorted(
            (s for s in self._segments.values() if s.state is _State.FREE), key=lambda s: s.size
        )
        busy = sum(s.size for s in self._segments.values()) - sum(s.size for s in free)
        busy += self._reserved
        exact = slot_size(nbytes, min_slot_bytes=self.min_slot_bytes)
        roomy = slot_size(nbytes, headroom=True, min_slot_bytes=self.min_slot_bytes)
        bare = page_round(max(nbytes, self.min_slot_bytes))  # under a tight cap, no slack even
        grew = 0 < self._largest < nbytes  # sizes vary: leave room for the next ones
        self._largest = max(self._largest, nbytes)
        sizes = (roomy, exact, bare) if grew else (exact, bare)
        size = next((n for n in sizes if busy + n <= self.max_bytes), None)
        if size is None:
            return None
        total = busy + sum(s.size for s in free)
        for seg in free:  # all too small for this batch; drop the smallest first
            if total + size <= self.max_bytes:
                break
            del self._segments[seg.name]  # FREE: no view holds it; unmapped with our last ref
            self._unmapping(seg)
            unlink(seg.name)
            total -= seg.size
        seg = self._create(size)
        self._segments[seg.name] = seg
        if self._on_map is not None:
            with contextlib.suppress(Exception):
                self._on_map(ctypes.addressof(seg.mapping), seg.size)
        return seg

    def _unmapping(self, seg: _Segment) -> None:
        if self._on_unmap is not None:
            with contextlib.suppress(Exception):
                self._on_unmap(ctypes.addressof(seg.mapping))

    def _create(self, size: int) -> _Segment:
        name, mapping = create_segment(size, self.shm_dir)
        return _Segment(name, size, mapping)

    def reserve(self, nbytes: int) -> int:
        """Set aside up to ``nbytes`` of the cap for a segment a worker will make (a batch whose
        size is not known yet): the bytes reserved, or 0 if less than ``min_slot_bytes`` is
        left. The worker makes a segment of at most that size; :meth:`adopt` takes it over
        with its reservation, or :meth:`unreserve` gives the reservation back."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        with self._lock:
            if self._closed:
                return 0
            used = sum(s.size for s in self._segments.values()) + self._reserved
            granted = min(nbytes, self.max_bytes - used)
            if granted < self.min_slot_bytes:
                return 0
            self._reserved += granted
            return granted

    def unreserve(self, nbytes: int) -> None:
        """Give back a reservation of :meth:`reserve` whose segment was not made."""
        with self._lock:
            self._reserved = max(0, self._reserved - nbytes)

    def adopt(self, name: str, size: int, reserved: int = 0) -> Slot:
        """Take over segment ``name`` that a worker created for a batch (one made before the
        batch size was known) as a leased slot, to be opened like any: it is then the pool's
        to reuse and unlink. ``reserved`` is the :meth:`reserve` it was made under (at least
        ``size``), given back as the segment takes its place under the cap.

        Raises:
            RuntimeError: if the pool is closed (the segment is unlinked).
            FileNotFoundError: if the segment is gone.
        """
        try:
            mapping = map_shared(Slot(name, size))
        except BaseException:
            self.unreserve(reserved)
            unlink(name)
            raise
        with self._lock:
            self._reserved = max(0, self._reserved - reserved)
            if self._closed:
                unlink(name)
                raise RuntimeError("SlotPool is closed")
            seg = _Segment(name, size, mapping, _State.LEASED, next(self._lease_ids))
            self._segments[name] = seg
            self._largest = max(self._largest, size)
            self._count_leased()
        if self._on_map is not None:
            with contextlib.suppress(Exception):
                self._on_map(ctypes.addressof(seg.mapping), seg.size)
        return Slot(name, size, seg.lease_id)

    def release(self, slot: Slot) -> None:
        """Return a leased slot whose batch came back inline or was abandoned.

        Call it only once the worker can no longer write into the slot (its job finished, or the
        worker is dead). Releases that do not match the current lease are ignored: a second
        release, a release after :meth:`open` (the batch's views own the slot now), a release of
        an older lease of the same segment, or any release after :meth:`close`. So a double
        release never hands one slot to two batches.
        """
        with self._lock:
            self._drain()
            seg = self._segments.get(slot.name)
            if seg is None or seg.state is not _State.LEASED or seg.lease_id != slot.lease_id:
                return
            self._free(seg)
            self._trim()
        self.wake_watchers()  # a lease waiting for a slot to come back (watch) may take it

    def forget(self, slot: Slot) -> None:
        """Drop a leased slot for good: unlinked (if it is still there) and never leased again;
        its memory goes with the last mapping. For a segment that vanished from ``/dev/shm``
        (removed by someone else), or one a dying process may still write into. Like
        :meth:`release`, a call that does not match the current lease does nothing."""
        with self._lock:
            self._drain()
            seg = self._segments.get(slot.name)
            if seg is not None and seg.state is _State.LEASED and seg.lease_id == slot.lease_id:
                del self._segments[seg.name]
                self._unmapping(seg)
                unlink(seg.name)  # gone already; this tells the resource tracker

    def open(self, slot: Slot, tree: Any) -> Any:
        """Rebuild a batch from a worker's descriptor tree as views of the slot: zero copies.

        Every array is a view of one root ``uint8`` array over the used bytes; when the root is
        collected (every view of the batch is gone, including torch tensors made from them),
        the slot becomes free. If this raises, the slot stays leased: release it.

        Args:
            slot: the slot leased for this batch.
            tree: :attr:`Encoded.tree` of a non-inline :class:`Encoded`.

        Returns:
            The batch, with the nesting of the worker's batch.

        Raises:
            RuntimeError: if the pool is closed.
            ValueError: if ``slot`` is not currently leased under this lease id (stale, already
                opened or released) or a descriptor lies outside the slot.
            TypeError: if ``tree`` is an :class:`Encoded` rather than its ``tree``.
        """
        if isinstance(tree, Encoded):
            raise TypeError("open() takes Encoded.tree, not the Encoded record")
        refs = [leaf for leaf in iter_leaves(tree) if isinstance(leaf, ArrayRef)]
        with self._lock:
            if self._closed:
                raise RuntimeError("SlotPool is closed")
            self._drain()
            seg = self._segments.get(slot.name)
            if seg is None or seg.state is not _State.LEASED or seg.lease_id != slot.lease_id:
                state = "unknown" if seg is None else f"{seg.state.value}, lease {seg.lease_id}"
                raise ValueError(f"slot={slot!r} is not leased under this lease id ({state})")
            if refs:
                used = max(ref_end(ref, seg.size) for ref in refs)
                root = as_bytes(seg.mapping, used)
                torch_mod = import_torch() if any(r.kind == "torch" for r in refs) else None
                batch = map_tree(tree, lambda leaf: view_leaf(root, leaf, torch_mod))
                seg.state = _State.HELD
                returned = (seg.name, seg.lease_id)
                fin = weakref.finalize(
                    root, _on_return, self._returned, weakref.ref(self), returned
                )
                fin.atexit = False
                return batch
            self._free(seg)  # nothing points into the slot: it is free again at once
        self.wake_watchers()
        return tree

    def write(self, slot: Slot, parts: Sequence[tuple[int, Any]]) -> None:
        """Copy each ``(offset, data)`` of ``parts`` into the leased ``slot``: the other way
        round, data the main process sends a worker (raw samples for it to decode). The slot
        stays leased; release it once the worker is done reading.

        Raises:
            RuntimeError: if the pool is closed.
            ValueError: if ``slot`` is not currently leased under this lease id, or a part
                lies outside the slot.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("SlotPool is closed")
            seg = self._segments.get(slot.name)
            if seg is None or seg.state is not _State.LEASED or seg.lease_id != slot.lease_id:
                raise ValueError(f"slot={slot!r} is not leased under this lease id")
            mapping = seg.mapping  # keeps the segment mapped while the bytes are copied
        with memoryview(mapping) as mapped, mapped.cast("B") as view:
            for offset, data in parts:
                size = len(data)
                if offset < 0 or offset + size > seg.size:
                    raise ValueError(f"{size} bytes at offset {offset} do not fit {slot!r}")
                view[offset : offset + size] = data

    def _drain(self) -> None:
        # Lock held. Apply the returns that finalizers queued, then give back idle slots.
        while self._returned:
            name, lease_id = self._returned.popleft()
            seg = self._segments.get(name)
            if seg is not None and seg.state is _State.HELD and seg.lease_id == lease_id:
                self._free(seg)
        self._trim()

    def drain_nowait(self) -> None:
        """Apply the returns of batches that died, and give back idle slots, unless another
        thread is in the pool now (it does so itself). Never blocks: a finalizer calls it."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if not self._closed:
                self._drain()
        finally:
            self._lock.release()

    def _free(self, seg: _Segment) -> None:
        seg.state, seg.lease_id, seg.freed_at = _State.FREE, 0, self._clock()

    def _count_leased(self) -> None:
        # Lock held, after a lease: an epoch in flight needs as many slots as it leases at once.
        leased = sum(1 for s in self._segments.values() if s.state is _State.LEASED)
        self.keep = max(self.keep, leased)

    def _trim(self) -> None:
        """Lock held. Unlink the free slots beyond :attr:`keep` and :data:`KEEP_SPARE` (the
        largest are kept: they fit any batch): at once if every slot is free (no batch being
        made, none held: a burst was dropped, or an epoch ended), else those free for
        :data:`IDLE_GRACE_S` (a slot freed while others are in use is leased again within
        milliseconds in an epoch). Not in a forked child: the segments are the parent's."""
        free = [s for s in self._segments.values() if s.state is _State.FREE]
        kept = self.keep + self._keep_spare
        if len(free) <= kept or os.getpid() != self._owner:
            return
        in_use = len(free) < len(self._segments)
        old = self._clock() - IDLE_GRACE_S
        free.sort(key=lambda s: s.size, reverse=True)
        for seg in free[kept:]:
            if not in_use or seg.freed_at <= old:
                del self._segments[seg.name]  # FREE: no view holds it; unmapped with our last ref
                self._unmapping(seg)
                unlink(seg.name)

    def stats(self) -> ShmStats:
        """Count the slots in each state and the bytes of all segments."""
        with self._lock:
            self._drain()
            states = collections.Counter(s.state for s in self._segments.values())
            return ShmStats(
                slots=len(self._segments),
                free=states[_State.FREE],
                leased=states[_State.LEASED],
                held=states[_State.HELD],
                bytes_total=sum(s.size for s in self._segments.values()),
                max_bytes=self.max_bytes,
            )

    def free_bytes(self) -> int:
        """Bytes still free in this pool's ``shm_dir``."""
        return free_bytes(self.shm_dir)

    def preflight(self, batch_bytes: int, count: int) -> None:
        """Warn (:class:`RuntimeWarning`) if ``count`` batches of ``batch_bytes`` may not fit.

        The loader calls this once it knows the batch size, with ``count`` = prefetch depth.
        Bytes this pool already holds count as available to it. A RuntimeWarning is shown by
        default (a ResourceWarning would be hidden), and the run may still succeed if batches
        come back inline, so this warns rather than raises.
        """
        for arg, value in (("batch_bytes", batch_bytes), ("count", count)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{arg} must be a non-negative int, got {value!r}")
        want = batch_bytes * count
        have = self.free_bytes() + self.stats().bytes_total
        if want > have:
            warnings.warn(
                f"{count} batches of {batch_bytes} bytes need {want} bytes of shared memory, "
                f"but {self.shm_dir} has {have} bytes available; those that do not fit travel "
                "pickled (slower). Enlarge it (docker run --shm-size=...) or lower prefetch "
                "or batch size.",
                RuntimeWarning,
                stacklevel=2,
            )

    def close(self) -> None:
        """Unlink every segment; idempotent, never raises.

        Views of batches still alive stay readable: their mapping is released when they die.
        After ``close``, :meth:`lease` and :meth:`open` raise and :meth:`release` does nothing.
        A close interrupted (a second Ctrl-C) is finished by the next: a segment leaves the
        pool only once unlinked, and the exit's finalizer stays until none is left.
        """
        with self._lock:
            self._closed = True
            self._returned.clear()
            if os.getpid() != self._owner:
                # A forked copy: the segments belong to the parent; drop our mappings only.
                self._segments.clear()
            while self._segments:
                name, seg = next(iter(self._segments.items()))
                if name == self._unlinking:
                    discard(name)  # cut mid-unlink: tells the tracker only if it was still there
                else:
                    self._unmapping(seg)
                    self._unlinking = name
                    unlink(name)
                del self._segments[name]  # our mapping goes now; a live batch's with its views
                self._unlinking = None
            self._finalizer.detach()
        self.wake_watchers()

    @property
    def closed(self) -> bool:
        return self._closed
