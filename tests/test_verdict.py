"""The bottleneck verdict, proven the way a user uses it: follow its advice, the rate moves.

Each test runs a deliberately slowed pipeline for one short epoch, reads the verdict, turns the
knob it names, and runs the epoch again: the rate must rise by a clear factor (the delays are
sleeps, so the factor holds on a busy machine: a sleeping thread needs no CPU). A pipeline bound
by the CPUs themselves must be named as such, with no knob offered. Rates are compared within a
test, never against a number of the machine (speed itself is measured in ``benchmarks/``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from datasets import AsyncRange, Slow

from aioloader import DataLoader
from aioloader._stats._counters import EpochStatistics, cpus_available

# Sleep-bound pipelines speed up by ~2-4x when the knob is turned; a clear margin below that
# keeps a loaded machine from failing them, and well above noise.
FASTER = 1.4


async def epoch_stats(dataset: Any, step_s: float = 0.0, **settings: Any) -> EpochStatistics:
    """One epoch of ``dataset`` with ``settings``, the consumer taking ``step_s`` per batch."""
    async with DataLoader(dataset, **settings) as loader:
        async for _ in loader:
            if step_s:
                await asyncio.sleep(step_s)
        return loader.statistics().epoch_stats


async def test_num_workers_verdict_raises_the_rate_when_followed() -> None:
    slowed = await epoch_stats(Slow(40, 0.02), batch_size=4, num_workers=2, thread_pool=True)
    assert (slowed.bottleneck, slowed.knob) == ("workers", "num_workers"), slowed.hint
    followed = await epoch_stats(Slow(40, 0.02), batch_size=4, num_workers=8, thread_pool=True)
    assert followed.samples_per_s > FASTER * slowed.samples_per_s


async def test_io_concurrency_verdict_raises_the_rate_when_followed() -> None:
    slowed = await epoch_stats(AsyncRange(48, delay=0.03), batch_size=8, io_concurrency=4)
    assert (slowed.bottleneck, slowed.knob) == ("io", "io_concurrency"), slowed.hint
    followed = await epoch_stats(AsyncRange(48, delay=0.03), batch_size=8, io_concurrency=16)
    assert followed.samples_per_s > FASTER * slowed.samples_per_s


async def test_prefetch_verdict_raises_the_rate_when_followed() -> None:
    # Eight threads, but prefetch=2 lets only two batches be made at once.
    settings = {"batch_size": 4, "num_workers": 8, "thread_pool": True}
    slowed = await epoch_stats(Slow(40, 0.02), prefetch=2, **settings)
    assert slowed.knob == "prefetch", slowed.hint
    followed = await epoch_stats(Slow(40, 0.02), prefetch=8, **settings)
    assert followed.samples_per_s > FASTER * slowed.samples_per_s


async def test_consumer_verdict_means_the_step_not_the_loader() -> None:
    # The loader keeps up: its verdict names the training step, and a faster step is faster.
    slowed = await epoch_stats(Slow(64, 0.0), step_s=0.02, batch_size=4)
    assert (slowed.bottleneck, slowed.knob) == ("consumer", ""), slowed.hint
    followed = await epoch_stats(Slow(64, 0.0), step_s=0.005, batch_size=4)
    assert followed.samples_per_s > FASTER * slowed.samples_per_s


class SlowStream:
    """An async iterable dataset whose every item arrives ``delay`` seconds after the last (a
    feed read one record at a time)."""

    def __init__(self, n: int, delay: float) -> None:
        self.n = n
        self.delay = delay

    async def __aiter__(self) -> AsyncIterator[int]:
        for i in range(self.n):
            await asyncio.sleep(self.delay)
            yield i


async def test_source_verdict_raises_the_rate_when_followed() -> None:
    # The verdict says: the stream is read one item at a time on the loop, use a map-style
    # dataset. The same items behind an async map-style dataset are fetched 8 at a time.
    slowed = await epoch_stats(SlowStream(32, 0.01), batch_size=4)
    assert (slowed.bottleneck, slowed.knob) == ("source", ""), slowed.hint
    assert "map-style" in slowed.hint
    followed = await epoch_stats(AsyncRange(32, delay=0.01), batch_size=4, io_concurrency=8)
    assert followed.samples_per_s > FASTER * slowed.samples_per_s


class Burn:
    """A map-style dataset whose every sample costs ``ms`` milliseconds of CPU (a decode)."""

    def __init__(self, n: int, ms: float) -> None:
        self.n = n
        self.ms = ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        end = time.thread_time() + self.ms / 1e3
        x = 0
        while time.thread_time() < end:  # bounded: CPU time always advances while it runs
            x += 1
        return np.full(64, index, dtype=np.int64)


def warm_epoch_stats(dataset: Any, **settings: Any) -> EpochStatistics:
    """The second (warm: workers started) epoch's statistics, iterated with ``for``."""
    with DataLoader(dataset, **settings) as loader:
        for _ in range(2):
            for _batch in loader:
                pass
        return loader.statistics().epoch_stats


def test_a_cpu_bound_pipeline_names_the_machine_and_no_knob() -> None:
    # As many worker processes as the CPUs this process may use, each sample 15 ms of CPU: the
    # cores are full (a decode-bound ImageNet pipeline on a small machine). "raise num_workers"
    # or "raise prefetch" would be false advice.
    workers = max(1, int(cpus_available()))
    stats = warm_epoch_stats(Burn(48 * workers, 15.0), batch_size=4, num_workers=workers)
    assert stats.bottleneck == "cpu", stats.hint
    assert stats.knob == ""
    assert "the machine is the limit" in stats.hint
    assert stats.cpu_share + stats.cpu_wait_share >= 0.85
