"""The first batches of a loader, before it knows how large its batches are: a large one goes
into a shared-memory segment its worker makes, which the main process takes over into its pool
(``_workers._wire.OwnSlot``, ``SlotPool.adopt``), instead of being pickled through the pipe; a
tiny one travels inline, and nothing is made for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from datasets import FdReport, Range

from aioloader import DataLoader, WorkerPool, _shm, default_collate, numpy_collate
from aioloader._shm import SlotPool
from aioloader._workers._records import OwnSlot, Parcel
from aioloader._workers._wire import Packer, Receiver

pytestmark = pytest.mark.usefixtures("baseline")


class Tiles(Range):
    """16 KiB arrays filled with their index: a batch of 8 is 128 KiB, past the inline limit."""

    def __getitem__(self, index: int) -> np.ndarray:  # type: ignore[override]
        return np.full((64, 64, 4), index % 251, dtype=np.uint8)


def own_segments() -> set[str]:
    prefix = f"{_shm.SHM_PREFIX}{os.getpid()}_"
    return {name for name in os.listdir(_shm.SHM_DIR) if name.startswith(prefix)}


def test_the_first_large_batches_come_through_shared_memory_not_pickled() -> None:
    with DataLoader(Tiles(64), batch_size=8, num_workers=2, prefetch=4) as loader:
        it = iter(loader)
        held = [next(it) for _ in range(4)]  # all four asked for before any size was known
        stats = loader.statistics()
        assert stats.held_shm_slots >= 4  # ours, and any made meanwhile waiting its turn
        assert stats.shm_fallbacks == 0
        rest = list(it)
        for k, batch in enumerate(held + rest):
            assert batch.shape == (8, 64, 64, 4)
            assert [int(sample[0, 0, 0]) for sample in batch] == list(range(8 * k, 8 * k + 8))
        del held, rest, batch
    assert not own_segments()


def test_tiny_first_batches_travel_inline_and_make_no_segment() -> None:
    with DataLoader(Range(64), batch_size=8, num_workers=2) as loader:
        assert sum(len(b) for b in loader) == 64
        assert loader.statistics().live_shm_slots == 0
    assert not own_segments()


def test_a_closed_pool_refuses_a_workers_segment_and_unlinks_it() -> None:
    pool = SlotPool(8 << 20)
    name, _ = _shm.create_segment(1 << 20, _shm.SHM_DIR)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.adopt(name, 1 << 20)
    assert name not in own_segments()


def test_an_adopted_segment_is_the_pools_to_reuse_and_unlink() -> None:
    pool = SlotPool(8 << 20)
    try:
        name, _ = _shm.create_segment(1 << 20, _shm.SHM_DIR)
        slot = pool.adopt(name, 1 << 20)
        assert pool.stats().leased == 1
        pool.release(slot)
        again = pool.reuse(1000)
        assert again is not None
        assert again.name == name
        pool.release(again)
    finally:
        pool.close()
    assert name not in own_segments()


def test_a_job_that_failed_after_its_worker_made_a_segment_leaves_none() -> None:
    receiver = Receiver(SlotPool(8 << 20), prefetch=2)
    own = asyncio.run(receiver.lease())
    assert isinstance(own, OwnSlot)
    release = receiver.releaser(own)
    assert release is not None
    release()  # the worker never made it: nothing to do, nothing said to the tracker
    _shm.create_segment(1 << 20, _shm.SHM_DIR, own.name)  # as the worker does, then dies
    assert own.name in own_segments()
    release()
    assert own.name not in own_segments()


def test_a_swept_name_is_neither_adopted_nor_unlinked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The pool's close sweeps the names of segments workers were told to make while the loop
    # still holds the reply of one (a training step between reading and opening it): the
    # sweep unlinks it; opening the reply then must not adopt or unlink it again (a second
    # unregister makes Python's resource tracker print a KeyError traceback).
    from multiprocessing import resource_tracker

    from aioloader._types import Made
    from aioloader._workers._wire import Packer, sweep_unclaimed

    told: list[str] = []
    unregister = resource_tracker.unregister

    def spy(name: str, rtype: str) -> None:
        told.append(name)
        unregister(name, rtype)

    monkeypatch.setattr(resource_tracker, "unregister", spy)
    unclaimed: set[str] = set()
    slots = SlotPool(8 << 20)
    receiver = Receiver(slots, prefetch=2, unclaimed=unclaimed)
    own = asyncio.run(receiver.lease())
    assert isinstance(own, OwnSlot)
    assert unclaimed == {own.name}
    parcel = Packer(own).pack(np.ones((64, 64, 16), dtype=np.uint8))  # as the worker does
    assert parcel.own_slot is not None
    sweep_unclaimed(unclaimed)  # the pool closes: its workers are stopped
    assert own.name not in own_segments()
    with pytest.raises(RuntimeError, match="closed"):
        receiver.open(Made(batch=parcel), own)
    assert told.count("/" + own.name) == 1
    assert slots.stats().slots == 0
    slots.close()
    release = receiver.releaser(own)
    assert release is not None
    release()  # and a late release does not unlink it either
    assert told.count("/" + own.name) == 1


def test_names_of_segments_for_failed_first_batches_are_let_go() -> None:
    # Batches without array bytes (lists of ints) never tell the loader their size, so every
    # one leases an OwnSlot; a batch that fails ends its job: its name goes then, not at the
    # pool's close (a long run's failed batches piled their names up).
    from datasets import FailAt

    bad = {0, 8, 16, 24, 32, 40, 48, 56}
    with DataLoader(FailAt(64, bad), batch_size=4, num_workers=2, collate_fn=list) as loader:
        for _ in range(2):
            made, failed = 0, 0
            it = iter(loader)
            for _ in range(64):  # bounded: 16 batches
                try:
                    next(it)
                    made += 1
                except StopIteration:
                    break
                except KeyError:
                    failed += 1
            assert (made, failed) == (8, 8)
        runner = loader._res.runner
        assert runner is not None
        assert runner._unclaimed_own == set()  # type: ignore[attr-defined]


def test_a_sweep_interrupted_midway_leaves_its_name_for_the_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A second Ctrl-C lands in the close's sweep: a close called again (as the loader's is)
    # must still unlink what the interrupted one had taken out of the names.
    from aioloader._workers import _wire

    name, _ = _shm.create_segment(1 << 16, _shm.SHM_DIR)
    names = {name}
    discard = _shm.discard
    interrupted: list[str] = []

    def once(n: str) -> None:
        if not interrupted:
            interrupted.append(n)
            raise KeyboardInterrupt
        discard(n)

    monkeypatch.setattr(_shm, "discard", once)  # the module _wire calls it through
    with pytest.raises(KeyboardInterrupt):
        _wire.sweep_unclaimed(names)
    assert names == {name}
    _wire.sweep_unclaimed(names)  # the close, called again
    assert names == set()
    assert name not in own_segments()


def test_names_of_first_batches_given_up_are_let_go_once_their_workers_are_done() -> None:
    # Batches without array bytes lease an OwnSlot each; breaking out of an epoch gives up
    # the ones in flight. Their workers finish them, and then the names go (they piled up
    # until the pool closed, epoch after epoch).
    with DataLoader(Range(64), batch_size=4, num_workers=2, collate_fn=list) as loader:
        it = iter(loader)
        next(it)
        del it  # given up with batches in flight
        assert sum(len(b) for b in loader) == 64  # the workers answered those jobs first
        runner = loader._res.runner
        assert runner is not None
        assert runner._unclaimed_own == set()  # type: ignore[attr-defined]


class SlowTiles(Tiles):
    """Tiles that take 50 ms each, and say in ``marker_dir`` that a worker began one."""

    def __init__(self, n: int, marker_dir: str) -> None:
        super().__init__(n)
        self.marker_dir = marker_dir

    def __getitem__(self, index: int) -> np.ndarray:  # type: ignore[override]
        open(os.path.join(self.marker_dir, f"began-{index}"), "w").close()
        time.sleep(0.05)
        return super().__getitem__(index)


async def give_up_the_first_batches(loader: DataLoader, markers: pathlib.Path) -> None:
    """Ask for the first batch, wait until both workers are making one, and give it up."""
    first = asyncio.ensure_future(anext(aiter(loader)))
    for _ in range(200):  # bounded: 10 s
        if len(os.listdir(markers)) >= 2:
            break
        await asyncio.sleep(0.05)
    assert len(os.listdir(markers)) >= 2  # both workers are making a batch
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_a_loader_closed_while_workers_make_their_first_segments_leaves_none(
    tmp_path: pathlib.Path,
) -> None:
    # The loader closes while its workers are still making the first batches' segments (the
    # jobs given up, their worker not done): what the workers make afterwards is unlinked too.
    loader = DataLoader(SlowTiles(64, str(tmp_path)), batch_size=8, num_workers=2, prefetch=4)
    async with loader:
        await give_up_the_first_batches(loader, tmp_path)
    assert own_segments() == set()


@pytest.mark.parametrize("pool_closes", ["at once", "after the workers are done"])
async def test_a_shared_pool_leaves_none_of_a_closed_loaders_first_segments(
    tmp_path: pathlib.Path, pool_closes: str
) -> None:
    # As above, over a shared pool: the loader closes and the pool runs on, its workers still
    # making the segments of the jobs given up. They are unlinked when the workers are done
    # with those jobs, or, if the pool closes first, when it has stopped its workers.
    pool = WorkerPool(num_workers=2)
    try:
        loader = DataLoader(SlowTiles(64, str(tmp_path)), batch_size=8, workers=pool, prefetch=4)
        async with loader:
            await give_up_the_first_batches(loader, tmp_path)
        if pool_closes != "at once":
            # Done: no sample begun for longer than a batch takes (0.4 s). Bounded: 10 s.
            begun, still_since = -1, time.monotonic()
            for _ in range(100):
                if len(os.listdir(tmp_path)) != begun:
                    begun, still_since = len(os.listdir(tmp_path)), time.monotonic()
                elif time.monotonic() - still_since > 0.6:
                    break
                await asyncio.sleep(0.1)
            assert own_segments() == set()  # the pool still runs
    finally:
        await pool.aclose()
    assert own_segments() == set()


async def test_segments_workers_made_for_batches_nobody_read_are_unlinked_at_close(
    tmp_path: pathlib.Path,
) -> None:
    # A SIGTERM stops the main thread's loop in the handler, which releases the loader from a
    # thread of its own: the workers made the first batches' segments and sent them, but the
    # loop never read those parcels, so nothing took the segments in. The release unlinks
    # them once the workers are stopped (it left one to the resource tracker, which warned).
    # The loop let go of the workers' pipes only after the close: they are closed then (the
    # baseline fixture finds none left open).
    import threading

    from aioloader import _signals

    loader = DataLoader(SlowTiles(64, str(tmp_path)), batch_size=8, num_workers=2, prefetch=4)
    first = asyncio.ensure_future(anext(aiter(loader)))
    for _ in range(200):  # bounded: 10 s
        if len(os.listdir(tmp_path)) >= 2:
            break
        await asyncio.sleep(0.05)
    assert len(os.listdir(tmp_path)) >= 2  # workers are making batches
    # From here the loop runs nothing, as in the handler: no parcel is read.
    deadline = time.monotonic() + 10.0
    while not own_segments() and time.monotonic() < deadline:
        time.sleep(0.02)  # noqa: ASYNC251 - the loop must not run: no parcel is read
    assert own_segments(), "no worker made a segment in 10 s"
    _signals.terminating.set()
    try:
        release = threading.Thread(target=loader._res.close)
        release.start()
        release.join(30.0)
        assert not release.is_alive()
    finally:
        _signals.terminating.clear()
    assert own_segments() == set()
    first.cancel()
    with contextlib.suppress(BaseException):
        await first
    await loader.aclose()


# -- the cap before the batch size is known: reservations ---------------------------------------

MIB = 1 << 20


def test_reservations_count_against_the_cap_until_given_back_or_adopted() -> None:
    pool = SlotPool(8 * MIB)
    try:
        assert pool.reserve(3 * MIB) == 3 * MIB
        assert pool.reserve(6 * MIB) == 5 * MIB  # what is left
        assert pool.reserve(MIB) == 0  # nothing left
        assert pool.lease(MIB) is None  # a lease cannot take reserved bytes either
        name, _ = _shm.create_segment(2 * MIB, _shm.SHM_DIR)
        slot = pool.adopt(name, 2 * MIB, 3 * MIB)  # made under the first reservation
        assert pool.stats().bytes_total == 2 * MIB
        assert pool.reserve(2 * MIB) == MIB  # the 1 MiB the segment did not use came back
        pool.unreserve(5 * MIB)
        pool.unreserve(MIB)
        assert pool.reserve(8 * MIB) == 6 * MIB  # all but the adopted segment
        pool.unreserve(6 * MIB)
        pool.release(slot)
    finally:
        pool.close()
    assert name not in own_segments()


def test_a_reservation_under_the_smallest_slot_is_none() -> None:
    pool = SlotPool(4 * MIB, min_slot_bytes=MIB)
    try:
        assert pool.reserve(MIB - 1) == 0
        assert pool.reserve(3 * MIB + MIB // 2) == 3 * MIB + MIB // 2
        assert pool.reserve(MIB) == 0  # half a MiB left: under the smallest slot
    finally:
        pool.close()


def test_an_own_slot_holds_a_share_of_the_cap_until_its_job_ends() -> None:
    pool = SlotPool(9 * MIB)
    try:
        receiver = Receiver(pool, prefetch=2)
        owns = [asyncio.run(receiver.lease()) for _ in range(4)]
        assert all(isinstance(own, OwnSlot) for own in owns)
        limits = [own.limit for own in owns if isinstance(own, OwnSlot)]
        assert limits == [3 * MIB, 3 * MIB, 3 * MIB, 0]  # a third each: prefetch + 1 shares
        release = receiver.releaser(owns[0])
        assert release is not None
        release()  # the job was given up: its share comes back
        release()  # once: the other two shares stay reserved
        assert pool.reserve(9 * MIB) == 3 * MIB
        for own in owns[1:]:
            release = receiver.releaser(own)
            assert release is not None
            release()
        pool.unreserve(3 * MIB)
        assert pool.reserve(9 * MIB) == 9 * MIB
    finally:
        pool.close()


class Images(Range):
    """256 KiB images with their index as label: a batch of 8 is 2 MiB, which the default
    collate stacks as the samples are read."""

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:  # type: ignore[override]
        return np.full((64, 64, 64), index % 251, dtype=np.uint8), index


class TwoLarge(Range):
    """Two 1 MiB leaves a sample: the first sizes the segment, the second cannot fit it."""

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:  # type: ignore[override]
        return {
            "a": np.full(MIB, index % 251, dtype=np.uint8),
            "b": np.full(MIB // 8, index, dtype=np.int64),
        }


def collated_into(samples: Sequence[Any], own: OwnSlot) -> tuple[Any, Parcel]:
    packer = Packer(own)
    assert packer.alloc is not None
    batch = default_collate(samples, alloc=packer.alloc)
    return batch, packer.pack(batch)


def test_a_first_batch_is_collated_in_the_segment_its_worker_makes_not_copied_there() -> None:
    own = OwnSlot(_shm.new_name(), 64 * MIB)
    samples = [Images(8)[i] for i in range(8)]
    try:
        batch, parcel = collated_into(samples, own)
        assert parcel.in_slot
        assert parcel.own_slot is not None
        assert parcel.own_slot.name == own.name
        images, labels = batch
        segment = _shm.attach(parcel.own_slot)
        ref = parcel.tree[0]
        mapped = segment[ref.offset : ref.offset + images.nbytes]
        assert (mapped == images.numpy().reshape(-1)).all()
        images[3, 0, 0, 0] = 200  # the batch is the segment's memory: no copy was made
        assert mapped[3 * 64 * 64 * 64] == 200
        assert labels.tolist() == list(range(8))
        # Made at the first large alloc (the images) with room for the labels beside, then
        # cut to the batch's size: the pool keeps it as a slot of that size.
        assert parcel.own_slot.size == _shm.slot_size(_shm.in_slot_bytes([images.nbytes, 64]))
        assert os.stat(os.path.join(_shm.SHM_DIR, own.name)).st_size == parcel.own_slot.size
    finally:
        _shm.unlink(own.name)
    assert own.name not in own_segments()


def test_a_first_batch_larger_than_its_first_segment_goes_in_one_made_to_its_size() -> None:
    own = OwnSlot(_shm.new_name(), 64 * MIB)
    samples = [TwoLarge(4)[i] for i in range(4)]
    try:
        batch, parcel = collated_into(samples, own)
        assert parcel.in_slot
        assert parcel.slot_error == ""
        assert parcel.own_slot is not None
        assert parcel.own_slot.name == own.name
        needed = 4 * MIB + 4 * (MIB // 8) * 8
        assert parcel.own_slot.size >= needed
        segment = _shm.attach(parcel.own_slot)
        for key in ("a", "b"):
            ref = parcel.tree[key]
            leaf = batch[key].numpy()
            view = segment[ref.offset : ref.offset + leaf.nbytes].view(leaf.dtype)
            assert (view.reshape(leaf.shape) == leaf).all()
        assert batch["b"][:, 0].tolist() == [0, 1, 2, 3]
    finally:
        _shm.unlink(own.name)
    assert own.name not in own_segments()


def test_a_first_batch_over_its_share_of_the_cap_makes_no_segment_and_says_why() -> None:
    own = OwnSlot(_shm.new_name(), MIB)  # the batch is 2 MiB
    batch, parcel = collated_into([Images(8)[i] for i in range(8)], own)
    assert not parcel.in_slot
    assert parcel.fallback == "cap"
    assert "shm_max_bytes" in parcel.slot_error
    assert own.name not in own_segments()
    assert batch[0][:, 0, 0, 0].tolist() == list(range(8))


def test_first_batches_stacked_as_read_come_whole_and_in_slots() -> None:
    with DataLoader(Images(48), batch_size=8, num_workers=2, prefetch=4) as loader:
        batches = list(loader)
        assert loader.statistics().shm_fallbacks == 0
    for k, (images, labels) in enumerate(batches):
        assert labels.tolist() == list(range(8 * k, 8 * k + 8))
        assert images[:, 5, 6, 7].tolist() == [i % 251 for i in range(8 * k, 8 * k + 8)]
    del batches, images, labels
    assert not own_segments()


def test_a_job_failing_after_its_first_segment_was_begun_leaves_none() -> None:
    class Fails(Images):
        def __getitem__(self, index: int) -> tuple[np.ndarray, int]:  # type: ignore[override]
            if index % 8 == 5:  # after the stacked array was begun in the segment
                raise ValueError(f"sample {index}")
            return super().__getitem__(index)

    # One batch: a second would be begun after the error (the traceback keeps the iterator).
    with DataLoader(Fails(8), batch_size=8, num_workers=1, prefetch=1) as loader:
        with pytest.raises(ValueError, match="sample 5"):
            next(iter(loader))
        assert not own_segments()  # unlinked with the job, not only at close
    assert not own_segments()


class SegmentsSeen(Images):
    """:class:`Images` whose label is how many segments of the process ``owner`` exist as the
    sample is read: a segment made during the batch's collation shows from its second sample."""

    def __init__(self, n: int, owner: int, tensors: bool = False) -> None:
        super().__init__(n)
        self.owner = owner
        self.tensors = tensors

    def __getitem__(self, index: int) -> tuple[Any, int]:  # type: ignore[override]
        prefix = f"{_shm.SHM_PREFIX}{self.owner}_"
        seen = sum(name.startswith(prefix) for name in os.listdir(_shm.SHM_DIR))
        image = super().__getitem__(index)[0]
        return (torch.from_numpy(image).permute(2, 0, 1) if self.tensors else image), seen


@pytest.mark.parametrize("tensors", [False, True], ids=["arrays", "tensors"])
def test_a_first_batch_is_stacked_into_its_segment_as_its_samples_are_read(
    tensors: bool,
) -> None:
    dataset = SegmentsSeen(16, os.getpid(), tensors)
    with DataLoader(dataset, batch_size=8, num_workers=1, prefetch=1) as loader:
        first, second = list(loader)
        assert loader.statistics().shm_fallbacks == 0
    seen = first[1].tolist()
    assert seen[1] == seen[0] + 1  # made at the first sample, before the second was read
    assert seen[1:] == [seen[1]] * 7
    expected = first[0][:, 5, 6, 7] if not tensors else first[0][:, 7, 5, 6]
    assert expected.tolist() == list(range(8))
    del first, second


def _import_numpy_ma(worker_id: int) -> None:
    import numpy.ma  # noqa: F401  (collation imports it later, when no descriptor is left)


def test_a_worker_out_of_descriptors_sends_its_first_batches_inline() -> None:
    dataset = FdReport(6, starve_at=0, starve_for_good=True)
    with DataLoader(
        dataset, batch_size=1, num_workers=1, worker_init_fn=_import_numpy_ma, timeout=60
    ) as loader:
        batches = list(loader)
        stats = loader.statistics()
    assert [int(b[0, 0]) for b in batches] == list(range(6))
    assert stats.shm_fallbacks == 6  # each said to have found no segment, none lost
    assert not own_segments()


XYZ = np.dtype([("x", "<f4"), ("y", "<f4"), ("z", "<f4")])


class Records(Range):
    """Structured arrays, which shared memory does not hold: they travel pickled."""

    def __init__(self, n: int, length: int) -> None:
        super().__init__(n)
        self.length = length

    def __getitem__(self, index: int) -> np.ndarray:  # type: ignore[override]
        return np.full(self.length, index, dtype=XYZ)


@pytest.mark.parametrize("length", [10, 8192], ids=["small", "past-the-inline-limit"])
def test_structured_arrays_are_collated_whatever_slot_their_batch_has(length: int) -> None:
    with DataLoader(
        Records(16, length), batch_size=4, num_workers=1, collate_fn=numpy_collate
    ) as loader:
        batches = list(loader)
        stats = loader.statistics()
    # No slot: records travel pickled, so no segment is made or leased for them, and their
    # batches are no fallback.
    assert stats.live_shm_slots == 0
    assert stats.shm_fallbacks == 0
    assert len(batches) == 4
    for k, batch in enumerate(batches):
        assert batch.dtype == XYZ
        assert batch.shape == (4, length)
        assert batch["y"][:, -1].tolist() == [float(i) for i in range(4 * k, 4 * k + 4)]


def test_a_segment_that_cannot_be_cut_keeps_its_size_and_says_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_shm, "shrink", lambda name, size: False)
    own = OwnSlot(_shm.new_name(), 64 * MIB)
    try:
        batch, parcel = collated_into([Images(8)[i] for i in range(8)], own)
        assert parcel.in_slot
        assert parcel.own_slot is not None
        made = os.stat(os.path.join(_shm.SHM_DIR, own.name)).st_size
        assert parcel.own_slot.size == made > _shm.slot_size(batch[0].nbytes + 64)
        segment = _shm.attach(parcel.own_slot)  # the main process maps it at that size
        assert segment.nbytes == made
    finally:
        _shm.unlink(own.name)


def test_a_batch_packed_into_its_cut_segment_allows_no_later_alloc() -> None:
    own = OwnSlot(_shm.new_name(), 64 * MIB)
    packer = Packer(own)
    alloc = packer.alloc
    assert alloc is not None
    try:
        batch = default_collate([Images(8)[i] for i in range(8)], alloc=alloc)
        parcel = packer.pack(batch)
        assert parcel.in_slot
        # Past the cut a write would be a SIGBUS: a collate function that kept alloc is told.
        with pytest.raises(RuntimeError, match="after encode"):
            alloc((MIB,), np.dtype(np.uint8))
    finally:
        _shm.unlink(own.name)
