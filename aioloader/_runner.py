"""Where the CPU work of a batch runs: a thread (``ThreadRunner``) or a worker process
(``ProcessRunner``). Both present one small async interface to the epoch pipeline:

- ``await make(request)`` builds the batch of a map-style request (reading samples by index,
  or decoding samples the loop already fetched) and returns a :class:`Made`;
- ``await pull(job)`` builds the next batch of an iterable dataset's stream (``Made`` whose
  ``batch`` is :data:`END` once the stream is exhausted);
- ``on_deadline(batch_id)`` is called when a batch misses its deadline: the process runner
  kills the worker that holds it (a thread cannot be killed; it is left to finish and its
  result is dropped);
- ``close()`` releases everything (blocking; called from a thread by ``aclose``).

The process runner owns the hand-off to shared memory: it leases a slot sized from the largest
batch seen so far, sends it with the job, and maps the worker's descriptors back into arrays.
Batches smaller than :data:`INLINE_MAX_BYTES` travel pickled instead: for them a slot costs
more (a lease, a mapping, a finalizer) than the copy it saves.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from . import _shm
from ._shm import INLINE_MAX_BYTES
from ._types import END, BatchRequest, Made, StreamRequest
from ._workers import (
    IterJob,
    MapJob,
    Reply,
    WorkerPool,
    from_wire,
    run_iter_job,
    run_map_job,
)

__all__ = ["INLINE_MAX_BYTES", "ProcessRunner"]

A = TypeVar("A")
R = TypeVar("R")

# How long closing waits for the loader's threads to finish what they run.
THREAD_JOIN_TIMEOUT_S = 10.0




class ProcessRunner:
    """CPU work in worker processes, batches back through shared memory.

    Args:
        pool: the worker processes.
        slots: the shared-memory slot pool, or None to send every batch pickled.
    """

    def __init__(self, pool: WorkerPool, slots: _shm.SlotPool | None, prefetch: int = 1) -> None:
        self.pool = pool
        self.slots = slots
        self._prefetch = prefetch
        self._batch_bytes = 0  # the largest batch seen: leases are sized from it
        self._checked_bytes = 0  # the batch size /dev/shm was last checked for

    async def _lease(self) -> _shm.Slot | None:
        """A slot for the next batch; None sends it inline. Reuse is instant; creating a
        segment reserves and maps its pages, so it runs in a thread, off the loop."""
        size = self._batch_bytes
        if self.slots is None or size < INLINE_MAX_BYTES:
            return None
        slot = self.slots.reuse(size)
        if slot is not None:
            return slot
        if size > self._checked_bytes:  # warn up front if prefetch x batch will not fit
            self._checked_bytes = size
            self.slots.preflight(size, self._prefetch + 1)
        return await asyncio.to_thread(self.slots.lease, size)

    async def _run(self, fn: Any, job_of: Any, batch_id: int, worker: int | None) -> Made:
        slot = await self._lease()
        release = (lambda: self.slots.release(slot)) if slot is not None else None  # type: ignore[union-attr]
        try:
            reply: Reply = await self.pool.submit(
                fn,
                job_of(slot),
                batch_id=batch_id,
                worker=worker,
                on_abandon=release,
                resubmit_innocent=worker is None,
            )
        except asyncio.CancelledError:
            raise  # on_abandon releases the slot once the worker is done with it
        except BaseException:
            if release is not None:
                release()
            raise
        self._batch_bytes = max(self._batch_bytes, reply.nbytes)
        if reply.encoded:
            assert slot is not None
            assert self.slots is not None
            try:
                batch = self.slots.open(slot, reply.value.tree)
            except BaseException:
                self.slots.release(slot)  # a failed open leaves the slot leased
                raise
        else:
            if release is not None:
                release()
            batch = END if reply.end else from_wire(reply.value)
        return Made(batch, list(reply.skipped), reply.read_s, reply.collate_s, reply.samples)

    def start_make(self, request: BatchRequest) -> asyncio.Future[Made]:
        return asyncio.ensure_future(
            self._run(run_map_job, lambda slot: MapJob(request, slot), request.batch_id, None)
        )

    async def pull(self, job: StreamRequest, worker: int) -> Made:
        def job_of(slot: _shm.Slot | None) -> IterJob:
            return IterJob(job.epoch, job.batch_id, job.batch_size, job.drop_last, slot)

        return await self._run(run_iter_job, job_of, job.batch_id, worker)

    def is_running(self, batch_id: int) -> bool:
        return self.pool.is_running(batch_id)

    def on_deadline(self, batch_id: int) -> int | None:
        return self.pool.kill_holding(batch_id)

    @property
    def streams(self) -> int:
        return self.pool.num_workers

    @property
    def restarts(self) -> int:
        return self.pool.rebuilds

    def start(self) -> None:
        self.pool.start()

    def close(self) -> None:
        self.pool.close()
