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

This module is the segment side: creating, mapping, leasing, attaching and unlinking segments.
How a batch is laid out in a slot and read back (:class:`SlotWriter`, :class:`Encoded`,
:class:`ArrayRef`, the tree walks) lives in :mod:`aioloader._shm_tree`, which only works on
buffers mapped here; this module re-exports those names, so callers import everything from
``_shm``.

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
- **A mapping lives as long as its last view.** A segment is mapped into a plain buffer object
  (:func:`_map`) that every numpy view of it keeps alive; a finalizer unmaps it when the last
  reference goes, so nothing can unmap memory that a view still reads (Python's ``mmap.close``
  would refuse with ``BufferError`` instead). :meth:`SlotPool.close` unlinks every segment at
  once and drops its own references; a batch still alive keeps its mapping until it dies.
- **Unlinked is not freed.** A segment's memory lives until every mapping of it is gone, in
  every process. Workers cache their mappings; on each new attach they drop mappings of
  segments that no longer exist, and the cache is bounded (:data:`ATTACH_CACHE_MAX`).
- **Names.** ``aiol_<pid>_<8 hex>``: at most 21 characters, under macOS's 31-character limit.
  The pid lets :func:`janitor` find segments of dead processes. Two caveats: a dead owner's pid
  may be reused (its segments then wait for the new process to die too), and processes in
  another PID namespace that share ``/dev/shm`` look dead; segments of other users cannot be
  unlinked (``/dev/shm`` is sticky) and are skipped.
- **File descriptors.** A mapping needs no open file: the descriptor from ``shm_open`` is
  closed as soon as the segment is mapped, so a live batch, a slot of the pool and a worker's
  cached attachment hold none, and ``list(loader)`` may keep thousands of batches under
  ``ulimit -n 1024``. Python's ``mmap.mmap`` would keep a duplicate of the descriptor for the
  mapping's life (until 3.13's ``trackfd=False``), which is why :func:`_map` calls libc through
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

import collections
import contextlib
import ctypes
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
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from multiprocessing import resource_tracker
from typing import Any

import numpy as np
import numpy.typing as npt

from ._errors import SharedMemoryError
from ._shm_tree import (
    ALIGN,
    INLINE_MAX_BYTES,
    ArrayRef,
    Encoded,
    SlotWriter,
    import_torch,
    ref_end,
    view_leaf,
)
from ._tree import iter_leaves, map_tree

if sys.platform != "win32":
    import _posixshmem  # type: ignore[import-not-found]  # CPython's, without stubs
    import resource

__all__ = [
    "ALIGN",
    "ATTACH_CACHE_MAX",
    "ArrayRef",
    "Encoded",
    "GROWTH",
    "INLINE_MAX_BYTES",
    "MIN_SLOT_BYTES",
    "SHM_DIR",
    "SHM_PREFIX",
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

# A new segment gets this much headroom over the batch that asked for it, so batches that vary
# a little in size (variable-length samples) reuse the slot instead of re-creating it. Higher
# wastes /dev/shm; lower re-creates segments (slow first writes: page faults) more often.
GROWTH = 1.25

# The smallest segment created. Larger wastes memory on small batches; smaller creates more
# segments while batch sizes are still being learned.
MIN_SLOT_BYTES = 1 << 20

# Mappings a worker keeps. Each pins its segment's memory even after the owner unlinks it (but
# holds no descriptor); the pool normally has about prefetch-depth slots, well under this.
ATTACH_CACHE_MAX = 32

# Mappings are populated up front (page tables filled in one call): about 3x cheaper than
# faulting the pages in one by one on first write, and paid once per slot per process.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_PROT = mmap.PROT_READ | mmap.PROT_WRITE
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


def _out_of_fds(exc: OSError, what: str, size: int) -> SharedMemoryError | None:
    """What to raise instead of ``exc`` (from opening a segment) if descriptors ran out."""
    if exc.errno == errno.EMFILE:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return SharedMemoryError(
            f"cannot {what} a shared-memory segment of {size} bytes for a batch slot: this "
            f"process has no file descriptor left (the limit is {soft}). Batches and slots hold "
            "none, so other open files use them up; raise the limit (`ulimit -n 4096` in the "
            "shell, or resource.setrlimit(RLIMIT_NOFILE) before creating the loader)."
        )
    if exc.errno == errno.ENFILE:
        return SharedMemoryError(
            f"cannot {what} a shared-memory segment of {size} bytes for a batch slot: the "
            "system's table of open files is full (fs.file-max); `ulimit -n` does not help."
        )
    return None


# libc's mmap and munmap, through ctypes: unlike mmap.mmap, the mapping keeps no descriptor.
if sys.platform != "win32":
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,  # off_t: as wide as long on LP64 Linux and macOS; the offset is always 0
    )
    _libc.munmap.restype = ctypes.c_int
    _libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value

# A mapped segment: a ctypes byte array at the mapping's address, which numpy views can share.
_Mapping = ctypes.Array[ctypes.c_ubyte]


def _map(fd: int, size: int) -> _Mapping:
    """Map ``size`` bytes of ``fd`` shared and writable; the caller may close ``fd`` at once.

    The mapping lives as long as the returned buffer: every numpy array made from it keeps it
    alive (views of views collapse to the first array over it), and a finalizer unmaps it when
    the last reference is gone. Not at exit (``atexit = False``): the process's end unmaps
    everything anyway, and a view in a module global may still be read by other exit code.

    Raises:
        OSError: if the kernel refuses the mapping (e.g. ENOMEM).
    """
    address = _libc.mmap(None, size, _PROT, _MAP_FLAGS, fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    try:
        buf = (ctypes.c_ubyte * size).from_address(address)
        weakref.finalize(buf, _libc.munmap, address, size).atexit = False
    except BaseException:
        _libc.munmap(address, size)
        raise
    return buf


def _bytes(mapping: _Mapping, count: int) -> npt.NDArray[np.uint8]:
    """The first ``count`` bytes of a mapping as a ``uint8`` array that keeps it mapped."""
    return np.frombuffer(memoryview(mapping), dtype=np.uint8, count=count)


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
    mapping: _Mapping
    state: _State = _State.FREE
    lease_id: int = 0


def _unlink(name: str) -> None:
    """Unlink an owned segment and tell the tracker; never raises."""
    with contextlib.suppress(OSError):  # already gone (a janitor, or unlinked by hand)
        _posixshmem.shm_unlink("/" + name)
    with contextlib.suppress(Exception):  # the tracker died: nothing left to tell it
        resource_tracker.unregister("/" + name, "shared_memory")


def _destroy(segments: dict[str, _Segment]) -> None:
    for seg in segments.values():
        _unlink(seg.name)
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

    def reuse(self, nbytes: int) -> Slot | None:
        """Lease a free slot of at least ``nbytes`` if there is one; never creates a segment.

        Cheap (no system call), so the event loop may call it; when it returns None, call
        :meth:`lease` from a thread, since creating a segment takes a while.
        """
        return self._lease(nbytes, create=False)

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
        return self._lease(nbytes, create=True)

    def _lease(self, nbytes: int, *, create: bool) -> Slot | None:
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
                best = self._make_room_and_create(nbytes) if create else None
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
            del self._segments[seg.name]  # FREE: no view holds it; unmapped with our last ref
            self._unmapping(seg)
            _unlink(seg.name)
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
        for _ in range(_NAME_ATTEMPTS):
            name = _new_name()
            try:
                fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            except OSError as exc:
                if (error := _out_of_fds(exc, "create", size)) is None:
                    raise
                raise error from exc
            break
        else:  # pragma: no cover - needs _NAME_ATTEMPTS collisions of 32 random bits
            raise FileExistsError(f"no free shared-memory name after {_NAME_ATTEMPTS} attempts")
        # Registered before anything can fail, so a crash from here on is still cleaned up.
        resource_tracker.register("/" + name, "shared_memory")
        try:
            os.ftruncate(fd, size)
            self._reserve(fd, size)
            mapping = _map(fd, size)
        except BaseException:
            _unlink(name)
            raise
        finally:
            os.close(fd)  # the mapping needs no descriptor
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
        refs = [leaf for leaf in iter_leaves(tree) if isinstance(leaf, ArrayRef)]
        with self._lock:
            if self._closed:
                raise RuntimeError("SlotPool is closed")
            self._drain()
            seg = self._segments.get(slot.name)
            if seg is None or seg.state is not _State.LEASED or seg.lease_id != slot.lease_id:
                state = "unknown" if seg is None else f"{seg.state.value}, lease {seg.lease_id}"
                raise ValueError(f"slot={slot!r} is not leased under this lease id ({state})")
            used = max((ref_end(ref, seg.size) for ref in refs), default=0)
            if not refs:  # nothing points into the slot: it is free again at once
                seg.state, seg.lease_id = _State.FREE, 0
                return tree
            root = _bytes(seg.mapping, used)
            torch_mod = import_torch() if any(r.kind == "torch" for r in refs) else None
            batch = map_tree(tree, lambda leaf: view_leaf(root, leaf, torch_mod))
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
            else:  # a forked copy: the segments belong to the parent; drop our mappings only
                self._segments.clear()

    @property
    def closed(self) -> bool:
        return self._closed


# ---------------------------------------------------------------------------------------------
# Worker side


# name -> whole-segment uint8 view (which keeps the mapping alive); most recently used last.
# Invariant: holds no descriptor; a dropped entry is unmapped once no batch views it.
_attached: collections.OrderedDict[str, npt.NDArray[np.uint8]] = collections.OrderedDict()
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
        SharedMemoryError: if this process has no file descriptor left to open the segment.
    """
    with _attach_lock:
        hit = _attached.get(slot.name)
        if hit is not None and hit.size == slot.size:
            _attached.move_to_end(slot.name)
            return hit
        if hit is not None:
            del _attached[slot.name]
        # A new name: the pool may have unlinked slots we still map, pinning their memory.
        for name in [n for n in _attached if not _exists(n)]:
            del _attached[name]
        try:
            fd = _posixshmem.shm_open("/" + slot.name, os.O_RDWR, 0)
        except OSError as exc:
            if (error := _out_of_fds(exc, "attach", slot.size)) is None:
                raise
            raise error from exc
        try:
            size = os.fstat(fd).st_size
            if size != slot.size:
                raise ValueError(f"segment {slot.name} has {size} bytes, slot.size={slot.size}")
            buf = _bytes(_map(fd, size), size)
        finally:
            os.close(fd)  # the mapping needs no descriptor
        _attached[slot.name] = buf
        while len(_attached) > ATTACH_CACHE_MAX:
            _attached.popitem(last=False)
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


def detach_all() -> None:
    """Drop every cached mapping (worker shutdown); each is unmapped once no batch views it."""
    with _attach_lock:
        _attached.clear()


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
