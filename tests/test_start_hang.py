"""RELIABILITY.md row 30: a worker that hangs while it starts is timed out, never waited on.

A worker starts in two steps: its process starts (the interpreter, the start method's imports
and unpickling, the loader's initializer), then it loads its dataset copy (unpickling the
dataset, with the imports that triggers, then ``worker_init_fn``); the copy loads again at
every epoch with ``persistent_workers=False``. A hang in either step, in the first worker or
in a replacement for one that crashed, must end in :class:`aioloader.WorkerInitError` naming
the worker, its pid and what it was doing (its Python stack), within the batch ``timeout``
when one is set, else within ``start_timeout``; the hung process is killed, nothing leaks
(the conftest checks segments, processes and threads after each test).

The deadlines here are short (2 s or less): each scenario takes a few seconds.

The second part checks that errors a worker raises on the way name their batch: a
``SystemExit`` or ``KeyboardInterrupt`` from the dataset (a :class:`aioloader.WorkerError`,
never the program's own exit), and a sample or batch that cannot be pickled.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import fault_datasets as fd
import pytest

import aioloader

# RELIABILITY.md's common assertion (iii): every test fails if it leaves a descriptor, thread,
# process, segment or asyncio task above the baseline (conftest.baseline).
pytestmark = pytest.mark.usefixtures("baseline")

# A scenario ends within its start deadline, plus the time to take the stack and kill (about a
# second), plus slack for a loaded 2-core machine.
SLACK_S = 8.0

_WORKER_PID = re.compile(r"worker (\d+) \(pid (\d+)\)")


def _worker_and_pid(err: BaseException) -> tuple[int, int]:
    found = _WORKER_PID.search(str(err))
    assert found is not None, f"the error names no worker and pid: {err}"
    return int(found.group(1)), int(found.group(2))


def _assert_killed(pid: int, seen: list[int]) -> None:
    assert pid in seen, f"pid {pid} was not one of the loader's workers {seen}"
    assert fd.wait_gone([pid]) == [], f"the hung worker {pid} still runs"


async def _worker_pids(loader: aioloader.DataLoader, count: int) -> list[int]:
    """The loader's worker pids once ``count`` of them started (bounded wait; nothing to
    await: the pool has no event for it)."""
    async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S):
        while len(loader.worker_pids) < count:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    return list(loader.worker_pids)


async def test_hanging_worker_init_fn_fails_the_first_batch_with_its_stack() -> None:
    started = time.monotonic()
    loader = fd.make_loader(
        fd.Faulty(32), num_workers=1, worker_init_fn=fd.hanging_init, start_timeout=2
    )
    async with loader:
        epoch = aiter(loader)
        first = asyncio.ensure_future(anext(epoch))
        seen = await _worker_pids(loader, 1)
        with pytest.raises(aioloader.WorkerInitError) as info:
            async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S):
                await first
        elapsed = time.monotonic() - started
        restarts = loader.statistics().worker_restarts
    text = str(info.value)
    worker, pid = _worker_and_pid(info.value)
    assert worker == 0
    assert "did not finish starting within 2.0 s (start_timeout=2.0)" in text, text
    assert "loading its dataset copy" in text
    assert "batch 0" in text
    assert "in hanging_init" in text  # its stack, taken before it was killed
    assert "fault_datasets.py" in text
    assert "in load_copy" in text
    assert 2.0 <= elapsed < 2.0 + SLACK_S
    assert restarts == 1  # killed and replaced, not restarted in a loop
    _assert_killed(pid, seen)


def test_dataset_hanging_while_it_unpickles_fails_sync_iteration_within_the_timeout() -> None:
    # No start_timeout given: the batch timeout bounds the start too, as in torch.
    started = time.monotonic()
    with fd.make_loader(fd.HangsOnUnpickle(32), timeout=1.5) as loader:
        it = iter(loader)
        with pytest.raises(aioloader.WorkerInitError) as info:
            next(it)
        elapsed = time.monotonic() - started
        seen = list(loader.worker_pids)
    text = str(info.value)
    _, pid = _worker_and_pid(info.value)
    assert "within 1.5 s (timeout=1.5)" in text, text
    assert "in __setstate__" in text
    assert "batch 0" in text
    assert elapsed < 1.5 + SLACK_S
    assert fd.wait_gone([pid]) == []
    assert pid not in seen  # replaced


async def test_worker_hanging_before_its_initializer_fails_async_with_and_closes_the_loader() -> (
    None
):
    loader = fd.make_loader(
        fd.Faulty(8), num_workers=1, mp_context=fd.HangingStartContext(), start_timeout=2
    )
    started = time.monotonic()
    with pytest.raises(aioloader.WorkerInitError) as info:
        async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S), loader:
            pytest.fail("the body must not run: the workers did not start")
    elapsed = time.monotonic() - started
    text = str(info.value)
    worker, pid = _worker_and_pid(info.value)
    assert worker == 0
    assert "did not finish starting within 2.0 s (start_timeout=2.0)" in text, text
    assert "its process had not started" in text
    assert elapsed < 2.0 + SLACK_S
    assert loader.closed  # a failed `async with` leaves nothing running
    assert fd.wait_gone([pid]) == []


async def test_replacement_worker_hanging_at_start_after_a_crash_ends_the_stall(
    tmp_path: Path,
) -> None:
    # Batch 1's worker dies; its retry goes to the replacement, which never finishes loading
    # its copy. The batch's own deadline cannot fire (its job is only queued): the start
    # deadline, here the batch timeout, must.
    ds = fd.HangsAfterCrash(16, kill=5, marker_dir=str(tmp_path))
    started = time.monotonic()
    async with fd.make_loader(ds, num_workers=1, prefetch=1, timeout=2.0, max_retries=2) as loader:
        run = await fd.run_epoch(aiter(loader), stop_at_error=True)
        seen = list(loader.worker_pids)
        stats = loader.statistics()
    elapsed = time.monotonic() - started
    [err] = run.errors
    assert isinstance(err, aioloader.WorkerInitError)
    assert run.batches == [[0, 1, 2, 3]]
    text = str(err)
    assert "batch 1" in text, text
    assert "within 2.0 s (timeout=2.0)" in text
    assert "in __setstate__" in text
    [(crashed, _)] = fd.visits(str(tmp_path), 5)
    _, pid = _worker_and_pid(err)
    assert pid != crashed
    assert stats.retries == 1  # the crash was retried; the hang is not retried in a loop
    assert elapsed < 2.0 + SLACK_S
    assert fd.wait_gone([pid, crashed]) == []
    assert pid not in seen


async def test_per_epoch_copy_hanging_while_it_loads_fails_that_epoch() -> None:
    ds = fd.HangsOnUnpickle(16, hang=False)
    async with fd.make_loader(ds, num_workers=1, start_timeout=2) as loader:
        first = await fd.run_epoch(aiter(loader))
        assert first.errors == []
        seen = list(loader.worker_pids)
        ds.hang = True  # the next epoch's copy (persistent_workers=False) hangs in the worker
        started = time.monotonic()
        epoch = aiter(loader)
        second = await fd.run_epoch(epoch, stop_at_error=True)
        elapsed = time.monotonic() - started
        await epoch.aclose()  # the error's traceback holds it: close it, as `async for` would
        ds.hang = False
        third = await fd.run_epoch(aiter(loader))  # a fresh worker serves the next epoch
    [err] = second.errors
    assert isinstance(err, aioloader.WorkerInitError)
    text = str(err)
    _, pid = _worker_and_pid(err)
    assert seen == [pid]  # the warm worker, not a new process, hung while loading
    assert "loading its dataset copy for epoch 1" in text, text
    assert "in __setstate__" in text
    assert elapsed < 2.0 + SLACK_S
    assert third.errors == []
    assert third.batches == fd.sequential_batches(16, 4)
    assert fd.wait_gone([pid]) == []


def test_start_timeout_is_checked_and_shown() -> None:
    assert aioloader.DataLoader(range(4)).start_timeout is None
    assert aioloader.DataLoader(range(4), start_timeout=5).start_timeout == 5.0
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=rf"start_timeout .*got {bad!r}"):
            aioloader.DataLoader(range(4), start_timeout=bad)
    wrong: Any = "soon"
    with pytest.raises(TypeError, match=r"start_timeout.*'soon'"):
        aioloader.DataLoader(range(4), start_timeout=wrong)


# -- errors a worker raises name their batch -------------------------------------------------


def _text(err: BaseException) -> str:
    return "\n".join([str(err), *getattr(err, "__notes__", ())])


@pytest.mark.parametrize("workers", [2, 0], ids=["processes", "thread"])
@pytest.mark.parametrize("error", [SystemExit, KeyboardInterrupt])
async def test_systemexit_from_the_dataset_is_a_worker_error_naming_the_batch(
    error: type[BaseException], workers: int
) -> None:
    ds = fd.ExitsInGetitem(16, at=6, error=error)
    async with fd.make_loader(ds, num_workers=workers) as loader:
        run = await fd.run_epoch(aiter(loader))  # this program goes on: it is not its exit
        restarts = loader.statistics().worker_restarts
    [err] = run.errors
    assert type(err) is aioloader.WorkerError
    text = _text(err)
    assert f"{error.__name__}(the dataset gave up at index 6) was raised in " in text, text
    assert "while making batch 1" in text
    assert "reading sample index 6 of batch 1" in text
    assert "in __getitem__" in text  # the worker's traceback
    assert "Ctrl-C" in text
    fd.assert_exact(run, fd.sequential_batches(16, 4))  # the loader goes on
    assert restarts == 0  # nor did it end the worker


async def test_unpicklable_sample_names_its_batch_and_keeps_its_type() -> None:
    ds = fd.UnpicklableAt(16, at=9)
    async with fd.make_loader(ds, collate_fn=fd.stack_as_list) as loader:
        run = await fd.run_epoch(aiter(loader))
    [err] = run.errors
    assert isinstance(err, TypeError)  # what pickle raises for a lock
    text = _text(err)
    assert "lock" in text
    assert "while sending batch 2 of indices [8, 9, 10, 11] to the main process" in text, text
    assert "cannot be pickled" in text
    assert re.search(r"in worker [01] \(pid \d+\)", text), text
    fd.assert_exact(run, fd.sequential_batches(16, 4))


async def test_unpicklable_collate_output_names_every_batch_it_breaks() -> None:
    async with fd.make_loader(fd.Faulty(8), collate_fn=fd.unpicklable_collate) as loader:
        run = await fd.run_epoch(aiter(loader))
    assert [fd.failed_batch_id(e) for e in run.errors] == [0, 1]
    for batch_id, err in enumerate(run.errors):
        assert isinstance(err, TypeError)
        text = _text(err)
        assert "generator" in text
        assert f"while sending batch {batch_id} of indices" in text, text
