"""A shared-memory slot is the size of the batch it holds: batches of one size (default collation
of fixed-shape samples) get slots of that size and no more, the slots workers make for a
loader's first batches included; headroom (``GROWTH``) comes only once a batch larger than every
slot made before asks, when sizes vary. Every slot's pages count in the PSS of each process
that maps it, so headroom never used was 25% more of every slot.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest

from aioloader import DataLoader, _shm

PAGE = _shm.page_round(1)
BATCH = 8
SAMPLE = (3, 256, 256)  # uint8: 192 KiB a sample, 1.5 MiB a batch (over MIN_SLOT_BYTES)
BATCH_BYTES = BATCH * math.prod(SAMPLE)


@pytest.fixture
def pool() -> Iterator[_shm.SlotPool]:
    p = _shm.SlotPool(1 << 28, min_slot_bytes=PAGE)
    try:
        yield p
    finally:
        p.close()


def test_slots_for_batches_of_one_size_are_that_size(pool: _shm.SlotPool) -> None:
    nbytes = 10 * PAGE + 123
    slots = [pool.lease(nbytes) for _ in range(4)]
    assert all(s is not None for s in slots)
    sizes = {s.size for s in slots if s is not None}
    # The batch's pages (its bytes in a slot, alignment counted: _shm.in_slot_bytes), no
    # headroom and no slack beside them.
    assert sizes == {_shm.slot_size(nbytes, min_slot_bytes=PAGE)} == {11 * PAGE}
    assert pool.stats().bytes_total == 4 * 11 * PAGE


def test_headroom_comes_once_a_larger_batch_asks(pool: _shm.SlotPool) -> None:
    first = pool.lease(10 * PAGE)
    assert first is not None
    larger = pool.lease(20 * PAGE)
    assert larger is not None
    assert larger.size == _shm.page_round(math.ceil(20 * PAGE * _shm.GROWTH))
    # A batch a little larger still reuses that slot instead of making another.
    pool.release(larger)
    again = pool.lease(22 * PAGE)
    assert again is not None
    assert again.name == larger.name


class Images:
    """Fixed-shape uint8 samples: every batch has one size."""

    def __len__(self) -> int:
        return 16 * BATCH

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(SAMPLE, index % 251, dtype=np.uint8)


def test_a_loaders_slots_follow_its_batch_size() -> None:
    with DataLoader(Images(), batch_size=BATCH, num_workers=2) as loader:
        for _ in range(2):
            seen = 0
            for batch in loader:
                assert batch.shape == (BATCH, *SAMPLE)
                seen += 1
            assert seen == 16
        del batch
        stats = loader.statistics()
    assert stats.live_shm_slots >= 1
    # The first batches' slots (made by the workers) and the pool's: each the batch's size.
    assert stats.shm_bytes == stats.live_shm_slots * _shm.slot_size(BATCH_BYTES)
