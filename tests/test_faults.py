"""Fault injection on the process-worker path: each test is a row of RELIABILITY.md.

Faults fire inside real worker processes (see ``fault_datasets``: exceptions, SIGKILL, SIGSEGV,
``os._exit``, a hang), once per marker file, so "fails the first time, works on the retry" is
deterministic. Every scenario is bounded by ``asyncio.timeout`` (or a subprocess timeout) well
inside the 30 s cap, and checks the common assertions: the error's type and what it names, that
nothing was lost or delivered twice (an index checksum against the sampler), and that every
worker process it started is gone. Scenarios that kill or signal the loader's own process run it
in a child Python process.

Note: the after-test leak check in ``conftest`` skips processes whose command line mentions the
forkserver, and forkserver workers carry that command line; so the tests below check worker pids
themselves with psutil.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import fault_datasets as fd
import pytest
from datasets import Slow
from helpers import until

import aioloader
from aioloader import _shm
from aioloader._sampling._sampler import BatchSampler, RandomSampler
from aioloader._workers import _pool

# Every scenario here gets the full leak check of RELIABILITY.md (common assertion iii): no
# descriptor, thread, process, segment or asyncio task above the baseline (conftest.baseline).
pytestmark = pytest.mark.usefixtures("baseline")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# A child scenario must finish inside this, start-up (importing torch twice) included.
CHILD_TIMEOUT_S = 60.0
# A child interrupted exits within a second or two; past this, the test shows its stacks
# (the suite's own 60 s timeout would cut the test first, with nothing of the child's).
INTERRUPT_WAIT_S = 20.0


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def _fd_target(fd_: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd_}")
    except OSError:
        return "?"


def _shuffled_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    sampler = RandomSampler(n, seed=seed)
    sampler.set_epoch(epoch)
    return [list(b) for b in BatchSampler(sampler, batch_size)]


# -- row 1: an exception in __getitem__ ------------------------------------------------------


async def test_getitem_error_keeps_its_type_names_index_and_worker_and_loader_goes_on(
    tmp_path: Path,
) -> None:
    ds = fd.Faulty(40, faults={13: fd.KEY_ERROR}, marker_dir=str(tmp_path))
    expected = fd.sequential_batches(40, 4)
    async with fd.make_loader(ds) as loader:
        run = await fd.run_epoch(aiter(loader))
        [err] = run.errors
        assert isinstance(err, KeyError)  # the user's own type: `except KeyError` still works
        [(pid, _)] = fd.visits(str(tmp_path), 13)
        notes = "\n".join(err.__notes__)
        assert "sample index 13 of batch 3" in notes
        assert re.search(rf"in worker [01] \(pid {pid}\)", notes), notes
        remote = str(err.__cause__)  # the worker's traceback text travels as the cause
        assert "fault_datasets.py" in remote
        assert "in fire" in remote
        assert "KeyError" in remote
        assert run.order[3] is err  # raised at that batch's turn, not earlier or later
        fd.assert_exact(run, expected)  # the batches after it still came

        again = await fd.run_epoch(aiter(loader))  # the next epoch is whole
        assert again.errors == []
        assert again.batches == expected
        assert loader.statistics().worker_restarts == 0  # an exception is not a crash


async def test_unpicklable_error_arrives_as_runtime_error_naming_its_type(tmp_path: Path) -> None:
    ds = fd.Faulty(16, faults={6: fd.UNPICKLABLE}, marker_dir=str(tmp_path))
    async with fd.make_loader(ds) as loader:
        run = await fd.run_epoch(aiter(loader))
        [err] = run.errors
        assert type(err) is RuntimeError
        text = str(err)
        assert "fault_datasets.TwoArgError" in text
        assert "could not be pickled" in text
        assert "injected failure at index 6" in text
        assert "in fire" in text
        assert "sample index 6 of batch 1" in "\n".join(err.__notes__)
        fd.assert_exact(run, fd.sequential_batches(16, 4))
        assert loader.statistics().worker_restarts == 0  # the pool survived it


async def test_unpicklable_error_is_rebuilt_as_its_own_type_where_its_type_allows(
    tmp_path: Path,
) -> None:
    # As torch's DataLoader does: an exception that holds what cannot be pickled comes back as
    # its own type, made from its message, so that `except HoldingError` still catches it.
    faults = {5: fd.HOLDING, 10: fd.HOLDING_KEY}
    ds = fd.Faulty(16, faults=faults, marker_dir=str(tmp_path))
    async with fd.make_loader(ds) as loader:
        run = await fd.run_epoch(aiter(loader))
        holding, key = run.errors
        assert type(holding) is fd.HoldingError
        assert holding.held is None  # the lock stayed in the worker
        text = str(holding)
        assert text.startswith("injected failure at index 5 (a fault_datasets.HoldingError")
        assert "could not be pickled" in text
        assert "in fire" in text  # the worker's traceback, in the message
        assert "sample index 5 of batch 1" in "\n".join(holding.__notes__)
        assert type(key) is KeyError
        lines = str(key).splitlines()  # shown as written: not one repr'd line of "\\n"s
        assert "could not be pickled" in lines[0]
        assert any("in fire" in line for line in lines[1:]), lines
        assert "sample index 10 of batch 2" in "\n".join(key.__notes__)
        fd.assert_exact(run, fd.sequential_batches(16, 4))
        assert loader.statistics().worker_restarts == 0


# -- row 3: an exception in collate_fn --------------------------------------------------------


async def test_collate_error_names_batch_and_indices_and_leaves_no_slot_leased() -> None:
    # 16 KiB samples, 8 a batch: batches travel through shared memory once the size is known.
    ds = fd.Faulty(96, shape=(16, 32, 32))
    expected = fd.sequential_batches(96, 8)
    async with fd.make_loader(ds, batch_size=8, collate_fn=fd.FailingCollate(70)) as loader:
        run = await fd.run_epoch(aiter(loader))
        [err] = run.errors
        assert isinstance(err, ValueError)
        assert "injected collate failure" in str(err)
        notes = "\n".join(err.__notes__)
        assert "while collating batch 8 of indices [64, 65, 66, 67, 68, 69, 70, 71]" in notes
        assert re.search(r"in worker [01] \(pid \d+\)", notes), notes
        fd.assert_exact(run, expected)
        gc.collect()
        stats = loader.statistics()
        assert stats.live_shm_slots > 0  # the shared-memory path was used
        assert stats.leased_shm_slots == 0
        assert stats.held_shm_slots == 0


# -- row 4: an exception in worker_init_fn ----------------------------------------------------


async def test_worker_init_error_fails_fast_at_the_first_batch_without_retry_loop() -> None:
    started = time.monotonic()
    loader = fd.make_loader(fd.Faulty(64), worker_init_fn=fd.failing_init, max_retries=3)
    async with loader:
        run = await fd.run_epoch(aiter(loader), stop_at_error=True)
        stats = loader.statistics()
    [err] = run.errors
    assert run.order == [err]  # the very first thing the consumer gets
    assert isinstance(err, aioloader.WorkerInitError)
    text = str(err)
    assert re.search(r"worker [01] \(pid \d+\) failed to start", text), text
    assert "OSError: injected init failure in worker" in text
    assert "in failing_init" in text  # the traceback from the worker
    assert stats.retries == 0
    assert stats.worker_restarts == 0
    assert time.monotonic() - started < 10.0


async def test_worker_dying_while_it_starts_fails_fast_instead_of_restarting_forever() -> None:
    # The worker exits while unpickling the dataset: no job ever runs, so no batch is to blame.
    started = time.monotonic()
    async with fd.make_loader(fd.DiesOnUnpickle(64), num_workers=1) as loader:
        run = await fd.run_epoch(aiter(loader), stop_at_error=True)
        restarts = loader.statistics().worker_restarts
    [err] = run.errors
    assert isinstance(err, aioloader.WorkerInitError)
    text = str(err)
    assert re.search(r"worker 0 \(pid \d+\) exited unexpectedly with code 3", text), text
    assert "before it ran any job" in text
    assert "batch 0" in text
    assert restarts <= 2 * _pool.MAX_START_FAILURES  # bounded, not a loop
    assert time.monotonic() - started < 15.0


# -- rows 6 and 8: a worker killed mid-batch ---------------------------------------------------


@pytest.mark.parametrize(
    ("action", "how"),
    [
        (fd.SIGKILL, "was killed by SIGKILL"),
        (fd.SIGSEGV, "was killed by SIGSEGV"),
        (fd.EXIT0, "exited unexpectedly with code 0"),  # row 8: never a silent loss
    ],
)
async def test_worker_dying_mid_batch_is_reported_then_replaced(
    tmp_path: Path, action: str, how: str
) -> None:
    ds = fd.Faulty(48, faults={21: action}, marker_dir=str(tmp_path))
    expected = fd.sequential_batches(48, 4)
    async with fd.make_loader(ds) as loader:
        run = await fd.run_epoch(aiter(loader))
        [err] = run.errors
        assert isinstance(err, aioloader.WorkerCrashedError)
        [(pid, fired_at)] = fd.visits(str(tmp_path), 21)
        text = str(err)
        assert f"(pid {pid}) {how}" in text, text
        assert "while making batch 5" in text, text
        assert "indices [20, 21, 22, 23]" in "\n".join(err.__notes__)
        assert err.pid == pid
        assert err.exitcode == {fd.SIGKILL: -9, fd.SIGSEGV: -11, fd.EXIT0: 0}[action]
        assert ("out-of-memory killer" in text) == (action == fd.SIGKILL)
        assert isinstance(err.__cause__, BrokenProcessPool)
        assert run.error_times[0] - fired_at < 1.0  # noticed within a second
        fd.assert_exact(run, expected)  # the batches queued behind it were re-run, not lost
        assert fd.wait_gone([pid]) == []
        assert loader.statistics().worker_restarts == 1

        again = await fd.run_epoch(aiter(loader))  # the rebuilt pool serves the next epoch
        assert again.errors == []
        assert again.batches == expected
        assert pid not in loader.worker_pids


async def test_every_crash_names_its_own_pid_and_signal(tmp_path: Path) -> None:
    # Six crashes in a row, on both workers: each report must carry the exit status of the
    # process that died (it is read once from the forkserver; a racing second reader would
    # get 255 instead of the signal).
    bad = list(range(2, 48, 8))  # one index in each of batches 0, 2, 4, ... 10
    ds = fd.Faulty(48, faults=dict.fromkeys(bad, fd.SIGKILL), marker_dir=str(tmp_path))
    async with fd.make_loader(ds) as loader:
        run = await fd.run_epoch(aiter(loader))
    assert [fd.failed_batch_id(e) for e in run.errors] == [i // 4 for i in bad]
    for err, index in zip(run.errors, bad, strict=True):
        assert isinstance(err, aioloader.WorkerCrashedError)
        [(pid, _)] = fd.visits(str(tmp_path), index)
        assert (err.pid, err.exitcode) == (pid, -signal.SIGKILL), str(err)
    fd.assert_exact(run, fd.sequential_batches(48, 4))


@pytest.mark.parametrize("action", [fd.SIGKILL, fd.SIGSEGV])
async def test_batch_lost_to_a_crash_is_rerun_with_max_retries(tmp_path: Path, action: str) -> None:
    ds = fd.Faulty(48, faults={21: action}, marker_dir=str(tmp_path))
    async with fd.make_loader(ds, max_retries=1) as loader:
        run = await fd.run_epoch(aiter(loader))
        stats = loader.statistics()
    assert run.errors == []
    assert run.batches == fd.sequential_batches(48, 4)  # complete, exact, in order
    (first, _), (second, _) = fd.visits(str(tmp_path), 21)
    assert first != second  # the retry ran in the replacement worker
    assert stats.retries == 1
    assert stats.worker_restarts == 1


# -- row 7: a worker that hangs ---------------------------------------------------------------


async def test_hung_worker_misses_its_deadline_and_is_killed_and_replaced(tmp_path: Path) -> None:
    ds = fd.Faulty(32, faults={13: fd.HANG}, marker_dir=str(tmp_path))
    expected = fd.sequential_batches(32, 4)
    # prefetch == num_workers: no other job waits behind the hung one in its worker.
    async with fd.make_loader(ds, timeout=1.0, prefetch=2) as loader:
        run = await fd.run_epoch(aiter(loader))
        [err] = run.errors
        assert isinstance(err, aioloader.LoaderTimeoutError)
        assert isinstance(err, TimeoutError)
        [(pid, _)] = fd.visits(str(tmp_path), 13)
        text = str(err)
        assert "batch 3 (indices [12, 13, 14, 15])" in text, text
        waited = re.search(r"not ready after (\d+\.\d+) s", text)
        assert waited is not None
        assert 1.0 <= float(waited.group(1)) < 5.0
        assert "timeout=1.0" in text
        assert f"worker pid {pid} was killed" in text
        assert "max_retries" in text
        assert "larger timeout" in text
        assert fd.wait_gone([pid]) == []
        fd.assert_exact(run, expected)

        again = await fd.run_epoch(aiter(loader))
        assert again.errors == []
        assert again.batches == expected
        stats = loader.statistics()
        assert stats.timeouts == 1
        assert stats.worker_restarts == 1
        assert pid not in loader.worker_pids


async def test_hung_batch_is_rerun_by_the_replacement_worker_with_max_retries(
    tmp_path: Path,
) -> None:
    # One worker: the retry is submitted to the very worker that was just killed, before its
    # death is noticed. It must go to the replacement, not be blamed for the kill.
    ds = fd.Faulty(16, faults={5: fd.HANG}, marker_dir=str(tmp_path))
    async with fd.make_loader(ds, num_workers=1, prefetch=1, timeout=1.0, max_retries=1) as loader:
        run = await fd.run_epoch(aiter(loader))
        stats = loader.statistics()
    assert run.errors == []
    assert run.batches == fd.sequential_batches(16, 4)
    (hung, _), (rerun, _) = fd.visits(str(tmp_path), 5)
    assert hung != rerun
    assert stats.timeouts == 1
    assert stats.retries == 1
    assert stats.worker_restarts == 1
    assert fd.wait_gone([hung]) == []


async def test_batch_queued_behind_a_hung_one_does_not_time_out(tmp_path: Path) -> None:
    # One worker, two batches in flight: batch 1 waits in the worker's queue behind batch 0,
    # which hangs. Only batch 0 should miss its deadline; batch 1 never ran, and should be
    # made by the replacement worker rather than reported as late.
    ds = fd.Faulty(16, faults={0: fd.HANG}, marker_dir=str(tmp_path))
    async with fd.make_loader(ds, num_workers=1, prefetch=2, timeout=1.0) as loader:
        run = await fd.run_epoch(aiter(loader))
    assert [fd.failed_batch_id(e) for e in run.errors] == [0], [str(e) for e in run.errors]
    fd.assert_exact(run, fd.sequential_batches(16, 4))


async def _leave_while_running(loader: aioloader.DataLoader, marks: str, index: int) -> int:
    """Take one batch, wait until a worker reads sample ``index`` (it hangs there), then leave
    the epoch; the pid of the worker that hangs."""
    it = aiter(loader)
    async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S):
        await anext(it)
    await until(lambda: bool(fd.visits(marks, index)))
    [(hung, _)] = fd.visits(marks, index)
    await it.aclose()
    return hung


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "renewed"])
async def test_a_batch_its_epoch_gave_up_that_hangs_does_not_hold_up_the_next(
    tmp_path: Path, persistent: bool
) -> None:
    # One worker. The consumer leaves the epoch while the worker runs batch 1, which hangs:
    # nobody awaits it any more, and the next epoch's batches queue behind it in that worker,
    # where their own deadlines have not begun. The worker is killed once the given-up batch
    # has run past the deadline, and the next epoch comes whole from its replacement.
    marks = str(tmp_path)
    ds = fd.Faulty(16, faults={5: fd.HANG}, marker_dir=marks)
    async with fd.make_loader(
        ds, num_workers=1, prefetch=2, timeout=0.5, persistent_workers=persistent
    ) as loader:
        hung = await _leave_while_running(loader, marks, 5)
        run = await fd.run_epoch(aiter(loader))
        stats = loader.statistics()
    assert run.errors == []
    assert run.batches == fd.sequential_batches(16, 4)
    assert stats.worker_restarts == 1
    assert stats.timeouts == 1  # the given-up batch's missed deadline, counted at its kill
    assert fd.wait_gone([hung]) == []


async def test_a_second_iterator_behind_the_firsts_hung_batch_is_not_taken_for_it(
    tmp_path: Path,
) -> None:
    # Iterator A's batch 1 hangs; iterator B starts meanwhile (both run a full epoch, as
    # torch's do) and its batches 0 and 1 queue behind it in the one worker. A's batch 1 must
    # miss its deadline (its worker killed), and B's batches come from the replacement: B's
    # batch 1 is not A's batch 1 because they share a batch id.
    marks = str(tmp_path)
    ds = fd.Faulty(16, faults={5: fd.HANG}, marker_dir=marks)
    async with fd.make_loader(ds, num_workers=1, prefetch=2, timeout=0.5) as loader:
        a = aiter(loader)
        async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S):
            await anext(a)
        await until(lambda: bool(fd.visits(marks, 5)))
        b = aiter(loader)
        second = await fd.run_epoch(b)
        first = await fd.run_epoch(a)
    assert second.errors == []
    assert second.batches == fd.sequential_batches(16, 4)
    assert [fd.failed_batch_id(e) for e in first.errors] == [1]
    assert isinstance(first.errors[0], aioloader.LoaderTimeoutError)
    assert first.batches == fd.sequential_batches(16, 4)[2:]


async def test_a_given_up_stream_pull_that_hangs_fails_the_next_epochs_pulls_saying_so(
    tmp_path: Path,
) -> None:
    # An iterable dataset: a pull queued behind the killed worker cannot go to the
    # replacement (only the dead worker's iterator knew where its stream stood). Its epoch
    # fails, saying the loader killed the worker, not the out-of-memory killer; the next
    # epoch is whole.
    marks = str(tmp_path)
    ds = fd.HangingStream(16, 5, marks)
    async with fd.make_loader(ds, num_workers=1, prefetch=2, timeout=0.5) as loader:
        hung = await _leave_while_running(loader, marks, 5)
        broken = await fd.run_epoch(aiter(loader))
        whole = await fd.run_epoch(aiter(loader))
    assert broken.errors, "the pulls queued behind the killed worker came back"
    for error in broken.errors:
        assert isinstance(error, aioloader.WorkerCrashedError), repr(error)
        assert f"pid {hung}) was killed by the loader" in str(error), str(error)
        assert "waited behind another job" in str(error), str(error)
    assert whole.errors == []
    assert whole.batches == fd.sequential_batches(16, 4)


async def test_a_given_up_batch_that_hangs_does_not_hold_up_another_loader_on_the_pool(
    tmp_path: Path,
) -> None:
    marks = str(tmp_path)
    async with aioloader.WorkerPool(1) as pool:
        hanging = fd.make_loader(
            fd.Faulty(16, faults={5: fd.HANG}, marker_dir=marks),
            workers=pool,
            num_workers=1,
            timeout=0.5,
        )
        other = fd.make_loader(fd.Faulty(12), workers=pool, num_workers=1, timeout=0.5)
        async with hanging, other:
            hung = await _leave_while_running(hanging, marks, 5)
            run = await fd.run_epoch(aiter(other))
            counted = (hanging.statistics().timeouts, other.statistics().timeouts)
        assert counted == (1, 0)  # the kill counts for the loader that gave the batch up
        assert run.errors == []
        assert run.batches == fd.sequential_batches(12, 4)
        assert hung not in pool.worker_pids
    assert fd.wait_gone([hung]) == []


# -- rows 10 and 12: the consumer stops early --------------------------------------------------


async def test_error_in_the_training_loop_tears_everything_down() -> None:
    loader = fd.make_loader(fd.Faulty(10_000, shape=(16, 32, 32)), batch_size=8)
    pids: list[int] = []

    async def train() -> None:
        async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S), loader:
            async for batch in loader:
                pids.extend(loader.worker_pids)
                del batch
                raise RuntimeError("training step failed")

    with pytest.raises(RuntimeError, match="training step failed"):
        await train()
    assert len(pids) == 2
    assert fd.wait_gone(pids) == []
    assert "closed" in repr(loader)
    with pytest.raises(RuntimeError, match="closed"):
        aiter(loader)
    tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith("aioloader")]
    assert tasks == []


async def test_break_then_the_next_epoch_is_complete_and_exact() -> None:
    ds = fd.Faulty(200, shape=(16, 32, 32))
    async with fd.make_loader(ds, batch_size=8, shuffle=True, seed=3) as loader:
        async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S):
            async for batch in loader:
                first = fd.batch_indices(batch)
                break
        assert first == _shuffled_batches(200, 8, 3, 0)[0]
        del batch
        run = await fd.run_epoch(aiter(loader))
        assert run.errors == []
        assert run.batches == _shuffled_batches(200, 8, 3, 1)


async def test_iterator_dropped_without_aclose_is_cleaned_within_2_s() -> None:
    ds = fd.Faulty(200, shape=(16, 32, 32))
    async with fd.make_loader(ds, batch_size=8) as loader:
        it = aiter(loader)
        async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S):
            for _ in range(3):
                await anext(it)
        del it
        gc.collect()
        deadline = time.monotonic() + 2.0
        while True:
            tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith("aioloader")]
            held = loader.statistics().held_shm_slots
            if (not tasks and held == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert tasks == [], "tasks of a dropped iterator still run"
        assert held == 0, "batches of a dropped iterator still hold shared memory"
        run = await fd.run_epoch(aiter(loader))  # and the next epoch is whole
        assert run.errors == []
        assert run.batches == fd.sequential_batches(200, 8)


# -- row 13: the consumer is cancelled while it awaits a batch --------------------------------


async def test_cancelled_wait_for_a_batch_loses_nothing() -> None:
    expected = fd.sequential_batches(12, 2)
    got: list[list[int]] = []
    cancelled = 0
    async with fd.make_loader(Slow(12, 0.05), batch_size=2, num_workers=1) as loader:
        it = aiter(loader)
        async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S):
            while True:
                try:
                    if cancelled % 2:  # both ways a consumer gives up on a batch
                        batch = await asyncio.wait_for(anext(it), 0.02)
                    else:
                        async with asyncio.timeout(0.02):
                            batch = await anext(it)
                except TimeoutError:
                    cancelled += 1
                    continue
                except StopAsyncIteration:
                    break
                got.append(fd.batch_indices(batch))
            # and a consumer task cancelled outright: the same iterator still yields it all
            it = aiter(loader)

            async def first() -> object:
                return await anext(it)

            task = asyncio.create_task(first())
            await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            run = await fd.run_epoch(it)
    assert cancelled > 0
    assert got == expected
    assert run.batches == expected


# -- rows 21 and 23: crashes in one epoch, the next one is exact, nothing leaks ---------------


async def test_three_epochs_with_crashes_leave_nothing_and_stay_exact(tmp_path: Path) -> None:
    n, size, seed = 64, 4, 11
    # Index 7 crashes its worker on its first two visits: one in epoch 0, one in epoch 1.
    ds = fd.Faulty(
        n, shape=(32, 32, 32), faults={7: fd.SIGKILL}, marker_dir=str(tmp_path), on_visits=(0, 1)
    )
    async with fd.make_loader(fd.Faulty(8), num_workers=1) as warm:  # the forkserver's own fds
        await fd.run_epoch(aiter(warm))
    fds_before = _open_fds()
    seen_pids: set[int] = set()
    async with fd.make_loader(ds, batch_size=size, shuffle=True, seed=seed) as loader:
        # Epoch 0: stop at the crash, with other batches still in flight.
        run0 = await fd.run_epoch(aiter(loader), stop_at_error=True)
        assert len(run0.errors) == 1, [f"{e!r} {getattr(e, '__notes__', '')}" for e in run0.errors]
        [err0] = run0.errors
        assert isinstance(err0, aioloader.WorkerCrashedError)
        seen_pids.update(loader.worker_pids)
        # Abandon epoch 0: its error's traceback holds the iterator, so drop them. (A new
        # iterator no longer closes an older one still held: each runs a full epoch.)
        del run0, err0
        # Epoch 1: the crash again, then every other batch, in this epoch's order only.
        run1 = await fd.run_epoch(aiter(loader))
        assert len(run1.errors) == 1, [f"{e!r} {getattr(e, '__notes__', '')}" for e in run1.errors]
        [err1] = run1.errors
        assert isinstance(err1, aioloader.WorkerCrashedError)
        fd.assert_exact(run1, _shuffled_batches(n, size, seed, 1))
        seen_pids.update(loader.worker_pids)
        # Epoch 2: clean, complete, exact: no stale batch of an earlier epoch.
        run2 = await fd.run_epoch(aiter(loader))
        assert run2.errors == []
        assert run2.batches == _shuffled_batches(n, size, seed, 2)
        seen_pids.update(loader.worker_pids)
        stats = loader.statistics()
        assert stats.worker_restarts == 2
        assert stats.live_shm_slots > 0  # 128 KiB batches: the shared-memory path was used
        gc.collect()  # epoch 0's iterator was in a cycle with its error: closed when collected
        await asyncio.sleep(0.05)  # ... on the loop, right after
        # The close runs on the loop after that collection and keeps the epoch reachable until
        # it has run; what was left of the cycle (epoch 0's batches the consumer kept, with
        # their slots) is freed by the next collection, as the garbage collector would.
        gc.collect()
        assert loader.statistics().held_shm_slots == 0
    seen_pids.update(pid for pid, _ in fd.visits(str(tmp_path), 7))
    assert fd.wait_gone(sorted(seen_pids)) == []
    mine = f"{_shm.SHM_PREFIX}{os.getpid()}_"
    assert [s for s in os.listdir(_shm.SHM_DIR) if s.startswith(mine)] == []
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("aioloader")] == []
    for _ in range(100):  # pipes of replaced workers close as their processes are reaped
        extra = _open_fds() - fds_before
        if not extra:
            break
        await asyncio.sleep(0.05)
    assert extra == set(), {fd_: _fd_target(fd_) for fd_ in extra}


# -- row 26: a slow consumer -------------------------------------------------------------------


@pytest.mark.slow
async def test_slow_consumer_gets_no_false_timeouts_and_bounded_shared_memory() -> None:
    prefetch = 2
    ds = fd.Faulty(48, shape=(16, 32, 32))  # 128 KiB batches: shared memory
    async with fd.make_loader(
        ds, batch_size=8, num_workers=1, prefetch=prefetch, timeout=0.5
    ) as loader:
        got = []
        live = []
        async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S):
            async for batch in loader:
                got.append(fd.batch_indices(batch))
                del batch
                gc.collect()
                if len(got) <= 3:
                    await asyncio.sleep(0.75)  # a training step longer than the timeout
                live.append(loader.statistics().live_shm_slots)
        stats = loader.statistics()
    assert got == fd.sequential_batches(48, 8)
    assert stats.timeouts == 0
    assert max(live) > 0, live  # the shared-memory path was used
    assert max(live) <= prefetch + 1, live


# -- row 9: the loader's own process is killed ------------------------------------------------

_KILLED_CHILD = """
import asyncio, faulthandler, os
import psutil
import fault_datasets as fd
import aioloader

async def main():
    ds = fd.Faulty(10**6, shape=(3, 64, 64))  # 96 KiB batches: shared memory
    async with aioloader.DataLoader(ds, batch_size=8, num_workers=2) as loader:
        held = []
        async for batch in loader:
            held.append(batch)  # keep them: their segments stay in use
            if len(held) == 8:
                break
        kids = [p.pid for p in psutil.Process().children(recursive=True)]
        print("pids", *loader.worker_pids, flush=True)
        print("descendants", *kids, flush=True)
        print("ready", flush=True)
        await asyncio.sleep(1000)

if __name__ == "__main__":  # workers re-import this file
    faulthandler.dump_traceback_later({timeout}, exit=True)
    asyncio.run(main())
"""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, env.get("PYTHONPATH", "")) if p)
    return env


def _read_until(proc: subprocess.Popen[bytes], marker: str, timeout: float) -> str:
    """Read the child's stdout until a line equal to ``marker``; fail after ``timeout``."""
    assert proc.stdout is not None
    fd_out = proc.stdout.fileno()
    text = ""
    deadline = time.monotonic() + timeout
    while marker not in text.splitlines():
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            proc.kill()
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"child never printed {marker!r}; stdout {text!r}, stderr {err!r}")
        ready, _, _ = select.select([fd_out], [], [], left)
        if ready:
            text += os.read(fd_out, 65536).decode()
    return text


def _ints_after(text: str, key: str) -> list[int]:
    for line in text.splitlines():
        if line.startswith(key + " ") or line == key:
            return [int(x) for x in line.split()[1:]]
    raise AssertionError(f"no {key!r} line in {text!r}")


@pytest.mark.slow
def test_killed_loader_process_workers_exit_and_janitor_removes_segments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_KILLED_CHILD.format(timeout=CHILD_TIMEOUT_S)))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_child_env(),
        bufsize=0,
    )
    try:
        text = _read_until(proc, "ready", CHILD_TIMEOUT_S)
        workers = _ints_after(text, "pids")
        descendants = _ints_after(text, "descendants")
        assert len(workers) == 2
        assert set(workers) <= set(descendants)
        prefix = f"{_shm.SHM_PREFIX}{proc.pid}_"
        assert [s for s in os.listdir(_shm.SHM_DIR) if s.startswith(prefix)], "no segments"
        os.kill(proc.pid, signal.SIGKILL)
        # Not reaped yet: the killed loader is a zombie, and its workers must still notice.
        assert fd.wait_gone(workers, 5.0) == []
        assert fd.wait_gone(descendants, 5.0) == []
    finally:
        proc.kill()
        proc.communicate(timeout=10)
    # Segments the dead loader left (plus one planted, in case something else already removed
    # them) go when the next loader starts: its janitor runs once per process.
    planted = os.path.join(_shm.SHM_DIR, f"{prefix}0badc0de")
    with open(planted, "wb"):
        pass
    monkeypatch.setattr(_shm._segment, "_janitor_pid", None)
    with fd.make_loader(fd.Faulty(8)):
        pass
    assert [s for s in os.listdir(_shm.SHM_DIR) if s.startswith(prefix)] == []


# -- row 11: SIGINT during synchronous iteration ----------------------------------------------

_INTERRUPTED_CHILD = """
import faulthandler, os, signal, threading
import psutil
import fault_datasets as fd
import aioloader

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks of a hang

def workers():
    me = os.getpid()
    return [p.pid for p in psutil.Process().children(recursive=True) if p.ppid() != me]

def main():
    ds = fd.Faulty(10**6, shape=(3, 64, 64))  # 96 KiB batches: shared memory
    loader = aioloader.DataLoader(ds, batch_size=8, num_workers=2)
    count = 0
    try:
        with loader:
            for batch in loader:
                count += 1
                if count == 8:
                    print("pids", *loader.worker_pids, flush=True)
                    print("ready", flush=True)
    except KeyboardInterrupt:
        print("interrupted", count, flush=True)
        print("workers", *workers(), flush=True)
        prefix = f"aiol_{{os.getpid()}}_"
        print("segments", *[s for s in os.listdir("/dev/shm") if s.startswith(prefix)], flush=True)
        others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        print("threads", *others, flush=True)
        raise

if __name__ == "__main__":  # workers re-import this file
    faulthandler.dump_traceback_later({timeout}, exit=True)
    main()
"""


@pytest.mark.slow
def test_sigint_during_sync_iteration_exits_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_INTERRUPTED_CHILD.format(timeout=CHILD_TIMEOUT_S)))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_child_env(),
        bufsize=0,
        start_new_session=True,  # its own process group: Ctrl-C reaches every process in it
    )
    try:
        text = _read_until(proc, "ready", CHILD_TIMEOUT_S)
        workers = _ints_after(text, "pids")
        time.sleep(0.2)  # let it iterate on
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=INTERRUPT_WAIT_S)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGUSR1)  # its threads' stacks, to its stderr
            time.sleep(1.0)
            proc.kill()
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"no exit {INTERRUPT_WAIT_S} s after Ctrl-C; its stacks:\n{err.decode()}")
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    stdout, stderr = text + out.decode(), err.decode()
    assert proc.returncode == -signal.SIGINT, (proc.returncode, stdout, stderr)
    assert took < 5.0
    assert _ints_after(stdout, "interrupted")[0] >= 8
    assert _ints_after(stdout, "workers") == []
    assert "segments" in stdout.splitlines()  # the line, with no segment after it
    assert "threads" in stdout.splitlines()
    assert stderr.count("Traceback") == 1, stderr  # the main process's; none from workers
    assert stderr.rstrip().endswith("KeyboardInterrupt"), stderr
    assert "resource_tracker" not in stderr, stderr
    assert "leaked" not in stderr, stderr
    assert fd.wait_gone(workers) == []


# -- fork, where a sibling worker holds a dead worker's pipe open ---------------------------------

_FORK_CHILD = """
import asyncio, time
import aioloader
import fault_datasets as fd


async def main() -> None:
    ds = fd.Faulty(48, faults={{21: fd.SIGKILL}}, marker_dir={marker_dir!r})
    expected = fd.sequential_batches(48, 4)
    loader = fd.make_loader(ds, mp_context="fork", allow_fork=True)
    async with loader:
        run = await fd.run_epoch(aiter(loader))
        [err] = run.errors
        assert isinstance(err, aioloader.WorkerCrashedError), repr(err)
        assert "was killed by SIGKILL" in str(err), str(err)
        [(pid, fired_at)] = fd.visits({marker_dir!r}, 21)
        assert err.pid == pid
        print("noticed_after", run.error_times[0] - fired_at, flush=True)
        fd.assert_exact(run, expected)
        again = await fd.run_epoch(aiter(loader))
        assert again.errors == [] and again.batches == expected
        closing = time.monotonic()
    print("closed_in", time.monotonic() - closing, flush=True)


async def epoch(loader) -> "fd.EpochRun":
    return await fd.run_epoch(aiter(loader))


def across_loops() -> None:
    # An idle worker dies while no loop runs: the next loop is told, and its epoch is whole.
    import os, signal
    expected = fd.sequential_batches(24, 4)
    with fd.make_loader(fd.Faulty(24), mp_context="fork", allow_fork=True) as loader:
        first = asyncio.run(epoch(loader))
        assert first.batches == expected
        pid = loader.worker_pids[0]
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        second = asyncio.run(asyncio.wait_for(epoch(loader), 20))
        assert second.errors == [] and second.batches == expected, second.errors


asyncio.run(main())
across_loops()
print("ok", flush=True)
"""


@pytest.mark.slow
def test_fork_workers_crash_is_detected_and_replaced(tmp_path: Path) -> None:
    # Under fork each worker inherits the pipes of the workers started before it, so a dead
    # worker's pipe does not reach end-of-file: the watch on its sentinel must report it.
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_FORK_CHILD.format(marker_dir=str(tmp_path))))
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=_child_env(),
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "ok"
    assert _float_after(out.stdout, "noticed_after") < 2.0
    # The workers are told to stop (end-of-file alone would not reach them): no grace period
    # runs out and nobody is killed.
    assert _float_after(out.stdout, "closed_in") < _pool.SHUTDOWN_GRACE_S


def _float_after(text: str, key: str) -> float:
    [line] = [line for line in text.splitlines() if line.startswith(key)]
    return float(line.split()[1])
