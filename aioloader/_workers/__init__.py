"""Worker processes: the only module that creates processes.

Each worker is its own single-process :class:`concurrent.futures.ProcessPoolExecutor`, rather
than all workers sharing one pool. That refinement of the design buys the failure contract:

- a dead worker is attributed exactly (pid, exit code or signal), because only its own jobs
  fail with ``BrokenProcessPool``, and only that worker is rebuilt; the others keep running;
- a hung worker can be killed alone when its batch misses its deadline;
- stream (iterable) datasets keep one iterator per worker, which needs jobs routed to a
  chosen worker.

The executor starts the worker, runs its initializer and reports its death; batches do not go
through the executor's queues. Each worker runs one long executor job, a serve loop over two
pipes that the event loop watches directly (:mod:`aioloader._channel`): no thread of the main
process touches a batch on its way, which cuts the main process's cost per job from ~200 us
to ~25 us (what decides the rate of tiny batches).

Data flow of one job::

    main: WorkerPool.submit(fn, job) ──pipe: pickle(job: indices, slot)──▶ worker w
          (least-loaded worker,         ◀──pipe: pickle(Reply: descriptors)── fn(job): read,
           or the one named)                                              collate into the slot

What each worker gets once, at start: the pickled payload (dataset, collate_fn, transforms,
worker_init_fn), its id, the worker count, the base seed, a shared array in which it publishes
the batch it is working on (so a crash names the batch it killed), the main pid (a watchdog
thread makes the worker exit within a second if the main process dies without closing it), and
its ends of the two pipes.

A worker's death shows twice: its pipe reaches end-of-file at once (the usual signal), and the
executor fails the serve job (the backstop, e.g. under ``fork``, where a sibling may hold the
pipe open). Either fails every job the worker held with ``BrokenProcessPool``.

Sharp edges:
- Workers ignore SIGINT: Ctrl-C is the main process's to handle; it then closes the pool.
  Otherwise every worker would print a KeyboardInterrupt traceback mid-batch.
- ``fork`` is refused while threads run (an event loop's executor, a sync iterator's thread):
  a forked child inherits locks held by threads that do not exist in it. ``forkserver`` is the
  default; ``spawn`` works too. Both re-import ``aioloader`` in a fresh interpreter, so the
  forkserver preloads this module (and with it numpy and torch) once.
- A worker that dies while starting (before it answers any job) gets no culprit batch, so its
  jobs would be resubmitted to a fresh worker forever; after ``MAX_START_FAILURES`` such deaths
  in a row they fail with ``WorkerInitError`` instead.
- A worker killed for hanging (``kill_holding``) is not blamed for the jobs queued behind it,
  including a retry of the hung batch itself: they go to its replacement.
- The watchdog treats a zombie main process as dead: a killed process stays a zombie until its
  parent reaps it, and ``kill(pid, 0)`` succeeds on zombies.
- An exception that cannot be pickled would break the pool; jobs catch it and send a
  ``RuntimeError`` carrying the original type name, message and traceback text instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing as mp
import os
import pickle
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np

from .. import _shm
from .._batch import BatchMaker, BatchRequest, annotate
from .._errors import WorkerCrashedError, WorkerInitError
from ._channel import Channel, open_channel, picklable, serve_over

__all__ = [
    "IterJob",
    "MapJob",
    "Reply",
    "WorkerInfo",
    "WorkerPool",
    "get_worker_info",
    "resolve_context",
    "seed_everything",
    "from_wire",
    "take",
    "to_wire",
]

# How often a worker checks that the main process is still alive. Shorter: faster exit of
# orphans; longer: fewer wake-ups. Half a second keeps the 5 s contract with a wide margin.
WATCHDOG_INTERVAL_S = 0.5

# How long close() lets a worker finish its current job before killing it.
SHUTDOWN_GRACE_S = 1.0

# How long to wait for a dead worker's exit status (it names the signal that killed it). The
# status normally arrives within milliseconds; the wait blocks the event loop, so keep it short.
EXIT_STATUS_WAIT_S = 1.0

# How many times in a row a worker may die before it ran any job (an import or unpickling that
# crashes the interpreter, the OOM killer at start-up) before its jobs fail with
# WorkerInitError instead of being resubmitted to yet another fresh worker. Higher: more
# patience with a transient start-up fault; lower: a worker that can never start is reported
# sooner. Each try costs one process start.
MAX_START_FAILURES = 3


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker knows about itself; :func:`get_worker_info` returns it inside a worker.

    Attributes:
        id: the worker's number, ``0 <= id < num_workers``; stable across rebuilds.
        num_workers: how many workers the loader runs.
        seed: the loader's base seed (per-batch seeds derive from it, the epoch and batch id).
        dataset: this worker's copy of the dataset.
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any


@dataclass(slots=True)
class _WorkerState:
    info: WorkerInfo
    maker: BatchMaker
    current: Any  # shared ctypes array: batch id + 1 being worked on, 0 when idle
    init_error: BaseException | None = None
    init_tb: str = ""
    iterator: Iterator[Any] | None = None
    iter_epoch: int = -1
    iter_error: BaseException | None = None  # raised by the next pull, after a partial batch
    info_asked: bool = False


_STATE: _WorkerState | None = None


def get_worker_info() -> WorkerInfo | None:
    """Inside a worker process: its :class:`WorkerInfo`; in the main process: ``None``.

    An iterable dataset uses it in ``__iter__`` to read only its shard. If a dataset never asks,
    the loader shards its stream for it (worker ``k`` keeps items ``k, k + n, k + 2n, ...``) so
    that no item is produced twice.
    """
    if _STATE is None:
        return None
    _STATE.info_asked = True
    return _STATE.info


def seed_everything(seed: int, epoch: int, batch_id: int) -> int:
    """Seed ``random``, ``numpy.random`` and ``torch`` from (seed, epoch, batch id).

    A sample's randomness then depends on which batch it is in, never on which worker ran it or
    how many workers there are. Returns the derived 64-bit seed.

    Runs before every batch, so it must be cheap: the mix is three rounds of splitmix64 in
    Python (~2 us; ``SeedSequence`` costs ~120 us), and torch is seeded through its CPU
    generator (``torch.manual_seed`` also reseeds every accelerator: ~300 us).
    """
    derived = _mix(_mix(_mix(seed) ^ epoch) ^ batch_id)
    random.seed(derived)
    np.random.seed(derived & 0xFFFFFFFF)
    import torch

    torch.default_generator.manual_seed(derived)
    return derived


_MASK64 = 0xFFFFFFFFFFFFFFFF


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


# -- jobs (pickled to the worker) ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MapJob:
    """Make the batch of ``request`` (indices or fetched samples) into ``slot`` if given."""

    request: BatchRequest
    slot: _shm.Slot | None


@dataclass(frozen=True, slots=True)
class IterJob:
    """Pull the next batch of this worker's stream for ``epoch``."""

    epoch: int
    batch_id: int
    batch_size: int
    drop_last: bool
    slot: _shm.Slot | None


@dataclass(frozen=True, slots=True)
class Reply:
    """A worker's answer: a descriptor tree (shared memory) or the batch itself (inline)."""

    batch_id: int
    value: Any
    encoded: bool  # value is an _shm.Encoded tree to open against the job's slot
    nbytes: int  # array bytes in the batch, to size later slots
    skipped: list[tuple[int, str]] = field(default_factory=list)
    read_s: float = 0.0
    collate_s: float = 0.0
    worker_id: int = -1
    pid: int = 0
    end: bool = False  # iterable jobs: the worker's stream is exhausted
    samples: int = 0


def batch_nbytes(batch: Any) -> int:
    """Bytes of the arrays and tensors in a (nested) batch."""
    import torch

    if isinstance(batch, np.ndarray):
        return int(batch.nbytes)
    if isinstance(batch, torch.Tensor):
        return int(batch.element_size() * batch.nelement())
    if isinstance(batch, dict):
        return sum(batch_nbytes(v) for v in batch.values())
    if isinstance(batch, list | tuple):
        return sum(batch_nbytes(v) for v in batch)
    return 0


def _init_worker(
    payload: bytes,
    worker_id: int,
    num_workers: int,
    seed: int,
    current: Any,
    main_pid: int,
    pipes: tuple[Connection, Connection],
) -> None:
    global _STATE, _PIPES
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _PIPES = pipes
    threading.Thread(
        target=_watchdog, args=(main_pid,), name="aioloader-watchdog", daemon=True
    ).start()
    maker: BatchMaker | None = None
    init_fn: Callable[[int], Any] | None = None
    try:
        maker, init_fn = pickle.loads(payload)
    except BaseException as exc:  # reported at the first job, not as a silent crash
        _STATE = _WorkerState(
            WorkerInfo(worker_id, num_workers, seed, None),
            BatchMaker(None, list),
            current,
            exc,
            traceback.format_exc(),
        )
        return
    _STATE = _WorkerState(WorkerInfo(worker_id, num_workers, seed, maker.dataset), maker, current)
    if init_fn is not None:
        try:
            init_fn(worker_id)
        except BaseException as exc:
            _STATE.init_error = exc
            _STATE.init_tb = traceback.format_exc()


_PIPES: tuple[Connection, Connection] | None = None  # this worker's (requests, replies)


def _ping() -> int:
    return os.getpid()


def _serve() -> None:
    """The one executor job a worker runs: serve batches over its pipes until the main process
    closes them (see :mod:`aioloader._channel`)."""
    assert _PIPES is not None, "worker job run outside a worker"
    serve_over(*_PIPES)


def _watchdog(main_pid: int) -> None:
    while True:
        time.sleep(WATCHDOG_INTERVAL_S)
        if not _alive(main_pid):
            os._exit(1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs. A zombie does not: a killed main process stays a zombie until its
    parent reaps it, and ``kill(pid, 0)`` still succeeds on a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - pid reused by another user's process
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):  # no procfs (macOS), or the process just went
        return True
    return state not in (b"Z", b"X")


def _state() -> _WorkerState:
    state = _STATE
    assert state is not None, "worker job run outside a worker"
    if state.init_error is not None:
        exc = state.init_error
        raise WorkerInitError(
            f"worker {state.info.id} (pid {os.getpid()}) failed to start: "
            f"{type(exc).__name__}: {exc}\n{state.init_tb}"
        )
    return state


def run_map_job(job: MapJob) -> Reply:
    """Worker side: make one batch of a map-style dataset."""
    state = _state()
    request = job.request
    state.current[state.info.id] = request.batch_id + 1  # first: the deadline asks for it
    seed_everything(state.info.seed, request.epoch, request.batch_id)
    try:
        try:
            writer = _shm.SlotWriter(_shm.attach(job.slot)) if job.slot is not None else None
            made = state.maker.make(request, writer.alloc if writer is not None else None)
            reply = _reply_from(state, request.batch_id, made.batch, writer)
        except BaseException as exc:
            annotate(exc, f"in worker {state.info.id} (pid {os.getpid()})")
            raise picklable(exc) from None
        return _with_made(reply, made)
    finally:
        state.current[state.info.id] = 0


def _reply_from(
    state: _WorkerState, batch_id: int, batch: Any, writer: _shm.SlotWriter | None
) -> Reply:
    """Encode ``batch`` into the slot behind ``writer``, or send it inline."""
    nbytes = batch_nbytes(batch)
    worker_id, pid = state.info.id, os.getpid()
    if writer is None:
        return Reply(batch_id, to_wire(batch), False, nbytes, worker_id=worker_id, pid=pid)
    encoded = writer.encode(batch)
    if encoded.inline:  # did not fit: inline now, a bigger slot next time
        needed = max(nbytes, encoded.needed_bytes)
        return Reply(batch_id, to_wire(encoded.tree), False, needed, worker_id=worker_id, pid=pid)
    return Reply(batch_id, encoded, True, nbytes, worker_id=worker_id, pid=pid)


@dataclass(frozen=True, slots=True)
class _WireTensor:
    """A CPU tensor travelling inline as its numpy array.

    torch registers a reduction with multiprocessing's pickler that moves every pickled tensor
    into a new shared-memory file and passes its descriptor: for a small batch that costs far
    more than the bytes (it is why tiny batches are slow through torch's own loader). A numpy
    array pickles by value instead; the main process wraps it back without a copy.
    """

    array: Any

    def restore(self) -> Any:
        import torch

        return torch.from_numpy(self.array)


def to_wire(batch: Any) -> Any:
    """Replace CPU tensors with :class:`_WireTensor` so an inline batch pickles by value."""
    import torch

    def leaf(x: Any) -> Any:
        if (
            isinstance(x, torch.Tensor)
            and x.device.type == "cpu"
            and x.layout == torch.strided
            and not x.requires_grad
            and str(x.dtype) not in _NO_NUMPY
        ):
            return _WireTensor(x.numpy())
        return x

    return _shm._map_tree(batch, leaf)


def from_wire(batch: Any) -> Any:
    """Undo :func:`to_wire` (in the main process)."""
    return _shm._map_tree(batch, lambda x: x.restore() if isinstance(x, _WireTensor) else x)


_NO_NUMPY = {"torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2", "torch.complex32"}


def _with_made(reply: Reply, made: Any) -> Reply:
    reply.skipped.extend(made.skipped)
    object.__setattr__(reply, "samples", made.samples)
    object.__setattr__(reply, "read_s", made.read_s)
    object.__setattr__(reply, "collate_s", made.collate_s)
    return reply


def run_iter_job(job: IterJob) -> Reply:
    """Worker side: pull the next batch of this worker's shard of an iterable dataset."""
    state = _state()
    state.current[state.info.id] = job.batch_id + 1  # first: the deadline asks for it
    seed_everything(state.info.seed, job.epoch, job.batch_id)
    try:
        t0 = time.perf_counter()
        try:
            if state.iter_epoch != job.epoch or state.iterator is None:
                state.iterator = _sharded_iter(state)
                state.iter_epoch = job.epoch
                state.iter_error = None
            if state.iter_error is not None:
                pending, state.iter_error = state.iter_error, None
                raise pending
            samples, error = take(state.iterator, job.batch_size)
            if error is not None:
                # A failed stream ends for good (re-iterating would repeat samples). What it
                # produced before the failure is delivered first; the error comes next.
                state.iterator = iter(())
                if not samples:
                    raise error
                state.iter_error = error
        except BaseException as exc:
            state.iterator = iter(())
            annotate(exc, f"in the stream of worker {state.info.id} (pid {os.getpid()})")
            raise picklable(exc) from None
        t1 = time.perf_counter()
        short = len(samples) < job.batch_size and state.iter_error is None
        if not samples or (job.drop_last and short):
            return Reply(
                job.batch_id, None, False, 0, worker_id=state.info.id, pid=os.getpid(), end=True
            )
        try:
            writer = _shm.SlotWriter(_shm.attach(job.slot)) if job.slot is not None else None
            request = BatchRequest(job.epoch, job.batch_id, list(range(len(samples))), raw=samples)
            made = state.maker.make(request, writer.alloc if writer is not None else None)
            reply = _reply_from(state, job.batch_id, made.batch, writer)
        except BaseException as exc:
            annotate(exc, f"in worker {state.info.id} (pid {os.getpid()})")
            raise picklable(exc) from None
        made.read_s += t1 - t0
        return _with_made(reply, made)
    finally:
        state.current[state.info.id] = 0


def _sharded_iter(state: _WorkerState) -> Iterator[Any]:
    state.info_asked = False
    it = iter(state.maker.dataset)
    first = next(it, _END)  # generators run their body (and ask for worker info) only now
    if first is _END:
        return iter(())
    rest = _chain_first(first, it)
    if state.info_asked:
        return rest
    return _every_nth(rest, state.info.id, state.info.num_workers)


def _chain_first(first: Any, it: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from it


def _every_nth(it: Iterator[Any], start: int, step: int) -> Iterator[Any]:
    for position, item in enumerate(it):
        if position % step == start:
            yield item


_END = object()


def take(it: Iterator[Any], n: int) -> tuple[list[Any], BaseException | None]:
    """Up to ``n`` items of ``it``, and the error that stopped it early, if any."""
    out: list[Any] = []
    try:
        for _ in range(n):
            item = next(it, _END)
            if item is _END:
                break
            out.append(item)
    except Exception as exc:
        return out, exc
    return out, None


# -- main side -------------------------------------------------------------------------------


def resolve_context(mp_context: str | BaseContext | None, *, allow_fork: bool) -> BaseContext:
    """The multiprocessing context to start workers with (``forkserver`` unless told).

    Raises:
        ValueError: unknown start method, or ``fork`` while other threads run (unless
            ``allow_fork``).
    """
    if mp_context is None:
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        ctx: BaseContext = mp.get_context(method)
    elif isinstance(mp_context, str):
        if mp_context not in mp.get_all_start_methods():
            raise ValueError(
                f"mp_context={mp_context!r} is not a start method here; "
                f"use one of {mp.get_all_start_methods()}"
            )
        ctx = mp.get_context(mp_context)
    elif isinstance(mp_context, BaseContext):
        ctx = mp_context
    else:
        raise TypeError(f"mp_context must be a start method name or a context, got {mp_context!r}")
    if ctx.get_start_method() == "fork" and not allow_fork:
        # Workers are forked while the loader runs: from the event loop's thread or a helper
        # thread, with the loop's executor and the executors' manager threads alive. A forked
        # child inherits locks those threads may hold and can deadlock, so fork is refused
        # unless the caller insists; counting threads now would not tell what runs at fork time.
        raise ValueError(
            "mp_context='fork' is refused while other threads run: workers are started from "
            f"the event loop or a helper thread ({threading.active_count()} thread(s) now), "
            "and a forked worker inherits their locks and can deadlock. Use 'forkserver' or "
            "'spawn', or pass allow_fork=True."
        )
    if ctx.get_start_method() == "forkserver":
        with contextlib.suppress(Exception):  # only effective before the server starts
            ctx.set_forkserver_preload(["aioloader._workers"])
    return ctx


@dataclass(slots=True)
class _Slot:
    """One worker: its executor, process, pipes and the jobs it holds."""

    id: int
    executor: ProcessPoolExecutor
    channel: Channel
    child_pipes: tuple[Connection, Connection] | None  # the worker's ends, until it starts
    generation: int = 0
    outstanding: int = 0
    process: Any = None
    started: Future[int] | None = None  # the start-up ping: done once the initializer ran
    served: bool = False  # this generation's process answered a job: it started fine
    killed: bool = False  # this generation's process was killed by kill_holding (it hung)
    failed_starts: int = 0  # consecutive generations that died before answering any job


@dataclass(frozen=True, slots=True)
class _Crash:
    worker_id: int
    pid: int | None
    exitcode: int | None
    culprit: int | None  # batch id the worker was running, if any
    failed_starts: int = 0  # the slot's consecutive deaths before answering any job


class WorkerPool:
    """``num_workers`` single-process executors with crash detection and targeted rebuild.

    Args:
        num_workers: how many worker processes.
        context: the multiprocessing context (see :func:`resolve_context`).
        payload: ``pickle.dumps((BatchMaker, worker_init_fn))``, sent to each worker once.
        seed: the base seed each worker derives per-batch seeds from.
    """

    def __init__(self, num_workers: int, context: BaseContext, payload: bytes, seed: int) -> None:
        self.num_workers = num_workers
        self._context = context
        self._payload = payload
        self._seed = seed
        self._current = context.Array(ctypes.c_int64, num_workers, lock=False)
        self._launch_lock = threading.Lock()
        self._workers = [_Slot(i, *self._new_worker(i)) for i in range(num_workers)]
        self._crashes: dict[tuple[int, int], _Crash] = {}
        self._closed = False
        self.rebuilds = 0

    def _new_worker(
        self, worker_id: int
    ) -> tuple[ProcessPoolExecutor, Channel, tuple[Connection, Connection]]:
        """An executor for one worker (its process starts at :meth:`_launch`) and its pipes."""
        channel, child = open_channel()
        executor = ProcessPoolExecutor(
            max_workers=1,
            mp_context=self._context,
            initializer=_init_worker,
            initargs=(
                self._payload,
                worker_id,
                self.num_workers,
                self._seed,
                self._current,
                os.getpid(),
                child,
            ),
        )
        return executor, channel, child

    def _launch(self, slot: _Slot) -> None:
        """Start the worker's process if it has not started: the executor spawns it at the
        first job (a ping), then runs :func:`_serve` on it for the rest of its life."""
        if slot.started is not None:
            return
        with self._launch_lock:
            if slot.started is not None:
                return
            executor, generation, channel = slot.executor, slot.generation, slot.channel
            started = executor.submit(_ping)  # spawns the process, handing it the pipes
            serving = executor.submit(_serve)
            slot.process = next(iter(executor._processes.values()), None)
            if slot.child_pipes is not None:  # the worker has its copies now
                for end in slot.child_pipes:
                    end.close()
                slot.child_pipes = None
            slot.started = started

        def serve_ended(future: Future[None]) -> None:
            # Normally the channel's end-of-file tells first; this covers a worker whose pipe
            # another process still holds open (fork), and a serve loop that failed.
            if slot.generation == generation:
                error = future.exception() if not future.cancelled() else None
                channel.fail_threadsafe(f"the worker stopped serving ({error or 'it exited'})")

        serving.add_done_callback(serve_ended)

    def start(self) -> None:
        """Start every worker and wait until each has run its initializer (blocking: call it
        from a thread). Without it, workers start at their first job."""
        waits = []
        for slot in self._workers:
            self._launch(slot)
            waits.append((slot, slot.generation, slot.started))
        for slot, generation, started in waits:
            assert started is not None
            with contextlib.suppress(Exception):  # a crash shows at the first real job
                started.result()
                if slot.generation == generation:
                    slot.served = True

    def pids(self) -> list[int]:
        """Pids of the worker processes started so far."""
        return [w.process.pid for w in self._workers if w.process is not None]

    def _pick(self) -> _Slot:
        return min(self._workers, key=lambda w: w.outstanding)

    async def submit(
        self,
        fn: Callable[[Any], Reply],
        job: Any,
        *,
        batch_id: int,
        worker: int | None = None,
        on_abandon: Callable[[], None] | None = None,
        resubmit_innocent: bool = True,
    ) -> Reply:
        """Run ``fn(job)`` in a worker and await its reply without blocking the loop.

        A job that was only queued behind a job that crashed its worker is resubmitted to the
        rebuilt worker (it did nothing wrong); the job the worker was running when it died gets
        :class:`WorkerCrashedError`. If the awaiting task is cancelled while the job runs,
        ``on_abandon`` is called once the worker is really done with it (so a shared-memory
        slot is never reused while a worker may still write into it).

        A worker that dies before it answered any job is started afresh, at most
        :data:`MAX_START_FAILURES` times in a row; then its jobs fail with
        :class:`WorkerInitError` rather than loop through process starts forever.

        Raises:
            WorkerCrashedError: the worker died while running this job.
            WorkerInitError: the worker keeps dying while it starts.
        """
        while True:
            if self._closed:
                raise RuntimeError("the worker pool is closed")
            slot = self._workers[worker] if worker is not None else self._pick()
            generation = slot.generation
            channel = slot.channel
            job_id: int | None = None
            slot.outstanding += 1
            try:
                self._launch(slot)
                job_id, future = channel.send(fn, job)
                reply: Reply = await future
                if slot.generation == generation:
                    slot.served = True
                    slot.failed_starts = 0
                return reply
            except BrokenProcessPool as exc:
                if self._closed:
                    raise RuntimeError("the worker pool was closed") from exc
                # Reading the dead worker's exit status waits for threads: do the waiting off
                # the loop, then the bookkeeping on it (no race with other jobs' submits).
                if slot.generation == generation:
                    try:
                        await asyncio.to_thread(_reap, slot.executor, slot.process)
                    except asyncio.CancelledError:
                        if on_abandon is not None:  # the worker is dead: done with the job
                            on_abandon()
                        raise
                crash = self._on_broken(slot, generation)
                if crash.culprit is None and crash.failed_starts >= MAX_START_FAILURES:
                    raise self._start_error(crash, batch_id) from exc
                if crash.culprit != batch_id and resubmit_innocent:
                    continue
                raise self._crash_error(crash, batch_id) from exc
            except asyncio.CancelledError:
                if job_id is not None:  # on_abandon runs once the worker is done with it
                    channel.abandon(job_id, on_abandon)
                raise
            finally:
                slot.outstanding -= 1

    def _on_broken(self, slot: _Slot, generation: int) -> _Crash:
        key = (slot.id, generation)
        crash = self._crashes.get(key)
        if crash is not None:
            return crash
        process = slot.process
        pid = getattr(process, "pid", None)
        exitcode = None
        # The broken executor's manager thread reaps the dead process. A forkserver child's
        # exit status is read from a pipe, once: a second reader at the same time gets EOF and
        # records 255 instead of the signal. So let that thread finish before asking.
        manager = getattr(slot.executor, "_executor_manager_thread", None)
        if manager is not None and manager is not threading.current_thread():
            manager.join(timeout=EXIT_STATUS_WAIT_S)
        if process is not None:
            process.join(timeout=EXIT_STATUS_WAIT_S)
            exitcode = process.exitcode
        culprit: int | None = int(self._current[slot.id]) - 1
        self._current[slot.id] = 0
        if slot.killed:
            # We killed it for hanging: that batch was already reported by its deadline, and
            # a retry of it, submitted here before the death was noticed, is innocent.
            culprit = None
        elif culprit is not None and culprit < 0:
            culprit = None
        if culprit is None and not slot.served and not slot.killed:
            slot.failed_starts += 1  # it died before it answered anything: while starting
        else:
            slot.failed_starts = 0
        crash = _Crash(slot.id, pid, exitcode, culprit, slot.failed_starts)
        self._crashes[key] = crash
        self._replace(slot)
        return crash

    def _replace(self, slot: _Slot) -> None:
        old = slot.executor
        slot.channel.close()
        # No cancel_futures: a broken executor has already failed every job it held, and a
        # cancelled job would look like the awaiting task's own cancellation.
        old.shutdown(wait=False)
        _close_pipes(slot.child_pipes)
        slot.generation += 1
        slot.process = None
        slot.started = None
        slot.served = False
        slot.killed = False
        self.rebuilds += 1
        if not self._closed:
            slot.executor, slot.channel, slot.child_pipes = self._new_worker(slot.id)

    @staticmethod
    def _crash_error(crash: _Crash, batch_id: int) -> WorkerCrashedError:
        how = _describe_exit(crash.exitcode)
        return WorkerCrashedError(
            f"worker {crash.worker_id} (pid {crash.pid}) {how} while making batch {batch_id}; "
            "the worker was replaced and the loader can go on",
            pid=crash.pid,
            exitcode=crash.exitcode,
        )

    @staticmethod
    def _start_error(crash: _Crash, batch_id: int) -> WorkerInitError:
        how = _describe_exit(crash.exitcode)
        return WorkerInitError(
            f"worker {crash.worker_id} (pid {crash.pid}) {how} before it ran any job, "
            f"{crash.failed_starts} times in a row, so batch {batch_id} was not run: the worker "
            "cannot start. Check what a worker does at start: unpickling the dataset, "
            "worker_init_fn, the imports they trigger, and the memory they need."
        )

    def is_running(self, batch_id: int) -> bool:
        """Whether a worker has started ``batch_id`` and not finished it (not merely queued)."""
        return any(int(self._current[w.id]) - 1 == batch_id for w in self._workers)

    def kill_holding(self, batch_id: int) -> int | None:
        """Kill the worker running ``batch_id`` (a hung batch); returns its pid, if any."""
        for slot in self._workers:
            if int(self._current[slot.id]) - 1 == batch_id and slot.process is not None:
                pid = int(slot.process.pid)
                slot.killed = True  # its death is ours: see _on_broken
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                return pid
        return None

    def close(self) -> None:
        """Stop every worker: let current jobs end for a moment, then kill. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:  # end-of-file: each worker's serve loop returns
            w.channel.close()
            _close_pipes(w.child_pipes)
            w.child_pipes = None
        processes = [w.process for w in self._workers if w.process is not None]
        # shutdown() forgets its manager thread even when it does not wait for it; keep them to
        # wait for below.
        managers = [getattr(w.executor, "_executor_manager_thread", None) for w in self._workers]
        for w in self._workers:
            w.executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for p in processes:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.join(timeout=5.0)
        for w in self._workers:
            w.executor.shutdown(wait=True)
        for manager in managers:
            if manager is not None and manager is not threading.current_thread():
                manager.join(timeout=5.0)
        # Release each process's pipes now, not when the process object is collected: an error
        # the user keeps holds this pool through its traceback (a frame of submit), and with it
        # every worker's last process. Only once no manager thread can still touch them.
        for w in self._workers:
            w.process = None
        if all(m is None or not m.is_alive() for m in managers):
            for p in processes:
                with contextlib.suppress(ValueError):  # still running after the kill: leave it
                    p.close()


def _close_pipes(pipes: tuple[Connection, Connection] | None) -> None:
    for end in pipes or ():
        end.close()


def _reap(executor: ProcessPoolExecutor, process: Any) -> None:
    """Wait (bounded) until a broken executor's manager thread has reaped its dead process.

    A forkserver child's exit status is read from a pipe, once: a second reader at the same
    time gets EOF and records 255 instead of the signal. Blocking: call it from a thread.
    """
    manager = getattr(executor, "_executor_manager_thread", None)
    if manager is not None and manager is not threading.current_thread():
        manager.join(timeout=EXIT_STATUS_WAIT_S)
    if process is not None:
        process.join(timeout=EXIT_STATUS_WAIT_S)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        text = f"was killed by {name}"
        if -exitcode == signal.SIGKILL:
            text += " (often the out-of-memory killer: check `dmesg`, lower batch size or workers)"
        return text
    return f"exited unexpectedly with code {exitcode}"
