"""WorkerPool: one set of worker processes that several loaders share.

A training loop that also evaluates holds two loaders, and by default each starts its own
workers and its own shared-memory slot pool: twice the processes, twice the start-up, two
budgets of ``/dev/shm`` that know nothing of each other. A :class:`WorkerPool` is made once and
passed as ``DataLoader(..., workers=pool)``::

    with WorkerPool(num_workers=4) as pool:              # the processes start here, once
        train = DataLoader(train_set, batch_size=64, shuffle=True, workers=pool,
                           persistent_workers=True)
        val = DataLoader(val_set, batch_size=256, workers=pool)
        for epoch in range(epochs):
            for batch in train: ...
            for batch in val: ...                         # train's copies stay loaded

What is shared and what is not::

    WorkerPool ─── worker processes (_workers.WorkerPool: start, crashes, rebuilds, close)
      │        ├── one SlotPool: one shared-memory budget (shm_max_bytes) for every loader
      │        └── one private event loop for every loader's `for` (LoopThread)
      ├─ loader A ── SharedRunner(copy_id=1) ── its own Receiver, prefetch, deadlines
      └─ loader B ── SharedRunner(copy_id=2) ── likewise

Each loader's dataset copy lives in every worker beside the others', under its copy id, with
its own seed, ``worker_init_fn`` and :class:`~aioloader.WorkerInfo` (see ``_workers._worker``):
loader B's epoch neither evicts nor reloads loader A's copy; A's own ``persistent_workers=False``
renews A's copy each epoch, as it would in its own workers. Closing a loader drops its copy in
the workers (:meth:`SharedRunner.close`) and leaves the pool running; closing the pool (or the
end of the program, or a SIGTERM, through ``_resources.close_all_at_exit``) stops the workers,
and a loader used afterwards raises at its next epoch.

Failures stay each loader's own: a worker publishes the copy id with the batch it runs, so a
crash is reported to the loader whose batch killed it (:class:`~aioloader.WorkerCrashedError`
naming batch and pid), and the other loader's jobs that the dead worker held are resubmitted
to its replacement, as every innocent job is.

Sharp edges:
- Every loader of a pool runs its jobs from one event loop at a time: the workers' pipes are
  watched by one loop. ``for`` over any of them runs on the pool's one private loop, so train
  and eval ``for`` loops interleave freely; ``async for`` over them runs on the caller's loop.
  Mixing both at once (one loader ``async for`` while another is mid-``for``) is refused with
  a ``RuntimeError`` naming the cause.
- ``worker_restarts`` and the shared-memory numbers of each loader's ``statistics()`` are the
  pool's: the processes and slots are one.
- The slots are not registered as page-locked memory for a loader's ``device`` (the loaders
  may use different devices, or none): device copies go through pinned staging.
- With ``worker_seeding='worker'`` the copies in one worker share the process's ``random``,
  numpy and torch generators: a loader's draws then also depend on the other loaders' batches.
  The default ``'batch'`` reseeds before every batch from the loader's seed, epoch and batch.
- A stream (iterable dataset) lives in its worker: a crash caused by another loader ends that
  worker's stream of this loader with ``WorkerCrashedError``, as a crash of its own would.
- A pickled loader (Lightning's ``ddp_spawn``) arrives without the pool; it starts workers of
  its own, as many as the pool had.
- A process forked from one that used the pool (Lightning's ``ddp_fork``) has a copy of it
  that starts workers, slots and a loop of the child's own at its first use, leaving the
  parent's to the parent (:meth:`WorkerPool._leave_parent`); a pool closed before the fork is
  closed in the child too.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any

from .. import _shm
from .. import _validate as check
from .._config import LoaderConfig, context_argument
from .._errors import out_of_descriptors_note
from .._sampling import rank_seed
from .._threads import LoopThread, off_loop
from .._types import Runner

if TYPE_CHECKING:
    from .._device import DeviceStage
from .._workers import (
    DEFAULT_START_TIMEOUT_S,
    Payload,
    ProcessRunner,
    hold_server,
    preload_pickler,
    resolve_context,
    starts_through_pythons_forkserver,
    sweep_unclaimed,
    warn_more_workers_than_cpus,
)
from .._workers import WorkerPool as Processes
from ._closing import close_soon, forked_lock, keep_inherited

__all__ = [
    "SharedRunner",
    "WorkerPool",
    "WorkerPoolStatistics",
    "close_pools",
    "forked_server_note",
    "private_pool",
    "refuse_parents_forkserver",
    "shared_pool",
    "start_deadline",
    "worker_context",
]


@dataclass(frozen=True, slots=True)
class WorkerPoolStatistics:
    """A snapshot of a :class:`WorkerPool`.

    Attributes:
        num_workers: worker processes in the pool.
        worker_pids: pids of the workers started so far.
        loaders: loaders attached now (those that ran an epoch and are not closed).
        worker_restarts: workers replaced after a crash or a kill, whichever loader's batch.
        live_shm_slots: shared-memory segments alive, of every loader.
        leased_shm_slots: segments lent to a worker for a batch it is making.
        held_shm_slots: segments holding batches that a consumer still holds.
        shm_bytes: bytes of all segments.
        shm_max_bytes: the budget they share (0: batches travel pickled).
    """

    num_workers: int
    worker_pids: tuple[int, ...]
    loaders: int
    worker_restarts: int
    live_shm_slots: int
    leased_shm_slots: int
    held_shm_slots: int
    shm_bytes: int
    shm_max_bytes: int


class SharedRunner(ProcessRunner):
    """One loader's :class:`~aioloader._types.Runner` over a shared pool: its jobs name its
    dataset copy, its copies carry its seeds, and closing it releases its copy, not the pool.

    Args:
        processes: the pool's worker processes.
        slots: the pool's slot pool (None: batches travel inline).
        config: the loader's settings (prefetch, seed, worker seeding).
        copy_id: this loader's copy id in the workers.
        on_close: called once when the runner is closed (the pool forgets the loader).
        unclaimed_own: the pool's set of segment names to sweep once its workers are stopped
            (closing one loader leaves the workers running: what they make for its given-up
            jobs is unlinked when they are done, or else when the pool closes; what they made
            for batches nobody read, a SIGTERM having stopped the loop, when the pool closes).
    """

    def __init__(
        self,
        processes: Processes,
        slots: _shm.SlotPool | None,
        config: LoaderConfig,
        copy_id: int,
        on_close: Callable[[], None],
        unclaimed_own: set[str],
        *,
        no_room: bool = False,
    ) -> None:
        super().__init__(
            processes,
            slots,
            config.prefetch,
            copy_id=copy_id,
            unclaimed_own=unclaimed_own,
            no_room=no_room,
            timeout=config.timeout,
        )
        self._seed = config.seed
        self._per_batch_seeds = config.worker_seeding == "batch"
        self._on_close: Callable[[], None] | None = on_close

    def load(self, make: Callable[[], Payload], epoch: int, seed: int | None = None) -> None:
        """Give the workers this loader's next dataset copy, with its own seeds (``seed``, else
        the loader's, for this rank: see ``_distributed.rank_seed``)."""
        self.pool.load(
            make,
            epoch,
            self.copy_id,
            seed=rank_seed(self._seed) if seed is None else seed,
            per_batch_seeds=self._per_batch_seeds,
        )

    def close(self) -> None:
        """Release this loader's copy in the workers; the pool keeps running. Idempotent."""
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


@dataclass(slots=True, eq=False, weakref_slot=True)  # identity: kept in a WeakSet
class _Held:
    """What a :class:`WorkerPool` holds, apart from the pool object (so a finalizer can
    release it without keeping the pool alive)."""

    processes: Processes
    shm_max_bytes: int | None
    private: bool = False  # a loader's own pool (no ``workers=``): closed with its loader
    slots: _shm.SlotPool | None = None
    slots_made: bool = False
    no_room: bool = False  # no slot pool for want of room in /dev/shm (not shm_max_bytes=0)
    loop_thread: LoopThread | None = None
    attached: set[int] = field(default_factory=set)  # copy ids of the loaders attached now
    # Segment names every loader's workers were told to make whose batch was not taken in
    # (given up while a worker may still make it, or never read): swept at close once the
    # workers are stopped (ProcessRunner).
    unclaimed_own: set[str] = field(default_factory=set)
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    closed: bool = False  # nothing new is started from now on
    released: bool = False  # every step of close() done
    lock: threading.Lock = field(default_factory=threading.Lock)
    pid: int = field(default_factory=os.getpid)  # the process the pool belongs to
    # Lets go of the forked worker server once the workers are stopped (``hold_server``): the
    # last pool to close ends it, so no process of the loader outlives the pools.
    let_go_server: Callable[[], None] | None = None

    def slot_pool(self, device: DeviceStage | None = None) -> _shm.SlotPool | None:
        """The one slot pool, made at the first loader's first epoch (under the lock). A
        loader's own pool registers each slot as page-locked memory with the loader's
        ``device`` stage, so device copies read the slots directly; a shared pool does not
        (its loaders may use different devices, or none)."""
        if not self.slots_made:
            self.slots_made = True
            cap = _shm.budget(self.shm_max_bytes) if _shm.shm_available() else 0
            self.no_room = cap <= 0 and _shm.shm_available() and self.shm_max_bytes is None
            if cap > 0:
                # A nearly full /dev/shm gives a cap under the smallest slot: slots that small.
                smallest = min(cap, _shm.MIN_SLOT_BYTES)
                if self.private and device is not None and device.enabled:
                    self.slots = _shm.SlotPool(
                        cap,
                        min_slot_bytes=smallest,
                        on_map=device.register_host_memory,
                        on_unmap=device.unregister_host_memory,
                    )
                else:
                    self.slots = _shm.SlotPool(cap, min_slot_bytes=smallest)
        return self.slots

    def detach(self, copy_id: int) -> None:
        """A loader was closed: the workers drop its copy."""
        with self.lock:
            self.attached.discard(copy_id)
            if self.closed:
                return
        self.processes.release(copy_id)

    def close(self) -> None:
        """Stop the workers, the loop thread and the slot pool (blocking). Idempotent. In a
        forked child, nothing: they are the parent's (see ``_resources.Resources.close``);
        nor is its lock, which a parent's thread may have held as the child forked."""
        if os.getpid() != self.pid:
            self.closed = True
            return
        with self.lock:
            if self.released:
                return
            # Each step below can be done again: a close interrupted (a second Ctrl-C) is
            # finished by the next call, so the parts stay held until they are closed.
            self.closed = True
            loop_thread, slots = self.loop_thread, self.slots
            self.attached.clear()
        _OPEN.discard(self)
        if loop_thread is not None:
            loop_thread.close()
            self.loop_thread = None
        self.processes.close()
        if self.let_go_server is not None:
            self.let_go_server()
        sweep_unclaimed(self.unclaimed_own)  # the workers are stopped: none makes one now
        if slots is not None:
            slots.close()
            self.slots = None
        self.released = True


def start_deadline(config: LoaderConfig) -> tuple[float, str]:
    """Seconds a loader's own worker processes may take to start, and to load each dataset
    copy, with the setting that says so (for errors): ``start_timeout`` if given, else the
    batch ``timeout`` (as in torch, where the first batch's timeout covers the workers'
    start), else :data:`DEFAULT_START_TIMEOUT_S`."""
    if config.start_timeout is not None:
        return config.start_timeout, f"start_timeout={config.start_timeout}"
    if config.timeout is not None:
        return config.timeout, f"timeout={config.timeout}"
    return DEFAULT_START_TIMEOUT_S, "start_timeout not set: the default"


def _start_up_note(exc: OSError, workers: int) -> str | None:
    """What to add to an error from starting the workers when the machine ran out of
    something: descriptors, or room in /dev/shm (where multiprocessing keeps its locks)."""
    where = f"starting {workers} worker processes"
    note = out_of_descriptors_note(exc, where)
    if note is None and exc.errno == errno.ENOSPC and _shm.shm_available():
        note = (
            f"{where}: {_shm.SHM_DIR} is full ({_shm.free_bytes()} bytes free), and "
            "multiprocessing keeps every worker's locks and semaphores there, so no worker can "
            f"start. Free space in {_shm.SHM_DIR}, give it more (docker run --shm-size=...), or "
            "read in this process (num_workers=0, or thread_pool=True)"
        )
    return note


class WorkerPool:
    """Worker processes, a shared-memory budget and a private event loop, made once and shared
    by several :class:`~aioloader.DataLoader` objects (``DataLoader(..., workers=pool)``).

    Each loader keeps its own dataset copy in every worker, with its own ``worker_init_fn``,
    seeds and :func:`~aioloader.get_worker_info`, its own ``prefetch``, ``timeout`` and retries;
    they share the processes and the shared-memory budget. Use it as a context manager
    (``with`` / ``async with`` start the workers; leaving closes them), or call
    :meth:`close` / :meth:`aclose`; without :meth:`start` the workers start at the first batch.
    Closing a loader leaves the pool running; closing the pool stops every loader's workers.

    Args:
        num_workers: worker processes (at least 1).
        multiprocessing_context: ``'forkserver'`` (default), ``'spawn'``, ``'fork'`` or a
            context, as for ``DataLoader``; ``mp_context`` is its other name.
        mp_context: another name for ``multiprocessing_context``.
        allow_fork: fork every worker as it starts, even while threads run (unsafe; you
            insist); without it ``'fork'`` forks only where that is safe, else starts the
            workers through the default start method, with one warning.
        shm_max_bytes: the shared-memory budget of all its loaders together (default: a
            quarter of free /dev/shm, at most 4 GiB); 0 sends every batch pickled.
        start_timeout: seconds a worker may take to start, and to load each loader's dataset
            copy; past it :class:`~aioloader.WorkerInitError` names the worker and its stack.
            None (default): 120 s.

    Raises:
        TypeError: an argument of the wrong type (named).
        ValueError: a bad value (named).
    """

    def __init__(
        self,
        num_workers: int,
        multiprocessing_context: str | BaseContext | None = None,
        *,
        mp_context: str | BaseContext | None = None,
        allow_fork: bool = False,
        shm_max_bytes: int | None = None,
        start_timeout: float | None = None,
    ) -> None:
        self.num_workers = check.positive_int("num_workers", num_workers)
        _, context = context_argument(multiprocessing_context, mp_context)
        self.allow_fork = check.boolean("allow_fork", allow_fork)
        self.shm_max_bytes = (
            None
            if shm_max_bytes is None
            else check.non_negative_int("shm_max_bytes", shm_max_bytes)
        )
        self.start_timeout = check.seconds("start_timeout", start_timeout, positive=True)
        self._context = resolve_context(context, allow_fork=self.allow_fork)
        warn_more_workers_than_cpus(self.num_workers)
        timeout = self.start_timeout
        self._setup(
            DEFAULT_START_TIMEOUT_S if timeout is None else timeout,
            (
                "start_timeout not set: the default"
                if timeout is None
                else f"WorkerPool(start_timeout={timeout})"
            ),
            private=False,
        )

    def _setup(self, start_timeout: float, start_setting: str, *, private: bool) -> None:
        """What every pool holds, a loader's own or one it shares: the processes (not started
        yet), and the record a finalizer and the exit hook release (made again in a forked
        child: :meth:`_leave_parent`)."""
        self._start_deadline = (start_timeout, start_setting)
        try:
            processes = Processes(
                self.num_workers,
                self._context,
                0,  # each loader's copy brings its own seed
                start_timeout=start_timeout,
                start_setting=start_setting,
            )
        except OSError as exc:
            if (note := _start_up_note(exc, self.num_workers)) is not None:
                exc.add_note(note)
            raise
        held = _Held(processes, self.shm_max_bytes, private=private)
        try:
            held.let_go_server = hold_server(self._context)
        except BaseException:  # nothing was started: the pipes go, the pool is left as it was
            processes.close()
            raise
        self._held = held
        _OPEN.add(held)
        self._finalizer = weakref.finalize(self, _finalize, held)

    def _leave_parent(self) -> None:
        """In a process forked from the one whose workers the pool holds (a program that
        forks after using it: Lightning's ``ddp_fork``, ``multiprocessing`` under 'fork'):
        let go of the parent's, and hold a new set of this process's own, started when used,
        as a pool made here would be. The parent's processes, slots, pipes and loop thread are
        kept untouched (``_closing.keep_inherited``): its workers keep serving it. Every
        loader of the pool in this process then attaches anew (``_resources``). A pool closed
        before the fork stays closed. Its lock is not taken: a thread of the parent may have
        held it as the process forked.

        Raises:
            RuntimeError: the workers start through Python's forkserver, the parent's
                (:func:`refuse_parents_forkserver`), or cannot be started from here now
                (their server must be forked from this process, which other threads make
                unsafe); says so.
        """
        held = self._held
        if held.pid == os.getpid() or held.closed:
            return
        with forked_lock():
            held = self._held
            if held.pid == os.getpid() or held.closed:
                return
            refuse_parents_forkserver(self._context, held.pid)
            self._finalizer.detach()  # this process's record of the parent's pool
            keep_inherited(held)
            try:
                self._setup(*self._start_deadline, private=held.private)
            except RuntimeError as exc:
                exc.add_note(forked_server_note(held.pid))
                raise

    @property
    def multiprocessing_context(self) -> BaseContext:
        """The multiprocessing context the workers start from."""
        return self._context

    mp_context = multiprocessing_context

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` or :meth:`aclose` was called (or the program is ending)."""
        return self._held.closed

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """Pids of the worker processes started so far (empty once closed)."""
        held = self._held
        if held.closed or held.pid != os.getpid():  # a forked child's copy: the parent's
            return ()
        return tuple(held.processes.pids())

    def start(self) -> None:
        """Start every worker now and wait until each is ready (blocking).

        Raises:
            RuntimeError: the pool is closed.
            WorkerInitError: a worker did not start within ``start_timeout`` (it was killed).
        """
        self._leave_parent()
        self._check_open()
        self._held.processes.start()

    async def astart(self) -> None:
        """:meth:`start`, off the event loop."""
        await off_loop(self.start)

    def close(self) -> None:
        """Stop the workers and release the shared memory (blocking). Loaders that use the
        pool raise at their next epoch; close them too. Idempotent."""
        self._held.close()
        self._finalizer.detach()

    async def aclose(self) -> None:
        """:meth:`close`, off the event loop."""
        try:
            await off_loop(self.close)
        except asyncio.CancelledError:
            self.close()  # cancelled while waiting: finish the job here, then go
            raise

    def __enter__(self) -> WorkerPool:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> WorkerPool:
        try:
            await self.astart()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def statistics(self) -> WorkerPoolStatistics:
        """A snapshot: workers, attached loaders, restarts and the shared memory of all."""
        held = self._held
        slots = held.slots.stats() if held.slots is not None else None
        return WorkerPoolStatistics(
            num_workers=self.num_workers,
            worker_pids=self.worker_pids,
            loaders=len(held.attached),
            worker_restarts=held.processes.rebuilds,
            live_shm_slots=slots.slots if slots is not None else 0,
            leased_shm_slots=slots.leased if slots is not None else 0,
            held_shm_slots=slots.held if slots is not None else 0,
            shm_bytes=slots.bytes_total if slots is not None else 0,
            shm_max_bytes=slots.max_bytes if slots is not None else 0,
        )

    def __repr__(self) -> str:
        held = self._held
        state = " closed" if held.closed else ""
        return (
            f"<WorkerPool num_workers={self.num_workers} "
            f"({self._context.get_start_method()}) loaders={len(held.attached)}{state}>"
        )

    # -- what loaders use (through ``_resources``) -------------------------------------------

    def _check_open(self) -> None:
        if self._held.closed:
            raise RuntimeError(
                f"the WorkerPool this loader uses (workers={self!r}) is closed: its worker "
                "processes are gone. Make a new pool and new loaders, or close the pool last"
            )

    def attach(
        self, config: LoaderConfig, current: Runner | None, device: DeviceStage | None = None
    ) -> Runner:
        """The runner of a loader with ``config``: ``current`` if it has one, else a new one
        with a copy id of its own. ``device``: the loader's device stage, whose page-locked
        memory a loader's own pool makes its slots (see :meth:`_Held.slot_pool`).

        Raises:
            RuntimeError: the pool is closed (the message says so, naming it).
        """
        self._leave_parent()
        held = self._held
        with held.lock:
            self._check_open()
            if current is not None:
                return current
            copy_id = next(held.ids)
            held.attached.add(copy_id)
            return SharedRunner(
                held.processes,
                held.slot_pool(device),
                config,
                copy_id,
                functools.partial(held.detach, copy_id),
                held.unclaimed_own,
                no_room=held.no_room,
            )

    def loop(self) -> LoopThread:
        """The private event loop that every ``for`` over the pool's loaders runs on.

        Raises:
            RuntimeError: the pool is closed.
        """
        self._leave_parent()
        held = self._held
        with held.lock:
            self._check_open()
            if held.loop_thread is None:
                held.loop_thread = LoopThread()
            return held.loop_thread


def private_pool(config: LoaderConfig, context: BaseContext) -> WorkerPool:
    """The pool a loader without ``workers=`` makes for itself at its first epoch (or as it is
    made, to start its workers early), and attaches to exactly as to a pool it is given: one
    holder of processes, slots and budget, one finalizer, one exit hook, whoever made it. It
    is the loader's alone: closed with the loader (``_resources``), started and sized by the
    loader's own settings, its slots page-locked for the loader's device; the loader warned
    about more workers than CPUs already."""
    pool = WorkerPool.__new__(WorkerPool)
    pool.num_workers = config.num_workers
    pool.allow_fork = False  # decided by resolving ``context`` already
    pool.shm_max_bytes = config.shm_max_bytes
    pool.start_timeout = config.start_timeout
    pool._context = context
    pool._setup(*start_deadline(config), private=True)
    return pool


def forked_server_note(parent: int) -> str:
    """What to add to an error from starting a forked child's own workers (``parent``: the
    process it was forked from)."""
    return (
        f"this process ({os.getpid()}) was forked from process {parent}, whose loader it "
        "inherited: its own workers start from a server forked from this process, which is "
        "safe only from its main thread while no other thread of its own runs. Iterate the "
        "loader there first, or use multiprocessing_context='spawn'"
    )


def refuse_parents_forkserver(context: BaseContext, parent: int) -> None:
    """In a process forked from process ``parent``, before it starts workers of its own: refuse
    at once those of Python's own ``forkserver``. That server is the parent's child, and
    ``multiprocessing`` checks that it runs by waiting on it as on a child of its own, which
    fails in this one ("No child processes"), at every worker's start. The default start
    method (workers forked from a server this process forks itself) and ``spawn`` work here.

    The context's own start method is not the test: a ``'fork'`` context whose workers cannot
    be forked from here now (another thread runs) starts them through its fallback, which may
    be that server (``_workers.starts_through_pythons_forkserver``).

    Raises:
        RuntimeError: the workers would start through the standard forkserver; names both pids
            and the fix.
    """
    if not starts_through_pythons_forkserver(context):
        return
    raise RuntimeError(
        f"this process ({os.getpid()}) was forked from process {parent}, whose loader starts "
        "its workers through Python's 'forkserver': that server is the parent's child, and "
        "multiprocessing cannot start workers through it from a forked process. Use the "
        "default start method (multiprocessing_context=None), whose server each process forks "
        "for itself, or 'spawn'; or make the loader (and its WorkerPool) in this process"
    )


def shared_pool(workers: object, *, num_workers: object, thread_pool: object) -> WorkerPool | None:
    """``DataLoader``'s ``workers`` argument, checked with the loader arguments it decides
    (:func:`worker_context` checks the others, once the loader's settings are built): the pool
    decides how many workers there are, so a loader may leave ``num_workers`` out, or give the
    pool's own count.

    Raises:
        TypeError: ``workers`` is not a :class:`WorkerPool`.
        ValueError: the pool is closed, or a loader argument conflicts with it (both named).
    """
    pool = check.instance_or_none("workers", workers, WorkerPool)
    if pool is None:
        return None
    if pool.closed:
        raise ValueError(f"workers={pool!r} is closed; make a new WorkerPool")
    check.decided_by("workers", pool, "num_workers", num_workers, pool.num_workers, unset=0)
    check.decided_by("workers", pool, "thread_pool", thread_pool, False, unset=False)
    return pool


def worker_context(
    pool: WorkerPool | None,
    config: LoaderConfig,
    context: str | BaseContext | None,
    allow_fork: bool,
    dataset: Any = None,
) -> BaseContext:
    """The multiprocessing context a loader's workers start from: the shared pool's, whose
    start method, ``allow_fork``, start deadline and shared-memory budget the loader may leave
    out or give alike; else the loader's own (see ``_workers._context``). By default, before
    the server forks: the pickler that ``dataset`` and the loader's callables need, if they
    come from ``__main__`` (``_workers.preload_pickler``).

    Raises:
        ValueError: a loader argument conflicts with the pool (both named); an unknown
            start method.
    """
    if pool is None:
        if context is None:
            preload_pickler(dataset, config.collate_fn, config.worker_init_fn)
        return resolve_context(context, allow_fork=allow_fork)
    mp_context = pool.multiprocessing_context
    if context is not mp_context:
        given = context.get_start_method() if isinstance(context, BaseContext) else context
        method = mp_context.get_start_method()
        check.decided_by("workers", pool, "multiprocessing_context", given, method)
    check.decided_by("workers", pool, "allow_fork", allow_fork, pool.allow_fork, unset=False)
    check.decided_by("workers", pool, "shm_max_bytes", config.shm_max_bytes, pool.shm_max_bytes)
    check.decided_by("workers", pool, "start_timeout", config.start_timeout, pool.start_timeout)
    return mp_context


# Pools not closed yet: closed at interpreter exit (or SIGTERM) by ``_resources``, after the
# loaders, before Python joins its threads.
_OPEN: weakref.WeakSet[_Held] = weakref.WeakSet()


def close_pools() -> None:
    """Close every pool still open (the end of the program; silent, as for loaders)."""
    for held in list(_OPEN):
        with contextlib.suppress(Exception):
            held.close()


# A forked child (a worker under 'fork') inherits the set: those pools are its parent's.
os.register_at_fork(after_in_child=_OPEN.clear)


def _finalize(held: _Held) -> None:
    """The pool was garbage collected unclosed: warn, then stop its workers (from a thread of
    their own where the collecting thread holds the pool's lock or is its loop thread: see
    ``_closing``)."""
    if held.closed or os.getpid() != held.pid:  # a forked child's copy: the parent's pool
        return
    if held.private:  # its loader was collected too, and warned (``_resources.finalize``)
        close_soon(held.close, held.lock)
        return
    warnings.warn(
        "WorkerPool was not closed; use `with` / `async with`, or call close() / aclose()",
        ResourceWarning,
        stacklevel=2,
    )
    close_soon(held.close, held.lock)
