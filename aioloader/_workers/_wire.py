"""What goes to a worker and how its batch comes back: the wire format of one job.

Three job records go out (pickled over the worker's request pipe, with the function to run):

- :class:`LoadJob`: the dataset copy (and the callables) a worker makes its batches with from
  now on, sent before the first batch job of each epoch that renews it;
- :class:`MapJob`: a map-style :class:`~aioloader._types.BatchRequest` and the slot, if any,
  the batch should be collated into; with samples the loop fetched (async datasets, tar
  shards), their large ``bytes`` may travel in a second slot, ``raw_slot`` (see below);
- :class:`StreamJob`: a :class:`~aioloader._types.StreamRequest` (the next batch of this
  worker's stream) and likewise a slot.

One record comes back: :class:`~aioloader._types.Made`, whose ``batch`` is a :class:`Parcel`
on the way (the batch in wire form) and the real batch once :meth:`Receiver.open` has opened it
in the main process. Nothing else is built from it and nothing is patched into it on the way.

Shared memory or inline is decided here and nowhere else, on both sides of the pipe::

    main: Receiver.lease()     the largest batch seen so far (or the fetched samples' bytes) is
                               >= INLINE_MAX_BYTES and a slot pool exists ─▶ a slot (reused at
                               once, or created in a thread); no batch seen yet (and no fetched
                               bytes to send) ─▶ an OwnSlot: the worker makes the segment of a
                               large batch under a name from here, the pool adopts it (the
                               first batches of a loader need not travel pickled); otherwise
                               None: inline
    worker: Packer(slot)       collate straight into the slot (Packer.alloc), then pack():
                               no slot, a tiny batch, or one that did not fit ─▶ inline
                               (with the bytes a slot would need, so the next lease fits);
                               a slot it cannot map (removed from /dev/shm, no descriptor
                               left) ─▶ inline, with the reason;
                               else ─▶ the descriptor tree of the arrays in the slot
    main: Receiver.open()      in the slot ─▶ zero-copy views (the slot goes with them);
                               inline ─▶ the slot goes back to the pool (forgotten if it
                               was removed), tensors are rebuilt

The samples the event loop fetched for a map job travel the other way, main to worker, in the
same slot (:class:`Sender`): an item that is ``bytes`` (or a plain ``dict`` whose values are),
of at least :data:`RAW_SLOT_MIN_BYTES` each and :data:`INLINE_MAX_BYTES` in all, is copied once
into the job's slot (leased for the larger of the two) and replaced in the pickled request by a
:class:`RawRef`; the worker copies each back out into ``bytes`` of its own (:func:`unpack_raw`)
before anything sees it, so ``decode`` gets exactly the types it would have got inline, and
then collates the batch into the same slot. Pickling the same bytes instead costs a copy into
the pickle, the kernel's two copies through a 64 KiB pipe (dozens of wake-ups of both processes
per batch of megabytes) and a copy out of the pickle; a second slot would cost a second
segment's pages in every process. No slot to be had (no pool, the cap, a full ``/dev/shm``)
sends the request inline; a worker that cannot map the slot answers :class:`RawSlotError` and
the request is sent again inline (``ProcessRunner``).

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
import dataclasses
import functools
import logging
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .. import _shm
from .._batch import Alloc
from .._errors import SharedMemoryError
from .._tree import iter_leaves, map_tree
from .._types import BatchRequest, Made, StreamRequest
from ._payload import Payload

__all__ = [
    "COPY_TAG_SPAN",
    "INLINE_MAX_BYTES",
    "RAW_SLOT_MIN_BYTES",
    "LoadJob",
    "MapJob",
    "Packer",
    "Parcel",
    "RawPlan",
    "RawRef",
    "RawSlotError",
    "Receiver",
    "Sender",
    "StreamJob",
    "batch_nbytes",
    "from_wire",
    "inline",
    "running_tag",
    "to_wire",
    "unpack_raw",
]

# Batches with fewer array bytes than this travel inline, never in a slot: for them a slot
# costs more (a lease, a mapping, a finalizer) than the pickle copy it saves.
INLINE_MAX_BYTES = _shm.INLINE_MAX_BYTES

_log = logging.getLogger("aioloader.shm")

# A worker publishes the job it runs as one int64 (see :func:`running_tag`): the batch id below
# this span, the dataset copy's id above it. Batch ids stay below 2**40 and copy ids (one per
# loader on a shared pool) below 2**23, so a tag fits, and copy 0's tag is ``batch_id + 1``.
COPY_TAG_SPAN = 1 << 40


def running_tag(copy_id: int, batch_id: int) -> int:
    """What a worker publishes while it runs ``batch_id`` of dataset copy ``copy_id`` (0 while
    it runs nothing): two loaders sharing the workers number their batches alike, and a crash
    or a deadline must name the right one."""
    return copy_id * COPY_TAG_SPAN + batch_id + 1


# -- out: the jobs -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadJob:
    """Make batches from now on with the dataset copy in ``payload``, made for ``epoch``.

    Attributes:
        payload: ``(BatchMaker, worker_init_fn)`` pickled by :func:`._payload.dumps_copy`.
        epoch: the epoch it was made for (the worker's seed derives from it).
        copy_id: which of the worker's copies it replaces: 0 for a loader's own workers, one
            id per loader on a shared pool (each keeps its copy beside the others').
        seed: the loader's seed, when it is not the one the worker started with (a shared
            pool's workers serve loaders of different seeds).
        per_batch_seeds: likewise, ``worker_seeding='batch'``.
    """

    payload: Payload
    epoch: int
    copy_id: int = 0
    seed: int | None = None
    per_batch_seeds: bool | None = None


# A fetched item's bytes travel in the job's raw slot from this size on. Smaller ones are
# pickled with the request: for them, a descriptor and a copy out of the slot cost about what
# the pickle copy does.
RAW_SLOT_MIN_BYTES = 4 << 10


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
    one is given; with ``raw_in_slot``, the :class:`RawRef` in ``request.raw`` point into
    ``slot``, to be copied out before the batch is collated there."""

    request: BatchRequest
    slot: _shm.Slot | OwnSlot | None
    raw_in_slot: bool = False
    copy_id: int = 0


@dataclass(frozen=True, slots=True)
class StreamJob:
    """Make the next batch of this worker's stream of dataset copy ``copy_id`` for
    ``request``, into ``slot`` if given."""

    request: StreamRequest
    slot: _shm.Slot | OwnSlot | None
    copy_id: int = 0


# -- out: fetched bytes through a slot ------------------------------------------------------


class RawRef(NamedTuple):
    """In place of a fetched item's bytes: where they lie in the job's slot, and whether they
    were a ``bytearray`` (else ``bytes``). A tuple: thousands a second are pickled, and a
    slotted dataclass pickles through ``dataclasses.fields``, ten times slower."""

    offset: int
    size: int
    mutable: bool = False


class RawSlotError(Exception):
    """A worker could not map a job's raw slot (``vanished``: its segment is gone); the main
    process sends the request again inline."""

    def __init__(self, reason: str, vanished: bool) -> None:
        super().__init__(reason, vanished)
        self.reason = reason
        self.vanished = vanished

    def __str__(self) -> str:
        return f"the raw samples' slot cannot be mapped: {self.reason}"


_BYTES = (bytes, bytearray)


def _raw_parts(raw: Sequence[Any]) -> list[tuple[int, Any, Any]]:
    """``(item position, dict key or None, bytes)`` of each large bytes value of ``raw``."""
    parts: list[tuple[int, Any, Any]] = []
    least = RAW_SLOT_MIN_BYTES
    for position, item in enumerate(raw):
        kind = type(item)
        if kind is dict:
            for key, value in item.items():
                if type(value) in _BYTES and len(value) >= least:
                    parts.append((position, key, value))
        elif kind in _BYTES and len(item) >= least:
            parts.append((position, None, item))
    return parts


@dataclass(frozen=True, slots=True)
class RawPlan:
    """Where the large bytes of ``request``'s samples go in a slot: ``parts`` are ``(item
    position, dict key or None, bytes)``, at ``offsets``; ``nbytes`` in all."""

    request: BatchRequest
    parts: list[tuple[int, Any, Any]]
    offsets: list[int]
    nbytes: int


class Sender:
    """Main side: the large bytes of a map job's fetched samples into the job's slot (see the
    module docstring). One per runner; the slot is the one the batch comes back in.

    Args:
        slots: the shared-memory slot pool, or None to send every request inline.
    """

    def __init__(self, slots: _shm.SlotPool | None) -> None:
        self._slots = slots
        self.fallbacks = 0  # requests sent again inline: a worker could not map their slot
        self._said = False

    def plan(self, request: BatchRequest) -> RawPlan | None:
        """Where ``request``'s large bytes would lie in a slot; None if they travel inline
        (no pool, or too few bytes to be worth a slot)."""
        if self._slots is None or request.raw is None or request.sharded:
            return None
        parts = _raw_parts(request.raw)
        align = _shm.ALIGN
        offsets, total = [], 0
        for _position, _key, data in parts:
            offsets.append(total)
            total += (len(data) + align - 1) // align * align
        if total < INLINE_MAX_BYTES:
            return None
        return RawPlan(request, parts, offsets, total)

    def fill(self, plan: RawPlan, slot: _shm.Slot) -> BatchRequest:
        """Copy the planned bytes into ``slot`` (leased, at least ``plan.nbytes``); returns
        the request to send, with :class:`RawRef` in their place. The caller's samples are
        not changed."""
        assert self._slots is not None
        parts, offsets = plan.parts, plan.offsets
        self._slots.write(slot, [(at, part[2]) for at, part in zip(offsets, parts, strict=True)])
        raw = list(plan.request.raw or ())
        copied: set[int] = set()
        for offset, (position, key, data) in zip(offsets, parts, strict=True):
            ref = RawRef(offset, len(data), type(data) is bytearray)
            if key is None:
                raw[position] = ref
                continue
            if position not in copied:  # a shallow copy: the caller's sample stays as it was
                copied.add(position)
                raw[position] = dict(raw[position])
            raw[position][key] = ref
        return dataclasses.replace(plan.request, raw=raw)

    def lost(self, slot: _shm.Slot, error: RawSlotError) -> None:
        """The worker could not map ``slot`` (``error``): never lease it again if its segment
        vanished, else give it back; the caller sends the request again inline."""
        assert self._slots is not None
        if error.vanished:
            self._slots.forget(slot)
        else:
            self._slots.release(slot)
        self.fallbacks += 1
        if not self._said:
            self._said = True
            _log.warning("fetched samples travel to the workers pickled instead: %s", error)


def unpack_raw(request: BatchRequest, slot: _shm.Slot) -> BatchRequest:
    """Worker side: ``request`` with each :class:`RawRef` replaced by a copy of its bytes.

    Raises:
        RawSlotError: the slot cannot be mapped here (removed from ``/dev/shm``, or no file
            descriptor left).
    """
    try:
        buffer = _shm.attach(slot)
    except FileNotFoundError as exc:
        raise RawSlotError(str(exc), True) from None
    except SharedMemoryError as exc:
        raise RawSlotError(str(exc), False) from None
    with buffer.data as view:

        def copy(ref: RawRef) -> Any:
            data = view[ref.offset : ref.offset + ref.size]
            return bytearray(data) if ref.mutable else data.tobytes()

        raw: list[Any] = []
        assert request.raw is not None
        for item in request.raw:
            if isinstance(item, RawRef):
                item = copy(item)
            elif type(item) is dict and any(isinstance(v, RawRef) for v in item.values()):
                item = {k: copy(v) if isinstance(v, RawRef) else v for k, v in item.items()}
            raw.append(item)
    return dataclasses.replace(request, raw=raw)


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
        except SharedMemoryError as exc:  # /dev/shm full, or no descriptor: said and counted
            parcel = inline(batch)
            return Parcel(parcel.tree, False, parcel.nbytes, slot_error=str(exc))
        except OSError:  # the name taken: by this job's earlier try, in a worker that died
            return inline(batch)
        encoded = _shm.SlotWriter(_shm.as_bytes(mapping, size)).encode(
            batch, inline_below=INLINE_MAX_BYTES
        )
        if encoded.inline:  # cannot happen for a batch sized as this: but never lose it
            _shm.unlink(name)
            return Parcel(to_wire(encoded.tree), False, max(nbytes, encoded.needed_bytes))
        return Parcel(encoded.tree, True, nbytes, own_slot=_shm.Slot(name, size))


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

    async def lease(self, at_least: int = 0) -> _shm.Slot | OwnSlot | None:
        """A slot for the next batch (and for ``at_least`` bytes of fetched samples on their
        way to the worker); None sends it inline. Reuse is instant; creating a segment
        reserves and maps its pages, so it runs in a thread, off the loop. If the caller is
        cancelled meanwhile, the slot the thread leases goes back to the pool when it comes.
        Before any batch came back (its size unknown) and with nothing to send, the worker
        makes the segment (:class:`OwnSlot`)."""
        unknown = self._batch_bytes == 0 and not at_least
        if self._slots is not None and unknown and not self.fallbacks:
            return OwnSlot(_shm.new_name())
        size = max(self._batch_bytes, at_least)
        if self._slots is None or size < INLINE_MAX_BYTES:
            return None
        slot = self._slots.reuse(size)
        if slot is not None:
            return slot
        if size > self._checked_bytes:  # warn up front if prefetch x batch will not fit
            self._checked_bytes = size
            self._slots.preflight(size, self._prefetch + 1)
        leasing = asyncio.ensure_future(asyncio.to_thread(self._slots.lease, size))
        try:
            return await asyncio.shield(leasing)
        except asyncio.CancelledError:
            leasing.add_done_callback(self._give_back)
            raise
        except SharedMemoryError as exc:
            # /dev/shm filled up (another process, another rank's loader) or descriptors ran
            # out: the batch still travels, inline, slower but whole. Said once, then counted.
            self._fell_back("lease", str(exc))
            return None

    def _give_back(self, leasing: asyncio.Future[_shm.Slot | None]) -> None:
        if self._slots is None or leasing.cancelled() or leasing.exception() is not None:
            return
        slot = leasing.result()
        if slot is not None:
            self._slots.release(slot)

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
        if isinstance(leased, OwnSlot) and parcel.own_slot is None:
            # Inline after all; a worker that made the segment and died (the job ran again
            # elsewhere, which found the name taken) left it behind.
            _shm.discard(leased.name)
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
