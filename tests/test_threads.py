"""The thread runner (_threads) and its small pool: results, errors, cancellation, streams, and
closing with a stuck job."""

from __future__ import annotations

import asyncio
import threading

import pytest
from datasets import Stream

from aioloader._batch._collate import default_collate
from aioloader._batch._make import BatchMaker
from aioloader._threads import _runner as _threads
from aioloader._threads._runner import ThreadPool, ThreadRunner
from aioloader._types import END, BatchRequest, StreamRequest

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")


async def test_results_and_errors_reach_the_awaiting_task() -> None:
    threads = ThreadPool(2)
    try:
        assert await threads.run(lambda x: x * 2, 21) == 42
        with pytest.raises(KeyError, match="missing"):
            await threads.run(lambda key: dict[str, int]()[key], "missing")
    finally:
        assert threads.close(5.0) == []


async def test_a_job_cancelled_before_it_starts_never_runs() -> None:
    threads = ThreadPool(1)
    gate = threading.Event()
    ran: list[str] = []
    try:
        first = threads.run(lambda _: gate.wait(5.0), None)  # occupies the only thread
        second = threads.run(ran.append, "second")
        second.cancel()
        gate.set()
        assert await first is True
        result: object = await threads.run(ran.append, "third")
        assert result is None
        assert ran == ["third"]
    finally:
        gate.set()
        assert threads.close(5.0) == []


class Gated:
    """A dataset whose reads wait for a gate."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.reading = threading.Event()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        self.reading.set()
        self.gate.wait(10.0)
        return i


async def test_a_pool_stops_only_while_idle_and_then_refuses_jobs() -> None:
    threads = ThreadPool(1)
    gate = threading.Event()
    try:
        held = threads.run(lambda _: gate.wait(5.0), None)
        queued = threads.run(lambda x: x, "queued")
        assert not threads.stop_if_idle()  # one job runs, one waits
        gate.set()
        assert await held
        assert await queued == "queued"
        # A job is counted done before its result is posted: whoever has the last result
        # finds the pool idle at once (a race the loader's in-place close depends on).
        for i in range(200):
            assert await threads.run(lambda x: x, i) == i
            assert threads.idle
        assert threads.stop_if_idle()
        with pytest.raises(RuntimeError, match="closed"):
            threads.run(lambda x: x, "late")  # no job slips in after the pool said yes
    finally:
        gate.set()
        assert threads.close(5.0) == []


async def test_closing_names_a_thread_stuck_in_user_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_threads, "THREAD_JOIN_TIMEOUT_S", 0.1)
    dataset = Gated()
    runner = ThreadRunner(BatchMaker(dataset, default_collate), threads=1)
    request = BatchRequest(0, 0, [0, 1])
    stuck = runner.start_make(request)
    await asyncio.to_thread(dataset.reading.wait, 5.0)
    assert runner.is_running(request)
    assert not runner.is_running(BatchRequest(1, 0, [0, 1]))  # the same batch id, another epoch
    try:
        with pytest.warns(ResourceWarning, match=r"1 loader thread\(s\) still run user code"):
            runner.close()
    finally:
        dataset.gate.set()
        assert (await stuck).batch.tolist() == [0, 1]


async def test_a_stream_is_cut_into_batches_then_ends() -> None:
    runner = ThreadRunner(BatchMaker(Stream(5), default_collate), threads=1)
    try:
        got = []
        for batch_id in range(4):
            made = await runner.pull(StreamRequest(0, batch_id, 2, drop_last=False), 0)
            got.append(made.batch if made.batch is END else made.batch.tolist())
        assert got == [[0, 1], [2, 3], [4], END]
        # a new epoch reads the stream afresh
        made = await runner.pull(StreamRequest(1, 0, 2, drop_last=True), 0)
        assert made.batch.tolist() == [0, 1]
    finally:
        runner.close()


async def test_a_failed_stream_delivers_what_it_read_then_its_error() -> None:
    runner = ThreadRunner(BatchMaker(Stream(10, fail_at=3), default_collate), threads=1)
    try:
        first = await runner.pull(StreamRequest(0, 0, 2, drop_last=True), 0)
        assert first.batch.tolist() == [0, 1]
        partial = await runner.pull(StreamRequest(0, 1, 2, drop_last=True), 0)
        assert partial.batch.tolist() == [2]  # short, but never dropped: the stream failed
        with pytest.raises(OSError, match="stream broke at item 3"):
            await runner.pull(StreamRequest(0, 2, 2, drop_last=True), 0)
        ended = await runner.pull(StreamRequest(0, 3, 2, drop_last=True), 0)
        assert ended.batch is END  # a failed stream ends for good: no repeated samples
    finally:
        runner.close()
