"""Arrays and tensors that live in a memory-mapped file travel to a worker as a reference to the
file, and the worker maps the file itself: the bytes are neither pickled nor copied.

The LLM-pretraining pattern ``self.tokens = np.memmap(path, dtype=np.uint16, mode="r")`` holds
a file of many GB. Pickled as numpy pickles it, the whole file would go into every copy of the
dataset (an ``np.memmap`` pickles as a plain array of all its bytes), every time workers start;
through ``fork``, torch's workers share the mapping instead. Here such a buffer is located in
this process's address space (``/proc/self/maps``: which file, at which file offset, mapped how)
and pickled as a reference to the file region; the worker opens and maps the same region and
builds the same array over it::

    main:   np.memmap / torch.Tensor ──▶ its bytes inside a mapping of a regular file that
                                         still has this path?  ──no──▶ pickled as before
                                         │ yes
                                         ▼
            (FileRegion, offset, dtype, shape, strides)  ── a few hundred bytes in the stream
    worker: FileRegion ──▶ open + fstat (same file, long enough?) ──▶ mmap ──▶ the array / the
                           tensor over it (one mapping per region, however many views use it)

What a worker then sees is what it would see had it been forked, by the kind of mapping:
- shared, writable (``np.memmap`` mode ``r+`` or ``w+``, a tensor ``from_numpy`` of one, a
  ``torch.UntypedStorage.from_file(shared=True)``): mapped shared; a worker's writes reach the
  file, and every process mapping it sees them.
- shared, read-only (mode ``r``): an array is mapped read-only, as the original; a tensor is
  mapped copy-on-write (torch refuses to build a tensor over read-only memory without a
  warning; its writes stay the worker's own).
- private (mode ``c``, ``torch.load(path, mmap=True)``): only while this process has changed
  none of its pages (no anonymous or swapped page in ``/proc/self/smaps``), so that the file
  still holds exactly what the mapping shows; mapped copy-on-write. A mapping with private
  changes is pickled as before: its bytes, changes included.

A tensor torch put in shared memory (``share_memory_()``, with torch's default
``file_descriptor`` sharing strategy) lives in a file already removed, which this process keeps
open: it travels as a reference to that descriptor (``/proc/PID/fd/N``), and the worker maps the
same memory shared (:meth:`Finder.reduce_shared_tensor`), so writes on either side are seen on
the other, as after ``fork``: an epoch counter or a label table the main process updates
between epochs of persistent workers, a cache the workers fill.

Sharp edges:
- Linux only (``/proc/self/maps``); where it cannot be read, everything is pickled as before.
- A shared tensor is reached through this process's descriptor: it must stay alive here until
  the workers loaded the copy (the dataset holds it), and ``/proc/PID/fd`` must be open to the
  workers (the same user; it is, unless a security module says otherwise: then the worker's
  start fails naming the path). A descriptor number reused by another file is caught (the
  inode is compared), as a replaced file is.
- A file already removed, or replaced by another under its path (``(deleted)`` in the maps, or
  another inode), is pickled as before: this process still holds the bytes. A file removed,
  replaced or shortened *after* the pickling, before a worker maps it, fails that worker's
  start with ``FileNotFoundError`` or ``OSError`` (ESTALE) naming the path: the bytes are in
  no payload to fall back to. A file changed in place is seen changed, as through ``fork``.
- Only the file's inode is compared with the mapping's, not the device: on overlayfs (Docker)
  the maps show the lower file system's device, ``stat`` the overlay's. The worker compares
  both with what ``stat`` showed here (the same path, the same view of it).
- Files under ``/dev/shm`` are left alone: shared-memory segments come and go with their
  owners (a batch of a loader, a torch tensor in shared memory), a file on disk does not.
- Only exact ``np.memmap`` and ``torch.Tensor`` are looked at (by type, in the pickler's
  dispatch table): an ``np.asarray(memmap)`` view is a plain array and is copied.
- A worker's mapping holds a descriptor (Python's ``mmap`` keeps a duplicate), as the
  original ``np.memmap`` does here.
"""

from __future__ import annotations

import bisect
import errno
import mmap
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .. import _shm

__all__ = ["FileRegion", "Finder"]

Access = Literal["r", "r+", "c"]

_ACCESS = {"r": mmap.ACCESS_READ, "r+": mmap.ACCESS_WRITE, "c": mmap.ACCESS_COPY}
_MAPS = "/proc/self/maps"
_SMAPS = "/proc/self/smaps"
_DELETED = " (deleted)"


@dataclass(frozen=True, slots=True)
class FileRegion:
    """A region of a regular file that a worker maps for itself.

    Pickles as the call that maps it: a worker unpickles a mapping (``mmap.mmap``), one per
    region however many arrays refer to it (the pickler's memo).

    Attributes:
        path: the file, absolute.
        device: ``st_dev`` of the file here (a worker checks it maps the same file).
        inode: ``st_ino`` of the file here.
        offset: where the region starts in the file (a multiple of the page size).
        length: its length in bytes (the file holds all of it).
        access: ``"r"`` read-only shared, ``"r+"`` writable shared, ``"c"`` copy-on-write.
    """

    path: str
    device: int
    inode: int
    offset: int
    length: int
    access: Access

    def __reduce__(self) -> tuple[Any, ...]:
        fields = (self.path, self.device, self.inode, self.offset, self.length, self.access)
        return _open_region, fields


@dataclass(frozen=True, slots=True)
class _Vma:
    """A line of ``/proc/self/maps`` that maps a file by its path."""

    start: int
    end: int
    shared: bool
    writable: bool
    offset: int
    inode: int
    path: str


class Finder:
    """Locates buffers in this process's file mappings, for one pickling: ``/proc/self/maps``
    is read at the first question (not at all for a dataset with no memmap and no tensor),
    ``/proc/self/smaps`` only when a private mapping is asked about."""

    def __init__(self) -> None:
        self._vmas: list[_Vma] | None = None
        self._starts: list[int] = []
        self._touched: dict[int, int] | None = None
        # One region object per mapping and access: the pickler memoizes it, so a worker
        # maps it once for all the arrays that refer to it.
        self._regions: dict[tuple[int, Access], FileRegion] = {}
        self._stats: dict[int, os.stat_result] = {}  # by mapping: a file stat'ed once
        self._shared: dict[int, FileRegion] = {}  # torch's shared memory, by descriptor
        self._kept: list[Any] = []  # the storages of those descriptors

    def reduce_memmap(self, array: np.memmap[Any, Any]) -> tuple[Any, ...] | None:
        """The reduction of ``array`` as a reference to its file, or None: pickle it as before
        (not in a mapping of a file a worker can map the same; empty)."""
        if array.size == 0:
            return None
        low, high = _extent(array.ctypes.data, array.shape, array.strides, array.itemsize)
        found = self._locate(low, high - low, read_only="r")
        if found is None:
            return None
        region, within = found
        start = within + array.ctypes.data - low  # where element 0 is
        attrs = (array.filename, array.offset, array.mode)
        view = (array.dtype, array.shape, array.strides, attrs, bool(array.flags.writeable))
        return _array_over, (region, start, *view)

    def reduce_tensor(self, tensor: Any) -> tuple[Any, ...] | None:
        """The reduction of a CPU tensor as a reference to the file its storage lies in, or
        None: pickle it as before."""
        import torch

        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            return None
        storage = tensor.untyped_storage()
        # First whether it lies in a file's mapping at all (a bisection): most tensors do not.
        if not self._in_a_file(address := storage.data_ptr()):
            return None
        nbytes = storage.nbytes()
        if (
            nbytes == 0
            or nbytes % tensor.element_size()  # the worker views the bytes as the dtype
            or tensor.requires_grad
            or tensor.is_quantized
            or tensor.is_conj()
            or tensor.is_neg()
        ):
            return None
        found = self._locate(address, nbytes, read_only="c")
        if found is None:
            return None
        region, within = found
        view = (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset())
        return _tensor_over, (region, within, nbytes, *view)

    @property
    def kept(self) -> tuple[Any, ...]:
        """The storages whose descriptors the picklings referred to (see
        :meth:`reduce_shared_tensor`): the descriptors stay valid while they live."""
        return tuple(self._kept)

    def reduce_shared_tensor(self, tensor: Any) -> tuple[Any, ...] | None:
        """The reduction of a CPU tensor in torch's shared memory as a reference to the
        descriptor this process keeps for it, or None: pickle it as before (not shared, or
        shared by file name or by CUDA, or a view a worker cannot rebuild)."""
        import torch

        if (
            tensor.device.type != "cpu"
            or tensor.layout != torch.strided
            or tensor.requires_grad
            or tensor.is_quantized
            or tensor.is_conj()
            or tensor.is_neg()
            or not tensor.is_shared()
        ):
            return None
        storage = tensor.untyped_storage()
        try:
            fd = storage._get_shared_fd()  # -1: not kept by descriptor (never moves the data)
        except Exception:
            return None
        nbytes = storage.nbytes()
        if fd < 0 or nbytes == 0 or nbytes % tensor.element_size():
            return None
        region = self._shared.get(fd)  # one per storage: a worker maps it once
        if region is None:
            st = os.fstat(fd)
            path = f"/proc/{os.getpid()}/fd/{fd}"
            region = self._shared[fd] = FileRegion(path, st.st_dev, st.st_ino, 0, nbytes, "r+")
            self._kept.append(storage)
        view = (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset())
        return _tensor_over, (region, 0, nbytes, *view)

    def _vma_at(self, address: int) -> _Vma | None:
        """The file mapping ``address`` lies in, if any."""
        if self._vmas is None:
            self._vmas = _read_maps()
            self._starts = [vma.start for vma in self._vmas]
        at = bisect.bisect_right(self._starts, address) - 1
        if at < 0 or address >= self._vmas[at].end:
            return None
        return self._vmas[at]

    def _in_a_file(self, address: int) -> bool:
        return self._vma_at(address) is not None

    def _locate(
        self, address: int, nbytes: int, *, read_only: Access
    ) -> tuple[FileRegion, int] | None:
        """The region holding bytes ``[address, address + nbytes)`` and where they start in it,
        or None. ``read_only``: how a worker maps a shared read-only mapping."""
        vma = self._vma_at(address)
        if vma is None:
            return None
        if address + nbytes > vma.end:
            return None  # not one mapping (or not a file's at all)
        if vma.shared:
            access: Access = "r+" if vma.writable else read_only
        elif self._unchanged(vma):
            access = "c"
        else:
            return None  # this process's private changes: only a copy carries them
        st = self._stats.get(vma.start)
        if st is None:
            try:
                st = self._stats[vma.start] = os.stat(vma.path)
            except OSError:
                return None
        if not stat.S_ISREG(st.st_mode) or st.st_ino != vma.inode:
            return None  # replaced under its path since it was mapped
        length = min(vma.end - vma.start, st.st_size - vma.offset)
        within = address - vma.start
        if within + nbytes > length:
            return None  # past the end of the file (truncated since it was mapped)
        key = (vma.start, access)
        region = self._regions.get(key)
        if region is None:
            region = FileRegion(vma.path, st.st_dev, st.st_ino, vma.offset, length, access)
            self._regions[key] = region
        return region, within

    def _unchanged(self, vma: _Vma) -> bool:
        """Whether this process changed no page of the private mapping ``vma``: the file still
        holds what it shows (a written page becomes anonymous, or swap once swapped out)."""
        if self._touched is None:
            self._touched = _read_touched()
        return self._touched.get(vma.start, 1) == 0


def _read_maps() -> list[_Vma]:
    """The mappings of regular files of this process, by address (none off Linux)."""
    try:
        with open(_MAPS, encoding="utf-8", errors="surrogateescape") as file:
            text = file.read()
    except OSError:
        return []
    vmas = []
    shm_dir = _shm.SHM_DIR.rstrip("/") + "/"
    for line in text.split("\n"):  # not splitlines(): a path may hold \r, \x1c ...
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue  # anonymous
        addresses, perms, offset, _device, inode, path = fields
        if not path.startswith("/") or path.endswith(_DELETED) or path.startswith(shm_dir):
            continue  # [heap], [stack]...; a removed file; shared memory
        start, end = addresses.split("-")
        vmas.append(
            _Vma(
                int(start, 16),
                int(end, 16),
                shared=perms[3] == "s",
                writable=perms[1] == "w",
                offset=int(offset, 16),
                inode=int(inode),
                path=path.replace("\\012", "\n"),  # the kernel's one escape in this file
            )
        )
    return vmas


def _read_touched() -> dict[int, int]:
    """Each mapping's start and its kB of anonymous and swapped pages, from smaps."""
    try:
        with open(_SMAPS, encoding="utf-8", errors="surrogateescape") as file:
            text = file.read()
    except OSError:
        return {}
    touched: dict[int, int] = {}
    current: int | None = None
    for line in text.split("\n"):
        head, _, rest = line.partition(" ")
        if head.endswith(":"):  # a field of the current mapping
            if current is not None and head in ("Anonymous:", "Swap:"):
                touched[current] += int(rest.split()[0])
        elif "-" in head:  # the header of the next mapping
            current = int(head.partition("-")[0], 16)
            touched[current] = 0
    return touched


def _extent(
    address: int, shape: Sequence[int], strides: Sequence[int], itemsize: int
) -> tuple[int, int]:
    """The bytes ``[low, high)`` a non-empty array at ``address`` spans."""
    low = high = address
    for count, step in zip(shape, strides, strict=True):
        if step < 0:
            low += (count - 1) * step
        else:
            high += (count - 1) * step
    return low, high + itemsize


def _open_region(
    path: str, device: int, inode: int, offset: int, length: int, access: Access
) -> mmap.mmap:
    """Map the region of a :class:`FileRegion` (in a worker, unpickling it).

    Raises:
        FileNotFoundError: the file is gone.
        OSError: (ESTALE) another file has the path now, or it is shorter than the region.
    """
    what = "a memory-mapped file of the dataset"
    why = "after the workers' copy of the dataset was pickled (a worker maps such a file again)"
    try:
        file = open(path, "r+b" if access == "r+" else "rb")  # noqa: SIM115 - with, below
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            exc.errno, f"{what} is gone: removed or renamed {why}", path
        ) from exc
    with file:  # the mapping keeps a descriptor of its own
        st = os.fstat(file.fileno())
        if (st.st_dev, st.st_ino) != (device, inode):
            raise OSError(errno.ESTALE, f"{what} was replaced by another file {why}", path)
        if st.st_size < offset + length:
            raise OSError(
                errno.ESTALE,
                f"{what} was shortened to {st.st_size} bytes (it needs {offset + length}) {why}",
                path,
            )
        return mmap.mmap(file.fileno(), length, access=_ACCESS[access], offset=offset)


def _array_over(
    mapping: mmap.mmap,
    start: int,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    attrs: tuple[Any, Any, Any],
    writeable: bool,
) -> np.memmap[Any, Any]:
    """The ``np.memmap`` :meth:`Finder.reduce_memmap` pickled, over the worker's mapping (built
    as ``np.memmap.__new__`` builds one)."""
    array: Any = np.ndarray.__new__(
        np.memmap, shape, dtype=dtype, buffer=mapping, offset=start, strides=strides
    )
    array._mmap = mapping
    array.filename, array.offset, array.mode = attrs
    if not writeable and array.flags.writeable:
        array.flags.writeable = False
    result: np.memmap[Any, Any] = array
    return result


def _tensor_over(
    mapping: mmap.mmap,
    start: int,
    nbytes: int,
    dtype: Any,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    storage_offset: int,
) -> Any:
    """The tensor :meth:`Finder.reduce_tensor` pickled: its storage over the worker's mapping
    (writable: mapped shared and writable, or copy-on-write), the same view of it."""
    import torch

    storage = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=start)
    return storage.view(dtype).as_strided(shape, stride, storage_offset)
