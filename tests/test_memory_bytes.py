"""Large ``bytes`` leaves of a batch travel in its shared-memory slot, not pickled through the
worker's pipe: the worker copies each in, the main process copies it out into new ``bytes``
(the type the batch had), so the slot is free again at once when nothing else of the batch
lies in it. Small ``bytes`` stay in the pickled tree.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from aioloader import DataLoader, _shm
from aioloader._types import Made
from aioloader._workers._records import OwnSlot
from aioloader._workers._wire import Packer, Receiver, batch_nbytes

BIG = _shm.BYTES_IN_SLOT_MIN * 4


@pytest.fixture
def pool() -> Iterator[_shm.SlotPool]:
    p = _shm.SlotPool(1 << 26)
    try:
        yield p
    finally:
        p.close()


def round_trip(pool: _shm.SlotPool, batch: object) -> tuple[_shm.Encoded, object]:
    slot = pool.lease(4 * BIG)
    assert slot is not None
    encoded = _shm.SlotWriter(_shm.attach(slot)).encode(batch)
    assert not encoded.inline
    return encoded, pool.open(slot, encoded.tree)


def test_large_bytes_go_in_the_slot_and_come_back_as_equal_bytes(pool: _shm.SlotPool) -> None:
    raw = bytes(range(256)) * (BIG // 256)
    small = b"label"
    pixels = np.arange(BIG // 8, dtype=np.int64)
    batch = {"raw": raw, "small": small, "pixels": pixels}
    encoded, opened = round_trip(pool, batch)
    assert isinstance(encoded.tree["raw"], _shm.ArrayRef)
    assert encoded.tree["raw"].kind == "bytes"
    assert encoded.tree["small"] == small  # under BYTES_IN_SLOT_MIN: in the pickled tree
    assert isinstance(opened, dict)
    assert type(opened["raw"]) is bytes
    assert opened["raw"] == raw
    assert opened["small"] == small
    assert np.array_equal(opened["pixels"], pixels)
    assert pool.stats().held == 1  # the array is a view of the slot: it keeps it


def test_a_batch_of_bytes_only_frees_its_slot_at_once(pool: _shm.SlotPool) -> None:
    items = [bytes([i]) * BIG for i in range(3)]
    _, opened = round_trip(pool, items)
    assert opened == items
    assert isinstance(opened, list)
    assert all(type(item) is bytes for item in opened)
    stats = pool.stats()
    assert (stats.held, stats.leased, stats.free) == (0, 0, 1)


class Blobs:
    """Each item a 1 MiB ``bytes`` object, as a dataset of raw files is."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> bytes:
        return bytes([index]) * (1 << 20)


def test_a_loader_hands_large_bytes_over_through_shared_memory() -> None:
    with DataLoader(Blobs(), batch_size=None, num_workers=1) as loader:
        for _ in range(2):
            items = list(loader)
            assert all(type(item) is bytes for item in items)
            assert items == [Blobs()[i] for i in range(12)]
        stats = loader.statistics()
    # Pickled through the pipe they would have needed no slot at all.
    assert stats.live_shm_slots >= 1
    assert stats.held_shm_slots == 0  # every item is its own bytes: no slot is held


# A first batch of many leaves: 256 bytes objects of 100,000 bytes (collate_fn=list), each
# at an aligned offset in the slot: the writer needs 25,608,160 bytes, more than their bytes
# and the page of slack a slot once had (25,604,096).
MANY, EACH = 256, 100_000


def test_a_batch_of_many_leaves_fits_the_slot_made_for_its_size() -> None:
    batch = [bytes([i]) * EACH for i in range(MANY)]
    nbytes = batch_nbytes(batch)
    assert nbytes == _shm.in_slot_bytes([EACH] * MANY) == 25_608_192
    parcel = Packer(OwnSlot(_shm.new_name(), 1 << 30)).pack(batch)
    assert parcel.own_slot is not None
    try:
        assert parcel.in_slot  # in the worker's segment, sized as the pool sizes a first slot
        assert parcel.own_slot.size == _shm.slot_size(nbytes)
        assert not parcel.slot_error
    finally:
        _shm.unlink(parcel.own_slot.name)


def test_a_batch_larger_than_its_slot_travels_inline_and_is_counted(
    pool: _shm.SlotPool,
) -> None:
    slot = pool.lease(2 * BIG)
    assert slot is not None
    batch = [bytes([i]) * BIG for i in range(2 * slot.size // BIG)]  # twice what it holds
    try:
        parcel = Packer(slot).pack(batch)
    finally:
        _shm.detach_all()
    assert not parcel.in_slot
    assert parcel.fallback == "fit"
    assert str(slot.size) in parcel.slot_error
    receiver = Receiver(pool, prefetch=1)
    made = receiver.open(Made(parcel), slot)
    assert made.batch == batch
    assert receiver.fallbacks == 1  # counted (shm_fallbacks)


@pytest.mark.parametrize(
    "size",
    [_shm.HUGE_BYTES_MIN - 1, _shm.HUGE_BYTES_MIN, 9 * _shm.HUGE_BYTES_MIN + 12_345],
    ids=["under", "at", "over-unaligned"],
)
def test_new_bytes_is_an_independent_equal_copy_at_every_size(size: int) -> None:
    # From HUGE_BYTES_MIN on the copy is written into a fresh bytes object by address; its
    # ends (unaligned to huge pages) and its contents must be exactly the source's.
    rng = np.random.default_rng(size)
    source = rng.integers(0, 256, size=size, dtype=np.uint8)
    expected = source.tobytes()
    copied = _shm.new_bytes(source)
    assert type(copied) is bytes
    assert len(copied) == size
    assert copied == expected
    assert hash(copied) == hash(expected)  # hashes as the same bytes made the ordinary way
    source[0] ^= 0xFF
    source[-1] ^= 0xFF
    assert copied == expected  # nothing shared with the source


def test_new_bytes_of_a_non_contiguous_array_copies_its_elements_in_order() -> None:
    source = np.arange(2 * _shm.HUGE_BYTES_MIN, dtype=np.uint8)[::2]
    assert _shm.new_bytes(source) == source.tobytes()


def test_a_large_bytes_leaf_comes_back_whole_and_frees_its_slot(pool: _shm.SlotPool) -> None:
    raw = np.random.default_rng(0).integers(0, 256, 5 * _shm.HUGE_BYTES_MIN, np.uint8).tobytes()
    slot = pool.lease(len(raw) + _shm.ALIGN)
    assert slot is not None
    encoded = _shm.SlotWriter(_shm.attach(slot)).encode([raw])
    assert not encoded.inline
    opened = pool.open(slot, encoded.tree)
    assert opened == [raw]
    assert type(opened[0]) is bytes
    assert pool.stats().held == 0  # its own memory: the slot is free at once
