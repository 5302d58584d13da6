"""Segments: naming, creating, mapping, attaching and unlinking one POSIX shared-memory segment.

Every system call on a segment is made here; :mod:`._pool` and :mod:`._attach` only keep state
over what this module returns. A segment is named ``aiol_<pid>_<8 hex>``, created with its pages
reserved, mapped through libc (the mapping keeps no descriptor and lives as long as its last
view), and unlinked by its owner; :func:`janitor` unlinks those of processes that died. The
package docstring tells the sharp edges behind each of these choices.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import secrets
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker

import numpy as np
import numpy.typing as npt

from .._errors import SharedMemoryError

if sys.platform != "win32":
    import _posixshmem  # type: ignore[import-not-found]  # CPython's, without stubs
    import fcntl
    import resource

__all__ = [
    "SHM_DIR",
    "SHM_PREFIX",
    "TURN_POLL_S",
    "TURN_WAIT_S",
    "SegmentMapping",
    "Slot",
    "as_bytes",
    "create_segment",
    "discard",
    "drop_pages",
    "free_bytes",
    "janitor",
    "janitor_once",
    "map_existing",
    "map_private",
    "map_shared",
    "new_name",
    "page_round",
    "segment_exists",
    "shm_available",
    "shrink",
    "turn",
    "unlink",
    "vanished_message",
]

SHM_PREFIX = "aiol_"
SHM_DIR = "/dev/shm"

# Mappings are populated up front (page tables filled in one call): about 3x cheaper than
# faulting the pages in one by one on first write, and paid once per slot per process.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_PROT = mmap.PROT_READ | mmap.PROT_WRITE
_RESERVE_CHUNK = 1 << 20  # zeros written per call when posix_fallocate is unavailable
_NAME_ATTEMPTS = 8  # name collisions are ~2**-32 each; retry a few times, then give up
_NO_ROOM = {errno.ENOSPC, errno.EFBIG, errno.ENOMEM}
_NO_FALLOCATE = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, errno.ENODEV}


@dataclass(frozen=True, slots=True)
class Slot:
    """A leased segment, sent to the worker that fills it.

    Attributes:
        name: the segment's name (without the leading slash).
        size: the segment's size in bytes; the worker may use all of it.
        lease_id: which lease this is. The pool ignores a release or open that names an older
            lease of the same segment, so a stale release can never free a slot that a later
            batch is using. 0 means "not a lease" (enough for ``attach``).
    """

    name: str
    size: int
    lease_id: int = 0


def shm_available() -> bool:
    """Whether POSIX shared memory under ``/dev/shm`` is usable; if not, send batches inline."""
    return sys.platform != "win32" and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def free_bytes(shm_dir: str = SHM_DIR) -> int:
    """Bytes still free in ``shm_dir`` (the tmpfs that backs shared memory)."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def page_round(n: int) -> int:
    """``n`` rounded up to a whole number of pages: the size a segment of ``n`` bytes gets."""
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def new_name() -> str:
    """A fresh segment name of this process (its pid in it, for the janitor and the tests)."""
    return f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"


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


# -- mapping ----------------------------------------------------------------------------------

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
    _libc.madvise.restype = ctypes.c_int
    _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MAP_FAILED = ctypes.c_void_p(-1).value

# A mapped segment: a ctypes byte array at the mapping's address, which numpy views can share.
SegmentMapping = ctypes.Array[ctypes.c_ubyte]


def _map(fd: int, size: int, flags: int = _MAP_FLAGS) -> SegmentMapping:
    """Map ``size`` bytes of ``fd`` shared and writable; the caller may close ``fd`` at once.

    The mapping lives as long as the returned buffer: every numpy array made from it keeps it
    alive (views of views collapse to the first array over it), and a finalizer unmaps it when
    the last reference is gone. Not at exit (``atexit = False``): the process's end unmaps
    everything anyway, and a view in a module global may still be read by other exit code.

    Raises:
        OSError: if the kernel refuses the mapping (e.g. ENOMEM).
    """
    address = _libc.mmap(None, size, _PROT, flags, fd, 0)
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


def drop_pages(view: npt.NDArray[np.uint8], start: int) -> None:
    """Give back this process's pages of a private mapping (:func:`map_private`) from byte
    ``start`` (rounded up to a page) to the end of ``view``, the mapping's bytes from its
    first: they leave its resident memory (a later read maps them in again, as the owner
    wrote them). For the part of a mapping that was read once while the rest stays in use (a
    dataset copy's stream beside the buffers its arrays live on). Best effort: no-op where
    ``madvise`` is missing or refuses."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    first = page_round(start)
    if advice is None or sys.platform == "win32" or first >= view.nbytes:
        return
    address = view.__array_interface__["data"][0]
    _libc.madvise(address + first, view.nbytes - first, advice)


def as_bytes(mapping: SegmentMapping, count: int) -> npt.NDArray[np.uint8]:
    """The first ``count`` bytes of a mapping as a ``uint8`` array that keeps it mapped."""
    return np.frombuffer(memoryview(mapping), dtype=np.uint8, count=count)


# -- the owner's side: create and unlink ----------------------------------------------------


def _free_tracker_lock_in_child() -> None:
    # Python 3.11's resource tracker guards its connection with a lock that nothing frees in
    # a forked child: a parent's thread registering a segment (a slot leased off the loop) as
    # the program forked left the child's first register() waiting forever (its first epoch
    # hung). The child inherits the connection, which stays valid; only the lock is remade.
    lock = getattr(getattr(resource_tracker, "_resource_tracker", None), "_lock", None)
    reinit = getattr(lock, "_at_fork_reinit", None)
    if reinit is not None:
        reinit()


if sys.platform != "win32":
    os.register_at_fork(after_in_child=_free_tracker_lock_in_child)


def create_segment(size: int, shm_dir: str, name: str | None = None) -> tuple[str, SegmentMapping]:
    """Create a segment of ``size`` bytes under a fresh name, reserve its pages and map it.

    The segment is registered with the resource tracker before anything can fail, so a crash
    from then on still gets it unlinked; if creating fails, it is unlinked here. No descriptor
    stays open.

    Args:
        size: bytes, a whole number of pages.
        shm_dir: the tmpfs behind POSIX shared memory, named in the error when it is full.
        name: the name to create it under (made by :func:`new_name` in the process that
            will own it: a worker creates a segment the main process takes over); default a
            fresh name of this process.

    Returns:
        The segment's name and its mapping.

    Raises:
        SharedMemoryError: if ``shm_dir`` has no room for the segment, this process has no
            file descriptor left, or it cannot map the segment (no address space or map left).
    """
    given = name
    for _ in range(_NAME_ATTEMPTS if given is None else 1):
        name = given or new_name()  # a fresh name for each attempt
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
        _reserve(fd, size, shm_dir)
        try:
            mapping = _map(fd, size)
        except OSError as exc:
            # The kernel refused the mapping, not /dev/shm its pages: no address space or map
            # left to this process (RLIMIT_AS, vm.max_map_count, strict overcommit). Its
            # segment cannot be had either: the caller sends the batch another way.
            raise SharedMemoryError(
                f"{exc.strerror or exc}: this process could not map a shared-memory segment "
                f"of {size} bytes (its address space or its count of memory maps is at a "
                "limit: ulimit -v, vm.max_map_count)"
            ) from exc
    except BaseException:
        unlink(name)
        raise
    finally:
        os.close(fd)  # the mapping needs no descriptor
    return name, mapping


def _reserve(fd: int, size: int, shm_dir: str) -> None:
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
        free = free_bytes(shm_dir)
        raise SharedMemoryError(
            f"cannot reserve {size} bytes of shared memory for a batch slot: {shm_dir} "
            f"has {free} bytes free ({errno.errorcode.get(exc.errno or 0, exc.errno)}). "
            "Give it more room (docker run --shm-size=..., or a memory-backed emptyDir on "
            "Kubernetes) or lower prefetch / batch size."
        ) from exc


def discard(name: str) -> None:
    """Unlink segment ``name`` if it was created (a worker's, for a job that failed); never
    raises, and tells the tracker only of a segment that existed."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except OSError:
        return
    with contextlib.suppress(Exception):
        resource_tracker.unregister("/" + name, "shared_memory")


def shrink(name: str, size: int) -> bool:
    """Cut the segment ``name`` down to ``size`` bytes (whole pages), its pages past that going
    back to ``/dev/shm``; the caller must not touch its mapping past ``size`` from then on
    (SIGBUS). False where it could not (no descriptor left, or the segment is gone): the
    segment, if any, keeps its size."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
    except OSError:
        return False
    try:
        os.ftruncate(fd, size)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def unlink(name: str) -> None:
    """Unlink an owned segment and tell the tracker; never raises."""
    with contextlib.suppress(OSError):  # already gone (a janitor, or unlinked by hand)
        _posixshmem.shm_unlink("/" + name)
    with contextlib.suppress(Exception):  # the tracker died: nothing left to tell it
        resource_tracker.unregister("/" + name, "shared_memory")


# -- a worker's side: map what the owner created ----------------------------------------------


def map_existing(slot: Slot) -> npt.NDArray[np.uint8]:
    """Map the whole segment of ``slot``, without the resource tracker; no descriptor stays open.

    Raises:
        FileNotFoundError: if the segment is gone (the owner unlinked it, or something else
            removed it: the message names the usual suspects, see :func:`vanished_message`).
        ValueError: if the segment's size differs from ``slot.size``.
        SharedMemoryError: if this process has no file descriptor left to open the segment.
    """
    return as_bytes(map_shared(slot), slot.size)


def map_shared(slot: Slot) -> SegmentMapping:
    """The mapping :func:`map_existing` makes (see there), as the creator's is."""
    try:
        fd = _posixshmem.shm_open("/" + slot.name, os.O_RDWR, 0)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            exc.errno, vanished_message(slot.name), f"{SHM_DIR}/{slot.name}"
        ) from exc
    except OSError as exc:
        if (error := _out_of_fds(exc, "attach", slot.size)) is None:
            raise
        raise error from exc
    try:
        size = os.fstat(fd).st_size
        if size != slot.size:
            raise ValueError(f"segment {slot.name} has {size} bytes, slot.size={slot.size}")
        return _map(fd, size)
    finally:
        os.close(fd)  # the mapping needs no descriptor


def map_private(name: str, size: int) -> npt.NDArray[np.uint8]:
    """Map segment ``name`` copy-on-write: this process reads what the owner wrote, and what
    it writes stays its own (as memory inherited through ``fork``). No descriptor stays open.

    Raises:
        FileNotFoundError: if the segment is gone (see :func:`vanished_message`).
        SharedMemoryError: if this process has no file descriptor left to open the segment.
    """
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
    except FileNotFoundError as exc:
        why = vanished_message(name, "a dataset copy")
        raise FileNotFoundError(exc.errno, why, f"{SHM_DIR}/{name}") from exc
    except OSError as exc:
        if (error := _out_of_fds(exc, "attach", size)) is None:
            raise
        raise error from exc
    try:
        flags = mmap.MAP_PRIVATE  # pages come in as they are read: a dataset may read few
        return as_bytes(_map(fd, size, flags), size)
    finally:
        os.close(fd)


#: How long a process waits for a turn (:func:`turn`) before it goes on without one. A holder
#: that hangs is killed at its own start deadline, which frees its turn; this bounds the wait
#: where nothing kills it (no deadline set). Longer: a hung holder delays the others longer
#: where nothing kills it; shorter: more processes at once than turns after a slow load.
TURN_WAIT_S = 60.0
#: How often a waiting process tries every turn again. Shorter: a freed turn is taken sooner,
#: for more wake-ups while waiting; longer: the reverse.
TURN_POLL_S = 0.005


@contextlib.contextmanager
def turn(
    name: str,
    turns: int,
    *,
    wait_s: float = TURN_WAIT_S,
    waiting: Callable[[bool], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[bool]:
    """Hold one of ``turns`` turns on segment ``name`` while in the block: a byte-range lock
    on its file (byte ``k`` for turn ``k``), so that at most ``turns`` processes are in such a
    block at once. Workers that all unpickle one large dataset copy at once, more of them than
    there are CPUs, only slow each other: the first to finish (the first batch) finishes
    later, the last no sooner. A turn ends with the block, or with the process (the kernel
    drops a dead process's locks), so a worker killed mid-load holds nobody up.

    A process that finds every turn taken tries all of them again every :data:`TURN_POLL_S`
    (whichever comes free first is its own, not one byte it waits on behind a holder that
    may hang), for at most ``wait_s`` seconds; past that it goes on without a turn, so one
    hung holder delays the others by a bound, never forever. Where the lock cannot be had at
    all (the segment is gone, no descriptor left, a file system without record locks) the
    block runs without a turn at once. POSIX record locks belong to the process and go when
    *any* descriptor of the file is closed: take the turn after mapping the segment
    (:func:`map_private` opens and closes one), and open no other descriptor of it in the
    block.

    Args:
        name: the segment.
        turns: how many processes may hold a turn at once (at least 1).
        wait_s: the longest wait for a turn.
        waiting: told ``True`` when this process must wait (every turn taken), ``False`` when
            the wait ends (a turn held, or given up): a worker's start clock stops meanwhile,
            so that a worker is not blamed for the time another one holds the turns.
        clock, sleep: the time, for tests.

    Yields:
        Whether a turn is held.
    """
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0)
    except OSError:
        fd = -1
    try:
        held = False
        if fd >= 0:
            held = _take_turn(fd, max(1, turns), wait_s, waiting, clock, sleep)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    try:
        # Outside any except clause: an error in the block is not chained to ours.
        yield held
    finally:
        if fd >= 0:
            os.close(fd)  # the turn with it


def _take_turn(
    fd: int,
    turns: int,
    wait_s: float,
    waiting: Callable[[bool], None] | None,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> bool:
    """A free turn of ``fd``, trying every byte without blocking until one comes free or
    ``wait_s`` passed; whether one was taken."""
    deadline: float | None = None
    try:
        while True:
            for k in range(turns):
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, k)
                    return True
                except OSError as exc:
                    if exc.errno not in (errno.EACCES, errno.EAGAIN):
                        return False  # no record locks here: no turns
            now = clock()
            if deadline is None:
                deadline = now + wait_s
                if waiting is not None:
                    waiting(True)
            if now >= deadline:
                return False
            sleep(min(TURN_POLL_S, deadline - now))
    finally:
        if deadline is not None and waiting is not None:
            waiting(False)


def vanished_message(name: str, of: str = "a live batch slot") -> str:
    """Why segment ``name`` (``of`` what) may be missing from ``/dev/shm``, and what to do."""
    return (
        f"shared-memory segment {name} of {of} is gone from {SHM_DIR}: something "
        "other than this loader removed it. Likely: systemd-logind's RemoveIPC=yes (the "
        "default) when the last session of the user ends (run the job under a system user, or "
        "set RemoveIPC=no in /etc/systemd/logind.conf), a cleanup script or tmp cleaner that "
        f"empties {SHM_DIR}, or a container restart that gave it a fresh tmpfs"
    )


def segment_exists(name: str) -> bool:
    """Whether segment ``name`` still exists; True when that cannot be told (e.g. no fds)."""
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell (e.g. out of fds): keep it
    os.close(fd)
    return True


# -- janitor: segments of processes that died without closing their pool -----------------------

_janitor_pid: int | None = None  # the process the janitor last ran in


def janitor_once(shm_dir: str) -> None:
    """Run :func:`janitor` once per process (the first pool of each process calls it)."""
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
