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
