"""Start-up against the dataset object's size: time to the first batch.

A map-style dataset object that holds 16, 64 or 128 MiB of Python ``bytes`` objects (64 KiB
each: the case where pickling the dataset for each worker is the cost, unlike numpy arrays,
which pickle as one buffer), read by 1, 2, 4 or 8 worker processes started with ``forkserver``
or ``spawn``, or each loader's ``default`` (``multiprocessing_context`` not given: ``fork`` for
torch on Linux, aioloader's worker server forked from the training process); each sample is a
few bytes of one object, batch 4. Measured, in a fresh interpreter for each case, both loaders'
modules imported first: seconds from the loader's construction to its first batch, for
torch's ``DataLoader`` and aioloader's, and the PSS of the process tree at the first batch (read
once then: sampling it all along, every 100 ms, reads the memory maps of processes holding
hundreds of MB, and slowed the start-up it measured by seconds).
(SPDL's documentation measures torch at ~28 s with 128 MiB and 8 workers.) More workers than
CPUs is the point of the 8-worker case: aioloader warns about it, once.

    python benchmarks/startup_size.py                       # every case (a few minutes)
    python benchmarks/startup_size.py --mib 128 --workers 8 --methods spawn
    python benchmarks/startup_size.py --mib 16 128 --workers 1 8 --methods default forkserver
    python benchmarks/startup_size.py --quick               # the smoke test: 4 MiB, 1 worker
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from harness import run_child, tree_pss_mb  # noqa: E402  (benchmarks/ is not a package)

LOADERS = ("torch", "aioloader")
CHUNK = 64 * 1024


class HeavyDataset:
    """``mib`` MiB of bytes objects held by the dataset object itself."""

    def __init__(self, mib: int) -> None:
        self.chunks = [bytes([i % 251]) * CHUNK for i in range(mib * 2**20 // CHUNK)]

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: int) -> int:
        return self.chunks[index][0]


def child(loader: str, mib: int, workers: int, method: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    dataset = HeavyDataset(mib)
    context = None if method == "default" else method
    if loader == "aioloader":
        import aioloader  # before the clock, as torch is
    started = time.perf_counter()
    if loader == "torch":
        from torch.utils.data import DataLoader

        tl = DataLoader(dataset, batch_size=4, num_workers=workers, multiprocessing_context=context)
        first = next(iter(tl))
        first_s = time.perf_counter() - started
        pss = tree_pss_mb()
        del tl
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # more workers than CPUs: on purpose
            al = aioloader.DataLoader(
                dataset, batch_size=4, num_workers=workers, multiprocessing_context=context
            )
        with al:
            first = next(iter(al))
            first_s = time.perf_counter() - started
            pss = tree_pss_mb()
    assert list(first) == [dataset[i] for i in range(4)], first
    return {
        "loader": loader,
        "mib": mib,
        "workers": workers,
        "method": method,
        "first_batch_s": first_s,
        "pss_mb": pss,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--methods", nargs="+", default=["default", "forkserver", "spawn"])
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--quick", action="store_true", help="the smoke test: 4 MiB, 1 worker")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.workers, args.methods = [4], [1], ["forkserver"]
    for method in args.methods:
        if method not in ("default", "forkserver", "spawn"):
            parser.error(f"--methods: default, forkserver or spawn, got {method!r}")
    if args.child:
        loader, mib, workers, method = args.child
        print(json.dumps(child(loader, int(mib), int(workers), method)))
        return 0
    chosen = [n for n in args.loaders.split(",") if n]
    if set(chosen) - set(LOADERS):
        parser.error(f"--loaders: unknown {sorted(set(chosen) - set(LOADERS))}")
    rows = []
    for method in args.methods:
        for mib in args.mib:
            for workers in args.workers:
                for loader in chosen:
                    print(
                        f"startup: {loader}, {mib} MiB, {workers} workers, {method} ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    argv_ = ["--child", loader, str(mib), str(workers), method]
                    rows.append(run_child(__file__, argv_, f"startup: {' '.join(argv_)}"))
    document = {"benchmark": "startup", "rows": rows}
    print(table(document), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(document))
    return 0


def table(doc: dict[str, Any]) -> str:
    lines = [
        "| method | dataset MiB | workers | torch first batch s | aioloader first batch s "
        "| torch / aioloader | torch PSS MB at first batch | aioloader PSS MB at first batch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    cases: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for r in doc["rows"]:
        cases.setdefault((r["method"], r["mib"], r["workers"]), {})[r["loader"]] = r
    for (method, mib, workers), by in cases.items():
        t, a = by.get("torch"), by.get("aioloader")
        ratio = f"{t['first_batch_s'] / a['first_batch_s']:.2f}x" if t and a else ""
        lines.append(
            f"| {method} | {mib} | {workers} | {t['first_batch_s']:.2f} | "
            if t
            else f"| {method} | {mib} | {workers} | | "
        )
        lines[-1] += (f"{a['first_batch_s']:.2f}" if a else "") + f" | {ratio} | "
        lines[-1] += (f"{t['pss_mb']:.0f}" if t else "") + " | "
        lines[-1] += (f"{a['pss_mb']:.0f}" if a else "") + " |"
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
