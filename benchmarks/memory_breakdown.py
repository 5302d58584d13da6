"""Where the memory of a loader's process tree goes: PSS per process and per kind of mapping.

torch's ``DataLoader`` (its default start method, ``fork`` on Linux) and aioloader's (its
default), 2 workers, ``persistent_workers=True`` both, two epochs of a large-batch case
(64 x 3x224x224 uint8: 9.6 MB a batch) and a tiny one (Python ints, batch 256), each in a fresh
interpreter. The peak PSS of the whole tree is sampled during the epochs every 0.1-0.5 s
(``harness.PeakPss``: batches in flight count, torch's in its fresh segments, aioloader's in
its slots); after them, for every process of the tree (the training process, the worker server, the
workers, the resource tracker) it reports the PSS, split into anonymous memory (the heap:
Python objects, numpy and torch allocations, shared copy-on-write with the parent that forked
it), shared libraries (``.so`` files, shared with every process that maps them) and
shared-memory segments (``/dev/shm``: aioloader's batch slots; torch's tensors in flight), and
the private part (pages no other process maps) of the anonymous and shared-memory columns.
PSS counts a segment only while some process maps it, and torch's batches waiting in its
queue are mapped by none (the worker unmapped them, the training process has not unpickled
them yet): the last row adds the tree's anonymous memory and what ``/dev/shm`` holds beyond its
use at the start, mapped or not (``harness.PeakPss.peak_held``; run it on a quiet machine).
Torch's workers are forked from the training process; aioloader's from a worker server forked
from it, so both share the training process's pages; the differences are the extra processes,
what each worker holds of its own, and the slots.

    python benchmarks/memory_breakdown.py                # both cases, both loaders
    python benchmarks/memory_breakdown.py --case large --json
    python benchmarks/memory_breakdown.py --quick        # the smoke test: tiny case only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from harness import run_child  # noqa: E402  (benchmarks/ is not a package)

CASES = {"large": 64, "tiny": 256}  # case: batch size
# Long enough for the peak sampler (every 0.1-0.5 s) to see each epoch several times.
LENGTH = {"large": 64 * 40, "tiny": 256 * 400}
EPOCHS = 2


def breakdown() -> list[dict[str, Any]]:
    """Each process of this tree: its role, PSS, and PSS by kind of mapping (MiB)."""
    import psutil

    me = psutil.Process()
    rows = []
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            kinds = {"anon": 0, "libs": 0, "shm": 0, "other": 0}
            private = {"anon": 0, "shm": 0}
            for m in p.memory_maps(grouped=True):
                path = m.path
                own = m.private_clean + m.private_dirty
                name = path.rsplit("/", 1)[-1]
                if path.startswith("/dev/shm") or name.startswith(("psm_", "aiol_", "torch_")):
                    kinds["shm"] += m.pss
                    private["shm"] += own
                elif path in ("", "[heap]") or path.startswith("[anon") or path == "[stack]":
                    kinds["anon"] += m.pss
                    private["anon"] += own
                elif ".so" in path:
                    kinds["libs"] += m.pss
                else:
                    kinds["other"] += m.pss
            cmd = " ".join(p.cmdline())
            role = (
                "training process"
                if p.pid == me.pid
                else "resource tracker"
                if "resource_tracker" in cmd
                else "process"
            )
            rows.append(
                {
                    "pid": p.pid,
                    "ppid": p.ppid(),
                    "role": role,
                    "pss_mb": sum(kinds.values()) / 2**20,
                    **{f"{k}_mb": v / 2**20 for k, v in kinds.items()},
                    **{f"private_{k}_mb": v / 2**20 for k, v in private.items()},
                }
            )
    # Name the rest from the tree's shape: a process whose children are workers is the server.
    parents = {r["ppid"] for r in rows}
    for r in rows:
        if r["role"] == "process":
            r["role"] = "worker server" if r["pid"] in parents else "worker"
    return rows


def child(loader: str, case: str) -> dict[str, Any]:
    import bench_loader
    import torch
    from harness import PeakPss

    torch.set_num_threads(1)
    dataset = bench_loader.make_dataset(case, LENGTH[case])
    batch = CASES[case]
    if loader == "torch":
        from torch.utils.data import DataLoader

        tl = DataLoader(dataset, batch_size=batch, num_workers=2, persistent_workers=True)
        with PeakPss() as peak:
            for _ in range(EPOCHS):
                for _b in tl:
                    pass
        rows = breakdown()
    else:
        import aioloader

        with aioloader.DataLoader(
            dataset, batch_size=batch, num_workers=2, persistent_workers=True
        ) as al:
            with PeakPss() as peak:
                for _ in range(EPOCHS):
                    for _b in al:
                        pass
            rows = breakdown()
            stats = al.statistics()
            slots = {"live_shm_slots": stats.live_shm_slots, "shm_mb": stats.shm_bytes / 2**20}
    doc: dict[str, Any] = {"loader": loader, "case": case, "processes": rows}
    doc["total_pss_mb"] = sum(r["pss_mb"] for r in rows)
    doc["peak_pss_mb"] = peak.peak / 2**20
    doc["peak_own_mb"] = peak.peak_own / 2**20
    doc["peak_held_mb"] = peak.peak_held / 2**20
    if loader == "aioloader":
        doc.update(slots)
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--quick", action="store_true", help="the smoke test: tiny only")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    cases = ["tiny"] if args.quick else args.case
    docs = []
    for case in cases:
        for loader in ("torch", "aioloader"):
            print(f"memory: {loader}, {case} ...", file=sys.stderr, flush=True)
            docs.append(run_child(__file__, ["--child", loader, case], f"memory: {loader} {case}"))
    document = {"benchmark": "memory", "rows": docs}
    print(table(document), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(document))
    return 0


def table(doc: dict[str, Any]) -> str:
    lines = [
        "| case | loader | process | PSS MB | anon | libs | shm | other | private anon "
        "| private shm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in doc["rows"]:
        for r in d["processes"]:
            lines.append(
                f"| {d['case']} | {d['loader']} | {r['role']} | {r['pss_mb']:.1f} "
                f"| {r['anon_mb']:.1f} | {r['libs_mb']:.1f} | {r['shm_mb']:.1f} "
                f"| {r['other_mb']:.1f} | {r['private_anon_mb']:.1f} | {r['private_shm_mb']:.1f} |"
            )
        extra = ""
        if "live_shm_slots" in d:
            extra = f" ({d['live_shm_slots']} slots, {d['shm_mb']:.1f} MB)"
        lines.append(
            f"| {d['case']} | {d['loader']} | **tree**{extra} "
            f"| **{d['total_pss_mb']:.0f}** | | | | | | |"
        )
        lines.append(
            f"| {d['case']} | {d['loader']} | **tree, peak during the epochs** "
            f"| **{d['peak_pss_mb']:.0f}** | **{d['peak_own_mb']:.0f}** anon + shm | | | | | |"
        )
        lines.append(
            f"| {d['case']} | {d['loader']} | **peak anon + /dev/shm held** (mapped or not) "
            f"| | **{d['peak_held_mb']:.0f}** | | | | | |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
