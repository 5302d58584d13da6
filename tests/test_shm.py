"""Tests of the shared-memory slot pool: real segments, real worker processes, injected faults."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import errno
import gc
import math
import mmap
import multiprocessing
import os
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from aioloader import _shm
from aioloader._errors import SharedMemoryError
from aioloader._shm import ArrayRef, Encoded, Slot, SlotPool, SlotWriter, attach
from aioloader._shm._pool import IDLE_GRACE_S, KEEP_SPARE
from aioloader._tree import iter_leaves

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TESTS_DIR)
PAGE = mmap.PAGESIZE


class Meta(NamedTuple):
    scale: Any
    tag: str


def _mine() -> set[str]:
    """Segments of this process (other test runs may share /dev/shm)."""
    prefix = f"{_shm.SHM_PREFIX}{os.getpid()}_"
    return {n for n in os.listdir(_shm.SHM_DIR) if n.startswith(prefix)}


def _make_batch(scale: int, alloc: Any = None) -> dict[str, Any]:
    """A batch with every kind of leaf; ``images`` goes through ``alloc`` when given."""
    shape = (scale * 16, 32, 32)
    images = alloc(shape, np.dtype(np.float32)) if alloc is not None else np.empty(shape, "f4")
    images[...] = np.arange(math.prod(shape), dtype=np.float32).reshape(shape) / 7
    return {
        "images": images,
        "labels": np.arange(scale * 16, dtype=np.int64) * 3,  # copied in
        "strided": np.arange(600, dtype=np.int16).reshape(20, 30)[:, ::2],  # copied, non-contig
        "meta": Meta(np.full(3, float(scale)), "tag"),
        "ids": [1, 2, (3, "x")],
        "none": None,
    }


def _fill_job(slot: Slot, scale: int) -> tuple[Encoded, bool, int]:
    """Worker side: collate into the slot the way a worker does."""
    cached = slot.name in _shm.attached
    writer = SlotWriter(attach(slot))
    batch = _make_batch(scale, writer.alloc)
    return writer.encode(batch), cached, os.getpid()


def _assert_same(got: Any, want: Any) -> None:
    """Same nesting, container types, leaf values, dtypes and shapes (bitwise for arrays)."""
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            _assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same(g, w)
    elif isinstance(want, np.ndarray):
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        assert got.tobytes() == want.tobytes()
    elif type(want).__module__ == "torch":
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        assert got.detach().view(-1).view(_byte_view(got)).tolist() == (
            want.detach().contiguous().view(-1).view(_byte_view(want)).tolist()
        )
    else:
        assert got == want


def _byte_view(t: Any) -> Any:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def _segment_span(pool: SlotPool, slot: Slot) -> tuple[int, int]:
    """Address range of the pool's own mapping of ``slot``."""
    mapping = pool._segments[slot.name].mapping
    start = np.frombuffer(memoryview(mapping), np.uint8).__array_interface__["data"][0]
    return start, start + slot.size


def _address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


def _forkserver_executor() -> cf.ProcessPoolExecutor:
    return cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"))


@pytest.fixture
def pool() -> Iterator[SlotPool]:
    p = SlotPool(64 << 20)
    try:
        yield p
    finally:
        p.close()
        _shm.detach_all()


def _encode_here(pool: SlotPool, batch: Any, nbytes: int = 1 << 20) -> tuple[Slot, Encoded]:
    """Lease a slot and encode ``batch`` into it from this process, as a worker would."""
    slot = pool.lease(nbytes)
    assert slot is not None
    return slot, SlotWriter(attach(slot)).encode(batch, inline_below=0)


# --- round trip through a real worker ------------------------------------------------------


def test_roundtrip_through_forkserver_worker(pool: SlotPool) -> None:
    ex = _forkserver_executor()
    try:
        slot = pool.lease(200_000)
        assert slot is not None
        encoded, cached, pid = ex.submit(_fill_job, slot, 1).result(timeout=30)
        assert not encoded.inline
        assert not cached
        assert isinstance(encoded.tree["images"], ArrayRef)
        assert encoded.tree["ids"] == [1, 2, (3, "x")]  # plain leaves travel as they are
        batch = pool.open(slot, encoded.tree)
        _assert_same(batch, _make_batch(1))
        assert pool.stats().held == 1

        # Zero copies: every array is a view of one root over the pool's mapping of the slot.
        leaves = [batch["images"], batch["labels"], batch["strided"], batch["meta"].scale]
        root = leaves[0].base
        lo, hi = _segment_span(pool, slot)
        for leaf in leaves:
            assert leaf.base is root
            assert lo <= _address(leaf)
            assert _address(leaf) + leaf.nbytes <= hi
        # ... and the bytes are the segment's: a write here is visible in /dev/shm.
        batch["labels"][0] = 123456789
        fd = os.open(os.path.join(_shm.SHM_DIR, slot.name), os.O_RDONLY)
        try:
            raw = os.pread(fd, 8, encoded.tree["labels"].offset)
        finally:
            os.close(fd)
        assert np.frombuffer(raw, np.int64)[0] == 123456789

        # The slot is free once the batch is gone, and the next lease reuses it; the worker
        # has it mapped already.
        del batch, leaves, root, leaf
        gc.collect()
        assert pool.stats().free == 1
        again = pool.lease(200_000)
        assert again is not None
        assert again.name == slot.name
        encoded, cached, pid2 = ex.submit(_fill_job, again, 2).result(timeout=30)
        assert cached
        assert pid2 == pid
        _assert_same(pool.open(again, encoded.tree), _make_batch(2))
        gc.collect()

        # A batch bigger than the slot comes back inline, saying how much it needs.
        third = pool.lease(200_000)
        assert third is not None
        assert third.name == slot.name
        big = 40  # 2.5 MiB of images against a 1 MiB slot
        encoded, _, _ = ex.submit(_fill_job, third, big).result(timeout=30)
        assert encoded.inline
        assert encoded.used_bytes == 0
        assert encoded.needed_bytes > third.size
        assert encoded.needed_bytes >= sum(
            a.nbytes for a in _make_batch(big).values() if isinstance(a, np.ndarray)
        )
        _assert_same(encoded.tree, _make_batch(big))
        pool.release(third)
        bigger = pool.lease(encoded.needed_bytes)
        assert bigger is not None
        assert bigger.size >= encoded.needed_bytes
        encoded, _, _ = ex.submit(_fill_job, bigger, big).result(timeout=30)
        assert not encoded.inline
        _assert_same(pool.open(bigger, encoded.tree), _make_batch(big))
        gc.collect()
        assert pool.stats().leased == pool.stats().held == 0
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def test_no_resource_tracker_warning_from_a_child_process() -> None:
    code = textwrap.dedent(
        f"""
        import concurrent.futures as cf, gc, multiprocessing, sys
        sys.path.insert(0, {TESTS_DIR!r})
        from aioloader import _shm
        from test_shm import _fill_job

        if __name__ == "__main__":
            pool = _shm.SlotPool(1 << 26)
            ex = cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"))
            try:
                slot = pool.lease(200_000)
                encoded, _, _ = ex.submit(_fill_job, slot, 1).result(timeout=30)
                batch = pool.open(slot, encoded.tree)
                assert batch["images"][0, 0, 1] == batch["images"].dtype.type(1) / 7
                kept = batch["labels"]  # a view alive across close()
                del batch
            finally:
                ex.shutdown(wait=True)
                pool.close()
            assert int(kept[1]) == 3
            print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-W", "default", "-c", code],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    for text in ("resource_tracker", "leaked", "Traceback", "Warning"):
        assert text not in proc.stderr, proc.stderr


# --- ownership: when a slot comes back -----------------------------------------------------


def test_slot_returns_only_after_the_last_view_dies(pool: SlotPool) -> None:
    batch_in = {"a": np.arange(1000.0), "b": [np.ones((4, 5), np.int32), 7]}
    slot, encoded = _encode_here(pool, batch_in)
    batch = pool.open(slot, encoded.tree)
    kept = batch["b"][0][1:3].T  # a derived view is enough to hold the slot
    del batch
    gc.collect()
    assert (pool.stats().held, pool.stats().free) == (1, 0)
    assert kept.sum() == 10
    del kept
    gc.collect()
    assert (pool.stats().held, pool.stats().free) == (0, 1)
    assert pool.lease(10) == Slot(slot.name, slot.size, slot.lease_id + 1)


def test_a_torch_tensor_made_from_a_leaf_holds_the_slot(pool: SlotPool) -> None:
    import torch

    slot, encoded = _encode_here(pool, {"x": np.arange(64, dtype=np.float32)})
    batch = pool.open(slot, encoded.tree)
    tensor = torch.from_numpy(batch["x"])
    del batch
    gc.collect()
    assert pool.stats().held == 1
    assert float(tensor[3]) == 3.0
    del tensor
    gc.collect()
    assert pool.stats().held == 0
    assert pool.stats().free == 1


def test_torch_leaves_come_back_as_tensors_in_the_slot(pool: SlotPool) -> None:
    import torch

    src: dict[str, Any] = {
        "f": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "bf16": torch.linspace(-2, 2, 10, dtype=torch.bfloat16),  # no numpy dtype
        "grad": torch.ones(5, requires_grad=True),
        "t": torch.arange(20, dtype=torch.int64).reshape(4, 5).T,  # non-contiguous
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "mask": torch.tensor([True, False, True]),
        "np": np.arange(4, dtype=np.uint8),
    }
    slot, encoded = _encode_here(pool, src)
    assert encoded.tree["bf16"].torch_dtype == "bfloat16"
    assert encoded.tree["f"].kind == "torch"
    assert encoded.tree["np"].kind == "numpy"
    batch = pool.open(slot, encoded.tree)
    want = dict(src, grad=src["grad"].detach())
    _assert_same({**batch, "grad": batch["grad"].detach()}, want)
    lo, hi = _segment_span(pool, slot)
    for key in ("f", "bf16", "grad", "t", "scalar", "mask"):
        assert batch[key].is_contiguous()
        # As a pickled tensor would: the flag, as a leaf (the graph cannot cross processes).
        assert batch[key].requires_grad == (key == "grad")
        assert batch[key].is_leaf
        assert lo <= batch[key].data_ptr() < hi
    del batch
    gc.collect()
    assert pool.stats().free == 1


def test_alloc_writes_in_place_and_encode_does_not_copy(pool: SlotPool) -> None:
    import torch

    slot = pool.lease(1 << 20)
    assert slot is not None
    buf = attach(slot)
    writer = SlotWriter(buf)
    a = writer.alloc((100, 3), np.float64)
    b = torch.from_numpy(writer.alloc(7, np.int32))
    a[:] = 1.5
    b[:] = 9
    assert a.flags.c_contiguous
    assert a.flags.writeable
    assert [_address(a) % _shm.ALIGN, (b.data_ptr() - _address(buf)) % _shm.ALIGN] == [0, 0]
    encoded = writer.encode({"a": a, "b": b, "again": a}, inline_below=0)
    refs = encoded.tree
    assert refs["a"].offset == _address(a) - _address(buf)
    assert refs["b"].offset == b.data_ptr() - _address(buf)
    assert refs["again"] == refs["a"]  # the same array is stored once
    assert encoded.used_bytes == writer.needed_bytes  # nothing was copied in after the allocs
    batch = pool.open(slot, encoded.tree)
    assert np.shares_memory(batch["a"], batch["again"])
    assert batch["a"].sum() == 450.0
    assert b.sum() == 63
    with pytest.raises(RuntimeError, match="one writer per batch"):
        writer.encode({})


def test_containers_keep_their_types(pool: SlotPool) -> None:
    dd: collections.defaultdict[str, Any] = collections.defaultdict(list, {"x": np.zeros(3)})
    src = [
        collections.OrderedDict(b=np.ones(2), a=(np.arange(3), "s")),
        Meta(np.arange(5.0), "m"),
        dd,
        (),
        {"empty": np.zeros((0, 4), np.float32), "bytes": b"raw", "obj": np.array([1, None])},
    ]
    slot, encoded = _encode_here(pool, src)
    assert not isinstance(encoded.tree[4]["obj"], ArrayRef)  # object arrays are pickled
    batch = pool.open(slot, encoded.tree)
    assert batch[2].default_factory is list
    _assert_same(batch[:4], src[:4])
    assert batch[4]["empty"].shape == (0, 4)
    assert batch[4]["bytes"] == b"raw"
    assert batch[4]["obj"].tolist() == [1, None]


# --- the pool: reuse, cap, stale releases --------------------------------------------------


def test_reuse_and_the_cap() -> None:
    p = SlotPool(8 * PAGE, min_slot_bytes=PAGE)
    try:
        a = p.lease(PAGE)
        assert a is not None
        p.release(a)
        b = p.lease(PAGE // 2)
        assert b is not None
        assert b.name == a.name
        sizes = [b.size]
        while (s := p.lease(PAGE)) is not None:
            sizes.append(s.size)
            assert p.stats().bytes_total <= 8 * PAGE
        assert sum(sizes) <= 8 * PAGE
        assert p.stats().free == 0
        assert p.lease(1) is None  # at the cap, nothing free: caller goes inline
        assert p.lease(9 * PAGE) is None  # never fits
    finally:
        p.close()


def test_free_slots_too_small_are_dropped_to_make_room() -> None:
    p = SlotPool(16 * PAGE, min_slot_bytes=PAGE)
    try:
        # 2 pages each: the batch's (its alignment counted in its size), no slack
        small = [p.lease(2 * PAGE) for _ in range(6)]
        assert all(s is not None and s.size == 2 * PAGE for s in small)
        for s in small:
            p.release(s)  # type: ignore[arg-type]
        # Larger than every slot made: sizes vary, so headroom: 9 pages; 3 small ones must go.
        big = p.lease(7 * PAGE)
        assert big is not None
        assert big.size == _shm.page_round(math.ceil(7 * PAGE * _shm.GROWTH))
        gone = {s.name for s in small if s is not None} - _mine()
        assert len(gone) == 3
        stats = p.stats()
        assert (stats.slots, stats.free, stats.leased) == (4, 3, 1)
        assert stats.bytes_total == 15 * PAGE <= p.max_bytes
        # When the headroom does not fit under the cap, the batch's own size still may.
        p.release(big)
        exact = p.lease(15 * PAGE)
        assert exact is not None
        assert exact.size == _shm.slot_size(15 * PAGE, min_slot_bytes=PAGE) == 15 * PAGE
        assert p.stats().slots == 1
    finally:
        p.close()


def test_a_stale_release_never_frees_a_later_lease(pool: SlotPool) -> None:
    first = pool.lease(100)
    assert first is not None
    pool.release(first)
    pool.release(first)  # double release: ignored
    second = pool.lease(100)
    assert second is not None
    assert second.name == first.name
    pool.release(first)  # stale: must not free the second lease
    assert pool.stats().leased == 1
    third = pool.lease(100)
    assert third is not None
    assert third.name != second.name  # a different segment, never the one in use
    with pytest.raises(ValueError, match="not leased"):
        pool.open(first, {"x": ArrayRef(0, "<f4", (2,), "numpy")})
    batch = pool.open(second, {"x": ArrayRef(0, "<f4", (2,), "numpy")})
    pool.release(second)  # after open the views own the slot: ignored
    assert pool.stats().held == 1
    del batch


def test_open_rejects_a_descriptor_outside_the_slot(pool: SlotPool) -> None:
    slot = pool.lease(100)
    assert slot is not None
    with pytest.raises(ValueError, match="outside the slot"):
        pool.open(slot, [ArrayRef(slot.size - 4, "<f8", (1,), "numpy")])
    with pytest.raises(TypeError, match=r"Encoded\.tree"):
        pool.open(slot, Encoded({}, 0, 0, False))
    assert pool.stats().leased == 1  # still leased: the caller releases it
    pool.release(slot)
    assert pool.stats().free == 1


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        SlotPool(0)
    with pytest.raises(ValueError, match="min_slot_bytes=4096 must not exceed max_bytes=10"):
        SlotPool(10, min_slot_bytes=4096)
    p = SlotPool(1 << 20)
    try:
        with pytest.raises(ValueError, match="nbytes"):
            p.lease(-1)
        with pytest.raises(ValueError, match="count"):
            p.preflight(10, -2)
    finally:
        p.close()
    with pytest.raises(ValueError, match="buf"):
        SlotWriter(np.zeros(10, np.float32))
    with pytest.raises(ValueError, match=r"shape=.* negative"):
        SlotWriter(np.zeros(64, np.uint8)).alloc((2, -1), np.uint8)


@pytest.mark.parametrize(
    "dtype", [object, [("x", "<f4"), ("y", "<i2")], "V0"], ids=["object", "record", "void"]
)
def test_an_alloc_of_a_dtype_no_slot_holds_is_plain_memory_pickled_with_the_batch(
    dtype: Any,
) -> None:
    buf = np.zeros(1 << 16, np.uint8)
    writer = SlotWriter(buf)
    odd = writer.alloc(4, dtype)
    images = writer.alloc((4, 4096), np.uint8)
    assert not np.shares_memory(odd, buf)
    assert np.shares_memory(images, buf)
    images[...] = 7
    encoded = writer.encode({"odd": odd, "images": images}, inline_below=0)
    assert not encoded.inline
    assert encoded.tree["odd"] is odd  # pickled as it is, beside the descriptor
    assert isinstance(encoded.tree["images"], ArrayRef)
    assert encoded.tree["images"].offset == 0  # the odd one took no room in the slot


# --- inline: tiny batches and overflow -----------------------------------------------------


def test_tiny_batch_comes_back_inline_and_out_of_the_slot(pool: SlotPool) -> None:
    slot = pool.lease(1 << 20)
    assert slot is not None
    buf = attach(slot)
    writer = SlotWriter(buf)
    x = writer.alloc((4, 4), np.float32)
    x[:] = 2.0
    encoded = writer.encode({"x": x, "y": 3})
    assert encoded.inline
    assert encoded.used_bytes == 0
    assert not np.shares_memory(encoded.tree["x"], buf)  # the slot is about to be reused
    assert encoded.tree["x"].sum() == 32.0
    assert encoded.tree["y"] == 3
    pool.release(slot)


def test_alloc_overflow_sends_the_batch_inline(pool: SlotPool) -> None:
    slot = pool.lease(1)
    assert slot is not None
    writer = SlotWriter(attach(slot))
    fits = writer.alloc(slot.size // 8 - 8, np.float64)
    spill = writer.alloc((1000,), np.float64)
    assert writer.overflowed
    assert not np.shares_memory(spill, attach(slot))
    fits[:] = 1.0
    spill[:] = 2.0
    encoded = writer.encode([fits, spill])
    assert encoded.inline
    assert encoded.needed_bytes == writer.needed_bytes >= slot.size + 8000 - 64
    assert encoded.tree[0].sum() == fits.size
    assert encoded.tree[1].sum() == 2000.0
    pool.release(slot)


# --- close, janitor, faults ----------------------------------------------------------------


def test_close_with_live_views(pool: SlotPool) -> None:
    slot, encoded = _encode_here(pool, {"x": np.arange(10_000, dtype=np.int32)})
    batch = pool.open(slot, encoded.tree)
    spare = pool.lease(1)
    assert spare is not None
    pool.close()  # must not raise while batch["x"] exports the mapping
    pool.close()  # idempotent
    assert _mine() == set()
    assert int(batch["x"][9_999]) == 9_999  # still readable
    pool.release(spare)  # no-op after close
    with pytest.raises(RuntimeError, match="closed"):
        pool.lease(1)
    with pytest.raises(RuntimeError, match="closed"):
        pool.open(spare, {})
    del batch
    gc.collect()  # the finalizer of a closed pool's slot is harmless


@pytest.mark.parametrize("then", ["closed-again", "dropped"])
def test_a_close_interrupted_is_finished_by_the_next(
    monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """A second Ctrl-C while the segments are unlinked: the next close() unlinks the rest (the
    first had marked the pool closed; the rest stayed in /dev/shm until the exit's warning),
    and a pool dropped instead still has its finalizer, which unlinks them, saying so."""
    pool = SlotPool(1 << 24)
    slots = [pool.lease(1 << 20) for _ in range(3)]
    assert all(slot is not None for slot in slots)
    unlink = _shm._pool.unlink  # type: ignore[attr-defined]
    calls = 0

    def interrupted(name: str) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
        unlink(name)

    monkeypatch.setattr(_shm._pool, "unlink", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    assert pool.closed
    assert len(_mine()) == 2
    monkeypatch.setattr(_shm._pool, "unlink", unlink)
    if then == "dropped":
        with pytest.warns(ResourceWarning, match="never closed"):
            del pool  # the last reference: the finalizer runs here
        assert _mine() == set()
        return
    pool.close()
    assert _mine() == set()
    del pool
    gc.collect()  # no "never closed" warning (the suite turns warnings into errors)


def test_unclosed_pool_warns_and_unlinks() -> None:
    holder = [SlotPool(1 << 22)]
    slot = holder[0].lease(10)
    assert slot is not None
    with pytest.warns(ResourceWarning, match="never closed"):
        holder.clear()  # the last reference: no cycles, so the finalizer runs right here
    assert slot.name not in _mine()


def test_new_segments_have_their_pages_reserved(pool: SlotPool) -> None:
    slot = pool.lease(3 << 20)
    assert slot is not None
    st_ = os.stat(os.path.join(_shm.SHM_DIR, slot.name))
    assert st_.st_size == slot.size
    assert st_.st_blocks * 512 >= slot.size
    assert slot.size % PAGE == 0
    assert slot.size == _shm.slot_size(3 << 20) >= 3 << 20


def test_full_shm_raises_a_clear_error(pool: SlotPool, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    asked = _shm.slot_size(3 << 20)
    with pytest.raises(SharedMemoryError) as info:
        pool.lease(3 << 20)
    message = str(info.value)
    assert f"reserve {asked} bytes" in message
    free = re.search(r"has (\d+) bytes free", message)
    assert free is not None
    assert abs(int(free.group(1)) - pool.free_bytes()) < (64 << 20)
    assert "--shm-size" in message
    assert "prefetch" in message
    assert isinstance(info.value, MemoryError)
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC
    assert _mine() == set()
    assert pool.stats().slots == 0


def test_without_fallocate_pages_are_reserved_by_writing(
    pool: SlotPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def unsupported(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    slot = pool.lease(2 << 20)
    assert slot is not None
    assert calls == [slot.size]
    st_ = os.stat(os.path.join(_shm.SHM_DIR, slot.name))
    assert st_.st_size == slot.size
    assert st_.st_blocks * 512 >= slot.size


def test_janitor_removes_segments_of_dead_processes_only(pool: SlotPool) -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(done.stdout)
    dead = f"{_shm.SHM_PREFIX}{dead_pid}_deadbeef"
    alive_other = f"{_shm.SHM_PREFIX}{os.getppid()}_cafe0000"
    odd = f"{_shm.SHM_PREFIX}notapid_00000000"
    ours = pool.lease(1)
    assert ours is not None
    made = []
    try:
        for name in (dead, alive_other, odd):
            os.close(os.open(os.path.join(_shm.SHM_DIR, name), os.O_CREAT | os.O_EXCL, 0o600))
            made.append(name)
        removed = _shm.janitor()
        assert dead in removed
        assert not {alive_other, odd, ours.name} & set(removed)
        left = set(os.listdir(_shm.SHM_DIR))
        assert dead not in left
        assert {alive_other, odd, ours.name} <= left
    finally:
        for name in made:
            if os.path.exists(os.path.join(_shm.SHM_DIR, name)):
                os.unlink(os.path.join(_shm.SHM_DIR, name))


def test_preflight_warns_with_the_numbers(pool: SlotPool) -> None:
    huge = 1 << 50
    with pytest.warns(RuntimeWarning, match=rf"4 batches of {huge} bytes need {4 * huge} bytes"):
        pool.preflight(huge, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool.preflight(1024, 4)  # fits: silent


def test_worker_cache_drops_mappings_of_unlinked_segments() -> None:
    first = SlotPool(1 << 22)
    second = SlotPool(1 << 22)
    try:
        a, b = first.lease(1), second.lease(1)
        assert a is not None
        assert b is not None
        attach(a)
        assert attach(a) is attach(a)  # cached
        first.close()  # unlinks a; a mapping of it would pin its memory
        attach(b)
        assert a.name not in _shm.attached
        assert b.name in _shm.attached
        with pytest.raises(FileNotFoundError):
            attach(a)
    finally:
        first.close()
        second.close()
        _shm.detach_all()
    assert not _shm.attached


def test_shm_available_here() -> None:
    assert _shm.shm_available() is os.path.isdir("/dev/shm")


# --- properties ----------------------------------------------------------------------------

_dtypes = st.sampled_from(["u1", "<i2", "<i4", "<i8", "<f2", "<f4", ">f8", "<c8", "?", "<M8[s]"])
_arrays = hnp.arrays(
    _dtypes, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6)
).flatmap(
    lambda a: st.sampled_from([a, a.T, a[..., ::2] if a.ndim else a])  # some non-contiguous
)
_leaves = _arrays | st.integers() | st.text(max_size=3) | st.none()
_trees = st.recursive(
    _leaves,
    lambda kids: (
        st.lists(kids, max_size=3)
        | st.dictionaries(st.text(max_size=2), kids, max_size=3)
        | st.tuples(kids, kids)
    ),
    max_leaves=8,
)


def test_any_tree_round_trips_through_a_slot() -> None:
    pool = SlotPool(16 << 20)
    try:

        @settings(max_examples=80, deadline=None)
        @given(tree=_trees)
        def check(tree: Any) -> None:
            slot, encoded = _encode_here(pool, tree)
            if encoded.inline:  # no arrays at all
                pool.release(slot)
                _assert_same(encoded.tree, tree)
                return
            batch = pool.open(slot, encoded.tree)
            _assert_same(batch, tree)
            lo, hi = _segment_span(pool, slot)
            for leaf in iter_leaves(batch):
                if isinstance(leaf, np.ndarray) and leaf.nbytes:
                    assert lo <= _address(leaf)
                    assert _address(leaf) + leaf.nbytes <= hi
            del batch, leaf
            assert pool.stats().free == pool.stats().slots

        check()
    finally:
        pool.close()
        _shm.detach_all()


class PoolMachine(RuleBasedStateMachine):
    """Random leases, releases (double and stale too), opens and drops against a small cap."""

    MAX = 12 * PAGE

    def __init__(self) -> None:
        super().__init__()
        self.pool = SlotPool(self.MAX, min_slot_bytes=PAGE)
        self.leased: list[Slot] = []
        self.released: list[Slot] = []
        self.held: list[tuple[Slot, Any, int]] = []
        self.marks = 0

    def _busy(self) -> set[str]:
        return {s.name for s in self.leased} | {s.name for s, _, _ in self.held}

    @rule(nbytes=st.integers(0, 5 * PAGE))
    def lease(self, nbytes: int) -> None:
        slot = self.pool.lease(nbytes)
        busy_bytes = sum(s.size for s in self.leased) + sum(s.size for s, _, _ in self.held)
        if slot is None:
            assert busy_bytes + _shm.page_round(max(nbytes, PAGE)) > self.MAX
            return
        assert slot.size >= nbytes
        assert slot.name not in self._busy()
        self.leased.append(slot)

    @precondition(lambda self: self.leased)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        slot = self.leased.pop(data.draw(st.integers(0, len(self.leased) - 1)))
        self.pool.release(slot)
        self.released.append(slot)

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def stale_release(self, data: st.DataObject) -> None:
        self.pool.release(data.draw(st.sampled_from(self.released)))

    @precondition(lambda self: self.leased)
    @rule(data=st.data())
    def open(self, data: st.DataObject) -> None:
        slot = self.leased.pop(data.draw(st.integers(0, len(self.leased) - 1)))
        self.marks += 1
        writer = SlotWriter(attach(slot))
        arr = writer.alloc(slot.size // 8, np.int64)
        arr[:] = self.marks  # fills the whole slot: a second user would overwrite it
        batch = self.pool.open(slot, writer.encode({"x": arr}, inline_below=0).tree)
        self.held.append((slot, batch, self.marks))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))

    @invariant()
    def accounting(self) -> None:
        stats = self.pool.stats()
        assert stats.leased == len(self.leased)
        assert stats.held == len(self.held)
        assert stats.slots == stats.free + stats.leased + stats.held
        assert stats.bytes_total <= self.MAX

    @invariant()
    def free_slots_beyond_need_are_given_back_when_nothing_is_in_use(self) -> None:
        stats = self.pool.stats()
        if stats.leased == stats.held == 0:
            assert stats.free <= self.pool.keep + KEEP_SPARE
        assert self.pool.keep >= max(1, stats.leased)

    @invariant()
    def held_batches_are_intact(self) -> None:
        for _, batch, mark in self.held:
            assert (batch["x"] == mark).all()

    def teardown(self) -> None:
        self.held.clear()
        self.pool.close()
        _shm.detach_all()


PoolMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
test_pool_state_machine = PoolMachine.TestCase


def test_map_hooks_see_each_segment_once_with_its_address() -> None:
    """on_map/on_unmap let the device stage page-lock each slot once (cudaHostRegister)."""
    mapped: dict[int, int] = {}
    unmapped: list[int] = []
    pool = SlotPool(
        8 << 20, min_slot_bytes=1 << 20, on_map=mapped.__setitem__, on_unmap=unmapped.append
    )
    try:
        first = pool.lease(1000)
        assert first is not None
        pool.release(first)
        again = pool.lease(1000)  # reused: no second registration
        assert again is not None
        assert again.name == first.name
        assert len(mapped) == 1
        ((address, size),) = mapped.items()
        assert size == first.size
        buf = attach(again)  # the worker's own mapping is elsewhere; ours starts at `address`
        assert buf.nbytes == first.size
        pool.release(again)
    finally:
        pool.close()
        _shm.detach_all()
    assert unmapped == [address]


def test_a_failing_map_hook_does_not_break_leasing() -> None:
    def boom(address: int, size: int) -> None:
        raise RuntimeError("cudaHostRegister failed")

    pool = SlotPool(4 << 20, min_slot_bytes=1 << 20, on_map=boom)
    try:
        slot = pool.lease(10)
        assert slot is not None
        pool.release(slot)
    finally:
        pool.close()


def test_reuse_never_creates_a_segment() -> None:
    pool = SlotPool(8 << 20, min_slot_bytes=1 << 20)
    try:
        assert pool.reuse(1000) is None  # nothing free yet, and reuse does not create
        assert pool.stats().slots == 0
        slot = pool.lease(1000)
        assert slot is not None
        pool.release(slot)
        again = pool.reuse(1000)
        assert again is not None
        assert again.name == slot.name
        assert pool.reuse(1000) is None  # the only slot is leased now
        pool.release(again)
    finally:
        pool.close()


# --- file descriptors: a live batch holds none (RELIABILITY.md row 22) -----------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mapped_in(pid: int | str, name: str) -> bool:
    """Whether process ``pid`` has segment ``name`` mapped (``/proc/<pid>/maps``)."""
    with open(f"/proc/{pid}/maps") as maps:
        return any(line.rstrip().endswith(f"/{name}") or f"/{name} " in line for line in maps)


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self")


@needs_proc
def test_held_batches_and_cached_attachments_hold_no_descriptor(pool: SlotPool) -> None:
    before = _open_fds()
    batches = []
    for i in range(8):  # each: a new segment, mapped by the pool and by attach(), then held
        slot = pool.lease(2 << 20)
        assert slot is not None
        encoded = SlotWriter(attach(slot)).encode({"x": np.full(1000, i)}, inline_below=0)
        batches.append(pool.open(slot, encoded.tree))
    assert pool.stats().held == 8
    assert len(_shm.attached) == 8
    assert _open_fds() == before
    assert [int(b["x"][999]) for b in batches] == list(range(8))


@needs_proc
def test_a_mapping_lives_exactly_as_long_as_its_last_view() -> None:
    pool = SlotPool(8 << 20)
    try:
        slot, encoded = _encode_here(pool, {"x": np.arange(10_000, dtype=np.int32)})
        kept = pool.open(slot, encoded.tree)["x"][5:]
        _shm.detach_all()  # the worker side lets go of its mapping at once
        pool.close()  # unlinked; the pool's mapping is left to the view
        assert slot.name not in _mine()
        assert _mapped_in("self", slot.name)
        assert int(kept[-1]) == 9_999  # still readable
    finally:
        pool.close()
        _shm.detach_all()
    del kept
    gc.collect()
    assert not _mapped_in("self", slot.name)  # unmapped with its last view: memory given back


def test_a_name_taken_already_is_retried_under_a_fresh_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioloader._shm import _segment

    taken, _ = _shm.create_segment(1 << 16, _shm.SHM_DIR)
    fresh = _segment.new_name()
    names = iter([taken, taken, fresh])
    monkeypatch.setattr(_segment, "new_name", lambda: next(names))
    try:
        name, mapping = _shm.create_segment(1 << 16, _shm.SHM_DIR)
        assert name == fresh  # two attempts hit the taken name; the third is new
        del mapping  # unmapped when the last reference goes
    finally:
        _shm.unlink(taken)
        _shm.discard(fresh)


# --- what a burst leaves behind ------------------------------------------------------------


def _hold(pool: SlotPool, count: int) -> list[Any]:
    """``count`` batches held at once, each leased and opened before the next (one in flight)."""
    held = []
    for i in range(count):
        slot = pool.lease(PAGE)
        assert slot is not None
        writer = SlotWriter(attach(slot))
        arr = writer.alloc(PAGE // 8, np.int64)
        arr[:] = i
        held.append(pool.open(slot, writer.encode({"x": arr}, inline_below=0).tree))
    return held


def test_an_epochs_slots_outlive_its_end_when_its_batches_were_dropped() -> None:
    # An epoch of a training loop: two batches made at once (prefetch), two more waiting to be
    # taken, then every batch dropped as the epoch ends (``for _ in range(epochs)`` rebinds
    # the name) with nothing leased. The next epoch needs as many slots: given back and made
    # again, each new segment's pages were faulted in afresh (a quarter of the rate of large
    # batches). What was leased at once and the consumer's spare ones stay.
    p = SlotPool(64 * PAGE, min_slot_bytes=PAGE)
    try:
        held = []
        for _ in range(2):  # two rounds of two batches made at once
            slots = [p.lease(PAGE), p.lease(PAGE)]
            for slot in slots:
                assert slot is not None
                writer = SlotWriter(attach(slot))
                arr = writer.alloc(PAGE // 8, np.int64)
                held.append(p.open(slot, writer.encode({"x": arr}, inline_below=0).tree))
        assert p.keep == 2
        names = _mine()
        assert len(names) == 4
        del held, arr
        gc.collect()
        assert (p.stats().free, _mine()) == (4, names)  # 2 leased at once + KEEP_SPARE
        again = _hold(p, 2)  # the next epoch makes no segment
        assert _mine() == names
        del again
    finally:
        p.close()
        _shm.detach_all()


def test_a_dropped_burst_is_given_back_without_another_call() -> None:
    # An evaluation pass kept every batch (list(loader)), then dropped them: the pool keeps
    # what an epoch in flight needs (one slot leased at a time here, and the consumer's
    # spare ones), and no more, even if the program never calls the loader again.
    p = SlotPool(64 * PAGE, min_slot_bytes=PAGE)
    try:
        burst = _hold(p, 12)
        assert len(_mine()) == 12
        del burst
        gc.collect()
        assert len(_mine()) == 1 + KEEP_SPARE  # unlinked as the batches died, not at a call
        assert (p.stats().slots, p.stats().free, p.keep) == (3, 3, 1)
        again = _hold(p, 1)  # a slot kept is reused
        assert len(_mine()) == 1 + KEEP_SPARE
        del again
    finally:
        p.close()
        _shm.detach_all()


def test_while_batches_are_made_idle_slots_go_after_a_grace_period() -> None:
    now = [0.0]
    p = SlotPool(64 * PAGE, min_slot_bytes=PAGE, clock=lambda: now[0], keep_spare=0)
    try:
        burst = _hold(p, 4)
        making = p.lease(PAGE)  # an epoch in flight: a batch being made
        assert making is not None
        del burst
        gc.collect()
        assert p.stats().free == 4  # a burst may come again: kept for a while
        now[0] += IDLE_GRACE_S - 0.1
        assert p.stats().free == 4
        now[0] += 0.2
        assert (p.stats().free, p.stats().leased) == (1, 1)  # beyond keep (1): given back
        p.release(making)  # nothing leased: no more than keep stay
        assert (p.stats().slots, p.stats().free) == (1, 1)
        assert len(_mine()) == 1
    finally:
        p.close()
        _shm.detach_all()


def test_the_slots_an_epoch_leases_at_once_are_kept() -> None:
    p = SlotPool(64 * PAGE, min_slot_bytes=PAGE)
    try:
        slots = [p.lease(PAGE) for _ in range(3)]  # prefetch 3: three in flight at once
        for slot in slots:
            assert slot is not None
            p.release(slot)
        assert (p.keep, p.stats().free) == (3, 3)  # the next epoch reuses them all
    finally:
        p.close()


def _odd_leaves() -> list[Any]:
    import torch

    leaves: list[Any] = [
        b"x" * 10,
        b"x" * (1 << 17),
        np.zeros(8, np.float32),
        np.zeros(8, [("a", "<f4")]),
        np.zeros(3, object),
        np.ma.masked_array(np.zeros(8)),
        np.zeros((4, 4), np.int16).T,
        7,
        "text",
    ]
    for dtype in (torch.float32, torch.bfloat16, torch.complex64, torch.bool, torch.float16):
        leaves.append(torch.ones(5, 3, dtype=dtype))
    leaves.append(torch.ones(4, 4).t())
    leaves.append(torch.ones(4).to_sparse())
    with warnings.catch_warnings():  # quantized and nested tensors are said to be changing
        warnings.simplefilter("ignore")
        leaves.append(torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint8))
        leaves.append(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))
    leaves.append(torch.ones(3, requires_grad=True))
    return leaves


def test_a_leaf_counts_in_a_batch_s_size_as_the_slot_writer_places_it() -> None:
    from aioloader._shm._descriptors import _as_numpy, slot_nbytes

    for leaf in _odd_leaves():
        found = _as_numpy(leaf)
        expected = int(found[0].nbytes) if found is not None else 0
        assert slot_nbytes(leaf) == expected, repr(leaf)[:60]
