"""A lease that finds no free slot waits for the one the consumer is about to give back.

A ``for`` loop holds its last batch while it asks for the next; the loop's thread hands it the
next batch and leases the slot of the batch that then goes into production before the loop
has dropped that last one. Without waiting, every such lease made one slot more than a loop
needs: six 9.2 MiB slots for ``prefetch=4`` where five do, as an ``async for`` has. The lease
waits (``RETURN_WAIT_S``) while two batches or more are held, one of them in a slot that fits;
a consumer that keeps its batches (``list(loader)``) makes the leases waiting then miss, and no
lease waits again until a free slot is found.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aioloader import DataLoader, _shm
from aioloader._shm import SlotPool, SlotWriter, attach
from aioloader._workers import _wire
from aioloader._workers._runner import ProcessRunner

NBYTES = 4 * _shm.INLINE_MAX_BYTES  # in a slot: never inline
BATCH = 8
SAMPLE = (3, 128, 128)  # uint8: 48 KiB a sample, 384 KiB a batch (in a slot, not inline)


@pytest.fixture
def pool() -> Iterator[SlotPool]:
    p = SlotPool(1 << 26, min_slot_bytes=_shm.page_round(1))
    try:
        yield p
    finally:
        p.close()


def _held(pool: SlotPool, value: int) -> Any:
    """A batch opened from a slot (held by its views until they die), its bytes ``value``."""
    slot = pool.lease(NBYTES)
    assert slot is not None
    writer = SlotWriter(attach(slot))
    data = writer.alloc((NBYTES // 2,), np.dtype(np.uint8))
    data[:] = value
    encoded = writer.encode({"x": data})
    assert not encoded.inline
    return pool.open(slot, encoded.tree)


class Wakes:
    """A ``wake`` callback that counts its calls."""

    def __init__(self) -> None:
        self.called = threading.Event()
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        self.called.set()


def test_a_free_slot_is_leased_at_once(pool: SlotPool) -> None:
    batch = _held(pool, 1)
    slots = pool.stats().slots
    del batch
    gc.collect()
    wake = Wakes()
    slot, watching = pool.watch(NBYTES, wake)
    assert slot is not None
    assert not watching
    assert pool.stats().slots == slots  # the same slot, none made
    pool.wake_watchers()
    assert wake.calls == 0


def test_one_held_batch_is_not_waited_for(pool: SlotPool) -> None:
    # The one batch held is the one the consumer works on: it is not about to go.
    batch = _held(pool, 1)
    wake = Wakes()
    assert pool.watch(NBYTES, wake) == (None, False)
    del batch
    gc.collect()
    assert wake.calls == 0


def test_a_lease_gets_the_slot_of_the_batch_the_consumer_drops(pool: SlotPool) -> None:
    before, current = _held(pool, 1), _held(pool, 2)
    wake = Wakes()
    assert pool.watch(NBYTES, wake) == (None, True)
    assert pool.reuse(NBYTES) is None
    del before  # the loop rebinds its name: the batch's views die, its finalizer wakes us
    assert wake.called.wait(5)
    assert wake.calls == 1
    slot = pool.reuse(NBYTES)
    assert slot is not None
    assert pool.stats().slots == 2  # no third slot
    assert int(current["x"].min()) == int(current["x"].max()) == 2  # the kept batch untouched


def test_a_batch_larger_than_every_held_slot_does_not_wait(pool: SlotPool) -> None:
    held = [_held(pool, 1), _held(pool, 2)]
    assert pool.watch(4 * NBYTES, Wakes()) == (None, False)
    assert len(held) == 2


def test_unwatch_forgets_the_wake(pool: SlotPool) -> None:
    before, current = _held(pool, 1), _held(pool, 2)
    wake = Wakes()
    assert pool.watch(NBYTES, wake) == (None, True)
    pool.unwatch(wake)
    pool.unwatch(wake)  # twice: nothing
    del before
    gc.collect()
    assert wake.calls == 0
    assert current["x"][0] == 2


def test_close_wakes_whoever_waits(pool: SlotPool) -> None:
    held = [_held(pool, 1), _held(pool, 2)]
    wake = Wakes()
    assert pool.watch(NBYTES, wake) == (None, True)
    pool.close()
    assert wake.calls == 1
    assert len(held) == 2


def test_a_return_queued_before_the_watch_is_applied_by_it(pool: SlotPool) -> None:
    # A finalizer that finds the pool's lock taken only queues its return (drain_nowait):
    # the watch applies it instead of waiting for a wake that was already spent.
    before, current = _held(pool, 1), _held(pool, 2)
    with pool._lock:
        del before
        gc.collect()
    wake = Wakes()
    slot, watching = pool.watch(NBYTES, wake)
    assert slot is not None
    assert not watching
    assert current["x"][0] == 2


def test_a_released_slot_wakes_whoever_waits(pool: SlotPool) -> None:
    # A leased slot given back (its batch came inline, its job was abandoned, a Ray reply)
    # is free as a returned one is: a waiting lease takes it instead of timing out.
    held = [_held(pool, 1), _held(pool, 2)]
    leased = pool.lease(NBYTES)
    assert leased is not None
    wake = Wakes()
    assert pool.watch(NBYTES, wake) == (None, True)
    pool.release(leased)
    assert wake.calls == 1
    assert pool.reuse(NBYTES) is not None
    assert len(held) == 2


def test_a_lease_cancelled_as_its_slot_comes_back_is_cancelled(pool: SlotPool) -> None:
    # The consumer drops a batch (its finalizer wakes the waiting lease) in the loop turn that
    # cancels the lease (a close, a deadline): the lease must end cancelled, leasing nothing.
    async def main() -> None:
        receiver = _wire.Receiver(pool, 4)
        receiver.saw(NBYTES)
        held = {"before": _held(pool, 1), "current": _held(pool, 2)}
        lease = asyncio.ensure_future(receiver.lease())
        await asyncio.sleep(0)  # the lease waits (watch() registered it)
        assert pool.stats().leased == 0
        del held["before"]  # wakes the lease...
        lease.cancel()  # ...and cancels it in the same turn
        with pytest.raises(asyncio.CancelledError):
            await lease
        stats = pool.stats()
        assert (stats.leased, stats.free, stats.held) == (0, 1, 1)

    asyncio.run(main())


class Images:
    """Fixed-shape uint8 samples: every batch has one size, and says which it is."""

    def __init__(self, batches: int = 12) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return self.batches * BATCH

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(SAMPLE, index % 251, dtype=np.uint8)


def _receiver(loader: DataLoader) -> _wire.Receiver:
    runner = loader._res.runner
    assert isinstance(runner, ProcessRunner)
    return runner._receiver


def _check(batch: Any, number: int) -> None:
    first = number * BATCH
    assert batch.shape == (BATCH, *SAMPLE)
    assert [int(sample[0, 0, 0]) for sample in batch] == [(first + i) % 251 for i in range(BATCH)]
    assert int(batch[-1].min()) == int(batch[-1].max())


def test_a_for_loop_needs_no_slot_beyond_prefetch_and_its_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A long wait: on a loaded machine the consumer's thread may not run for milliseconds,
    # and the claim here is about slots, not about how long the lease waits.
    monkeypatch.setattr(_wire, "RETURN_WAIT_S", 10.0)
    prefetch = 4
    with DataLoader(Images(), batch_size=BATCH, num_workers=2, prefetch=prefetch) as loader:
        most = 0
        for _ in range(2):
            for number, batch in enumerate(loader):
                _check(batch, number)
                most = max(most, loader.statistics().live_shm_slots)
        assert _receiver(loader).return_waits_missed == 0
    # prefetch batches being made or waiting, and the one the loop holds (was prefetch + 2).
    assert most <= prefetch + 1


def test_a_consumer_that_keeps_its_batches_is_not_waited_for_at_every_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A wait that missed stops the waiting until a free slot is found again (the next epoch,
    # once this one's batches are dropped): leases waiting at that moment miss too, at most
    # one per batch in flight, then none. Waiting at every lease would miss 16 times an epoch.
    monkeypatch.setattr(_wire, "RETURN_WAIT_S", 0.2)
    prefetch = 4
    with DataLoader(Images(20), batch_size=BATCH, num_workers=2, prefetch=prefetch) as loader:
        for epoch in range(2):
            kept = list(loader)
            assert len(kept) == 20
            for number, batch in enumerate(kept):  # no slot leased again while held
                _check(batch, number)
            assert _receiver(loader).return_waits_missed <= (epoch + 1) * prefetch
            del kept, batch
            gc.collect()
