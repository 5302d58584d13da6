"""Batch trees in a slot: how a worker lays a batch out in a buffer, and how it is read back.

A batch is a tree of containers around leaves, walked with :mod:`aioloader._tree`. In a
worker, :class:`SlotWriter` places the batch's numpy arrays and CPU tensors in one attached slot
and describes the batch as an :class:`Encoded` whose tree has an :class:`ArrayRef` (offset,
dtype, shape) in place of each array. In the main process, ``SlotPool.open`` validates every
descriptor against the slot (:func:`ref_end`) and rebuilds the batch as views of one root array
over the slot (:func:`view_leaf`)::

    worker: SlotWriter(buf).alloc(shape, dtype) ──▶ collate writes straight into the slot
            SlotWriter.encode(batch) ──▶ Encoded(tree of ArrayRef)  (other arrays copied in)
    main:   map_tree(tree, view_leaf(root, ...))  ──▶ numpy / torch views of the slot, zero copies

This module never opens, maps or unlinks a segment: it works on the ``uint8`` buffers it is
given (mappings made by :mod:`aioloader._shm`), so ``_shm`` stays the only package that touches
POSIX shared memory. ``_shm`` re-exports every public name here.

Sharp edges:

- **Spills go inline.** An ``alloc`` that does not fit the slot gets plain memory; the batch then
  comes back inline with ``needed_bytes`` set, so the caller can lease a bigger slot next time.
- **Nothing inline points into a slot.** An inline batch's arrays that lie in the slot are
  copied out first, because the slot is reused as soon as the batch is returned.
- **dtypes numpy lacks.** bfloat16, float8 and complex32 tensors travel as same-width integers
  (:attr:`ArrayRef.torch_dtype` names the real dtype) and come back as the same dtype. A tensor
  that requires grad comes back as a leaf that requires grad (:attr:`ArrayRef.requires_grad`),
  as one pickled inline does: the flag never depends on the batch's size, and the graph, which
  cannot cross processes, stays behind. Conjugate and negative bits are resolved before the
  copy. Sparse, quantized, nested and non-CPU tensors, and object or structured arrays, are not
  arrays here: they stay leaves and are pickled.
- **Views keep the slot alive.** Views of views collapse to the first array that does not own
  its data, the root; so every leaf, and anything derived from it, keeps the root (and with it
  the slot) alive until the last one is collected.
- **torch is optional.** Leaves are recognised as tensors only if torch is already imported
  (no torch, no tensors), and ``open`` imports torch only when a descriptor asks for a tensor.
- **Containers are rebuilt by** :mod:`aioloader._tree`'s **one rule** (namedtuples field by
  field, a ``defaultdict`` keeps its factory); its walks visit leaves in a deterministic order.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from .._tree import iter_leaves, map_tree

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGN",
    "BYTES_IN_SLOT_MIN",
    "HUGE_BYTES_MIN",
    "INLINE_MAX_BYTES",
    "ArrayRef",
    "Encoded",
    "SlotWriter",
    "import_torch",
    "in_slot_bytes",
    "new_bytes",
    "ref_end",
    "view_leaf",
]

# Every array starts at a multiple of 64 bytes: one cache line, and enough for any dtype and for
# aligned SIMD loads. Costs at most 63 bytes per array.
ALIGN = 64

# Batches whose arrays total fewer bytes come back pickled: a pickle round trip of 64 KiB costs
# about as much as a lease, a mapping and a finalizer.
INLINE_MAX_BYTES = 64 << 10

# A ``bytes`` leaf at least this large travels in the slot like an array: copied in by the
# worker, and out into a new ``bytes`` by the main process (two copies; pickled, it cost a copy
# into the pickle, the kernel's two through a 64 KiB pipe with dozens of wake-ups of both
# processes per MiB, and one out of the pickle). Smaller ones stay in the pickled tree, where
# their own record costs less. Lower: more small leaves copied twice for little; higher: more
# large ones through the pipe.
BYTES_IN_SLOT_MIN = 64 << 10


# A ``bytes`` object copied out of a slot from this size on asks the kernel for huge pages
# (numpy's own threshold for its arrays): a 32 MiB ``bytes`` is fresh memory (malloc maps
# allocations that large anew each time), and faulting it in 4 KiB pages cost 19 ms against
# 5 ms in 2 MiB ones, measured here; that made the consumer the bound of 32 MiB ``bytes``
# payloads (1.5 GB/s).
HUGE_BYTES_MIN = 4 << 20
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux's <sys/mman.h>


def _huge_page_calls() -> tuple[Any, Any] | None:
    """``(PyBytes_AsString, madvise)`` where both can be called (CPython on Linux), else None."""
    if sys.platform != "linux" or sys.implementation.name != "cpython":
        return None
    try:
        address_of = ctypes.pythonapi.PyBytes_AsString
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    address_of.argtypes, address_of.restype = [ctypes.py_object], ctypes.c_void_p
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return address_of, madvise


_HUGE_CALLS = _huge_page_calls()


def new_bytes(arr: npt.NDArray[np.uint8]) -> bytes:
    """A new ``bytes`` holding the contiguous ``uint8`` array ``arr`` (a copy: it keeps no
    slot alive). From :data:`HUGE_BYTES_MIN` on, the new object's pages are advised as huge
    before the copy touches them: ``bytes(n)`` calls ``calloc``, which leaves a fresh mapping
    untouched, and the object is written while this function holds its only reference (no
    hash is cached yet), as C code fills a ``bytes`` it made with ``PyBytes_FromStringAndSize
    (NULL, n)``. Where the advice is refused (no transparent huge pages), it is a plain copy."""
    n = arr.nbytes
    if n < HUGE_BYTES_MIN or _HUGE_CALLS is None or not arr.flags.c_contiguous:
        return arr.tobytes()
    address_of, madvise = _HUGE_CALLS
    out = bytes(n)
    start = address_of(out)
    first = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    last = (start + n) // _HUGE_PAGE * _HUGE_PAGE
    if last > first:
        madvise(first, last - first, _MADV_HUGEPAGE)  # advice: a refusal changes nothing
    ctypes.memmove(start, arr.ctypes.data, n)
    return out


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def in_slot_bytes(sizes: Iterable[int]) -> int:
    """The bytes leaves of ``sizes`` bytes take in a slot, each at its aligned offset
    (:data:`ALIGN`): at most what :class:`SlotWriter` lays them out in, in any order. The
    one count of a batch's size in a slot, for the batch's and its slot's (however many
    leaves: a fixed slack covered only so many)."""
    return sum(_align(n) for n in sizes)


@dataclass(frozen=True, slots=True)
class ArrayRef:
    """Where one array of a batch lies in its slot (a leaf of :attr:`Encoded.tree`).

    Attributes:
        offset: byte offset from the start of the segment.
        dtype: numpy dtype string of the bytes (``'<f4'``).
        shape: the array's shape.
        kind: ``'numpy'`` or ``'torch'``: what :meth:`SlotPool.open` gives back (a view), or
            ``'bytes'``: a ``bytes`` leaf, given back as new ``bytes`` copied out of the slot.
        torch_dtype: for torch dtypes numpy lacks (``'bfloat16'``, float8, ...), the bytes are
            stored as a same-width integer ``dtype`` and reinterpreted as this torch dtype.
        requires_grad: the tensor required grad: its view does too (a leaf: the graph that
            made it stays in the worker), as a pickled tensor would.
    """

    offset: int
    dtype: str
    shape: tuple[int, ...]
    kind: Literal["numpy", "torch", "bytes"]
    torch_dtype: str | None = None
    requires_grad: bool = False


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
    def size(self) -> int:
        """Bytes of the slot."""
        return self._size

    @property
    def needed_bytes(self) -> int:
        """Bytes the allocations so far need in a slot."""
        return self._offset

    @property
    def overflowed(self) -> bool:
        """Whether an allocation did not fit and was given plain memory instead."""
        return self._offset > self._size

    def alloc(self, shape: int | tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        """A writable C-contiguous array in the slot, or plain memory if it does not fit (the
        batch then goes inline), or if its dtype cannot live in shared memory (object,
        structured, zero-width: :meth:`encode` leaves such an array to be pickled with the
        descriptors, as it does one made anywhere else).

        Raises:
            ValueError: for a negative dimension.
            RuntimeError: after :meth:`encode` (a collate function that kept ``alloc``).
        """
        if self._encoded:  # its slot may be cut to the batch's size by now (Packer)
            raise RuntimeError("SlotWriter.alloc() after encode(): the batch is packed")
        shape, dt, nbytes = alloc_args(shape, dtype)
        if not storable_dtype(dt):
            return np.empty(shape, dt)
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

        Walks the batch's containers (:mod:`aioloader._tree`). numpy arrays and CPU torch
        tensors become :class:`ArrayRef` leaves: arrays already in the slot (from
        :meth:`alloc`) without a copy, others (non-contiguous ones too) copied once; so do
        ``bytes`` leaves of :data:`BYTES_IN_SLOT_MIN` or more (copied once). Other leaves
        (numbers, strings, None, object arrays, sparse or CUDA tensors) stay as they are and are
        pickled. Tensors keep ``requires_grad`` (as leaves), as pickled ones do; torch dtypes
        numpy lacks (bfloat16) travel as raw bytes and come back as the same dtype.

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
        for leaf in iter_leaves(batch):
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
            grad = kind == "torch" and bool(leaf.requires_grad)
            ref = ArrayRef(offset, arr.dtype.str, tuple(arr.shape), kind, torch_dtype, grad)
            refs[id(leaf)] = ref
            if copy_in:
                copies.append((arr, ref))
        needed = cursor
        if array_bytes < inline_below or needed > self._size or not refs:
            tree = batch
            if touching:  # nothing returned may point into a slot that is about to be reused
                tree = map_tree(batch, lambda x: _copy_out(x) if id(x) in touching else x)
            return Encoded(tree, 0, needed, True)
        for arr, ref in copies:
            dst = self._buf[ref.offset : ref.offset + arr.nbytes].view(arr.dtype)
            np.copyto(dst.reshape(arr.shape), arr)
        tree = map_tree(batch, lambda x: refs.get(id(x), x))
        return Encoded(tree, needed, needed, False)


def alloc_args(
    shape: int | tuple[int, ...], dtype: npt.DTypeLike
) -> tuple[tuple[int, ...], np.dtype[Any], int]:
    """An ``alloc``'s arguments checked: the shape as a tuple, the dtype, and the bytes.

    Raises:
        ValueError: for a negative dimension.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    dt = np.dtype(dtype)
    if any(d < 0 for d in shape):
        raise ValueError(f"shape={shape} has a negative dimension")
    return shape, dt, math.prod(shape) * dt.itemsize


def _address(arr: npt.NDArray[Any]) -> int:
    return int(arr.__array_interface__["data"][0])


def _copy_out(x: Any) -> Any:
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def storable_dtype(dt: np.dtype[Any]) -> bool:
    """Whether arrays of ``dt`` can live in a slot (not objects, records, subarrays, voids)."""
    return not dt.hasobject and dt.fields is None and dt.subdtype is None and dt.itemsize > 0


_RAW_INT = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def slot_nbytes(x: Any) -> int:
    """Bytes leaf ``x`` takes in a slot (as :func:`_as_numpy` would place it, without making
    its numpy view); 0 for one that is pickled beside the descriptors."""
    if type(x) is bytes:
        return len(x) if len(x) >= BYTES_IN_SLOT_MIN else 0
    if type(x) is np.ndarray or isinstance(x, np.memmap):
        return int(x.nbytes) if storable_dtype(x.dtype) else 0
    torch_mod = sys.modules.get("torch")
    if torch_mod is None or not isinstance(x, torch_mod.Tensor) or not _slot_tensor(x):
        return 0
    size = x.element_size()
    if size not in _RAW_INT and _numpy_dtype(x.dtype) is None:
        return 0  # neither a numpy dtype nor raw bits to ship it as
    return int(size * x.nelement())


def _as_numpy(
    x: Any,
) -> tuple[npt.NDArray[Any], Literal["numpy", "torch", "bytes"], str | None] | None:
    """The bytes of an array leaf as numpy (sharing memory), its kind, and a raw torch dtype;
    a large ``bytes`` leaf too (:data:`BYTES_IN_SLOT_MIN`)."""
    if type(x) is bytes:
        return (np.frombuffer(x, np.uint8), "bytes", None) if len(x) >= BYTES_IN_SLOT_MIN else None
    if type(x) is np.ndarray or isinstance(x, np.memmap):
        return (x, "numpy", None) if storable_dtype(x.dtype) else None
    torch_mod = sys.modules.get("torch")  # no torch imported: no tensor can be a leaf
    if torch_mod is None or not isinstance(x, torch_mod.Tensor):
        return None
    t: torch.Tensor = x
    if not _slot_tensor(t):
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


def _slot_tensor(t: torch.Tensor) -> bool:
    """Whether tensor ``t`` can lie in a slot: strided, on the CPU, neither quantized nor
    nested (its dtype is :func:`_as_numpy`'s to check)."""
    return (
        t.layout == sys.modules["torch"].strided
        and t.device.type == "cpu"
        and not t.is_quantized
        and not t.is_nested
    )


@functools.lru_cache(maxsize=64)
def _numpy_dtype(dtype: Any) -> np.dtype[Any] | None:
    torch_mod = sys.modules["torch"]
    try:
        return torch_mod.empty(0, dtype=dtype).numpy().dtype  # type: ignore[no-any-return]
    except TypeError:
        return None


# ---------------------------------------------------------------------------------------------
# Reading back: descriptors checked against the slot, then views of its root array.


def ref_end(ref: ArrayRef, size: int) -> int:
    dt = np.dtype(ref.dtype)
    end = ref.offset + math.prod(ref.shape) * dt.itemsize
    if ref.offset < 0 or end > size or any(d < 0 for d in ref.shape):
        raise ValueError(f"descriptor {ref!r} lies outside the slot of {size} bytes")
    return end


def view_leaf(root: npt.NDArray[np.uint8], leaf: Any, torch_mod: Any) -> Any:
    if not isinstance(leaf, ArrayRef):
        return leaf
    dt = np.dtype(leaf.dtype)
    end = leaf.offset + math.prod(leaf.shape) * dt.itemsize
    # Views of views collapse to the first array that does not own its data: root. So every
    # leaf, and anything derived from it, keeps root (and with it the slot) alive.
    arr = root[leaf.offset : end].view(dt).reshape(leaf.shape)
    if leaf.kind == "numpy":
        return arr
    if leaf.kind == "bytes":
        return new_bytes(arr)  # its own memory: it does not keep the slot
    tensor = torch_mod.from_numpy(arr)
    if leaf.torch_dtype is not None:
        tensor = tensor.view(getattr(torch_mod, leaf.torch_dtype))
    if leaf.requires_grad:
        tensor.requires_grad_(True)
    return tensor


def import_torch() -> Any:
    import torch

    return torch
