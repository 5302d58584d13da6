"""What a newcomer's first runs meet (issue #42): each warning said once and only where the user
should act, and each error naming its fix — a closed loader, ``aioloader.run`` where a loop
already runs, a CUDA device on a machine without one, the worker pids as they start.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import warnings

import pytest
import torch
from datasets import Range, Slow

import aioloader
from aioloader import DataLoader


def test_iterating_a_closed_loader_says_what_to_do() -> None:
    with DataLoader(Range(4), batch_size=2) as loader:
        assert len(list(loader)) == 2
    with pytest.raises(RuntimeError, match="this DataLoader is closed") as info:
        iter(loader).__next__()
    assert "inside its `with`" in str(info.value)
    assert "make a new DataLoader" in str(info.value)


async def test_async_iterating_a_closed_loader_says_what_to_do() -> None:
    async with DataLoader(Range(4), batch_size=2) as loader:
        pass
    with pytest.raises(RuntimeError, match="make a new DataLoader"):
        async for _ in loader:
            pass


async def _main() -> int:
    return 1


async def test_run_inside_a_running_loop_says_to_await(recwarn: pytest.WarningsRecorder) -> None:
    # A notebook's cell runs inside a loop: aioloader.run(main()) there.
    coro = _main()
    with pytest.raises(RuntimeError, match=r"already running") as info:
        aioloader.run(coro)
    assert "`await _main()`" in str(info.value)
    assert "notebook" in str(info.value)
    # Closed unrun: no "coroutine was never awaited" follows.
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
    del coro
    assert [str(w.message) for w in recwarn] == []


def test_run_outside_a_loop_still_runs() -> None:
    assert aioloader.run(_main()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine-without-a-GPU behaviour")
def test_device_cuda_without_a_gpu_raises_at_the_start() -> None:
    loader = DataLoader(Range(4), batch_size=2, device="cuda")  # parsed: no CUDA needed yet
    with pytest.raises(RuntimeError, match="device='cuda' was asked for") as info:
        next(iter(loader))  # the first iteration: before any batch, not at the model
    assert "device='auto'" in str(info.value)
    loader.close()
    with (
        pytest.raises(RuntimeError, match="CUDA is not available"),
        DataLoader(Range(4), device="cuda:0"),
    ):
        pass  # `with` starts the loader: it raises there, and closes itself
    # The explicit fallback: CPU batches, and not a word.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with DataLoader(Range(4), batch_size=2, device="auto") as loader:
            assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine-without-a-GPU behaviour")
def test_pin_memory_without_a_gpu_warns_once_for_many_loaders(
    recwarn: pytest.WarningsRecorder,
) -> None:
    for _ in range(3):
        with DataLoader(Range(4), batch_size=2, pin_memory=True) as loader:
            list(loader)
    assert [w.category for w in recwarn] == [aioloader.DeviceUnavailableWarning]


def test_more_workers_than_cpus_warns_once_for_many_loaders(
    monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    for _ in range(3):  # made in a loop, each line the same cause
        DataLoader(Range(4), num_workers=2).close()
    assert [str(w.message) for w in recwarn] == [
        "num_workers=2 is more than the 1 CPUs here; extra workers only compete for them"
    ]


def test_pools_and_their_loaders_warn_once_for_one_count(
    monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    for _ in range(2):  # two pools of the same count, two loaders on each (nothing started)
        pool = aioloader.WorkerPool(num_workers=2)
        for _ in range(2):
            DataLoader(Range(4), workers=pool).close()
        pool.close()
    DataLoader(Range(4), num_workers=2).close()  # a loader of its own, the same count
    assert [str(w.message) for w in recwarn] == [
        "num_workers=2 is more than the 1 CPUs here; extra workers only compete for them"
    ]


def test_short_epochs_of_many_loaders_warn_nothing(
    caplog: pytest.LogCaptureFixture, recwarn: pytest.WarningsRecorder
) -> None:
    caplog.set_level(logging.WARNING)  # logging.basicConfig()'s default level
    for _ in range(2):
        with DataLoader(Slow(8, 0.005), batch_size=2) as loader:
            list(loader)
            list(loader)
    assert [r for r in caplog.records if r.name.startswith("aioloader")] == []
    assert list(recwarn) == []


def test_worker_pids_are_those_started_so_far_and_all_after_the_first_batch() -> None:
    with DataLoader(Range(8), batch_size=2, num_workers=2) as loader:
        early = loader.worker_pids
        assert len(early) <= 2  # those started so far: workers start in the background
        it = iter(loader)
        next(it)
        assert len(set(loader.worker_pids)) == 2  # after the first batch: every worker
        assert set(early) <= set(loader.worker_pids)
        del it
    assert loader.worker_pids == ()


def test_loop_is_not_left_running() -> None:
    # aioloader.run refused inside a loop must not leave that loop's state changed.
    async def inner() -> bool:
        coro = _main()
        with pytest.raises(RuntimeError):
            aioloader.run(coro)
        return asyncio.get_running_loop().is_running()

    assert asyncio.run(inner()) is True


@pytest.mark.cuda
def test_device_auto_with_a_gpu_puts_batches_on_it() -> None:
    with DataLoader(Range(4), batch_size=2, device="auto") as loader:
        assert [b.device.type for b in loader] == ["cuda", "cuda"]
