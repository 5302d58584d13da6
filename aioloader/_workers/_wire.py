"""What goes to a worker and how its batch comes back: the wire format of one job.

Three job records go out (pickled over the worker's request pipe, with the function to run):

- :class:`LoadJob`: the dataset copy (and the callables) a worker makes its batches with from
  now on, sent before the first batch job of each epoch that renews it;
- :class:`MapJob`: a map-style :class:`~aioloader._types.BatchRequest` and the slot, if any,
  the batch should be collated into;
- :class:`StreamJob`: a :class:`~aioloader._types.StreamRequest` (the next batch of this
  worker's stream) and likewise a slot.

One record comes back: :class:`~aioloader._types.Made`, whose ``batch`` is a :class:`Parcel`
on the way (the batch in wire form) and the real batch once :meth:`Receiver.open` has opened it
in the main process. Nothing else is built from it and nothing is patched into it on the way.

Shared memory or inline is decided here and nowhere else, on both sides of the pipe::

    main: Receiver.lease()     the largest batch seen so far is >= INLINE_MAX_BYTES and a slot
                               pool exists ─▶ a slot (reused at once, or created in a thread);
                               none seen yet ─▶ an OwnSlot: the worker makes the segment of a
                               large batch under a name from here, the pool adopts it (the
                               first batches of a loader need not travel pickled);
                               otherwise None: the batch will travel inline
    worker: Packer(slot)       collate straight into the slot (Packer.alloc), then pack():
                               no slot, a tiny batch, or one that did not fit ─▶ inline
                               (with the bytes a slot would need, so the next lease fits);
                               a slot it cannot map (removed from /dev/shm, no descriptor
                               left) ─▶ inline, with the reason;
                               else ─▶ the descriptor tree of the arrays in the slot
    main: Receiver.open()      in the slot ─▶ zero-copy views (the slot goes with them);
                               inline ─▶ the slot goes back to the pool (forgotten if it
                               was removed), tensors are rebuilt

Sharp edges:
- torch registers a reduction with multiprocessing's pickler that moves every pickled tensor
  into a new shared-memory file and sends its descriptor: for a small batch that costs far more
  than the bytes. An inline batch therefore carries its CPU tensors as numpy arrays
  (:func:`to_wire`), which pickle by value; the main process wraps them back without a copy.
- A slot goes back to the pool only once no worker can write into it: after the job answered,
  or after the worker died. An abandoned job's slot is released by the channel when the worker
  is done with it (``on_abandon``), never by the task that gave up waiting.
- The markers :data:`~aioloader._types.END` and :data:`~aioloader._types.EMPTY_BATCH` travel
  inline and pickle by reference, so ``is`` tests hold after the round trip.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _shm
from .._batch import Alloc
from .._errors import SharedMemoryError
from .._tree import iter_leaves, map_tree
from .._types import BatchRequest, Made, StreamRequest
from ._payload import Payload

__all__ = [
    "INLINE_MAX_BYTES",
    "LoadJob",
    "MapJob",
    "Packer",
    "Parcel",
    "Receiver",
    "StreamJob",
    "batch_nbytes",
    "from_wire",
    "inline",
    "to_wire",
]

# Batches with fewer array bytes than this travel inline, never in a slot: for them a slot
# costs more (a lease, a mapping, a finalizer) than the pickle copy it saves.
INLINE_MAX_BYTES = _shm.INLINE_MAX_BYTES


# -- out: the jobs -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Make batches from now on with the dataset copy in ``payload``, made for ``epoch``.

    Attributes:
        payload: ``(BatchMaker, worker_init_fn)`` pickled by :func:`._payload.dumps_copy`.
        epoch: the epoch it was made for (the worker's seed derives from it).
    """

    payload: Payload
    epoch: int


@dataclass(frozen=True, slots=True)
class OwnSlot:
    """In place of a slot, before the loader knows how large its batches are: a batch of
    :data:`INLINE_MAX_BYTES` or more goes into a segment the worker creates under ``name``
    (the main process's name: it takes the segment over into its pool, or unlinks it if the
    job fails), not inline."""

    name: str


@dataclass(frozen=True, slots=True)
class MapJob:
    """Make the batch of ``request`` (indices, or samples the loop fetched), into ``slot`` if
    one is given."""

    request: BatchRequest
    slot: _shm.Slot | OwnSlot | None


@dataclass(frozen=True, slots=True)
class StreamJob:
    """Make the next batch of this worker's stream for ``request``, into ``slot`` if given."""

    request: StreamRequest
    slot: _shm.Slot | OwnSlot | None


# -- back: the parcel ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Parcel:
    """A made batch on its way to the main process (``Made.batch`` until it is opened).

    Attributes:
        tree: the batch's nesting with every array replaced by its place in the slot
            (``in_slot``), or the batch itself in wire form (see :func:`to_wire`).
        in_slot: whether the arrays lie in the job's slot.
        nbytes: the bytes a slot needs for a batch like this one; later leases are sized from
            the largest seen.
        slot_error: why the worker could not map the job's slot, so the batch came inline
            ("" if it could, or had no slot): the segment vanished, or descriptors ran out.
        slot_vanished: the slot's segment no longer exists (someone removed it): the pool must
            stop leasing it.
    """

    tree: Any
    in_slot: bool
    nbytes: int
    slot_error: str = ""
    slot_vanished: bool = False
    own_slot: _shm.Slot | None = None  # the segment the worker made for it (OwnSlot)


def inline(batch: Any) -> Parcel:
    """``batch`` sent inline (no slot, or a marker such as ``END``)."""
    return Parcel(to_wire(batch), False, batch_nbytes(batch))


class Packer:
    """Worker side: where one batch is collated and how it goes back. One per job.

    If the slot cannot be mapped (its segment was removed from ``/dev/shm`` behind the pool's
    back, or this process has no file descriptor left), the batch travels inline and the parcel
    says why: the batch is never lost for want of a slot.

    Args:
        slot: the job's slot (attached here, cached per process), or None for inline.
    """

    __slots__ = ("_error", "_own_name", "_vanished", "_writer")

    def __init__(self, slot: _shm.Slot | OwnSlot | None) -> None:
        self._writer: _shm.SlotWriter | None = None
        self._error = ""
        self._vanished = False
        self._own_name = slot.name if isinstance(slot, OwnSlot) else None
        if slot is None or isinstance(slot, OwnSlot):
            return
        try:
            self._writer = _shm.SlotWriter(_shm.attach(slot))
        except FileNotFoundError as exc:
            self._error, self._vanished = str(exc), True
        except SharedMemoryError as exc:
            self._error = str(exc)

    @property
    def alloc(self) -> Alloc | None:
        """Where a collate function that can should place its arrays (None: anywhere)."""
        return self._writer.alloc if self._writer is not None else None

    def pack(self, batch: Any) -> Parcel:
        """The parcel of ``batch``: in the slot if there is one and the batch fits and is not
        tiny; inline otherwise."""
        if self._writer is None:
            if self._error:
                parcel = inline(batch)
                return Parcel(parcel.tree, False, parcel.nbytes, self._error, self._vanished)
            if self._own_name is not None:
                return self._in_own_slot(batch, self._own_name)
            return inline(batch)
        nbytes = batch_nbytes(batch)
        encoded = self._writer.encode(batch, inline_below=INLINE_MAX_BYTES)
        if encoded.inline:  # tiny, or did not fit: inline now, a big enough slot next time
            return Parcel(to_wire(encoded.tree), False, max(nbytes, encoded.needed_bytes))
        return Parcel(encoded.tree, True, nbytes)

    @staticmethod
    def _in_own_slot(batch: Any, name: str) -> Parcel:
        """``batch`` in a segment made for it here (:class:`OwnSlot`), if it is not tiny and
        ``/dev/shm`` has room to spare (four times the segment); else inline."""
        nbytes = batch_nbytes(batch)
        # The pool's headroom (alignment, a batch a little larger next time), as it sizes its own.
        size = _shm.page_round(max(math.ceil(nbytes * _shm.GROWTH), _shm.MIN_SLOT_BYTES))
        if nbytes < INLINE_MAX_BYTES or not _shm.shm_available():
            return inline(batch)
        if 4 * size > _shm.free_bytes():
            return inline(batch)
        try:
            _, mapping = _shm.create_segment(size, _shm.SHM_DIR, name)
        except (OSError, SharedMemoryError):
            return inline(batch)
        encoded = _shm.SlotWriter(_shm.as_bytes(mapping, size)).encode(
            batch, inline_below=INLINE_MAX_BYTES
        )
        if encoded.inline:  # cannot happen for a batch sized as this: but never lose it
            _shm.unlink(name)
            return Parcel(to_wire(encoded.tree), False, max(nbytes, encoded.needed_bytes))
        return Parcel(encoded.tree, True, nbytes, own_slot=_shm.Slot(name, size))


_log = logging.getLogger("aioloader.shm")


class Receiver:
    """Main side: a slot for each job, and the worker's parcel opened into the batch.

    Args:
        slots: the shared-memory slot pool, or None to send every batch inline.
        prefetch: batches in flight at once: /dev/shm is checked up front for that many slots.
    """

    def __init__(self, slots: _shm.SlotPool | None, prefetch: int) -> None:
        self._slots = slots
        self._prefetch = prefetch
        self._batch_bytes = 0  # the largest batch seen: leases are sized from it
        self._checked_bytes = 0  # the batch size /dev/shm was last checked for
        self.fallbacks = 0  # batches sent inline because no segment could be had
        self._said: set[str] = set()  # the kinds of reason logged already (once each)

    async def lease(self) -> _shm.Slot | OwnSlot | None:
        """A slot for the next batch; None sends it inline. Reuse is instant; creating a
        segment reserves and maps its pages, so it runs in a thread, off the loop. Before any
        batch came back (its size unknown), the worker makes the segment (:class:`OwnSlot`)."""
        size = self._batch_bytes
        if self._slots is not None and size == 0 and not self.fallbacks:
            return OwnSlot(_shm.new_name())
        if self._slots is None or size < INLINE_MAX_BYTES:
            return None
        slot = self._slots.reuse(size)
        if slot is not None:
            return slot
        if size > self._checked_bytes:  # warn up front if prefetch x batch will not fit
            self._checked_bytes = size
            self._slots.preflight(size, self._prefetch + 1)
        try:
            return await asyncio.to_thread(self._slots.lease, size)
        except SharedMemoryError as exc:
            # /dev/shm filled up (another process, another rank's loader) or descriptors ran
            # out: the batch still travels, inline, slower but whole. Said once, then counted.
            self._fell_back("lease", str(exc))
            return None

    def _fell_back(self, kind: str, why: str) -> None:
        """Count a batch sent inline for want of a slot; log the first of each ``kind`` of
        reason (no room, a vanished segment, no descriptor in a worker), with the reason."""
        self.fallbacks += 1
        if kind not in self._said:
            self._said.add(kind)
            _log.warning("batches travel inline (pickled) instead: %s", why)

    def releaser(self, slot: _shm.Slot | OwnSlot | None) -> Callable[[], None] | None:
        """What gives ``slot`` back to the pool, to call once no worker can write into it
        (for an :class:`OwnSlot`: what unlinks the segment the worker may have made)."""
        if isinstance(slot, OwnSlot):
            return functools.partial(_shm.discard, slot.name)
        if slot is None or self._slots is None:
            return None
        return functools.partial(self._slots.release, slot)

    def open(self, made: Made, leased: _shm.Slot | OwnSlot | None) -> Made:
        """``made`` with its parcel opened: views of its slot, or the inline batch (then the
        slot, if one was leased, goes back to the pool). If this raises, the slot is free."""
        parcel: Parcel = made.batch
        self._batch_bytes = max(self._batch_bytes, parcel.nbytes)
        slot = leased if isinstance(leased, _shm.Slot) else None
        if parcel.own_slot is not None:
            if self._slots is None:  # pragma: no cover - an OwnSlot is sent only with a pool
                _shm.unlink(parcel.own_slot.name)
                raise RuntimeError("a worker's segment came back to a loader without a pool")
            slot = self._slots.adopt(parcel.own_slot.name, parcel.own_slot.size)
        if parcel.slot_error and self._slots is not None and not self._slots.closed:
            # The worker could not map the slot (after close: the pool unlinked it itself).
            self._fell_back("vanished" if parcel.slot_vanished else "attach", parcel.slot_error)
            if parcel.slot_vanished and slot is not None and self._slots is not None:
                self._slots.forget(slot)  # never lease a segment that no worker can map
                slot = None
        if parcel.in_slot:
            assert slot is not None
            assert self._slots is not None
            try:
                made.batch = self._slots.open(slot, parcel.tree)
            except BaseException:
                self._slots.release(slot)  # a failed open leaves the slot leased
                raise
            return made
        if slot is not None and self._slots is not None:
            self._slots.release(slot)
        made.batch = from_wire(parcel.tree)
        return made


# -- inline batches --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _WireTensor:
    """A CPU tensor travelling inline as its numpy array (see the module's sharp edges)."""

    array: Any

    def restore(self) -> Any:
        import torch

        return torch.from_numpy(self.array)


# torch dtypes numpy has no equivalent for: such tensors travel as tensors.
_NO_NUMPY = {"torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.complex32"}


def to_wire(batch: Any) -> Any:
    """``batch`` with its plain CPU tensors as numpy arrays, so that it pickles by value."""
    torch = sys.modules.get("torch")  # a batch can hold tensors only once torch is imported
    if torch is None:
        return batch

    def leaf(x: Any) -> Any:
        if (
            isinstance(x, torch.Tensor)
            and x.device.type == "cpu"
            and x.layout == torch.strided
            and not x.requires_grad
            and str(x.dtype) not in _NO_NUMPY
        ):
            return _WireTensor(x.numpy())
        return x

    return map_tree(batch, leaf)


def from_wire(batch: Any) -> Any:
    """Undo :func:`to_wire` (in the main process): tensors over the received arrays."""
    return map_tree(batch, lambda x: x.restore() if isinstance(x, _WireTensor) else x)


def batch_nbytes(batch: Any) -> int:
    """Bytes of the numpy arrays and tensors in a (nested) batch."""
    torch = sys.modules.get("torch")  # a batch can hold tensors only once torch is imported
    total = 0
    for leaf in iter_leaves(batch):
        if isinstance(leaf, np.ndarray):
            total += int(leaf.nbytes)
        elif torch is not None and isinstance(leaf, torch.Tensor):
            total += int(leaf.element_size() * leaf.nelement())
    return total
