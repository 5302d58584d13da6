"""The producer side of an epoch (_produce), through the loader: batches scheduled in sampler
order or yielded as completed, ``prefetch`` bounding the work in flight, and a failing batch
sampler or stream delivered in its turn (what came before it, then its error).

Every wait is bounded; the conftest checks that no thread outlives a test.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from datasets import AsyncStream, Broken, Range, Recorder, Slow
from helpers import BOUND_S, as_lists, collect, drain, flat, quiet, take

from aioloader import DataLoader

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

# -- order ------------------------------------------------------------------------------------


class Inverted(Range):
    """Index 0 cannot finish before index ``last`` has: batches complete out of order."""

    def __init__(self, n: int, last: int) -> None:
        super().__init__(n)
        self.last = last
        self.done = threading.Event()
        self.finished: list[int] = []
        self._lock = threading.Lock()

    def __getitem__(self, index: int) -> int:
        if index == 0:
            self.done.wait(BOUND_S)
        # A deterministic, index-dependent delay shuffles the other completions too.
        time.sleep(((index * 7919) % 5) * 0.003)
        with self._lock:
            self.finished.append(index)
        if index == self.last:
            self.done.set()
        return index


async def test_in_order_yields_sampler_order_although_batches_finish_out_of_order() -> None:
    dataset = Inverted(24, last=3)
    loader = DataLoader(dataset, batch_size=1, num_workers=4, thread_pool=True, prefetch=6)
    async with loader:
        assert flat(await collect(loader)) == list(range(24))
    assert dataset.finished.index(0) > dataset.finished.index(3)  # really out of order
    # The same with a shuffled sampler: the order is the sampler's, whatever finishes first.
    slow = Slow(30, lambda i: ((i * 7919) % 7) * 0.002)
    kwargs: dict[str, Any] = {"batch_size": 3, "shuffle": True, "seed": 9}
    async with DataLoader(slow, num_workers=4, thread_pool=True, **kwargs) as loader:
        got = flat(await collect(loader))
    async with DataLoader(Range(30), **kwargs) as reference:
        assert got == flat(await collect(reference))
    assert slow.finished != got


async def test_not_in_order_yields_every_batch_once_as_completed() -> None:
    dataset = Inverted(24, last=3)
    loader = DataLoader(
        dataset, batch_size=1, num_workers=4, thread_pool=True, prefetch=6, in_order=False
    )
    async with loader:
        batches = flat(await collect(loader))
    assert sorted(batches) == list(range(24))
    assert batches.index(0) > batches.index(3)  # batch 0 was not waited for


# -- prefetch bounds in-flight work -----------------------------------------------------------


async def test_prefetch_bounds_work_when_the_consumer_stops() -> None:
    prefetch, size = 3, 2
    dataset = Recorder(40, delay=0.005)
    loader = DataLoader(
        dataset, batch_size=size, num_workers=4, thread_pool=True, prefetch=prefetch
    )
    async with loader:
        it = aiter(loader)
        assert as_lists(await take(it, 1)) == [[0, 1]]
        peak = 0
        for _ in range(20):  # the consumer stops; watch the pipeline fill up and stop
            stats = loader.statistics()
            peak = max(peak, stats.in_flight + stats.waiting)
            await asyncio.sleep(0.005)
        await quiet(dataset)
        stats = loader.statistics()
        assert max(peak, stats.in_flight + stats.waiting) <= prefetch
        assert (stats.waiting, stats.in_flight) == (prefetch, 0)  # full, and stopped there
        assert stats.prefetch == prefetch
        assert len({i // size for i in dataset.read}) == 1 + prefetch
        # Taking one batch lets exactly one more in.
        await take(it, 1)
        await quiet(dataset)
        assert len({i // size for i in dataset.read}) == 2 + prefetch
        assert flat(await take(it, 18)) == list(range(4, 40))


async def test_prefetch_bounds_concurrent_reads() -> None:
    dataset = Recorder(48, delay=0.01)
    loader = DataLoader(dataset, batch_size=1, num_workers=4, thread_pool=True, prefetch=2)
    async with loader:
        assert flat(await collect(loader)) == list(range(48))
    assert dataset.max_running <= 2


# -- a failing batch sampler or stream --------------------------------------------------------


class BrokenPlan:
    """A batch sampler that fails after two batches."""

    def __iter__(self) -> Iterator[list[int]]:
        yield [0, 1]
        yield [2, 3]
        raise RuntimeError("the batch sampler broke")


async def test_a_failing_batch_sampler_delivers_what_came_before_then_raises() -> None:
    async with DataLoader(Range(8), batch_size=None, batch_sampler=BrokenPlan()) as loader:
        for _ in range(2):  # and again in the next epoch
            got: list[Any] = []
            with pytest.raises(RuntimeError, match="batch sampler broke"):
                await drain(aiter(loader), got)
            assert got == [[0, 1], [2, 3]]


@pytest.mark.parametrize("threads", [0, 2])
async def test_a_failing_stream_delivers_what_came_before_then_raises(threads: int) -> None:
    kwargs: dict[str, Any] = {"num_workers": threads, "thread_pool": bool(threads)}
    async with DataLoader(Broken(fail_at=7), batch_size=3, **kwargs) as loader:
        for _ in range(2):  # the next epoch restarts the stream and fails the same way
            got: list[list[int]] = []
            with pytest.raises(ValueError, match="broke at item 7"):
                await drain(loader, got)
            assert got == [[0, 1, 2], [3, 4, 5], [6]]


async def test_a_failing_async_stream_delivers_what_came_before_then_raises() -> None:
    dataset = AsyncStream(20, fail_at=7)
    async with DataLoader(dataset, batch_size=3) as loader:
        got: list[list[int]] = []
        with pytest.raises(ConnectionError, match="broke at item 7") as info:
            await drain(loader, got)
        assert got == [[0, 1, 2], [3, 4, 5], [6]]
        assert "async stream" in "\n".join(getattr(info.value, "__notes__", ()))
        # drop_last never drops the items that came before a failure.
        dataset = AsyncStream(20, fail_at=7)
    async with DataLoader(dataset, batch_size=3, drop_last=True) as loader:
        got = []
        with pytest.raises(ConnectionError):
            await drain(loader, got)
        assert got == [[0, 1, 2], [3, 4, 5], [6]]
