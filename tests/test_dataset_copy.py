"""The dataset copy's large buffers travel through shared memory, out of the pickle stream
(``_workers._payload.dumps_copy``): what arrives equals what was sent, each copy a worker loads
is its own (copy-on-write, as memory inherited through ``fork``), the segment lives while a
worker may still load the copy and no longer, and without room in shared memory the buffers go
in the stream as before.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import numpy as np
import pytest
import torch
from datasets import Range
from helpers import BOUND_S

import aioloader
from aioloader import DataLoader, _shm
from aioloader._workers import _payload, _records
from aioloader._workers._copy import DatasetCopy
from aioloader._workers._payload import OUT_OF_BAND_MIN_BYTES, dumps_copy, loads

pytestmark = pytest.mark.usefixtures("baseline")

BIG = OUT_OF_BAND_MIN_BYTES // 8 * 3  # int64 elements: 3 MiB, out of band


class InMemory(Range):
    """A dataset that holds its samples in one large array (as a dataset of images in memory
    does); reading a sample also scribbles over it, as a careless transform might."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.data = np.arange(BIG, dtype=np.int64)
        self.small = np.arange(16)  # in the stream

    def __getitem__(self, index: int) -> Any:
        value = int(self.data[index])
        self.data[index] = -1  # each worker's copy is its own: nobody else sees this
        return value


def own_segments() -> set[str]:
    prefix = f"{_shm.SHM_PREFIX}{os.getpid()}_"
    return {name for name in os.listdir(_shm.SHM_DIR) if name.startswith(prefix)}


def test_large_buffers_leave_the_stream_and_arrive_equal_and_private_to_each_copy() -> None:
    dataset = InMemory(8)
    payload = dumps_copy(dataset, main_by_value=False)
    try:
        assert payload.segment is not None
        assert len(payload.data) < 4096  # the 3 MiB went out of band
        assert [length for _, length in payload.spans] == [dataset.data.nbytes]
        first, second = loads(payload), loads(payload)
        for copy in (first, second):
            assert np.array_equal(copy.data, dataset.data)
            assert np.array_equal(copy.small, dataset.small)
            assert copy.data.flags.writeable
        first.data[:10] = 7
        assert np.array_equal(second.data[:10], np.arange(10))  # copy-on-write
        assert np.array_equal(dataset.data[:10], np.arange(10))
        assert np.array_equal(loads(payload).data[:10], np.arange(10))  # the segment neither
    finally:
        payload.release()
    assert payload.segment not in own_segments()


def test_without_room_in_shared_memory_the_buffers_go_in_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_payload, "OUT_OF_BAND_SHARE", 0.0)
    dataset = InMemory(8)
    payload = dumps_copy(dataset, main_by_value=False)
    assert payload.segment is None
    assert len(payload.data) > dataset.data.nbytes
    assert np.array_equal(loads(payload).data, dataset.data)


def test_small_buffers_stay_in_the_stream() -> None:
    payload = dumps_copy(Range(5), main_by_value=False)
    assert payload.segment is None
    assert loads(payload).n == 5


def test_workers_read_the_copy_through_shared_memory_and_each_epoch_gets_a_fresh_one() -> None:
    dataset = InMemory(64)
    seen: list[set[str]] = []
    with DataLoader(dataset, batch_size=8, num_workers=2) as loader:
        for _ in range(3):
            values = []
            for batch in loader:
                values += batch.tolist()
                seen.append(own_segments())
            # Every value as the main process holds it: no worker's scribbles reached another
            # worker, the next epoch, or this process.
            assert sorted(values) == list(range(64))
            # Both workers answered a job after loading this epoch's copy: the one before it
            # is nobody's to load any more, and went then; this one stays (a replacement
            # worker would load it), until every worker has loaded the next epoch's.
            assert len(own_segments()) == 1
    assert np.array_equal(dataset.data[:64], np.arange(64))
    # Batches this small travel inline: the segments are the copies'. The current one, and
    # at most the previous epoch's (a worker may still have its load queued); the first is
    # gone by the third epoch, and every one at close.
    assert all(1 <= len(names) <= 2 for names in seen)
    assert not seen[0] & seen[-1]
    assert not own_segments()


def test_torch_tensors_travel_out_of_band_too_with_their_dtype_and_shape() -> None:
    big = torch.arange(BIG, dtype=torch.float32).reshape(-1, 8)
    half = torch.ones(BIG // 8, 32, dtype=torch.bfloat16)  # no numpy dtype: travels as bytes
    small = torch.tensor([1, 2, 3])
    graded = torch.ones(4, requires_grad=True)  # as torch pickles it
    dataset = torch.utils.data.TensorDataset(big, half)
    payload = dumps_copy((dataset, small, graded), main_by_value=False)
    try:
        assert payload.segment is not None
        assert len(payload.data) < 4096
        copy, small_copy, graded_copy = loads(payload)
        for sent, got in zip(dataset.tensors, copy.tensors, strict=True):
            assert got.dtype == sent.dtype
            assert got.shape == sent.shape
            assert torch.equal(got, sent)
        assert torch.equal(small_copy, small)
        assert graded_copy.requires_grad
        assert torch.equal(graded_copy, graded)
        copy.tensors[0][0] = -1  # its own: neither the original nor another copy sees it
        assert big[0, 0] == 0
        assert loads(payload)[0].tensors[0][0, 0] == 0
        assert [b.tolist() for b in copy[3]] == [[24.0 + i for i in range(8)], [1.0] * 32]
        assert len(payload.spans) == 2
    finally:
        payload.release()


class _Tagged:
    """Samples carry the dataset's ``tag``; index ``fail_at`` raises (a missing file)."""

    def __init__(self) -> None:
        self.tag = 0
        self.fail_at: int | None = 13

    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        if index == self.fail_at:
            raise KeyError(f"missing {index} (tag {self.tag})")
        return self.tag


def _epoch_after_an_error(mode: str) -> list[int]:
    """One epoch that stops at a batch's error, the dataset fixed, and the next epoch's tags.
    No gc.collect() in between: the error's traceback keeps the first iterator alive."""
    dataset = _Tagged()
    with DataLoader(dataset, batch_size=4, num_workers=2, timeout=30) as loader:

        async def read() -> list[int]:
            return [int(t) for batch in [b async for b in loader] for t in batch]

        def run() -> list[int]:
            if mode == "async":
                return aioloader.run(read())
            return [int(t) for batch in loader for t in batch]

        with pytest.raises(KeyError, match="missing 13"):
            run()
        dataset.tag, dataset.fail_at = 1, None  # fixed, as a user does between epochs
        return run()


async def test_a_cancelled_waiter_does_not_cancel_the_copy_for_the_others() -> None:
    # An epoch closed while its job waited for the copy (a new epoch closing the one that
    # raised) cancelled the one future every waiter shares: the pickling thread then died on
    # it, and the next epoch's workers waited for the copy for ever (a hang, about 1 run in 3).
    gate = threading.Event()

    def make() -> _records.Payload:
        assert gate.wait(BOUND_S)
        return dumps_copy(Range(5), main_by_value=False)

    copy = DatasetCopy(make, epoch=1)
    first = asyncio.ensure_future(copy.job())
    second = asyncio.ensure_future(copy.job())
    await asyncio.sleep(0.01)
    first.cancel()
    gate.set()
    async with asyncio.timeout(BOUND_S):
        job = await second
    with pytest.raises(asyncio.CancelledError):
        await first
    assert loads(job.payload)[0] is not None
    copy.release()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_epoch_after_one_that_raised_gets_a_fresh_copy(mode: str) -> None:
    # Without persistent_workers, each epoch gets a fresh copy, also after an epoch that ended
    # in an error; before, the traceback's iterator looked like a second live iterator, so the
    # workers kept the old copy and raised the old error every epoch.
    assert _epoch_after_an_error(mode) == [1] * 40
