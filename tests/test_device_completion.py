"""The device stage learns of finished copies from its completion thread: no polling, no timer.

These tests run on the CPU with ``device_fakes.ThreadFake``: its events complete when a test
(or another thread) fires them, and the stage's completion thread blocks on them as it blocks
in ``cudaEventSynchronize`` on a GPU.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from typing import Any

import pytest
import torch
from device_fakes import ThreadedEvent, ThreadFake
from test_device import FakeEvent, assert_same_values, end_event, make_batch

from aioloader._device import DeviceStage
from aioloader._device._stage import OFF_LOOP_STAGING_BYTES
from aioloader._errors import TransferError

COMPLETION_THREAD = "aioloader-copy-done"
# A hand-off (completion thread -> task resumed) takes 0.1-0.3 ms on a loaded 2-core machine,
# now and then a few ms (the loop thread not scheduled): the median of several stays well under
# this, and a wake-up that waited for a timer tick (the old poll's back-off capped at 1 ms)
# would not.
HANDOFF_P50_BOUND_S = 1e-3
HANDOFF_SAMPLES = 9


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
    assert stats.handoffs == 1
    assert stats.waits == 1
    assert stats.wait_seconds >= 0.04
    # The hand-off: from the completion thread seeing the event to the task resuming (one
    # sample here; its bound near a timer tick is asserted over several below).
    assert 0.0 < stats.handoff_p50_s < 0.1
    assert stats.handoff_p99_s >= stats.handoff_p50_s
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
    stage = DeviceStage("cuda", backend=backend, ring_min_leaf_bytes=0)  # its leaves in a slot
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


async def test_drain_adds_nothing_to_the_consumers_wait_or_the_handoff_samples() -> None:
    backend = ThreadFake()
    stage = DeviceStage("cuda", backend=backend)
    transfers = [stage.start(make_batch(60 + i), i) for i in range(3)]
    firing = fire_later(end_event(backend), 0.02)
    await stage.drain()  # suspended ~20 ms: the stage's wait, not the consumer's
    firing.join()
    for transfer in transfers:
        await transfer.wait()  # complete already: never suspended
    stats = stage.stats()
    assert stats.waits == 0
    assert stats.wait_seconds == 0.0
    assert stats.handoffs == 0
    assert stats.handoff_p50_s == 0.0
    stage.close()


def big_batch(value: float) -> dict[str, torch.Tensor]:
    """A pageable batch large enough to be staged on the stage's thread."""
    return {"x": torch.full((OFF_LOOP_STAGING_BYTES // 4,), value)}


async def test_the_threads_of_a_stage_on_another_gpu_make_its_device_current_first() -> None:
    # On a fresh thread the current device is 0: a stage on cuda:1 whose threads did not make
    # their device current would create a context on GPU 0 (cudaEventSynchronize, copies).
    backend = ThreadFake(auto_fire=True)
    backend.devices = 2
    stage = DeviceStage("cuda:1", backend=backend)
    batches = [make_batch(80), big_batch(1.0), make_batch(81)]
    transfers = [stage.start(b, i) for i, b in enumerate(batches)]
    for batch, transfer in zip(batches, transfers, strict=True):
        assert_same_values(batch, await transfer.wait())
    stage.close()
    assert backend.waited_on == [(COMPLETION_THREAD, 1)] * 3
    # The staging thread enqueued the large batch (and the one behind it) on device 1.
    assert backend.copied_on
    assert all(device == 1 for _, device in backend.copied_on)
    threads = {name for name, _ in backend.copied_on}
    assert threads
    assert all(name.startswith("aioloader-stage") for name in threads)
    set_on = {(e[1], e[2]) for e in backend.entries("set_device")}
    assert set_on == {(COMPLETION_THREAD, 1)} | {(name, 1) for name in threads}


def test_a_stage_driven_from_a_thread_of_another_device_queries_its_events_on_its_own() -> None:
    # A sync `for` drives the stage from the loader's loop thread, whose current device is 0
    # (as any fresh thread's): querying or synchronizing a cuda:1 stage's events there would
    # create a context on GPU 0. Each such call runs under the stage's device, and the thread's
    # own device is left as it was.
    backend = ThreadFake(auto_fire=True)
    backend.devices = 2
    stage = DeviceStage("cuda:1", backend=backend)
    seen: dict[str, Any] = {}

    async def drive() -> None:
        batches = [make_batch(70 + i) for i in range(4)]
        transfers = [stage.start(b, i) for i, b in enumerate(batches)]
        for batch, transfer in zip(batches, transfers, strict=True):
            assert_same_values(batch, await transfer.wait())
        stage.close()

    def run() -> None:
        asyncio.run(drive())
        seen["device_after"] = backend.thread_device()

    thread = threading.Thread(target=run, name="driver")
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    calls = [device for name, device in backend.queried_on if name == "driver"]
    assert calls, backend.queried_on  # the driver did query (ring release events, close)
    assert set(calls) == {1}, backend.queried_on
    assert seen["device_after"] == 0


async def test_a_batch_started_while_a_large_one_is_staged_on_the_thread_is_enqueued_after_it() -> (
    None
):
    backend = ThreadFake(auto_fire=True)
    backend.hold = threading.Event()
    stage = DeviceStage("cuda", backend=backend)
    large, small = big_batch(2.0), make_batch(90)
    first = stage.start(large, 0)  # staged on the stage's thread, held at its copy
    second = stage.start(small, 1)  # small: inline, were the thread idle
    assert backend.entries("copy") == []  # nothing overtook the held large batch
    backend.hold.set()
    assert_same_values(small, await second.wait())
    assert_same_values(large, await first.wait())
    # On the side stream: the large batch's start event, copy and end event, then the small
    # one's; so its end event is also waited on, and completes, first.
    side = [
        ("copy", e[3]) if e[0] == "copy" else ("event", None)
        for e in backend.log
        if e[0] == "copy" or (e[0] == "record" and e[2] is backend.side)
    ]
    assert side[:4] == [
        ("event", None),
        ("copy", OFF_LOOP_STAGING_BYTES),
        ("event", None),
        ("event", None),
    ]
    assert len(side) == 8  # the small batch: three leaves between its two events
    stage.close()


async def test_a_stage_collected_unclosed_ends_its_completion_and_staging_threads() -> None:
    # The threads are told which device to make current without holding the stage itself.
    backend = ThreadFake(auto_fire=True)
    stage = DeviceStage("cuda", backend=backend)
    for i, batch in enumerate([big_batch(3.0), make_batch(95)]):
        await stage.start(batch, i).wait()
    threads = [t for t in threading.enumerate() if t.name.startswith("aioloader-")]
    assert {t.name.split("_")[0] for t in threads} == {COMPLETION_THREAD, "aioloader-stage"}
    collected = weakref.ref(stage)
    del stage
    for _ in range(100):  # the loop runs the completion callbacks the thread hands it (~1 s)
        await asyncio.sleep(0.01)
        gc.collect()
        if collected() is None:
            break
    assert collected() is None
    for thread in threads:
        thread.join(5.0)
        assert not thread.is_alive(), f"{thread.name} outlived its stage"


async def test_the_median_handoff_is_well_under_a_timer_tick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = ThreadFake()
    stage = DeviceStage("cuda", backend=backend)
    tried = forbid_timers(monkeypatch)
    # A wait counts as a handoff when the completion thread woke it. On busy cores the staging
    # thread can return after the event fired (5 ms on), and that wait finds the copy done
    # without sleeping: no handoff, rightly. Copies go on until HANDOFF_SAMPLES were handed
    # off (bounded).
    for i in range(4 * HANDOFF_SAMPLES):
        transfer = stage.start(make_batch(100 + i), i)
        firing = fire_later(end_event(backend), 0.005)
        await transfer.wait()
        firing.join()
        if stage.stats().handoffs == HANDOFF_SAMPLES:
            break
    monkeypatch.undo()
    assert tried == []
    stats = stage.stats()
    assert stats.handoffs == HANDOFF_SAMPLES
    assert 0.0 < stats.handoff_p50_s < HANDOFF_P50_BOUND_S
    assert stats.handoff_p99_s >= stats.handoff_p50_s
    stage.close()
