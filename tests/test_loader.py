"""The DataLoader's own job (_loader): async and sync iteration, epochs, lifecycle (closing,
what is released, workers started on enter), resume (``state_dict``), statistics and repr,
several iterators at once.

What other modules do is tested through the loader in their own files: an epoch's hand-over,
cancellation and closing in ``test_epoch``, scheduling and prefetch in ``test_produce``, async
fetches in ``test_fetch``, one batch's reading and errors in ``test_batch``, deadlines in
``test_deadline``, skips in ``test_failures``, argument checks in ``test_config``, worker
processes in ``test_workers``.

Most tests run the CPU work on the helper thread (``num_workers=0``) or a thread pool
(``thread_pool=True``), which is fast. Every loop and wait in this file is bounded; the conftest
checks that no thread, process or shared-memory segment outlives a test.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from datasets import FailOnce, Range, Slow, Stream
from helpers import BOUND_S, as_lists, collect, drain, expected_batches, flat, take, until
from hypothesis import example, given, settings
from hypothesis import strategies as st
from procs import worker_processes

import aioloader
from aioloader import BatchSampler, DataLoader, SequentialSampler, ShardedBatchSampler

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

# Hypothesis's default deadline trips on a loaded 2-core machine; correctness is what we test.
few = settings(deadline=None, max_examples=25)


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


async def test_after_an_error_the_next_epoch_is_complete() -> None:
    async with DataLoader(FailOnce(9, bad=4), batch_size=2) as loader:
        got: list[Any] = []
        with pytest.raises(KeyError):
            await drain(aiter(loader), got)
        assert got == [[0, 1], [2, 3]]
        assert as_lists(await collect(loader)) == expected_batches(9, 2)


# -- lifecycle: closing, workers, what is released --------------------------------------------


async def test_aclose_is_idempotent_and_a_closed_loader_refuses_to_iterate() -> None:
    loader = DataLoader(Range(10), batch_size=2, num_workers=2, thread_pool=True)
    it = aiter(loader)
    assert (await anext(it)).tolist() == [0, 1]
    await loader.aclose()
    await loader.aclose()
    with pytest.raises(RuntimeError, match="closed during epoch 0, before it was over"):
        await anext(it)  # the open epoch was closed with the loader: not a whole epoch
    with pytest.raises(RuntimeError, match="closed"):
        aiter(loader)
    assert "closed" in repr(loader)


@pytest.mark.parametrize("workers", [0, 2])
async def test_a_loader_closed_from_another_task_mid_epoch_tells_its_consumer(
    workers: int,
) -> None:
    # An orchestrator's shutdown closes the loader while the training task iterates: the task
    # must not see an epoch that ended (it would checkpoint it as done, the rest never read).
    loader = DataLoader(Slow(64, 0.01), batch_size=1, num_workers=workers, thread_pool=True)
    got: list[int] = []

    async def train() -> None:
        async for batch in loader:
            got.extend(batch.tolist())

    async with asyncio.timeout(BOUND_S):
        task = asyncio.ensure_future(train())
        await until(lambda: len(got) >= 3)
        await loader.aclose()
        with pytest.raises(RuntimeError, match="closed during epoch 0, before it was over"):
            await task
    assert 3 <= len(got) < 64


def test_a_loader_closed_from_another_thread_mid_epoch_tells_its_for_loop() -> None:
    loader = DataLoader(Slow(64, 0.01), batch_size=1)
    got: list[int] = []
    closer = threading.Timer(0.1, loader.close)
    closer.start()

    def train() -> None:
        for batch in loader:
            got.extend(batch.tolist())

    try:
        with pytest.raises(RuntimeError, match="closed during epoch 0, before it was over"):
            train()
    finally:
        closer.join()
    assert len(got) < 64


@pytest.mark.parametrize("workers", [0, 2])
async def test_an_epoch_over_before_the_close_just_ends(workers: int) -> None:
    for dataset in (Range(4), Stream(4)):
        loader = DataLoader(dataset, batch_size=2, num_workers=workers)
        it = aiter(loader)
        assert sorted(flat(await take(it, 2))) == [0, 1, 2, 3]  # every batch taken
        await asyncio.sleep(0.2)  # a stream's readers' ends arrive (they wait for no one)
        await loader.aclose()
        with pytest.raises(StopAsyncIteration):
            await anext(it)


def test_a_sync_epoch_over_before_another_threads_close_just_ends() -> None:
    loader = DataLoader(Range(4), batch_size=2, num_workers=2)
    it = iter(loader)
    assert as_lists([next(it), next(it)]) == [[0, 1], [2, 3]]
    closer = threading.Thread(target=loader.close)
    closer.start()
    closer.join()
    with pytest.raises(StopIteration):
        next(it)


def test_a_worker_pool_closed_under_a_for_loop_tells_it() -> None:
    with aioloader.WorkerPool(2) as pool:
        loader = DataLoader(Slow(64, 0.01), batch_size=1, workers=pool)
        it = iter(loader)
        next(it)
        closer = threading.Timer(0.05, pool.close)
        closer.start()
        try:
            with pytest.raises(RuntimeError, match="closed"):
                list(it)
        finally:
            closer.join()
        loader.close()


class ClosesBadly(Range):
    async def aclose(self) -> None:
        raise OSError("session close failed")


def _loader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aioloader")]


async def test_aclose_releases_everything_even_when_the_dataset_close_fails() -> None:
    loader = DataLoader(ClosesBadly(8), batch_size=4)
    async with asyncio.timeout(BOUND_S):
        assert [b.tolist() async for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        with pytest.raises(OSError, match="session close failed"):
            await loader.aclose()
    assert loader.closed
    assert _loader_threads() == []  # the helper thread is gone (the leak check agrees)


class CountsCloses(Range):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.closes = 0

    async def aclose(self) -> None:
        self.closes += 1


def test_close_after_the_loop_it_iterated_on_ended_still_closes_the_dataset() -> None:
    # asyncio.run(train()), then loader.close(): no loop is left to run the dataset's aclose().
    dataset = CountsCloses(8)
    loader = DataLoader(dataset, batch_size=4)

    async def train() -> int:
        return len([b async for b in loader])

    assert asyncio.run(train()) == 2
    loader.close()
    assert dataset.closes == 1
    loader.close()  # idempotent
    assert dataset.closes == 1


async def test_sync_close_inside_a_running_loop_closes_the_dataset_on_it() -> None:
    dataset = CountsCloses(8)
    loader = DataLoader(dataset, batch_size=4)
    async with asyncio.timeout(BOUND_S):
        assert len([b async for b in loader]) == 2
        loader.close()  # sync, on the loop: the dataset's aclose() is scheduled there
        await until(lambda: dataset.closes == 1)


class ClosesPlainly(CountsCloses):
    def aclose(self) -> None:  # type: ignore[override]  # a plain function passes the protocol
        self.closes += 1


async def test_sync_close_in_a_running_loop_with_a_plain_aclose_releases_everything() -> None:
    dataset = ClosesPlainly(8)
    loader = DataLoader(dataset, batch_size=4)
    async with asyncio.timeout(BOUND_S):
        assert len([b async for b in loader]) == 2
        loader.close()
        await until(lambda: dataset.closes == 1)
    assert loader.closed
    assert _loader_threads() == []


class RecordsItsLoop(CountsCloses):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.loops: list[asyncio.AbstractEventLoop] = []

    async def aclose(self) -> None:
        self.loops.append(asyncio.get_running_loop())


def test_close_after_iterating_on_a_loop_of_ones_own_closes_the_dataset_there() -> None:
    # The loop is idle but open, and this thread's current one: the dataset's resources
    # belong to it, and close() must leave it current.
    dataset = RecordsItsLoop(8)
    loader = DataLoader(dataset, batch_size=4)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        assert loop.run_until_complete(_count(loader)) == 2
        loader.close()
        assert dataset.loops == [loop]
        assert asyncio.get_event_loop() is loop
    finally:
        asyncio.set_event_loop(None)
        loop.close()


async def _count(loader: DataLoader) -> int:
    return len([b async for b in loader])


def _executor_threads() -> list[str]:
    """Threads of an event loop's default executor (``asyncio.to_thread``)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("asyncio_")]


@pytest.mark.parametrize("iterated", ["never", "whole epoch", "slow batches"])
def test_aclose_of_an_idle_loader_without_workers_closes_in_place(iterated: str) -> None:
    # Nothing to wait for: no process, no batch on the helper thread. Closing in a thread
    # would cost a hand-off and start the loop's default executor for nothing.
    async def main() -> list[str]:
        dataset = Slow(8, 0.002) if iterated == "slow batches" else Range(8)
        loader = DataLoader(dataset, batch_size=2)
        async with asyncio.timeout(BOUND_S):
            if iterated != "never":
                assert len([b async for b in loader]) == 4
            await loader.aclose()
        assert loader.closed
        assert _loader_threads() == []
        return _executor_threads()

    assert asyncio.run(main()) == []


class Gated(Range):
    """Blocks in ``__getitem__`` until ``release`` is set, after setting ``entered``."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getitem__(self, index: int) -> int:
        self.entered.set()
        self.release.wait(BOUND_S)
        return super().__getitem__(index)


async def test_aclose_with_a_batch_on_the_helper_thread_leaves_the_loop_free() -> None:
    dataset = Gated(4)
    # One batch in flight: the held one is the only job, queued or running.
    loader = DataLoader(dataset, batch_size=2, prefetch=1)
    it = aiter(loader)
    first = asyncio.ensure_future(anext(it))
    try:
        async with asyncio.timeout(BOUND_S):
            assert await asyncio.to_thread(dataset.entered.wait, BOUND_S)
            closing = asyncio.ensure_future(loader.aclose())
            await asyncio.sleep(0.05)  # runs: closing waits for the thread off the loop
            assert not closing.done()
            dataset.release.set()
            await closing
    finally:
        dataset.release.set()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    assert loader.closed
    assert _loader_threads() == []


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


def test_workers_start_on_enter_for_sync_use() -> None:
    with DataLoader(Range(8), batch_size=4, num_workers=1) as loader:
        pids = loader.worker_pids
        assert len(pids) == 1  # started before the first batch was asked for
        assert set(pids) <= worker_processes()  # a live worker process
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_worker_pids_are_the_worker_processes_while_they_run() -> None:
    before = worker_processes()
    loader = DataLoader(Range(8), batch_size=4, num_workers=2)
    # Workers start as the loader is made (worker 0 at once, the others in the background): the
    # pids are those of the workers started so far, the same processes as after the start.
    early = loader.worker_pids
    with loader:
        pids = loader.worker_pids
        assert len(pids) == 2
        assert set(early) <= set(pids)
        assert set(pids) == worker_processes() - before
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert loader.worker_pids == pids  # the same processes serve every epoch
    assert not loader.worker_pids  # closed: gone
    with DataLoader(Range(8), batch_size=4, num_workers=2, thread_pool=True) as threads:
        assert [b.tolist() for b in threads] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert threads.worker_pids == ()  # threads are not processes


def test_closed_and_mp_context_are_readable() -> None:
    loader = DataLoader(Range(4), num_workers=1, mp_context="spawn")
    assert loader.mp_context is not None
    assert loader.mp_context.get_start_method() == "spawn"
    assert not loader.closed
    loader.close()
    assert loader.closed
    default = DataLoader(Range(4), num_workers=1)
    assert default.mp_context is not None
    assert default.mp_context.get_start_method() == "forkserver"
    default.close()
    threads = DataLoader(Range(4), num_workers=1, thread_pool=True)
    assert threads.mp_context is None  # no worker processes, no context
    threads.close()


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


# -- statistics and repr ----------------------------------------------------------------------


async def test_statistics_move_as_the_loader_runs() -> None:
    dataset = Slow(10, lambda i: 0.01)
    loader = DataLoader(dataset, batch_size=4)
    stats = loader.statistics()
    assert (stats.batches_yielded, stats.samples_yielded, stats.epoch) == (0, 0, 0)
    assert stats.consumer_wait_s == 0
    assert (stats.live_shm_slots, stats.leased_shm_slots, stats.held_shm_slots) == (0, 0, 0)
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
    # Every batch taken (without the next() that would raise StopIteration, as a loop that
    # counts to len(loader) does): the epoch is complete, and the state starts the next one.
    whole = k == len(epochs[1])
    expected = (2, []) if whole else (1, list(range(k)))
    assert (state["epoch"], sorted(state["done"])) == expected
    with make() as second:
        second.load_state_dict(state)
        if not whole:
            assert as_lists(list(second)) == epochs[1][k:]
        assert as_lists(list(second)) == epochs[2]
        assert second.statistics().epoch == 2


def _epochs_and_a_state_in_epoch_1(
    make: Callable[[], DataLoader], taken: int
) -> tuple[list[list[list[int]]], dict[str, Any]]:
    """Three uninterrupted epochs of ``make()``, and the state of another loader stopped after
    ``taken`` batches of its epoch 1."""
    with make() as reference:
        epochs = [as_lists(list(reference)) for _ in range(3)]
    with make() as first:
        list(first)
        it = iter(first)
        [next(it) for _ in range(taken)]
        state = first.state_dict()
        del it
    return epochs, state


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_saved_again_before_the_first_resumed_batch_is_the_one_loaded(
    num_workers: int,
) -> None:
    # A job preempted twice, or a framework that checkpoints right after its restore: the
    # second save must not fall back to the start of epoch 0 (it replayed everything).
    def make() -> DataLoader:
        return DataLoader(Range(23), batch_size=4, shuffle=True, seed=5, num_workers=num_workers)

    epochs, state = _epochs_and_a_state_in_epoch_1(make, taken=2)
    with make() as second:
        second.load_state_dict(state)
        again = second.state_dict()
    assert again == state
    with make() as third:
        third.load_state_dict(again)
        assert third.state_dict() == state
        assert as_lists(list(third)) == epochs[1][2:]
        assert third.state_dict()["epoch"] == 2
        assert as_lists(list(third)) == epochs[2]


def _torch_samplers(kind: str, seeded: bool) -> dict[str, Any]:
    import torch
    import torch.utils.data as tud

    generator = torch.Generator().manual_seed(3) if seeded else None
    data = Range(30)
    if kind == "random":
        return {"sampler": tud.RandomSampler(data, generator=generator), "batch_size": 4}
    if kind == "weighted":
        weights = [1.0 + (i % 3) for i in range(30)]
        sampler = tud.WeightedRandomSampler(weights, 30, generator=generator)
        return {"sampler": sampler, "batch_size": 4}
    inner = tud.RandomSampler(data, generator=generator)
    return {"batch_sampler": tud.BatchSampler(inner, 4, drop_last=False)}


@pytest.mark.parametrize("kind", ["random", "weighted", "batch_sampler"])
def test_torchs_random_samplers_with_a_generator_resume_exactly(kind: str) -> None:
    # torch's samplers have no state_dict: their order is their generator's state at the
    # epoch's iter(), which the loader's state now carries (it repeated and lost samples).
    def make() -> DataLoader:
        return DataLoader(Range(30), **_torch_samplers(kind, seeded=True))

    epochs, state = _epochs_and_a_state_in_epoch_1(make, taken=3)
    with make() as second, warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the order is restored
        second.load_state_dict(state)
        assert as_lists(list(second)) == epochs[1][3:]
        assert as_lists(list(second)) == epochs[2]


def test_a_state_for_other_samplers_generators_is_refused_when_loaded() -> None:
    # Refused at the next iter() before, after the loaded state had been taken: a second
    # iter() then ran a fresh epoch, the resume lost.
    with DataLoader(Range(30), **_torch_samplers("random", seeded=True)) as saver:
        state = saver.state_dict()
    other = DataLoader(Range(30), **_torch_samplers("random", seeded=False))
    with other, pytest.raises(ValueError, match="generator"):
        other.load_state_dict(state)


def test_a_state_saved_after_set_epoch_on_the_loaders_sampler_holds_that_epoch() -> None:
    def make() -> DataLoader:
        return DataLoader(Range(21), batch_size=4, shuffle=True, seed=8)

    with make() as reference:
        reference.set_epoch(5)
        epoch5 = as_lists(list(reference))
    with make() as saver:
        saver.sampler.set_epoch(5)
        state = saver.state_dict()
        assert as_lists(list(saver)) == epoch5
    assert state["epoch"] == 5
    with make() as resumed:
        resumed.load_state_dict(state)
        assert as_lists(list(resumed)) == epoch5


def test_a_mid_epoch_state_of_torchs_random_sampler_without_a_generator_warns() -> None:
    with DataLoader(Range(30), **_torch_samplers("random", seeded=False)) as loader:
        between = loader.state_dict()  # between epochs: the next order is drawn anyway
        it = iter(loader)
        next(it)
        with pytest.warns(UserWarning, match="global generator") as caught:
            loader.state_dict()
        assert caught[0].filename == __file__  # points at the caller
        del it
    assert between["done"] == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_set_epoch_on_the_sampler_the_loader_made_picks_the_epoch(num_workers: int) -> None:
    # torch's DDP idiom, loader.sampler.set_epoch(epoch) before each epoch: a run restarted at
    # epoch 5 got epoch 0's order, the loader's own count overriding the sampler's.
    def make() -> DataLoader:
        return DataLoader(Range(21), batch_size=4, shuffle=True, seed=8, num_workers=num_workers)

    with make() as reference:
        epochs = [as_lists(list(reference)) for _ in range(8)]
    assert epochs[5] != epochs[0]
    with make() as restarted:
        for epoch in (5, 6):
            restarted.sampler.set_epoch(epoch)
            assert as_lists(list(restarted)) == epochs[epoch]
        assert as_lists(list(restarted)) == epochs[7]  # not told: the count goes on from there
    with make() as counted:
        restarted_order = []
        for epoch in range(3):
            counted.sampler.set_epoch(epoch)  # in step with the loader's own count
            restarted_order.append(as_lists(list(counted)))
        assert restarted_order == epochs[:3]
        counted.sampler.set_epoch(5)
        counted.set_epoch(1)  # the loader's own call wins over the sampler's
        assert as_lists(list(counted)) == epochs[1]
        assert as_lists(list(counted)) == epochs[2]  # and its count goes on from there


def test_a_mid_epoch_state_is_refused_by_a_loader_whose_batches_are_other_samples() -> None:
    # Its batch ids count in batches of the saving loader: another batch size or dataset
    # length silently lost or repeated samples (12 of 40 lost, from batch_size 4 to 8).
    with DataLoader(Range(40), batch_size=4, shuffle=True, seed=1) as saver:
        it = iter(saver)
        [next(it) for _ in range(3)]
        state = saver.state_dict()
        del it
        between = DataLoader(Range(40), batch_size=4, shuffle=True, seed=1).state_dict()
    for other in (
        DataLoader(Range(40), batch_size=8, shuffle=True, seed=1),
        DataLoader(Range(60), batch_size=4, shuffle=True, seed=1),
    ):
        with other, pytest.raises(ValueError, match="batch_size=4 over 40 samples"):
            other.load_state_dict(state)
    with DataLoader(Range(60), batch_size=8, shuffle=True, seed=1) as grown:
        grown.load_state_dict(between)  # between epochs: nothing taken, nothing to count
        assert len(flat(list(grown))) == 60


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


# -- several iterators at once ----------------------------------------------------------------


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


@pytest.mark.parametrize("threads", [0, 2])
async def test_two_iterators_of_a_stream_each_read_it_whole(threads: int) -> None:
    async with DataLoader(
        Stream(6), batch_size=2, num_workers=threads, thread_pool=bool(threads)
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
