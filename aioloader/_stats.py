"""Live statistics: mutable counters inside, a frozen snapshot outside.

The pipeline bumps :class:`Counters` from the event loop thread only (worker processes report
their timings in their replies), so no lock is needed. :meth:`DataLoader.statistics` copies them
into a :class:`LoaderStatistics`, which is safe to keep, compare and print while the loader runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Counters", "LoaderStatistics"]


@dataclass(frozen=True, slots=True)
class LoaderStatistics:
    """A snapshot of the loader's state and where its time went.

    Attributes:
        epoch: the epoch being iterated (or last iterated).
        batches_yielded: batches handed to the consumer, all epochs.
        samples_yielded: samples in those batches, all epochs.
        epoch_batches_yielded: batches handed to the consumer in the current epoch.
        in_flight: batches scheduled whose result has not arrived.
        waiting: batches finished, waiting in the reorder buffer for their turn.
        prefetch: the permit count bounding in_flight + waiting (+ batches being handed over).
        live_shm_slots: shared-memory segments alive (free, leased or held by batches).
        leased_shm_slots: segments lent to a worker for a batch it is making.
        held_shm_slots: segments holding batches the consumer or the pipeline still holds.
        shm_bytes: bytes of all shared-memory segments.
        shm_fallbacks: batches that travelled inline (pickled) because no shared-memory segment
            could be had (``/dev/shm`` full, descriptors exhausted); logged once as a warning.
        worker_restarts: worker processes replaced after a crash or a kill.
        retries: batches re-run after a worker crash or a deadline (``max_retries``).
        timeouts: batches that missed their deadline.
        skipped: ``(index, reason)`` of every sample skipped with ``on_error='skip'``.
        fetch_s: seconds the event loop spent awaiting async dataset items (summed per batch).
        read_s: seconds spent reading samples (``dataset[i]``), in threads or workers.
        collate_s: seconds spent collating, in threads or workers.
        transfer_s: seconds from starting a device copy to its completion.
        consumer_wait_s: seconds the consumer waited for a batch that was not ready.
    """

    epoch: int = 0
    batches_yielded: int = 0
    samples_yielded: int = 0
    epoch_batches_yielded: int = 0
    in_flight: int = 0
    waiting: int = 0
    prefetch: int = 0
    live_shm_slots: int = 0
    leased_shm_slots: int = 0
    held_shm_slots: int = 0
    shm_bytes: int = 0
    shm_fallbacks: int = 0
    worker_restarts: int = 0
    retries: int = 0
    timeouts: int = 0
    skipped: tuple[tuple[int, str], ...] = ()
    fetch_s: float = 0.0
    read_s: float = 0.0
    collate_s: float = 0.0
    transfer_s: float = 0.0
    consumer_wait_s: float = 0.0


@dataclass(slots=True)
class Counters:
    """What the pipeline counts as it runs (see :class:`LoaderStatistics`)."""

    epoch: int = 0
    batches_yielded: int = 0
    samples_yielded: int = 0
    epoch_batches_yielded: int = 0
    retries: int = 0
    timeouts: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)
    fetch_s: float = 0.0
    read_s: float = 0.0
    collate_s: float = 0.0
    transfer_s: float = 0.0
    consumer_wait_s: float = 0.0
