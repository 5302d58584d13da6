"""Shared-memory slots: how a batch collated in a worker reaches the main process uncopied.

This is the only module that touches POSIX shared memory. The main process owns a
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

Sharp edges, and what this module does about them:

- **Resource tracker (Python 3.11).** ``SharedMemory(name)`` registers every segment it
  attaches with the resource tracker, and ``forkserver``/``spawn`` workers share the parent's
  tracker process. The tracker keeps one entry per name (a set, not a count), so a worker that
  unregisters right after attaching deletes the *owner's* entry: the owner's own unregister
  then makes the tracker print a ``KeyError`` traceback, and an owner crash leaks the segment.
  ``SharedMemory.__del__`` also reports a ``BufferError`` when views outlive it. So neither side
  uses ``SharedMemory``: both call ``_posixshmem.shm_open`` and ``mmap`` directly. Only the
  owner registers its segments with the tracker (and unregisters on unlink), so if the owner is
  killed, the tracker unlinks them once the owner's workers are gone (printing a "leaked" warning,
  which is then true). Workers never talk to the tracker.
- **SIGBUS on a full tmpfs.** Pages of a segment are allocated when first touched; on a full
  ``/dev/shm`` (Docker's default is 64 MiB) that touch kills the process with SIGBUS. A new
  segment's pages are reserved up front with ``os.posix_fallocate`` (or, where the file system
  lacks it, by writing zeros), so a full ``/dev/shm`` raises :class:`SharedMemoryError` at
  ``lease`` time, naming the bytes asked and the bytes free. tmpfs pages are charged to the
  memory cgroup of the process that allocates them: a tight container limit can still OOM-kill.
- **BufferError on close.** An ``mmap`` cannot be closed while numpy views export its buffer.
  :meth:`SlotPool.close` unlinks every segment at once; a mapping with live views is left to the
  views, and the kernel frees the memory when the last view dies.
- **Unlinked is not freed.** A segment's memory lives until every mapping of it is gone, in
  every process. Workers cache their mappings; on each new attach they drop mappings of
  segments that no longer exist, and the cache is bounded (:data:`ATTACH_CACHE_MAX`).
- **Names.** ``aiol_<pid>_<8 hex>``: at most 21 characters, under macOS's 31-character limit.
  The pid lets :func:`janitor` find segments of dead processes. Two caveats: a dead owner's pid
  may be reused (its segments then wait for the new process to die too), and processes in
  another PID namespace that share ``/dev/shm`` look dead; segments of other users cannot be
  unlinked (``/dev/shm`` is sticky) and are skipped.
- **File descriptors.** Python's ``mmap`` keeps a duplicate of the segment's descriptor, so each
  mapping holds one open file: one per slot in the main process, one per cached slot in a worker.
- **Timing of returns.** A slot comes back when the last view of its batch is collected; views
  caught in a reference cycle wait for the cycle collector. Returns are queued by the finalizer
  and applied by the next pool call, so finalizers never take a lock (they may run inside a GC
  pass that interrupted a pool method on the same thread).
- **Forked children.** A pool only unlinks segments in the process that created it, so a
  ``fork``-ed child that drops its copy of the pool does not destroy the parent's slots.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import errno
import itertools
import math
import mmap
import os
import secrets
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from multiprocessing import resource_tracker
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from ._errors import SharedMemoryError

if sys.platform != "win32":
    import _posixshmem  # type: ignore[import-not-found]  # CPython's, without stubs

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGN",
    "ATTACH_CACHE_MAX",
    "GROWTH",
    "INLINE_MAX_BYTES",
    "MIN_SLOT_BYTES",
    "SHM_DIR",
    "SHM_PREFIX",
    "ArrayRef",
    "Encoded",
    "ShmStats",
    "Slot",
    "SlotPool",
    "SlotWriter",
    "attach",
    "detach_all",
    "free_bytes",
    "janitor",
    "shm_available",
]

SHM_PREFIX = "aiol_"
SHM_DIR = "/dev/shm"

# Every array starts at a multiple of 64 bytes: one cache line, and enough for any dtype and for
# aligned SIMD loads. Costs at most 63 bytes per array.
ALIGN = 64

# A new segment gets this much headroom over the batch that asked for it, so batches that vary
# a little in size (variable-length samples) reuse the slot instead of re-creating it. Higher
# wastes /dev/shm; lower re-creates segments (slow first writes: page faults) more often.
GROWTH = 1.25

# The smallest segment created. Larger wastes memory on small batches; smaller creates more
# segments while batch sizes are still being learned.
MIN_SLOT_BYTES = 1 << 20

# Batches whose arrays total fewer bytes come back pickled: a pickle round trip of 64 KiB costs
# about as much as a lease, a mapping and a finalizer.
INLINE_MAX_BYTES = 64 << 10

# Mappings a worker keeps. Each holds a file descriptor and pins its segment's memory even after
# the owner unlinks it; the pool normally has about prefetch-depth slots, well under this.
ATTACH_CACHE_MAX = 32

# Mappings are populated up front (page tables filled in one call): about 3x cheaper than
# faulting the pages in one by one on first write, and paid once per slot per process.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_RESERVE_CHUNK = 1 << 20  # zeros written per call when posix_fallocate is unavailable
_NAME_ATTEMPTS = 8  # name collisions are ~2**-32 each; retry a few times, then give up
_NO_ROOM = {errno.ENOSPC, errno.EFBIG, errno.ENOMEM}
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, errno.ENODEV}


def shm_available() -> bool:
    """Whether POSIX shared memory under ``/dev/shm`` is usable; if not, send batches inline."""
    return sys.platform != "win32" and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def free_bytes(shm_dir: str = SHM_DIR) -> int:
    """Bytes still free in ``shm_dir`` (the tmpfs that backs shared memory)."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def _new_name() -> str:
    return f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"


def _page_round(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _note_fd_limit(exc: OSError) -> None:
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        exc.add_note("too many open files: each shared-memory slot holds one; raise `ulimit -n`")


@dataclass(frozen=True, slots=True)
class Slot:
    """A leased segment, sent to the worker that fills it.

    Attributes:
        name: the segment's name (without the leading slash).
        size: the segment's size in bytes; the worker may use all of it.
        lease_id: which lease this is. The pool ignores a release or open that names an older
            lease of the same segment, so a stale release can never free a slot that a later
            batch is using. 0 means "not a lease" (enough for :func:`attach`).
    """

    name: str
    size: int
    lease_id: int = 0


@dataclass(frozen=True, slots=True)
class ArrayRef:
    """Where one array of a batch lies in its slot (a leaf of :attr:`Encoded.tree`).

    Attributes:
        offset: byte offset from the start of the segment.
        dtype: numpy dtype string of the bytes (``'<f4'``).
        shape: the array's shape.
        kind: ``'numpy'`` or ``'torch'``: what :meth:`SlotPool.open` gives back.
        torch_dtype: for torch dtypes numpy lacks (``'bfloat16'``, float8, ...), the bytes are
            stored as a same-width integer ``dtype`` and reinterpreted as this torch dtype.
    """

    offset: int
    dtype: str
    shape: tuple[int, ...]
    kind: Literal["numpy", "torch"]
    torch_dtype: str | None = None


@dataclass(frozen=True, slots=True)
class Encoded:
    """What a worker sends back for one batch.

    Attributes:
        tree: if ``inline`` is false, the batch's nesting with every array replaced by an
            :class:`ArrayRef` (pass it to :meth:`SlotPool.open`); if true, the batch itself.
        used_bytes: bytes of the slot the batch occupies (0 when inline).
        needed_bytes: bytes a slot needs to hold this batch (also set when it did not fit).
        inline: the batch travels pickled; the caller releases the slot.
    """

    tree: Any
    used_bytes: int
    needed_bytes: int
    inline: bool


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
    mapping: mmap.mmap
    state: _State = _State.FREE
    lease_id: int = 0


def _unlink(name: str) -> None:
    """Unlink an owned segment and tell the tracker; never raises."""
    with contextlib.suppress(OSError):  # already gone (a janitor, or unlinked by hand)
        _posixshmem.shm_unlink("/" + name)
    with contextlib.suppress(Exception):  # the tracker died: nothing left to tell it
        resource_tracker.unregister("/" + name, "shared_memory")


def _mapping_address(mapping: mmap.mmap) -> int:
    view = np.frombuffer(mapping, dtype=np.uint8, count=1)  # released again right away
    return int(view.__array_interface__["data"][0])


def _drop_mapping(mapping: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # views alive: the mapping goes with the last one
        mapping.close()


def _destroy(segments: dict[str, _Segment]) -> None:
    for seg in segments.values():
        _unlink(seg.name)
        _drop_mapping(seg.mapping)
    segments.clear()


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
        # Invariant: every segment is FREE, LEASED to a worker, or HELD by a live batch, and the
        # sizes of all segments sum to at most max_bytes.
        self._segments: dict[str, _Segment] = {}
        self._lock = threading.Lock()
        self._lease_ids = itertools.count(1)
        # (name, lease_id) of held batches whose views died; appended by finalizers (any thread,
        # any time, lock-free: deque.append is atomic), applied under the lock by _drain().
        self._returned: collections.deque[tuple[str, int]] = collections.deque()
        self._closed = False
        self._owner = os.getpid()
        self._finalizer = weakref.finalize(self, _finalize_pool, self._segments, self._owner)
        _janitor_once(shm_dir)

    def __repr__(self) -> str:
        s = self.stats()
        state = "closed" if self._closed else "open"
        return (
            f"<SlotPool {state} slots={s.slots} free={s.free} leased={s.leased} "
            f"held={s.held} bytes={s.bytes_total}/{s.max_bytes}>"
        )

    def lease(self, nbytes: int) -> Slot | None:
        """Lease a slot of at least ``nbytes`` for one batch.

        Prefers the smallest free slot that fits; otherwise creates a segment with headroom
        (:data:`GROWTH`), first unlinking free slots that are too small if the cap requires.
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
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"nbytes must be a non-negative int, got {nbytes!r}")
        with self._lock:
            if self._closed:
                raise RuntimeError("SlotPool is closed")
            self._drain()
            best = min(
                (s for s in self._segments.values() if s.state is _State.FREE and s.size >= nbytes),
                key=lambda s: s.size,
                default=None,
            )
            if best is None:
                best = self._make_room_and_create(nbytes)
                if best is None:
                    return None
            best.state = _State.LEASED
            best.lease_id = next(self._lease_ids)
            return Slot(best.name, best.size, best.lease_id)

    def _make_room_and_create(self, nbytes: int) -> _Segment | None:
        # Called with the lock held, when no free slot is big enough.
        free = sorted(
            (s for s in self._segments.values() if s.state is _State.FREE), key=lambda s: s.size
        )
        busy = sum(s.size for s in self._segments.values()) - sum(s.size for s in free)
        exact = _page_round(max(nbytes, self.min_slot_bytes))
        roomy = _page_round(max(math.ceil(nbytes * GROWTH), self.min_slot_bytes))
        size = next((n for n in (roomy, exact) if busy + n <= self.max_bytes), None)
        if size is None:
            return None
        total = busy + sum(s.size for s in free)
        for seg in free:  # all too small for this batch; drop the smallest first
            if total + size <= self.max_bytes:
                break
            del self._segments[seg.name]
            self._unmapping(seg)
            _unlink(seg.name)
            _drop_mapping(seg.mapping)
            total -= seg.size
        seg = self._create(size)
        self._segments[seg.name] = seg
        if self._on_map is not None:
            with contextlib.suppress(Exception):
                self._on_map(_mapping_address(seg.mapping), seg.size)
        return seg

    def _unmapping(self, seg: _Segment) -> None:
        if self._on_unmap is not None:
            with contextlib.suppress(Exception):
                self._on_unmap(_mapping_address(seg.mapping))

    def _create(self, size: int) -> _Segment:
        for _ in range(_NAME_ATTEMPTS):
            name = _new_name()
            try:
                fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            except OSError as exc:
                _note_fd_limit(exc)
                raise
            break
        else:  # pragma: no cover - needs _NAME_ATTEMPTS collisions of 32 random bits
            raise FileExistsError(f"no free shared-memory name after {_NAME_ATTEMPTS} attempts")
        # Registered before anything can fail, so a crash from here on is still cleaned up.
        resource_tracker.register("/" + name, "shared_memory")
        try:
            os.ftruncate(fd, size)
            self._reserve(fd, size)
            mapping = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        except BaseException:
            _unlink(name)
            raise
        finally:
            os.close(fd)
        return _Segment(name, size, mapping)

    def _reserve(self, fd: int, size: int) -> None:
        """Allocate every page of the segment now, so a full tmpfs fails here, not with SIGBUS."""
        try:
            fallocate = getattr(os, "posix_fallocate", None)
            try:
                if fallocate is None:
                    raise OSError(errno.EOPNOTSUPP, "posix_fallocate is not available")
                fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in _NO_FALLOCATE:
                    raise
                zeros = memoryview(bytes(min(size, _RESERVE_CHUNK)))
                offset = 0
                while offset < size:  # pwrite may write less than asked
                    offset += os.pwrite(fd, zeros[: size - offset], offset)
        except OSError as exc:
            if exc.errno not in _NO_ROOM:
                raise
            free = free_bytes(self.shm_dir)
            raise SharedMemoryError(
                f"cannot reserve {size} bytes of shared memory for a batch slot: {self.shm_dir} "
                f"has {free} bytes free ({errno.errorcode.get(exc.errno or 0, exc.errno)}). "
                "Give it more room (docker run --shm-size=..., or a memory-backed emptyDir on "
                "Kubernetes) or lower prefetch / batch size."
            ) from exc

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
            if seg is not None and seg.state is _State.LEASED and seg.lease_id == slot.lease_id:
                seg.state = _State.FREE
                seg.lease_id = 0

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
        refs = [leaf for leaf in _iter_leaves(tree) if isinstance(leaf, ArrayRef)]
        with self._lock:
            if self._closed:
                raise RuntimeError("SlotPool is closed")
            self._drain()
            seg = self._segments.get(slot.name)
            if seg is None or seg.state is not _State.LEASED or seg.lease_id != slot.lease_id:
                state = "unknown" if seg is None else f"{seg.state.value}, lease {seg.lease_id}"
                raise ValueError(f"slot={slot!r} is not leased under this lease id ({state})")
            used = max((_ref_end(ref, seg.size) for ref in refs), default=0)
            if not refs:  # nothing points into the slot: it is free again at once
                seg.state, seg.lease_id = _State.FREE, 0
                return tree
            root = np.frombuffer(seg.mapping, dtype=np.uint8, count=used)
            torch_mod = _import_torch() if any(r.kind == "torch" for r in refs) else None
            batch = _map_tree(tree, lambda leaf: _view(root, leaf, torch_mod))
            seg.state = _State.HELD
            fin = weakref.finalize(root, self._returned.append, (seg.name, seg.lease_id))
            fin.atexit = False
            return batch

    def _drain(self) -> None:
        # Lock held. Apply the returns that finalizers queued.
        while self._returned:
            name, lease_id = self._returned.popleft()
            seg = self._segments.get(name)
            if seg is not None and seg.state is _State.HELD and seg.lease_id == lease_id:
                seg.state, seg.lease_id = _State.FREE, 0

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
                f"but {self.shm_dir} has {have} bytes available; batches may fail with "
                "SharedMemoryError. Enlarge it (docker run --shm-size=...) or lower prefetch "
                "or batch size.",
                RuntimeWarning,
                stacklevel=2,
            )

    def close(self) -> None:
        """Unlink every segment; idempotent, never raises.

        Views of batches still alive stay readable: their mapping is released when they die.
        After ``close``, :meth:`lease` and :meth:`open` raise and :meth:`release` does nothing.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._finalizer.detach()
            self._returned.clear()
            if os.getpid() == self._owner:
                for seg in self._segments.values():
                    self._unmapping(seg)
                _destroy(self._segments)
            else:  # a forked copy: the segments belong to the parent
                for seg in self._segments.values():
                    _drop_mapping(seg.mapping)
                self._segments.clear()

    @property
    def closed(self) -> bool:
        return self._closed


def _ref_end(ref: ArrayRef, size: int) -> int:
    dt = np.dtype(ref.dtype)
    end = ref.offset + math.prod(ref.shape) * dt.itemsize
    if ref.offset < 0 or end > size or any(d < 0 for d in ref.shape):
        raise ValueError(f"descriptor {ref!r} lies outside the slot of {size} bytes")
    return end


def _view(root: npt.NDArray[np.uint8], leaf: Any, torch_mod: Any) -> Any:
    if not isinstance(leaf, ArrayRef):
        return leaf
    dt = np.dtype(leaf.dtype)
    end = leaf.offset + math.prod(leaf.shape) * dt.itemsize
    # Views of views collapse to the first array that does not own its data: root. So every
    # leaf, and anything derived from it, keeps root (and with it the slot) alive.
    arr = root[leaf.offset : end].view(dt).reshape(leaf.shape)
    if leaf.kind == "numpy":
        return arr
    tensor = torch_mod.from_numpy(arr)
    if leaf.torch_dtype is not None:
        tensor = tensor.view(getattr(torch_mod, leaf.torch_dtype))
    return tensor


def _import_torch() -> Any:
    import torch

    return torch


# ---------------------------------------------------------------------------------------------
# Worker side


# name -> (mapping, whole-segment uint8 view); most recently used last.
_attached: collections.OrderedDict[str, tuple[mmap.mmap, npt.NDArray[np.uint8]]] = (
    collections.OrderedDict()
)
_attach_lock = threading.Lock()


def attach(slot: Slot) -> npt.NDArray[np.uint8]:
    """Map a slot in a worker, without the resource tracker; cached per process by name.

    Args:
        slot: the slot sent with the job.

    Returns:
        A writable ``uint8`` array over the whole segment.

    Raises:
        FileNotFoundError: if the owner has unlinked the segment (pool closed).
        ValueError: if the segment's size differs from ``slot.size``.
    """
    with _attach_lock:
        hit = _attached.get(slot.name)
        if hit is not None and hit[1].size == slot.size:
            _attached.move_to_end(slot.name)
            return hit[1]
        if hit is not None:
            _detach(slot.name)
        # A new name: the pool may have unlinked slots we still map, pinning their memory.
        for name in [n for n in _attached if not _exists(n)]:
            _detach(name)
        try:
            fd = _posixshmem.shm_open("/" + slot.name, os.O_RDWR, 0)
        except OSError as exc:
            _note_fd_limit(exc)
            raise
        try:
            size = os.fstat(fd).st_size
            if size != slot.size:
                raise ValueError(f"segment {slot.name} has {size} bytes, slot.size={slot.size}")
            mapping = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        finally:
            os.close(fd)
        buf = np.frombuffer(mapping, dtype=np.uint8)
        _attached[slot.name] = (mapping, buf)
        while len(_attached) > ATTACH_CACHE_MAX:
            _detach(next(iter(_attached)))
        return buf


def _exists(name: str) -> bool:
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell (e.g. out of fds): keep it
    os.close(fd)
    return True


def _detach(name: str) -> None:
    mapping, buf = _attached.pop(name)
    del buf  # our export; the mapping closes now unless a batch still holds a view
    _drop_mapping(mapping)


def detach_all() -> None:
    """Drop every cached mapping (worker shutdown)."""
    with _attach_lock:
        for name in list(_attached):
            _detach(name)


class SlotWriter:
    """A bump allocator over one attached slot, for one batch; not thread-safe.

    ``alloc`` hands out aligned views for a collate function to write into; ``encode`` turns
    the finished batch into an :class:`Encoded`, copying in any array that is not in the slot.

    Args:
        buf: the slot, as returned by :func:`attach`.
    """

    def __init__(self, buf: npt.NDArray[np.uint8]) -> None:
        if not (
            isinstance(buf, np.ndarray)
            and buf.dtype == np.uint8
            and buf.ndim == 1
            and buf.flags.c_contiguous
            and buf.flags.writeable
        ):
            raise ValueError(f"buf must be a writable 1-D contiguous uint8 array, got {buf!r:.80}")
        self._buf = buf
        self._size = int(buf.size)
        self._base = _address(buf)
        self._offset = 0  # bump pointer; may pass _size once an alloc has overflowed
        self._spilled: list[npt.NDArray[Any]] = []  # allocs that did not fit (plain memory)
        self._encoded = False

    @property
    def needed_bytes(self) -> int:
        """Bytes the allocations so far need in a slot."""
        return self._offset

    @property
    def overflowed(self) -> bool:
        """Whether an allocation did not fit and was given plain memory instead."""
        return self._offset > self._size

    def alloc(self, shape: int | tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        """A writable C-contiguous array in the slot, or plain memory if it does not fit.

        Raises:
            ValueError: for a negative dimension or a dtype that cannot live in shared memory
                (object, structured, zero-width).
        """
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        dt = np.dtype(dtype)
        if any(d < 0 for d in shape):
            raise ValueError(f"shape={shape} has a negative dimension")
        if not _storable_dtype(dt):
            raise ValueError(f"dtype={dt} cannot be placed in shared memory")
        nbytes = math.prod(shape) * dt.itemsize
        start = _align(self._offset)
        self._offset = start + nbytes
        if nbytes and self._offset <= self._size:
            return self._buf[start : self._offset].view(dt).reshape(shape)
        arr = np.empty(shape, dt)
        if nbytes:
            self._spilled.append(arr)
        return arr

    def encode(self, batch: Any, *, inline_below: int = INLINE_MAX_BYTES) -> Encoded:
        """Describe ``batch`` by offsets into the slot, copying in arrays that are elsewhere.

        Walks dicts (and other mappings), lists, tuples and namedtuples. numpy arrays and CPU
        torch tensors become :class:`ArrayRef` leaves: arrays already in the slot (from
        :meth:`alloc`) without a copy, others (non-contiguous ones too) copied once. Other leaves
        (numbers, strings, None, object arrays, sparse or CUDA tensors) stay as they are and are
        pickled. Tensors lose ``requires_grad``; torch dtypes numpy lacks (bfloat16) travel as raw
        bytes and come back as the same dtype.

        Args:
            batch: the collated batch.
            inline_below: batches with fewer array bytes than this are returned inline.

        Returns:
            The encoded batch; ``inline`` if it was tiny or did not fit the slot, in which case
            arrays in the slot have been copied out, and ``needed_bytes`` says what would fit.

        Raises:
            RuntimeError: if called twice (one writer per batch).
        """
        if self._encoded:
            raise RuntimeError("SlotWriter.encode() was already called; use one writer per batch")
        self._encoded = True
        spilled = {_address(a) for a in self._spilled}
        end = min(self._offset, self._size)  # leaves inside [0, end) were handed out by alloc
        refs: dict[int, ArrayRef] = {}  # id(leaf) -> its descriptor
        copies: list[tuple[npt.NDArray[Any], ArrayRef]] = []
        touching: set[int] = set()  # ids of leaves whose memory is in the slot
        cursor, array_bytes = self._offset, 0
        for leaf in _iter_leaves(batch):
            if id(leaf) in refs:
                continue
            found = _as_numpy(leaf)
            if found is None:
                continue
            arr, kind, torch_dtype = found
            array_bytes += arr.nbytes
            address = _address(arr)
            start = address - self._base
            if arr.nbytes and 0 <= start < self._size:
                touching.add(id(leaf))
            offset, copy_in = 0, False
            if arr.nbytes == 0:
                pass  # no bytes: any offset will do
            elif (
                id(leaf) in touching
                and arr.flags.c_contiguous
                and start + arr.nbytes <= end
                and start % arr.dtype.alignment == 0
            ):
                offset = start  # made by alloc (or a contiguous view of it): no copy
            elif address in spilled:
                pass  # counted in self._offset already; the batch goes inline
            else:
                offset, copy_in = _align(cursor), True
                cursor = offset + arr.nbytes
            ref = ArrayRef(offset, arr.dtype.str, tuple(arr.shape), kind, torch_dtype)
            refs[id(leaf)] = ref
            if copy_in:
                copies.append((arr, ref))
        needed = cursor
        if array_bytes < inline_below or needed > self._size or not refs:
            tree = batch
            if touching:  # nothing returned may point into a slot that is about to be reused
                tree = _map_tree(batch, lambda x: _copy_out(x) if id(x) in touching else x)
            return Encoded(tree, 0, needed, True)
        for arr, ref in copies:
            dst = self._buf[ref.offset : ref.offset + arr.nbytes].view(arr.dtype)
            np.copyto(dst.reshape(arr.shape), arr)
        tree = _map_tree(batch, lambda x: refs.get(id(x), x))
        return Encoded(tree, needed, needed, False)


def _address(arr: npt.NDArray[Any]) -> int:
    return int(arr.__array_interface__["data"][0])


def _copy_out(x: Any) -> Any:
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def _storable_dtype(dt: np.dtype[Any]) -> bool:
    return not dt.hasobject and dt.fields is None and dt.subdtype is None and dt.itemsize > 0


_RAW_INT = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _as_numpy(
    x: Any,
) -> tuple[npt.NDArray[Any], Literal["numpy", "torch"], str | None] | None:
    """The bytes of an array leaf as numpy (sharing memory), its kind, and a raw torch dtype."""
    if type(x) is np.ndarray or isinstance(x, np.memmap):
        return (x, "numpy", None) if _storable_dtype(x.dtype) else None
    torch_mod = sys.modules.get("torch")  # no torch imported: no tensor can be a leaf
    if torch_mod is None or not isinstance(x, torch_mod.Tensor):
        return None
    t: torch.Tensor = x
    if t.layout != torch_mod.strided or t.device.type != "cpu" or t.is_quantized or t.is_nested:
        return None
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    try:
        return t.numpy(), "torch", None
    except TypeError:  # no numpy dtype (bfloat16, float8, complex32): ship the raw bits
        raw = _RAW_INT.get(t.element_size())
        if raw is None:
            return None
        return t.view(getattr(torch_mod, raw)).numpy(), "torch", str(t.dtype).split(".")[-1]


# ---------------------------------------------------------------------------------------------
# Batch trees: the containers that encode/open walk; anything else is a leaf.


def _iter_leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, Mapping):
        for value in obj.values():
            yield from _iter_leaves(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _iter_leaves(value)
    else:
        yield obj


def _map_tree(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Rebuild ``obj`` with ``fn`` applied to every leaf, keeping container types."""
    if isinstance(obj, Mapping):
        items = {key: _map_tree(value, fn) for key, value in obj.items()}
        if isinstance(obj, dict):
            clone = copy.copy(obj)  # keeps dict subclasses (defaultdict, OrderedDict) intact
            clone.update(items)
            return clone
        factory: Any = type(obj)
        try:
            return factory(items)
        except TypeError:
            return items
    if isinstance(obj, (list, tuple)):
        values = [_map_tree(value, fn) for value in obj]
        if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):  # namedtuple
            return type(obj)(*values)
        try:
            return type(obj)(values)
        except TypeError:
            return tuple(values) if isinstance(obj, tuple) else values
    return fn(obj)


# ---------------------------------------------------------------------------------------------
# Janitor: segments of processes that died without closing their pool.

_janitor_pid: int | None = None


def _janitor_once(shm_dir: str) -> None:
    global _janitor_pid
    if _janitor_pid != os.getpid():
        _janitor_pid = os.getpid()
        janitor(shm_dir)


def janitor(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink ``aiol_<pid>_*`` segments whose process is gone; return the names removed.

    Segments of live processes, of other users, and names that do not parse are left alone.
    """
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        if not name.startswith(SHM_PREFIX):
            continue
        pid_text = name[len(SHM_PREFIX) :].split("_", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or int(pid_text) <= 0:
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue  # alive, another user's; or not a pid at all
        try:
            os.unlink(os.path.join(shm_dir, name))
        except OSError:
            continue  # gone already, or another user's
        removed.append(name)
    return removed
