"""Everything that runs inside a worker process.

A worker process runs :func:`run_worker`: :func:`init_worker` once, then :func:`serve`, a loop
that reads jobs from the worker's request pipe and writes replies to its reply pipe
(:mod:`._channel`) until the main process closes it. The jobs it runs are :func:`load_copy`
(the dataset copy to work with from now on), :func:`run_map_job` and :func:`run_stream_job`;
the last two return a :class:`~aioloader._types.Made` whose batch is a :class:`._records.Parcel`.

What a worker gets once, at start: its id, the worker count, the loader's seed and how to seed
(``'batch'`` or ``'worker'``), a shared array in which it publishes the batch it is working on
(so a crash names the batch it killed, and a deadline can tell "running" from "queued"), one
in which it says it is up, the main pid, and its ends of the two pipes. Its dataset copy
comes later, as a job (:class:`._records.LoadJob`): before its first batch, and again at each
epoch that renews it (``persistent_workers=False``, torch's default). Loading a copy drops the
previous one, seeds the worker (see :mod:`._info`), publishes its :class:`WorkerInfo` (to
torch's API too), and runs ``worker_init_fn``; the process itself, its imports and its
shared-memory mappings stay. The workers of a pool that several loaders share
(:mod:`aioloader._loader._shared_pool`) hold one copy per loader, keyed by a copy id that each job
names: a job of another copy than the last one publishes that copy's worker info first, and
:func:`drop_copy` forgets a closed loader's copy.

Sharp edges:
- What a worker inherits from the process it was forked from (the whole program's objects: torch's
  modules, the model) is out of reach of the garbage collector (``gc.freeze``: here as the
  worker starts, and already in the forked server it comes from). A full collection walks every
  object it tracks, writing to each; in a forked worker each such write copies a shared page,
  so one full collection made every worker a private copy of the program's heap (measured:
  +40 MB and 80 ms per worker, torch imported). The cost: garbage the parent had not yet
  collected when it forked, or that the worker makes of inherited objects, stays for the
  worker's life (a numpy view of a shared segment caught in such a cycle keeps the segment
  mapped). Objects the worker makes from then on, its dataset copy's included, are collected
  as usual; finalizers of the parent's garbage no longer run in workers.
- Workers ignore SIGINT: Ctrl-C is the main process's to handle; it then closes the pool.
  Otherwise every worker would print a KeyboardInterrupt traceback mid-batch.
- A watchdog thread makes the worker exit within :data:`WATCHDOG_INTERVAL_S` of the main
  process's death, even if nobody closed the pipes (a main process killed by SIGKILL). It
  treats a zombie as dead: a killed process stays a zombie until its parent reaps it, and
  ``kill(pid, 0)`` still succeeds on a zombie.
- A failure to unpickle the copy, or an exception from ``worker_init_fn``, does not crash the
  worker: it is reported by each following job, as :class:`~aioloader.WorkerInitError`, until a
  new copy loads.
- A worker that *hangs* while it loads a copy is the main process's to find (see ``_pool``):
  the worker publishes when its load began (a shared array), and answers
  :data:`STACK_SIGNAL` by writing every thread's Python stack (``faulthandler``, from the
  signal handler itself: it works while the main thread is stuck in C code) to a pipe the main
  process reads before it kills the worker.
- ``SystemExit``, ``KeyboardInterrupt`` and the other exceptions that are not ``Exception``
  subclasses, raised while making a batch, travel as :class:`~aioloader.WorkerError` naming
  the batch (:func:`aioloader._batch._make.not_an_exit`): set on the main side's future, they would
  end the training program, and a ``KeyboardInterrupt`` from here is never the user's Ctrl-C.
- A batch that cannot be pickled for the reply (a lock in a sample) is reported by the job
  itself, naming the batch, with the pickling error's own type (:func:`_packed`).
- An exception that cannot be pickled would break the reply; jobs send a ``RuntimeError``
  carrying the original type name, message and traceback text instead.
- A stream whose dataset never reads which worker it is in (neither in ``worker_init_fn`` nor
  while its stream starts, see :mod:`._info`) is sharded here (worker ``k`` keeps items
  ``k, k + n, k + 2n, ...``), so no item is produced twice. A generator runs its body only at
  the first ``next``, so the first item is read before deciding. In a distributed job each
  rank keeps its share too (:func:`aioloader._sampling._distributed.stream_share`), also of a stream
  that shards itself by worker.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import faulthandler
import gc
import os
import re
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from .._batch import (
    MAX_OPEN_STREAMS,
    BatchMaker,
    StreamCursor,
    annotate,
    continued_share,
    not_an_exit,
)
from .._errors import WorkerInitError
from .._sampling import every_nth, first_items_noted, one_by_one, stream_share
from .._shm import Slot
from .._types import END, BatchRequest, Made, StreamRequest, stream_state
from . import _info, _payload
from ._channel import serve_over
from ._frames import Packed, pack_result, picklable
from ._info import WorkerInfo
from ._raw import unpack_raw
from ._records import Cells, LoadJob, MapJob, OwnSlot, StreamJob
from ._wire import Packer, inline
from ._zygote import SHED_SIGNALS, Held, name_process, shed_parent_state

__all__ = [
    "STACK_SIGNAL",
    "WATCHDOG_INTERVAL_S",
    "WorkerCopy",
    "drop_copy",
    "init_worker",
    "load_copy",
    "read_stream",
    "run_map_job",
    "run_stream_job",
    "run_worker",
    "serve",
]

# How often a worker checks that the main process is still alive. Shorter: faster exit of
# orphans; longer: fewer wake-ups. Half a second keeps the 5 s contract with a wide margin.
WATCHDOG_INTERVAL_S = 0.5

# The signal that makes a worker write its threads' stacks to its stack pipe (a worker hung
# while it starts is asked for them before it is killed). SIGUSR1: unused by the loader and,
# in a worker, by torch; the forked server resets it to the default.
STACK_SIGNAL = signal.SIGUSR1


@dataclass(slots=True)
class WorkerCopy:
    """One dataset copy a worker makes batches with: its loader's (a shared pool's workers hold
    one per loader, see :mod:`aioloader._loader._shared_pool`). Set by :func:`load_copy`; a
    Ray actor keeps one per loader of an iterable dataset, for its stream."""

    worker_id: int
    num_workers: int
    seed: int  # the loader's seed: per-batch seeds derive from it
    per_batch_seeds: bool  # worker_seeding='batch': reseed before every batch
    maker: BatchMaker | None = None  # None if it failed to load
    info: WorkerInfo | None = None  # what get_worker_info() says while its jobs run
    init_error: BaseException | None = None
    init_tb: str = ""
    init_shards: bool = False  # worker_init_fn read which worker this is: it set up the copy
    stream: StreamCursor = field(init=False)
    # The random state the stream is read under where the loader splits it among readers:
    # the same in every worker (see _info). None: one reader, nothing to align.
    stream_random: _info.StreamRandom | None = None
    # Digests of the stream's first items, while they are to be sent (see run_stream_job).
    order: list[int] | None = None

    def __post_init__(self) -> None:
        self.stream = StreamCursor(self._open_stream, self._position)

    def set_maker(self, maker: BatchMaker) -> None:
        """Make batches with ``maker`` (the unpickled copy); where readers split a stream,
        read it under the random state every reader shares (see ``_info.StreamRandom``)."""
        self.maker = maker
        if stream_share(maker.shard, 0, self.num_workers)[1] > 1:  # readers split the stream
            self.stream_random = _info.StreamRandom(maker.stream_seed)

    def release(self) -> None:
        """Let go of the dataset and its streams now, not at the next garbage collection (the
        cursor's callbacks tie it and this copy into a cycle): their files and memory go."""
        self.maker = None
        self.info = None
        self.stream = StreamCursor(self._open_stream, self._position)

    def take_order(self) -> tuple[int, ...] | None:
        """The digests of the stream's first items noted since it opened (once)."""
        order, self.order = self.order, None
        return tuple(order) if order is not None else None

    def _position(self) -> Any:
        assert self.maker is not None
        return stream_state(self.maker.dataset)

    def _open_stream(self, resume: Any) -> Iterator[Any]:
        """This worker's share of the dataset's stream, for one epoch (from ``resume``, a
        :class:`~aioloader._types.ResumableStream` state, when one is given)."""
        assert self.maker is not None
        dataset = self.maker.dataset
        # A stream that shards itself draws as the batch does from the moment it reads which
        # worker it is in (or from the start, where worker_init_fn did): see StreamRandom.
        leave = self.stream_random.leave if self.stream_random is not None else None
        if leave is not None and self.init_shards:
            leave()
        _info.watch(on_seen=leave)
        try:
            if resume is not None:
                dataset.load_state_dict(resume)
            it = iter(dataset)
            first = next(it, END)  # generators run their body (and read worker info) only now
        finally:
            shards_itself = _info.unwatch() or self.init_shards
        if first is END:
            return iter(())
        rest = _chain_first(first, it)
        shard = self.maker.shard  # the rank share, in a distributed job
        if shards_itself:  # the stream is this worker's already: split it by rank only
            share = stream_share(shard, 0, 1)
        else:
            share = stream_share(shard, self.worker_id, self.num_workers)
            if self.num_workers > 1 and resume is None:  # resumed readers stand apart
                self.order = []
                rest = first_items_noted(rest, self.order)
        return every_nth(rest, *continued_share(*share, resume is not None))


@dataclass(slots=True)
class _WorkerState:
    """The worker process's one state: set by :func:`init_worker`, its copies by
    :func:`load_copy` and :func:`drop_copy`, read by every job."""

    worker_id: int
    num_workers: int
    seed: int  # the seed the worker started with: its copies' unless a LoadJob says
    per_batch_seeds: bool  # likewise, worker_seeding='batch'
    current: Any  # the running job's tag (its MapJob.tag), 0 when idle (see _records.Cells)
    loading: Any  # time.monotonic() a copy's load began, 0.0 when none
    pipes: tuple[Connection, Connection]  # this worker's (requests, replies)
    stacks: Connection  # where STACK_SIGNAL's handler writes the stacks (kept open for it)
    copies: dict[int, WorkerCopy] = field(default_factory=dict)  # by copy id (0: the only one)
    active: int | None = None  # the copy whose worker info is published now

    def idle(self) -> None:
        """No job runs now: the last one's reply was written. Not sooner: a worker that dies
        between making a batch and writing its reply (the OOM killer) must still name that
        job, or the job would look as if it only waited behind another one and run again (a
        map job whose fetched bytes came in its slot would then read the collated batch
        there as its bytes)."""
        self.current[self.worker_id] = 0

    def waiting_for_turn(self, waiting: bool) -> None:
        """While this worker waits for a turn to unpickle a large copy (``_shm.turn``: the
        other workers hold them all), its load has not begun: its start clock stops (0.0, as
        before a load) and starts afresh once it holds a turn, so that another worker's hang
        in its load never gets this one killed. The wait is bounded (``_shm.TURN_WAIT_S``)."""
        self.loading[self.worker_id] = 0.0 if waiting else time.monotonic()


_STATE: _WorkerState | None = None


# -- start-up, loading a copy, the serve loop ---------------------------------------------------


def run_worker(*args: Any) -> None:
    """A worker process's whole life: :func:`init_worker` with ``args``, then :func:`serve`
    until the main process closes the pipes (or says stop)."""
    init_worker(*args)
    serve()


def run_forked_worker(release: list[Held], *args: Any) -> None:
    """:func:`run_worker` in a worker forked from the main process itself (under ``'fork'``, as
    an epoch begins: ``_pool.WorkerPool.fork_here``): first drop what it must not keep of
    the main process, as the forked server does (``_zygote``): the sockets and pipes in
    ``release`` (the main process's, listed just before the fork) and its signal handlers.
    The parent blocked :data:`._zygote.SHED_SIGNALS` around the fork, so that none runs the
    main process's handler here before that: they are unblocked after."""
    shed_parent_state(release)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SHED_SIGNALS)
    run_worker(*args)


def init_worker(
    worker_id: int,
    num_workers: int,
    seed: int,
    per_batch_seeds: bool,
    cells: Cells,
    main_pid: int,
    pipes: tuple[Connection, Connection],
    stacks: Connection,
) -> None:
    """Set up this worker's state (see the module docstring); last, publish its pid in
    ``cells.started[worker_id]``: the main process's sign that the worker is up."""
    global _STATE
    gc.freeze()  # what the worker inherited: see the module docstring
    name_process(f"aiol-worker-{worker_id}".encode())  # for ps and top
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _keep_freed_memory()
    _info.seed_on_import()
    faulthandler.register(STACK_SIGNAL, file=stacks.fileno(), all_threads=True, chain=False)
    # A bare thread: threading.Thread.start() waits until the new thread has run, which took
    # up to 6 ms on the way to the first batch while the other processes just forked start
    # beside this one. Nothing joins it (a bare thread is never joined, whatever the start
    # method). threading.enumerate() does not list it: a loader made inside a worker may fork
    # from it (it holds no lock).
    _thread.start_new_thread(_watchdog, (main_pid,))
    _STATE = _WorkerState(
        worker_id, num_workers, seed, per_batch_seeds, cells.current, cells.loading, pipes, stacks
    )
    cells.started[worker_id] = os.getpid()


# glibc's malloc settings in a worker: what glibc itself settles on after the first large
# block is freed (its dynamic mmap threshold grows up to 32 MiB, the trim threshold to twice
# that), from the start. A job allocates a batch's worth of samples (tens of 64 KiB objects:
# bytes, decoded arrays) and frees them all at its end; with the initial 128 KiB trim
# threshold, that free hands the heap's top back to the kernel and the next job faults every
# page in again, zeroed: measured ~30 page faults and ~20-40 us of CPU per 64 KiB sample. A
# worker keeps at most MALLOC_TRIM_BYTES of freed heap instead.
MALLOC_MMAP_BYTES = 32 << 20
MALLOC_TRIM_BYTES = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>


def _keep_freed_memory() -> None:
    """Apply the malloc settings above where the C library is glibc (best effort)."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):  # type: ignore[union-attr]
            return
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_BYTES)
    except (OSError, ValueError, AttributeError):
        pass  # no glibc, or no confstr name for it: the C library's own policy stays


def load_copy(job: LoadJob) -> None:
    """Make batches from now on with the copy in ``job``: drop the previous copy, seed, publish
    the worker info, run ``worker_init_fn``. A failure is kept and reported by the next jobs."""
    state = _STATE
    assert state is not None, "worker job run outside a worker"
    state.loading[state.worker_id] = time.monotonic()  # a hang from here on is a start hang
    try:
        _load(state, job)
    finally:
        state.loading[state.worker_id] = 0.0


def _load(state: _WorkerState, job: LoadJob) -> None:
    # The previous copy goes first (its files, its memory), as torch's exiting worker would;
    # another loader's copies stay.
    _info.publish(None)
    state.active = None
    previous = state.copies.pop(job.copy_id, None)
    if previous is not None:
        previous.release()
    copy = state.copies[job.copy_id] = WorkerCopy(
        state.worker_id,
        state.num_workers,
        state.seed if job.seed is None else job.seed,
        state.per_batch_seeds if job.per_batch_seeds is None else job.per_batch_seeds,
    )
    seed = _info.worker_seed(copy.seed, job.epoch, state.worker_id)
    init_fn: Callable[[int], Any] | None = None
    try:
        maker, init_fn = _payload.loads(job.payload, waiting=state.waiting_for_turn)
    except BaseException as exc:  # reported by the jobs, not as a silent crash
        copy.init_error, copy.init_tb = exc, traceback.format_exc()
        return
    copy.set_maker(maker)
    # After unpickling: the dataset's modules are imported now, torch among them if it uses it.
    _info.seed_worker(seed, every_device=not copy.per_batch_seeds)
    _info.torch_on_one_thread()  # each copy starts as torch's fresh workers do
    copy.info = WorkerInfo(state.worker_id, state.num_workers, seed, maker.dataset)
    _info.publish(copy.info)
    state.active = job.copy_id
    if init_fn is None:
        return
    _info.watch()
    try:
        init_fn(state.worker_id)
    except BaseException as exc:
        copy.init_error, copy.init_tb = exc, traceback.format_exc()
    finally:
        copy.init_shards = _info.unwatch()


def drop_copy(copy_id: int) -> None:
    """Forget dataset copy ``copy_id`` (its loader was closed; the worker serves others)."""
    state = _STATE
    assert state is not None, "worker job run outside a worker"
    if state.active == copy_id:
        _info.publish(None)
        state.active = None
    copy = state.copies.pop(copy_id, None)
    if copy is not None:
        copy.release()


def serve() -> None:
    """Serve jobs over the worker's pipes until the main process closes them (see
    :mod:`._channel`)."""
    assert _STATE is not None, "worker job run outside a worker"
    serve_over(*_STATE.pipes, replied=_STATE.idle)


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


# -- the jobs --------------------------------------------------------------------------------


def run_map_job(job: MapJob) -> Packed[Made]:
    """Make one batch of a map-style dataset: a :class:`~aioloader._types.Made` whose batch is
    a :class:`._records.Parcel`, packed for the reply (see :func:`_packed`)."""
    state, copy = _state(job.copy_id)
    request = job.request
    _begin(state, copy, job, request)  # until its reply is written (_WorkerState.idle)
    if job.raw_in_slot:  # the fetched samples' bytes, out of the slot the batch goes into
        assert isinstance(job.slot, Slot)
        request = unpack_raw(request, job.slot)
    return _packed(_make(state, copy, request, job.slot), state, request)


def run_stream_job(job: StreamJob) -> Packed[Made]:
    """Make the next batch of this worker's share of an iterable dataset (``END`` once it ran
    out): a :class:`~aioloader._types.Made` as :func:`run_map_job` makes it."""
    state, copy = _state(job.copy_id)
    request = job.request
    _begin(state, copy, job, request)  # until its reply is written (_WorkerState.idle)
    started = time.perf_counter()
    try:
        samples, position, order = read_stream(copy, request)
    except BaseException as exc:
        raise _worker_side(exc, state, request.batch_id, "the stream of ") from None
    if samples is END:
        return Packed(pack_result(Made(batch=inline(END), order=order)))
    pulled_s = time.perf_counter() - started
    of_samples = BatchRequest(
        request.epoch, request.batch_id, list(range(len(samples))), raw=samples
    )
    made = _make(state, copy, of_samples, job.slot)
    made.read_s += pulled_s
    made.position = position
    made.order = order
    return _packed(made, state, of_samples)


def read_stream(
    copy: WorkerCopy, request: StreamRequest
) -> tuple[Any, Any, tuple[int, ...] | None]:
    """The samples of the next batch of ``copy``'s stream (or ``END``), the stream's position
    after them, and on an epoch's first request the digests of its first items (see
    :attr:`~aioloader._types.Made.order`). A Ray actor reads its stream with it too."""
    with _stream_random(copy, request):
        samples, position = copy.stream.next_samples(request)
    order = copy.take_order() if request.opens else None
    return samples, position, order


def _stream_random(
    copy: WorkerCopy, request: StreamRequest
) -> contextlib.AbstractContextManager[None]:
    """Where readers split the stream: pull it under its own random state, the same in every
    worker (each reads the whole stream and keeps its share: exact only if every copy orders
    it alike), and give the batch its state back after (reseeded, with per-batch seeds)."""
    if copy.stream_random is None:
        return contextlib.nullcontext()

    def reseed() -> None:
        _info.seed_everything(copy.seed, request.epoch, request.batch_id)

    then = reseed if copy.per_batch_seeds else None
    return copy.stream_random.reading(
        request.key, request.epoch, request.opens, keep=MAX_OPEN_STREAMS, then=then
    )


def _state(copy_id: int) -> tuple[_WorkerState, WorkerCopy]:
    state = _STATE
    assert state is not None, "worker job run outside a worker"
    copy = state.copies.get(copy_id)
    assert copy is not None, "a batch job reached a worker before its dataset copy"
    if copy.init_error is not None:
        exc = copy.init_error
        raise WorkerInitError(
            f"worker {state.worker_id} (pid {os.getpid()}) failed to start: "
            f"{type(exc).__name__}: {exc}\n{copy.init_tb}"
        )
    return state, copy


def _begin(
    state: _WorkerState,
    copy: WorkerCopy,
    job: MapJob | StreamJob,
    request: BatchRequest | StreamRequest,
) -> None:
    """Publish the job this worker now runs (first: a deadline asks for it), the worker info
    of its copy (another loader's ran before it, on a shared pool), then seed."""
    state.current[state.worker_id] = job.tag
    if state.active != job.copy_id:
        _info.publish(copy.info)
        state.active = job.copy_id
    if copy.per_batch_seeds:
        _info.seed_everything(copy.seed, request.epoch, request.batch_id)
    _info.catch_up()  # a backstop: what the import hook did not see


def _make(
    state: _WorkerState, copy: WorkerCopy, request: BatchRequest, slot: Slot | OwnSlot | None
) -> Made:
    """Read, collate (into ``slot``, if any) and pack the batch of ``request``."""
    try:
        packer = Packer(slot)
        assert copy.maker is not None
        made = copy.maker.make(request, packer.alloc)
        made.batch = packer.pack(made.batch)
    except BaseException as exc:
        raise _worker_side(exc, state, request.batch_id) from None
    return made


def _packed(made: Made, state: _WorkerState, request: BatchRequest) -> Packed[Made]:
    """``made`` pickled for the reply, here rather than by the serve loop: a sample or a
    collated batch that cannot be pickled (a lock, a generator, an open file) is then
    reported naming its batch, with its own exception type."""
    try:
        return Packed(pack_result(made))
    except Exception as exc:
        annotate(
            exc,
            f"while sending batch {request.batch_id} of indices {list(request.indices[:8])}"
            f"{'...' if len(request.indices) > 8 else ''} to the main process: it holds an "
            "object that cannot be pickled; return samples (and a collate_fn output) made of "
            "arrays, tensors, numbers, strings and containers of them",
        )
        raise _worker_side(exc, state, request.batch_id) from None


def _worker_side(
    exc: BaseException, state: _WorkerState, batch_id: int, where: str = ""
) -> BaseException:
    """What the main process gets for ``exc``, raised while making ``batch_id``: the exception
    itself with a note naming the worker (and the batch, unless a note names it already), or,
    for one that is not an ``Exception`` (see the module's sharp edges), a
    :class:`WorkerError`."""
    worker = f"{where}worker {state.worker_id} (pid {os.getpid()})"
    if not isinstance(exc, Exception):
        return not_an_exit(exc, worker, batch_id)
    notes = "\n".join(getattr(exc, "__notes__", ()))
    named = re.search(rf"\bbatch {batch_id}\b", notes)  # as the batch maker names it
    annotate(exc, f"in {worker}" if named else f"in {worker}, making batch {batch_id}")
    return picklable(exc)


def _chain_first(first: Any, it: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from one_by_one(it)  # never iter(it) again: a stream that is its own iterator restarts
