"""Why is my training slow? Three deliberately slowed pipelines and the loader's verdict on each.

    python examples/why_slow.py                    # --case dataset: reading is slow: num_workers
    python examples/why_slow.py --case remote      # remote reads are slow: io_concurrency
    python examples/why_slow.py --case consumer    # the training step is slow: not the loader
    python examples/why_slow.py --case cpu         # the CPUs are full: no knob helps

Each case runs one epoch with a setting that is too small (two for ``consumer`` and ``cpu``,
whose verdict is of the second: the first one's start would weigh too much in so short an
epoch), prints ``loader.statistics()`` (a table of the last epoch and the total, then the
bottleneck verdict), and runs again with the knob the verdict names turned up (``--no-fix``
skips that). With logging configured
(``--log``), the loader also logs each epoch's verdict itself (``aioloader.epoch``, at INFO: an
epoch this short is never a WARNING, see the README's Logging section).

- ``dataset``: each sample takes 20 ms to read (a ``time.sleep`` standing in for a decode or a
  blocking read) in one worker process; the consumer takes no time. The worker is busy all the
  time and the consumer waits for it: more workers help.
- ``remote``: an async dataset whose every item answers after 50 ms (an ``asyncio.sleep``
  standing in for an object store's latency) with ``io_concurrency=4``: four requests in flight
  is far too few to hide the latency.
- ``consumer``: batches are cheap, and the training step takes 20 ms: the loader keeps up, and
  no setting of the loader makes the epoch shorter.
- ``cpu``: each sample costs 10 ms of CPU (a decode) in one worker process per CPU: the cores
  are full, and the verdict names the machine. Its "fix" runs twice the workers, to show that
  they do not help: the rate stays where it was.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from typing import Any

import numpy as np

# Imported up front, as a training script does: the batches are torch tensors, and torch's
# import (about a second) would otherwise fall inside the first (and here only) epoch measured.
import torch  # noqa: F401

import aioloader

SAMPLE_S = 0.02  # the dataset case: seconds to read one sample
LATENCY_S = 0.05  # the remote case: seconds until an item arrives
STEP_S = 0.02  # the consumer case: seconds per training step
BURN_S = 0.01  # the cpu case: CPU seconds per sample


class SlowReads:
    """A map-style dataset whose ``__getitem__`` blocks for ``delay`` seconds."""

    def __init__(self, n: int, delay: float) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        time.sleep(self.delay)
        return np.full(256, index, dtype=np.float32)


class Decode:
    """A map-style dataset whose ``__getitem__`` costs ``cost`` seconds of CPU (a decode)."""

    def __init__(self, n: int, cost: float) -> None:
        self.n = n
        self.cost = cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        end = time.thread_time() + self.cost
        while time.thread_time() < end:  # CPU time advances while this runs: it ends
            pass
        return np.full(256, index, dtype=np.float32)


class RemoteStore:
    """An async map-style dataset: every item arrives ``latency`` seconds after it is asked."""

    def __init__(self, n: int, latency: float) -> None:
        self.n = n
        self.latency = latency

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> np.ndarray:
        await asyncio.sleep(self.latency)
        return np.full(256, index, dtype=np.float32)


def case_settings(case: str, n: int, fixed: bool) -> tuple[Any, dict[str, Any], float]:
    """The dataset, the loader's arguments and the consumer's seconds per step of ``case``."""
    if case == "dataset":
        # One worker, or one per CPU (at least two) to show the difference.
        workers = max(2, os.cpu_count() or 1) if fixed else 1
        return SlowReads(n, SAMPLE_S), {"num_workers": workers}, 0.0
    if case == "remote":
        return RemoteStore(n, LATENCY_S), {"io_concurrency": 64 if fixed else 4}, 0.0
    if case == "consumer":
        return SlowReads(n, 0.0), {"num_workers": 0}, STEP_S
    if case == "cpu":
        cpus = len(os.sched_getaffinity(0))
        return Decode(n, BURN_S), {"num_workers": 2 * cpus if fixed else cpus}, 0.0
    raise ValueError(f"unknown case {case!r}")


async def run(case: str, n: int, *, fixed: bool) -> aioloader.LoaderStatistics:
    """One epoch of ``case`` (two for ``consumer`` and ``cpu``); the loader's statistics."""
    dataset, settings, step_s = case_settings(case, n, fixed)
    # The cpu case measures a second, warm epoch: the first one's start (workers importing
    # torch) would weigh more than its 10 ms per sample. So does the consumer case: its first
    # batch waits for the loader's thread to start, which on a loaded machine was a quarter of
    # a short epoch, and the verdict then named prefetch.
    epochs = 2 if case in ("cpu", "consumer") else 1
    async with aioloader.DataLoader(dataset, batch_size=8, **settings) as loader:
        for _ in range(epochs):
            async for _batch in loader:
                if step_s:
                    await asyncio.sleep(step_s)  # the training step
        return loader.statistics()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--case", choices=["dataset", "remote", "consumer", "cpu"], default="dataset"
    )
    parser.add_argument("--samples", type=int, default=160, help="samples in the epoch")
    parser.add_argument("--no-fix", action="store_true", help="skip the run with the knob turned")
    parser.add_argument("--log", action="store_true", help="show the loader's own log records")
    args = parser.parse_args()
    if args.log:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    stats = await run(args.case, args.samples, fixed=False)
    print(stats)
    print(f"\nverdict: {stats.bottleneck} (knob: {stats.epoch_stats.knob or 'none'})")
    knob = stats.epoch_stats.knob or ("num_workers" if stats.bottleneck == "cpu" else "")
    if args.no_fix or not knob:
        return
    fixed = await run(args.case, args.samples, fixed=True)
    before, after = stats.epoch_stats, fixed.epoch_stats
    print(
        f"with {knob} turned up: {after.samples_per_s:.0f} samples/s "
        f"(was {before.samples_per_s:.0f}); verdict now: {fixed.bottleneck}"
    )


if __name__ == "__main__":
    aioloader.run(main())
