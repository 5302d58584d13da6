"""The device ring: a slot is reused only once its batch was let go and the consumer ran past it.

On the CPU with ``device_fakes.ThreadFake``: copies are deferred until an event after them
completes, and the consumer's release events complete only when a test fires them, so a slot
reused too early shows up as overwritten values or as a reuse the test forbade.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import numpy as np
import pytest
import torch
from device_fakes import ThreadFake
from hypothesis import HealthCheck, given, settings
from test_device import FakeStream, assert_same_values, make_batch, trees

from aioloader._device import DeviceStage
from aioloader._device._ring import MAX_RING_SLOTS, RING_MIN_LEAF_BYTES
from aioloader._device._stage import OFF_LOOP_STAGING_BYTES

# float32 values of a leaf just large enough to go into a ring slot
N = RING_MIN_LEAF_BYTES // 4


def storage_of(out: Any) -> int:
    return int(out["x"].untyped_storage().data_ptr())


def host(seed: int) -> dict[str, Any]:
    """Two leaves of RING_MIN_LEAF_BYTES each: both land in the batch's ring slot."""
    return {"x": torch.arange(N, dtype=torch.float32) + seed, "y": np.arange(N // 2) * seed}


async def test_a_slot_is_reused_only_after_its_batch_was_let_go_and_the_release_completed() -> None:
    backend = ThreadFake(consumer_done=False, auto_fire=True)
    stage = DeviceStage("cuda", backend=backend)
    out_a = await stage.start(host(1), 0).wait()
    slot_a = storage_of(out_a)
    # Ring leaves share the slot's storage: no record_stream for them.
    assert out_a["y"].untyped_storage().data_ptr() == slot_a
    assert backend.entries("record_stream") == []
    # Batch a is still referenced: b gets a slot of its own.
    out_b = await stage.start(host(2), 1).wait()
    assert storage_of(out_b) != slot_a
    del out_a  # let go: at the next start its release event is recorded on the consumer stream
    out_c = await stage.start(host(3), 2).wait()
    assert storage_of(out_c) not in (slot_a, storage_of(out_b))
    releases = backend.release_events()
    assert len(releases) == 1
    assert releases[0].stream is backend.default  # the stream it was handed to
    assert not releases[0].completed
    # Held incomplete, the release event keeps the slot from reuse.
    out_d = await stage.start(host(4), 3).wait()
    assert storage_of(out_d) != slot_a
    assert stage.stats().ring_slots == 4
    releases[0].fire()
    out_e = await stage.start(host(5), 4).wait()
    assert storage_of(out_e) == slot_a  # now, and only now, reused
    assert_same_values(host(5), out_e)
    for seed, out in ((2, out_b), (3, out_c), (4, out_d)):
        assert_same_values(host(seed), out)
    stage.close()


async def test_a_view_the_user_keeps_is_never_overwritten() -> None:
    backend = ThreadFake(consumer_done=True, auto_fire=True)
    stage = DeviceStage("cuda", backend=backend)
    out = await stage.start(host(7), 0).wait()
    kept = out["x"][100:110]  # a view of the slot: the batch itself goes
    del out
    for i in range(3 * MAX_RING_SLOTS):
        assert_same_values(host(10 + i), await stage.start(host(10 + i), 1 + i).wait())
    assert torch.equal(kept, torch.arange(100, 110, dtype=torch.float32) + 7)
    stats = stage.stats()
    # The kept slot and about one more for the rest: reused, not one per batch.
    assert stats.ring_slots <= 3
    assert backend.device_allocs == stats.ring_slots
    stage.close()


async def test_a_pending_copy_keeps_its_slot() -> None:
    backend = ThreadFake(consumer_done=True)
    stage = DeviceStage("cuda", backend=backend)
    first = stage.start(host(1), 0)
    second = stage.start(host(2), 1)  # the first copy is pending: its slot is not free
    assert stage.stats().ring_slots == 2
    backend.fire_all()
    assert_same_values(host(1), await first.wait())
    assert_same_values(host(2), await second.wait())
    stage.close()


async def test_a_full_ring_falls_back_to_fresh_tensors_tied_by_record_stream() -> None:
    backend = ThreadFake(consumer_done=True, auto_fire=True)
    stage = DeviceStage("cuda", backend=backend)
    held = [await stage.start(host(i), i).wait() for i in range(MAX_RING_SLOTS)]
    assert backend.entries("record_stream") == []
    extra = await stage.start(host(99), 99).wait()
    assert_same_values(host(99), extra)
    stats = stage.stats()
    assert stats.ring_slots == MAX_RING_SLOTS
    assert stats.ring_fallbacks == 1
    recorded = {id(e[1]) for e in backend.entries("record_stream")}
    assert recorded == {id(extra["x"]), id(extra["y"])}
    for i, out in enumerate(held):
        assert_same_values(host(i), out)
    stage.close()


async def test_the_release_event_goes_on_the_consumers_own_stream_and_close_ties_held_slots() -> (
    None
):
    backend = ThreadFake(consumer_done=False, auto_fire=True)
    stage = DeviceStage("cuda", backend=backend)
    consumer = FakeStream("consumer")
    out = await stage.start(host(1), 0).wait(stream=consumer)
    assert backend.entries("wait_event")[-1][1] is consumer
    del out
    kept = await stage.start(host(2), 1).wait(stream=consumer)
    assert [ev.stream for ev in backend.release_events()] == [consumer]
    # Closed while the user holds a batch, and while the consumer's stream may still read the
    # one let go (its release event is pending): both buffers are tied to the consumer's
    # stream for the caching allocator, which frees them once nobody holds them.
    stage.close()
    tied = backend.entries("record_stream")
    assert len(tied) == 2
    assert all(entry[2] is consumer for entry in tied)
    assert storage_of(kept) in {entry[1].untyped_storage().data_ptr() for entry in tied}
    assert_same_values(host(2), kept)


async def test_deep_pipeline_with_kept_batches_never_sees_a_slot_reused_early() -> None:
    # Up to five copies in flight, events fired in random bursts, the consumer's release
    # events completed at random, and a random third of the batches kept to the end.
    backend = ThreadFake(consumer_done=False)
    stage = DeviceStage("cuda", backend=backend, ring_min_leaf_bytes=0)  # every leaf in a slot
    rng = np.random.default_rng(3)
    pending: collections.deque[tuple[dict[str, Any], Any]] = collections.deque()
    kept: list[tuple[dict[str, Any], Any]] = []
    for i in range(60):
        batch = make_batch(200 + i)
        pending.append((batch, stage.start(batch, i)))
        if len(pending) > 4 or rng.random() < 0.3:
            backend.fire_all()
            while pending and (len(pending) > 1 or rng.random() < 0.5):
                batch, transfer = pending.popleft()
                out = await transfer.wait()
                assert_same_values(batch, out)
                if rng.random() < 0.3:
                    kept.append((batch, out))
        for event in backend.release_events():
            if not event.completed and rng.random() < 0.5:
                event.fire()
    backend.fire_all()
    while pending:
        batch, transfer = pending.popleft()
        assert_same_values(batch, await transfer.wait())
    for batch, out in kept:
        assert_same_values(batch, out)
    assert stage.stats().batches_copied == 60
    stage.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=trees)
def test_any_batch_arrives_through_ring_slots_with_its_structure_and_values(batch: Any) -> None:
    # Every dtype, shape (scalars, empty) and layout the stage accepts, carved out of one slot
    # (every leaf goes into the ring here, however small).
    backend = ThreadFake(consumer_done=True)
    stage = DeviceStage("cuda", backend=backend, ring_min_leaf_bytes=0)

    async def collect() -> list[Any]:
        transfers = [stage.start(batch, i) for i in range(2)]  # two in flight share nothing
        backend.fire_all()
        return [await t.wait() for t in transfers]

    try:
        for result in asyncio.run(collect()):
            assert_same_values(batch, result)
        assert stage.stats().ring_fallbacks == 0
    finally:
        stage.close()


# --- what a user may do with a ring batch ------------------------------------------------------


async def test_a_ring_leaf_is_a_plain_tensor_that_takes_part_in_autograd_in_place() -> None:
    backend = ThreadFake(consumer_done=True, auto_fire=True)
    stage = DeviceStage("cuda", backend=backend)
    out = await stage.start(host(1), 0).wait()
    x = out["x"]
    assert not x._is_view()
    assert x.grad_fn is None
    assert not x.requires_grad
    # A view made under no_grad refuses this ("A view was created in no_grad mode and is
    # being modified inplace with grad mode enabled"); a training step may well do it.
    w = torch.full((N,), 2.0, requires_grad=True)
    x.mul_(w)
    x.sum().backward()
    assert w.grad is not None
    assert torch.equal(w.grad, host(1)["x"])
    # A leaf made to require grad, updated in place outside autograd, then used.
    z = (await stage.start(host(2), 1).wait())["x"]
    z.requires_grad_()
    with torch.no_grad():
        z.add_(1.0)
    (z * 3.0).sum().backward()
    assert z.grad is not None
    assert torch.equal(z.grad, torch.full((N,), 3.0))
    assert torch.equal(z.detach(), host(2)["x"] + 1.0)
    stage.close()


async def test_a_small_leaf_the_user_keeps_has_a_tensor_of_its_own_and_keeps_no_slot() -> None:
    backend = ThreadFake(consumer_done=True, auto_fire=True)
    stage = DeviceStage("cuda", backend=backend)
    consumer = FakeStream("consumer")
    batch = {**host(1), "label": torch.tensor([4, 5, 6])}
    out = await stage.start(batch, 0).wait(stream=consumer)
    slot = storage_of(out)
    label = out["label"]
    assert label.untyped_storage().data_ptr() != slot
    # Outside the ring, the small leaf is tied to the consumer's stream for the allocator.
    tied = backend.entries("record_stream")
    assert [(entry[1] is label, entry[2]) for entry in tied] == [(True, consumer)]
    del out
    out = await stage.start(host(2), 1).wait(stream=consumer)
    assert storage_of(out) == slot  # reused: the kept label does not hold the slot
    assert_same_values(host(2), out)
    assert torch.equal(label, torch.tensor([4, 5, 6]))
    stage.close()


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage).clone()


async def test_a_storage_object_the_user_keeps_keeps_its_slot_from_reuse() -> None:
    backend = ThreadFake(consumer_done=True, auto_fire=True)
    stage = DeviceStage("cuda", backend=backend)
    out = await stage.start(host(1), 0).wait()
    storage = out["x"].untyped_storage()
    before = storage_bytes(storage)
    slot = storage_of(out)
    del out  # no tensor of the batch is left, only the storage object
    for i in range(3):
        result = await stage.start(host(10 + i), 1 + i).wait()
        assert storage_of(result) != slot
        assert_same_values(host(10 + i), result)
        del result
    assert torch.equal(storage_bytes(storage), before)
    del storage
    result = await stage.start(host(20), 9).wait()
    assert_same_values(host(20), result)
    # Let go at last: the slot is free again (the one batch's slot plus one for the rest).
    assert stage.stats().ring_slots == 2
    stage.close()


async def test_a_ring_batch_handed_over_after_close_is_tied_to_the_consumers_stream() -> None:
    backend = ThreadFake(consumer_done=True)
    stage = DeviceStage("cuda", backend=backend)
    transfer = stage.start(host(1), 0)
    stage.close()  # completes the copy; the ring forgets its slots
    consumer = FakeStream("consumer")
    out = await transfer.wait(stream=consumer)
    assert_same_values(host(1), out)
    # Nobody records a release event for a forgotten slot: the allocator must wait instead.
    tied = backend.entries("record_stream")
    assert len(tied) == 1
    assert tied[0][2] is consumer
    assert tied[0][1].untyped_storage().data_ptr() == storage_of(out)


def linger_after_each_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pool threads hold their work item (the job's arguments, its future) 50 ms after each
    job, past the moment its waiter woke."""
    import concurrent.futures.thread as pool_thread

    run = pool_thread._WorkItem.run

    def lingering(self: Any) -> None:
        run(self)
        time.sleep(0.05)  # the waiter is awake; this thread still holds the work item

    monkeypatch.setattr(pool_thread._WorkItem, "run", lingering)


async def slots_of_three_staged_batches() -> set[int]:
    """Three large batches staged on the stage's thread one after another, each let go before
    the next: the storages of the ring slots they got."""
    backend = ThreadFake(consumer_done=True, auto_fire=True)
    stage = DeviceStage("cuda", backend=backend)
    big = OFF_LOOP_STAGING_BYTES // 4  # float32 values: staged on the stage's thread
    slots = set()
    try:
        for i in range(3):
            out = await stage.start({"x": torch.full((big,), float(i))}, i).wait()
            assert float(out["x"][0]) == float(i)
            slots.add(storage_of(out))
            del out
    finally:
        stage.close()
    return slots


async def test_the_stage_threads_finished_job_keeps_no_batch_while_its_thread_lingers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The thread that ran a job drops its work item (the job's arguments, its future) only a
    # moment after the waiter woke: under load the next start came first, and a work item that
    # held the batch (or the record that holds it) kept its slot from reuse.
    linger_after_each_job(monkeypatch)
    assert len(await slots_of_three_staged_batches()) == 1


async def test_a_copy_seen_done_before_its_staging_job_returned_keeps_no_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The completion thread can see a copy's event complete before the staging thread's job
    # has returned (its future not yet done): the stage then comes back once the future is
    # done, through a callback the future keeps. That callback, and the thread's work item that
    # still holds the future, must not keep the batch (and so its ring slot) once let go.
    import aioloader._device._stage as stage_module

    enqueue_into = stage_module._enqueue_into

    def slow_return(*args: Any) -> None:
        enqueue_into(*args)
        time.sleep(0.2)  # the event is pushed (and fired): the completion thread goes first

    completed_weak = stage_module.DeviceStage._completed_weak
    calls = []

    def counted(self: Any, *args: Any) -> None:
        calls.append(1)
        completed_weak(self, *args)

    monkeypatch.setattr(stage_module, "_enqueue_into", slow_return)
    monkeypatch.setattr(stage_module.DeviceStage, "_completed_weak", counted)
    linger_after_each_job(monkeypatch)
    assert len(await slots_of_three_staged_batches()) == 1
    # At least one copy took that way: completed once on the notice, and again through the
    # staging job's callback (once per copy otherwise).
    assert len(calls) > 3


async def test_the_completion_thread_keeps_no_batch_while_it_lingers_after_the_hand_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The completion thread hands a finished copy to the loop and returns: descheduled in
    # between (under load), it still held the copy's record, and so the batch and its ring
    # slot, while the loop had already woken the task and the user had let the batch go.
    import threading

    loop = asyncio.get_running_loop()
    schedule = loop.call_soon_threadsafe

    def then_linger(*args: Any, **kwargs: Any) -> Any:
        handle = schedule(*args, **kwargs)
        if threading.current_thread().name.startswith("aioloader-copy-done"):
            time.sleep(0.1)  # the loop runs the callback meanwhile
        return handle

    monkeypatch.setattr(loop, "call_soon_threadsafe", then_linger)
    assert len(await slots_of_three_staged_batches()) == 1


async def test_a_batch_staged_on_the_stages_thread_gives_its_slot_back_once_let_go() -> None:
    backend = ThreadFake(consumer_done=True, auto_fire=True)
    stage = DeviceStage("cuda", backend=backend)
    big = OFF_LOOP_STAGING_BYTES // 4  # float32 values: staged on the stage's thread
    slots = set()
    for i in range(4):
        out = await stage.start({"x": torch.full((big,), float(i))}, i).wait()
        assert float(out["x"][0]) == float(i)
        slots.add(storage_of(out))
        del out
    assert len(slots) == 1  # nothing of the stage's kept a let-go batch (and so its slot)
    assert stage.stats().ring_slots == 1
    stage.close()
