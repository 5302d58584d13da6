"""aioloader against torch's DataLoader, same data, same worker count, same run.

Three workloads from the process-workers issue, each measured in a fresh child process (so one
loader's workers and memory do not colour the next), reported as batches/s and as the ratio
aioloader / torch. The machine is shared and noisy: read the ratios, not the absolute numbers.

- ``large``: 64 x 3x224x224 uint8 (9.6 MB a batch) from an in-memory data set, with a cheap
  per-sample transform (a horizontal flip);
- ``cpu``: ~2 ms of per-sample Python work, batch 32;
- ``tiny``: Python ints, batch 256.

Each case runs one warm-up epoch (workers start, shared memory is faulted in), then times whole
epochs; the best of ``--repeat`` interleaved runs counts. Both run with
``persistent_workers=True``: torch's workers start once, and aioloader's (which always stay)
keep their dataset copy instead of loading a new one each epoch, as torch's would. Peak memory
is the largest sum of PSS over the process and its children, sampled every 0.1-0.5 s in a separate
one-epoch run (sampling costs CPU, so throughput runs do not sample).

Other loaders run beside them with ``--loaders`` (``benchmarks/other_loaders.py``: torchdata,
SPDL, seqtools, where installed); ``--json`` prints the results as one JSON document on
stdout (the table goes to stderr), for ``benchmarks/run_all.py``; ``--quick`` is a smoke test:
less data, the first worker count only, one timed epoch, one run, no memory sampling.

    python benchmarks/bench_loader.py                 # all cases
    python benchmarks/bench_loader.py --case tiny --epochs 3
    python benchmarks/bench_loader.py --loaders torch,aioloader,torchdata --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
from harness import PeakPss

#: The loaders this script knows; torch and aioloader always run.
LOADERS = ("torch", "aioloader", "torchdata", "spdl", "seqtools")
CASES = {
    # name: (dataset kind, length, batch size, worker counts)
    "large": ("large", 1280, 64, (2, 0)),
    "cpu": ("cpu", 640, 32, (2, 0)),
    "tiny": ("tiny", 256 * 400, 256, (2, 0)),
}
#: --quick: each data set's length, a few batches (a run's cost is then mostly starting the
#: process and its workers; 1280 large images took torchdata.nodes seconds a run here).
QUICK_LENGTH = {"large": 256, "cpu": 128, "tiny": 256 * 40}


class LargeImages:
    """Images held in memory; each sample is flipped (a cheap per-sample transform)."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.data = rng.integers(0, 255, size=(64, 3, 224, 224), dtype=np.uint8)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.ascontiguousarray(self.data[i % 64][:, :, ::-1])


def _burn(ms: float) -> float:
    end = time.perf_counter() + ms / 1000
    x = 0.0
    while time.perf_counter() < end:
        x += 1.0
    return x


class CpuHeavy:
    """~2 ms of CPU per sample (a busy loop holding the GIL), then a small array."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        _burn(2.0)
        return np.full(64, i, dtype=np.float32)


class Tiny:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def make_dataset(kind: str, n: int) -> Any:
    return {"large": LargeImages, "cpu": CpuHeavy, "tiny": Tiny}[kind](n)


def run_torch(kind: str, n: int, batch: int, workers: int, epochs: int) -> dict[str, float]:
    import torch.utils.data as tud

    loader = tud.DataLoader(
        make_dataset(kind, n),
        batch_size=batch,
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context="forkserver" if workers else None,
    )
    with PeakPss() as mem:
        for _ in loader:
            pass
        start = time.perf_counter()
        batches = 0
        for _ in range(epochs):
            for _ in loader:
                batches += 1
        elapsed = time.perf_counter() - start
    del loader
    return {"batches_per_s": batches / elapsed, "peak_pss_mb": mem.peak / 2**20}


def run_ours(kind: str, n: int, batch: int, workers: int, epochs: int) -> dict[str, float]:
    import aioloader

    async def main() -> dict[str, float]:
        async with aioloader.DataLoader(
            make_dataset(kind, n),
            batch_size=batch,
            num_workers=workers,
            persistent_workers=workers > 0,
        ) as loader:
            with PeakPss() as mem:
                async for _ in loader:
                    pass
                start = time.perf_counter()
                batches = 0
                for _ in range(epochs):
                    async for _ in loader:
                        batches += 1
                elapsed = time.perf_counter() - start
        return {"batches_per_s": batches / elapsed, "peak_pss_mb": mem.peak / 2**20}

    return aioloader.run(main())


def child(args: argparse.Namespace) -> None:
    kind, n, batch, _ = CASES[args.case]
    if args.quick:
        n = QUICK_LENGTH[args.case]
    if args.impl in ("aioloader", "torch"):
        fn = run_ours if args.impl == "aioloader" else run_torch
    else:
        import other_loaders

        fn = other_loaders.RUNNERS[args.impl]
    result = fn(kind, n, batch, args.workers, args.epochs)
    print(json.dumps(result))


def measure(
    case: str, impl: str, workers: int, epochs: int, memory: bool = True, quick: bool = False
) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            *([] if memory else ["--no-memory"]),
            *(["--quick"] if quick else []),
            "--child",
            "--case",
            case,
            "--impl",
            impl,
            "--workers",
            str(workers),
            "--epochs",
            str(epochs),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{impl} {case} workers={workers} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=[*CASES, "all"], default="all")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per run")
    parser.add_argument("--repeat", type=int, default=2, help="runs per loader; best counts")
    parser.add_argument(
        "--no-memory", action="store_true", help="do not sample PSS (less disturbance)"
    )
    parser.add_argument(
        "--loaders",
        default="torch,aioloader",
        help=f"comma-separated, from {', '.join(LOADERS)} (torch and aioloader always run)",
    )
    parser.add_argument("--json", action="store_true", help="results as JSON on stdout")
    parser.add_argument("--quick", action="store_true", help="a smoke test: small and short")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", default="aioloader", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        PeakPss.enabled = not args.no_memory
        child(args)
        return
    asked = [name.strip() for name in args.loaders.split(",") if name.strip()]
    unknown = sorted(set(asked) - set(LOADERS))
    if unknown:
        parser.error(f"--loaders: unknown {unknown}; known: {', '.join(LOADERS)}")
    loaders = ["torch", "aioloader", *(n for n in LOADERS[2:] if n in asked)]
    if args.quick:
        args.epochs, args.repeat, args.no_memory = 1, 1, True
    table = sys.stderr if args.json else sys.stdout
    cases = list(CASES) if args.case == "all" else [args.case]
    others = loaders[2:]
    print(
        f"{'case':<6} {'workers':>7} {'torch b/s':>10} {'ours b/s':>10} {'ratio':>6} "
        f"{'torch PSS MB':>12} {'ours PSS MB':>11}" + "".join(f" {n + ' b/s':>14}" for n in others),
        file=table,
    )
    rows = []
    for case in cases:
        counts = CASES[case][3][:1] if args.quick else CASES[case][3]
        for workers in counts:
            # Throughput runs sample no memory (reading smaps of every process every 100 ms
            # takes CPU from the loaders); the best of --repeat interleaved runs counts.
            rates = dict.fromkeys(loaders, 0.0)
            for _ in range(args.repeat):
                for impl in rates:
                    result = measure(case, impl, workers, args.epochs, False, args.quick)
                    rates[impl] = max(rates[impl], result["batches_per_s"])
            pss = dict.fromkeys(loaders, float("nan"))
            if not args.no_memory:
                for impl in pss:
                    pss[impl] = measure(case, impl, workers, 1, True, args.quick)["peak_pss_mb"]
            rows.append(
                {"case": case, "workers": workers, "batches_per_s": rates, "peak_pss_mb": pss}
            )
            print(
                f"{case:<6} {workers:>7} {rates['torch']:>10.1f} {rates['aioloader']:>10.1f} "
                f"{rates['aioloader'] / rates['torch']:>5.2f}x "
                f"{pss['torch']:>12.0f} {pss['aioloader']:>11.0f}"
                + "".join(f" {rates[n]:>14.1f}" for n in others),
                file=table,
                flush=True,
            )
    if args.json:
        document = {
            "benchmark": "bench_loader",
            "unit": "batches/s",
            "quick": args.quick,
            "epochs": args.epochs,
            "repeat": args.repeat,
            "cpus": os.cpu_count(),
            # NaN (memory not sampled) is not JSON: None instead.
            "rows": [
                {
                    **row,
                    "peak_pss_mb": {
                        k: (None if v != v else v) for k, v in row["peak_pss_mb"].items()
                    },
                }
                for row in rows
            ],
        }
        print(json.dumps(document))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    asyncio.set_event_loop_policy(None)
    main()
