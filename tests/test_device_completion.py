"""The device stage learns of finished copies from its completion thread: no polling, no timer.

These tests run on the CPU with ``device_fakes.ThreadFake``: its events complete when a test
(or another thread) fires them, and the stage's completion thread blocks on them as it blocks
in ``cudaEventSynchronize`` on a GPU.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
from device_fakes import ThreadedEvent, ThreadFake
from test_device import FakeEvent, assert_same_values, end_event, make_batch

from aioloader._device import DeviceStage
from aioloader._errors import TransferError

COMPLETION_THREAD = "aioloader-copy-done"


def completion_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == COMPLETION_THREAD]


def fire_later(event: FakeEvent, delay: float) -> threading.Thread:
    """Complete ``event`` from another thread after ``delay`` seconds (no loop involved)."""

    def run() -> None:
        time.sleep(delay)
        event.fire()

    thread = threading.Thread(target=run, name="test-fires-event")
    thread.start()
    return thread


def forbid_timers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Forbid ``asyncio.sleep`` and the running loop's timers (from inside a test's loop);
    returns what tried to use one."""
    tried: list[str] = []
    loop = asyncio.get_running_loop()

    def timer(*args: Any, **kwargs: Any) -> Any:
        tried.append("timer")
        raise AssertionError("a timer on the completion path")

    async def sleep(delay: float, result: Any = None) -> Any:
        tried.append(f"sleep({delay})")
        raise AssertionError("a timer on the completion path")

    monkeypatch.setattr(loop, "call_later", timer)
    monkeypatch.setattr(loop, "call_at", timer)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    return tried


async def test_a_copy_completed_from_another_thread_wakes_the_task_without_any_timer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = ThreadFake()
    stage = DeviceStage("cuda", backend=backend)
    batch = make_batch(1)
    transfer = stage.start(batch, 0)
    end = end_event(backend)
    assert isinstance(end, ThreadedEvent)
    tried = forbid_timers(monkeypatch)
    firing = fire_later(end, 0.05)
    started = time.perf_counter()
    result = await transfer.wait()
    waited = time.perf_counter() - started
    firing.join()
    monkeypatch.undo()
    assert tried == []
    assert_same_values(batch, result)
    assert waited >= 0.04  # it did wait for the event, and was woken once it completed
    # One look at the event before suspending, none while suspended: no polling.
    assert end.queries <= 1
    assert backend.waited_from == [COMPLETION_THREAD]
    stats = stage.stats()
    assert stats.wakes == 1
    assert stats.waits == 1
    assert stats.wait_seconds >= 0.04
    # The wake latency: from the completion thread seeing the event to the task resuming.
    assert 0.0 < stats.wake_p50_s < 1.0
    assert stats.wake_p99_s >= stats.wake_p50_s
    stage.close()
    assert completion_threads() == []


async def test_copies_complete_in_start_order_and_each_batch_is_its_own() -> None:
    backend = ThreadFake()
    stage = DeviceStage("cuda", backend=backend)
    batches = [make_batch(10 + i) for i in range(5)]
    transfers = [stage.start(b, i) for i, b in enumerate(batches)]
    ends = [e[1] for e in backend.entries("record")][1::2]  # start, end per batch
    assert len(ends) == 5
    # Completing copy 2 completes 0 and 1 too (one stream, in order); 3 and 4 stay pending.
    firing = fire_later(ends[2], 0.0)
    assert_same_values(batches[2], await transfers[2].wait())
    firing.join()
    assert all(t.done() for t in transfers[:3])
    assert not transfers[3].done()
    assert not transfers[4].done()
    assert stage.stats().in_flight == 2
    firing = fire_later(ends[4], 0.01)
    results = [await t.wait() for t in transfers]
    firing.join()
    for batch, result in zip(batches, results, strict=True):
        assert_same_values(batch, result)
    stage.close()  # ends the completion thread once it has seen every event
    assert backend.waited_from == [COMPLETION_THREAD] * 5


async def test_a_cancelled_wait_loses_nothing_and_a_later_wait_is_woken() -> None:
    backend = ThreadFake()
    stage = DeviceStage("cuda", backend=backend)
    batch = make_batch(20)
    transfer = stage.start(batch, 0)
    task = asyncio.create_task(transfer.wait())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not transfer.done()
    assert backend.entries("wait_event") == []  # nothing was handed over
    firing = fire_later(end_event(backend), 0.02)
    assert_same_values(batch, await transfer.wait())
    firing.join()
    stage.close()
    assert completion_threads() == []


async def test_close_mid_copy_settles_it_ends_the_thread_and_the_batch_still_arrives() -> None:
    backend = ThreadFake()
    stage = DeviceStage("cuda", backend=backend)
    batches = [make_batch(30 + i) for i in range(3)]
    transfers = [stage.start(b, i) for i, b in enumerate(batches)]
    waiter = asyncio.create_task(transfers[0].wait())
    await asyncio.sleep(0.01)
    assert len(completion_threads()) == 1
    assert not waiter.done()
    stage.close()  # synchronizes the copies in flight on this thread, then ends the thread
    assert completion_threads() == []
    stats = stage.stats()
    assert stats.in_flight == 0
    assert stats.staging_buffers == 0
    assert stats.ring_slots == 0
    assert_same_values(batches[0], await asyncio.wait_for(waiter, 5))
    for batch, transfer in zip(batches[1:], transfers[1:], strict=True):
        assert transfer.done()
        assert_same_values(batch, await transfer.wait())
    with pytest.raises(RuntimeError, match="closed"):
        stage.start(batches[0], 9)


async def test_a_device_fault_seen_by_the_completion_thread_fails_that_batch() -> None:
    backend = ThreadFake()

    def failing_waiter() -> Any:
        def wait(event: ThreadedEvent) -> None:
            raise RuntimeError("injected device fault")

        return wait

    backend.event_waiter = failing_waiter  # type: ignore[method-assign]
    stage = DeviceStage("cuda", backend=backend)
    transfer = stage.start(make_batch(40), 7)
    with pytest.raises(TransferError, match=r"batch 7\b.*injected device fault"):
        await asyncio.wait_for(transfer.wait(), 5)
    stats = stage.stats()
    assert stats.in_flight == 0
    assert stats.ring_slots == 0  # the failed copy's slot is never reused
    assert stats.staging_buffers == 0  # nor its staging buffer
    stage.close()
    assert completion_threads() == []


async def test_drain_is_woken_by_the_completion_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = ThreadFake()
    stage = DeviceStage("cuda", backend=backend)
    transfers = [stage.start(make_batch(50 + i), i) for i in range(3)]
    tried = forbid_timers(monkeypatch)
    firing = fire_later(end_event(backend), 0.02)  # the last: completes all three
    await stage.drain()
    firing.join()
    monkeypatch.undo()
    assert tried == []
    assert all(t.done() for t in transfers)
    assert stage.stats().in_flight == 0
    stage.close()


async def test_the_counters_of_a_pageable_batch_a_pinned_one_and_a_registered_one() -> None:
    backend = ThreadFake(auto_fire=True)
    stage = DeviceStage("cuda", backend=backend)
    pageable = {"x": torch.arange(1024, dtype=torch.float32)}  # 4096 bytes, staged
    await stage.start(pageable, 0).wait()
    stats = stage.stats()
    assert stats.staged_bytes == 4096
    assert stats.bytes_copied == 4096
    # Collated into the stage's pinned memory: copied directly, nothing staged.
    array = stage.host_alloc((32, 8), torch.zeros(0, dtype=torch.float64).numpy().dtype)
    array[:] = 1.5
    pinned = {"x": torch.from_numpy(array), "n": array}
    out = await stage.start(pinned, 1).wait()
    assert_same_values(pinned, out)
    stats = stage.stats()
    assert stats.staged_bytes == 4096
    assert stats.bytes_copied == 4096 + 2 * array.nbytes
    assert stats.batches_copied == 2
    assert stats.staged_bytes_per_batch == 2048
    assert stats.in_flight == 0
    stage.close()
