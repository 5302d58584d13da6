"""Cold start: aioloader against torch's DataLoader, each run a fresh process, from construction.

What a user sees first, and what every evaluation loader, short job and notebook pays: the
import, the time from ``DataLoader(...)`` to the first batch, and the rate of a whole run counted
from construction (worker start-up and the first touch of fresh memory included). Each run
imports torch first, before any clock starts, as a training script does for its model:
``import aioloader`` does not import torch, so without that the first batch would pay for
torch's import in aioloader's runs only (and its worker processes, started before torch was
loaded, would each import it too: about two seconds more here). Every figure
is one fresh interpreter; aioloader and torch alternate, run after run, and the median of
``--repeat`` runs counts. The machine is shared and noisy: read the ratios.

Workloads (the samples of ``bench_loader``; torch at the same ``num_workers``, its default start
method, no persistent workers, as a user writes it):

- ``first``: time to the first batch, ints, batch 64.
- ``short``: 64 batches of 64 x 3x224x224 uint8, every byte read by the consumer.
- ``W2``: large images, 1280 samples, batch 64 (2 and 0 workers).
- ``W3``: ~2 ms of Python per sample, 640 samples, batch 32.
- ``W4``: Python ints, 102,400 samples, batch 256 (2 and 0 workers; 0 workers with ``for`` too).

``--json`` prints the results as one JSON document on stdout (the table goes to stderr), for
``benchmarks/run_all.py``.

    python benchmarks/cold_start.py                  # everything, 5 runs each
    python benchmarks/cold_start.py --only first short --repeat 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

# name: (dataset kind, samples, batch size, num_workers, how aioloader iterates)
WORKLOADS: dict[str, tuple[str, int, int, int, str]] = {
    "first": ("tiny", 64 * 64, 64, 2, "async"),
    "short": ("large", 64 * 64, 64, 2, "async"),
    "W2 w2": ("large", 1280, 64, 2, "async"),
    "W2 w0": ("large", 1280, 64, 0, "async"),
    "W3 w2": ("cpu", 640, 32, 2, "async"),
    "W4 w2": ("tiny", 256 * 400, 256, 2, "async"),
    "W4 w0": ("tiny", 256 * 400, 256, 0, "async"),
    "W4 w0 for": ("tiny", 256 * 400, 256, 0, "sync"),
}


def touch(batch: Any) -> int:
    """Read every byte of a batch, as a training step would (a sum over the tensor)."""
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.sum()) if batch.dtype == torch.uint8 else batch.numel()
    return len(batch)


def child(impl: str, workload: str) -> dict[str, float]:
    """One cold run in this (fresh) process: import, construct, iterate one epoch."""
    kind, n, batch, workers, mode = WORKLOADS[workload]
    only_first = workload == "first"
    import torch  # noqa: F401  (the training script's own import, outside every clock)

    t_import = time.perf_counter()
    if impl == "torch":
        from torch.utils.data import DataLoader
    else:
        from aioloader import DataLoader  # type: ignore[assignment]
    t_made = time.perf_counter()
    import bench_loader  # the datasets; imported after the clock so both pay it alike

    dataset = bench_loader.make_dataset(kind, n)
    t0 = time.perf_counter()
    loader = DataLoader(dataset, batch_size=batch, num_workers=workers)
    first = total = samples = 0.0
    if impl == "aioloader" and mode == "async":
        import aioloader

        async def run() -> tuple[float, int]:
            seen = 0
            first_at = 0.0
            async with loader:  # type: ignore[attr-defined]
                async for b in loader:  # type: ignore[attr-defined]
                    if not first_at:
                        first_at = time.perf_counter()
                        if only_first:
                            break
                    seen += len(b)
                    touch(b)
            return first_at, seen

        first_at, seen = aioloader.run(run())
    else:
        seen = 0
        first_at = 0.0
        for b in loader:
            if not first_at:
                first_at = time.perf_counter()
                if only_first:
                    break
            seen += len(b)
            touch(b)
        close = getattr(loader, "close", None)
        if close is not None:
            close()
        del loader
    end = time.perf_counter()
    first = first_at - t0
    total = end - t0
    samples = float(seen)
    return {
        "import_s": t_made - t_import,
        "first_s": first,
        "total_s": total,
        "rate": samples / total if samples else 0.0,
    }


def measure(impl: str, workload: str) -> dict[str, float]:
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, __file__, "--child", impl, workload],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{impl} {workload} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(WORKLOADS), help="these workloads")
    parser.add_argument("--repeat", type=int, default=5, help="fresh runs per loader (median)")
    parser.add_argument("--json", action="store_true", help="results as JSON on stdout")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "WORKLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    table = sys.stderr if args.json else sys.stdout
    print(
        f"{sys.version.split()[0]}, {os.cpu_count()} CPUs, median of {args.repeat} fresh runs\n",
        file=table,
    )
    print(
        "| workload | torch first batch | aioloader first batch | ratio | torch samples/s "
        "| aioloader samples/s | ratio |",
        file=table,
    )
    print("|---|---|---|---|---|---|---|", file=table)
    imports: dict[str, list[float]] = {"torch": [], "aioloader": []}
    rows = []
    for workload in args.only or list(WORKLOADS):
        runs: dict[str, list[dict[str, float]]] = {"torch": [], "aioloader": []}
        for _ in range(args.repeat):
            for impl in runs:  # interleaved: a slow minute on the machine hits both
                result = measure(impl, workload)
                runs[impl].append(result)
                imports[impl].append(result["import_s"])
        first = {k: statistics.median(r["first_s"] for r in v) for k, v in runs.items()}
        rate = {k: statistics.median(r["rate"] for r in v) for k, v in runs.items()}
        rows.append(
            {
                "workload": workload,
                "first_batch_s": first,
                # "first" stops at the first batch: it has no rate.
                "samples_per_s": rate if workload != "first" else None,
            }
        )
        rate_cell = (
            f"{rate['torch']:,.0f} | {rate['aioloader']:,.0f} | "
            f"{rate['aioloader'] / rate['torch']:.2f}x"
            if workload != "first"
            else "- | - | -"
        )
        print(
            f"| {workload} | {first['torch'] * 1e3:.0f} ms | {first['aioloader'] * 1e3:.0f} ms "
            f"| {first['torch'] / first['aioloader']:.2f}x | {rate_cell} |",
            file=table,
            flush=True,
        )
    import_s = {k: statistics.median(v) for k, v in imports.items()}
    print(
        f"\nimport (median): torch.utils.data {import_s['torch'] * 1e3:.0f} ms, "
        f"aioloader {import_s['aioloader'] * 1e3:.0f} ms. "
        "Ratios: torch / aioloader for the first batch, aioloader / torch for the rate "
        "(above 1: aioloader is ahead).",
        file=table,
    )
    if args.json:
        document = {
            "benchmark": "cold_start",
            "repeat": args.repeat,
            "cpus": os.cpu_count(),
            "import_s": import_s,
            "rows": rows,
        }
        print(json.dumps(document))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
