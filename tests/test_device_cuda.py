"""Tests of the device stage on a real CUDA device (skipped cleanly without one).

These prove what the fake backend cannot: values survive real asynchronous DMA, the caching
allocator does not hand a freed batch's block to the next copy while the consumer's stream
still reads it, and registered host memory is copied from directly.
"""

from __future__ import annotations

import gc
import mmap
import threading
from typing import Any

import numpy as np
import pytest
import torch
from test_device_completion import forbid_timers

from aioloader._device import DeviceStage
from aioloader._device._ring import RING_MIN_LEAF_BYTES

pytestmark = pytest.mark.cuda

# Cycles the consumer stream spins before reading a batch: long enough (~10 ms) that the next
# copy, on the side stream, would overwrite a block reused too early.
BUSY_CYCLES = 20_000_000


def as_host(value: Any) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value, dtype=value.dtype.newbyteorder("=")))
    assert isinstance(value, torch.Tensor)
    return value


async def test_values_arrive_intact() -> None:
    stage = DeviceStage("cuda")
    readonly = np.arange(1000, dtype=np.int64)
    readonly.flags.writeable = False
    batch = {
        "x": torch.randn(64, 128),
        "strided": torch.randn(32, 16).t(),
        "y": np.arange(5000, dtype=np.float32).reshape(50, 100),
        "readonly": readonly,
        "swapped": np.arange(10, dtype=">f8"),
        "flags": torch.rand(100) > 0.5,
        "empty": torch.empty(0, 3),
        "meta": ["name", 3],
    }
    transfer = stage.start(batch, 0)
    out = await transfer.wait()
    assert transfer.done()
    for key in ("x", "strided", "y", "readonly", "swapped", "flags", "empty"):
        assert out[key].device == stage.device, key
        assert torch.equal(out[key].cpu(), as_host(batch[key])), key
    assert out["meta"] == ["name", 3]
    stats = stage.stats()
    assert stats.batches_copied == 1
    assert stats.staging_buffers == 1
    assert stats.copy_seconds > 0
    stage.close()


async def test_consumer_on_its_own_stream_sees_the_batch() -> None:
    stage = DeviceStage("cuda")
    consumer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    host = torch.arange(1 << 20, dtype=torch.float32)
    out = await stage.start({"x": host}, 0).wait(stream=consumer)
    with torch.cuda.stream(consumer):
        doubled = out["x"] * 2
    consumer.synchronize()
    assert torch.equal(doubled.cpu(), host * 2)
    stage.close()


@pytest.mark.parametrize("consumer_kind", ["default", "own"])
async def test_no_corruption_when_batches_are_freed_while_the_next_copy_runs(
    consumer_kind: str,
) -> None:
    stage = DeviceStage("cuda")
    consumer = (
        torch.cuda.current_stream() if consumer_kind == "default" else torch.cuda.Stream()  # type: ignore[no-untyped-call]
    )
    n = 1 << 20
    batches = 24
    kept: list[torch.Tensor] = []
    transfer = stage.start({"x": torch.full((n,), 0.0)}, 0)
    for i in range(batches):
        dev = await transfer.wait(stream=consumer)
        with torch.cuda.stream(consumer):
            torch.cuda._sleep(BUSY_CYCLES)  # type: ignore[no-untyped-call]  # read only later
            kept.append(dev["x"].clone())
        # Drop every reference (the batch and its transfer): the block is freed on the host
        # while the consumer's read is still queued, and the next copy allocates right after.
        del dev, transfer
        transfer = stage.start({"x": torch.full((n,), float(i + 1))}, i + 1)
    await transfer.wait()
    torch.cuda.synchronize()
    for i, value in enumerate(kept):
        assert bool((value == float(i)).all()), f"batch {i} was overwritten"
    stage.close()


async def test_registered_host_memory_is_copied_directly() -> None:
    stage = DeviceStage("cuda")
    region = mmap.mmap(-1, 1 << 22)  # stands in for a shared-memory slot
    slot = np.frombuffer(region, dtype=np.uint8)
    base = slot.__array_interface__["data"][0]
    assert stage.register_host_memory(base, slot.nbytes)
    assert stage.stats().registered_bytes == slot.nbytes
    images = slot[: 1 << 20].view(np.float32).reshape(256, 1024)
    images[:] = np.arange(images.size, dtype=np.float32).reshape(images.shape)
    assert torch.from_numpy(images).is_pinned()  # torch sees registered memory as pinned
    out = await stage.start({"images": images}, 0).wait()
    assert torch.equal(out["images"].cpu(), torch.from_numpy(images))
    assert stage.stats().staging_buffers == 0  # nothing went through staging
    # A failed registration (an overlapping range) is reported, and does not leave a CUDA
    # error behind for the next kernel launch to trip over.
    assert not stage.register_host_memory(base + 4096, 4096)
    assert (torch.ones(10, device=stage.device) * 2).sum().item() == 20
    stage.unregister_host_memory(base)
    assert stage.stats().registered_bytes == 0
    stage.close()
    del images, slot, out
    gc.collect()
    region.close()


async def test_pin_only_mode_returns_pinned_host_memory() -> None:
    stage = DeviceStage(None, pin_memory=True)
    batch: dict[str, Any] = {"x": torch.randn(10), "y": np.arange(4)}
    out = await stage.start(batch, 0).wait()
    assert out["x"].is_pinned()
    assert out["y"].is_pinned()
    assert out["x"].device.type == "cpu"
    assert torch.equal(out["x"], batch["x"])
    assert torch.equal(out["y"], torch.from_numpy(batch["y"]))
    stage.close()


async def test_close_with_copies_in_flight_then_wait() -> None:
    stage = DeviceStage("cuda")
    hosts = [torch.full((1 << 22,), float(i)) for i in range(4)]
    transfers = [stage.start({"x": h}, i) for i, h in enumerate(hosts)]
    stage.close()
    assert stage.stats().in_flight == 0
    for i, transfer in enumerate(transfers):
        out = await transfer.wait()
        assert bool((out["x"] == float(i)).all())


# --- the completion thread, the device ring, pinned collation (this change: first GPU run) ---


async def test_a_pending_copy_is_woken_by_the_completion_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stage = DeviceStage("cuda")
    host = torch.empty(1 << 26, dtype=torch.uint8).pin_memory()  # 64 MiB: a few ms to copy
    transfer = stage.start({"x": host}, 0)
    tried = forbid_timers(monkeypatch)  # woken by the completion thread, never by a timer
    out = await transfer.wait()
    monkeypatch.undo()
    assert tried == []
    assert out["x"].device == stage.device
    stats = stage.stats()
    assert stats.handoffs == 1  # it was pending at wait(), and the thread woke it
    # The hand-off (thread saw the event -> task resumed) is tens of microseconds; a timer
    # tick, as the old poll's 1 ms back-off, would not fit.
    assert 0.0 < stats.handoff_p50_s < 1e-3
    assert stats.staged_bytes == 0  # pinned: copied directly
    stage.close()
    assert not [t for t in threading.enumerate() if t.name == "aioloader-copy-done"]


async def test_batches_collated_into_host_alloc_memory_are_copied_without_staging() -> None:
    stage = DeviceStage("cuda")
    array = stage.host_alloc((256, 1024), np.dtype(np.float32))
    array[:] = np.arange(array.size, dtype=np.float32).reshape(array.shape)
    tensor = torch.from_numpy(array)
    assert tensor.is_pinned()
    out = await stage.start({"t": tensor, "a": array}, 0).wait()
    assert torch.equal(out["t"].cpu(), tensor)
    assert torch.equal(out["a"].cpu(), tensor)
    stats = stage.stats()
    assert stats.staged_bytes == 0
    assert stats.staging_buffers == 0
    stage.close()


async def test_a_ring_slot_is_not_reused_while_the_consumer_still_reads_it() -> None:
    # The consumer's stream spins, then reads batch i; batch i is dropped at once on the host.
    # Its slot must not take batch i + 1 until the spin and the read have run: every batch
    # read must hold its own value. No record_stream is involved for ring leaves.
    stage = DeviceStage("cuda")
    consumer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    n = 1 << 20
    kept: list[torch.Tensor] = []
    for i in range(12):
        dev = await stage.start({"x": torch.full((n,), float(i))}, i).wait(stream=consumer)
        with torch.cuda.stream(consumer):
            torch.cuda._sleep(BUSY_CYCLES)  # type: ignore[no-untyped-call]
            kept.append(dev["x"].sum())
        del dev
    torch.cuda.synchronize()
    for i, total in enumerate(kept):
        assert float(total) == float(i) * n, f"batch {i} was overwritten"
    stats = stage.stats()
    assert 1 <= stats.ring_slots <= 8
    assert stats.ring_fallbacks == 0 or stats.ring_slots == 8
    stage.close()


async def test_a_loader_on_threads_stages_no_host_bytes() -> None:
    from aioloader import DataLoader

    class Rows:
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> np.ndarray:
            return np.full(4096, i, dtype=np.float32)

    async with DataLoader(Rows(), batch_size=16, device="cuda") as loader:
        seen = []
        async for batch in loader:
            assert batch.device.type == "cuda"
            seen += batch[:, 0].long().tolist()
        stats = loader.statistics()
    assert sorted(seen) == list(range(64))
    assert stats.device_batches == 4
    assert stats.device_staged_bytes == 0


async def test_ring_leaves_take_part_in_autograd_in_place_and_a_kept_storage_keeps_its_slot() -> (
    None
):
    stage = DeviceStage("cuda")
    n = RING_MIN_LEAF_BYTES // 4
    out = await stage.start({"x": torch.arange(n, dtype=torch.float32)}, 0).wait()
    x = out["x"]
    assert not x._is_view()
    w = torch.full((n,), 2.0, device=stage.device, requires_grad=True)
    x.mul_(w)  # refused for a view made under no_grad
    x.sum().backward()
    assert w.grad is not None
    assert torch.equal(w.grad.cpu(), torch.arange(n, dtype=torch.float32))
    storage = x.untyped_storage()
    del out, x
    torch.cuda.synchronize()
    kept = torch.empty(0, dtype=torch.float32, device=stage.device).set_(storage, 0, (n,), (1,))
    before = kept.clone()
    del kept
    for i in range(4):
        await stage.start({"x": torch.full((n,), float(i))}, 1 + i).wait()
    torch.cuda.synchronize()
    kept = torch.empty(0, dtype=torch.float32, device=stage.device).set_(storage, 0, (n,), (1,))
    assert torch.equal(kept, before), "a slot the user holds a storage of was overwritten"
    stage.close()
