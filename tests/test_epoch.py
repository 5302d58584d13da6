"""One epoch, the consumer side (_epoch): hand-over, permits, a cancelled consumer, closing,
dropped iterators.

The hand-over to a device stage is tested on an :class:`Epoch` made directly, with a fake
device stage through its ``device`` argument (the ``_epoch.DeviceStage`` protocol); the rest
goes through a :class:`DataLoader` on threads. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from datasets import Range, Recorder, Slow
from helpers import BOUND_S, collect, epoch_over, flat, quiet, take

from aioloader import DataLoader, TransferError
from aioloader._epoch._consume import DeviceStage

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

# -- hand-over to the device stage ------------------------------------------------------------


def an_epoch(dataset: Range, device: DeviceStage | None, **settings: Any) -> Any:
    """Epoch 0 over ``dataset`` in sampler order, with ``device`` as its device stage (see
    ``helpers.epoch_over``)."""
    return epoch_over(dataset, device, **settings)


class _Copied:
    def __init__(self, batch: Any) -> None:
        self.batch = batch

    async def wait(self) -> Any:
        await asyncio.sleep(0)
        return self.batch


class FlakyDevice:
    """A device stage whose copy of some batches fails to start."""

    def __init__(self, failing: set[int]) -> None:
        self.failing = failing

    def start(self, batch: Any, batch_id: int) -> _Copied:
        if batch_id in self.failing:
            raise TransferError(f"batch {batch_id}: cannot pin")
        return _Copied(batch)


@pytest.mark.parametrize("device_prefetch", [1, 3])
async def test_a_copy_that_fails_to_start_is_raised_in_turn_and_loses_no_permit(
    device_prefetch: int,
) -> None:
    # prefetch=2 and two failed copies: a permit lost with each would stall the epoch.
    device = FlakyDevice({1, 3})
    settings: dict[str, Any] = {"batch_size": 2, "prefetch": 2, "device_prefetch": device_prefetch}
    async with an_epoch(Range(12), device, **settings) as epoch:
        it = aiter(epoch)
        got: list[Any] = []
        async with asyncio.timeout(BOUND_S):
            for batch_id in range(6):
                if batch_id in (1, 3):
                    with pytest.raises(TransferError, match=f"batch {batch_id}"):
                        await anext(it)
                else:
                    got.append((await anext(it)).tolist())
            with pytest.raises(StopAsyncIteration):
                await anext(it)
        assert got == [[0, 1], [4, 5], [8, 9], [10, 11]]
        assert epoch.reorder.pending == 0  # what statistics().in_flight reports
        assert epoch.finished


# -- cancellation of the consumer -------------------------------------------------------------


async def test_a_timed_out_anext_loses_no_batch() -> None:
    dataset = Slow(6, lambda i: 0.2 if i == 0 else 0.0)
    async with DataLoader(dataset, batch_size=1) as loader:
        it = aiter(loader)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(it), 0.02)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await anext(it)
        assert flat(await take(it, 6)) == [0, 1, 2, 3, 4, 5]
        with pytest.raises(StopAsyncIteration):
            await anext(it)


async def test_a_cancelled_consumer_task_loses_no_batch() -> None:
    dataset = Slow(5, lambda i: 0.15 if i in (0, 2) else 0.0)
    async with DataLoader(dataset, batch_size=1, num_workers=2, thread_pool=True) as loader:
        it = aiter(loader)
        got: list[int] = []
        cancelled = 0
        for _ in range(2):  # cancel while waiting for batch 0, then for batch 2
            task = asyncio.ensure_future(anext(it))
            await asyncio.sleep(0.03)
            if task.cancel():
                cancelled += 1
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                got.extend(task.result().tolist())
            got.extend(flat(await take(it, 1)))
        got.extend(flat([b async for b in it]))
        assert got == [0, 1, 2, 3, 4]
        assert cancelled >= 1


async def test_cancelling_the_iterating_task_then_resuming_the_iterator() -> None:
    dataset = Slow(8, lambda i: 0.3 if i == 3 else 0.0)
    async with DataLoader(dataset, batch_size=2) as loader:
        it = aiter(loader)
        got: list[int] = []

        first_batch = asyncio.Event()

        async def consume() -> None:
            async for batch in it:
                got.extend(batch.tolist())
                first_batch.set()

        task = asyncio.create_task(consume())
        async with asyncio.timeout(BOUND_S):
            await first_batch.wait()  # then the task waits for batch 1 (index 3 is slow)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert got == [0, 1]
        got.extend(flat(await take(it, 3)))
        assert got == list(range(8))


# -- abandoning an epoch ----------------------------------------------------------------------


async def test_break_then_a_new_epoch_is_complete_and_clean() -> None:
    dataset = Recorder(30, delay=0.002)
    loader = DataLoader(
        dataset, batch_size=3, num_workers=3, thread_pool=True, shuffle=True, seed=1
    )
    async with loader:
        async for _ in loader:
            break
        full = flat(await collect(loader))
        assert sorted(full) == list(range(30))
        stats = loader.statistics()
        assert stats.epoch == 1
        assert stats.epoch_batches_yielded == 10
        assert (stats.in_flight, stats.waiting) == (0, 0)
        # Abandon another one midway through, with batches in flight.
        it = aiter(loader)
        await take(it, 4)
        del it
        assert sorted(flat(await collect(loader))) == list(range(30))


async def _eventually(predicate: Callable[[], bool], within_s: float = 2.0) -> None:
    async with asyncio.timeout(within_s):
        while True:
            if predicate():
                return
            await asyncio.sleep(0.01)


def _our_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("aioloader")]


async def test_a_dropped_iterator_is_closed_at_once() -> None:
    dataset = Recorder(400, delay=0.002)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, thread_pool=True, prefetch=4)
    async with loader:
        it = aiter(loader)
        await take(it, 3)
        assert _our_tasks() != []
        del it  # no aclose(), no new epoch: dropping the iterator is enough
        await _eventually(lambda: _our_tasks() == [])
        stats = loader.statistics()
        assert (stats.in_flight, stats.waiting) == (0, 0)
        await quiet(dataset)
        assert len(dataset.read) <= 2 * (3 + 4)  # nothing was read after the drop
        # A one-off `anext(aiter(...))` keeps its iterator alive while it waits.
        assert (await anext(aiter(loader))).tolist() == [0, 1]
        # A consumer still waiting when the loader closes is told it was closed: an epoch cut
        # short must not pass for a whole one (a training loop would checkpoint it as done).
        slow = DataLoader(Slow(4, lambda i: 0.3), batch_size=1)
        async with slow:
            waiting = asyncio.ensure_future(anext(aiter(slow)))
            await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="closed during epoch 0, before it was over"):
            await asyncio.wait_for(waiting, BOUND_S)
        assert flat(await collect(loader)) == list(range(400))


async def test_a_cancelled_consumer_task_kept_by_its_caller_closes_its_epoch() -> None:
    # A supervisor cancels the training task and keeps the Task (gather(...,
    # return_exceptions=True), a task list): the CancelledError's traceback keeps the frames
    # the cancel went through, which must not keep the epoch running.
    dataset = Recorder(60, delay=0.05)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, thread_pool=True, prefetch=4)
    async with loader:
        started = asyncio.Event()

        async def train() -> None:
            async for _ in loader:
                started.set()  # then it waits in __anext__: the data is slower than the step

        task = asyncio.create_task(train())
        async with asyncio.timeout(BOUND_S):
            await started.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()  # kept, with its traceback, to the end of the test
        await _eventually(lambda: _our_tasks() == [])
        stats = loader.statistics()
        assert (stats.in_flight, stats.waiting) == (0, 0)
        await quiet(dataset)
        read = len(dataset.read)
        await asyncio.sleep(0.2)  # four reads' time: none starts
        assert len(dataset.read) == read
        assert flat(await collect(loader)) == list(range(60))  # the next epoch runs alone


def test_sync_break_then_a_new_epoch_is_complete() -> None:
    with DataLoader(Range(20), batch_size=3, num_workers=2, thread_pool=True) as loader:
        for _ in loader:
            break
        assert flat(list(loader)) == list(range(20))
        it = iter(loader)
        next(it)
        next(it)
        del it  # the generator's finally closes the epoch on the loop thread
        assert flat(list(loader)) == list(range(20))
