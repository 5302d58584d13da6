"""Fetched samples' bytes through a job's slot, main process to worker (see :mod:`._wire`).

An item of a map job's fetched samples that is ``bytes`` (or a plain ``dict`` whose values
are), of at least :data:`RAW_SLOT_MIN_BYTES` each and
:data:`~aioloader._shm.INLINE_MAX_BYTES` in all, is copied once into the job's slot
by :class:`Sender` and replaced in the pickled request by a :class:`._records.RawRef`; the
worker copies each back out (:func:`unpack_raw`) before anything sees it. A worker that cannot
map the slot answers :class:`._records.RawSlotError`, and the request is sent again inline.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .. import _shm
from .._errors import SharedMemoryError
from .._types import BatchRequest
from ._records import RawRef, RawSlotError

__all__ = ["RAW_SLOT_MIN_BYTES", "RawPlan", "Sender", "unpack_raw"]

_log = logging.getLogger("aioloader.shm")

# A fetched item's bytes travel in the job's raw slot from this size on. Smaller ones are
# pickled with the request: for them, a descriptor and a copy out of the slot cost about what
# the pickle copy does.
RAW_SLOT_MIN_BYTES = 4 << 10


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
        if total < _shm.INLINE_MAX_BYTES:
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
