"""The device stage stages large pageable batches on its own thread, not on the event loop.

Measured on an H100 host, a 128 MB pageable batch staged inside ``start()`` held the loop for
~250 ms (p99 lag of a 1 ms timer, ``benchmarks/gpu_transfer.py``). These tests use the fake
backend of ``test_device`` with a slow ``to_device`` standing in for a slow memcpy.
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
from test_device import FakeBackend, assert_same_values

from aioloader._device import DeviceStage, Transfer
from aioloader._device._stage import OFF_LOOP_STAGING_BYTES
from aioloader._errors import TransferError


class ThreadedBackend(FakeBackend):
    """Records which thread enqueued each copy; each copy can take ``copy_s`` of CPU."""

    def __init__(self, copy_s: float = 0.0) -> None:
        super().__init__()
        self.copy_s = copy_s
        self.threads: list[str] = []

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.threads.append(threading.current_thread().name)
        if self.copy_s:
            time.sleep(self.copy_s)
        return super().to_device(tensor, device)


def large_batch(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    n = OFF_LOOP_STAGING_BYTES // 4 + 1024  # just over the threshold, in float32
    return {"x": torch.randn(n, generator=g), "label": seed}


async def fire_until_done(backend: FakeBackend, *transfers: Transfer) -> None:
    """Complete the fake device's work as the stage thread enqueues it, until all are done."""
    for _ in range(2000):
        if backend.side is not None:
            for event in backend.side.events:
                event.fire()
        if all(t.done() for t in transfers):
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the copies never completed")


async def test_a_large_batch_is_enqueued_on_the_stage_thread_a_small_one_inline() -> None:
    backend = ThreadedBackend()
    stage = DeviceStage("cuda", backend=backend)
    small = {"x": torch.randn(16)}
    t_small = stage.start(small, 0)
    assert backend.threads == [threading.current_thread().name]
    batch = large_batch(1)
    t_large = stage.start(batch, 1)
    await fire_until_done(backend, t_small, t_large)
    assert_same_values(batch, await t_large.wait())
    assert_same_values(small, await t_small.wait())
    assert backend.threads[1].startswith("aioloader-stage")
    stage.close()


async def test_a_slow_staging_copy_does_not_hold_the_loop() -> None:
    backend = ThreadedBackend(copy_s=0.3)
    stage = DeviceStage("cuda", backend=backend)
    lags: list[float] = []
    period = 0.005

    async def ticker() -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(period)
            lags.append(time.monotonic() - before - period)

    tick_task = asyncio.create_task(ticker())
    await asyncio.sleep(period * 2)
    batch = large_batch(2)
    started = time.monotonic()
    transfer = stage.start(batch, 0)
    returned = time.monotonic() - started
    await fire_until_done(backend, transfer)
    result = await transfer.wait()
    tick_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await tick_task
    assert_same_values(batch, result)
    # Inline, start() itself would have taken the whole 300 ms and the ticker would have
    # missed it all.
    assert returned < 0.1
    assert len(lags) >= 20
    assert max(lags) < 0.15
    stage.close()


async def test_large_batches_are_enqueued_in_start_order() -> None:
    backend = ThreadedBackend(copy_s=0.01)
    stage = DeviceStage("cuda", backend=backend)
    batches = [large_batch(i) for i in range(4)]
    transfers = [stage.start(b, i) for i, b in enumerate(batches)]
    await fire_until_done(backend, *transfers)
    for batch, transfer in zip(batches, transfers, strict=True):
        assert_same_values(batch, await transfer.wait())
    sources = [entry[2] for entry in backend.entries("copy")]
    offsets = [backend.staging_of(ptr) for ptr in sources]
    assert None not in offsets
    # One thread enqueues in start order: the same order as the batches' ids.
    assert len(sources) == 4
    stage.close()


async def test_a_failure_on_the_stage_thread_arrives_at_wait_naming_the_batch() -> None:
    backend = ThreadedBackend()
    backend.fail_copy_at = 1
    stage = DeviceStage("cuda", backend=backend)
    batch = large_batch(3)
    leaf_ref = weakref.ref(batch["x"])
    transfer = stage.start(batch, 17)  # the failure happens off the caller's thread
    del batch
    with pytest.raises(TransferError, match=r"batch 17\b.*injected copy failure") as info:
        await asyncio.wait_for(transfer.wait(), 10)
    assert isinstance(info.value.__cause__, RuntimeError)
    # The error keeps no reference to the host batch. The stage thread's executor drops its
    # work item (the job's arguments) only just after it failed the job's future: a moment.
    for _ in range(100):  # bounded: 1 s
        gc.collect()
        if leaf_ref() is None:
            break
        await asyncio.sleep(0.01)
    assert leaf_ref() is None
    assert stage.stats().in_flight == 0
    # The failed batch's buffer retires behind an event (a copy may have been enqueued) and
    # comes back once that event completes: two batches later, nothing new is allocated.
    backend.fail_copy_at = None
    for batch_id in (18, 19):
        batch2 = large_batch(batch_id)
        t2 = stage.start(batch2, batch_id)
        await fire_until_done(backend, t2)
        assert_same_values(batch2, await t2.wait())
    allocs = backend.allocs
    t3 = stage.start(large_batch(20), 20)
    await fire_until_done(backend, t3)
    assert backend.allocs == allocs
    del info
    stage.close()


async def test_close_waits_for_the_stage_thread_and_the_batch_still_arrives() -> None:
    backend = ThreadedBackend(copy_s=0.1)
    backend.auto_complete_after = 1
    stage = DeviceStage("cuda", backend=backend)
    batch = large_batch(5)
    transfer = stage.start(batch, 0)
    stage.close()  # blocks while the thread stages and enqueues, then settles the copy
    assert transfer.done()
    assert_same_values(batch, await transfer.wait())
    stage.close()
