"""The device ring: device buffers that batches are copied into, reused once nobody reads them.

Allocating each batch's device tensors afresh on the side stream and handing them to the
consumer's stream needs ``record_stream``: the caching allocator then holds a freed block until
the consumer's work *at the time of the free* is done, a point nobody chose, and a block freed
while the consumer runs ahead is held far longer than needed. The ring owns its buffers instead
and reuses a slot only at a point it defines::

    start(batch): take(nbytes) ──▶ slot "copying" (the batch's large leaves are tensors over
        its buffer's storage)
        copy completed (its end event) ──▶ "out": the consumer may hold it
    each start(): reap()
        "out", nobody references the buffer any more, never handed over ──▶ "free"
        "out", nobody references the buffer any more, handed over to stream(s) S
            ──▶ a release event recorded on each S *now* ──▶ "releasing"
        "releasing", every release event completed ──▶ "free"
    take(nbytes): the smallest "free" slot it fills enough of; else a new one within the caps;
        else None (the stage then allocates that batch's tensors afresh, with record_stream)

When the consumer lets a batch go (the rule): when nothing shares the slot's buffer any more
(neither the batch's leaves, nor any view the user made of them, nor a storage object the user
took from one, ``leaf.untyped_storage()``), as the storage's use count and its Python object's
reference count tell (:func:`~aioloader._device._backend.storage_users`). The release event
is recorded at the first ``reap`` after that, on every stream the batch was handed to, so it
follows every kernel the consumer enqueued with the batch: a kernel cannot be enqueued without
a reference. A user who keeps a batch (or a view of it, or its storage) for longer keeps its
slot: it is never written again while referenced. A typical loop drops batch *i* when
the loop variable takes batch *i + 1*, so its slot is released at the next ``start()`` and free
once the step that read it has run; the ring then holds about ``device_prefetch + 3`` slots.

Invariants: a slot is in exactly one state; a slot is handed to ``take`` only when "free",
which it reaches only after its copy completed, nobody references its buffer, and every
release event recorded for it completed. Nothing here waits for the device: events are only
queried.

Sharp edges:

- Only leaves of :data:`RING_MIN_LEAF_BYTES` or more go into a slot; smaller ones get device
  tensors of their own (with ``record_stream``). The large leaves of one batch share the slot's
  storage: keeping one of them keeps the whole slot (as keeping a view keeps its base), and
  ``torch.save`` of one saves the whole slot's storage. Keep ``leaf.clone()`` instead, to hold
  or save one leaf on its own.
- A leaf is a plain tensor over the slot's storage (``Tensor.set_``), not a view of the
  buffer: a view made under ``no_grad`` cannot take part in autograd in place
  (``leaf.mul_(w)`` with ``w`` requiring grad), and a training step may do just that.
- Streams other than the one the batch was handed to are the user's to order, exactly as
  with torch's own ``record_stream`` rule.
- Closing forgets the slots (no longer :attr:`Slot.owned`). Buffers still referenced by the
  user get ``record_stream`` on the streams they were handed to first, so the caching
  allocator, which frees them once the user lets go, waits for those streams' work as it would
  for any tensor; a batch of a forgotten slot handed over later gets ``record_stream`` then
  (the stage does it at the hand-over).
- Slots are sized in :data:`RING_GRANULE` steps, keyed by that size class rather than by the
  batch's exact layout: batches of slightly different shapes (the last one, variable lengths)
  share slots, and each batch's leaves are carved out of the slot at its own offsets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = [
    "MAX_RING_BYTES",
    "MAX_RING_SLOTS",
    "RING_GRANULE",
    "RING_MIN_LEAF_BYTES",
    "DeviceRing",
    "Slot",
]

#: Leaves smaller than this get device tensors of their own rather than a place in a slot: a
#: label or an index kept for logging would otherwise keep a whole slot (megabytes) from reuse,
#: while the allocator serves small tensors from its small pool at no cost worth saving.
RING_MIN_LEAF_BYTES = 64 << 10
#: Slot sizes are multiples of this: batches of slightly different size share a size class.
RING_GRANULE = 1 << 20
#: A free slot is reused for a batch only if the batch fills at least this share of it (or it is
#: of the batch's own size class): a small last batch does not take (and keep busy) a large slot.
_MIN_FILL = 0.5
#: Slots a stage keeps at most. Steady state needs about ``device_prefetch + 3`` (copies ahead,
#: the batch in use, the one whose release event is pending, one spare); more only helps a
#: consumer that keeps batches, and each slot is device memory the model cannot use.
MAX_RING_SLOTS = 8
#: Device bytes the ring may hold at most; past it, batches get fresh tensors (allocator).
MAX_RING_BYTES = 2 << 30

SlotState = Literal["copying", "out", "releasing", "free"]


@dataclass(eq=False, slots=True)
class Slot:
    """One reusable device buffer (see the module docstring for its states).

    Attributes:
        buffer: the flat uint8 device tensor.
        baseline: the buffer's storage use count when only the ring holds it.
        state: where it is in its cycle.
        consumers: the streams the batch in it was handed to.
        release: events recorded on those streams once the batch was let go.
        owned: whether the ring still watches it (False once closed or discarded: a hand-over
            then ties the buffer to the consumer's stream with ``record_stream``).
    """

    buffer: torch.Tensor
    baseline: int
    state: SlotState = "copying"
    consumers: list[Any] = field(default_factory=list)
    release: list[Any] = field(default_factory=list)
    owned: bool = True

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor of ``like``'s dtype and shape over the buffer's bytes at
        ``offset`` (a multiple of its item size).

        Not a view of the buffer (see the module docstring): a fresh tensor set onto the
        buffer's storage, so it has no base and no ``grad_fn``, may take part in autograd in
        place, and still counts as a user of the storage.
        """
        itemsize = like.element_size()
        start = self.buffer.storage_offset() + offset
        assert start % itemsize == 0, "ring leaves start at multiples of their item size"
        shape = tuple(like.shape)
        stride = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            stride[i] = stride[i + 1] * max(shape[i + 1], 1)
        out = torch.empty(0, dtype=like.dtype, device=self.buffer.device)
        return out.set_(self.buffer.untyped_storage(), start // itemsize, shape, tuple(stride))


class DeviceRing:
    """Reusable device buffers; a sync state machine driven by the stage (loop thread only).

    Args:
        alloc: a new flat uint8 device buffer of so many bytes.
        users: the storage use count of a tensor's storage (the backend's ``storage_users``).
        max_slots: slots kept at most.
        max_bytes: bytes kept at most.
    """

    def __init__(
        self,
        alloc: Callable[[int], torch.Tensor],
        users: Callable[[torch.Tensor], int | None],
        *,
        max_slots: int = MAX_RING_SLOTS,
        max_bytes: int = MAX_RING_BYTES,
    ) -> None:
        self._alloc = alloc
        self._users = users
        self._max_slots = max_slots
        self._max_bytes = max_bytes
        self._slots: list[Slot] = []
        self.fallbacks = 0  # batches that got no slot (caps reached)

    def take(self, nbytes: int) -> Slot | None:
        """A slot of at least ``nbytes`` for a new copy ("copying"), or None (caps reached)."""
        if nbytes <= 0:
            return None
        size = -(-nbytes // RING_GRANULE) * RING_GRANULE
        fits = [
            s
            for s in self._slots
            if s.state == "free"
            and nbytes <= s.nbytes
            and (s.nbytes == size or nbytes >= _MIN_FILL * s.nbytes)
        ]
        if fits:
            slot = min(fits, key=lambda s: s.nbytes)
            slot.state = "copying"
            slot.consumers.clear()
            slot.release.clear()
            return slot
        # Room first: drop free slots of other sizes (the smallest serve the fewest batches).
        while self._full(size):
            free = [s for s in self._slots if s.state == "free"]
            if not free:
                self.fallbacks += 1
                return None
            self._slots.remove(min(free, key=lambda s: s.nbytes))
        buffer = self._alloc(size)
        baseline = self._users(buffer)
        if baseline is None:
            self.fallbacks += 1
            return None
        slot = Slot(buffer, baseline)
        self._slots.append(slot)
        return slot

    def copied(self, slot: Slot) -> None:
        """The copy into ``slot`` completed: its batch is out."""
        if slot.state == "copying":
            slot.state = "out"

    def discard(self, slot: Slot) -> None:
        """The copy into ``slot`` failed: never reuse it."""
        slot.owned = False
        if slot in self._slots:
            self._slots.remove(slot)

    def handed(self, slot: Slot, stream: Any) -> None:
        """The batch in ``slot`` was handed over to ``stream``."""
        if not any(s is stream for s in slot.consumers):
            slot.consumers.append(stream)

    def reap(self, mark: Callable[[Any], Any], query: Callable[[Any], bool]) -> None:
        """Move let-go slots on (see the module docstring); never waits.

        Args:
            mark: records a new event on a stream and returns it.
            query: whether an event has completed (raises on a device fault).
        """
        for slot in list(self._slots):
            try:
                if slot.state == "out" and self._users(slot.buffer) == slot.baseline:
                    if not slot.consumers:
                        slot.state = "free"  # copied, never read on the device
                        continue
                    slot.release = [mark(stream) for stream in slot.consumers]
                    slot.state = "releasing"
                if slot.state == "releasing" and all(query(ev) for ev in slot.release):
                    slot.state = "free"
                    slot.consumers.clear()
                    slot.release.clear()
            except Exception:
                slot.owned = False
                self._slots.remove(slot)  # the device is in trouble: never reuse it

    def close(self, record_stream: Callable[[torch.Tensor, Any], None]) -> None:
        """Forget every slot; buffers the user still holds are handed to the allocator's
        stream tracking first (see the module docstring)."""
        for slot in self._slots:
            slot.owned = False
            if slot.state in ("out", "releasing") and slot.consumers:
                for stream in slot.consumers:
                    with contextlib.suppress(Exception):  # a device fault at close
                        record_stream(slot.buffer, stream)
        self._slots.clear()

    @property
    def slots(self) -> int:
        return len(self._slots)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._slots)

    def _full(self, size: int) -> bool:
        return len(self._slots) >= self._max_slots or self.nbytes + size > self._max_bytes
