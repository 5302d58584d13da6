"""The thread runner's small pool: results, errors, cancellation, and closing with a stuck job."""

from __future__ import annotations

import asyncio
import threading

import pytest

from aioloader import _runner


async def test_results_and_errors_reach_the_awaiting_task() -> None:
    threads = _runner._Threads(2)
    try:
        assert await threads.run(lambda x: x * 2, 21) == 42
        with pytest.raises(KeyError, match="missing"):
            await threads.run(lambda key: {}[key], "missing")
    finally:
        assert threads.close(5.0) == []


async def test_a_job_cancelled_before_it_starts_never_runs() -> None:
    threads = _runner._Threads(1)
    gate, ran = threading.Event(), []
    try:
        first = threads.run(lambda _: gate.wait(5.0), None)  # occupies the only thread
        second = threads.run(ran.append, "second")
        second.cancel()
        gate.set()
        assert await first is True
        assert await threads.run(ran.append, "third") is None
        assert ran == ["third"]
    finally:
        gate.set()
        assert threads.close(5.0) == []


async def test_closing_names_a_thread_stuck_in_user_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runner, "THREAD_JOIN_TIMEOUT_S", 0.1)
    gate = threading.Event()
    runner = _runner.ThreadRunner(maker=None, threads=1)  # type: ignore[arg-type]
    stuck = runner._threads.run(lambda _: gate.wait(10.0), None)
    await asyncio.sleep(0.05)
    try:
        with pytest.warns(ResourceWarning, match=r"1 loader thread\(s\) still run user code"):
            runner.close()
    finally:
        gate.set()
        await stuck
