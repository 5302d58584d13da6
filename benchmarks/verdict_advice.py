"""Does the bottleneck verdict tell the truth? Follow its advice and measure the rate again.

Each case runs a pipeline for an epoch (after a warm-up epoch, so workers have started), reads
``statistics()``'s verdict, turns the knob the verdict names (or, where it names none, the knob
a user would try first: ``num_workers``), and runs again. A true verdict with a knob moves the
rate; a verdict that names the machine (``cpu``) or the training step (``consumer``) means that
no knob of the loader moves it much.

- ``slow-reads``: 20 ms of sleep per sample in 2 threads (a blocking read);
- ``remote``: an async dataset answering after 30 ms, 4 fetches in flight;
- ``few-permits``: 8 threads, ``prefetch=2``;
- ``transport``: 2 MiB arrays from 1 worker process, no work per item, default prefetch;
- ``decode``: 10 ms of CPU per sample in one worker per CPU (a decode-bound pipeline);
- ``quickstart``: the quickstart's synthetic images, 2 workers.

    python benchmarks/verdict_advice.py                  # every case (a minute or two)
    python benchmarks/verdict_advice.py --case transport decode
    python benchmarks/verdict_advice.py --sync            # each epoch a plain `for` loop
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


class Sleepy:
    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        time.sleep(self.delay)
        return np.full(16, index)


class Remote:
    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> np.ndarray:
        await asyncio.sleep(self.delay)
        return np.full(16, index)


class Burn:
    def __init__(self, n: int, ms: float) -> None:
        self.n, self.ms = n, ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        end = time.thread_time() + self.ms / 1e3
        while time.thread_time() < end:  # CPU time advances while this runs
            pass
        return np.full(16, index)


class Big:
    def __init__(self, n: int, nbytes: int) -> None:
        self.n, self.nbytes = n, nbytes
        self._payload: np.ndarray | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        if self._payload is None:
            self._payload = np.arange(self.nbytes // 4, dtype=np.float32)
        return self._payload


class Images:
    """The quickstart's data set: 3x64x64 uint8 crops of 72x72 images, flipped at random."""

    def __init__(self, n: int = 2048) -> None:
        rng = np.random.default_rng(0)
        self.images = rng.integers(0, 256, size=(n, 3, 72, 72), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, Any]:
        y, x = np.random.randint(0, 9, size=2)
        img = self.images[i, :, y : y + 64, x : x + 64]
        if np.random.rand() < 0.5:
            img = img[:, :, ::-1]
        return {"image": np.ascontiguousarray(img), "label": i % 10}


def cpus() -> int:
    return len(os.sched_getaffinity(0))


#: case: (make the dataset, the loader's settings, the knob to try when the verdict names none,
#: and its turned value)
CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "slow-reads": (
        lambda: Sleepy(40, 0.02),
        {"batch_size": 4, "num_workers": 2, "thread_pool": True},
    ),
    "remote": (lambda: Remote(48, 0.03), {"batch_size": 8, "io_concurrency": 4}),
    "few-permits": (
        lambda: Sleepy(40, 0.02),
        {"batch_size": 4, "num_workers": 8, "thread_pool": True, "prefetch": 2},
    ),
    "transport": (lambda: Big(128, 2 * 2**20), {"batch_size": None, "num_workers": 1}),
    "decode": (lambda: Burn(48 * cpus(), 10.0), {"batch_size": 4, "num_workers": cpus()}),
    "quickstart": (Images, {"batch_size": 64, "num_workers": 2}),
}

#: A knob's turned value, from the settings it was found at.
TURN = {
    "num_workers": lambda s: {"num_workers": 2 * s.get("num_workers", 1)},
    "io_concurrency": lambda s: {"io_concurrency": 4 * s["io_concurrency"]},
    "prefetch": lambda s: {"prefetch": 4 * s.get("prefetch", 2 * max(1, s.get("num_workers", 1)))},
    "batch_size": lambda s: {"batch_size": 4 * s["batch_size"]},
}


def measure(make: Any, settings: dict[str, Any], sync: bool) -> dict[str, Any]:
    import warnings

    import aioloader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # more workers than CPUs, when the knob asks for it
        loader = aioloader.DataLoader(make(), **settings)

    async def epochs() -> None:
        for _ in range(2):  # a warm-up epoch, then the measured one
            async for _ in loader:
                pass

    with loader:
        if sync:
            for _ in range(2):
                for _ in loader:
                    pass
        else:
            aioloader.run(epochs())
        e = loader.statistics().epoch_stats
    return {
        "samples_per_s": e.samples_per_s,
        "bottleneck": e.bottleneck,
        "knob": e.knob,
        "cpu_share": e.cpu_share,
        "cpu_wait_share": e.cpu_wait_share,
        "hint": e.hint,
    }


def run(names: list[str], sync: bool) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        make, settings = CASES[name]
        before = measure(make, settings, sync)
        knob = before["knob"] or "num_workers"
        turned = {**settings, **TURN[knob](settings)}
        after = measure(make, turned, sync)
        rows.append(
            {
                "case": name,
                "verdict": before["bottleneck"],
                "knob": before["knob"],
                "tried": f"{knob}={turned[knob]}",
                "before": before,
                "after": after,
                "ratio": after["samples_per_s"] / before["samples_per_s"],
            }
        )
        print(f"verdict: {name}: {before['bottleneck']} ...", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | verdict (knob) | CPU used + waited | tried | samples/s before | after "
        "| after / before |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, a = r["before"], r["after"]
        lines.append(
            f"| {r['case']} | {r['verdict']} ({r['knob'] or 'none'}) "
            f"| {b['cpu_share'] + b['cpu_wait_share']:.0%} | {r['tried']} "
            f"| {b['samples_per_s']:,.0f} | {a['samples_per_s']:,.0f} | {r['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--sync", action="store_true", help="iterate with `for`, not `async for`")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = run(args.case, args.sync)
    print(table(rows), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"benchmark": "verdict", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
