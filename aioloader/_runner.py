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
import contextlib
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from . import _shm
from ._batch import BatchMaker, BatchRequest, Made
from ._shm import INLINE_MAX_BYTES
from ._workers import (
    IterJob,
    MapJob,
    Reply,
    WorkerPool,
    from_wire,
    run_iter_job,
    run_map_job,
    take,
)

__all__ = ["END", "INLINE_MAX_BYTES", "ProcessRunner", "ThreadRunner"]

A = TypeVar("A")
R = TypeVar("R")

# How long closing waits for the loader's threads to finish what they run.
THREAD_JOIN_TIMEOUT_S = 10.0


END = object()  # a stream's end, in place of a batch


class ThreadRunner:
    """CPU work on ``threads`` threads of this process (``num_workers=0`` uses one).

    Args:
        maker: builds batches.
        threads: thread count.
        stream_factory: makes an iterator over the dataset for iterable datasets.
    """

    def __init__(self, maker: BatchMaker, threads: int) -> None:
        self._maker = maker
        self._threads = _Threads(threads)
        self._stream: Iterator[Any] | None = None
        self._stream_epoch = -1
        self._stream_error: BaseException | None = None
        self._stream_lock = threading.Lock()  # one stream, pulled by one thread at a time
        self._running: set[int] = set()  # batch ids a thread is working on now

    async def make(self, request: BatchRequest) -> Made:
        return await self._threads.run(self._make, request)

    def start_make(self, request: BatchRequest) -> asyncio.Future[Made]:
        """:meth:`make` without a coroutine: the future of the batch, made on a thread."""
        return self._threads.run(self._make, request)

    def _make(self, request: BatchRequest) -> Made:
        self._running.add(request.batch_id)  # set.add/discard are atomic: no lock needed
        try:
            return self._maker.make(request)
        finally:
            self._running.discard(request.batch_id)

    async def pull(self, job: IterJob, worker: int) -> Made:
        return await self._threads.run(self._pull, job)

    def _pull(self, job: IterJob) -> Made:
        self._running.add(job.batch_id)
        try:
            return self._pull_locked(job)
        finally:
            self._running.discard(job.batch_id)

    def _pull_locked(self, job: IterJob) -> Made:
        with self._stream_lock:
            if self._stream is None or self._stream_epoch != job.epoch:
                self._stream = iter(self._maker.dataset)
                self._stream_epoch = job.epoch
                self._stream_error = None
            if self._stream_error is not None:
                pending, self._stream_error = self._stream_error, None
                raise pending
            samples, error = take(self._stream, job.batch_size)
            if error is not None:
                # A failed stream ends for good; what it produced comes first, then the error.
                self._stream = iter(())
                if not samples:
                    raise error
                self._stream_error = error
            short = len(samples) < job.batch_size and self._stream_error is None
        if not samples or (job.drop_last and short):
            return Made(batch=END)
        request = BatchRequest(job.epoch, job.batch_id, list(range(len(samples))), raw=samples)
        return self._maker.make(request)

    def is_running(self, batch_id: int) -> bool:
        return batch_id in self._running

    def on_deadline(self, batch_id: int) -> int | None:
        return None  # a thread cannot be killed; its late result is dropped

    @property
    def streams(self) -> int:
        return 1

    def close(self) -> None:
        stuck = self._threads.close(THREAD_JOIN_TIMEOUT_S)
        if stuck:
            warnings.warn(
                f"{len(stuck)} loader thread(s) still run user code after close ({stuck}): "
                "a dataset read or collate_fn that never returns cannot be interrupted in a "
                "thread; use process workers (num_workers > 0) to have it killed",
                ResourceWarning,
                stacklevel=3,
            )


class _Threads:
    """A minimal thread pool whose jobs complete asyncio futures directly.

    ``loop.run_in_executor`` goes through a ``concurrent.futures.Future`` chained to an
    asyncio one; for batches of a few tens of microseconds that bookkeeping is a visible share
    of the loader's overhead. Here a job carries its loop and asyncio future, and the thread
    hands the result over with one ``call_soon_threadsafe``. A job whose future was cancelled
    before a thread picked it up is skipped.
    """

    def __init__(self, count: int) -> None:
        self._count = count
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def run(self, fn: Callable[[A], R], arg: A) -> asyncio.Future[R]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        if len(self._threads) < self._count:  # started on demand, like ThreadPoolExecutor
            thread = threading.Thread(
                target=self._work, name=f"aioloader-{len(self._threads)}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        self._jobs.put((loop, future, fn, arg))
        return future

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, future, fn, arg = job
            if future.cancelled():
                continue
            try:
                result = fn(arg)
            except BaseException as exc:
                _post(loop, future, None, exc)
            else:
                _post(loop, future, result, None)
            del job, loop, future, arg

    def close(self, timeout: float) -> list[str]:
        """Stop the threads; returns the names of those still busy after ``timeout``."""
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]


def _post(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any,
    error: BaseException | None,
) -> None:
    def settle() -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(settle)


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

    async def make(self, request: BatchRequest) -> Made:
        return await self._run(
            run_map_job, lambda slot: MapJob(request, slot), request.batch_id, None
        )

    async def pull(self, job: IterJob, worker: int) -> Made:
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

    def close(self) -> None:
        self.pool.close()
