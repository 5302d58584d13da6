"""A /dev/shm that fills up while the loader runs costs no batch (RELIABILITY row 20).

Where a segment cannot be had, the batch travels inline instead: every sample is delivered
exactly once, one warning is logged, and ``statistics().shm_fallbacks`` counts the batches.
The allocation failure is injected in the main process (the only one that creates segments), at
the loader level, with real worker processes.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from aioloader import DataLoader, SharedMemoryError, _shm

BOUND_S = 30.0


class Images:
    """128 KiB per sample, each filled with its index: batches go through shared memory."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> Any:
        return np.full((128, 1024), i, dtype=np.uint8)


def _filling_up(after: int) -> Any:
    """A SlotPool.lease that works ``after`` times, then finds /dev/shm full."""
    real = _shm.SlotPool.lease
    calls = {"n": 0}

    def lease(self: Any, nbytes: int) -> Any:
        calls["n"] += 1
        if calls["n"] > after:
            raise SharedMemoryError(f"cannot reserve {nbytes} bytes: /dev/shm has 0 bytes free")
        return real(self, nbytes)

    return lease


@pytest.mark.parametrize("after", [0, 2])
def test_a_full_dev_shm_sends_batches_inline_and_loses_none(
    after: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_shm.SlotPool, "lease", _filling_up(after))
    caplog.set_level(logging.WARNING, logger="aioloader")
    with DataLoader(Images(), batch_size=4, num_workers=2, prefetch=6, timeout=BOUND_S) as loader:
        for _ in range(2):  # two epochs: the fallback holds on
            # Every batch kept until the epoch ends, so slots keep being leased: the first ones
            # (made by the workers before the batch size was known) cannot serve them all.
            batches = list(loader)
            seen = [int(v) for batch in batches for v in batch[:, 0, 0].tolist()]
            del batches
            assert sorted(seen) == list(range(48))  # nothing lost, nothing twice
            assert seen == list(range(48))  # and in order
        stats = loader.statistics()
    assert stats.shm_fallbacks > 0
    assert stats.batches_yielded == 24
    warnings = [r for r in caplog.records if "travel inline" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "/dev/shm has 0 bytes free" in warnings[0].getMessage()


# -- the cap holds from the first batch, and every batch it sends inline is counted -----------


def _watched_epoch(loader: Any) -> tuple[list[int], int]:
    """One epoch's first sample values, in order, and the most shared memory the loader held
    after any batch (each batch dropped before the next, as a training step does)."""
    seen: list[int] = []
    most = 0
    for batch in loader:
        seen.extend(int(v) for v in batch[:, 0, 0].tolist())
        del batch
        most = max(most, loader.statistics().shm_bytes)
    return seen, most


def test_the_first_batches_stay_under_the_cap(caplog: pytest.LogCaptureFixture) -> None:
    # 512 KiB batches and room for about 4 of them: before their size is known, the workers
    # make the segments of the first prefetched batches; those come out of the cap too.
    cap = 3 << 20
    caplog.set_level(logging.INFO, logger="aioloader.shm")
    with DataLoader(
        Images(), batch_size=4, num_workers=2, prefetch=10, shm_max_bytes=cap, timeout=BOUND_S
    ) as loader:
        for _ in range(2):
            seen, most = _watched_epoch(loader)
            assert seen == list(range(48))
            assert most <= cap
        stats = loader.statistics()
    assert stats.shm_bytes <= cap
    assert stats.live_shm_slots >= 1  # the cap was used, not refused
    said = [r for r in caplog.records if "travel inline" in r.getMessage()]
    assert len([r for r in said if r.levelno == logging.WARNING]) == min(stats.shm_fallbacks, 1)


def test_batches_over_the_cap_all_travel_inline_and_are_all_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 2 MiB batches against a 1.5 MiB cap: not one fits, the first ones included.
    caplog.set_level(logging.WARNING, logger="aioloader.shm")
    with DataLoader(
        Images(), batch_size=16, num_workers=2, prefetch=4, shm_max_bytes=3 << 19, timeout=BOUND_S
    ) as loader:
        seen, most = _watched_epoch(loader)
        stats = loader.statistics()
    assert seen == list(range(48))
    assert most == 0
    assert stats.shm_fallbacks == 3  # every batch, each once
    (warning,) = [r.getMessage() for r in caplog.records if "travel inline" in r.getMessage()]
    assert "shm_max_bytes" in warning


def test_without_room_for_a_pool_every_large_batch_is_counted(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # /dev/shm with no room when the loader starts (a quarter of nothing is its default cap).
    monkeypatch.setattr("aioloader._shm.budget", lambda max_bytes, free=None: 0)
    caplog.set_level(logging.WARNING, logger="aioloader.shm")
    with DataLoader(Images(), batch_size=4, num_workers=2, timeout=BOUND_S) as loader:
        seen, _ = _watched_epoch(loader)
        stats = loader.statistics()
    assert seen == list(range(48))
    assert stats.shm_fallbacks == 12
    (warning,) = [r.getMessage() for r in caplog.records if "travel inline" in r.getMessage()]
    assert "--shm-size" in warning


def test_no_shared_memory_by_choice_is_not_a_fallback(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="aioloader.shm")
    with DataLoader(
        Images(), batch_size=4, num_workers=2, shm_max_bytes=0, timeout=BOUND_S
    ) as loader:
        seen, most = _watched_epoch(loader)
        stats = loader.statistics()
    assert seen == list(range(48))
    assert (most, stats.shm_fallbacks) == (0, 0)
    assert not [r for r in caplog.records if "travel inline" in r.getMessage()]
