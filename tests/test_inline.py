"""Cheap batches made where they are asked for (``num_workers=0``): in the caller's thread for
``for``, on the event loop for ``async for`` once a few were cheap; a costly batch sends the next
ones to the helper thread. What must not change: every sample once and in order, errors named
and the epoch going on after them, skips, statistics, exact resume, the end of an epoch seen at
its last batch, Ctrl-C, and the dataset never read from two threads at once.

Which thread made a batch is read from the dataset itself (the thread that ran ``__getitem__``).
The route policy alone, with no loader, is ``test_routes``'s.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
from datasets import Range
from helpers import BOUND_S, as_lists, expected_batches, flat, notes_of

from aioloader import DataLoader, WorkerError
from aioloader._batch._make import BatchMaker
from aioloader._threads import RoutePolicy, ThreadRunner, _routes
from aioloader._threads._routes import INLINE_AFTER
from aioloader._types import BatchRequest, Route

pytestmark = pytest.mark.usefixtures("baseline")

# The thresholds these tests run with: far from the time a tiny batch takes, so a busy machine
# that pauses a thread for a few milliseconds does not move a batch. A sample of COSTLY_S makes
# its batch costly.
CHEAP_BELOW_S = 0.005
COSTLY_ABOVE_S = 0.03
COSTLY_S = 0.1
HELPER = "aioloader-0"  # the helper thread's name (_threads.ThreadPool)


@pytest.fixture(autouse=True)
def robust_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The route policy of every loader made here uses these thresholds (its defaults)."""
    monkeypatch.setattr(_routes, "INLINE_BELOW_S", CHEAP_BELOW_S)
    monkeypatch.setattr(_routes, "INLINE_ABOVE_S", COSTLY_ABOVE_S)


class WhereMade(Range):
    """Records the thread that read each index; the indices in ``costly`` take ``COSTLY_S``;
    reading ``interrupt`` raises KeyboardInterrupt once (a Ctrl-C in the dataset's code)."""

    def __init__(
        self, n: int, costly: frozenset[int] = frozenset(), interrupt: int | None = None
    ) -> None:
        super().__init__(n)
        self.costly = costly
        self.interrupt = interrupt
        self.threads: dict[int, str] = {}
        self.running = 0
        self.most_at_once = 0

    def __getitem__(self, index: int) -> int:
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            self.threads[index] = threading.current_thread().name
            if index == self.interrupt:
                self.interrupt = None
                raise KeyboardInterrupt
            if index in self.costly:
                time.sleep(COSTLY_S)
            return super().__getitem__(index)
        finally:
            self.running -= 1


GATED = 63


class Gated(WhereMade):
    """Reading index ``GATED`` waits (bounded) until ``gate`` is set; ``entered`` says it began."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __getitem__(self, index: int) -> int:
        if index == GATED:
            self.entered.set()
            self.gate.wait(BOUND_S)
        return super().__getitem__(index)


def made_by(dataset: WhereMade, indices: range) -> set[str]:
    return {dataset.threads[i] for i in indices}


def test_for_makes_cheap_batches_in_the_callers_thread_with_no_loop_and_as_torch_does() -> None:
    data = WhereMade(64)
    seen_threads: set[str] = set()
    with DataLoader(data, batch_size=4) as loader:
        batches = []
        for batch in loader:
            batches.append(batch)
            seen_threads |= {t.name for t in threading.enumerate()}
    assert made_by(data, range(64)) == {threading.current_thread().name}
    assert not {name for name in seen_threads if name.startswith("aioloader")}
    reference: Any = Range(64)
    expected = list(torch.utils.data.DataLoader(reference, batch_size=4))
    assert len(batches) == len(expected) == 16
    for ours, theirs in zip(batches, expected, strict=True):
        assert torch.equal(ours, theirs)


def test_a_costly_batch_sends_the_rest_of_the_epoch_to_the_helper_thread() -> None:
    data = WhereMade(40, costly=frozenset({9}))  # in batch 2 (indices 8..11)
    with DataLoader(data, batch_size=4) as loader:
        assert as_lists(list(loader)) == expected_batches(40, 4)
        me = threading.current_thread().name
        assert made_by(data, range(12)) == {me}  # the costly batch itself was made inline
        assert made_by(data, range(12, 16)) == {HELPER}  # then the thread, prefetching
        assert me not in made_by(data, range(16, 40))  # the rest from the loop's side
        # The batches after it were cheap: an epoch without it stays in the caller's thread.
        data.threads.clear()
        data.costly = frozenset()
        assert flat(list(loader)) == list(range(40))
        assert made_by(data, range(40)) == {me}
    assert data.most_at_once == 1


async def test_async_for_makes_batches_on_the_loop_once_they_proved_cheap() -> None:
    data = WhereMade(128)
    async with DataLoader(data, batch_size=4) as loader:
        assert as_lists([b async for b in loader]) == expected_batches(128, 4)
    loop_thread = threading.current_thread().name
    assert made_by(data, range(4)) == {HELPER}  # the first batch: not known to be cheap yet
    later = [data.threads[i] for i in range(4 * (INLINE_AFTER + 4), 128)]
    # Most of them: a pause of the machine while one is made (> INLINE_ABOVE_S) would send a
    # few back to the thread until they prove cheap again.
    assert later.count(loop_thread) > len(later) * 0.9
    assert data.most_at_once == 1


async def test_a_runner_found_cheap_makes_on_the_loop_and_a_costly_batch_sends_the_next_away() -> (
    None
):
    data = Gated(64)
    routes = RoutePolicy(cheap_below_s=CHEAP_BELOW_S, costly_above_s=COSTLY_ABOVE_S)
    runner = ThreadRunner(BatchMaker(data, collate_fn=list), 1, inline=True, routes=routes)

    def found_cheap() -> None:
        for _ in range(INLINE_AFTER):
            routes.record(0.0, Route.THREAD)

    try:
        found_cheap()
        made = runner.start_make(BatchRequest(0, 0, [0, 1]))
        assert made.done()  # made right there, on the loop
        assert (await made).batch == [0, 1]
        routes.record(COSTLY_ABOVE_S * 2, Route.THREAD)
        on_thread = runner.start_make(BatchRequest(0, 1, [2, 3]))
        assert not on_thread.done()
        assert (await on_thread).batch == [2, 3]
        # While the thread makes a batch, the loop does not make one beside it.
        routes.record(COSTLY_ABOVE_S * 2, Route.THREAD)
        data.gate.clear()
        held = runner.start_make(BatchRequest(0, 2, [GATED]))  # waits in the thread
        assert data.entered.wait(BOUND_S)
        found_cheap()
        assert routes.route(on_loop=True) is Route.LOOP  # the policy says the loop...
        beside = runner.start_make(BatchRequest(0, 3, [4, 5]))
        assert not beside.done()  # ... but the thread holds the maker: queued behind it
        data.gate.set()
        assert (await held).batch == [GATED]
        assert (await beside).batch == [4, 5]
        found_cheap()
        assert runner.start_make(BatchRequest(0, 4, [6, 7])).done()
        assert data.most_at_once == 1
    finally:
        runner.close()


def test_an_error_names_its_sample_and_the_epoch_goes_on_inline() -> None:
    class FailAt5(WhereMade):
        def __getitem__(self, index: int) -> int:
            if index == 5:
                raise KeyError("sample 5 is broken")
            return super().__getitem__(index)

    with DataLoader(FailAt5(16), batch_size=4) as loader:
        it = iter(loader)
        assert next(it).tolist() == [0, 1, 2, 3]
        with pytest.raises(KeyError) as info:
            next(it)
        assert "index 5" in notes_of(info.value)
        assert [b.tolist() for b in it] == [[8, 9, 10, 11], [12, 13, 14, 15]]


def test_skips_and_statistics_inline() -> None:
    class FailOdd(WhereMade):
        def __getitem__(self, index: int) -> int:
            if index % 2:
                raise ValueError(f"odd {index}")
            return super().__getitem__(index)

    data = FailOdd(40)
    with DataLoader(data, batch_size=4, on_error="skip", max_failures=0.6) as loader:
        assert flat(list(loader)) == list(range(0, 40, 2))
        stats = loader.statistics()
    assert made_by(data, range(0, 40, 2)) == {threading.current_thread().name}
    assert stats.batches_yielded == 10
    assert stats.samples_yielded == 20
    assert stats.skipped_count == 20
    assert stats.read_s > 0


def test_a_state_taken_mid_epoch_inline_resumes_exactly() -> None:
    def loader() -> DataLoader:
        return DataLoader(WhereMade(50), batch_size=4, shuffle=True, seed=7)

    with loader() as whole:
        expected = as_lists(list(whole))
    with loader() as first:
        it = iter(first)
        head = as_lists([next(it) for _ in range(5)])
        state = first.state_dict()
    with loader() as second:
        second.load_state_dict(state)
        rest = as_lists(list(second))
    assert head + rest == expected


def test_taking_len_batches_ends_the_epoch_without_a_last_next() -> None:
    # Lightning and accelerate count to len(loader) and never ask for the batch after.
    with (
        DataLoader(WhereMade(20), batch_size=4, seed=3) as counted,
        DataLoader(WhereMade(20), batch_size=4, seed=3) as drained,
    ):
        it = iter(counted)
        for _ in range(len(counted)):
            next(it)
        list(drained)
        assert counted.state_dict() == drained.state_dict()


def test_ctrl_c_in_the_dataset_ends_the_epoch_and_the_next_one_starts_whole() -> None:
    data = WhereMade(24, interrupt=6)
    with DataLoader(data, batch_size=4) as loader:
        it = iter(loader)
        assert next(it).tolist() == [0, 1, 2, 3]
        with pytest.raises(KeyboardInterrupt):
            next(it)
        with pytest.raises(StopIteration):
            next(it)
        assert flat(list(loader)) == list(range(24))


def test_ctrl_c_raised_by_the_dataset_on_the_private_loop_is_a_worker_error() -> None:
    # A costly first batch hands the epoch to the private loop's scheduler; once batches prove
    # cheap it makes them on that loop's thread, where a KeyboardInterrupt is the dataset's
    # own (Python delivers Ctrl-C to the main thread only). It killed that thread, and the
    # loader with it: the next epoch raised "the DataLoader was closed".
    data = WhereMade(128, costly=frozenset({0}), interrupt=96)
    with DataLoader(data, batch_size=4) as loader:
        it = iter(loader)
        assert [next(it)[0].item() for _ in range(24)] == list(range(0, 96, 4))
        with pytest.raises(WorkerError, match="while making batch 24"):
            next(it)
        assert data.threads[96] == "aioloader-loop"  # the case this test is about
        assert flat(list(loader)) == list(range(128))  # the loader lives on


def test_a_failing_batch_sampler_is_delivered_in_order_inline() -> None:
    # [None] is no batch (strings would be keys, passed to dataset[key] as torch does)
    plan: list[Any] = [[0, 1], [2, 3], [None], [4, 5]]
    with DataLoader(WhereMade(8), batch_sampler=plan) as loader:
        it = iter(loader)
        assert [next(it).tolist() for _ in range(2)] == [[0, 1], [2, 3]]
        with pytest.raises(TypeError):
            next(it)
        assert list(it) == []


def test_two_epochs_at_once_each_run_whole_and_never_read_together() -> None:
    data = WhereMade(32, costly=frozenset({13}))
    with DataLoader(data, batch_size=4) as loader:
        pairs = list(zip(loader, loader, strict=True))
        assert [a.tolist() for a, _ in pairs] == [b.tolist() for _, b in pairs]
        assert flat([a for a, _ in pairs]) == list(range(32))
    assert data.most_at_once == 1


def test_a_loader_closed_under_an_inline_iterator_ends_it() -> None:
    loader = DataLoader(WhereMade(16), batch_size=4)
    it = iter(loader)
    assert next(it).tolist() == [0, 1, 2, 3]
    loader.close()
    started = time.monotonic()
    with pytest.raises((StopIteration, RuntimeError)):
        next(it)
    assert time.monotonic() - started < BOUND_S


# -- async for: the consumer makes the batches on the loop ------------------------------------
# Once batches proved cheap, the scheduler parks and the consumer makes each batch itself in
# __anext__ (no task, permit or future per batch), giving the loop a turn every LOOP_TURN_S.

PARKED_FROM = 4 * (INLINE_AFTER + 4)  # an index whose batch comes after the scheduler parked


async def test_a_costly_batch_after_the_consumer_took_over_sends_the_next_to_the_thread() -> None:
    back = 128 + 4 * INLINE_AFTER * 16  # the stall asks for 16 times the cheap run
    n = back + 4 * 8
    data = WhereMade(n, costly=frozenset({120}))
    async with DataLoader(data, batch_size=4) as loader:
        assert as_lists([b async for b in loader]) == expected_batches(n, 4)
    loop_thread = threading.current_thread().name
    before = [data.threads[i] for i in range(PARKED_FROM, 120)]
    assert before.count(loop_thread) > len(before) * 0.9
    assert made_by(data, range(124, 128)) == {HELPER}  # the batch after the costly one
    # Cheap again, but it stalled the loop: not back after INLINE_AFTER cheap batches...
    assert made_by(data, range(128, 128 + 4 * INLINE_AFTER * 2)) == {HELPER}
    # ... only after 16 times as many.
    assert data.threads[n - 1] == loop_thread
    assert data.most_at_once == 1


async def test_the_loop_gets_turns_while_the_consumer_makes_cheap_batches() -> None:
    ticks: list[float] = []
    stop = False

    async def ticker() -> None:
        while not stop:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0)

    data = WhereMade(4 * 8000)
    async with DataLoader(data, batch_size=4) as loader:
        task = asyncio.ensure_future(ticker())
        taken = 0
        half = 0.0
        async for _ in loader:  # never awaits anything else: only the loader gives turns
            taken += 1
            if taken == 4000:
                half = time.perf_counter()  # long after the consumer took over
        ended = time.perf_counter()
        stop = True
        await asyncio.wait_for(task, BOUND_S)
    assert taken == 8000
    assert made_by(data, range(4 * 4000, 4 * 8000)) == {threading.current_thread().name}
    # A turn every LOOP_TURN_S of making: tens in the second half (which takes tens of ms at
    # least); none if the consumer never yielded.
    second_half = [t for t in ticks if half <= t <= ended]
    assert len(second_half) >= 10, (len(second_half), ended - half)


async def test_a_state_taken_mid_epoch_on_the_loop_resumes_exactly() -> None:
    def loader() -> DataLoader:
        return DataLoader(WhereMade(200), batch_size=4, shuffle=True, seed=11)

    async with loader() as whole:
        expected = as_lists([b async for b in whole])
    async with loader() as first:
        it = aiter(first)
        head = as_lists([await anext(it) for _ in range(30)])  # well past the take-over
        state = first.state_dict()
    async with loader() as second:
        second.load_state_dict(state)
        rest = as_lists([b async for b in second])
    assert head + rest == expected


async def test_an_exit_in_the_dataset_on_the_loop_is_that_batchs_error_and_the_epoch_goes_on() -> (
    None
):
    class ExitAt(WhereMade):
        def __getitem__(self, index: int) -> int:
            if index == 101:
                raise SystemExit(3)
            return super().__getitem__(index)

    data = ExitAt(120)
    async with DataLoader(data, batch_size=4) as loader:
        it = aiter(loader)
        got = [(await anext(it)).tolist() for _ in range(25)]
        with pytest.raises(WorkerError, match="SystemExit") as info:
            await anext(it)
        assert "batch 25" in str(info.value)
        got += [b.tolist() async for b in it]
    assert data.threads[100] == threading.current_thread().name  # made on the loop
    assert got == [b for b in expected_batches(120, 4) if 101 not in b]


async def test_ctrl_c_in_the_dataset_on_the_loop_ends_the_epoch_and_the_next_starts_whole() -> None:
    data = WhereMade(120, interrupt=101)
    async with DataLoader(data, batch_size=4) as loader:
        it = aiter(loader)
        for _ in range(25):
            await anext(it)
        with pytest.raises(KeyboardInterrupt):
            await anext(it)
        with pytest.raises(StopAsyncIteration):
            await anext(it)
        assert flat([b async for b in loader]) == list(range(120))


async def test_two_async_epochs_at_once_run_whole_and_never_read_together() -> None:
    data = WhereMade(400, costly=frozenset({150, 301}))
    async with DataLoader(data, batch_size=4) as loader:
        a, b = aiter(loader), aiter(loader)
        pairs = [(await anext(a), await anext(b)) for _ in range(100)]
        for it in (a, b):
            with pytest.raises(StopAsyncIteration):
                await anext(it)
    assert [x.tolist() for x, _ in pairs] == [y.tolist() for _, y in pairs]
    assert flat([x for x, _ in pairs]) == list(range(400))
    assert data.most_at_once == 1


async def test_while_a_thread_makes_a_batch_the_consumer_leaves_the_next_to_the_scheduler() -> None:
    data = Gated(200)
    async with DataLoader(data, batch_size=4) as loader:
        it = aiter(loader)
        got = [(await anext(it)).tolist() for _ in range(20)]  # the consumer took over
        # Another epoch of this loader, iterated with `for` in a thread of its own, makes its
        # batches in that thread: it holds the maker while it reads index GATED (batch 15).
        data.gate.clear()
        data.entered.clear()
        other: list[int] = []

        def other_epoch() -> None:
            sync = iter(loader)
            try:
                for batch in sync:
                    other.extend(batch.tolist())
                    if GATED in other:
                        return
            finally:
                sync.close()

        reader = threading.Thread(target=other_epoch, name="other-epoch")
        reader.start()
        try:
            assert await asyncio.to_thread(data.entered.wait, BOUND_S)
            nxt = asyncio.ensure_future(anext(it))
            await asyncio.sleep(0.05)  # the loop runs: it never waits for the maker
            assert not nxt.done()
        finally:
            data.gate.set()
            await asyncio.to_thread(reader.join, BOUND_S)
        assert not reader.is_alive()
        assert other == list(range(GATED + 1))
        got.append((await asyncio.wait_for(nxt, BOUND_S)).tolist())
        got += [b.tolist() async for b in it]
    assert got == expected_batches(200, 4)
    assert data.threads[GATED] == "other-epoch"  # the maker was held where the test says
    assert data.threads[80] == HELPER  # made by the scheduler's thread once the maker was free
    assert data.most_at_once == 1


@pytest.mark.parametrize("batches", [1, 2, 5, 6, 7, 12])
async def test_taking_len_batches_on_the_loop_ends_each_epoch_without_a_last_next(
    batches: int,
) -> None:
    # As Lightning counts: len(loader) batches and no further __anext__. Whether the scheduler
    # parks at the last batch (a warm loader's one-batch epoch, or an epoch that ends just as
    # its batches prove cheap), the epoch ends at that batch: done, and the state says so.
    async with DataLoader(WhereMade(4 * batches), batch_size=4, seed=3) as loader:
        for epoch in range(INLINE_AFTER + 2):
            it = aiter(loader)
            for _ in range(len(loader)):
                await anext(it)
            state = loader.state_dict()
            assert state["epoch"] == epoch + 1, (epoch, state)
            assert state["done"] == [], (epoch, state)
            del it
