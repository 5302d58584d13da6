"""The worker processes, seen from the main process: start, route jobs, detect and attribute
deaths, rebuild, close.

Each worker is a process of its own, started through the multiprocessing context
(:func:`._worker.run_worker`), with its own pipes. That buys the failure contract:

- a dead worker is attributed exactly (pid, exit code or signal), because only its own jobs
  fail, and only that worker is rebuilt; the others keep running;
- a hung worker can be killed alone when its batch misses its deadline;
- stream (iterable) datasets keep one iterator per worker, which needs jobs routed to a
  chosen worker.

Jobs travel over two pipes per worker that the event loop watches directly (:mod:`._channel`):
no thread of the main process touches a job on its way, which cuts the main process's cost per
job from ~200 us (a ``ProcessPoolExecutor``'s queues) to ~25 us, what decides the rate of tiny
batches. No executor either: one per worker cost two threads, three queues pickled to the
worker and rebuilt there, and a start-up ping through them, all on the first batch's path. A
worker says it has started by writing its pid into a shared array once its initializer ran.

A worker's death (:mod:`._death`: how it is seen, what its error says, what happens to its
jobs) fails every job the worker held with ``BrokenProcessPool``; each job's :meth:`submit`
then learns from the one record of that death whether it fails or goes to the replacement,
which the pool starts at its next job (:meth:`WorkerPool._replace`).

The dataset copy (:meth:`WorkerPool.load`) is not part of a worker's start: it is a job of its
own, sent ahead of the first job a worker gets after a new copy was given (a replacement
worker gets the current copy the same way). The copy is pickled once for all workers, in a
thread (a large dataset would stall the event loop), as soon as it is given. Renewing
it each epoch (``persistent_workers=False``) therefore costs one pickling and one unpickling
per worker, as in torch, but no process start: the processes, their imports and their
shared-memory mappings are kept warm.

Loaders sharing the pool (``aioloader._loader._shared_pool``) keep a copy each, by copy id, dropped
when the loader closes (:meth:`WorkerPool.release`); a worker publishes copy and batch of the
job it runs as one tag (``_records.running_tag``): a crash blames that job only, of one loader.

Sharp edges:
- A copy that cannot be pickled fails every job that needs it with the ``TypeError`` that
  names what could not be pickled (a fresh one each time: each batch adds its own notes).
- A worker that hangs while it starts or loads its copy is killed at the start deadline
  (``start_timeout``, else the batch ``timeout``, see :mod:`._starting`); every job it held
  fails with ``WorkerInitError`` naming its stack, rather than wait for a start that will
  not come, or go to a replacement that would most likely hang the same way.
- Processes are launched on threads, never on the event loop's (a launch waits for a fork, or
  for the standard forkserver's own start): a job waits off the loop for its worker's launch
  before it is sent, under a deadline of the launch's own (:mod:`._launch`).
- A job whose awaiting task is cancelled keeps running in the worker; ``on_abandon`` is called
  once the worker is really done with it (or dead), so a shared-memory slot is never reused
  while a worker may still write into it. Under a deadline, a worker that runs such a job
  past it is killed (:func:`._death.watch_abandoned`): nothing else would free the jobs
  behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing
import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import connection
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any, TypeVar

from .._errors import WorkerInitError
from .._log import first_time, workers_log
from .._threads import off_loop
from ._channel import Channel, open_channel
from ._context import ForkContext, start_context
from ._copy import DatasetCopy
from ._death import EXIT_STATUS_WAIT_S as EXIT_STATUS_WAIT_S
from ._death import MAX_START_FAILURES as MAX_START_FAILURES
from ._death import Deaths, kill_corrupt, watch_abandoned
from ._frames import Packed
from ._launch import Launcher, Worker
from ._records import Payload, new_cells, running_tag
from ._starting import START_POLL_S, Hang, StackPipe, describe_start, kill, take_stack
from ._worker import drop_copy, load_copy
from ._zygote import fork_unsafe_reason, is_zygote

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "EXIT_STATUS_WAIT_S",
    "MAX_START_FAILURES",
    "SHUTDOWN_GRACE_S",
    "WorkerPool",
    "starts_through_pythons_forkserver",
    "warn_more_workers_than_cpus",
]

J = TypeVar("J")
R = TypeVar("R")

# How long close() lets a worker finish its current job before killing it.
SHUTDOWN_GRACE_S = 1.0

# How long a worker may take to start (its process, then loading a dataset copy) when neither
# start_timeout nor the batch timeout says (the loader passes its own: see LoaderConfig).
# Longer: more patience with a slow file system or a large dataset to unpickle; shorter: a
# hung start is reported sooner.
DEFAULT_START_TIMEOUT_S = 120.0


# How often a blocking start (:meth:`WorkerPool.start`) looks whether a worker is up.
_START_CHECK_S = 0.002

# The start method of workers the pool forks from this process (fork_here).
_FORK: BaseContext | None = (
    multiprocessing.get_context("fork")
    if "fork" in multiprocessing.get_all_start_methods()
    else None
)


def starts_through_pythons_forkserver(context: BaseContext) -> bool:
    """Whether a pool of ``context`` made now, on this thread, starts its workers through
    Python's own forkserver: a ``forkserver`` context, or a ``'fork'`` one
    (:class:`._context.ForkContext`) whose workers cannot be forked from here now
    (:meth:`WorkerPool.fork_here`'s test) and whose fallback is that server. Not the forked
    server of ``_zygote``."""
    start = start_context(context)
    if is_zygote(start) or start.get_start_method() != "forkserver":
        return False
    return start is context or fork_unsafe_reason(runs_user_code=True) is not None


def warn_more_workers_than_cpus(num_workers: int, stacklevel: int = 3) -> None:
    """Warn where ``num_workers`` processes are more than this machine's CPUs: the extra ones
    only compete for them. Said by whoever decides the count (a loader with workers of its
    own, or a :class:`~aioloader.WorkerPool`), never by a loader on a pool as well, and once
    per process for each count. Threads (``thread_pool=True``) are not counted: they mostly
    wait on IO with the GIL released."""
    cpus = os.cpu_count() or 1
    if num_workers > cpus and first_time(("num_workers above CPUs", num_workers)):
        warnings.warn(
            f"num_workers={num_workers} is more than the {cpus} CPUs here; "
            "extra workers only compete for them",
            UserWarning,
            stacklevel=stacklevel,
        )


class WorkerPool:
    """``num_workers`` worker processes with crash detection and targeted rebuild.

    Args:
        num_workers: how many worker processes.
        context: the multiprocessing context (see :func:`resolve_context`).
        seed: the loader's seed; workers derive their seeds from it.
        per_batch_seeds: reseed each worker before every batch (``worker_seeding='batch'``),
            rather than once per copy.
        start_timeout: seconds a worker may take to start, and to load each dataset copy.
        start_setting: the setting that gave it, for errors (``"start_timeout=2.0"``).
    """

    def __init__(
        self,
        num_workers: int,
        context: BaseContext,
        seed: int,
        *,
        per_batch_seeds: bool = True,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        start_setting: str = "the default",
    ) -> None:
        self.num_workers = num_workers
        self.context = context
        self._seed = seed
        self._per_batch_seeds = per_batch_seeds
        self._start_timeout = start_timeout
        self._start_setting = start_setting
        self._copies: dict[int, DatasetCopy] = {}  # by copy id: 0, or one per loader sharing
        self._retired: dict[int, DatasetCopy] = {}  # the copy before each, maybe being loaded
        self._cells = new_cells(num_workers)  # what each worker publishes for the pool
        self._deaths = Deaths(self._cells.current, self._replace)
        when = (start_timeout, start_setting)
        self._fork = isinstance(context, ForkContext)  # forked here where safe (fork_here)
        self._launcher = Launcher(
            start_context(context),
            self._deaths.exits,
            lambda: self._closed,
            when,
            fork_asked=self._fork,
        )
        # The copies, and the closing mark with the workers' pipes made after it is checked.
        self._launch_lock = threading.Lock()
        self._workers = [Worker(i, *self._new_worker(i)) for i in range(num_workers)]
        self._closed = False  # no job or launch from now on
        self._closed_all = False  # every step of close() done
        self._close_lock = threading.RLock()
        self.rebuilds = 0

    def _new_worker(self, worker_id: int) -> tuple[Channel, tuple[Connection, ...], StackPipe]:
        """Worker ``worker_id``'s pipes (its process starts at its launch: see
        :class:`._launch.Launcher`)."""
        channel, child = open_channel(functools.partial(self._corrupt, worker_id))
        stacks = StackPipe()
        return channel, (*child, stacks.child), stacks

    def _worker_args(self, w: Worker) -> tuple[Any, ...]:
        """What :func:`._worker.run_worker` gets in worker ``w`` (see ``init_worker``)."""
        assert w.child_pipes is not None
        requests, replies, stacks = w.child_pipes
        return (
            w.id,
            self.num_workers,
            self._seed,
            self._per_batch_seeds,
            self._cells,
            os.getpid(),
            (requests, replies),
            stacks,
        )

    def _is_up(self, w: Worker) -> bool:
        """Whether this generation's process of ``w`` ran its initializer."""
        process = w.process
        return process is not None and int(self._cells.started[w.id]) == process.pid

    def fork_here(self) -> None:
        """Under ``'fork'`` (a :class:`._context.ForkContext`): fork every worker that has no
        process from this thread now, where that is safe (``_zygote.fork_unsafe_reason``: any
        other thread, a daemon too, makes it unsafe), all before any is waited for; else say
        once why they start through the fallback (their launch, from a thread, does). Called
        as an epoch begins (:meth:`load`) and by :meth:`start`: the workers see the program as
        it is then, as torch's forked workers do. A no-op for other contexts, and once every
        worker has a process. Never raises: a fork that fails (EAGAIN, ENOMEM) leaves its
        worker, with new pipes, to its launch."""
        if not self._fork or _FORK is None or self._closed:
            return
        waiting = [w for w in self._workers if w.process is None]
        if not waiting:
            return
        reason = fork_unsafe_reason(runs_user_code=True)  # daemon threads count too
        if reason is not None:
            self._launcher.not_forked(waiting[0].id, reason)
            return
        try:
            self._launcher.launch_here(waiting, self._worker_args, via=_FORK)
        except Exception as exc:
            workers_log.info("forking workers failed (%s): they start through the fallback", exc)
            self._renew_pipes(waiting)

    def _renew_pipes(self, workers: list[Worker]) -> None:
        """New pipes for each of ``workers`` whose launch failed (the launcher closed its
        pipes): its next launch needs them."""
        for w in workers:
            if w.process is None and w.child_pipes is None:
                w.channel.close()
                w.stacks.close()
                self._renew(w)

    def _renew(self, w: Worker) -> None:
        """New pipes for worker ``w``, whose old ones were closed; none once the pool is closed.
        Made and given to ``w`` under the lock :meth:`close` marks the pool closed under: a
        close on another thread either comes first (nothing is made) or finds the new pipes
        on ``w`` and closes them. Checked without the lock, a close landing between the
        check and the assignment closed the old pipes only, and the new ones stayed open for
        the pool's life."""
        with self._launch_lock:
            if not self._closed:
                w.channel, w.child_pipes, w.stacks = self._new_worker(w.id)

    def launch(self) -> None:
        """Start every worker's process now, without waiting until it is ready (from the
        forked server, blocking while they are forked, in order: call it from a thread; else
        each on a thread of its own). :meth:`start` waits for them; a job waits for its own
        worker only."""
        self._launcher.launch_all(self._workers, self._worker_args)

    def start(self) -> None:
        """Start every worker and wait until each has run its initializer (blocking: call it
        from a thread). Without it, workers start at their first job. Their dataset copy comes
        with their first job (see :meth:`load`).

        Raises:
            WorkerInitError: a worker did not start within the start deadline (it is killed),
                or got no process within the launch deadline.
        """
        self.fork_here()  # under 'fork': from here, where that is safe
        launches = self._launcher.launch_all(self._workers, self._worker_args)
        for w, launch in zip(self._workers, launches, strict=True):
            if launch is not None:
                self._launcher.wait(w, launch)
            generation, process = w.generation, w.process
            if process is None:  # closed meanwhile (by another thread)
                raise RuntimeError("the worker pool is closed")
            while not self._is_up(w) and w.generation == generation:
                left = w.launched + self._start_timeout - time.monotonic()
                if left <= 0:
                    if self._stop_hung_start(w, generation):
                        assert w.hang is not None
                        raise WorkerInitError(w.hang.message(None)) from None
                    break
                if connection.wait([process.sentinel], min(left, _START_CHECK_S)):
                    break  # it died while starting: its first job tells how

    def load(self, make: Callable[[], Payload], epoch: int, copy_id: int = 0, **seeds: Any) -> None:
        """Give the workers a new dataset copy: ``make()`` pickles it (once, in a thread, from
        now on); each worker loads it before its next job of ``copy_id``
        (one per loader sharing the pool, with its own seeds). Thread-safe. The one before the
        current one of ``copy_id`` is released: no worker can have its load queued. Under
        ``'fork'``, the workers without a process are forked first (:meth:`fork_here`), before
        the pickling's thread starts."""
        self.fork_here()
        copy = DatasetCopy(make, epoch, copy_id, **seeds)  # seed=, per_batch_seeds= if given
        with self._launch_lock:
            retired = self._retired.pop(copy_id, None)
            current = self._copies.get(copy_id)
            if current is not None:
                self._retired[copy_id] = current
            self._copies[copy_id] = copy
        if retired is not None:
            retired.release()
        copy.start()

    def copy_given(self, copy_id: int = 0) -> bool:
        """Whether dataset copy ``copy_id`` was given (:meth:`load`) and not released."""
        return copy_id in self._copies

    def release(self, copy_id: int) -> None:
        """Forget copy ``copy_id`` (its loader closed): workers drop it, soon on the loop of their
        pipes if one runs, else before their next job. Thread-safe."""
        with self._launch_lock:
            copies = [self._copies.pop(copy_id, None), self._retired.pop(copy_id, None)]
        for copy in filter(None, copies):
            copy.release()  # a load still queued fails, then the drop behind it runs
        for w in self._workers:
            w.drops.append(copy_id)
            loop = w.channel.loop
            if loop is not None and not self._closed:
                with contextlib.suppress(RuntimeError):  # the loop is closed: the next job
                    loop.call_soon_threadsafe(self._drop_released, w, loop)

    def _drop_released(self, w: Worker, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Tell worker ``w`` to drop the released copies it holds (on its pipes' loop)."""
        if loop is not None and w.channel.loop is not loop:
            return  # the pipes moved to another loop meanwhile: the next job does it there
        while w.drops:
            copy_id = w.drops.pop()
            if w.loaded.pop(copy_id, None) is not None:
                with contextlib.suppress(BrokenProcessPool):  # dead: the copy went with it
                    w.channel.post(drop_copy, copy_id)

    def _loaded_everywhere(self, w: Worker, copy_id: int, copy: DatasetCopy) -> None:
        """Worker ``w`` answered a job after loading ``copy``: once every worker running has,
        none can still have a load of the copy before it queued, which is released now (its
        segment unlinked) rather than at the next :meth:`load`. ``copy`` itself stays: a
        replacement worker loads that snapshot of the epoch's dataset again."""
        copy.loaded_by(id(w), w.generation)
        if copy_id not in self._retired:
            return
        if not all(
            x.process is None or copy.was_loaded_by(id(x), x.generation) for x in self._workers
        ):
            return
        with self._launch_lock:
            retired = self._retired.get(copy_id)
            if retired is None or self._copies.get(copy_id) is not copy:
                return
            del self._retired[copy_id]
        retired.release()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` began: jobs still running fail then, their workers not
        yet stopped."""
        return self._closed

    def pids(self) -> list[int]:
        """Pids of the worker processes started so far."""
        return [w.process.pid for w in self._workers if w.process is not None]

    def _pick(self) -> Worker:
        # Not a worker whose launch is overdue while another will do: it fails jobs at once.
        return min(self._workers, key=lambda w: (_overdue(w), w.outstanding))

    async def submit(
        self,
        fn: Callable[[J], R] | Callable[[J], Packed[R]],
        job: J,
        *,
        batch_id: int,
        worker: int | None = None,
        on_abandon: Callable[[], None] | None = None,
        resubmit_innocent: bool = True,
        copy_id: int = 0,
        tag: int | None = None,
        hang_after: float | None = None,
    ) -> R:
        """Run ``fn(job)`` in a worker and await its reply without blocking the loop.

        A worker that has not loaded the current dataset copy (:meth:`load`) gets it first, on
        the same pipe, so the job runs with it. A job that was only queued behind a job that
        crashed its worker is resubmitted to the rebuilt worker (it did nothing wrong); the job
        the worker was running when it died gets :class:`WorkerCrashedError`. If the awaiting
        task is cancelled while the job runs, ``on_abandon`` is called once the worker is
        really done with it (so a shared-memory slot is never reused while a worker may still
        write into it).

        A worker that dies before it answered any job is started afresh, at most
        :data:`MAX_START_FAILURES` times in a row; then its jobs fail with
        :class:`WorkerInitError` rather than loop through process starts forever.

        Args:
            fn: what the worker runs (a module-level function: it is pickled by reference).
            job: its argument.
            batch_id: the batch the job makes, for errors.
            worker: the worker to run it on (a stream's own); None picks the least loaded.
            on_abandon: called once the worker is done with a job whose awaiting task was
                cancelled.
            resubmit_innocent: resubmit a job that was only queued behind a crash.
            copy_id: the dataset copy the job runs with (its loader's, on a shared pool).
            tag: what the worker publishes while it runs the job (``_records.running_tag``), if
                it publishes one: a crash is blamed on the job whose tag it published. None:
                ``running_tag(copy_id, batch_id)``.
            hang_after: the batch deadline, if any: a job given up while it runs is watched
                under it (:func:`._death.watch_abandoned`).

        Raises:
            WorkerCrashedError: the worker died while running this job.
            WorkerInitError: the worker keeps dying while it starts.
            TypeError: the dataset copy cannot be pickled (names what).
        """
        if tag is None:
            tag = running_tag(copy_id, batch_id)
        while True:
            if self._closed:
                raise RuntimeError("the worker pool is closed")
            w = self._workers[worker] if worker is not None else self._pick()
            generation = w.generation
            channel = w.channel
            job_id: int | None = None
            w.outstanding += 1
            try:
                if w.process is None:  # its launch, waited for off the loop
                    await self._launcher.launched(w, self._worker_args, batch_id)
                    if self._closed:
                        raise RuntimeError("the worker pool is closed")
                    generation, channel = w.generation, w.channel
                if w.drops:
                    self._drop_released(w)
                copy = self._copies.get(copy_id)
                while copy is not None and w.loaded.get(copy_id) is not copy:
                    load = await copy.job()  # raises the TypeError of an unpicklable copy
                    current = self._copies.get(copy_id)
                    if current is not copy:
                        # A newer copy was given while this one was pickled: that one, the
                        # current, is what the job runs with (the older may be released).
                        # Bounded: a copy is given once an epoch.
                        copy = current
                        continue
                    if w.loaded.get(copy_id) is not copy and w.generation == generation:
                        # Ahead of the job; its failures show in it, its hang in _reply.
                        w.load_job = channel.post(load_copy, load)
                        w.loaded[copy_id] = w.last_load = copy
                    break
                job_id, future = channel.send(fn, job)
                result: R = await self._reply(w, generation, future)
                if w.generation == generation:
                    w.served = True
                    w.failed_starts = 0
                    if copy is not None and w.loaded.get(copy_id) is copy:
                        self._loaded_everywhere(w, copy_id, copy)
                return result
            except BrokenProcessPool as exc:
                if self._closed:
                    raise RuntimeError("the worker pool was closed") from exc
                # Reading the dead worker's exit status waits for threads: do the waiting off
                # the loop, then the bookkeeping on it (no race with other jobs' submits).
                # A worker whose reply pipe carried garbage was killed as the channel saw it
                # (_corrupt): this waits for that death too.
                if w.generation == generation:
                    try:
                        await off_loop(self._deaths.reap, w.process)
                    except asyncio.CancelledError:
                        # Released once the worker is done with the job: now, as it is dead
                        # (one killed for garbage: once the channel sees it dead).
                        if job_id is not None:
                            channel.abandon(job_id, on_abandon)
                        elif on_abandon is not None:
                            on_abandon()
                        raise
                crash = self._deaths.crashed(w, generation)  # the worker replaced
                error = crash.error(batch_id, tag, resubmit_innocent=resubmit_innocent)
                if error is None:
                    continue  # innocent: to the replacement
                raise error from exc
            except asyncio.CancelledError:
                if job_id is not None:  # on_abandon runs once the worker is done with it
                    channel.abandon(job_id, on_abandon)
                    if hang_after is not None and not channel.answered(job_id):
                        watch_abandoned(w, job_id, tag, hang_after, self._cells.current)
                elif on_abandon is not None:  # cancelled before it was sent
                    on_abandon()
                raise
            finally:
                w.outstanding -= 1

    async def _reply(self, w: Worker, generation: int, future: asyncio.Future[R]) -> R:
        """Await a job's reply; while its worker starts (ahead of the job), under the start
        deadline: past it the worker is killed, and the job fails like every job it held.

        Cancelled while it watches, it leaves the future to :meth:`submit` (which abandons the
        job), having retrieved an outcome that came meanwhile: unlike ``await future``,
        ``asyncio.wait`` neither cancels the future nor retrieves its exception.
        """
        try:
            while not future.done():
                left = self._start_left(w, generation)
                if left is None:
                    break  # started: the batch's own deadline (if any) watches the rest
                if left <= 0:
                    # Off the loop: taking the stack waits for the worker to write it.
                    await off_loop(self._stop_hung_start, w, generation)
                    break  # the job now fails with BrokenProcessPool (see submit)
                await asyncio.wait([future], timeout=min(left, START_POLL_S))
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                future.exception()  # retrieved: nobody will await it now
            raise
        return await future

    def _start_left(self, w: Worker, generation: int) -> float | None:
        """Seconds left before worker ``w`` passes its start deadline; ``inf`` while a copy
        it was sent waits behind other jobs (its clock has not begun); None once it started,
        or if it is another generation now, or its hang is being dealt with, or it has no
        process (a job is sent once its launch ended: one that failed fails the job)."""
        if w.generation != generation or w.stopping or w.process is None:
            return None
        if not self._is_up(w):
            since = w.launched  # the process itself is starting
        elif w.load_job is not None and not w.channel.answered(w.load_job):
            since = float(self._cells.loading[w.id])  # the worker publishes when its load began
            if not since:
                return float("inf")
        else:
            w.load_job = None
            return None
        return since + self._start_timeout - time.monotonic()

    def _stop_hung_start(self, w: Worker, generation: int) -> bool:
        """Worker ``w`` passed its start deadline: take its stack, kill it, fail its jobs.
        Blocking (call it off the loop). False if it is gone or taken care of already."""
        with w.lock:
            process = w.process
            if w.generation != generation or w.stopping or process is None:
                return False
            initialized = self._is_up(w)
            loading = float(self._cells.loading[w.id])
            w.stopping = True  # the other jobs' watches leave it to this one
        pid = int(process.pid)
        epoch = w.last_load.epoch if w.last_load is not None and loading else None
        when = (self._start_timeout, self._start_setting)
        head = describe_start(w.id, pid, when, initialized=initialized, loading_epoch=epoch)
        stack = take_stack(pid, w.stacks) if initialized else ""
        w.hang = Hang(head, stack)
        w.killed = True  # its death is ours: see _death.Deaths.crashed
        kill(pid)
        w.channel.fail_threadsafe(f"the worker was killed: it hung while starting ({head})")
        workers_log.warning("worker process pid %d killed: %s", pid, head)
        return True

    def _replace(self, w: Worker) -> None:
        """Worker ``w``'s process died (its death recorded: ``_death.Deaths.crashed``): new
        pipes for the next one, which its next job launches."""
        if w.process is not None:
            self._deaths.exits.discard(w.process)
        w.channel.close()
        _close_pipes(w.child_pipes)
        w.stacks.close()
        self._cells.loading[w.id] = 0.0  # a killed worker's load never ended
        w.generation += 1
        w.process = None
        self._cells.started[w.id] = 0
        w.served = False
        w.killed = False
        w.loaded = {}  # the replacement gets the current copies before its first jobs
        w.last_load = None
        w.drops = []
        w.load_job = None
        w.stopping = False
        w.hang = None
        self.rebuilds += 1
        self._renew(w)

    def _corrupt(self, worker_id: int, channel: Channel, why: str) -> None:
        """Worker ``worker_id``'s reply pipe ``channel`` carried garbage (``why``): kill the
        worker now, not when a job next goes to it. It may be running a job given up, writing
        into that job's slot; the channel releases such a job once the death is seen."""
        w = self._workers[worker_id]
        if w.channel is channel:  # else a process replaced already
            kill_corrupt(w, why)

    def is_running(self, tag: int) -> bool:
        """Whether a worker runs the job tagged ``tag`` now (not merely queued)."""
        return any(int(self._cells.current[w.id]) == tag for w in self._workers)

    def kill_holding(self, tag: int) -> int | None:
        """Kill the worker running the job tagged ``tag`` (hung); returns its pid."""
        for w in self._workers:
            if int(self._cells.current[w.id]) == tag and w.process is not None:
                return w.kill()
        return None

    def close(self) -> None:
        """Stop every worker: let current jobs end for a moment, then kill. Idempotent in
        effect: each step can be done again, so a close interrupted (a second Ctrl-C while it
        joins busy workers) is finished by the next call rather than left half done."""
        with self._close_lock:  # re-entrant: a SIGTERM handler may close amid a close here
            with self._launch_lock:
                if self._closed_all:
                    return
                self._closed = True
                copies = [*self._copies.values(), *self._retired.values()]
            self._launcher.close(self._workers)
            grace = time.monotonic() + SHUTDOWN_GRACE_S
            for w in self._workers:  # a launch under way (another thread's) finishes first
                if w.lock.acquire(timeout=max(0.0, grace - time.monotonic())):  # stalled server
                    w.lock.release()
            for copy in copies:
                copy.release()
            for w in self._workers:  # end-of-file: each worker's serve loop returns
                w.channel.close()
                _close_pipes(w.child_pipes)
                w.child_pipes = None
                w.stacks.close()
            processes = [w.process for w in self._workers if w.process is not None]
            deadline = time.monotonic() + SHUTDOWN_GRACE_S
            for p in processes:
                if p.exitcode is None:  # a process is reaped once: an earlier call may have
                    self._deaths.join(p, max(0.0, deadline - time.monotonic()))
                if p.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
                    self._deaths.join(p, 5.0)
            self._deaths.exits.close()  # before the sentinels close
            # Release each process's pipes now, not when the process object is collected: an
            # error the user keeps holds this pool through its traceback (a frame of submit),
            # and with it every worker's last process.
            for w in self._workers:
                p, w.process = w.process, None
                if p is not None:
                    with contextlib.suppress(ValueError):  # still running after the kill
                        p.close()
            self._closed_all = True


def _overdue(w: Worker) -> bool:
    return w.pending is not None and w.pending.reported


def _close_pipes(pipes: tuple[Connection, ...] | None) -> None:
    for end in pipes or ():
        end.close()
