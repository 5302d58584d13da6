"""ProcessRunner: the epoch's :class:`~aioloader._types.Runner` over worker processes.

It only routes: a slot for the job (:class:`._wire.Receiver`; a map job's fetched samples may
travel to the worker in it, :class:`._raw.Sender`), the job to a worker
(:class:`._pool.WorkerPool`), and the worker's :class:`~aioloader._types.Made` opened back into
a batch (:class:`._wire.Receiver`). Whether a batch travels in shared memory or inline is not
decided here (see :mod:`._wire`).

Slot ownership, which every path keeps: a leased slot is either opened into the batch (its
views own it then), released when the batch came back inline or the job failed, or released by
the channel once the worker is done with a job whose awaiting task was cancelled. A slot that
carried fetched samples is the job's slot: the same rules hold for it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import Callable
from typing import Any

from .. import _shm
from .._errors import WorkerCrashedError
from .._log import workers_log
from .._types import BatchRequest, InlineMaking, Made, StreamRequest
from ._frames import Packed
from ._pool import WorkerPool
from ._raw import Sender
from ._records import MapJob, OwnSlot, Payload, RawSlotError, StreamJob, running_tag
from ._wire import Receiver, SegmentUnreadable, sweep_unclaimed
from ._worker import run_map_job, run_stream_job

__all__ = ["ProcessRunner"]


class ProcessRunner:
    """CPU work in worker processes, batches back through shared memory.

    Args:
        pool: the worker processes (``pool.start()``, ``pool.pids()`` and ``pool.rebuilds``
            are the loader's to use).
        slots: the shared-memory slot pool, or None to send every batch inline.
        prefetch: batches in flight at once (to check /dev/shm for that many slots).
        copy_id: the workers' dataset copy this runner's jobs use: 0 for a loader's own
            workers, one per loader on a shared pool (see ``aioloader._loader._shared_pool``).
        unclaimed_own: the names of segments workers were told to make (``OwnSlot``) whose
            batch was not taken in yet (see ``__init__``); the runner's own set when None. A
            shared pool passes its set, which it sweeps when it stops the workers.
        timeout: the batch deadline; a job given up while it runs past it has its worker
            killed (``WorkerPool.submit``'s ``hang_after``).
    """

    inline: InlineMaking | None = None  # every batch is a worker's

    def __init__(
        self,
        pool: WorkerPool,
        slots: _shm.SlotPool | None,
        prefetch: int = 1,
        *,
        copy_id: int = 0,
        unclaimed_own: set[str] | None = None,
        no_room: bool = False,
        timeout: float | None = None,
    ) -> None:
        self.pool = pool
        self.timeout = timeout
        self.slots = slots
        self.copy_id = copy_id
        # Names of segments workers were told to make (OwnSlot), from the lease until their
        # batch is taken in: a job given up while it ran (a pool that closes lets them go
        # before their worker is done), or one whose parcel was never read (a SIGTERM stops
        # the loop that reads it), may still leave one, unlinked once the workers are stopped.
        self._unclaimed_own: set[str] = set() if unclaimed_own is None else unclaimed_own
        self._receiver = Receiver(slots, prefetch, no_room=no_room, unclaimed=self._unclaimed_own)
        self._sender = Sender(slots)
        self._restarts_logged = pool.rebuilds  # worker replacements said in the log so far
        # Each attempt at a batch has a tag of its own (see _records.running_tag). The deadline
        # asks about a request object, which means its newest attempt: by the object's id (it
        # lives while its attempts run), since batch ids repeat every epoch and a batch given
        # up with its epoch, or another iterator's, may run beside it.
        self._numbers = itertools.count()
        self._attempts: dict[int, int] = {}  # id(request) -> tag of its attempt under way

    @property
    def streams(self) -> int:
        """One stream per worker: each keeps its own iterator over an iterable dataset."""
        return self.pool.num_workers

    @property
    def restarts(self) -> int:
        """Worker processes replaced after a crash or a kill."""
        return self.pool.rebuilds

    @property
    def shm_fallbacks(self) -> int:
        """Batches sent inline because no shared-memory segment could be had."""
        return self._receiver.fallbacks + self._sender.fallbacks

    @property
    def has_copy(self) -> bool:
        """Whether the workers were given this runner's dataset copy (:meth:`load`)."""
        return self.pool.copy_given(self.copy_id)

    def load(self, make: Callable[[], Payload], epoch: int, seed: int | None = None) -> None:
        """Give the workers a new dataset copy (see ``WorkerPool.load``), seeded from ``seed``
        (None: the pool's)."""
        self.pool.load(make, epoch, self.copy_id, seed=seed)

    def start(self) -> None:
        """Start every worker and wait until each ran its initializer (blocking)."""
        self.pool.start()

    def worker_pids(self) -> tuple[int, ...]:
        return tuple(self.pool.pids())

    def shm_stats(self) -> _shm.ShmStats | None:
        return self.slots.stats() if self.slots is not None else None

    def begin_epoch(self) -> None:
        """Nothing: the workers' state travels with their dataset copy (:meth:`load`)."""

    def stop_if_idle(self) -> bool:
        return False  # closing waits for the processes: never in place, on the loop

    def launch(self) -> None:
        """Start every worker's process without waiting for it (see ``WorkerPool.launch``)."""
        self.pool.launch()

    def start_make(self, request: BatchRequest) -> asyncio.Future[Made]:
        """Start making a map-style batch on the least-loaded worker."""
        return asyncio.ensure_future(self._run(run_map_job, request, None))

    async def pull(self, request: StreamRequest, stream: int) -> Made:
        """Make the next batch of worker ``stream``'s stream (``Made.batch is END`` at its end).

        A stream's batch is never resubmitted to another worker: only that worker's iterator
        knows where the stream stands.
        """
        return await self._run(run_stream_job, request, stream)

    async def _run(
        self,
        fn: Callable[[Any], Packed[Made]],
        request: BatchRequest | StreamRequest,
        worker: int | None,
        *,
        pickled: bool = False,
    ) -> Made:
        plan = None
        if isinstance(request, BatchRequest) and not pickled:
            plan = self._sender.plan(request)  # fetched samples' bytes to send in the slot
        slot = await self._receiver.lease(plan.nbytes if plan is not None else 0)
        release = self._receiver.releaser(slot)
        on_abandon = release
        if isinstance(slot, OwnSlot) and release is not None:
            on_abandon = functools.partial(self._abandoned_own, release, slot.name)
        tag = running_tag(self.copy_id, next(self._numbers))
        job: MapJob | StreamJob
        if isinstance(request, BatchRequest):
            wire = request
            if plan is not None and isinstance(slot, _shm.Slot) and slot.size >= plan.nbytes:
                try:
                    wire = self._sender.fill(plan, slot)
                except BaseException:
                    if release is not None:
                        release()
                    raise
            job = MapJob(wire, slot, wire is not request, self.copy_id, tag)
        else:
            job = StreamJob(request, slot, self.copy_id, tag)
        self._attempts[id(request)] = tag
        try:
            made: Made = await self.pool.submit(
                fn,
                job,
                batch_id=request.batch_id,
                worker=worker,
                on_abandon=on_abandon,
                resubmit_innocent=worker is None,
                copy_id=self.copy_id,
                tag=tag,
                hang_after=self.timeout,
            )
        except BaseException as exc:
            # An OwnSlot's name stays unclaimed until release() (now, or for a job given up,
            # once its worker is done with it) or the close's sweep (see __init__).
            if isinstance(exc, asyncio.CancelledError):
                raise  # on_abandon releases the slot once the worker is done with the job
            if not isinstance(exc, Exception):
                # The coroutine closed under its wait (GeneratorExit: a loop torn down), an
                # interrupt: the worker may still write into the slot, and nothing will say
                # when it is done. The slot stays leased (an OwnSlot's name unclaimed) until
                # the pool's close, which unlinks it once the workers are stopped.
                raise
            if not isinstance(exc, RawSlotError):
                if release is not None:
                    release()
                answered = isinstance(exc, Exception) and not self.pool.closed
                if isinstance(slot, OwnSlot) and answered:
                    # Its worker answered or died: nothing to sweep. (Failed by a close, the
                    # worker may still make it before it is stopped; interrupted here (Ctrl-C,
                    # the coroutine closed), it may still run: the sweep's then.)
                    self._receiver.settled(slot.name)
                self._log_restarts(exc)
                raise
            # The worker could not map the slot: the same request again, pickled.
            assert isinstance(slot, _shm.Slot)
            self._sender.lost(slot, exc)
            return await self._run(fn, request, worker, pickled=True)
        finally:
            if self._attempts.get(id(request)) == tag:
                del self._attempts[id(request)]
        if self.pool.rebuilds > self._restarts_logged:  # a worker died with nothing of ours
            self._log_restarts(None)
        try:
            return self._receiver.open(made, slot)
        except SegmentUnreadable:
            if not isinstance(request, BatchRequest) or pickled:
                raise  # a stream's items cannot be read again: the batch fails, named
            # Counted (Receiver.open); the same request again, inline.
            return await self._run(fn, request, worker, pickled=True)

    def _abandoned_own(self, release: Callable[[], None], name: str) -> None:
        """A given-up job's OwnSlot, its worker done with it (``on_abandon``): unlinked, and
        its name need not be swept, unless the pool is closing (then the channel lets the job
        go before its worker is done, and the worker may still make the segment)."""
        release()
        if not self.pool.closed:
            self._receiver.settled(name)

    def _log_restarts(self, error: BaseException | None) -> None:
        """Log worker replacements not logged yet, with the cause where it is known."""
        rebuilds = self.pool.rebuilds
        if rebuilds <= self._restarts_logged:
            return
        self._restarts_logged = rebuilds
        cause = str(error) if isinstance(error, WorkerCrashedError) else "a worker process died"
        workers_log.warning("worker process replaced (%d so far): %s", rebuilds, cause)

    def is_running(self, request: BatchRequest | StreamRequest) -> bool:
        """Whether a worker runs the batch of ``request`` now (not merely has it queued)."""
        tag = self._attempts.get(id(request))
        return tag is not None and self.pool.is_running(tag)

    def on_deadline(self, request: BatchRequest | StreamRequest) -> int | None:
        """Kill the worker that runs the batch of ``request`` (it hung); returns its pid, if
        one was."""
        tag = self._attempts.get(id(request))
        pid = self.pool.kill_holding(tag) if tag is not None else None
        if pid is not None:
            # Said here, with its cause; the replacement this causes is then not said again.
            self._restarts_logged += 1
            workers_log.warning(
                "worker process pid %d killed and replaced: batch %d passed its deadline",
                pid,
                request.batch_id,
            )
        return pid

    def close(self) -> None:
        """Stop every worker (blocking), then unlink what they made for abandoned jobs."""
        self.pool.close()
        sweep_unclaimed(self._unclaimed_own)
