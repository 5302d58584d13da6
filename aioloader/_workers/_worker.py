"""Everything that runs inside a worker process.

A worker is started by its executor (see :mod:`._pool`), which runs :func:`init_worker` once
and then one long job, :func:`serve`: a loop that reads jobs from the worker's request pipe and
writes replies to its reply pipe (:mod:`._channel`). The jobs it runs are :func:`run_map_job`
and :func:`run_stream_job`; each returns a :class:`~aioloader._types.Made` whose batch is a
:class:`._wire.Parcel`.

What a worker gets once, at start: the pickled payload (its :class:`~aioloader._batch.
BatchMaker`, which holds the dataset, collate_fn, transform and decode, and the user's
``worker_init_fn``), its id, the worker count, the base seed, a shared array in which it
publishes the batch it is working on (so a crash names the batch it killed, and a deadline can
tell "running" from "queued"), the main pid, and its ends of the two pipes.

Sharp edges:
- Workers ignore SIGINT: Ctrl-C is the main process's to handle; it then closes the pool.
  Otherwise every worker would print a KeyboardInterrupt traceback mid-batch.
- A watchdog thread makes the worker exit within :data:`WATCHDOG_INTERVAL_S` of the main
  process's death, even if nobody closed the pipes (a main process killed by SIGKILL). It
  treats a zombie as dead: a killed process stays a zombie until its parent reaps it, and
  ``kill(pid, 0)`` still succeeds on a zombie.
- A failure to unpickle the payload, or an exception from ``worker_init_fn``, does not crash the
  worker: it is reported by the first job, as :class:`~aioloader.WorkerInitError`.
- An exception that cannot be pickled would break the reply; jobs send a ``RuntimeError``
  carrying the original type name, message and traceback text instead.
- A stream that never asks :func:`get_worker_info` is sharded here (worker ``k`` keeps items
  ``k, k + n, k + 2n, ...``), so no item is produced twice. A generator runs its body only at
  the first ``next``, so the first item is read before deciding. In a distributed job each
  rank keeps its share too (:func:`aioloader._distributed.stream_share`), also of a stream
  that shards itself by worker.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .._batch import BatchMaker, StreamCursor, annotate
from .._distributed import every_nth, stream_share
from .._errors import WorkerInitError
from .._shm import Slot
from .._types import END, BatchRequest, Made
from ._channel import serve_over
from ._frames import picklable
from ._wire import MapJob, Packer, StreamJob, inline

__all__ = [
    "WATCHDOG_INTERVAL_S",
    "WorkerInfo",
    "get_worker_info",
    "init_worker",
    "ping",
    "run_map_job",
    "run_stream_job",
    "seed_everything",
    "serve",
]

# How often a worker checks that the main process is still alive. Shorter: faster exit of
# orphans; longer: fewer wake-ups. Half a second keeps the 5 s contract with a wide margin.
WATCHDOG_INTERVAL_S = 0.5


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
    """The worker process's one state: set by :func:`init_worker`, read by every job."""

    info: WorkerInfo
    maker: BatchMaker
    current: Any  # shared ctypes array: batch id + 1 being worked on, 0 when idle
    pipes: tuple[Connection, Connection]  # this worker's (requests, replies)
    init_error: BaseException | None = None
    init_tb: str = ""
    info_asked: bool = False  # the dataset asked get_worker_info (it shards itself)
    stream: StreamCursor = field(init=False)

    def __post_init__(self) -> None:
        self.stream = StreamCursor(self._open_stream)

    def _open_stream(self) -> Iterator[Any]:
        """This worker's share of the dataset's stream, for one epoch."""
        self.info_asked = False
        it = iter(self.maker.dataset)
        first = next(it, END)  # generators run their body (and ask for worker info) only now
        if first is END:
            return iter(())
        rest = _chain_first(first, it)
        shard = self.maker.shard  # the rank share, in a distributed job
        if self.info_asked:  # the stream is this worker's already: split it by rank only
            return every_nth(rest, *stream_share(shard, 0, 1))
        return every_nth(rest, *stream_share(shard, self.info.id, self.info.num_workers))


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


# -- start-up and the serve loop -------------------------------------------------------------


def init_worker(
    payload: bytes,
    worker_id: int,
    num_workers: int,
    seed: int,
    current: Any,
    main_pid: int,
    pipes: tuple[Connection, Connection],
) -> None:
    """The executor's initializer: set up this worker's state (see the module docstring)."""
    global _STATE
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(
        target=_watchdog, args=(main_pid,), name="aioloader-watchdog", daemon=True
    ).start()
    init_fn: Callable[[int], Any] | None = None
    try:
        maker, init_fn = pickle.loads(payload)
    except BaseException as exc:  # reported at the first job, not as a silent crash
        _STATE = _WorkerState(
            WorkerInfo(worker_id, num_workers, seed, None),
            BatchMaker(None, list),
            current,
            pipes,
            exc,
            traceback.format_exc(),
        )
        return
    info = WorkerInfo(worker_id, num_workers, seed, maker.dataset)
    _STATE = _WorkerState(info, maker, current, pipes)
    if init_fn is not None:
        try:
            init_fn(worker_id)
        except BaseException as exc:
            _STATE.init_error = exc
            _STATE.init_tb = traceback.format_exc()


def ping() -> int:
    """The first executor job: returns once the initializer ran (it starts the process)."""
    return os.getpid()


def serve() -> None:
    """The one long executor job a worker runs: serve jobs over its pipes until the main
    process closes them (see :mod:`._channel`)."""
    assert _STATE is not None, "worker job run outside a worker"
    serve_over(*_STATE.pipes)


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


def run_map_job(job: MapJob) -> Made:
    """Make one batch of a map-style dataset; its batch is a :class:`._wire.Parcel`."""
    state = _state()
    request = job.request
    _begin(state, request.epoch, request.batch_id)
    try:
        return _make(state, request, job.slot)
    finally:
        state.current[state.info.id] = 0


def run_stream_job(job: StreamJob) -> Made:
    """Make the next batch of this worker's share of an iterable dataset (``END`` once it ran
    out); its batch is a :class:`._wire.Parcel`."""
    state = _state()
    request = job.request
    _begin(state, request.epoch, request.batch_id)
    try:
        started = time.perf_counter()
        try:
            samples = state.stream.next_samples(request)
        except BaseException as exc:
            annotate(exc, f"in the stream of worker {state.info.id} (pid {os.getpid()})")
            raise picklable(exc) from None
        if samples is END:
            return Made(batch=inline(END))
        pulled_s = time.perf_counter() - started
        of_samples = BatchRequest(
            request.epoch, request.batch_id, list(range(len(samples))), raw=samples
        )
        made = _make(state, of_samples, job.slot)
        made.read_s += pulled_s
        return made
    finally:
        state.current[state.info.id] = 0


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


def _begin(state: _WorkerState, epoch: int, batch_id: int) -> None:
    """Publish the batch this worker now runs (first: a deadline asks for it), then seed."""
    state.current[state.info.id] = batch_id + 1
    seed_everything(state.info.seed, epoch, batch_id)


def _make(state: _WorkerState, request: BatchRequest, slot: Slot | None) -> Made:
    """Read, collate (into ``slot``, if any) and pack the batch of ``request``."""
    try:
        packer = Packer(slot)
        made = state.maker.make(request, packer.alloc)
        made.batch = packer.pack(made.batch)
    except BaseException as exc:
        annotate(exc, f"in worker {state.info.id} (pid {os.getpid()})")
        raise picklable(exc) from None
    return made


def _chain_first(first: Any, it: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from it
