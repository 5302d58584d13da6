"""Samples the loop fetched reach the worker processes through shared memory (``_raw.Sender``).

The large ``bytes`` of a map job's fetched samples (a tar shard's members, an HTTP object) are
copied into the job's slot instead of being pickled through the pipe; the worker copies them
back out, so ``decode`` gets what it would have got inline, and collates the batch there.
Where no slot can be had (the cap, a full ``/dev/shm``) or the worker cannot map it (removed
behind the loader's back), the samples travel pickled: nothing is lost, nothing comes twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
from datasets import tar_digest, tar_shard
from procs import no_worker_left_behind

from aioloader import DataLoader, _shm
from aioloader._shm import Slot, SlotPool
from aioloader._types import BatchRequest
from aioloader._workers._raw import RAW_SLOT_MIN_BYTES, Sender, unpack_raw
from aioloader._workers._records import RawRef, RawSlotError
from aioloader._workers._wire import Receiver
from aioloader.sources import TarDataset

BOUND_S = 30.0
BIG = 64 << 10  # a member's bytes: well above RAW_SLOT_MIN_BYTES


def keep(batch: list[Any]) -> list[Any]:
    return batch


def _request(raw: list[Any]) -> BatchRequest:
    return BatchRequest(0, 7, list(range(len(raw))), raw=raw)


def _sent(sender: Sender, pool: SlotPool, raw: list[Any]) -> tuple[BatchRequest, Slot]:
    """What the runner does: plan, lease a slot big enough, copy the bytes in."""
    plan = sender.plan(_request(raw))
    assert plan is not None
    slot = pool.lease(plan.nbytes)
    assert slot is not None
    return sender.fill(plan, slot), slot


def test_large_bytes_go_through_the_slot_and_come_back_as_they_were() -> None:
    pool = SlotPool(64 << 20)
    sender = Sender(pool)
    big, other = os.urandom(BIG), os.urandom(BIG + 3)
    raw = [
        big,
        bytearray(other),
        {"__key__": "a/1", "bin": other, "cls": b"1", "n": 5},
        b"tiny",
        ("not", "walked"),
    ]
    try:
        wire, slot = _sent(sender, pool, raw)
        sent: Any = wire.raw
        assert isinstance(sent[0], RawRef)
        assert isinstance(sent[1], RawRef)
        assert sent[1].mutable
        assert isinstance(sent[2]["bin"], RawRef)
        assert sent[2]["cls"] == b"1"  # small values are pickled with the request
        assert sent[3] == b"tiny"
        assert raw[2]["bin"] is other  # type: ignore[index]  # the caller's samples unchanged
        back: Any = unpack_raw(wire, slot).raw
        assert back == raw
        assert [type(x) for x in back] == [type(x) for x in raw]
        assert type(back[2]["bin"]) is bytes
    finally:
        pool.close()
        _shm.detach_all()


def test_small_samples_and_no_pool_travel_inline() -> None:
    pool = SlotPool(64 << 20)
    try:
        small = [os.urandom(RAW_SLOT_MIN_BYTES - 1) for _ in range(40)]
        assert Sender(pool).plan(_request(small)) is None  # each under the minimum
        assert Sender(pool).plan(_request([os.urandom(RAW_SLOT_MIN_BYTES)])) is None  # in all
        assert Sender(None).plan(_request([os.urandom(BIG)])) is None
    finally:
        pool.close()


async def test_samples_over_the_cap_get_no_slot() -> None:
    pool = SlotPool(1 << 20, min_slot_bytes=1 << 20)
    try:
        plan = Sender(pool).plan(_request([os.urandom(BIG) for _ in range(20)]))
        assert plan is not None
        assert plan.nbytes > 1 << 20  # 1.25 MiB: over the cap, so the request goes pickled
        assert await Receiver(pool, prefetch=2).lease(plan.nbytes) is None
        assert pool.stats().slots == 0
    finally:
        pool.close()


async def test_a_slot_leased_for_a_cancelled_job_goes_back() -> None:
    pool = SlotPool(64 << 20)
    receiver = Receiver(pool, prefetch=2)
    entered, go_on = threading.Event(), threading.Event()
    real = pool.lease

    def slow_lease(nbytes: int) -> Slot | None:
        entered.set()
        assert go_on.wait(BOUND_S)
        return real(nbytes)

    pool.lease = slow_lease  # type: ignore[method-assign]
    try:
        task = asyncio.ensure_future(receiver.lease(BIG * 4))
        assert await asyncio.to_thread(entered.wait, BOUND_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go_on.set()
        for _ in range(1000):  # the thread's lease comes back, and is given back
            if pool.stats().slots == 1 and pool.stats().leased == 0:
                break
            await asyncio.sleep(0.005)
        assert (pool.stats().slots, pool.stats().leased) == (1, 0)
    finally:
        go_on.set()
        pool.close()


def test_a_slot_the_worker_cannot_map_is_named_and_forgotten() -> None:
    pool = SlotPool(64 << 20)
    try:
        sender = Sender(pool)
        wire, slot = _sent(sender, pool, [os.urandom(BIG)])
        os.unlink(os.path.join(_shm.SHM_DIR, slot.name))  # as RemoveIPC or a cleanup would
        with pytest.raises(RawSlotError) as info:
            unpack_raw(wire, slot)
        assert info.value.vanished
        assert "RemoveIPC" in str(info.value)
        sender.lost(slot, info.value)
        assert pool.stats().slots == 0  # never leased again
        assert sender.fallbacks == 1
    finally:
        pool.close()
        _shm.detach_all()


# -- with the loader and real worker processes ---------------------------------------------


@pytest.fixture
def big_shards(tmp_path: Path) -> list[str]:
    paths = []
    for shard in range(3):
        path = tmp_path / f"big-{shard}.tar"
        path.write_bytes(tar_shard(shard, 6, size=BIG))
        paths.append(str(path))
    return paths


def _expected(paths: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for raw in asyncio.run(_raws(paths)):
        out[raw["__key__"]] = {
            k: ("bytes", zlib.crc32(v)) for k, v in raw.items() if not k.startswith("__")
        }
    return out


async def _raws(paths: list[str]) -> list[dict[str, Any]]:
    ds = TarDataset(paths)
    try:
        return [raw async for raw in ds]
    finally:
        await ds.aclose()


def _decoded(loader: DataLoader) -> dict[str, dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for batch in loader:
        for sample in batch:
            assert sample["key"] not in seen  # nothing twice
            assert sample["pid"] != os.getpid()  # decoded in a worker process
            seen[sample["key"]] = sample["members"]
    return seen


@no_worker_left_behind()
def test_workers_decode_tar_members_sent_through_shared_memory(big_shards: list[str]) -> None:
    ds = TarDataset(big_shards, decode=tar_digest)
    with DataLoader(ds, batch_size=4, num_workers=2, collate_fn=keep, timeout=BOUND_S) as loader:
        assert _decoded(loader) == _expected(big_shards)
        stats = loader.statistics()
    # The batches (lists of dicts) hold no array and come back pickled: every segment the
    # pool made carried fetched samples to a worker, and was given back.
    assert stats.live_shm_slots >= 1
    assert (stats.leased_shm_slots, stats.held_shm_slots) == (0, 0)
    assert stats.shm_fallbacks == 0


@no_worker_left_behind()
def test_removed_raw_slots_send_the_samples_pickled_and_lose_none(
    big_shards: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = SlotPool.lease

    def lease_then_lose(self: SlotPool, nbytes: int) -> Slot | None:
        slot = real(self, nbytes)
        if slot is not None:
            os.unlink(os.path.join(_shm.SHM_DIR, slot.name))
        return slot

    monkeypatch.setattr(SlotPool, "lease", lease_then_lose)
    caplog.set_level(logging.WARNING, logger="aioloader.shm")
    ds = TarDataset(big_shards, decode=tar_digest)
    with DataLoader(ds, batch_size=4, num_workers=2, collate_fn=keep, timeout=BOUND_S) as loader:
        for _ in range(2):  # a second epoch: no removed segment is leased again
            assert _decoded(loader) == _expected(big_shards)
        stats = loader.statistics()
    assert stats.shm_fallbacks >= 5  # every batch of the first epoch: 18 samples, 5 batches
    messages = [r.getMessage() for r in caplog.records]
    assert any("fetched samples travel to the workers pickled" in m for m in messages), messages


@no_worker_left_behind()
def test_samples_that_do_not_fit_the_cap_travel_pickled(big_shards: list[str]) -> None:
    ds = TarDataset(big_shards, decode=tar_digest)
    with DataLoader(
        ds, batch_size=4, num_workers=2, collate_fn=keep, timeout=BOUND_S, shm_max_bytes=1 << 16
    ) as loader:
        assert _decoded(loader) == _expected(big_shards)
        assert loader.statistics().held_shm_slots == 0
