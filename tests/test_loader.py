"""Tests of the core DataLoader over map-style datasets (aioloader._loader, _epoch, _batch).

Most tests run the CPU work on the helper thread (``num_workers=0``) or a thread pool
(``thread_pool=True``), which is fast; a few repeat a contract with worker processes
(``num_workers=2``), where the behaviour must be the same. Datasets used with worker processes
are defined at module level so they pickle by reference; workers import this module by name
(``tests/`` is on ``sys.path``, and the forkserver passes ``sys.path`` on to its children).

Every loop and wait in this file is bounded; the conftest checks that no thread, process or
shared-memory segment outlives a test.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from collections import Counter, namedtuple
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from procs import no_worker_left_behind, worker_processes

import aioloader
from aioloader import (
    BatchSampler,
    DataLoader,
    LoaderTimeoutError,
    SequentialSampler,
    ShardedBatchSampler,
    TooManyFailuresError,
)

# Hypothesis's default deadline trips on a loaded 2-core machine; correctness is what we test.
few = settings(deadline=None, max_examples=25)

# No single wait in these tests should come near this; it only turns a hang into a failure.
BOUND_S = 10.0


# -- datasets (module level: picklable for worker processes) ----------------------------------


class Range:
    """``dataset[i] == i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return index


class FailAt(Range):
    """Raises ``error_type`` for the indices in ``bad``."""

    def __init__(self, n: int, bad: set[int], error_type: type[Exception] = KeyError) -> None:
        super().__init__(n)
        self.bad = bad
        self.error_type = error_type

    def __getitem__(self, index: int) -> int:
        if index in self.bad:
            raise self.error_type(f"sample {index} is broken")
        return super().__getitem__(index)


Point = namedtuple("Point", ["x", "y"])


class Nested(Range):
    """Samples with every container kind the default collate handles."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "image": np.full((2, 3), index, dtype=np.float32),
            "label": index,
            "name": f"item-{index}",
            "pair": (index, float(index) / 2),
            "point": Point(index, -index),
        }


def fail_collate_on_7(samples: list[int]) -> list[int]:
    if 7 in samples:
        raise ValueError("cannot collate 7")
    return list(samples)


def times_ten(sample: int) -> int:
    return sample * 10


class FailOnce(Range):
    """Raises KeyError the first time index ``bad`` is read, then behaves (thread mode only)."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad
        self.failed = False

    def __getitem__(self, index: int) -> int:
        if index == self.bad and not self.failed:
            self.failed = True
            raise KeyError(index)
        return super().__getitem__(index)


class Slow(Range):
    """Sleeps ``delay(i)`` seconds in ``__getitem__`` and records when each index finished."""

    def __init__(self, n: int, delay: Callable[[int], float]) -> None:
        super().__init__(n)
        self.delay = delay
        self.finished: list[int] = []
        self._lock = threading.Lock()

    def __getitem__(self, index: int) -> int:
        time.sleep(self.delay(index))
        with self._lock:
            self.finished.append(index)
        return index


class Recorder(Range):
    """Records every index read and the largest number of reads running at once."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        super().__init__(n)
        self.delay = delay
        self.read: list[int] = []
        self.running = 0
        self.max_running = 0
        self._lock = threading.Lock()

    def __getitem__(self, index: int) -> int:
        with self._lock:
            self.read.append(index)
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            time.sleep(self.delay)
            return index
        finally:
            with self._lock:
                self.running -= 1


class HangAt(Range):
    """Blocks reading index ``bad`` until ``release`` is set (or ``BOUND_S`` passes)."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad
        self.release = threading.Event()

    def __getitem__(self, index: int) -> int:
        if index == self.bad:
            self.release.wait(BOUND_S)
        return index


class AsyncRange:
    """``await dataset[i] == i`` after a short sleep; records concurrency; fails on ``bad``."""

    def __init__(
        self,
        n: int,
        delay: float = 0.0,
        bad: set[int] | None = None,
        error_type: type[Exception] = KeyError,
    ) -> None:
        self.n = n
        self.delay = delay
        self.bad = bad or set()
        self.error_type = error_type
        self.running = 0
        self.max_running = 0

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(self.delay)
            if index in self.bad:
                raise self.error_type(f"async sample {index} is broken")
            return index
        finally:
            self.running -= 1


# -- helpers ----------------------------------------------------------------------------------


def as_lists(batches: list[Any]) -> list[list[int]]:
    return [b.tolist() if isinstance(b, torch.Tensor) else list(b) for b in batches]


def flat(batches: list[Any]) -> list[int]:
    return [i for b in as_lists(batches) for i in b]


async def collect(loader: DataLoader) -> list[Any]:
    async with asyncio.timeout(BOUND_S):
        return [batch async for batch in loader]


async def take(iterator: AsyncIterator[Any], k: int) -> list[Any]:
    async with asyncio.timeout(BOUND_S):
        return [await anext(iterator) for _ in range(k)]


async def drain(iterator: AsyncIterator[Any], into: list[Any]) -> None:
    """Append every batch of ``iterator`` (as lists) to ``into`` until it ends or raises."""
    async with asyncio.timeout(BOUND_S):
        async for batch in iterator:
            into.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)


def drain_sync(loader: DataLoader, into: list[Any]) -> None:
    """Append every batch of one sync epoch (as lists) to ``into`` until it ends or raises."""
    for batch in loader:
        into.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)


def expected_batches(n: int, size: int, drop: bool = False) -> list[list[int]]:
    batches = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    if drop and batches and len(batches[-1]) < size:
        batches.pop()
    return batches


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


# -- iteration: async, sync, epochs -----------------------------------------------------------


async def test_async_for_sync_for_and_async_with_give_the_same_batches() -> None:
    n, size = 23, 4
    async with DataLoader(Range(n), batch_size=size) as loader:
        assert len(loader) == 6
        first = as_lists(await collect(loader))
    plain = DataLoader(Range(n), batch_size=size)
    try:
        second = as_lists(await collect(plain))
    finally:
        await plain.aclose()
    with DataLoader(Range(n), batch_size=size) as loader:
        sync = as_lists(await asyncio.to_thread(list, loader))
    assert first == second == sync == expected_batches(n, size)


async def test_each_iteration_is_a_new_epoch_and_set_epoch_replays_one() -> None:
    async with DataLoader(Range(40), batch_size=8, shuffle=True, seed=5) as a:
        runs_a = [flat(await collect(a)) for _ in range(3)]
        assert a.statistics().epoch == 2
        a.set_epoch(1)
        replay = flat(await collect(a))
        assert a.statistics().epoch == 1
    for order in runs_a:
        assert sorted(order) == list(range(40))
    assert len({tuple(order) for order in runs_a}) == 3  # 40! orders: a repeat is a bug
    assert replay == runs_a[1]
    async with DataLoader(Range(40), batch_size=8, shuffle=True, seed=5) as b:
        assert [flat(await collect(b)) for _ in range(3)] == runs_a  # same seed, same orders


def test_sync_iteration_epochs_and_close() -> None:
    loader = DataLoader(Range(10), batch_size=3, shuffle=True, seed=3)
    try:
        first = flat(list(loader))
        second = flat(list(loader))
        assert sorted(first) == sorted(second) == list(range(10))
        assert first != second
        assert loader.statistics().epoch == 1
    finally:
        loader.close()
    loader.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        list(loader)


async def test_aclose_is_idempotent_and_a_closed_loader_refuses_to_iterate() -> None:
    loader = DataLoader(Range(10), batch_size=2, num_workers=2, thread_pool=True)
    it = aiter(loader)
    assert (await anext(it)).tolist() == [0, 1]
    await loader.aclose()
    await loader.aclose()
    with pytest.raises(StopAsyncIteration):
        await anext(it)  # the open epoch was closed with the loader
    with pytest.raises(RuntimeError, match="closed"):
        aiter(loader)
    assert "closed" in repr(loader)


def _forget(holder: list[Any]) -> None:
    holder.clear()
    gc.collect()


def test_an_unclosed_loader_warns_and_releases_everything() -> None:
    never_iterated = DataLoader(Range(6), batch_size=2)
    del never_iterated
    gc.collect()  # nothing was started: no warning (warnings are errors here)
    loader = DataLoader(Range(6), batch_size=2, num_workers=2, thread_pool=True)
    assert flat(list(loader)) == list(range(6))
    holder = [loader]
    del loader
    with pytest.warns(ResourceWarning, match="not closed"):
        _forget(holder)
    # The conftest fails the test if the loop thread or a pool thread is still alive.


# -- every index exactly once -----------------------------------------------------------------


@few
@example(n=1, size=3, shuffle=False, policy="rollover", in_order=True)  # epochs with no batch
@given(
    n=st.integers(0, 60),
    size=st.integers(1, 13),
    shuffle=st.booleans(),
    policy=st.sampled_from(["keep", "discard", "rollover"]),
    in_order=st.booleans(),
)
def test_every_index_once_per_epoch(
    n: int, size: int, shuffle: bool, policy: str, in_order: bool
) -> None:
    loader = DataLoader(
        Range(n),
        batch_size=size,
        shuffle=shuffle,
        last_batch=policy,
        seed=n * 100 + size,
        in_order=in_order,
        num_workers=2,
        thread_pool=True,
    )
    with loader:
        carry: Counter[int] = Counter()
        for _ in range(3):
            announced = len(loader)
            batches = as_lists(list(loader))
            assert len(batches) == announced
            indices = [i for b in batches for i in b]
            if policy == "keep":
                assert sorted(indices) == list(range(n))
                # One short batch at most, and only when size does not divide n. Out of order it
                # may arrive before full ones; in order it is the last.
                short = [b for b in batches if len(b) != size]
                assert [len(b) for b in short] == ([n % size] if n % size else [])
                if in_order and short:
                    assert batches[-1] is short[0]
            elif policy == "discard":
                assert len(batches) == n // size
                assert all(len(b) == size for b in batches)
                assert sorted(set(indices)) == sorted(indices)
                assert len(indices) == n - n % size
            else:
                # Rollover: last epoch's remainder comes first, then this epoch's indices; every
                # batch is full, and exactly the remainder is held back for the next epoch.
                owed = carry + Counter(range(n))
                total = owed.total()
                assert len(batches) == total // size
                assert all(len(b) == size for b in batches)
                assert Counter(indices) <= owed  # nothing invented, nothing repeated
                if in_order and indices:
                    assert Counter(indices[: carry.total()]) == carry
                carry = owed - Counter(indices)
                assert carry.total() == total % size
            if not shuffle and policy != "rollover" and in_order:
                assert indices == list(range(len(indices)))


def test_rollover_carries_exactly_the_remainder() -> None:
    with DataLoader(Range(10), batch_size=4, last_batch="rollover") as loader:
        assert len(loader) == 2
        assert as_lists(list(loader)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert len(loader) == 3  # the carry of 2 plus 10 new: 3 full batches
        assert as_lists(list(loader)) == [[8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]
        assert as_lists(list(loader)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


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


# -- collation, collate_fn, batchify_fn, transform --------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
@no_worker_left_behind()
def test_nested_samples_collate_through_the_loader(num_workers: int) -> None:
    with DataLoader(Nested(7), batch_size=3, num_workers=num_workers) as loader:
        batches = list(loader)
    assert len(batches) == 3
    start = 0
    for batch in batches:
        count = len(batch["name"])
        ids = list(range(start, start + count))
        assert set(batch) == {"image", "label", "name", "pair", "point"}
        assert isinstance(batch["image"], torch.Tensor)
        assert batch["image"].shape == (count, 2, 3)
        assert batch["image"].dtype == torch.float32
        assert batch["image"][:, 0, 0].tolist() == ids
        assert batch["label"].tolist() == ids
        assert batch["label"].dtype == torch.int64
        assert batch["name"] == [f"item-{i}" for i in ids]
        assert isinstance(batch["pair"], list)  # tuples come back as lists, as in torch
        assert batch["pair"][0].tolist() == ids
        assert batch["pair"][1].tolist() == [i / 2 for i in ids]
        assert isinstance(batch["point"], Point)
        assert batch["point"].x.tolist() == ids
        assert batch["point"].y.tolist() == [-i for i in ids]
        start += count
    assert start == 7


def test_collate_fn_batchify_fn_and_transform() -> None:
    def tag(samples: list[int]) -> tuple[str, list[int]]:
        return ("custom", list(samples))

    tagged = [("custom", [0, 1]), ("custom", [2, 3]), ("custom", [4])]
    with DataLoader(Range(5), batch_size=2, collate_fn=tag) as loader:
        assert list(loader) == tagged
    with DataLoader(Range(5), batch_size=2, batchify_fn=tag) as loader:
        assert list(loader) == tagged
    with DataLoader(Range(5), batch_size=2, transform=times_ten) as loader:
        assert as_lists(list(loader)) == [[0, 10], [20, 30], [40]]
    with DataLoader(Range(5), batch_size=2, transform=times_ten, collate_fn=tag) as loader:
        # The transform runs on each sample, before collation.
        assert list(loader) == [("custom", [0, 10]), ("custom", [20, 30]), ("custom", [40])]
    with pytest.raises(ValueError, match="collate_fn or batchify_fn"):
        DataLoader(Range(5), collate_fn=tag, batchify_fn=list)


# -- errors -----------------------------------------------------------------------------------


def _notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", ()))


async def test_getitem_error_keeps_its_type_at_its_turn() -> None:
    loader = DataLoader(FailAt(12, {5}), batch_size=2, num_workers=3, thread_pool=True)
    got: list[list[int]] = []
    async with loader:
        it = aiter(loader)
        with pytest.raises(KeyError) as info:
            await drain(it, got)
        assert got == [[0, 1], [2, 3]]  # everything before the failing batch was delivered
        notes = _notes(info.value)
        assert "sample index 5" in notes
        assert "batch 2" in notes
        assert "sample 5 is broken" in str(info.value)
        # The same iterator goes on with the batches after the failing one.
        assert as_lists(await take(it, 3)) == [[6, 7], [8, 9], [10, 11]]
        with pytest.raises(StopAsyncIteration):
            await anext(it)


async def test_after_an_error_the_next_epoch_is_complete() -> None:
    async with DataLoader(FailOnce(9, bad=4), batch_size=2) as loader:
        got: list[Any] = []
        with pytest.raises(KeyError):
            await drain(aiter(loader), got)
        assert got == [[0, 1], [2, 3]]
        assert as_lists(await collect(loader)) == expected_batches(9, 2)


async def test_collate_fn_error_keeps_its_type_and_names_the_batch() -> None:
    async with DataLoader(Range(10), batch_size=3, collate_fn=fail_collate_on_7) as loader:
        it = aiter(loader)
        assert await take(it, 2) == [[0, 1, 2], [3, 4, 5]]
        with pytest.raises(ValueError, match="cannot collate 7") as info:
            await anext(it)
        notes = _notes(info.value)
        assert "batch 2" in notes
        assert "[6, 7, 8]" in notes
        assert await take(it, 1) == [[9]]
        assert await take(aiter(loader), 2) == [[0, 1, 2], [3, 4, 5]]  # a new epoch


@no_worker_left_behind()
def test_errors_in_worker_processes_keep_their_type() -> None:
    with DataLoader(FailAt(12, {5}), batch_size=2, num_workers=2) as loader:
        for _ in range(2):  # the loader stays usable: the next epoch starts from the beginning
            got: list[Any] = []
            with pytest.raises(KeyError) as info:
                drain_sync(loader, got)
            assert got == [[0, 1], [2, 3]]
            notes = _notes(info.value)
            assert "sample index 5" in notes
            assert "batch 2" in notes
    with DataLoader(Range(10), batch_size=3, num_workers=2, collate_fn=fail_collate_on_7) as dl:
        got = []
        with pytest.raises(ValueError, match="cannot collate 7") as info:
            drain_sync(dl, got)
        assert got == [[0, 1, 2], [3, 4, 5]]
        assert "batch 2" in _notes(info.value)


# -- timeouts ---------------------------------------------------------------------------------


async def test_a_hung_batch_raises_loader_timeout_error_naming_it() -> None:
    dataset = HangAt(8, bad=4)
    loader = DataLoader(dataset, batch_size=2, timeout=0.3)
    try:
        it = aiter(loader)
        assert as_lists(await take(it, 2)) == [[0, 1], [2, 3]]
        started = time.monotonic()
        with pytest.raises(LoaderTimeoutError) as info:
            await take(it, 1)
        assert time.monotonic() - started < BOUND_S / 2
        assert isinstance(info.value, TimeoutError)
        assert isinstance(info.value, aioloader.AioloaderError)
        assert "batch 2" in str(info.value)
        assert "timeout=0.3" in str(info.value)
        assert loader.statistics().timeouts >= 1
    finally:
        dataset.release.set()  # a thread cannot be killed: let it finish
        await loader.aclose()


async def test_a_slow_consumer_causes_no_timeout() -> None:
    async with DataLoader(Range(6), batch_size=2, timeout=0.2, prefetch=2) as loader:
        got = []
        async with asyncio.timeout(BOUND_S):
            async for batch in loader:
                got.append(batch.tolist())
                await asyncio.sleep(0.3)  # longer than the timeout, between batches
        assert got == expected_batches(6, 2)
        assert loader.statistics().timeouts == 0


# -- prefetch bounds in-flight work -----------------------------------------------------------


async def _quiet(dataset: Recorder, for_s: float = 0.1) -> None:
    """Wait until the dataset has not been read for ``for_s`` seconds."""
    async with asyncio.timeout(BOUND_S):
        last = -1
        while True:
            count = len(dataset.read)
            if count == last and dataset.running == 0:
                return
            last = count
            await asyncio.sleep(for_s)


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
        await _quiet(dataset)
        stats = loader.statistics()
        assert max(peak, stats.in_flight + stats.waiting) <= prefetch
        assert (stats.waiting, stats.in_flight) == (prefetch, 0)  # full, and stopped there
        assert stats.prefetch == prefetch
        assert len({i // size for i in dataset.read}) == 1 + prefetch
        # Taking one batch lets exactly one more in.
        await take(it, 1)
        await _quiet(dataset)
        assert len({i // size for i in dataset.read}) == 2 + prefetch
        assert flat(await take(it, 18)) == list(range(4, 40))


async def test_prefetch_bounds_concurrent_reads() -> None:
    dataset = Recorder(48, delay=0.01)
    loader = DataLoader(dataset, batch_size=1, num_workers=4, thread_pool=True, prefetch=2)
    async with loader:
        assert flat(await collect(loader)) == list(range(48))
    assert dataset.max_running <= 2


# -- cancellation -----------------------------------------------------------------------------


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
        await _quiet(dataset)
        assert len(dataset.read) <= 2 * (3 + 4)  # nothing was read after the drop
        # A one-off `anext(aiter(...))` keeps its iterator alive while it waits.
        assert (await anext(aiter(loader))).tolist() == [0, 1]
        # A consumer still waiting when the loader closes is told it is over.
        slow = DataLoader(Slow(4, lambda i: 0.3), batch_size=1)
        async with slow:
            waiting = asyncio.ensure_future(anext(aiter(slow)))
            await asyncio.sleep(0.05)
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(waiting, BOUND_S)
        assert flat(await collect(loader)) == list(range(400))


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


# -- statistics and repr ----------------------------------------------------------------------


async def test_statistics_move_as_the_loader_runs() -> None:
    dataset = Slow(10, lambda i: 0.01)
    loader = DataLoader(dataset, batch_size=4)
    stats = loader.statistics()
    assert (stats.batches_yielded, stats.samples_yielded, stats.epoch) == (0, 0, 0)
    assert stats.consumer_wait_s == 0
    assert isinstance(stats, aioloader.LoaderStatistics)
    async with loader:
        it = aiter(loader)
        await take(it, 1)
        stats = loader.statistics()
        assert (stats.batches_yielded, stats.samples_yielded) == (1, 4)
        assert "yielded=1/3" in repr(loader)
        await take(it, 2)
        stats = loader.statistics()
        assert (stats.batches_yielded, stats.samples_yielded) == (3, 10)
        assert stats.epoch_batches_yielded == 3
        assert stats.consumer_wait_s > 0  # the consumer waited for slow reads
        assert stats.read_s > 0
        assert stats.collate_s > 0
        await collect(loader)
        stats = loader.statistics()
        assert stats.epoch == 1
        assert (stats.batches_yielded, stats.samples_yielded) == (6, 20)
        assert stats.epoch_batches_yielded == 3
        assert stats.skipped == ()
        text = repr(loader)
        assert "epoch=1" in text
        assert "yielded=3/3" in text
        assert "prefetch=2" in text
        with pytest.raises(AttributeError):
            stats.epoch = 5  # type: ignore[misc]  # a frozen snapshot


# -- state_dict / load_state_dict -------------------------------------------------------------


async def test_resume_in_the_middle_of_a_shuffled_epoch() -> None:
    n, size, seed, k = 23, 4, 1234, 3

    def make() -> DataLoader:
        return DataLoader(
            Range(n), batch_size=size, shuffle=True, seed=seed, num_workers=2, thread_pool=True
        )

    async with make() as reference:
        epochs = [as_lists(await collect(reference)) for _ in range(2)]
    async with make() as first:
        it = aiter(first)
        taken = as_lists(await take(it, k))
        state = first.state_dict()
    assert taken == epochs[0][:k]
    assert (state["epoch"], sorted(state["done"])) == (0, list(range(k)))
    async with make() as second:
        second.load_state_dict(state)
        assert as_lists(await collect(second)) == epochs[0][k:]
        assert as_lists(await collect(second)) == epochs[1]


@pytest.mark.parametrize(("policy", "k"), [("keep", 0), ("discard", 5), ("rollover", 2)])
def test_resume_yields_exactly_the_rest_then_matches_an_uninterrupted_run(
    policy: str, k: int
) -> None:
    n, size, seed = 23, 4, 99

    def make() -> DataLoader:
        return DataLoader(Range(n), batch_size=size, shuffle=True, seed=seed, last_batch=policy)

    with make() as reference:
        epochs = [as_lists(list(reference)) for _ in range(3)]
    with make() as first:
        list(first)  # epoch 0 (with rollover: leaves a carry for epoch 1)
        it = iter(first)
        taken = [next(it).tolist() for _ in range(k)]
        state = first.state_dict()
        del it
    assert taken == epochs[1][:k]
    assert (state["epoch"], sorted(state["done"])) == (1, list(range(k)))
    with make() as second:
        second.load_state_dict(state)
        assert as_lists(list(second)) == epochs[1][k:]
        assert as_lists(list(second)) == epochs[2]
        assert second.statistics().epoch == 2


def test_resume_between_epochs_and_state_survives_pickle() -> None:
    import pickle

    def make() -> DataLoader:
        return DataLoader(Range(11), batch_size=3, shuffle=True, seed=7, last_batch="rollover")

    with make() as reference:
        epochs = [as_lists(list(reference)) for _ in range(3)]
    with make() as first:
        list(first)
        state = pickle.loads(pickle.dumps(first.state_dict()))
    assert state["epoch"] == 1
    with make() as second:
        second.load_state_dict(state)
        assert as_lists(list(second)) == epochs[1]
        assert as_lists(list(second)) == epochs[2]
    with DataLoader(Range(11), batch_size=3, shuffle=True, seed=8) as other:
        with pytest.raises(ValueError, match="seed"):
            other.load_state_dict(state)
        with pytest.raises(ValueError, match="done"):
            other.load_state_dict({"epoch": 0, "seed": 8})


# -- argument validation ----------------------------------------------------------------------


BAD_ARGUMENTS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"num_workers": -1}, ValueError, "num_workers"),
    ({"num_workers": 1.5}, TypeError, "num_workers"),
    ({"num_workers": True}, TypeError, "num_workers"),
    ({"num_workers": "2"}, TypeError, "num_workers"),
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"batch_size": -3}, ValueError, "batch_size"),
    ({"batch_size": 2.0}, TypeError, "batch_size"),
    ({"batch_size": True}, TypeError, "batch_size"),
    ({"batch_size": None}, ValueError, "batch_size"),
    ({"prefetch": 0}, ValueError, "prefetch"),
    ({"prefetch": -1}, ValueError, "prefetch"),
    ({"prefetch": 2.5}, TypeError, "prefetch"),
    ({"prefetch": False}, TypeError, "prefetch"),
    ({"timeout": -1}, ValueError, "timeout"),
    ({"timeout": float("nan")}, ValueError, "timeout"),
    ({"timeout": float("inf")}, ValueError, "timeout"),
    ({"timeout": "1"}, TypeError, "timeout"),
    ({"timeout": True}, TypeError, "timeout"),
    ({"sampler": SequentialSampler(10), "shuffle": True}, ValueError, "shuffle"),
    ({"batch_sampler": [[0, 1]], "batch_size": 2}, ValueError, "batch_size"),
    ({"batch_sampler": [[0, 1]], "shuffle": True}, ValueError, "shuffle"),
    ({"batch_sampler": [[0, 1]], "sampler": [0, 1]}, ValueError, "sampler"),
    ({"batch_sampler": [[0, 1]], "drop_last": True}, ValueError, "drop_last"),
    ({"batch_sampler": [[0, 1]], "last_batch": "discard"}, ValueError, "last_batch"),
    ({"last_batch": "drop"}, ValueError, "last_batch"),
    ({"last_batch": 3}, ValueError, "last_batch"),
    ({"drop_last": True, "last_batch": "keep"}, ValueError, "drop_last"),
    ({"drop_last": 1}, TypeError, "drop_last"),
    ({"shuffle": 1}, TypeError, "shuffle"),
    ({"mp_context": "telepathy"}, ValueError, "mp_context"),
    ({"mp_context": "telepathy", "num_workers": 2}, ValueError, "mp_context"),
    ({"mp_context": 3}, TypeError, "mp_context"),
    ({"collate_fn": "stack"}, TypeError, "collate_fn"),
    ({"batchify_fn": 3}, TypeError, "collate_fn"),
    ({"transform": 3}, TypeError, "transform"),
    ({"worker_init_fn": "init"}, TypeError, "worker_init_fn"),
    ({"max_failures": -1}, ValueError, "max_failures"),
    ({"max_failures": float("nan")}, ValueError, "max_failures"),
    ({"max_failures": float("inf")}, ValueError, "max_failures"),
    ({"max_failures": 1.5}, ValueError, "max_failures"),
    ({"max_failures": "3"}, TypeError, "max_failures"),
    ({"max_failures": True}, TypeError, "max_failures"),
    ({"on_error": "ignore"}, ValueError, "on_error"),
    ({"device": "cuda:x"}, ValueError, "device"),
    ({"device": "gpu"}, ValueError, "device"),
    ({"device": -1}, ValueError, "device"),
    ({"device": 1.0}, TypeError, "device"),
    ({"seed": "42"}, TypeError, "seed"),
    ({"io_concurrency": 0}, ValueError, "io_concurrency"),
    ({"max_retries": -1}, ValueError, "max_retries"),
    ({"in_order": "yes"}, TypeError, "in_order"),
    ({"thread_pool": None}, TypeError, "thread_pool"),
    ({"shm_max_bytes": -1}, ValueError, "shm_max_bytes"),
]


class Stream:
    def __iter__(self) -> Any:
        return iter(range(5))


BAD_FOR_ITERABLES: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"shuffle": True}, ValueError, "shuffle"),
    ({"sampler": SequentialSampler(5)}, ValueError, "sampler"),
    ({"batch_sampler": [[0, 1]]}, ValueError, "batch_sampler"),
    ({"last_batch": "rollover"}, ValueError, "rollover"),
    ({"batch_size": None}, ValueError, "batch_size"),
]


def _construction_error(dataset: Any, kwargs: dict[str, Any]) -> Exception | None:
    try:
        DataLoader(dataset, **kwargs).close()
    except Exception as exc:
        return exc
    return None


def test_bad_arguments_are_rejected_naming_the_argument() -> None:
    # One test over a table (each case is cheap; a test each would mostly measure teardown).
    cases = [(Range(10), *case) for case in BAD_ARGUMENTS]
    cases += [(Stream(), *case) for case in BAD_FOR_ITERABLES]
    cases += [(42, {}, TypeError, "dataset")]
    wrong = []
    for dataset, kwargs, error, name in cases:
        exc = _construction_error(dataset, kwargs)
        if type(exc) is not error or name not in str(exc):
            wrong.append(
                f"{type(dataset).__name__} {kwargs}: want {error.__name__} naming "
                f"{name!r}, got {exc!r}"
            )
    assert wrong == []


def test_unpicklable_dataset_for_worker_processes_is_reported_at_construction() -> None:
    local = Range(4)
    local.fn = lambda x: x  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="dataset"):
        DataLoader(local, num_workers=2)
    with pytest.raises(TypeError, match="collate_fn"):
        DataLoader(Range(4), num_workers=2, collate_fn=lambda s: s)
    # Threads need no pickling.
    DataLoader(local, num_workers=2, thread_pool=True, collate_fn=lambda s: s).close()


def test_more_worker_processes_than_cpus_warns() -> None:
    cpus = os.cpu_count() or 1
    with pytest.warns(UserWarning, match=f"num_workers={cpus + 1}"):
        loader = DataLoader(Range(4), num_workers=cpus + 1)
    loader.close()
    # Threads wait on IO; more of them than CPUs is normal and does not warn.
    DataLoader(Range(4), num_workers=cpus + 1, thread_pool=True).close()


# -- sharded batches and batch samplers -------------------------------------------------------


async def test_sharded_batch_sampler_yields_one_batch_per_shard() -> None:
    sampler = ShardedBatchSampler(BatchSampler(SequentialSampler(11), 5), num_shards=2)
    async with DataLoader(Range(11), batch_size=None, batch_sampler=sampler) as loader:
        assert len(loader) == 3
        batches = await collect(loader)
    assert [[shard.tolist() for shard in batch] for batch in batches] == [
        [[0, 1, 2], [3, 4]],
        [[5, 6, 7], [8, 9]],
        [[10]],
    ]
    plan = [[3, 1], [0], [2, 4, 5]]  # any iterable of index lists is a batch sampler
    async with DataLoader(Range(6), batch_size=None, batch_sampler=plan) as loader:
        assert len(loader) == 3
        assert as_lists(await collect(loader)) == plan


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


# -- async map datasets -----------------------------------------------------------------------


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
            notes = _notes(info.value)
            assert "index 5" in notes
            assert "batch 1" in notes
        # Several items of one batch fail: still the user's type (not an ExceptionGroup), the
        # first in sample order, the others mentioned.
        dataset = AsyncRange(8, bad={1, 2}, error_type=OSError)
        async with DataLoader(dataset, batch_size=4) as loader:
            with pytest.raises(OSError, match="async sample 1 is broken") as info:
                await collect(loader)
            assert "async sample 2 is broken" in _notes(info.value)
            await asyncio.sleep(0.05)  # let the sibling fetches of the failed batches settle
    assert handler.calls == []


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


def test_sync_dataset_skip_with_a_fraction() -> None:
    dataset = FailAt(40, {7, 30}, error_type=ValueError)
    with DataLoader(dataset, batch_size=5, on_error="skip", max_failures=0.1) as loader:
        assert flat(list(loader)) == [i for i in range(40) if i not in (7, 30)]
        assert sorted(i for i, _ in loader.statistics().skipped) == [7, 30]
    dataset = FailAt(40, {1, 2, 3}, error_type=ValueError)
    loader = DataLoader(dataset, batch_size=5, on_error="skip", max_failures=0.1)
    with loader, pytest.raises(TooManyFailuresError):
        list(loader)


class GetItems(Range):
    """Reads a whole batch at once, as torch's ``__getitems__`` convention allows."""

    def __getitems__(self, indices: list[int]) -> list[int]:
        return [i * 100 for i in indices]


class ShortGetItems(Range):
    def __getitems__(self, indices: list[int]) -> list[int]:
        return [0]  # one sample, whatever was asked


def test_getitems_reads_a_batch_at_once_and_a_wrong_count_is_an_error() -> None:
    with DataLoader(GetItems(6), batch_size=4) as loader:
        assert as_lists(list(loader)) == [[0, 100, 200, 300], [400, 500]]
    loader = DataLoader(ShortGetItems(6), batch_size=4)
    with loader, pytest.raises(ValueError, match="__getitems__ returned 1 samples for 4 indices"):
        list(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
@no_worker_left_behind()
def test_a_batch_whose_samples_all_fail_is_skipped_whole(num_workers: int) -> None:
    dataset = FailAt(12, {4, 5, 6, 7, 9}, error_type=ValueError)
    kwargs: dict[str, Any] = {"on_error": "skip", "max_failures": 5, "num_workers": num_workers}
    with DataLoader(dataset, batch_size=4, **kwargs) as loader:
        # Batch 1 lost every sample: it is not yielded (collating nothing would fail).
        assert as_lists(list(loader)) == [[0, 1, 2, 3], [8, 10, 11]]
        stats = loader.statistics()
        assert sorted(i for i, _ in stats.skipped) == [4, 5, 6, 7, 9]
        assert (stats.batches_yielded, stats.samples_yielded) == (2, 7)
    # Sharded: a shard that lost every sample is left out; a batch that lost all is skipped.
    sampler = ShardedBatchSampler(BatchSampler(SequentialSampler(12), 4), num_shards=2)
    with DataLoader(dataset, batch_size=None, batch_sampler=sampler, **kwargs) as loader:
        batches = [[shard.tolist() for shard in batch] for batch in loader]
    assert batches == [[[0, 1], [2, 3]], [[8], [10, 11]]]


# -- worker processes behave like threads -----------------------------------------------------


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


async def test_two_iterators_at_once_each_run_a_full_epoch() -> None:
    """As torch's do: neither is cut short, and each is in sampler order."""
    async with DataLoader(Range(10), batch_size=3, shuffle=True, seed=5) as reference:
        epoch0 = flat(await collect(reference))
        epoch1 = flat(await collect(reference))
    async with DataLoader(
        Range(10), batch_size=3, shuffle=True, seed=5, num_workers=2, thread_pool=True
    ) as loader:
        first, second = aiter(loader), aiter(loader)  # made, nothing started yet
        a = [await anext(first)]
        b = [batch async for batch in second]  # a whole epoch while `first` is mid-way
        a += [batch async for batch in first]
    assert flat(a) == epoch0  # the first iterator is epoch 0, in sampler order, complete
    assert flat(b) == epoch1  # the second is epoch 1
    assert epoch0 != epoch1


def test_zip_of_a_loader_with_itself_in_sync_code() -> None:
    with DataLoader(Range(7), batch_size=2) as loader:
        pairs = list(zip(loader, loader, strict=True))
    assert len(pairs) == 4
    assert [a.tolist() for a, _ in pairs] == [b.tolist() for _, b in pairs]


class SixStream:
    def __iter__(self) -> Any:
        return iter(range(6))


@pytest.mark.parametrize("threads", [0, 2])
async def test_two_iterators_of_a_stream_each_read_it_whole(threads: int) -> None:
    async with DataLoader(
        SixStream(), batch_size=2, num_workers=threads, thread_pool=bool(threads)
    ) as loader:
        first = aiter(loader)
        a = [await anext(first)]
        b = [batch async for batch in loader]
        a += [batch async for batch in first]
    assert sorted(flat(a)) == list(range(6))  # neither is cut short
    assert sorted(flat(b)) == list(range(6))


def test_iter_starts_nothing_until_next() -> None:
    """A framework's `iter(loader)` probe consumes no epoch and no resume state."""
    with DataLoader(Range(6), batch_size=2, shuffle=True, seed=1) as other:
        reference = [b.tolist() for b in other]
    with DataLoader(Range(6), batch_size=2, shuffle=True, seed=1) as loader:
        probe = iter(loader)
        del probe
        aprobe = loader.__aiter__()
        del aprobe
        assert loader.state_dict()["epoch"] == 0
        assert [b.tolist() for b in loader] == reference


def test_a_temporary_loader_iterated_directly() -> None:
    """The iterator keeps its loader alive; once both are dropped the loader is released (with
    the ResourceWarning an unclosed file gives, hidden by default)."""
    with pytest.warns(ResourceWarning, match="not closed"):
        first = next(iter(DataLoader(Range(5), batch_size=2))).tolist()
    assert first == [0, 1]
    with pytest.warns(ResourceWarning, match="not closed"):
        batches = [b.tolist() for b in DataLoader(Range(5), batch_size=2)]
    assert batches == [[0, 1], [2, 3], [4]]
