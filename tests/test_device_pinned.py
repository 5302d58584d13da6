"""A loader with a CUDA device stage: how many host bytes each route copies on the way there.

Batches made on the loader's threads (``num_workers=0``, ``thread_pool=True``) are collated
straight into the stage's pinned memory, and worker processes' batches lie in shared memory the
stage registered as page-locked: on both, no host memcpy into staging. A collate function that
cannot write into given memory still pays it (the counter is not zero by construction). The
stage's CUDA is ``device_fakes.ThreadFake``, given through ``DeviceStage.default_backend``.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from device_fakes import ThreadFake

from aioloader import DataLoader
from aioloader._device import DeviceStage
from aioloader._device._ring import RING_GRANULE

N = 40
BATCH = 8
ROW = 4096  # float32 values per sample: a batch (128 KiB) travels in shared memory


class Rows:
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": np.full(ROW, i, dtype=np.float32), "i": i}


def own_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A collate function that takes no ``alloc``: its batches are pageable."""
    return {
        "x": torch.from_numpy(np.stack([s["x"] for s in samples])),
        "i": torch.tensor([s["i"] for s in samples]),
    }


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> list[ThreadFake]:
    made: list[ThreadFake] = []

    def backend() -> ThreadFake:
        made.append(ThreadFake(auto_fire=True))
        return made[-1]

    monkeypatch.setattr(DeviceStage, "default_backend", staticmethod(backend))
    return made


async def read_all(loader: DataLoader) -> list[Any]:
    out = []
    async for batch in loader:
        assert torch.equal(batch["x"][:, 0].long(), batch["i"])  # each row its sample
        out.append(batch)
    return out


@pytest.mark.parametrize(
    "kwargs",
    [{"num_workers": 0}, {"num_workers": 2, "thread_pool": True}, {"num_workers": 1}],
    ids=["num_workers=0", "thread_pool", "processes"],
)
async def test_no_host_bytes_are_staged_on_the_way_to_the_device(
    fakes: list[ThreadFake], kwargs: dict[str, Any]
) -> None:
    async with DataLoader(Rows(), batch_size=BATCH, device="cuda", **kwargs) as loader:
        batches = await read_all(loader)
        stats = loader.statistics()
    assert sorted(int(i) for b in batches for i in b["i"]) == list(range(N))
    assert stats.device_batches == N // BATCH
    assert stats.device_bytes == N * (ROW * 4 + 8)
    assert stats.device_staged_bytes == 0
    assert stats.device_copies_in_flight == 0
    assert "device: batches=5 staged_bytes/batch=0" in str(stats)
    (backend,) = fakes
    copies = backend.entries("copy")
    assert len(copies) == 2 * (N // BATCH)
    # Every copy read page-locked memory: pinned by the stage, or shared memory it registered
    # (unregistered since, as the loader closed).
    registered = [(e[1], e[2]) for e in backend.entries("register")]
    assert all(
        backend.staging_of(ptr) is not None
        or any(base <= ptr < base + size for base, size in registered)
        for _, _, ptr, _ in copies
    )
    assert bool(registered) == (kwargs["num_workers"] > 0 and "thread_pool" not in kwargs)
    assert stats.as_dict()["device_staged_bytes"] == 0
    # The device ring, in statistics(): each batch's 128 KiB of rows went into a slot, reused
    # as the loop let batches go (read_all keeps them all here: one slot each, up to the cap).
    assert 1 <= stats.device_ring_slots <= N // BATCH
    assert stats.device_ring_bytes == stats.device_ring_slots * RING_GRANULE
    assert stats.device_ring_fallbacks == 0
    assert stats.device_pinned_fallbacks == 0
    assert f"ring_slots={stats.device_ring_slots} ring_fallbacks=0" in str(stats)


async def test_a_collate_function_without_alloc_is_staged_and_counted(
    fakes: list[ThreadFake],
) -> None:
    async with DataLoader(
        Rows(), batch_size=BATCH, device="cuda", num_workers=0, collate_fn=own_collate
    ) as loader:
        await read_all(loader)
        stats = loader.statistics()
    assert stats.device_batches == N // BATCH
    assert stats.device_staged_bytes == stats.device_bytes == N * (ROW * 4 + 8)


async def test_an_epoch_abandoned_with_copies_in_flight_leaves_nothing(
    fakes: list[ThreadFake],
) -> None:
    async with DataLoader(
        Rows(), batch_size=BATCH, device="cuda", num_workers=0, device_prefetch=3
    ) as loader:
        async for batch in loader:
            assert int(batch["i"][0]) == 0
            break
        assert loader.statistics().device_batches >= 1
    # Closed: the completion thread is gone (the suite's leak check also says so), and the
    # stage dropped its ring and staging buffers.
    assert not [t for t in threading.enumerate() if t.name == "aioloader-copy-done"]


def test_a_sync_for_loop_gets_its_batches_through_the_completion_thread(
    fakes: list[ThreadFake],
) -> None:
    # ``for`` runs the epoch on the loader's loop thread: the completion futures belong to it.
    with DataLoader(Rows(), batch_size=BATCH, device="cuda", num_workers=0) as loader:
        seen = [int(i) for batch in loader for i in batch["i"]]
        stats = loader.statistics()
    assert sorted(seen) == list(range(N))
    assert stats.device_batches == N // BATCH
    assert stats.device_staged_bytes == 0
    (backend,) = fakes
    assert backend.waited_from  # the completion thread waited on the copies' events
    assert set(backend.waited_from) == {"aioloader-copy-done"}


async def test_host_alloc_without_pinned_memory_falls_back_to_pageable_and_is_staged() -> None:
    backend = ThreadFake(auto_fire=True)
    stage = DeviceStage("cuda", backend=backend)
    backend.fail_pinned = 2  # page-locked memory exhausted for the next two allocations
    with pytest.warns(RuntimeWarning, match=r"pinned memory for a batch of 2048 bytes"):
        first = stage.host_alloc((64, 8), np.dtype(np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per stage
        second = stage.host_alloc((16,), np.dtype(np.int64))
    assert first.shape == (64, 8)
    assert first.dtype == np.float32
    assert first.flags.c_contiguous
    assert first.flags.writeable
    assert not backend.is_pinned(torch.from_numpy(first))
    first[:] = 1.5
    second[:] = np.arange(16)
    batch = {"a": first, "b": second}
    out = await stage.start(batch, 0).wait()
    assert torch.equal(out["a"], torch.from_numpy(first))
    assert torch.equal(out["b"], torch.from_numpy(second))
    stats = stage.stats()
    assert stats.pinned_fallbacks == 2
    assert stats.staged_bytes == first.nbytes + second.nbytes  # staged, and counted
    # Pinned memory again: no fallback, nothing staged.
    third = stage.host_alloc((8,), np.dtype(np.float32))
    assert backend.is_pinned(torch.from_numpy(third))
    assert stage.stats().pinned_fallbacks == 2
    stage.close()
