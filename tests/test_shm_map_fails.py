"""The training process cannot map shared memory (RELIABILITY.md row 20's promise: batches go
inline, counted, never failed).

``/dev/shm`` may have room while this process has no address space or memory map left for a
segment (``ulimit -v``, ``vm.max_map_count``, strict overcommit): the kernel refuses the
``mmap`` (ENOMEM). Injected in the training process only, by failing its mapping call: the
worker processes map for real.

- a segment the pool would make for a batch: the batch travels inline, counted;
- the segment a worker made for one of a loader's first batches (before their size is known),
  which the training process cannot map: a map-style batch is made again, inline, counted; a
  stream's batch (whose items cannot be read again) fails with ``SharedMemoryError``, naming
  why, and its reader ends, as after any failed batch of a stream.
"""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import pytest
from fault_datasets import Faulty, batch_indices, make_loader

from aioloader import SharedMemoryError
from aioloader._shm import _pool, _segment

pytestmark = pytest.mark.usefixtures("baseline")

BOUND_S = 60.0
SHAPE = (64, 1024)  # 64 KiB samples: batches of 256 KiB, in slots


def refuse_adopting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fails this process's mapping of the segments workers make (their names, as refused)."""
    refused: list[str] = []

    def map_or_refuse(slot: Any) -> Any:
        refused.append(slot.name)
        raise OSError(errno.ENOMEM, f"mmap of {slot.size} bytes failed: Cannot allocate memory")

    monkeypatch.setattr(_pool, "map_shared", map_or_refuse)
    return refused


class Refusing:
    """Fails this process's shared mappings with ENOMEM while ``on``; counts the refusals."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on = False
        self.refused = 0
        real = _segment._map

        def map_or_refuse(fd: int, size: int, *args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.refused += 1
                raise OSError(errno.ENOMEM, f"mmap of {size} bytes failed: Cannot allocate memory")
            return real(fd, size, *args, **kwargs)

        monkeypatch.setattr(_segment, "_map", map_or_refuse)


async def test_a_segment_this_process_cannot_map_sends_the_batch_inline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refusing = Refusing(monkeypatch)
    async with asyncio.timeout(BOUND_S):
        async with make_loader(Faulty(64, shape=SHAPE), num_workers=1, prefetch=2) as loader:
            it = aiter(loader)
            held = [await anext(it) for _ in range(3)]  # held: later batches need new slots
            refusing.on = True
            rest = [b async for b in it]
            seen = [i for batch in held + rest for i in batch_indices(batch)]
            assert seen == list(range(64))  # every batch, once, in order
            assert refusing.refused > 0
            assert loader.statistics().shm_fallbacks == refusing.refused


async def test_a_first_batch_whose_segment_cannot_be_mapped_is_made_again_inline(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    refused = refuse_adopting(monkeypatch)  # the workers make the segments of the first ones
    async with asyncio.timeout(BOUND_S):
        async with make_loader(Faulty(64, shape=SHAPE), num_workers=2) as loader:
            seen = [i async for batch in loader for i in batch_indices(batch)]
            assert seen == list(range(64))  # each batch once, in order: made again inline
            assert refused
            assert loader.statistics().shm_fallbacks >= 1
    assert "could not be mapped" in caplog.text
    assert not [name for name in refused if _segment.segment_exists(name)]  # unlinked


class Records:
    """A stream of 64 KiB records (not resumable): record ``i`` filled with ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        import numpy as np

        for i in range(self.n):
            yield np.full(SHAPE, i, dtype=np.uint8)


async def test_a_streams_first_batch_that_cannot_be_mapped_fails_named_and_ends_its_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = refuse_adopting(monkeypatch)
    async with asyncio.timeout(BOUND_S):
        async with make_loader(Records(32), num_workers=1, prefetch=1) as loader:
            it = aiter(loader)
            with pytest.raises(SharedMemoryError, match="could not be mapped"):
                await anext(it)  # its items were read: they cannot be read again
            # As after any failed batch of a stream, its reader has ended (the one worker's):
            # the epoch ends, at once, not waiting for ever.
            assert [b async for b in it] == []
            assert len(refused) == 1
    assert not _segment.segment_exists(refused[0])
