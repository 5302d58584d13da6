"""Reused memory for large batches made on the loader's threads (``aioloader._threads._reuse``).

The promise: a batch's memory is written again only once every array and tensor of that batch
(views and slices included) is gone; a batch the consumer keeps keeps its values. And the
point of it: batches that the consumer lets go are made in memory already faulted in, so an
epoch makes only a few mappings, however many batches it has.
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from typing import Any

import numpy as np
import pytest
import torch

from aioloader import DataLoader, numpy_collate
from aioloader._threads._reuse import REUSE_MIN_BYTES, ReusedBuffers
from aioloader._threads._routes import INLINE_ABOVE_S
from aioloader._threads._runner import ThreadRunner

MIB = 1 << 20
U8 = np.dtype(np.uint8)


def test_small_leaves_get_plain_arrays() -> None:
    pool = ReusedBuffers(keep=8)
    small = pool.alloc((REUSE_MIN_BYTES // 8 - 1,), np.dtype(np.int64))
    assert small.flags.owndata
    assert small.flags.c_contiguous
    assert small.flags.writeable
    assert pool.made == 0


def test_a_leaf_is_written_again_only_after_its_last_view_is_gone() -> None:
    pool = ReusedBuffers(keep=8)
    first = pool.alloc((2, MIB), U8)
    first[...] = 7
    address = first.ctypes.data
    row = torch.from_numpy(first)[1]  # a tensor of a slice: all that is left of the leaf
    del first
    gc.collect()
    second = pool.alloc((2, MIB), U8)
    assert second.ctypes.data != address  # the row still holds the first mapping
    second[...] = 9
    assert bool((row == 7).all())
    del row
    gc.collect()
    third = pool.alloc((2, MIB), U8)
    assert third.ctypes.data == address  # now it is free, and taken again
    assert pool.made == 2


def test_a_much_smaller_leaf_gets_a_mapping_of_its_own() -> None:
    pool = ReusedBuffers(keep=8)
    big = pool.alloc((4 * MIB,), U8)
    del big
    gc.collect()
    small = pool.alloc((3 * MIB // 2,), U8)  # under half of the free one: it is not pinned
    assert pool.made == 2
    assert small.nbytes == 3 * MIB // 2


def test_what_is_kept_free_never_exceeds_the_most_ever_out() -> None:
    pool = ReusedBuffers(keep=8)
    leaves = [pool.alloc((2 * MIB,), U8) for _ in range(4)]  # 8 MiB out at once: the peak
    del leaves
    gc.collect()
    assert pool.free_bytes == 8 * MIB
    large = pool.alloc((6 * MIB,), U8)  # no free mapping fits: a new one, 14 MiB in all
    assert pool.made == 5
    assert pool.free_bytes <= 8 * MIB - 6 * MIB  # free ones unmapped down to the peak
    del large
    gc.collect()
    assert pool.free_bytes <= 8 * MIB
    again = pool.alloc((6 * MIB,), U8)
    assert pool.made == 5  # the 6 MiB one was kept, and is taken again
    del again


def test_no_more_than_keep_free_mappings_stay_after_many_were_held() -> None:
    pool = ReusedBuffers(keep=3)
    held = [pool.alloc((MIB,), U8) for _ in range(10)]  # a consumer that kept ten batches
    del held
    gc.collect()
    assert pool.free_bytes == 3 * MIB  # the other seven were unmapped
    again = [pool.alloc((MIB,), U8) for _ in range(3)]
    assert pool.made == 10  # the three kept are used again
    del again


def test_keep_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keep=0"):
        ReusedBuffers(keep=0)


def test_a_forked_child_gets_its_own_copy_of_a_batch() -> None:
    pool = ReusedBuffers(keep=8)
    leaf = pool.alloc((2 * MIB,), U8)
    leaf[...] = 1
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            leaf[...] = 99  # the child's own copy, never the parent's batch
            os.write(write, bytes([int(leaf[0])]))
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == bytes([99])
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert bool((leaf == 1).all())


def test_after_close_nothing_is_kept() -> None:
    pool = ReusedBuffers(keep=8)
    held = pool.alloc((2 * MIB,), U8)
    free = pool.alloc((2 * MIB,), U8)
    del free
    gc.collect()
    pool.close()
    assert pool.free_bytes == 0
    del held
    gc.collect()
    assert pool.free_bytes == 0


# -- the loader: batches made on its thread (num_workers=0) ------------------------------------

SAMPLE_SHAPE = (3, 160, 160)  # 76,800 bytes: a batch of 16 is 1.2 MB, above REUSE_MIN_BYTES
BATCH = 16
# Each sample takes this long, so each batch takes over INLINE_ABOVE_S: every batch is made on
# a loader thread (cheaper ones are made inline, in the consumer's thread, without alloc).
SAMPLE_S = 2 * INLINE_ABOVE_S / BATCH
LENGTH = 12 * BATCH


class Images:
    """Samples whose every byte says which sample it is (as arrays, or as tensors)."""

    def __init__(self, as_tensors: bool = False) -> None:
        self.as_tensors = as_tensors

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i: int) -> Any:
        time.sleep(SAMPLE_S)
        sample = np.full(SAMPLE_SHAPE, i % 251, dtype=np.uint8)
        return torch.from_numpy(sample) if self.as_tensors else sample


def expected(batch_id: int) -> np.ndarray[Any, Any]:
    ids = np.arange(batch_id * BATCH, (batch_id + 1) * BATCH) % 251
    return np.broadcast_to(ids.reshape(-1, 1, 1, 1), (BATCH, *SAMPLE_SHAPE)).astype(np.uint8)


CASES = {
    "arrays": ({}, False),
    "tensors": ({}, True),  # stacked into the reused memory by numpy (_stacking.stack_into)
    "numpy_collate": ({"collate_fn": numpy_collate}, False),
    "thread pool": ({"num_workers": 2, "thread_pool": True}, False),
}


@pytest.mark.parametrize(("kwargs", "as_tensors"), CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("iterate", ["async for", "for"])
def test_batches_the_consumer_keeps_keep_their_values(
    kwargs: dict[str, Any], as_tensors: bool, iterate: str
) -> None:
    kept: list[Any] = []  # every batch of the first epoch
    slices: list[Any] = []  # of the second, one sample of each: the batch itself goes

    def take(epoch: int, batch: Any) -> None:
        if epoch == 0:
            kept.append(batch)
        else:
            slices.append(batch[3])
        gc.collect()  # a batch let go of is collected at once: its memory is free to reuse

    loader = DataLoader(Images(as_tensors), batch_size=BATCH, **{"num_workers": 0, **kwargs})
    try:
        for epoch in range(2):
            if iterate == "for":
                for batch in loader:
                    take(epoch, batch)
                    del batch
            else:

                async def one_epoch(epoch: int = epoch) -> None:
                    async for batch in loader:
                        take(epoch, batch)
                        del batch

                asyncio.run(one_epoch())
    finally:
        loader.close()
    assert len(kept) == len(slices) == LENGTH // BATCH
    for batch_id, (batch, sample) in enumerate(zip(kept, slices, strict=True)):
        want = expected(batch_id)
        assert isinstance(batch, np.ndarray if "collate_fn" in kwargs else torch.Tensor)
        np.testing.assert_array_equal(np.asarray(batch), want)
        np.testing.assert_array_equal(np.asarray(sample), want[3])


async def test_batches_let_go_of_are_made_in_memory_already_used() -> None:
    async with DataLoader(Images(), batch_size=BATCH, num_workers=0) as loader:
        pointers = set()
        for _ in range(3):
            async for batch in loader:
                pointers.add(batch.data_ptr())
                del batch
        runner = loader._res.runner
        assert isinstance(runner, ThreadRunner)
        made = runner.buffers.made
    # 36 batches, each let go of before the next was taken: the mappings are the batches in
    # flight at once (the prefetch, and the one the consumer holds), made once each.
    assert made <= loader.prefetch + 3
    assert len(pointers) <= made
