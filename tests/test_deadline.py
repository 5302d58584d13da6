"""The batch deadline and retries (_deadline), against a fake runner and an injected clock.

The runner is a fake (it only says whether a batch is running and records kills); the attempts
are plain futures the test completes. The clock for elapsed times is injected, so the figures in
errors are exact; the deadline's own wake-ups use the loop's timer, on a loop whose clock skips
idle waits (``loop_time``): a deadline of seconds passes in no real time. The last tests take
the same contract through a loader, on its helper thread: a slow consumer and an async item
that never arrives on that loop too (it waits briefly, really, for the thread before it skips),
and one real hung read caught by a real deadline of a few tenths of a second.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from datasets import HangAt, Range
from helpers import BOUND_S, as_lists, expected_batches, take
from loop_time import THREAD_GRACE_S, run_skipping

import aioloader
from aioloader import DataLoader, LoaderTimeoutError, WorkerCrashedError
from aioloader._epoch._deadline import LOOKS, DeadlinePolicy, run_attempts, timeout_error
from aioloader._stats._counters import Counters
from aioloader._types import BatchRequest, Made, StreamRequest

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

TICK = 0.01  # the deadline used where none passes
DEADLINE_S = 2.0  # the deadline used where one passes: on the skipping loop, no real time


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0  # every reading is one "second" later
        return self.now


class FakeRunner:
    """Says a batch is running (or only queued) and records which batches were killed."""

    inline = None  # every batch is made by the runner

    def __init__(self, running: bool = True) -> None:
        self.running = running
        self.killed: list[int] = []

    @property
    def streams(self) -> int:
        return 1

    @property
    def restarts(self) -> int:
        return 0

    @property
    def shm_fallbacks(self) -> int:
        return 0

    def start(self) -> None:
        pass

    def worker_pids(self) -> tuple[int, ...]:
        return ()

    def shm_stats(self) -> None:
        return None

    @property
    def has_copy(self) -> bool:
        return True

    def load(self, make: Callable[[], Any], epoch: int, seed: int) -> None:
        pass

    def begin_epoch(self) -> None:
        pass

    def stop_if_idle(self) -> bool:
        return False

    def start_make(self, request: BatchRequest) -> asyncio.Future[Made]:
        raise NotImplementedError

    async def pull(self, request: StreamRequest, stream: int) -> Made:
        raise NotImplementedError

    def is_running(self, request: BatchRequest | StreamRequest) -> bool:
        return self.running

    def on_deadline(self, request: BatchRequest | StreamRequest) -> int | None:
        self.killed.append(request.batch_id)
        return 4242

    def close(self) -> None:
        pass


def attempts(*behaviours: str) -> tuple[Callable[[], Awaitable[Made]], list[int]]:
    """An attempt function whose n-th call does ``behaviours[n]``: 'ok', 'crash', 'hang',
    'error'. Returns it and the list of calls made."""
    calls: list[int] = []

    async def attempt() -> Made:
        calls.append(len(calls))
        what = behaviours[min(len(calls) - 1, len(behaviours) - 1)]
        if what == "ok":
            return Made(batch=f"batch-{len(calls)}", samples=3)
        if what == "crash":
            raise WorkerCrashedError("worker 0 (pid 1) was killed by SIGKILL", pid=1, exitcode=-9)
        if what == "error":
            raise KeyError("user's own")
        await asyncio.Event().wait()  # hangs until cancelled
        raise AssertionError("unreachable")

    return attempt, calls


async def run(
    attempt: Callable[[], Awaitable[Made]],
    runner: FakeRunner,
    policy: DeadlinePolicy,
    counters: Counters,
    retry: bool = True,
) -> Made:
    return await asyncio.wait_for(
        run_attempts(
            attempt,
            request=BatchRequest(0, 7, [1, 2, 3]),
            describe=lambda: "indices [1, 2, 3]",
            runner=runner,
            policy=policy,
            counters=counters,
            retry=retry,
        ),
        timeout=10,
    )


async def test_no_deadline_no_retry_returns_the_made_batch() -> None:
    attempt, calls = attempts("ok")
    made = await run(attempt, FakeRunner(), DeadlinePolicy(None, 0), Counters())
    assert made.batch == "batch-1"
    assert calls == [0]


async def test_a_crash_is_annotated_with_the_batch_and_not_retried_without_max_retries() -> None:
    attempt, calls = attempts("crash", "ok")
    counters = Counters()
    with pytest.raises(WorkerCrashedError) as info:
        await run(attempt, FakeRunner(), DeadlinePolicy(None, 0), counters)
    assert "batch 7: indices [1, 2, 3]" in info.value.__notes__
    assert calls == [0]
    assert counters.retries == 0


async def test_crashes_are_retried_up_to_max_retries() -> None:
    attempt, calls = attempts("crash", "crash", "ok")
    counters = Counters()
    made = await run(attempt, FakeRunner(), DeadlinePolicy(None, 2), counters)
    assert made.batch == "batch-3"
    assert counters.retries == 2
    attempt, calls = attempts("crash", "crash", "crash", "ok")
    with pytest.raises(WorkerCrashedError):
        await run(attempt, FakeRunner(), DeadlinePolicy(None, 2), Counters())
    assert calls == [0, 1, 2]


async def test_a_stream_batch_is_never_retried() -> None:
    attempt, calls = attempts("crash", "ok")
    with pytest.raises(WorkerCrashedError):
        await run(attempt, FakeRunner(), DeadlinePolicy(None, 3), Counters(), retry=False)
    assert calls == [0]


async def test_the_users_error_is_raised_unchanged_and_never_retried() -> None:
    attempt, calls = attempts("error", "ok")
    with pytest.raises(KeyError, match="user's own"):
        await run(attempt, FakeRunner(), DeadlinePolicy(TICK, 3), Counters())
    assert calls == [0]


def test_a_hung_running_batch_times_out_its_worker_killed_and_named() -> None:
    attempt, _calls = attempts("hang")
    runner = FakeRunner(running=True)
    counters = Counters()
    clock = FakeClock()

    async def main() -> tuple[LoaderTimeoutError, float]:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(LoaderTimeoutError) as info:
            await run(attempt, runner, DeadlinePolicy(DEADLINE_S, 0, clock=clock), counters)
        return info.value, loop.time() - started

    error, took = run_skipping(main())
    message = str(error)
    assert "batch 7 (indices [1, 2, 3])" in message
    assert "after 1.00 s" in message  # two readings of the fake clock, one second apart
    assert "worker pid 4242 was killed and replaced" in message
    assert isinstance(error, TimeoutError)
    assert runner.killed == [7]
    assert counters.timeouts == 1
    # Stopped once it ran its whole deadline, counted from the first look that saw it running,
    # and at most two looks later (the _deadline module's promise).
    assert DEADLINE_S <= took <= DEADLINE_S * (1 + 2 / LOOKS) + 0.01


def test_a_hung_batch_is_retried_then_succeeds() -> None:
    attempt, calls = attempts("hang", "ok")
    runner = FakeRunner(running=True)
    counters = Counters()
    made = run_skipping(run(attempt, runner, DeadlinePolicy(DEADLINE_S, 1), counters))
    assert made.batch == "batch-2"
    assert (counters.timeouts, counters.retries, runner.killed) == (1, 1, [7])
    assert calls == [0, 1]


def test_time_queued_behind_another_batch_does_not_count() -> None:
    """While the runner says the batch is only queued, its deadline starts again."""
    runner = FakeRunner(running=False)

    async def main() -> Made:
        gate: asyncio.Future[Made] = asyncio.get_running_loop().create_future()

        async def attempt() -> Made:
            return await gate

        task = asyncio.ensure_future(run(attempt, runner, DeadlinePolicy(TICK, 0), Counters()))
        await asyncio.sleep(TICK * 10)  # ten deadlines pass while queued
        assert not task.done()
        assert runner.killed == []
        gate.set_result(Made(batch="late but fine"))
        return await task

    assert run_skipping(main()).batch == "late but fine"


def test_a_batch_that_began_late_gets_its_whole_deadline_once_running() -> None:
    """Queued for most of a deadline, then running for less than one: not timed out (a look
    that found it running just after it began must not count the time it was queued)."""
    runner = FakeRunner(running=False)

    async def main() -> Made:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[Made] = loop.create_future()
        loop.call_later(0.3, setattr, runner, "running", True)  # begins at 0.3 s
        loop.call_later(0.6, gate.set_result, Made(batch="ran 0.3 s of its 0.5 s"))

        async def attempt() -> Made:
            return await gate

        return await run(attempt, runner, DeadlinePolicy(0.5, 0), Counters())

    made = run_skipping(main())
    assert made.batch == "ran 0.3 s of its 0.5 s"
    assert runner.killed == []


async def test_cancelling_the_wait_cancels_the_attempt() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def attempt() -> Made:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    task = asyncio.ensure_future(run(attempt, FakeRunner(), DeadlinePolicy(5.0, 0), Counters()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(cancelled.wait(), 5)


def test_timeout_error_says_what_to_try() -> None:
    error = timeout_error(3, "the stream of worker 1", 2.5, 2.0, None)
    assert isinstance(error, LoaderTimeoutError)
    assert "batch 3 (the stream of worker 1) was not ready after 2.50 s (timeout=2.0)" in str(error)
    assert "killed" not in str(error)
    assert "max_retries" in str(error)


# -- through the loader -----------------------------------------------------------------------


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


def test_a_slow_consumer_causes_no_timeout() -> None:
    async def main() -> None:
        async with DataLoader(Range(6), batch_size=2, timeout=0.2, prefetch=2) as loader:
            got = []
            async with asyncio.timeout(BOUND_S):
                async for batch in loader:
                    got.append(batch.tolist())
                    await asyncio.sleep(1.0)  # five times the timeout, between batches
            assert got == expected_batches(6, 2)
            assert loader.statistics().timeouts == 0

    run_skipping(main(), grace_s=THREAD_GRACE_S)


class NeverArrives:
    def __init__(self, n: int, stuck: int) -> None:
        self.n, self.stuck = n, stuck

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> int:
        if i == self.stuck:
            await asyncio.sleep(3600)
        return i


def test_an_async_item_that_never_arrives_misses_its_batch_deadline() -> None:
    async def main() -> None:
        loader = DataLoader(NeverArrives(8, stuck=5), batch_size=4, timeout=5.0)
        async with loader, asyncio.timeout(BOUND_S * 10):  # loop time: 2 deadlines and more
            it = aiter(loader)
            assert (await anext(it)).tolist() == [0, 1, 2, 3]
            with pytest.raises(
                LoaderTimeoutError, match=r"batch 1 \(fetching indices \[4, 5, 6, 7\]\)"
            ):
                await anext(it)
            assert loader.statistics().timeouts == 1
            # The loader stays usable: the next epoch delivers, then misses the same deadline.
            again = aiter(loader)
            assert (await anext(again)).tolist() == [0, 1, 2, 3]
            with pytest.raises(TimeoutError):  # LoaderTimeoutError is also a TimeoutError
                await anext(again)

    run_skipping(main(), grace_s=THREAD_GRACE_S)
