"""How a batch comes back from a worker: shared memory or inline, packed in the worker and
opened in the main process.

The jobs a worker gets and the :class:`._records.Parcel` it answers with are records
(:mod:`._records`); this module fills and opens the parcel. One record comes back:
:class:`~aioloader._types.Made`, whose ``batch`` is a parcel on the way (the batch in wire
form) and the real batch once :meth:`Receiver.open` has opened it in the main process. Nothing
else is built from it and nothing is patched into it on the way.

Shared memory or inline is decided here and nowhere else, on both sides of the pipe::

    main: Receiver.lease()     the largest batch seen so far (or the fetched samples' bytes) is
                               >= INLINE_MAX_BYTES and a slot pool exists ─▶ a slot (reused at
                               once, or created in a thread; none under the cap ─▶ inline,
                               counted); no batch seen yet (and no fetched bytes to send) ─▶
                               an OwnSlot: the worker makes the segment of a large batch under
                               a name from here, within 1/(prefetch + 1) of the cap reserved
                               in the pool, which adopts it (the first batches of a loader
                               need not travel pickled, and stay under the cap); otherwise
                               None: inline
    worker: Packer(slot)       collate straight into the slot (Packer.alloc; for an OwnSlot,
                               into the segment made at the batch's first large alloc, so the
                               first batches are no more copied nor held twice than the
                               rest; pack() cuts it to the batch's size, and nothing may touch
                               the worker's mapping past that), then pack():
                               no slot, a tiny batch, or one that did not fit ─▶ inline
                               (with the bytes a slot would need, so the next lease fits);
                               a slot it cannot map (removed from /dev/shm, no descriptor
                               left) ─▶ inline, with the reason;
                               else ─▶ the descriptor tree of the arrays in the slot
    main: Receiver.open()      in the slot ─▶ zero-copy views (the slot goes with them);
                               inline ─▶ the slot goes back to the pool (forgotten if it
                               was removed), tensors are rebuilt

The samples the event loop fetched for a map job travel the other way, main to worker, in the
same slot (:class:`._raw.Sender`): an item that is ``bytes`` (or a plain ``dict`` whose values
are), of at least :data:`._raw.RAW_SLOT_MIN_BYTES` each and :data:`INLINE_MAX_BYTES` in all, is
copied once into the job's slot (leased for the larger of the two) and replaced in the pickled
request by a :class:`._records.RawRef`; the worker copies each back out into ``bytes`` of its
own (:func:`._raw.unpack_raw`) before anything sees it, so ``decode`` gets exactly the types it
would have got inline, and then collates the batch into the same slot. Pickling the same bytes
instead costs a copy into the pickle, the kernel's two copies through a 64 KiB pipe (dozens of
wake-ups of both processes per batch of megabytes) and a copy out of the pickle; a second slot
would cost a second segment's pages in every process. No slot to be had (no pool, the cap, a
full ``/dev/shm``) sends the request inline; a worker that cannot map the slot answers
:class:`._records.RawSlotError` and the request is sent again inline (``ProcessRunner``).

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
import contextlib
import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _shm
from .._errors import SharedMemoryError
from .._threads import off_loop
from .._tree import iter_leaves, map_tree
from .._types import Alloc, Made
from ._records import OwnSlot, Parcel, WireTensor

__all__ = [
    "INLINE_MAX_BYTES",
    "Packer",
    "Receiver",
    "SegmentUnreadable",
    "batch_nbytes",
    "from_wire",
    "inline",
    "sweep_unclaimed",
    "to_wire",
]


class SegmentUnreadable(SharedMemoryError):
    """The segment a worker made for a batch could not be mapped in the main process
    (:meth:`Receiver.open`): counted as a fallback; the batch is made again, inline, where
    it can be (a map-style batch), else it fails with this error (a stream's: its items
    cannot be read again)."""


# Batches with fewer array bytes than this travel inline, never in a slot: for them a slot
# costs more (a lease, a mapping, a finalizer) than the pickle copy it saves.
INLINE_MAX_BYTES = _shm.INLINE_MAX_BYTES

#: Room left beside the first large array of a batch in the segment a worker makes for an
#: :class:`OwnSlot` (:meth:`Packer.alloc`): what a batch's small leaves (labels, lengths)
#: collated after it need. A batch that needs more is copied into a segment made to its size.
OWN_PAD_BYTES = 64 << 10

#: How long a lease that finds no free slot waits for a held batch's slot to come back before
#: it makes another segment (:meth:`Receiver.lease`, :meth:`_shm.SlotPool.watch`). A ``for``
#: loop drops its last batch as soon as its thread runs after the loop's thread handed it the
#: next (microseconds; 5 ms waits missed a few times an epoch with every core busy). A
#: consumer that keeps its batches makes the waits then in progress miss (one per batch in
#: flight at most), after which no lease waits until a free slot is found again. The job
#: waits with its lease, usually behind another on its worker.
RETURN_WAIT_S = 0.02

_log = logging.getLogger("aioloader.shm")


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


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

    __slots__ = ("_error", "_kind", "_own", "_own_tried", "_plain_bytes", "_vanished", "_writer")

    def __init__(self, slot: _shm.Slot | OwnSlot | None) -> None:
        self._writer: _shm.SlotWriter | None = None
        self._error = ""
        self._kind = ""  # the fallback kind of the error, if not "vanished" / "attach"
        self._vanished = False
        self._own = slot if isinstance(slot, OwnSlot) else None
        self._own_tried = False  # an OwnSlot's segment was tried for (at most once a job)
        self._plain_bytes = 0  # what allocs before that segment got in plain memory
        if slot is None or isinstance(slot, OwnSlot):
            return
        try:
            self._writer = _shm.SlotWriter(_shm.attach(slot))
        except FileNotFoundError as exc:
            self._error, self._vanished = str(exc), True
        except SharedMemoryError as exc:  # no descriptor left
            self._error = str(exc)
        except OSError as exc:  # not ours to open (another user's segment)
            self._error, self._kind = f"{type(exc).__name__}: {exc}", "denied"

    @property
    def alloc(self) -> Alloc | None:
        """Where a collate function that can should place its arrays (None: anywhere)."""
        if self._writer is not None:
            return self._writer.alloc
        return self._own_alloc if self._own is not None and not self._error else None

    def _own_alloc(self, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray[Any, Any]:
        """An OwnSlot's alloc: the segment is made at the first allocation of
        :data:`INLINE_MAX_BYTES` or more, sized for it and :data:`OWN_PAD_BYTES` beside (the
        labels and such collated after it; :meth:`pack` cuts it to the batch's size), so the
        batch is collated straight into it as into a pool's slot; smaller ones before it get
        plain memory (copied in by :meth:`pack`).
        Where no segment may be made (its share of the cap, /dev/shm's room), every one gets
        plain memory and :meth:`pack` says why the batch comes inline."""
        if self._writer is not None:
            return self._writer.alloc(shape, dtype)
        shape, dt, nbytes = _shm.alloc_args(shape, dtype)
        if not _shm.storable_dtype(dt):  # pickled with the batch, wherever it is made
            return np.empty(shape, dt)
        if nbytes >= INLINE_MAX_BYTES and not self._own_tried:
            self._writer = self._make_own(nbytes)
            if self._writer is not None:
                return self._writer.alloc(shape, dt)
        self._plain_bytes += nbytes + _shm.ALIGN
        return np.empty(shape, dt)

    def _make_own(self, nbytes: int) -> _shm.SlotWriter | None:
        assert self._own is not None
        size = _shm.slot_size(nbytes + self._plain_bytes + OWN_PAD_BYTES)
        self._own_tried = True
        if size > self._own.limit or not _shm.shm_available() or 4 * size > _shm.free_bytes():
            return None  # pack() makes the batch's segment, or says why it cannot
        try:
            _, mapping = _shm.create_segment(size, _shm.SHM_DIR, self._own.name)
        except (OSError, SharedMemoryError):  # pack() tries again, and says why it cannot
            return None
        return _shm.SlotWriter(_shm.as_bytes(mapping, size))

    def pack(self, batch: Any) -> Parcel:
        """The parcel of ``batch``: in the slot if there is one and the batch fits and is not
        tiny; inline otherwise."""
        if self._writer is None:
            if self._error:
                parcel = inline(batch)
                return Parcel(
                    parcel.tree, False, parcel.nbytes, self._error, self._vanished, None, self._kind
                )
            if self._own is not None:
                return self._in_own_slot(batch, self._own)
            return inline(batch)
        if self._own is not None:
            return self._packed_own(batch, self._own, self._writer)
        nbytes = batch_nbytes(batch)
        size = self._writer.size
        encoded = self._writer.encode(batch, inline_below=INLINE_MAX_BYTES)
        if encoded.inline:  # tiny, or did not fit: inline now, a big enough slot next time
            return _not_in_slot(encoded, nbytes, size)
        return Parcel(encoded.tree, True, nbytes)

    def _packed_own(self, batch: Any, own: OwnSlot, writer: _shm.SlotWriter) -> Parcel:
        """``batch``, collated (in part) into the segment made at its first large alloc: its
        parcel names the segment if the whole batch fits there; else the segment goes and the
        batch is packed as if it had none (into one made for it, or inline)."""
        nbytes = batch_nbytes(batch)
        encoded = writer.encode(batch, inline_below=INLINE_MAX_BYTES)
        if not encoded.inline:
            # Cut to the batch's own size, as a segment made after collation was: the pool
            # keeps it as a slot, and a slot is its batch's size.
            size = _shm.slot_size(encoded.used_bytes)
            if size >= writer.size or not _shm.shrink(own.name, size):
                size = writer.size
            return Parcel(encoded.tree, True, nbytes, own_slot=_shm.Slot(own.name, size))
        # Tiny after all, or larger than the segment: what was in it has been copied out.
        self._writer = None
        _shm.unlink(own.name)
        return self._in_own_slot(encoded.tree, own)

    @staticmethod
    def _in_own_slot(batch: Any, own: OwnSlot) -> Parcel:
        """``batch`` in a segment made for it here (:class:`OwnSlot`), if it is not tiny, the
        segment fits the pool's reservation and ``/dev/shm`` has room to spare (four times
        the segment); else inline, saying why."""
        nbytes = batch_nbytes(batch)
        if nbytes < INLINE_MAX_BYTES or not _shm.shm_available():
            return inline(batch)
        size = _shm.slot_size(nbytes)  # as the pool sizes a first slot: the batch, no headroom
        name = own.name
        why, kind = "", ""
        if size > own.limit:
            share = f"its share, {own.limit} bytes," if own.limit else "no room left"
            why = f"a batch of {nbytes} bytes finds {share} under the cap (shm_max_bytes)"
            kind = "cap"
        elif 4 * size > (free := _shm.free_bytes()):
            why = f"/dev/shm has {free} bytes free, too few for a segment of {size} bytes"
            kind = "room"
        if why:
            parcel = inline(batch)
            return Parcel(parcel.tree, False, parcel.nbytes, slot_error=why, fallback=kind)
        try:
            _, mapping = _shm.create_segment(size, _shm.SHM_DIR, name)
        except SharedMemoryError as exc:  # /dev/shm full, or no descriptor: said and counted
            parcel = inline(batch)
            return Parcel(parcel.tree, False, parcel.nbytes, slot_error=str(exc))
        except FileExistsError:  # the name taken: by this job's earlier try, in a worker that died
            return inline(batch)
        except OSError as exc:  # mapping it failed (no address space left): said and counted
            parcel = inline(batch)
            why = f"no segment of {size} bytes could be made: {type(exc).__name__}: {exc}"
            return Parcel(parcel.tree, False, parcel.nbytes, slot_error=why, fallback="lease")
        encoded = _shm.SlotWriter(_shm.as_bytes(mapping, size)).encode(
            batch, inline_below=INLINE_MAX_BYTES
        )
        if encoded.inline:  # sized for it, so it cannot happen: but never lose it, say it
            _shm.unlink(name)
            return _not_in_slot(encoded, nbytes, size)
        return Parcel(encoded.tree, True, nbytes, own_slot=_shm.Slot(name, size))


def _not_in_slot(encoded: _shm.Encoded, nbytes: int, size: int) -> Parcel:
    """The parcel of a batch the slot writer sent inline: tiny, or larger than its slot of
    ``size`` bytes, which is a fallback, said and counted (the next slot is made for it)."""
    needed = max(nbytes, encoded.needed_bytes)
    if encoded.needed_bytes <= size:  # tiny
        return Parcel(to_wire(encoded.tree), False, needed)
    why = f"a batch of {encoded.needed_bytes} bytes did not fit its slot of {size} bytes"
    return Parcel(to_wire(encoded.tree), False, needed, slot_error=why, fallback="fit")


#: Reasons a batch finds no slot that a ``route`` other than inline takes in its stride: the
#: cap, /dev/shm's room, a segment that could not be made, a batch larger than its slot. (A
#: vanished segment or a worker that cannot map one stays a WARNING.)
_ROUTINE = frozenset({"cap", "room", "lease", "fit", "none"})


class Receiver:
    """Main side: a slot for each job, and the worker's parcel opened into the batch.

    Args:
        slots: the shared-memory slot pool, or None to send every batch inline.
        prefetch: batches in flight at once: /dev/shm is checked up front for that many slots,
            and before the batch size is known each job may reserve ``1 / (prefetch + 1)`` of
            the pool's cap for the segment its worker makes.
        no_room: ``slots`` is None because ``/dev/shm`` had no room for a pool (not by the
            user's choice): every batch too large to travel inline is then a fallback.
        unclaimed: where each :class:`OwnSlot`'s name is kept from its lease until its batch
            is opened; whoever stops the workers unlinks what is left there (a worker may
            have made the segment of a job whose parcel nobody read).
        route: how a batch travels without a slot, if not inline: ``"Ray's object store"``
            for Ray actors, whose batches go there as a matter of course. No warning is given
            up front, a batch that finds no slot under the cap or in ``/dev/shm`` is said at
            INFO, naming the route; a vanished segment or a worker that cannot map one is
            still a WARNING (the first of them).
    """

    def __init__(
        self,
        slots: _shm.SlotPool | None,
        prefetch: int,
        *,
        no_room: bool = False,
        unclaimed: set[str] | None = None,
        route: str | None = None,
    ) -> None:
        self._slots = slots
        self._route = route
        self._prefetch = prefetch
        self._no_room = no_room
        self._batch_bytes = 0  # the largest batch seen: leases are sized from it
        self._checked_bytes = 0  # the batch size /dev/shm was last checked for
        self.fallbacks = 0  # batches sent inline because no segment could be had
        self._said: set[str] = set()  # the kinds of reason logged already (once each)
        # What each OwnSlot out now holds of the pool's cap, by name: given back once, when
        # its batch is opened or its job is given up.
        self._reserved: dict[str, int] = {}
        self._unclaimed: set[str] = set() if unclaimed is None else unclaimed
        # Leases that waited RETURN_WAIT_S for nothing (read by tests; a miss only delays one
        # job, and the slot it then makes is counted in the statistics' shm_slots).
        self.return_waits_missed = 0
        self._wait_for_returns = True  # cleared by a miss, set again by a free slot found

    @property
    def sized(self) -> bool:
        """Whether a batch came back already: leases are sized from the largest so far (before
        that, :meth:`lease` gives an :class:`OwnSlot`)."""
        return self._batch_bytes > 0

    def saw(self, nbytes: int) -> None:
        """A batch needing ``nbytes`` in a slot came back another way than :meth:`open` (Ray's
        object store): later leases are sized for it."""
        self._batch_bytes = max(self._batch_bytes, nbytes)

    async def lease(self, at_least: int = 0) -> _shm.Slot | OwnSlot | None:
        """A slot for the next batch (and for ``at_least`` bytes of fetched samples on their
        way to the worker); None sends it inline. Reuse is instant; creating a segment
        reserves and maps its pages, so it runs in a thread, off the loop. If the caller is
        cancelled meanwhile, the slot the thread leases goes back to the pool when it comes.
        Before any batch came back (its size unknown) and with nothing to send, the worker
        makes the segment (:class:`OwnSlot`)."""
        unknown = self._batch_bytes == 0 and not at_least
        if self._slots is not None and unknown and not self.fallbacks:
            # A share of the cap, as the prefetched batches will share it once their size is
            # known; the worker makes a segment within it, or says why the batch came inline.
            name = _shm.new_name()
            limit = self._slots.reserve(self._slots.max_bytes // (self._prefetch + 1))
            if limit:
                self._reserved[name] = limit
            self._unclaimed.add(name)
            return OwnSlot(name, limit)
        size = max(self._batch_bytes, at_least)
        if self._slots is None or size < INLINE_MAX_BYTES:
            return None
        slot = await self._returning(self._slots, size)
        if slot is not None:
            return slot
        if size > self._checked_bytes and self._route is None:
            # Warn up front if prefetch x batch will not fit (they would travel pickled).
            self._checked_bytes = size
            self._slots.preflight(size, self._prefetch + 1)
        leasing = asyncio.ensure_future(off_loop(self._slots.lease, size))
        try:
            slot = await asyncio.shield(leasing)
        except asyncio.CancelledError:
            leasing.add_done_callback(self._give_back)
            raise
        except SharedMemoryError as exc:
            # /dev/shm filled up (another process, another rank's loader) or descriptors ran
            # out: the batch still travels, inline, slower but whole. Said once, then counted.
            self._fell_back("lease", str(exc))
            return None
        if slot is None:  # the slots alive leave no room under the cap for one this size
            self._fell_back(
                "cap",
                f"a batch of {size} bytes does not fit under the shared-memory cap "
                f"shm_max_bytes={self._slots.max_bytes} beside the batches in flight",
            )
        return slot

    async def _returning(self, slots: _shm.SlotPool, size: int) -> _shm.Slot | None:
        """A free slot of at least ``size``; else, while waits pay, one that a batch held by
        the consumer gives back within :data:`RETURN_WAIT_S`; else None (make one)."""
        if not self._wait_for_returns:
            slot = slots.reuse(size)
            if slot is not None:
                self._wait_for_returns = True  # slots free up again: a wait may pay again
            return slot
        loop = asyncio.get_running_loop()
        returned: asyncio.Future[None] = loop.create_future()

        def wake() -> None:  # a finalizer's thread, or close()'s
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_settle, returned)

        slot, watching = slots.watch(size, wake)
        if not watching:
            return slot
        try:
            # Not wait_for: on 3.11 it returns the result of a future done in the turn the
            # lease is cancelled (a close, a deadline), and the cancelled lease goes on.
            done, _ = await asyncio.wait({returned}, timeout=RETURN_WAIT_S)
        finally:
            slots.unwatch(wake)
        if not done:
            self.return_waits_missed += 1
            self._wait_for_returns = False
        return slots.reuse(size)

    def _give_back(self, leasing: asyncio.Future[_shm.Slot | None]) -> None:
        if self._slots is None or leasing.cancelled() or leasing.exception() is not None:
            return
        slot = leasing.result()
        if slot is not None:
            self._slots.release(slot)

    def _fell_back(self, kind: str, why: str) -> None:
        """Count a batch sent inline for want of a slot. The first one is a WARNING, with its
        reason; the first of each other ``kind`` of reason (the cap, no room, a vanished
        segment, no descriptor in a worker) is logged at INFO: one warning per loader."""
        self.fallbacks += 1
        if kind in self._said:
            return
        if self._route is None:
            # A batch larger than its slot is INFO only: the next slot is made for it.
            level = logging.INFO if self._said - {"fit"} or kind == "fit" else logging.WARNING
            self._said.add(kind)
            _log.log(level, "batches travel inline (pickled) instead: %s", why)
            return
        # The route's usual way for a batch without a slot is INFO; the first other is a
        # WARNING, whatever routine ones came before it.
        level = logging.INFO if kind in _ROUTINE or self._said - _ROUTINE else logging.WARNING
        self._said.add(kind)
        _log.log(level, "batches travel through %s instead of a slot: %s", self._route, why)

    def releaser(self, slot: _shm.Slot | OwnSlot | None) -> Callable[[], None] | None:
        """What gives ``slot`` back to the pool, to call once no worker can write into it
        (for an :class:`OwnSlot`: what unlinks the segment the worker may have made)."""
        if isinstance(slot, OwnSlot):
            return functools.partial(self._drop_own, slot.name)
        if slot is None or self._slots is None:
            return None
        return functools.partial(self._slots.release, slot)

    def _drop_own(self, name: str) -> None:
        """An :class:`OwnSlot`'s job was given up: unlink what its worker may have made, and
        give its reservation back. The name stays unclaimed (a worker may still make it: the
        close's sweep unlinks it then); unlinking twice is harmless (``discard`` tells the
        tracker only of a segment it removed)."""
        _shm.discard(name)
        self._unreserve(name)

    def settled(self, name: str) -> None:
        """The job of :class:`OwnSlot` ``name`` is over and its worker done with it (it
        answered, or died): after its release, the name need not be swept."""
        self._unclaimed.discard(name)

    def _claim(self, name: str) -> bool:
        """Take ``name`` out of the unclaimed names; False if a sweep took it first (that
        sweep unlinks the segment: only one of the two may, or the resource tracker is told
        twice). Safe beside a sweep on another thread (``set.remove`` is one step)."""
        try:
            self._unclaimed.remove(name)
        except KeyError:
            return False
        return True

    def _unreserve(self, name: str) -> int:
        reserved = self._reserved.pop(name, 0)
        if reserved and self._slots is not None:
            self._slots.unreserve(reserved)
        return reserved

    def open(self, made: Made, leased: _shm.Slot | OwnSlot | None) -> Made:
        """``made`` with its parcel opened: views of its slot, or the inline batch (then the
        slot, if one was leased, goes back to the pool). If this raises, the slot is free."""
        parcel: Parcel = made.batch
        self._batch_bytes = max(self._batch_bytes, parcel.nbytes)
        slot = leased if isinstance(leased, _shm.Slot) else None
        # Taken in here (adopted or unlinked below), unless the pool's close swept the name
        # first: the segment is gone then, and so is this batch's pool.
        claimed = isinstance(leased, OwnSlot) and self._claim(leased.name)
        if isinstance(leased, OwnSlot) and parcel.own_slot is None:
            # Inline after all; a worker that made the segment and died (the job ran again
            # elsewhere, which found the name taken) left it behind.
            if claimed:
                _shm.discard(leased.name)
            self._unreserve(leased.name)
        if parcel.own_slot is not None:
            if not claimed:
                self._unreserve(parcel.own_slot.name)
                raise RuntimeError("the worker pool was closed")
            if self._slots is None:  # pragma: no cover - an OwnSlot is sent only with a pool
                _shm.unlink(parcel.own_slot.name)
                raise RuntimeError("a worker's segment came back to a loader without a pool")
            reserved = self._reserved.pop(parcel.own_slot.name, 0)
            try:
                slot = self._slots.adopt(parcel.own_slot.name, parcel.own_slot.size, reserved)
            except (OSError, SharedMemoryError) as exc:  # unlinked by adopt, reservation back
                # The worker made the segment, this process cannot map it (no address space or
                # map left, or it is gone): the batch in it cannot be read here.
                why = f"a first batch's segment made by its worker could not be mapped: {exc}"
                self._fell_back("adopt", why)
                raise SegmentUnreadable(why) from exc
        if parcel.slot_error and self._slots is not None and not self._slots.closed:
            # The worker could not map the slot or make one (after close: the pool unlinked
            # the slot itself).
            kind = parcel.fallback or ("vanished" if parcel.slot_vanished else "attach")
            self._fell_back(kind, parcel.slot_error)
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
        if self._no_room and parcel.nbytes >= INLINE_MAX_BYTES:
            self._fell_back(
                "none",
                f"/dev/shm has {_shm.free_bytes()} bytes free, and had no room for shared "
                "memory when the loader started; enlarge it (docker run --shm-size=...) for "
                "zero-copy batches",
            )
        made.batch = from_wire(parcel.tree)
        return made


# -- inline batches --------------------------------------------------------------------------


# torch dtypes numpy has no equivalent for: such tensors travel as tensors.
_NO_NUMPY = {"torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.complex32"}


def sweep_unclaimed(names: set[str]) -> None:
    """Unlink the segments named in ``names`` (a :class:`Receiver`'s unclaimed names), taking
    each out first, so that a ``Receiver`` on another thread that would take one in or drop it
    finds it gone and leaves it alone. Call it once the workers are stopped."""
    while True:
        try:
            name = names.pop()
        except KeyError:
            return
        try:
            _shm.discard(name)
        except BaseException:  # interrupted (a second Ctrl-C): the next close sweeps it again
            names.add(name)
            raise


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
            return WireTensor(x.numpy())
        return x

    return map_tree(batch, leaf)


def from_wire(batch: Any) -> Any:
    """Undo :func:`to_wire` (in the main process): tensors over the received arrays."""
    return map_tree(batch, lambda x: x.restore() if isinstance(x, WireTensor) else x)


def batch_nbytes(batch: Any) -> int:
    """Bytes a (nested) batch takes in a slot: the leaves a slot writer places there (numpy
    arrays and CPU tensors of dtypes a slot holds, ``bytes`` of
    :data:`aioloader._shm.BYTES_IN_SLOT_MIN` or more: :func:`aioloader._shm.slot_nbytes`),
    each once and at its aligned offset (:func:`aioloader._shm.in_slot_bytes`), so that a slot
    of this size holds it however many leaves it has. Leaves pickled beside the descriptors
    (records, objects, masked arrays) count nothing."""
    sizes, seen = [], set()
    for leaf in iter_leaves(batch):
        if id(leaf) not in seen:
            seen.add(id(leaf))
            sizes.append(_shm.slot_nbytes(leaf))
    return _shm.in_slot_bytes(n for n in sizes if n)
