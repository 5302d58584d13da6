"""The records that travel between the main process and a worker: frame kinds, jobs, parcels.

Everything here crosses a process boundary, pickled or packed, and means the same on both
sides; nothing here does IO or decides anything. The modules that send, pack or open a record
import it from here: :mod:`._frames` packs frames, :mod:`._channel` moves them,
:mod:`._wire` packs a batch into a :class:`Parcel` and opens it, :mod:`._raw` moves fetched
bytes through a slot, :mod:`._payload` pickles and loads a :class:`Payload`, :mod:`._worker`
runs the jobs. What goes where::

    main ──▶ worker   a frame (HEADER: payload length, job id, kind) over the request pipe:
                        JOB        pickle((fn, job)), the job one of
                                     LoadJob    a dataset copy (its Payload) to make batches with
                                     MapJob     a BatchRequest (its fetched bytes maybe RawRef
                                                into the slot), the slot or OwnSlot
                                     StreamJob  a StreamRequest, the slot or OwnSlot
                        CANCEL     empty: skip that job if it has not started
                        STOP       empty: return from the serve loop
    worker ──▶ main   a frame over the reply pipe:
                        RESULT     a Made whose batch is a Parcel (its tree's CPU tensors as
                                   WireTensor), or None for a LoadJob
                        ERROR      (exception, traceback text); RawSlotError: the slot for
                                   fetched bytes could not be mapped
                        CANCELLED  empty: the job was dropped before it ran

A worker also publishes numbers for the pool in shared memory rather than on the pipe
(:class:`Cells`): among them the tag of the job it runs (:func:`running_tag`), which every
:class:`MapJob` and :class:`StreamJob` carries.

The request records that are not the workers' alone stay where the epoch makes them:
:class:`~aioloader._types.BatchRequest`, :class:`~aioloader._types.StreamRequest` and
:class:`~aioloader._types.Made` (threads make and return them too).

Sharp edges:
- :class:`RawRef` is a tuple, not a dataclass: thousands a second are pickled, and a slotted
  dataclass pickles through ``dataclasses.fields``, ten times slower.
- :class:`Payload` pickles without ``keep`` (what must stay alive here, never sent).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from multiprocessing import sharedctypes
from typing import Any, NamedTuple

from .. import _shm
from .._types import BatchRequest, StreamRequest

__all__ = [
    "CANCEL",
    "CANCELLED",
    "COPY_TAG_SPAN",
    "ERROR",
    "HEADER",
    "JOB",
    "MAX_REPLY_BYTES",
    "REPLY_KINDS",
    "RESULT",
    "STOP",
    "Cells",
    "LoadJob",
    "MapJob",
    "OwnSlot",
    "Parcel",
    "Payload",
    "RawRef",
    "RawSlotError",
    "StreamJob",
    "WireTensor",
    "new_cells",
    "running_tag",
]

# -- frames ----------------------------------------------------------------------------------

HEADER = struct.Struct("<QQB")  # payload length, job id, kind

# Request kinds.
JOB = 0
CANCEL = 1
STOP = 2  # return from the serve loop (end-of-file does the same, unless a sibling holds the pipe)
# Reply kinds.
RESULT = 0
ERROR = 1
CANCELLED = 2
REPLY_KINDS = frozenset((RESULT, ERROR, CANCELLED))

# The largest reply payload the main side accepts (a batch that travels inline). Nothing real
# comes near it: a batch that does not get a shared-memory segment is bounded by the slot
# pool's cap (4 GiB by default). What passes it is garbage, typically bytes a process that the
# dataset forked wrote into the worker's inherited pipe, and allocating a buffer of that size
# would fail (MemoryError) or take the machine's memory. Higher: room for larger inline
# batches; lower: garbage is caught by its length alone more often (the job id and kind catch
# the rest).
MAX_REPLY_BYTES = 1 << 38  # 256 GiB


# -- the running job's tag -------------------------------------------------------------------

# A worker publishes the job it runs as one int64 (see :func:`running_tag`): the job's number
# below this span, the dataset copy's id above it. Job numbers stay below 2**40 and copy ids
# (one per loader on a shared pool) below 2**23, so a tag fits.
COPY_TAG_SPAN = 1 << 40


def running_tag(copy_id: int, number: int) -> int:
    """What a worker publishes while it runs job ``number`` of dataset copy ``copy_id`` (0 while
    it runs nothing). A loader numbers each attempt at a batch afresh (``ProcessRunner``), not
    by batch id: a batch given up with its epoch may still run when the next epoch's batch of
    the same id does, and two loaders sharing the workers number their batches alike; a crash
    or a deadline must name the right attempt."""
    return copy_id * COPY_TAG_SPAN + number + 1


class Cells(NamedTuple):
    """What each worker publishes for the pool, one cell per worker, in shared memory: read by
    the pool without asking the worker. ``multiprocessing``'s shared arrays, which a worker
    inherits (forked) or gets with its start arguments (a descriptor of their arena); each cell
    is one aligned 8-byte word, written whole.

    Attributes:
        current: the running job's tag (:func:`running_tag`), 0 when idle.
        loading: ``time.monotonic()`` when a dataset copy's load began, 0.0 when none.
        started: the worker's pid, once its initializer ran (the pool's sign that it is up).
    """

    current: Any
    loading: Any
    started: Any


def new_cells(n: int) -> Cells:
    """Zeroed :class:`Cells` for ``n`` workers. (An anonymous file of our own mapped in every
    worker measured no faster to the first batch than these, which the first array a process
    makes gives a heap arena file for its whole life.)

    Raises:
        ValueError: ``n`` is not positive.
    """
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    return Cells(
        sharedctypes.RawArray("q", n), sharedctypes.RawArray("d", n), sharedctypes.RawArray("q", n)
    )


# -- out: the jobs ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Payload:
    """A pickled dataset copy (:func:`._payload.dumps_copy`): the stream, and the segment that
    holds its large buffers (and a large stream itself).

    Attributes:
        data: the pickle stream (both pickles of :func:`._payload.dumps`), or ``b""`` when it
            lies in the segment (``stream``).
        segment: the shared-memory segment of the out-of-band buffers, or None.
        size: the segment's size.
        spans: ``(offset, length)`` of each out-of-band buffer in it, in pickling order.
        stream: ``(offset, length)`` of the pickle stream in the segment, or None (in ``data``).
        keep: what must stay alive here while a worker may load the copy: the storages of
            tensors in torch's shared memory, which travel as this process's descriptors of
            them (a swapped tensor's descriptor would close, and its number be reused, before
            a replacement worker loads the copy). Never sent.
    """

    data: bytes
    segment: str | None = None
    size: int = 0
    spans: tuple[tuple[int, int], ...] = ()
    keep: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    stream: tuple[int, int] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Without ``keep``.
        return Payload, (self.data, self.segment, self.size, self.spans, (), self.stream)

    def release(self) -> None:
        """Unlink the segment (the owner's side, once no worker will load this copy again)."""
        if self.segment is not None:
            _shm.unlink(self.segment)


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


@dataclass(frozen=True, slots=True)
class OwnSlot:
    """In place of a slot, before the loader knows how large its batches are: a batch of
    :data:`~aioloader._shm.INLINE_MAX_BYTES` or more goes into a segment the worker creates
    under ``name`` (the main process's name: it takes the segment over into its pool, or
    unlinks it if the job fails), not inline, if the segment fits in ``limit`` bytes: the
    pool's reservation under its cap (0: none, so a large batch travels inline and says why)."""

    name: str
    limit: int = 0


@dataclass(frozen=True, slots=True)
class MapJob:
    """Make the batch of ``request`` (indices, or samples the loop fetched), into ``slot`` if
    one is given; with ``raw_in_slot``, the :class:`RawRef` in ``request.raw`` point into
    ``slot``, to be copied out before the batch is collated there."""

    request: BatchRequest
    slot: _shm.Slot | OwnSlot | None
    raw_in_slot: bool = False
    copy_id: int = 0
    tag: int = 0  # what the worker publishes while it runs the job (running_tag)


@dataclass(frozen=True, slots=True)
class StreamJob:
    """Make the next batch of this worker's stream of dataset copy ``copy_id`` for
    ``request``, into ``slot`` if given."""

    request: StreamRequest
    slot: _shm.Slot | OwnSlot | None
    copy_id: int = 0
    tag: int = 0  # what the worker publishes while it runs the job (running_tag)


class RawRef(NamedTuple):
    """In place of a fetched item's bytes: where they lie in the job's slot, and whether they
    were a ``bytearray`` (else ``bytes``). A tuple: see the module's sharp edges."""

    offset: int
    size: int
    mutable: bool = False


# -- back: the parcel, and what an error may say ---------------------------------------------


@dataclass(frozen=True, slots=True)
class Parcel:
    """A made batch on its way to the main process (``Made.batch`` until it is opened).

    Attributes:
        tree: the batch's nesting with every array replaced by its place in the slot
            (``in_slot``), or the batch itself in wire form (its CPU tensors as
            :class:`WireTensor`).
        in_slot: whether the arrays lie in the job's slot.
        nbytes: the bytes a slot needs for a batch like this one; later leases are sized from
            the largest seen.
        slot_error: why a batch too large to travel inline came inline all the same ("" if
            it did not): the segment vanished or descriptors ran out (the worker could not map
            the job's slot), the worker could not make one (:class:`OwnSlot`), or the batch
            did not fit its slot.
        slot_vanished: the slot's segment no longer exists (someone removed it): the pool must
            stop leasing it.
        own_slot: the segment the worker made for it (:class:`OwnSlot`).
        fallback: the kind of that reason, for the log (said once per kind): "vanished",
            "attach", "denied" (the slot is not this process's to open), "cap", "room" or
            "fit"; "" means "vanished" or "attach" by ``slot_vanished``.
    """

    tree: Any
    in_slot: bool
    nbytes: int
    slot_error: str = ""
    slot_vanished: bool = False
    own_slot: _shm.Slot | None = None
    fallback: str = ""


@dataclass(frozen=True, slots=True)
class WireTensor:
    """A CPU tensor travelling inline as its numpy array: torch's own pickling would move it
    into a new shared-memory file (see :mod:`._wire`)."""

    array: Any

    def restore(self) -> Any:
        """The tensor, over the received array (no copy)."""
        import torch

        return torch.from_numpy(self.array)


class RawSlotError(Exception):
    """A worker could not map a job's raw slot (``vanished``: its segment is gone); the main
    process sends the request again inline."""

    def __init__(self, reason: str, vanished: bool) -> None:
        super().__init__(reason, vanished)
        self.reason = reason
        self.vanished = vanished

    def __str__(self) -> str:
        return f"the raw samples' slot cannot be mapped: {self.reason}"
