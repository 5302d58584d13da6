"""RELIABILITY.md scenarios not covered elsewhere, or covered on one start method or one loop
only: the crash scenarios under the ``spawn`` start method, synchronous (``for``) epochs with
faults on the stock asyncio loop as well as uvloop, a straggler at the head of the order, an
epoch dropped inside a reference cycle. Each runs under the full leak check
(``conftest.baseline``: no descriptor, thread, process, segment or task above the baseline).
``tests/RELIABILITY_COVERAGE.md`` maps every numbered scenario to its tests.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from pathlib import Path

import conftest
import fault_datasets as fd
import pytest
from helpers import Baseline

import aioloader

# 128 KiB batches (8 samples of 16 KiB): they travel through shared memory.
SHAPE = (16, 32, 32)


async def released_within(loader: aioloader.DataLoader, seconds: float) -> bool:
    """Whether no batch holds a shared-memory slot any more, within ``seconds``."""
    deadline = time.monotonic() + seconds
    while loader.statistics().held_shm_slots and time.monotonic() < deadline:
        gc.collect()
        await asyncio.sleep(0.02)
    return loader.statistics().held_shm_slots == 0


# -- row 10: an error kept by the consumer holds the iterator in a reference cycle -------------


async def _keep_the_error(loader: aioloader.DataLoader) -> list[BaseException]:
    """Iterate until a batch raises; return the error, whose traceback holds this frame (and so
    the iterator, and the list itself: a reference cycle only the collector frees)."""
    kept: list[BaseException] = []
    it = aiter(loader)
    async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S):
        while not kept:
            try:
                await anext(it)
            except ValueError as exc:
                kept.append(exc)
    return kept


async def test_an_epoch_dropped_in_a_reference_cycle_is_closed_without_destroying_its_tasks(
    tmp_path: Path, baseline: Baseline
) -> None:
    ds = fd.Faulty(200, shape=SHAPE, faults={20: fd.RAISE}, marker_dir=str(tmp_path))
    async with fd.make_loader(ds, batch_size=8) as loader:
        kept = await _keep_the_error(loader)
        assert "sample index 20 of batch 2" in "\n".join(kept[0].__notes__)
        # The next epoch, while the first is still held (by the error): the loader holds the
        # new one now, so only the error keeps the old one.
        run = await fd.run_epoch(aiter(loader))
        assert run.errors == []
        assert run.batches == fd.sequential_batches(200, 8)
        del kept
        gc.collect()  # finds the iterator, its epoch and their pending tasks unreachable at once
        # The iterator's finalizer closes the epoch on the loop: its batches go within 2 s.
        assert await released_within(loader, 2.0)
        again = await fd.run_epoch(aiter(loader))
        assert again.batches == fd.sequential_batches(200, 8)
    # conftest: no "Task was destroyed but it is pending!" reached the loop's handler


# -- row 19: a straggler at the head of the order ---------------------------------------------


async def test_a_straggler_at_the_head_is_bounded_by_its_deadline_and_memory_stays_bounded(
    tmp_path: Path, baseline: Baseline
) -> None:
    # Batch 0 hangs; the batches behind it finish and wait for their turn in sampler order.
    prefetch = 4
    ds = fd.Faulty(96, shape=SHAPE, faults={0: fd.HANG}, marker_dir=str(tmp_path))
    expected = fd.sequential_batches(96, 8)
    async with fd.make_loader(ds, batch_size=8, prefetch=prefetch, timeout=1.0) as loader:
        it = aiter(loader)
        head = asyncio.ensure_future(anext(it))
        started = time.monotonic()
        held: list[int] = []
        slots: list[int] = []
        async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S):
            while not head.done():  # what the pipeline holds while the head is late
                stats = loader.statistics()
                held.append(stats.in_flight + stats.waiting)
                slots.append(stats.live_shm_slots)
                await asyncio.sleep(0.02)
        waited = time.monotonic() - started
        error = head.exception()
        assert isinstance(error, aioloader.LoaderTimeoutError), repr(error)
        assert "batch 0 (indices [0, 1, 2, 3, 4, 5, 6, 7])" in str(error)
        assert 1.0 <= waited < 5.0  # its deadline, not the hang
        assert max(held) <= prefetch, held
        assert max(slots) <= prefetch + 1, slots  # the next batches wait, no more are made
        run = await fd.run_epoch(it)
        run.errors.insert(0, error)
        run.order.insert(0, error)
        fd.assert_exact(run, expected)
        assert loader.statistics().live_shm_slots > 0  # the batches went through shared memory


# -- rows 6, 7, 8, 12, 23, 28: faults in synchronous epochs, on each event loop ------------------


def _sync_epoch(loader: aioloader.DataLoader, stop_after: int | None = None) -> fd.EpochRun:
    """One ``for`` epoch: batches and the errors ``next()`` raised (the epoch goes on after
    each, as torch's does); ``break`` after ``stop_after`` outcomes."""
    run = fd.EpochRun()
    it = iter(loader)
    while stop_after is None or len(run.order) < stop_after:
        try:
            batch = next(it)
        except StopIteration:
            break
        except Exception as exc:
            run.errors.append(exc)
            run.order.append(exc)
            continue
        run.batches.append(fd.batch_indices(batch))
        run.order.append(run.batches[-1][0])
        del batch
    return run


def _crash_of(err: BaseException, marker_dir: str, index: int, how: str) -> int:
    """Check that ``err`` reports the death of the worker that visited ``index``; its pid."""
    assert isinstance(err, aioloader.WorkerCrashedError), repr(err)
    [(pid, _)] = fd.visits(marker_dir, index)
    assert err.pid == pid
    assert f"(pid {pid}) {how}" in str(err), str(err)
    return pid


def test_sync_epochs_with_crashes_a_hang_and_a_break_on_each_loop(
    tmp_path: Path, sync_loop: str, baseline: Baseline
) -> None:
    marker_dir = str(tmp_path)
    faults = {5: fd.SIGKILL, 22: fd.SIGSEGV, 37: fd.EXIT0, 50: fd.HANG}
    ds = fd.Faulty(64, faults=faults, marker_dir=marker_dir)
    expected = fd.sequential_batches(64, 4)
    started = time.monotonic()
    # prefetch == num_workers: no batch waits in the hung worker's queue behind the hang.
    with fd.make_loader(ds, timeout=1.0, prefetch=2) as loader:
        run = _sync_epoch(loader)
        kill, segv, exit0, hang = run.errors
        pids = [
            _crash_of(kill, marker_dir, 5, "was killed by SIGKILL"),
            _crash_of(segv, marker_dir, 22, "was killed by SIGSEGV"),
            _crash_of(exit0, marker_dir, 37, "exited unexpectedly with code 0"),
        ]
        assert "out-of-memory killer" in str(kill)
        assert isinstance(hang, aioloader.LoaderTimeoutError)
        assert "batch 12 (indices [48, 49, 50, 51])" in str(hang)
        [(hung, _)] = fd.visits(marker_dir, 50)
        pids.append(hung)
        fd.assert_exact(run, expected)
        assert fd.wait_gone(pids) == []
        # A `break` mid-epoch, then a whole epoch: nothing stale, nothing lost.
        broken = _sync_epoch(loader, stop_after=3)
        assert broken.batches == expected[:3]
        again = _sync_epoch(loader)
        assert again.errors == []
        assert again.batches == expected
        # (the hung worker's replacement may start after its epoch ended: counted by now)
        assert loader.statistics().worker_restarts == 4
    assert time.monotonic() - started < fd.SCENARIO_TIMEOUT_S
    assert conftest.SYNC_LOOPS_MADE  # the epochs ran on the loop asked for
    assert {m.split(".")[0] for m in conftest.SYNC_LOOPS_MADE} == {
        "uvloop" if sync_loop == "uvloop" else "asyncio"
    }


# -- rows 6, 7, 24: crashes and a hang under the spawn start method -----------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sync_loop", ["asyncio"], indirect=True)
@pytest.mark.parametrize("mp_context", ["spawn"])
def test_spawn_workers_killed_or_hung_are_named_replaced_and_lose_nothing(
    tmp_path: Path,
    mp_context: str,
    sync_loop: str,
    baseline: Baseline,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # One worker, one epoch, each fault once: a worker under spawn starts a fresh interpreter
    # (seconds on a loaded machine; the forkserver tests cover each fault alone, on both loops).
    marker_dir = str(tmp_path)
    faults = {5: fd.SIGKILL, 22: fd.SIGSEGV, 37: fd.HANG}
    ds = fd.Faulty(48, faults=faults, marker_dir=marker_dir)
    expected = fd.sequential_batches(48, 4)
    started = time.monotonic()
    caplog.set_level(logging.WARNING, logger="aioloader.workers")
    # The hang is caught by the batch deadline (timeout); a spawned replacement's start (a
    # fresh interpreter importing torch) gets its own, longer deadline, so that a loaded
    # machine's slow start is not taken for the fault under test.
    with fd.make_loader(
        ds, num_workers=1, mp_context=mp_context, timeout=5.0, start_timeout=60.0, max_retries=1
    ) as loader:
        assert loader.mp_context is not None
        assert loader.mp_context.get_start_method() == "spawn"
        run = _sync_epoch(loader)
        stats = loader.statistics()
    # With max_retries=1 the lost batches are re-run: complete, exact, in order, no error.
    assert run.errors == []
    assert run.batches == expected
    assert (stats.worker_restarts, stats.retries, stats.timeouts) == (3, 3, 1)
    visits = {index: [pid for pid, _ in fd.visits(marker_dir, index)] for index in faults}
    assert all(len(pids) == 2 for pids in visits.values())  # the failed visit, the re-run
    # Each loss was told (aioloader.workers) naming the process and how it ended.
    told = "\n".join(r.getMessage() for r in caplog.records if r.name == "aioloader.workers")
    assert f"(pid {visits[5][0]}) was killed by SIGKILL" in told, told
    assert f"(pid {visits[22][0]}) was killed by SIGSEGV" in told, told
    assert f"worker process pid {visits[37][0]} killed and replaced: batch 9 passed" in told, told
    assert fd.wait_gone([pid for pids in visits.values() for pid in pids]) == []
    assert time.monotonic() - started < fd.SCENARIO_TIMEOUT_S
