"""Helpers the tests share: bounded iteration, batches as lists, a config to build, a fake sleep,
and a leak baseline (:class:`Baseline`: descriptors, threads, processes, segments, tasks).

Every wait here is bounded by :data:`BOUND_S`, which no wait in the tests comes near: it only
turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psutil
import pytest
import torch
from datasets import Recorder

from aioloader._batch._collate import default_collate
from aioloader._config import LoaderConfig

BOUND_S = 10.0


def as_lists(batches: list[Any]) -> list[list[int]]:
    return [b.tolist() if isinstance(b, torch.Tensor) else list(b) for b in batches]


def flat(batches: list[Any]) -> list[int]:
    return [i for b in as_lists(batches) for i in b]


def chunks(items: list[int], size: int, drop_last: bool = False) -> list[list[int]]:
    out = [items[i : i + size] for i in range(0, len(items), size)]
    if drop_last and out and len(out[-1]) < size:
        out.pop()
    return out


def expected_batches(n: int, size: int, drop: bool = False) -> list[list[int]]:
    """The batches of a sequential sampler over ``range(n)``."""
    return chunks(list(range(n)), size, drop)


def assert_raises_naming(
    make: Callable[[], object], error: type[Exception], needles: list[str]
) -> None:
    """``make()`` raises ``error`` whose message contains every one of ``needles`` (the
    argument's name and the value it got, for bad-input errors)."""
    with pytest.raises(error) as info:
        make()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def notes_of(exc: BaseException) -> str:
    """The notes added to an exception, one a line."""
    return "\n".join(getattr(exc, "__notes__", ()))


async def collect(loader: AsyncIterable[Any]) -> list[Any]:
    """Every batch of one epoch."""
    async with asyncio.timeout(BOUND_S):
        return [batch async for batch in loader]


async def take(iterator: AsyncIterator[Any], k: int) -> list[Any]:
    async with asyncio.timeout(BOUND_S):
        return [await anext(iterator) for _ in range(k)]


async def drain(batches: AsyncIterable[Any], into: list[Any]) -> None:
    """Append every batch (as lists) to ``into`` until the iteration ends or raises."""
    async with asyncio.timeout(BOUND_S):
        async for batch in batches:
            into.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)


def drain_sync(batches: Iterable[Any], into: list[Any]) -> None:
    """Append every batch of one sync epoch (as lists) to ``into`` until it ends or raises."""
    for batch in batches:
        into.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)


async def until(condition: Callable[[], bool]) -> None:
    """Poll the loop until ``condition()`` holds (a bounded wait: a hang fails the test)."""
    async with asyncio.timeout(BOUND_S):
        while True:
            if condition():
                return
            await asyncio.sleep(0.01)


async def quiet(dataset: Recorder, for_s: float = 0.1) -> None:
    """Wait until the dataset has not been read for ``for_s`` seconds."""
    async with asyncio.timeout(BOUND_S):
        last = -1
        while True:
            count = len(dataset.read)
            if count == last and dataset.running == 0:
                return
            last = count
            await asyncio.sleep(for_s)


class Sleeps(list[float]):
    """An injectable ``sleep`` that records each delay and returns at once."""

    async def __call__(self, seconds: float) -> None:
        self.append(seconds)


def build_config(**overrides: Any) -> LoaderConfig:
    """A :class:`LoaderConfig` with the loader's defaults (batches of 4), ``overrides`` set."""
    arguments: dict[str, Any] = {
        "kind": "map",
        "batch_size": 4,
        "num_workers": 0,
        "thread_pool": False,
        "in_order": True,
        "prefetch": None,
        "timeout": None,
        "io_concurrency": 64,
        "max_retries": 0,
        "device_prefetch": 1,
        "on_error": "raise",
        "max_failures": 0,
        "collate_fn": None,
        "worker_init_fn": None,
        "transform": None,
        "seed": 0,
        "pin_memory": False,
        "shm_max_bytes": None,
        "last_batch": "keep",
        "default_collate": default_collate,
    }
    arguments.update(overrides)
    return LoaderConfig.build(**arguments)


# -- leak baseline (RELIABILITY.md, common assertion iii) ----------------------------------------

SHM_DIR = "/dev/shm"
SHM_PREFIX = "aiol_"
# How long a check waits for what was told to go (a process to be reaped, a thread to end).
LEAK_GRACE_S = 5.0


def _is_helper(process: psutil.Process) -> bool:
    """The session-long helpers: the forkservers (the stdlib's, and the one forked from this
    process, which names itself) and multiprocessing's resource tracker."""
    try:
        cmd = " ".join(process.cmdline())
        name = process.name()
    except psutil.Error:
        return True
    return "forkserver" in cmd or "resource_tracker" in cmd or name == "aiol-forkserver"


def live_descendants() -> set[int]:
    """Our live descendants (workers included, wherever they were forked from), minus the
    session-long helper processes themselves. A zombie counts as gone: it has exited."""
    pids: set[int] = set()
    for child in psutil.Process().children():
        candidates = [] if _is_helper(child) else [child]
        with contextlib.suppress(psutil.Error):
            candidates.extend(child.children(recursive=True))
        for process in candidates:
            with contextlib.suppress(psutil.Error):
                if process.status() != psutil.STATUS_ZOMBIE:
                    pids.add(process.pid)
    return pids


def own_segments() -> set[str]:
    """``/dev/shm`` segments named after this process or one of its descendants."""
    pids = {os.getpid()}
    with contextlib.suppress(psutil.Error):
        pids.update(p.pid for p in psutil.Process().children(recursive=True))
    prefixes = tuple(f"{SHM_PREFIX}{pid}_" for pid in pids)
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(prefixes)}
    except FileNotFoundError:  # pragma: no cover - non-Linux
        return set()


def open_fds() -> dict[int, str]:
    """This process's open descriptors and what each one is (``/proc/self/fd``)."""
    out: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return out


def _helper_fds() -> set[str]:
    """The pipes and sockets the session-long helper processes (:func:`_is_helper`) hold."""
    held: set[str] = set()
    for child in psutil.Process().children():
        if not _is_helper(child):
            continue
        with contextlib.suppress(OSError):
            for name in os.listdir(f"/proc/{child.pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{child.pid}/fd/{name}")
                    if target.startswith(("pipe:", "socket:")):  # one identity per inode
                        held.add(target)
    return held


def _threads() -> dict[int, str]:
    return {t.ident or 0: t.name for t in threading.enumerate()}


_warmed: set[str | None] = set()


def warm_up(mp_context: str | None = None) -> None:
    """Start what lives as long as the test session (the forkserver and its pipes, the resource
    tracker) by running one small epoch, once per start method, so that a baseline recorded
    after it holds them and a leak check counts only what a test leaves."""
    if mp_context == "spawn":
        mp_context = None  # spawn starts nothing that outlives its workers but what this does
    if mp_context in _warmed:
        return
    from aioloader import DataLoader

    with DataLoader(list(range(8)), batch_size=4, num_workers=1, mp_context=mp_context) as loader:
        assert [len(b) for b in loader] == [4, 4]
    _warmed.add(mp_context)


@dataclass
class Baseline:
    """What this process holds before a scenario: descriptors, threads, descendant processes and
    shared-memory segments. :meth:`check` fails if any of them is above it afterwards (each
    polled for :data:`LEAK_GRACE_S`, as a process told to exit needs a moment to be reaped);
    :meth:`check_tasks` does the same for the asyncio tasks of the running loop.

    Descriptors are compared by count (a number may be closed and reused for something else),
    and the new ones are named in the failure; the rest are compared as sets.
    """

    fds: dict[int, str]
    threads: dict[int, str]
    processes: set[int]
    segments: set[str]
    loop_errors: list[dict[str, Any]] | None = None

    def watch_loop(self) -> None:
        """Record what reaches the running loop's exception handler from now on ("Task
        exception was never retrieved", "Task was destroyed but it is pending!"):
        :meth:`check_tasks` fails if anything did."""
        self.loop_errors = []
        errors = self.loop_errors
        asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))

    @classmethod
    def record(cls, mp_context: str | None = None) -> Baseline:
        warm_up(mp_context)
        gc.collect()
        return cls(open_fds(), _threads(), live_descendants(), own_segments())

    def leaks(self) -> list[str]:
        """What is above the baseline now, one line per kind; empty when nothing is."""
        problems = []
        fds = open_fds()
        # A pipe to a server that lives as long as the session (a start method's first use
        # starts its forkserver), shared with that server, is not a leak.
        shared = _helper_fds()
        fds = {k: v for k, v in fds.items() if self.fds.get(k) == v or v not in shared}
        if len(fds) > len(self.fds):
            new = {k: v for k, v in fds.items() if self.fds.get(k) != v}
            problems.append(f"{len(fds) - len(self.fds)} descriptor(s) above baseline: {new}")
        threads = {k: v for k, v in _threads().items() if k not in self.threads}
        if threads:
            problems.append(f"threads left: {sorted(threads.values())}")
        processes = live_descendants() - self.processes
        if processes:
            problems.append(f"processes left: {sorted(processes)}")
        segments = own_segments() - self.segments
        if segments:
            problems.append(f"shared-memory segments left: {sorted(segments)}")
        return problems

    def check(self, grace_s: float = LEAK_GRACE_S) -> None:
        """Fail unless nothing is above the baseline within ``grace_s`` (from a sync context)."""
        deadline = time.monotonic() + grace_s
        gc.collect()
        while (problems := self.leaks()) and time.monotonic() < deadline:
            time.sleep(0.05)
            gc.collect()
        assert not problems, "; ".join(problems)

    async def check_tasks(self, grace_s: float = LEAK_GRACE_S) -> None:
        """Fail unless the running loop has no task but the caller's within ``grace_s``."""
        me = asyncio.current_task()
        deadline = time.monotonic() + grace_s
        gc.collect()
        while (tasks := asyncio.all_tasks() - {me}) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            gc.collect()
        assert not tasks, f"asyncio tasks left: {sorted(t.get_name() for t in tasks)}"
        if self.loop_errors is not None:
            messages = [
                f"{c.get('message')}: {c.get('task') or c.get('exception')!r}"
                for c in self.loop_errors
            ]
            assert not messages, f"the loop's exception handler was called: {messages}"


@contextlib.asynccontextmanager
async def epoch_over(
    dataset: Any,
    device: Any = None,
    *,
    lockstep: Any = None,
    counters: Any = None,
    **settings: Any,
) -> AsyncIterator[Any]:
    """Epoch 0 of ``dataset`` (map-style) in sampler order, made on helper threads as a
    loader makes it, with ``device`` as its device stage (an ``_epoch.DeviceStage``: a fake one
    in tests), ``lockstep`` for equal steps and ``counters`` for its statistics (a fresh
    ``Counters`` by default); the loader's ``settings`` (``build_config``). Closed, with its
    threads, at the end."""
    from aioloader import BatchSampler, SequentialSampler
    from aioloader._batch._make import BatchMaker
    from aioloader._epoch._consume import Epoch
    from aioloader._epoch._plan import Plan
    from aioloader._stats._counters import Counters
    from aioloader._threads._runner import ThreadRunner

    config = build_config(**settings)
    assert config.batch_size is not None
    runner = ThreadRunner(BatchMaker(dataset, config.collate_fn), config.threads)
    plan = Plan(enumerate(BatchSampler(SequentialSampler(len(dataset)), config.batch_size)))
    epoch = Epoch(
        config,
        0,
        runner,
        counters if counters is not None else Counters(),
        plan=plan,
        dataset=dataset,
        device=device,
        on_batch=lambda batch_id, position: None,
        lockstep=lockstep,
    )
    try:
        yield epoch
    finally:
        await epoch.aclose()
        runner.close()


def run_spawned_ranks(
    target: Callable[..., None],
    args_of: Callable[[int], tuple[Any, ...]],
    world: int,
    limit_s: float,
) -> list[Any]:
    """Run ``target(*args_of(rank), sender)`` in ``world`` spawned processes, one per rank,
    and return what each sends on its pipe, in rank order. Each must report within
    ``limit_s`` and exit 0; every process is joined, and killed if it outlives the test."""
    ctx = multiprocessing.get_context("spawn")
    processes: list[Any] = []
    receivers: list[Any] = []
    try:
        for rank in range(world):
            receiver, sender = ctx.Pipe(duplex=False)
            process = ctx.Process(target=target, args=(*args_of(rank), sender), daemon=True)
            process.start()
            sender.close()
            processes.append(process)
            receivers.append(receiver)
        results = []
        for rank, receiver in enumerate(receivers):
            assert receiver.poll(limit_s), f"rank {rank} did not report within {limit_s} s"
            try:
                results.append(receiver.recv())
            except EOFError:  # it died before reporting: name it and how it ended
                processes[rank].join(limit_s)
                code = processes[rank].exitcode
                raise AssertionError(
                    f"rank {rank} exited with code {code} before reporting (see its stderr)"
                ) from None
        for rank, process in enumerate(processes):
            process.join(limit_s)
            assert process.exitcode == 0, f"rank {rank} exited with code {process.exitcode}"
        return results
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(5)
        for receiver in receivers:
            receiver.close()


def first_and_state(loader: Any, count: int) -> tuple[list[list[int]], dict[str, Any]]:
    """The first ``count`` batches of ``loader``'s next epoch (as lists), and its state then."""
    it = iter(loader)
    taken = as_lists([next(it) for _ in range(count)])
    state = loader.state_dict()
    del it
    return taken, state


@contextlib.contextmanager
def reporting(conn: Any) -> Iterator[None]:
    """In a spawned rank (:func:`run_spawned_ranks`): any error inside is sent on ``conn`` as
    ``("error", traceback)`` (the test shows it), and ``conn`` is closed at the end."""
    try:
        yield
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def gloo_group(rank: int, world_size: int, store: str, interface: str) -> None:
    """Join a gloo process group of ``world_size`` through the file ``store``, listening on
    ``interface`` only (loopback: nothing leaves the machine)."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = interface
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
