"""Tests of the worker processes (``_workers``) and the process runner (``_workers._runner``).

What a worker is told and what it does with it (``get_worker_info``, seeding), how batches come
back (views of shared memory, zero copies), how workers are started (forkserver, spawn; fork and
unpicklable arguments refused up front) and stopped (a hung worker is killed on close; a worker
whose main process died, even one not yet reaped, exits by itself), and that worker processes
give what threads give, errors included. The failure scenarios of RELIABILITY.md are in
``test_faults.py``.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import random
import resource
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fault_datasets as fd
import numpy as np
import psutil
import pytest
import torch
from datasets import (
    AsyncRange,
    FailAt,
    HashSeeds,
    HeapChurn,
    NamesOfASet,
    Range,
    fail_collate_on_7,
)
from helpers import as_lists, drain_sync, flat, notes_of
from hypothesis import given, settings
from hypothesis import strategies as st
from procs import no_worker_left_behind, worker_processes

import aioloader
from aioloader import (
    BatchSampler,
    DataLoader,
    SequentialSampler,
    ShardedBatchSampler,
    _shm,
    _workers,
)
from aioloader._workers import _context, _death, _pool, _worker
from aioloader._workers._info import StreamRandom

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

# -- what a worker knows -----------------------------------------------------------------------


async def test_get_worker_info_names_the_worker_inside_and_is_none_outside() -> None:
    assert aioloader.get_worker_info() is None
    loader = fd.make_loader(
        fd.WhoAmI(32), collate_fn=fd.stack_as_list, seed=1234, mp_context="forkserver"
    )
    async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S), loader:
        samples = [s async for batch in loader for s in batch]
    assert sorted(s["index"] for s in samples) == list(range(32))
    assert {s["id"] for s in samples} == {0, 1}  # both workers had work
    assert {s["num_workers"] for s in samples} == {2}
    seed_of = {s["id"]: s["seed"] for s in samples}
    assert seed_of[1] == seed_of[0] + 1  # base + worker id, as in torch
    assert all(seed_of[s["id"]] == s["seed"] for s in samples)
    assert all(s["dataset_is_copy"] for s in samples)
    # torch's own get_worker_info() tells the same, with the same dataset copy.
    assert all(s["torch"] == (s["id"], 2, s["seed"], True) for s in samples)
    pid_of = {s["id"]: s["pid"] for s in samples}
    assert len(set(pid_of.values())) == 2  # one process per id
    assert all(pid_of[s["id"]] == s["pid"] for s in samples)
    assert aioloader.get_worker_info() is None
    assert torch.utils.data.get_worker_info() is None


# -- randomness (RELIABILITY.md row 25) --------------------------------------------------------


async def _draws(dataset: Any, epochs: int = 2, **kwargs: Any) -> list[list[np.ndarray[Any, Any]]]:
    async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S), fd.make_loader(dataset, **kwargs) as loader:
        return [[np.asarray(b) async for b in loader] for _ in range(epochs)]


def _same(a: list[list[np.ndarray[Any, Any]]], b: list[list[np.ndarray[Any, Any]]]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


async def test_randomness_depends_on_seed_epoch_and_index_not_on_workers_or_crashes(
    tmp_path: Path,
) -> None:
    one = await _draws(fd.RandomSamples(24), num_workers=1, seed=7)
    two = await _draws(fd.RandomSamples(24), num_workers=2, seed=7)
    crash = fd.RandomFaulty(24, kill=9, marker_dir=str(tmp_path))
    crashed = await _draws(crash, num_workers=2, seed=7, max_retries=1)
    other = await _draws(fd.RandomSamples(24), num_workers=2, seed=8, epochs=1)
    # Index 9 was read three times: killed, re-run by the replacement worker, then in epoch 1.
    (killed, _), (rerun, _), _ = fd.visits(str(tmp_path), 9)
    assert killed != rerun
    assert _same(one, two)  # worker count does not matter
    assert _same(one, crashed)  # nor a crash and a retry in another process
    assert not _same(one[:1], other)  # the seed does
    first, second = (np.concatenate(epoch) for epoch in one)
    assert np.array_equal(first[:, 0], np.arange(24))  # sample i is in row i
    assert not np.array_equal(first[:, 1:], second[:, 1:])  # the epoch does
    for column in (1, 2, 3):  # numpy, random and torch are each seeded, and vary per sample
        assert len(set(first[:, column].tolist())) == 24


@pytest.fixture
def _keep_global_rngs() -> Iterator[None]:
    """seed_everything reseeds the process-wide generators; give them back afterwards."""
    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])


def _draw() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1).item())


@pytest.mark.usefixtures("_keep_global_rngs")
@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**63 - 1),
    epoch=st.integers(0, 10**6),
    batch_id=st.integers(0, 10**6),
)
def test_seed_everything_is_a_function_of_seed_epoch_and_batch(
    seed: int, epoch: int, batch_id: int
) -> None:
    derived = _workers.seed_everything(seed, epoch, batch_id)
    draws = _draw()
    assert _workers.seed_everything(seed, epoch, batch_id) == derived
    assert _draw() == draws  # every generator starts over from the same state
    neighbours = {
        (seed ^ 1, epoch, batch_id),
        (seed, epoch + 1, batch_id),
        (seed, epoch, batch_id + 1),
    }
    for args in neighbours:
        assert _workers.seed_everything(*args) != derived


@pytest.mark.usefixtures("_keep_global_rngs")
@pytest.mark.parametrize("reseeded", [False, True])
def test_a_stream_is_read_under_its_own_random_state_and_the_batch_keeps_its_own(
    reseeded: bool,
) -> None:
    # The batch gets its state back either way: saved and restored (worker_seeding='worker'),
    # or reseeded from its batch seed (per-batch seeds).
    def batch_state(batch_id: int) -> Any:
        _workers.seed_everything(5, 0, batch_id)
        if not reseeded:
            return None
        return lambda: _workers.seed_everything(5, 0, batch_id)

    streams = StreamRandom(seed=5)
    batch_state(7)
    batch_draws = _draw()
    with streams.reading(0, 0, True, keep=2, then=batch_state(7)):
        first = _draw()
    assert _draw() == batch_draws  # the batch's state is as if the stream never drew
    with streams.reading(0, 0, False, keep=2, then=batch_state(8)):  # another worker's turn
        second = _draw()  # the stream goes on from where it stood
    again = StreamRandom(seed=5)
    with again.reading(0, 0, True, keep=2):
        assert (_draw(), _draw()) == (first, second)  # whatever the batches drew meanwhile
    with again.reading(0, 0, True, keep=2):
        assert _draw() == first  # opens: from the start
    with again.reading(1, 1, False, keep=2):
        assert _draw() != first  # another epoch, another stream
    with StreamRandom(seed=6).reading(0, 0, True, keep=2):
        assert _draw() != first  # another seed
    with StreamRandom(seed=5).reading(1, 1, True, keep=2):
        one = _draw()  # epoch 1's stream starts with these
    # The epochs read last are kept (keep=2): epoch 0, reopened after epoch 1, outlives it.
    for epoch in (0, 1, 0, 2):
        with again.reading(epoch, epoch, True, keep=2):
            _draw()
    with again.reading(0, 0, False, keep=2):
        assert _draw() == second  # where it stood
    with again.reading(1, 1, False, keep=2):
        assert _draw() == one  # forgotten: it starts over
    # Two readings of one epoch (two iterators, set_epoch before each) go apart, each from
    # the epoch's start.
    with again.reading(10, 0, True, keep=4):
        assert _draw() == first
    with again.reading(11, 0, True, keep=4):
        assert _draw() == first
    with again.reading(10, 0, False, keep=4):
        assert _draw() == second


@pytest.mark.usefixtures("_keep_global_rngs")
def test_a_stream_that_shards_itself_draws_as_the_batch_does_once_it_says_so() -> None:
    streams = StreamRandom(seed=5)
    _workers.seed_everything(5, 0, 1)
    batch_draws = (_draw(), _draw())
    _workers.seed_everything(5, 0, 1)
    with streams.reading(0, 0, True, keep=2):
        streams.leave()  # it read which worker it is in
        assert _draw() == batch_draws[0]
    with streams.reading(0, 0, False, keep=2):
        assert _draw() == batch_draws[1]  # for the rest of the epoch
    with streams.reading(0, 0, True, keep=2):
        assert _draw() != batch_draws[0]  # reopened: its own state until it says so again


# -- how batches come back ---------------------------------------------------------------------


def _segment_ranges() -> list[tuple[int, int]]:
    """Address ranges at which this process maps shared-memory segments of ours, as the kernel
    lists them (``/proc/self/maps``): where a batch that is a view of a slot must lie."""
    ours = os.path.join(_shm.SHM_DIR, _shm.SHM_PREFIX)
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(ours):
                low, high = (int(address, 16) for address in fields[0].split("-"))
                ranges.append((low, high))
    return ranges


async def test_large_batches_are_views_of_shared_memory_until_dropped() -> None:
    prefetch, count = 2, 10
    ds = fd.Faulty(64 * count, shape=(3, 64, 64))  # batches of 64x3x64x64 uint8: 768 KiB
    async with fd.make_loader(ds, batch_size=64, prefetch=prefetch) as loader:
        held: list[torch.Tensor] = []
        in_use = []
        async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S):
            async for batch in loader:
                held.append(batch)
                in_use.append(loader.statistics().held_shm_slots)
        del batch
        for k, b in enumerate(held):
            assert b.dtype == torch.uint8
            assert tuple(b.shape) == (64, 3, 64, 64)
            want = torch.arange(64 * k, 64 * k + 64, dtype=torch.int64) % 256
            assert torch.equal(b.reshape(64, -1).to(torch.int64), want[:, None].expand(64, 12288))
        ranges = _segment_ranges()
        in_shm = [any(lo <= b.data_ptr() < hi for lo, hi in ranges) for b in held]
        # The first batches travel pickled (their size is not known yet); then every batch is
        # a view of a slot, and each held batch keeps its slot.
        assert sum(in_shm) >= count - prefetch - 1
        assert in_shm[-1]
        assert in_use[-1] == sum(in_shm)
        assert in_use == sorted(in_use)  # rises while batches are held
        del held, b
        gc.collect()
        stats = loader.statistics()
        assert stats.held_shm_slots == 0
        assert stats.live_shm_slots > 0  # kept for reuse, not unlinked


async def test_failed_open_of_a_slot_releases_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = _shm.SlotPool.open
    calls: list[object] = []

    def flaky_open(self: _shm.SlotPool, slot: _shm.Slot, tree: Any) -> Any:
        calls.append(slot)
        if len(calls) == 1:
            raise ValueError("injected failure to map a slot")
        return real_open(self, slot, tree)

    monkeypatch.setattr(_shm.SlotPool, "open", flaky_open)
    ds = fd.Faulty(96, shape=(16, 32, 32))  # 128 KiB batches: shared memory
    async with fd.make_loader(ds, batch_size=8, num_workers=1, prefetch=1) as loader:
        run = await fd.run_epoch(aiter(loader))
        gc.collect()
        stats = loader.statistics()
    [err] = run.errors
    assert "injected failure to map a slot" in str(err)
    assert len(run.batches) == 11
    assert stats.live_shm_slots > 0  # the shared-memory path was used
    assert stats.leased_shm_slots == 0
    assert stats.held_shm_slots == 0


async def test_collate_fn_that_is_not_hashable_works_in_workers() -> None:
    async with fd.make_loader(fd.Faulty(16), collate_fn=fd.UnhashableCollate(offset=100)) as loader:
        run = await fd.run_epoch(aiter(loader))
    assert run.errors == [], [repr(e) for e in run.errors]
    assert run.batches == [[i + 100 for i in b] for b in fd.sequential_batches(16, 4)]


# -- start methods and what can be sent to a worker (RELIABILITY.md row 24) -------------------


def test_the_forkserver_preloads_the_module_workers_run() -> None:
    # Everything a worker runs is pickled by reference to one module; the forkserver imports
    # that module once, so that each worker forks with it (and numpy, torch) already loaded.
    jobs = (
        _worker.init_worker,
        _worker.run_worker,
        _worker.serve,
        _worker.load_copy,
        _worker.run_map_job,
        _worker.run_stream_job,
    )
    assert {fn.__module__ for fn in jobs} == {_context.WORKER_MODULE}


@pytest.mark.slow
def test_spawn_start_method_works() -> None:
    with fd.make_loader(fd.Faulty(24), num_workers=1, mp_context="spawn") as loader:
        assert loader.mp_context is not None
        assert loader.mp_context.get_start_method() == "spawn"
        assert [fd.batch_indices(b) for b in loader] == fd.sequential_batches(24, 4)


@no_worker_left_behind()
def test_spawned_workers_share_one_string_hash_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each spawned worker is a fresh interpreter: with a hash secret of its own, a stream over a
    # set of strings came in another order in each, and the split lost a quarter of the items.
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with DataLoader(NamesOfASet(100), batch_size=4, num_workers=2, mp_context="spawn") as loader:
        names = [name for batch in loader for name in batch]
    assert sorted(names) == sorted(f"shard-{i:04d}.tar" for i in range(100))
    # A seed the program set is the workers' too.
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    with DataLoader(HashSeeds(), batch_size=1, num_workers=2, mp_context="spawn") as loader:
        assert [seed for batch in loader for seed in batch] == ["1234"] * 4


@pytest.mark.slow
def test_spawn_workers_serve_when_descriptors_exceed_1023() -> None:
    # Under spawn a worker's pipes keep the main process's descriptor numbers; a process with
    # many files open hands it numbers that select() cannot watch.
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"needs 1200 open files, the limit is {soft}")
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with fd.make_loader(fd.Faulty(24), num_workers=1, mp_context="spawn") as loader:
            assert [fd.batch_indices(b) for b in loader] == fd.sequential_batches(24, 4)
            assert loader.statistics().worker_restarts == 0
    finally:
        for handle in held:
            os.close(handle)


def test_fork_is_accepted_and_made_safe_unless_insisted_on() -> None:
    # 'fork' is forked where that is safe (tests/test_torch_compat.py runs the forks);
    # allow_fork=True forks every worker, threads or not.
    with DataLoader(Range(4), num_workers=1, mp_context="fork") as loader:
        assert [b.tolist() for b in loader] == [[0], [1], [2], [3]]
    safe = _context.resolve_context("fork", allow_fork=False)
    assert isinstance(safe, _context.ForkContext)
    assert safe.get_start_method() == "fork"
    assert _context.resolve_context(safe, allow_fork=False) is safe
    plain = _context.resolve_context("fork", allow_fork=True)
    assert not isinstance(plain, _context.ForkContext)
    assert plain.get_start_method() == "fork"
    assert _context.pickles_main_by_value(_context.resolve_context("fork", allow_fork=False))
    assert not _context.pickles_main_by_value(plain)


def test_fork_while_another_thread_runs_falls_back_with_a_warning_and_no_error() -> None:
    stop = threading.Event()
    busy = threading.Thread(target=stop.wait, name="test-busy-thread")
    busy.start()
    try:
        with fd.make_loader(fd.Faulty(8), mp_context="fork") as loader:
            assert [fd.batch_indices(b) for b in loader] == fd.sequential_batches(8, 4)
    finally:
        stop.set()
        busy.join()


def test_unknown_start_method_is_named() -> None:
    with pytest.raises(ValueError, match=r"mp_context='telepathy' is not a start method"):
        fd.make_loader(fd.Faulty(8), mp_context="telepathy")
    with pytest.raises(TypeError, match=r"mp_context must be a start method name or a context"):
        fd.make_loader(fd.Faulty(8), mp_context=42)


@pytest.mark.parametrize("arg", ["collate_fn", "worker_init_fn", "transform"])
def test_a_lambda_holding_what_cannot_travel_is_reported_at_construction(arg: str) -> None:
    # A lambda travels by value now (see test_torch_compat); one whose closure holds a lock
    # cannot travel at all, and is refused as the loader is made, naming the lock.
    lock = threading.Lock()
    with pytest.raises(
        TypeError, match=rf"^{arg}=.*lambda.* cannot be sent to worker processes: .*_thread.lock"
    ):
        fd.make_loader(fd.Faulty(8), **{arg: lambda x: (lock, x)[1]})


def test_a_dataset_holding_a_lambda_reaches_the_workers() -> None:
    # Refused before (the lambda could not be pickled by reference); sent by value now.
    with fd.make_loader(fd.Mapped(8, lambda i: i * 2), collate_fn=fd.stack_as_list) as loader:
        assert [x for batch in loader for x in batch] == [i * 2 for i in range(8)]


def test_unpicklable_dataset_is_reported_at_the_first_batch() -> None:
    # The dataset is pickled when an epoch needs it (changes made after construction count),
    # not at construction too: pickling a large dataset twice would cost twice.
    lock = threading.Lock()
    with fd.make_loader(fd.Mapped(8, lambda i: (lock, i)[1])) as loader:
        for _ in range(2):  # every epoch says so, and the loader stays usable
            with pytest.raises(
                TypeError, match=r"^dataset=Mapped\(.*cannot be sent.*_thread.lock"
            ) as info:
                next(iter(loader))
            assert "thread_pool=True" in str(info.value)  # and what to do instead


class _HoldsAFile:
    """A dataset that opens its file in __init__: fine for torch's forked workers, not for a
    pickled copy."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "rb")  # noqa: SIM115 - held for the dataset's life

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


def test_a_dataset_holding_an_open_file_is_told_to_open_it_in_each_worker(tmp_path: Path) -> None:
    (tmp_path / "data.bin").write_bytes(b"x")
    dataset = _HoldsAFile(str(tmp_path / "data.bin"))
    try:
        with (
            fd.make_loader(dataset) as loader,
            pytest.raises(TypeError, match=r"cannot pickle '_io.BufferedReader'") as info,
        ):
            next(iter(loader))
        message = str(info.value)
        assert "open it in each worker" in message
        assert "module level" not in message  # the hint of a lambda's error, wrong here
    finally:
        dataset.file.close()


class _HoldsALock(Range):
    """Guards a cache with a ``multiprocessing.Lock`` (a ``Value`` holds one too): torch's
    forked workers inherit it; a pickled copy cannot hold it."""

    def __init__(self) -> None:
        super().__init__(4)
        self.lock = multiprocessing.Lock()


def test_a_dataset_holding_a_multiprocessing_lock_is_told_to_share_a_file() -> None:
    with (
        fd.make_loader(_HoldsALock()) as loader,
        pytest.raises(TypeError, match="through inheritance") as info,
    ):
        next(iter(loader))
    message = str(info.value)
    assert "share_memory_()" in message
    assert "module level" not in message  # the hint of a lambda's error, wrong here


# -- a dead worker's job, when its awaiting task is cancelled --------------------------------------


async def test_cancelled_while_a_dead_workers_status_is_read_the_job_is_still_released(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The slot of a job whose worker died is released (on_abandon) even if the task awaiting
    # the job is cancelled while the pool reads the dead worker's exit status.
    context = _workers.resolve_context(None, allow_fork=False)
    pool = _workers.WorkerPool(1, context, 0)
    loop = asyncio.get_running_loop()
    task: asyncio.Task[Any] | None = None
    real_reap = _death.reap

    def reap_then_cancel(*args: Any) -> None:
        assert task is not None
        loop.call_soon_threadsafe(task.cancel)
        real_reap(*args)

    monkeypatch.setattr(_death, "reap", reap_then_cancel)
    released: list[int] = []
    try:
        task = asyncio.create_task(
            pool.submit(
                os._exit,
                3,
                batch_id=7,
                worker=0,
                on_abandon=lambda: released.append(1),
                resubmit_innocent=False,
            )
        )
        with pytest.raises(asyncio.CancelledError):
            await task
        assert released == [1]
    finally:
        await asyncio.to_thread(pool.close)


# -- one loader, several event loops ------------------------------------------------------------


async def test_sync_and_async_epochs_alternate_on_one_set_of_workers() -> None:
    # ``for`` runs on the loader's private loop, ``async for`` on this one: the workers' pipes
    # move between the two loops, and the same worker processes serve every epoch.
    expected = fd.sequential_batches(40, 4)
    async with fd.make_loader(fd.Faulty(40)) as loader:
        pids = loader.worker_pids
        for _ in range(2):
            assert [fd.batch_indices(b) for b in loader] == expected  # blocks this loop: fine
            run = await fd.run_epoch(aiter(loader))
            assert run.errors == []
            assert run.batches == expected
        # An epoch broken off leaves abandoned jobs with the workers: the next epoch, on the
        # other loop, still starts at once and is whole.
        it = aiter(loader)
        await anext(it)
        await it.aclose()
        assert [fd.batch_indices(b) for b in loader] == expected
        sync_it = iter(loader)
        next(sync_it)
        sync_it.close()
        run = await fd.run_epoch(aiter(loader))
        assert run.batches == expected
        assert loader.worker_pids == pids
        assert loader.statistics().worker_restarts == 0


# -- stopping ----------------------------------------------------------------------------------


async def test_closing_while_a_worker_hangs_kills_it(tmp_path: Path) -> None:
    ds = fd.Faulty(8, faults={0: fd.HANG}, marker_dir=str(tmp_path))
    loader = fd.make_loader(ds, num_workers=1)
    async with loader:
        it = aiter(loader)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await anext(it)
        [(pid, _)] = fd.visits(str(tmp_path), 0)
        assert pid in loader.worker_pids
        closing = time.monotonic()
    assert time.monotonic() - closing < _pool.SHUTDOWN_GRACE_S + 3.0
    assert fd.wait_gone([pid]) == []


def test_watchdog_sees_a_zombie_main_process_as_dead() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert _worker._alive(proc.pid)
        proc.kill()
        deadline = time.monotonic() + 5.0
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the killed process never became a zombie"
            time.sleep(0.01)
        assert not _worker._alive(proc.pid)  # killed, not reaped yet: a zombie
    finally:
        proc.kill()
        proc.wait(timeout=5)
    assert not _worker._alive(proc.pid)


# -- worker processes behave like threads -----------------------------------------------------


@no_worker_left_behind()
def test_errors_in_worker_processes_keep_their_type() -> None:
    with DataLoader(FailAt(12, {5}), batch_size=2, num_workers=2) as loader:
        for _ in range(2):  # the loader stays usable: the next epoch starts from the beginning
            got: list[Any] = []
            with pytest.raises(KeyError) as info:
                drain_sync(loader, got)
            assert got == [[0, 1], [2, 3]]
            notes = notes_of(info.value)
            assert "sample index 5" in notes
            assert "batch 2" in notes
    with DataLoader(Range(10), batch_size=3, num_workers=2, collate_fn=fail_collate_on_7) as dl:
        got = []
        with pytest.raises(ValueError, match="cannot collate 7") as collate_info:
            drain_sync(dl, got)
        assert got == [[0, 1, 2], [3, 4, 5]]
        assert "batch 2" in notes_of(collate_info.value)


@no_worker_left_behind()
def test_worker_processes_give_the_same_batches_as_threads() -> None:
    kwargs: dict[str, Any] = {"batch_size": 5, "shuffle": True, "seed": 21}
    with DataLoader(Range(33), **kwargs) as threads:
        want = [as_lists(list(threads)) for _ in range(2)]
    before = worker_processes()
    with DataLoader(Range(33), num_workers=2, **kwargs) as processes:
        assert [as_lists(list(processes)) for _ in range(2)] == want
        assert len(worker_processes() - before) == 2  # really two processes, now running
        assert len(processes) == 7
        for _ in processes:  # a break mid-epoch, then a complete epoch
            break
        assert sorted(flat(list(processes))) == list(range(33))
    # Async items are fetched on the loop, then collated in a worker; sharded batches too.
    sampler = ShardedBatchSampler(BatchSampler(SequentialSampler(9), 4), num_shards=3)
    with DataLoader(
        AsyncRange(9), batch_size=None, batch_sampler=sampler, num_workers=2
    ) as processes:
        batches = list(processes)
    assert [[shard.tolist() for shard in batch] for batch in batches] == [
        [[0, 1], [2], [3]],
        [[4, 5], [6], [7]],
        [[8]],
    ]


@pytest.mark.skipif(
    not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"), reason="glibc's malloc"
)
def test_a_worker_reuses_freed_heap_from_batch_to_batch() -> None:
    # 4 MiB allocated and freed per sample: given back to the kernel each time, every page of
    # it would be faulted in again (~1,000 faults a sample); kept, the next sample reuses it.
    with DataLoader(HeapChurn(), batch_size=None, num_workers=1) as loader:
        faults = list(loader)
    assert len(faults) == 24
    assert statistics.median(faults[4:]) < 100, faults
