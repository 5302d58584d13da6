"""The full soak (RELIABILITY.md row 21), in a fresh interpreter, with its figures printed:
epochs, faults injected, RSS of the main process and of the workers at epoch 2 and at the last,
growth, wall time. It fails (exit status 1) if an epoch is not exact, something is left above
the leak baseline, or the main process's RSS grows by 5% or more from epoch 2 to the last.

Run from the repository root, with ``tests/`` on the path (workers import ``fault_datasets``)::

    PYTHONPATH=tests python tests/scripts/full_soak.py [--epochs 20] [--loop uvloop|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from collections.abc import Callable

import soak
from helpers import Baseline

MAX_GROWTH_PERCENT = 5.0


async def _watched(baseline: Baseline) -> None:
    baseline.watch_loop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=1.0, help="the batch deadline, s")
    parser.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop")
    args = parser.parse_args()
    if args.epochs < 3:
        parser.error("--epochs must be at least 3 (RSS growth is measured from epoch 2)")
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    if args.loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    baseline = Baseline.record()
    with tempfile.TemporaryDirectory() as marker_dir, asyncio.Runner(loop_factory=factory) as run:
        run.run(_watched(baseline))
        figures = run.run(soak.run_soak(args.epochs, marker_dir, deadline_s=args.timeout))
        run.run(baseline.check_tasks())
    baseline.check()
    print(figures.report())
    print("leaks none above the baseline (descriptors, threads, processes, segments, tasks)")
    growth = figures.growth(figures.rss)
    if growth >= MAX_GROWTH_PERCENT:
        print(f"FAIL: main RSS grew {growth:.2f}% (limit {MAX_GROWTH_PERCENT}%)")
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
