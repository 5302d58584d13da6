"""Datasets and callables for the fault-injection tests, defined at module level so that worker
processes can unpickle them (they import this module by name).

Faults are injected per *visit* of a sample index: each time a worker reads a faulty index it
claims the next visit number by creating a marker file with ``O_EXCL`` (atomic across
processes), and the fault fires only on the visits it was told to. That makes "crash on the
first attempt, succeed on the retry" and "crash in epoch 0 only" deterministic, whichever worker
runs the batch and however often the pool is rebuilt. A marker file holds the pid of the worker
that claimed it and the wall-clock time just before the fault fired, so a test can name the
process that died and measure how fast the loader noticed.

The helpers at the end (``run_epoch``, ``assert_exact``, ``wait_gone``, ...) run in the test
process only: they iterate an epoch under a time bound, check the index checksum, and wait for
processes to exit.
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing.context
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import aioloader
from aioloader import get_worker_info

# What a fault does when it fires.
RAISE = "raise"  # raise ValueError naming the index
KEY_ERROR = "key_error"  # raise KeyError (a builtin type the consumer may catch by name)
SIGKILL = "sigkill"  # the worker sends itself SIGKILL (what the OOM killer does)
SIGSEGV = "sigsegv"  # the worker sends itself SIGSEGV (a crash in native code)
EXIT0 = "exit0"  # os._exit(0): the worker vanishes with a clean exit code
HANG = "hang"  # sleep far longer than any test: only a kill ends it
UNPICKLABLE = "unpicklable"  # raise an exception that cannot cross a process boundary
HOLDING = "holding"  # raise an exception holding a lock (not picklable), made from a message
HOLDING_KEY = "holding_key"  # raise a KeyError whose key is a lock (not picklable)

HANG_S = 1000.0


class HoldingError(Exception):
    """An exception that holds what cannot be pickled (a lock, as a live response or an open
    file would be), whose type can be made from its message alone."""

    def __init__(self, message: str, held: Any = None) -> None:
        super().__init__(message)
        self.held = held


class TwoArgError(Exception):
    """An exception that pickles but cannot be unpickled (its ``__init__`` needs two arguments,
    ``args`` holds one): the classic way a worker's error breaks a process pool."""

    def __init__(self, index: int, what: str) -> None:
        super().__init__(f"{what} failure at index {index}")
        self.index = index


def claim_visit(marker_dir: str, index: int) -> int:
    """Claim the next visit number of ``index``; record this pid and the time in its marker."""
    visit = 0
    while True:
        path = os.path.join(marker_dir, f"visit-{index}-{visit}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            visit += 1
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {time.time()!r}\n")
        return visit


def visits(marker_dir: str, index: int) -> list[tuple[int, float]]:
    """``(pid, time)`` of each recorded visit of ``index``, in visit order."""
    out: list[tuple[int, float]] = []
    visit = 0
    while True:
        path = os.path.join(marker_dir, f"visit-{index}-{visit}")
        try:
            with open(path) as f:
                fields = f.read().split()
        except FileNotFoundError:
            return out
        if len(fields) != 2:  # claimed, not yet written (read while a worker records it)
            return out
        pid, when = fields
        out.append((int(pid), float(when)))
        visit += 1


def fire(action: str, index: int) -> None:
    """Do the fault ``action`` for sample ``index`` (in a worker process)."""
    if action == RAISE:
        raise ValueError(f"injected failure at index {index}")
    if action == KEY_ERROR:
        raise KeyError(f"injected missing key at index {index}")
    if action == UNPICKLABLE:
        raise TwoArgError(index, "injected")
    if action == HOLDING:
        raise HoldingError(f"injected failure at index {index}", threading.Lock())
    if action == HOLDING_KEY:
        raise KeyError(threading.Lock())
    if action == SIGKILL:
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == SIGSEGV:
        os.kill(os.getpid(), signal.SIGSEGV)
    elif action == EXIT0:
        os._exit(0)
    elif action == HANG:
        time.sleep(HANG_S)
    else:  # pragma: no cover - a typo in a test
        raise AssertionError(f"unknown fault action {action!r}")
    time.sleep(HANG_S)  # a signal is delivered asynchronously; never go on past it


@dataclass
class Faulty:
    """A map-style dataset whose sample ``i`` is ``i`` (or an array filled with ``i % 256``).

    Args:
        n: length.
        shape: shape of each sample's uint8 array; ``None`` makes samples plain ints.
        faults: ``index -> action`` (see the module constants).
        marker_dir: where visits are recorded; required when ``faults`` is not empty.
        on_visits: the visit numbers on which a fault fires (default: the first one only).
    """

    n: int
    shape: tuple[int, ...] | None = None
    faults: dict[int, str] = field(default_factory=dict)
    marker_dir: str | None = None
    on_visits: Sequence[int] = (0,)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for {self.n} samples")
        action = self.faults.get(index)
        if action is not None:
            assert self.marker_dir is not None, "faults need a marker_dir"
            if claim_visit(self.marker_dir, index) in self.on_visits:
                fire(action, index)
        if self.shape is None:
            return index
        return np.full(self.shape, index % 256, dtype=np.uint8)


@dataclass(frozen=True)
class FailingCollate:
    """A collate_fn that raises ``ValueError`` for a batch containing index ``bad`` (samples
    are ints or arrays filled with the index, as :class:`Faulty` makes them)."""

    bad: int

    def __call__(self, samples: list[Any]) -> Any:
        firsts = [int(np.asarray(s).flat[0]) for s in samples]
        if self.bad in firsts:
            raise ValueError(f"injected collate failure for index {self.bad}")
        return torch.stack([torch.as_tensor(np.asarray(s)) for s in samples])


@dataclass
class UnhashableCollate:
    """A collate_fn object that is not hashable (a dataclass with ``eq`` and no ``frozen``, like
    many configurable callables): it stacks samples into a tensor and adds ``offset``."""

    offset: int = 0

    def __call__(self, samples: list[Any]) -> Any:
        return torch.stack([torch.as_tensor(np.asarray(s)) for s in samples]) + self.offset


def failing_init(worker_id: int) -> None:
    """A worker_init_fn that always fails."""
    raise OSError(f"injected init failure in worker {worker_id}")


@dataclass
class RandomSamples:
    """Sample ``i`` is ``[i, numpy draw, random draw, torch draw]``: per-sample randomness."""

    n: int

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray[Any, Any]:
        return np.array(
            [index, np.random.rand(), random.random(), float(torch.rand(1).item())],
            dtype=np.float64,
        )


@dataclass
class RandomFaulty(RandomSamples):
    """:class:`RandomSamples` whose worker dies by SIGKILL on the first visit of ``kill``."""

    kill: int = 0
    marker_dir: str = ""

    def __getitem__(self, index: int) -> np.ndarray[Any, Any]:
        if index == self.kill and claim_visit(self.marker_dir, index) == 0:
            fire(SIGKILL, index)
        return super().__getitem__(index)


@dataclass
class WhoAmI:
    """Each sample reports what :func:`aioloader.get_worker_info` says in the worker."""

    n: int

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        info = get_worker_info()
        assert info is not None, "get_worker_info() is None inside a worker"
        theirs = torch.utils.data.get_worker_info()
        assert theirs is not None, "torch.utils.data.get_worker_info() is None inside a worker"
        return {
            "index": index,
            "id": info.id,
            "num_workers": info.num_workers,
            "seed": info.seed,
            "dataset_is_copy": isinstance(info.dataset, WhoAmI) and info.dataset is self,
            "pid": os.getpid(),
            "torch": (theirs.id, theirs.num_workers, theirs.seed, _same(theirs.dataset, self)),
        }


def _same(a: object, b: object) -> bool:
    """``a is b``, for objects whose declared types do not overlap (torch's ``Dataset``)."""
    return a is b


@dataclass
class Mapped:
    """Sample ``i`` is ``fn(i)``: unpicklable when ``fn`` is a lambda."""

    n: int
    fn: Callable[[int], Any]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return self.fn(index)


def stack_as_list(samples: list[Any]) -> list[Any]:
    """A collate_fn that keeps the samples as they are."""
    return list(samples)


@dataclass
class DiesOnUnpickle(Faulty):
    """A dataset whose copy in a worker kills the worker while it is unpickled: a fault at start
    that no ``try`` can catch (an import that crashes the interpreter, the OOM killer). The main
    process only pickles it, so it is never unpickled there."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        os._exit(3)


# -- armed faults: set by the test before each epoch, each fires exactly once -------------------


def arm(marker_dir: str, key: int | str, action: str) -> None:
    """Arm fault ``action`` at ``key`` (a sample index, or ``"collate-<first index>"``): the next
    visit of it in a worker, whichever epoch, worker or attempt that is, fires it, once."""
    path = os.path.join(marker_dir, f"arm-{key}")
    with open(path + ".tmp", "w") as f:
        f.write(action)
    os.replace(path + ".tmp", path)  # never seen half written


def take_armed(marker_dir: str, key: int | str) -> str | None:
    """Disarm the fault at ``key`` and return its action, or ``None`` if none is armed there.
    The rename is atomic: of two processes visiting ``key``, one gets the fault."""
    fired = os.path.join(marker_dir, f"fired-{key}-{os.getpid()}")
    try:
        os.rename(os.path.join(marker_dir, f"arm-{key}"), fired)
    except FileNotFoundError:
        return None
    with open(fired) as f:
        return f.read()


def armed(marker_dir: str) -> list[str]:
    """The faults still armed (not yet visited) in ``marker_dir``."""
    return sorted(name[4:] for name in os.listdir(marker_dir) if name.startswith("arm-"))


@dataclass
class Armed:
    """A map-style dataset like :class:`Faulty` (sample ``i`` an array filled with ``i % 256``),
    whose faults are armed from outside with :func:`arm`, so a long-lived worker (persistent
    workers keep their dataset copy) meets a new set of faults in every epoch."""

    n: int
    shape: tuple[int, ...]
    marker_dir: str

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        action = take_armed(self.marker_dir, index)
        if action is not None:
            fire(action, index)
        return np.full(self.shape, index % 256, dtype=np.uint8)


@dataclass
class HangingStream:
    """An iterable dataset of ``0 .. n-1`` whose first visit of ``hang_at`` (in any worker)
    hangs; later visits go on."""

    n: int
    hang_at: int
    marker_dir: str

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            if i == self.hang_at and claim_visit(self.marker_dir, i) == 0:
                time.sleep(HANG_S)
            yield i


@dataclass(frozen=True)
class ArmedCollate:
    """A collate_fn that stacks, and raises ``ValueError`` for a batch whose first sample's
    fault was armed as ``"collate-<index>"`` (once)."""

    marker_dir: str

    def __call__(self, samples: list[Any]) -> Any:
        first = int(np.asarray(samples[0]).flat[0])
        if take_armed(self.marker_dir, f"collate-{first}") is not None:
            raise ValueError(f"injected collate failure for the batch starting at {first}")
        return torch.stack([torch.as_tensor(np.asarray(s)) for s in samples])


# -- faults while a worker starts, and errors that must name their batch -----------------------


def hanging_init(worker_id: int) -> None:
    """A worker_init_fn that never returns (a lock never released, a stuck mount)."""
    time.sleep(HANG_S)


@dataclass
class HangsOnUnpickle(Faulty):
    """A dataset whose copy in a worker takes forever to unpickle (an import from a stuck
    mount, a file it opens while unpickled) while ``hang`` is set; the main process only
    pickles it. Set ``hang`` between epochs to make the next epoch's copy hang."""

    hang: bool = True

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.hang:
            time.sleep(HANG_S)


@dataclass
class HangsAfterCrash(Faulty):
    """Its worker dies by SIGKILL at the first visit of index ``kill``; from then on, a copy
    of it hangs while it is unpickled: the replacement worker never finishes starting."""

    kill: int = 0

    def __getitem__(self, index: int) -> Any:
        if index == self.kill:
            assert self.marker_dir is not None
            if claim_visit(self.marker_dir, index) == 0:
                fire(SIGKILL, index)
        return super().__getitem__(index)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.marker_dir is not None and visits(self.marker_dir, self.kill):
            time.sleep(HANG_S)


def _sleep_then_run(process: Any) -> None:
    """What a process of :class:`HangingStartContext` does before its target: hang."""
    time.sleep(HANG_S)


class _HangingStartProcess(multiprocessing.context.SpawnProcess):
    def run(self) -> None:
        _sleep_then_run(self)
        super().run()


class HangingStartContext(multiprocessing.context.SpawnContext):
    """A start method whose processes hang before they run anything of the loader's: a worker
    stuck while its interpreter starts (an import from a stuck mount)."""

    Process = _HangingStartProcess


class GatedKill(Faulty):
    """Reading index ``at`` (once) leaves ``<gate>.waiting``, waits (bounded) until the file
    ``gate`` exists, then SIGKILLs its worker: the test decides what else the worker holds
    (jobs queued in its pipe) when it dies."""

    def __init__(self, n: int, at: int, gate: str, shape: tuple[int, ...] | None = None) -> None:
        super().__init__(n, shape=shape)
        self.at = at
        self.gate = gate

    def __getitem__(self, index: int) -> Any:
        if index == self.at and not os.path.exists(f"{self.gate}.waiting"):
            with open(f"{self.gate}.waiting", "w"):
                pass
            deadline = time.monotonic() + SCENARIO_TIMEOUT_S
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.01)
            fire(SIGKILL, index)
        return super().__getitem__(index)


class ExitsInGetitem(Faulty):
    """Raises ``SystemExit(code)`` reading index ``at``: a dataset that calls ``sys.exit``."""

    def __init__(self, n: int, at: int, error: type[BaseException] = SystemExit) -> None:
        super().__init__(n)
        self.at = at
        self.error = error

    def __getitem__(self, index: int) -> Any:
        if index == self.at:
            raise self.error(f"the dataset gave up at index {index}")
        return super().__getitem__(index)


class _Unpicklable:
    """A sample that cannot cross a process boundary (it holds a lock)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.lock = threading.Lock()


class UnpicklableAt(Faulty):
    """Sample ``at`` cannot be pickled (collate it with :func:`stack_as_list`)."""

    def __init__(self, n: int, at: int) -> None:
        super().__init__(n)
        self.at = at

    def __getitem__(self, index: int) -> Any:
        if index == self.at:
            return _Unpicklable(index)
        return super().__getitem__(index)


def unpicklable_collate(samples: list[Any]) -> Any:
    """A collate_fn whose batch cannot be pickled: it holds a generator."""
    return {"indices": list(samples), "rest": (s for s in samples)}


# -- helpers for the tests (run in the test process only) ----------------------------------------

# Every scenario must end well inside this (RELIABILITY.md: 30 s cap on a 2-core machine).
SCENARIO_TIMEOUT_S = 30.0

_BATCH_ID = re.compile(r"\bbatch (\d+)\b")


def make_loader(dataset: Any, **kwargs: Any) -> aioloader.DataLoader:
    """A loader with the defaults these tests use: batches of 4, two worker processes, seed 0."""
    kwargs.setdefault("batch_size", 4)
    kwargs.setdefault("num_workers", 2)
    kwargs.setdefault("seed", 0)
    return aioloader.DataLoader(dataset, **kwargs)


def batch_indices(batch: Any) -> list[int]:
    """The sample indices of a batch made from :class:`Faulty` (ints, or arrays filled with the
    index modulo 256: keep such datasets at most 256 long)."""
    t = torch.as_tensor(batch)
    if t.dim() > 1:
        t = t.reshape(t.shape[0], -1)[:, 0]
    return [int(x) for x in t.tolist()]


def failed_batch_id(exc: BaseException) -> int:
    """The batch id an error names (in its message or its notes)."""
    text = "\n".join([str(exc), *getattr(exc, "__notes__", ())])
    found = _BATCH_ID.search(text)
    assert found is not None, f"the error names no batch: {text!r}"
    return int(found.group(1))


def sequential_batches(n: int, batch_size: int) -> list[list[int]]:
    """The batches of a sequential sampler (last batch kept)."""
    return [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]


@dataclass
class EpochRun:
    """What one epoch yielded: batches (as index lists) and errors, in the order they came."""

    batches: list[list[int]] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    error_times: list[float] = field(default_factory=list)  # time.time() when each was raised
    order: list[int | BaseException] = field(default_factory=list)  # first index, or the error


async def run_epoch(epoch: Any, *, stop_at_error: bool = False) -> EpochRun:
    """Iterate one epoch (an async iterator), collecting batches and errors; bounded in time."""
    run = EpochRun()
    async with asyncio.timeout(SCENARIO_TIMEOUT_S):
        while True:
            try:
                batch = await anext(epoch)
            except StopAsyncIteration:
                return run
            except Exception as exc:
                run.errors.append(exc)
                run.error_times.append(time.time())
                run.order.append(exc)
                if stop_at_error:
                    return run
                continue
            indices = batch_indices(batch)
            del batch
            run.batches.append(indices)
            run.order.append(indices[0])


def assert_exact(run: EpochRun, expected: list[list[int]]) -> None:
    """Index checksum: what was yielded plus what was reported failed is exactly the sampler's
    batches, nothing lost, nothing twice; and (in-order delivery) in the sampler's order."""
    failed = [failed_batch_id(e) for e in run.errors]
    assert len(set(failed)) == len(failed), f"a batch failed twice: {failed}"
    want = [b for i, b in enumerate(expected) if i not in failed]
    assert run.batches == want
    got = collections.Counter(i for b in run.batches for i in b)
    lost = collections.Counter(i for k in failed for i in expected[k])
    assert got + lost == collections.Counter(i for b in expected for i in b)


def wait_gone(pids: Sequence[int], timeout: float = 5.0) -> list[int]:
    """Wait until every pid has exited (a zombie counts as exited); return those still alive."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if _running(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _running(pid: int) -> bool:
    import psutil

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
