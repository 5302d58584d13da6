"""Async map datasets (_fetch): items awaited on the loop, ``io_concurrency`` fetches at once
across batches, a failed fetch that keeps its type, and failed fetches skipped up to
``max_failures``. No task exception may go unretrieved (the loop's exception handler is
watched).
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from datasets import AsyncRange, CancelledAt, Range
from helpers import BOUND_S, as_lists, collect, drain, flat, notes_of
from loop_time import THREAD_GRACE_S, run_skipping

from aioloader import DataLoader, LoaderTimeoutError, TooManyFailuresError

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")


class LoopErrors:
    """Records every call of the running loop's exception handler (for the test's duration)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __enter__(self) -> LoopErrors:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(lambda loop, context: self.calls.append(context))
        return self

    def __exit__(self, *exc: object) -> None:
        gc.collect()  # a never-retrieved task exception is reported when the task is collected
        self._loop.set_exception_handler(None)


async def test_async_dataset_batches_are_correct() -> None:
    dataset = AsyncRange(21, delay=0.001)
    async with DataLoader(dataset, batch_size=4, shuffle=True, seed=2) as loader:
        got = as_lists(await collect(loader))
    async with DataLoader(Range(21), batch_size=4, shuffle=True, seed=2) as reference:
        assert got == as_lists(await collect(reference))
    assert dataset.max_running > 1  # items were fetched concurrently


async def test_io_concurrency_bounds_concurrent_item_fetches() -> None:
    dataset = AsyncRange(80, delay=0.01)
    loader = DataLoader(dataset, batch_size=4, io_concurrency=5, prefetch=20)
    async with loader:
        assert flat(await collect(loader)) == list(range(80))
        assert loader.statistics().fetch_s > 0
    assert dataset.max_running == 5  # reached, never passed


async def test_default_prefetch_keeps_io_concurrency_fetches_in_flight() -> None:
    # Two batches of 4 would cap fetches at 8; the default for async data sets leaves room for
    # io_concurrency of them: ceil(16 / 4) + 2 = 6 batches.
    dataset = AsyncRange(96, delay=0.02)
    async with DataLoader(dataset, batch_size=4, io_concurrency=16) as loader:
        assert loader.prefetch == 6
        assert flat(await collect(loader)) == list(range(96))
    assert dataset.max_running == 16
    # A sync data set keeps the documented default.
    assert DataLoader(Range(8), batch_size=4).prefetch == 2


async def test_async_dataset_error_keeps_its_type_and_no_task_error_is_lost() -> None:
    with LoopErrors() as handler:
        async with DataLoader(AsyncRange(12, delay=0.002, bad={5}), batch_size=4) as loader:
            got: list[Any] = []
            with pytest.raises(KeyError) as info:
                await drain(aiter(loader), got)
            assert got == [[0, 1, 2, 3]]
            notes = notes_of(info.value)
            assert "index 5" in notes
            assert "batch 1" in notes
        # Several items of one batch fail: still the user's type (not an ExceptionGroup), the
        # first in sample order, the others mentioned.
        dataset = AsyncRange(8, bad={1, 2}, error_type=OSError)
        async with DataLoader(dataset, batch_size=4) as loader:
            with pytest.raises(OSError, match="async sample 1 is broken") as first:
                await collect(loader)
            assert "async sample 2 is broken" in notes_of(first.value)
            await asyncio.sleep(0.05)  # let the sibling fetches of the failed batches settle
    assert handler.calls == []


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_a_cancelled_error_from_the_dataset_is_its_batchs_error_not_a_hang(
    num_workers: int,
) -> None:
    # Something the dataset awaited was cancelled under it. Before, the batch's task ended as
    # if the loader had cancelled it, and the epoch waited for that batch for ever.
    async with DataLoader(CancelledAt(16, bad={5}), batch_size=4, num_workers=num_workers) as dl:
        it = aiter(dl)
        async with asyncio.timeout(BOUND_S):
            assert (await anext(it)).tolist() == [0, 1, 2, 3]
            with pytest.raises(RuntimeError, match="CancelledError") as info:
                await anext(it)
            assert "index 5" in notes_of(info.value)
            assert isinstance(info.value.__cause__, asyncio.CancelledError)
            assert as_lists([b async for b in it]) == [[8, 9, 10, 11], [12, 13, 14, 15]]
    # With on_error='skip' it is one skipped sample like any other failure.
    dataset = CancelledAt(12, bad={5})
    async with DataLoader(dataset, batch_size=4, on_error="skip", max_failures=1) as loader:
        async with asyncio.timeout(BOUND_S):
            assert flat(await collect(loader)) == [i for i in range(12) if i != 5]
        assert [index for index, _ in loader.statistics().skipped] == [5]


class HangsAt(AsyncRange):
    """Item ``bad`` never arrives; items are named like the URLs of a remote source."""

    async def __getitem__(self, index: int) -> int:
        if index in self.bad:
            await asyncio.Event().wait()
        return index

    def item_name(self, index: int) -> str:
        return f"http://store/obj/{index}"


def test_a_fetch_that_misses_the_timeout_names_the_items_it_still_awaited() -> None:
    # Before, it named the batch's 8 indices and advised more workers or max_retries, which do
    # nothing for a read that never answers. The deadline passes on a loop whose clock skips
    # idle waits (loop_time): no real time.
    async def main() -> LoaderTimeoutError:
        loader = DataLoader(HangsAt(16, bad={13}), batch_size=8, timeout=5.0)
        async with loader:
            it = aiter(loader)
            async with asyncio.timeout(BOUND_S):  # loop time
                assert (await anext(it)).tolist() == list(range(8))
                with pytest.raises(LoaderTimeoutError) as info:
                    await anext(it)
        return info.value

    message = str(run_skipping(main(), grace_s=THREAD_GRACE_S))
    assert "item(s) 13 (http://store/obj/13)" in message
    assert "more workers" not in message
    assert "item_deadline" in message


async def test_async_dataset_skips_failures_up_to_max_failures() -> None:
    dataset = AsyncRange(20, bad={3, 11}, error_type=ValueError)
    loader = DataLoader(dataset, batch_size=4, on_error="skip", max_failures=2)
    async with loader:
        assert flat(await collect(loader)) == [i for i in range(20) if i not in (3, 11)]
        stats = loader.statistics()
        assert sorted(index for index, _ in stats.skipped) == [3, 11]
        assert all("ValueError" in reason for _, reason in stats.skipped)
        assert stats.samples_yielded == 18
    dataset = AsyncRange(8, bad={0, 1, 2, 3}, error_type=ValueError)
    async with DataLoader(dataset, batch_size=4, on_error="skip", max_failures=4) as loader:
        assert as_lists(await collect(loader)) == [[4, 5, 6, 7]]  # batch 0 lost every sample
    dataset = AsyncRange(20, bad={3, 11, 12}, error_type=ValueError)
    with LoopErrors() as handler:
        # prefetch=1: batches complete one by one, so the failures are counted in order.
        loader = DataLoader(dataset, batch_size=4, on_error="skip", max_failures=2, prefetch=1)
        async with loader:
            got: list[Any] = []
            with pytest.raises(TooManyFailuresError, match="max_failures"):
                await drain(aiter(loader), got)
            # Batch 0 skips 3 and batch 2 skips 11 (two failures allowed); 12 is one too many.
            assert got == [[0, 1, 2], [4, 5, 6, 7], [8, 9, 10]]
    assert handler.calls == []
