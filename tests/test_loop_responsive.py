"""The loader never blocks the event loop it runs on.

A dataset whose ``__getitem__`` blocks (``time.sleep``, standing in for a slow disk or a decoder)
is loaded while a ticker coroutine on the same loop sleeps 5 ms at a time and records how late
each wake-up is. All blocking work must happen off the loop (the helper thread, a thread pool):
no read runs on the loop's thread (the dataset records the threads it is read on), and the
ticker keeps its pace (a 50 ms read on the loop would show as a 50 ms lag).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from typing import Any

import pytest
from datasets import Slow

from aioloader import DataLoader

READ_S = 0.05  # each sample blocks its reader this long
TICK_S = 0.005  # the ticker's period
# Half a read. Reads on the loop would block it for most of the ~1 s the reads take, so most
# ticks would lag by about READ_S. The ticks' p99 is no measure of that here: on a shared
# 2-core machine under load, scheduling alone put it at 40-54 ms with nothing on the loop
# (fresh-clone CI runs); the median stays at scheduling noise.
MAX_MEDIAN_LAG_S = READ_S / 2
BOUND_S = 20.0


class ReadOn(Slow):
    """:class:`Slow`, recording the thread of every read (in this process: threads only)."""

    def __init__(self, n: int, delay: float) -> None:
        super().__init__(n, delay)
        self.threads: set[int] = set()

    def __getitem__(self, index: int) -> int:
        self.threads.add(threading.get_ident())
        return super().__getitem__(index)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def _load_while_ticking(
    dataset: Slow, batch_size: int, **kwargs: Any
) -> tuple[list[int], list[float]]:
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            started = time.perf_counter()  # uvloop's loop.time() only has 1 ms resolution
            await asyncio.sleep(TICK_S)
            lags.append(time.perf_counter() - started - TICK_S)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)  # the ticker is running before the loader starts
    try:
        async with asyncio.timeout(BOUND_S):
            async with DataLoader(dataset, batch_size=batch_size, **kwargs) as loader:
                items = [i for batch in [b async for b in loader] for i in batch.tolist()]
    finally:
        stop.set()
        await task
    return items, lags


@pytest.mark.parametrize(
    ("n", "batch_size", "kwargs"),
    [
        (20, 1, {}),  # the helper thread: 20 batches, ~1 s of blocking reads
        (80, 4, {"num_workers": 4, "thread_pool": True}),  # 20 batches over 4 threads, ~1 s
    ],
    ids=["helper-thread", "thread-pool"],
)
async def test_blocking_reads_never_block_the_loop(
    n: int, batch_size: int, kwargs: dict[str, Any]
) -> None:
    dataset = ReadOn(n, READ_S)
    items, lags = await _load_while_ticking(dataset, batch_size, **kwargs)
    assert items == list(range(n))
    assert threading.get_ident() not in dataset.threads  # no read ran on the loop's thread
    # Blocking reads take n * READ_S / threads seconds; the ticker must have run all along.
    threads = kwargs.get("num_workers", 0) or 1
    assert len(lags) >= 0.5 * (n * READ_S / threads) / TICK_S
    median = statistics.median(lags)
    assert median < MAX_MEDIAN_LAG_S, (
        f"median lag {median * 1e3:.1f} ms, p99 {p99(lags) * 1e3:.1f}, max {max(lags) * 1e3:.1f}"
    )
