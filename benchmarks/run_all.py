"""Every benchmark in one command: one markdown table of ratios, and charts.

    python benchmarks/run_all.py                        # the full runs (tens of minutes)
    python benchmarks/run_all.py --quick                # a smoke test (under a minute)
    python benchmarks/run_all.py --out docs/bench --only warm remote

It runs, each in its own process and each with ``--json``:

- ``warm``: ``bench_loader.py``, batches/s once workers are up, against torch's DataLoader,
  and against torchdata.nodes, SPDL and seqtools where they are installed
  (``other_loaders.py``; a note says which were skipped);
- ``cold``: ``cold_start.py``, time to the first batch and the rate of a run counted from
  construction, each run a fresh interpreter, against torch's DataLoader, the same other
  loaders (their ratios to torch, and a row against the best of them where torch is not the
  best) and, for remote objects, the bare aiohttp loop;
- ``remote``: ``remote_http.py``, objects over HTTP with latency, against torch's DataLoader
  with a synchronous HTTP data set and against a bare aiohttp loop;
- ``gpu``: ``gpu_transfer.py``, host-to-device GB/s of the device stage against a plain pinned
  ``.to(non_blocking=True)`` loop; only where CUDA is available;
- ``jpeg``: ``jpeg_pipeline.py``, a folder of JPEG files decoded and augmented per sample, 2
  workers, batch 32 and 256: images/s warm and cold, CPU per image, peak PSS, against torch's
  DataLoader, torchdata.nodes and SPDL, and against the machine's ceiling for the pipeline;
- ``transport``: ``transport.py``, worker-to-consumer MB/s of 2-32 MiB bytes, arrays and
  tensors against a pipe, torch's DataLoader and SPDL's shared-memory arena;
- ``startup``: ``startup_size.py``, time to the first batch against the dataset object's size
  (16-128 MiB of bytes objects), 1-8 workers, forkserver and spawn, against torch's DataLoader;
- ``memory``: ``memory_breakdown.py``, the process tree's PSS at 2 workers against torch's
  DataLoader (the table of where it goes is in its own output);
- ``verdict``: ``verdict_advice.py``, slowed pipelines whose verdict's advice is followed: the
  rate after it against the rate before.

Then it prints one markdown table, a row per measurement with the baseline's figure,
aioloader's and their ratio (above 1: aioloader is ahead; for times and memory, the baseline's
figure over aioloader's), and writes into ``--out`` (default
``benchmarks/results``): ``results.md`` (the table and the machine), ``results.json`` (every
benchmark's own document and the rows), ``ratios.png`` (aioloader's ratio for every row, on a
log scale, with the baseline at 1) and, when other loaders ran, ``loaders.png`` (the warm rows,
a bar per loader). The charts need matplotlib (``pip install 'aioloader[plot]'``); without
it the script stops before measuring anything, unless ``--no-plot`` is given.

The machine is whatever runs this: on a shared one, read the ratios (each pair is measured in
the same run, interleaved), not the absolute numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCHMARKS = (
    "warm",
    "cold",
    "remote",
    "gpu",
    "jpeg",
    "transport",
    "startup",
    "memory",
    "verdict",
)
#: What ``--quick`` runs without ``--only``: the new workloads start several interpreters each
#: (seconds apiece on a shared 2-core machine), so their smoke runs are asked for by name.
QUICK_DEFAULT = ("warm", "cold", "remote", "gpu")
OTHER_LOADERS = {"torchdata": "torchdata.nodes", "spdl": "spdl.pipeline", "seqtools": "seqtools"}
INSTALL = {"torchdata": "torchdata", "spdl": "spdl-core", "seqtools": "seqtools"}
#: Seconds one benchmark may take before the runner gives up on it.
TIMEOUT_S = {"quick": 300, "full": 3600}


@dataclass(frozen=True, slots=True)
class Row:
    """One measurement: the baseline's figure, aioloader's, and aioloader's advantage."""

    benchmark: str
    case: str
    measure: str
    baseline: str
    baseline_value: float
    aioloader: float
    ratio: float  # above 1: aioloader is ahead (for times, baseline / aioloader)
    others: dict[str, float] = field(default_factory=dict)  # loader: its ratio, same sense


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def version_of(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "(version unknown)"


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def commands(quick: bool, others: list[str], repeat: int | None) -> dict[str, list[str]]:
    """The command line of each benchmark, in this mode."""
    loaders = ",".join(["torch", "aioloader", *others])
    jpeg = ",".join(["torch", "aioloader", *(o for o in others if o in ("torchdata", "spdl"))])
    again = [] if repeat is None else ["--repeat", str(repeat)]
    if quick:
        return {
            "warm": ["bench_loader.py", "--quick", "--case", "large", "--loaders", loaders],
            # No other loaders: each starts its own worker processes, seconds apiece here.
            "cold": ["cold_start.py", "--only", "first", "--repeat", "1", "--peers"],
            "remote": [
                "remote_http.py",
                "--objects",
                "256",
                "--latency",
                "0.01",
                "--torch-workers",
                "2",
            ],
            "gpu": ["gpu_transfer.py", "--batch-mb", "4", "--batches", "5", "--step-ms", "5"],
            "jpeg": ["jpeg_pipeline.py", "--quick", "--loaders", jpeg],
            "transport": ["transport.py", "--quick", "--loaders", "pipe,torch,aioloader"],
            "startup": ["startup_size.py", "--quick"],
            "memory": ["memory_breakdown.py", "--quick"],
            "verdict": ["verdict_advice.py", "--case", "slow-reads"],
        }
    return {
        "warm": ["bench_loader.py", "--loaders", loaders, *again],
        "cold": ["cold_start.py", "--peers", *others, *again],
        "remote": ["remote_http.py", *(again or ["--repeat", "2"])],
        "gpu": ["gpu_transfer.py", "--batch-mb", "4", "32", "128"],
        "jpeg": ["jpeg_pipeline.py", "--loaders", jpeg],
        "transport": ["transport.py"],
        "startup": ["startup_size.py"],
        "memory": ["memory_breakdown.py"],
        "verdict": ["verdict_advice.py"],
    }


def run_benchmark(argv: list[str], timeout: float) -> dict[str, Any]:
    """Run one benchmark with ``--json``; its progress and table pass through to stderr."""
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(HERE / argv[0]), *argv[1:], "--json"],
        stdout=subprocess.PIPE,
        text=True,
        timeout=timeout,
        check=False,
        cwd=HERE,
    )
    if result.returncode != 0:
        raise SystemExit(f"run_all: {argv[0]} failed with exit status {result.returncode}")
    lines = result.stdout.strip().splitlines()
    if not lines:
        raise SystemExit(f"run_all: {argv[0]} printed no JSON document")
    document: dict[str, Any] = json.loads(lines[-1])
    document["seconds"] = time.perf_counter() - started
    return document


# -- documents to rows ------------------------------------------------------------------------


def warm_rows(doc: dict[str, Any]) -> list[Row]:
    rows = []
    for r in doc["rows"]:
        case = f"{r['case']}, {r['workers']} workers"
        rates = r["batches_per_s"]
        base = rates["torch"]
        others = {k: v / base for k, v in rates.items() if k not in ("torch", "aioloader")}
        ours = rates["aioloader"]
        rows.append(Row("warm", case, "batches/s", "torch", base, ours, ours / base, others))
        pss = r["peak_pss_mb"]
        if pss["torch"] and pss["aioloader"]:  # None when memory was not sampled
            base, ours = pss["torch"], pss["aioloader"]
            others = {k: base / v for k, v in pss.items() if v and k not in ("torch", "aioloader")}
            rows.append(
                Row("warm", case, "peak PSS (MB)", "torch", base, ours, base / ours, others)
            )
    return rows


def cold_rows(doc: dict[str, Any]) -> list[Row]:
    rows = []
    for r in doc["rows"]:
        case = r["workload"]
        if r["torch_workers"] != r["workers"]:
            case += f" (torch w{r['torch_workers']})"
        first = r["first_batch_s"]
        base = first["torch"]
        others = {k: base / v for k, v in first.items() if k not in ("torch", "aioloader")}
        ours = first["aioloader"]
        rows.append(
            Row(
                "cold",
                case,
                "first batch (ms)",
                "torch",
                base * 1e3,
                ours * 1e3,
                base / ours,
                others,
            )
        )
        rate = r["samples_per_s"]
        if rate is None:  # "first" stops at the first batch: it has no rate
            continue
        measure = "samples/s from construction"
        base, ours = rate["torch"], rate["aioloader"]
        others = {k: v / base for k, v in rate.items() if k not in ("torch", "aioloader", "bare")}
        rows.append(Row("cold", case, measure, "torch", base, ours, ours / base, others))
        best = r.get("best_peer")
        if best is not None and best != "torch":
            value = r["best_peer_samples_per_s"]
            rows.append(
                Row("cold", case, measure, f"best other: {best}", value, ours, ours / value)
            )
        if "bare" in rate:
            value = rate["bare"]
            rows.append(Row("cold", case, measure, "bare aiohttp loop", value, ours, ours / value))
    return rows


def remote_rows(doc: dict[str, Any]) -> list[Row]:
    rates = doc["samples_per_s"]
    ours = rates["aioloader"]
    case = f"{doc['objects']} x {doc['size'] // 1024} KiB, {doc['latency_s'] * 1e3:g} ms"
    rows = []
    for name, value in rates.items():
        if name == "aioloader":
            continue
        baseline = (
            name.replace("@", " DataLoader, workers=")
            if name.startswith("torch")
            else ("bare aiohttp loop")
        )
        rows.append(Row("remote", case, "samples/s", baseline, value, ours, ours / value))
    return rows


def gpu_rows(doc: dict[str, Any]) -> list[Row]:
    if "skipped" in doc:
        return []
    return [
        Row(
            "gpu",
            f"{r['batch_mb']:g} MB batches, {doc['device']}",
            "host-to-device GB/s",
            "pinned .to() loop",
            r["pinned_to_gbps"],
            r["stage_gbps"],
            r["stage_gbps"] / r["pinned_to_gbps"],
        )
        for r in doc["rows"]
    ]


def jpeg_rows(doc: dict[str, Any]) -> list[Row]:
    """Per batch size: warm and cold images/s, CPU per image and peak PSS against torch (the
    other loaders as ratios beside), then warm and cold against the machine's ceiling."""
    rows = []
    top = doc["ceiling_img_s"]
    batches = sorted({r["batch"] for r in doc["rows"]})
    for batch in batches:
        by = {r["loader"]: r for r in doc["rows"] if r["batch"] == batch}
        if "torch" not in by or "aioloader" not in by:
            continue
        case = f"{doc['files']} JPEG files, batch {batch}"
        measures = [
            ("warm_img_s", "warm img/s", False),
            ("cold_img_s", "img/s from construction", False),
            ("warm_cpu_ms", "CPU ms per image (tree)", True),
            ("peak_pss_mb", "peak PSS (MB)", True),
        ]
        for key, measure, lower_is_better in measures:
            base, ours = by["torch"][key], by["aioloader"][key]

            def ratio(value: float, base: float = base, lower: bool = lower_is_better) -> float:
                return base / value if lower else value / base

            others = {k: ratio(r[key]) for k, r in by.items() if k not in ("torch", "aioloader")}
            rows.append(Row("jpeg", case, measure, "torch", base, ours, ratio(ours), others))
        for key, measure in (("warm_img_s", "warm img/s"), ("cold_img_s", "cold img/s")):
            ours = by["aioloader"][key]
            others = {k: r[key] / top for k, r in by.items() if k != "aioloader"}
            rows.append(
                Row("jpeg", case, measure, "machine ceiling", top, ours, ours / top, others)
            )
    return rows


def transport_rows(doc: dict[str, Any]) -> list[Row]:
    """Per payload: MB/s against a pipe and against torch's DataLoader (SPDL's ratio beside)."""
    rows = []
    cases = sorted({(r["kind"], r["mib"]) for r in doc["rows"]})
    for kind, mib in cases:
        by = {r["loader"]: r for r in doc["rows"] if (r["kind"], r["mib"]) == (kind, mib)}
        if "aioloader" not in by:
            continue
        ours = by["aioloader"]["mb_s"]
        for base in ("pipe", "torch"):
            if base not in by:
                continue
            value = by[base]["mb_s"]
            others = {"spdl": by["spdl"]["mb_s"] / value} if "spdl" in by else {}
            label = "pickle through a pipe" if base == "pipe" else "torch"
            case = f"{kind} {mib} MiB"
            rows.append(Row("transport", case, "MB/s", label, value, ours, ours / value, others))
    return rows


def startup_rows(doc: dict[str, Any]) -> list[Row]:
    rows = []
    cases: dict[tuple[str, int, int], dict[str, float]] = {}
    for r in doc["rows"]:
        cases.setdefault((r["method"], r["mib"], r["workers"]), {})[r["loader"]] = r[
            "first_batch_s"
        ]
    for (method, mib, workers), by in cases.items():
        if "torch" in by and "aioloader" in by:
            base, ours = by["torch"], by["aioloader"]
            case = f"{mib} MiB dataset, {workers} workers, {method}"
            rows.append(Row("startup", case, "first batch (s)", "torch", base, ours, base / ours))
    return rows


def memory_rows(doc: dict[str, Any]) -> list[Row]:
    by = {(d["case"], d["loader"]): d["total_pss_mb"] for d in doc["rows"]}
    rows = []
    for case in sorted({c for c, _ in by}):
        if (case, "torch") in by and (case, "aioloader") in by:
            base, ours = by[(case, "torch")], by[(case, "aioloader")]
            label = f"{case}, 2 workers"
            rows.append(Row("memory", label, "tree PSS (MB)", "torch", base, ours, base / ours))
    return rows


def verdict_rows(doc: dict[str, Any]) -> list[Row]:
    """Per case: the rate once the verdict's advice was followed, against the rate before."""
    return [
        Row(
            "verdict",
            f"{r['case']}: {r['verdict']} ({r['knob'] or 'no knob'})",
            f"samples/s with {r['tried']}",
            "before",
            r["before"]["samples_per_s"],
            r["after"]["samples_per_s"],
            r["ratio"],
        )
        for r in doc["rows"]
    ]


TO_ROWS = {
    "warm": warm_rows,
    "cold": cold_rows,
    "remote": remote_rows,
    "gpu": gpu_rows,
    "jpeg": jpeg_rows,
    "transport": transport_rows,
    "startup": startup_rows,
    "memory": memory_rows,
    "verdict": verdict_rows,
}


# -- output -----------------------------------------------------------------------------------


def times(ratio: float) -> str:
    """A ratio as text: two decimals, or two significant digits below 0.1."""
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def figure(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def markdown(rows: list[Row], others: list[str]) -> str:
    head = ["benchmark", "case", "measure", "baseline", "baseline value", "aioloader", "ratio"]
    head += [f"{name} ratio" for name in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.benchmark, r.case, r.measure, r.baseline, figure(r.baseline_value)]
        cells += [figure(r.aioloader), times(r.ratio)]
        cells += [times(r.others[name]) if name in r.others else "" for name in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> str:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, torch {torch_version}"
    )


def plot(rows: list[Row], others: list[str], path: Path, title: str) -> None:
    """Horizontal bars from 1 (the baseline) to each ratio, log scale: right is faster."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    loaders = ["aioloader", *others]
    labels = [f"{r.benchmark}: {r.case}\n{r.measure} vs {r.baseline}" for r in rows]
    # Per row, the loaders it has (other loaders run in the warm benchmark only), centred.
    bars: dict[str, list[tuple[float, float]]] = {name: [] for name in loaders}
    slots = max(1, max(len([n for n in others if n in r.others]) + 1 for r in rows) if rows else 1)
    height = 0.8 / slots
    for i, r in enumerate(rows):
        present = [("aioloader", r.ratio)] + [(n, r.others[n]) for n in others if n in r.others]
        for k, (name, value) in enumerate(present):
            bars[name].append((i + (k - (len(present) - 1) / 2) * height, value))
    fig, ax = plt.subplots(figsize=(9, 1.3 + len(rows) * (0.2 + 0.16 * slots)))
    ratios = [1.0]
    for name, shown in bars.items():
        if not shown:
            continue
        ratios += [v for _, v in shown]
        drawn = ax.barh(
            [p for p, _ in shown],
            [v - 1.0 for _, v in shown],
            left=1.0,
            height=height,
            label=name,
        )
        ax.bar_label(drawn, labels=[times(v) for _, v in shown], padding=3, fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlim(min(ratios) / 1.6, max(ratios) * 1.8)  # room for the labels
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}x"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    who = "loader" if len(ratios) > len(rows) + 1 else "aioloader"
    ax.set_xlabel(f"{who} / baseline (log scale; right of 1x: {who} is ahead)")
    ax.set_title(title, fontsize=9)
    if who == "loader":
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: small and short")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="output directory")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="these benchmarks")
    parser.add_argument("--no-plot", action="store_true", help="no charts (no matplotlib)")
    parser.add_argument(
        "--repeat", type=int, help="runs of each measurement (default: each benchmark's own)"
    )
    args = parser.parse_args(argv)
    if not args.no_plot and not installed("matplotlib"):
        print(
            "run_all: the charts need matplotlib, which is not installed: "
            "pip install 'aioloader[plot]' (or pip install matplotlib), or pass --no-plot",
            file=sys.stderr,
        )
        return 2

    notes = []
    others = [name for name, module in OTHER_LOADERS.items() if installed(module)]
    for name in OTHER_LOADERS:
        if name in others:
            notes.append(
                f"{name}: {INSTALL[name]} {version_of(INSTALL[name])}, in the warm and cold rows"
            )
        else:
            notes.append(f"{name}: not installed, skipped (pip install {INSTALL[name]})")
    chosen = list(args.only or (QUICK_DEFAULT if args.quick else BENCHMARKS))
    if "gpu" in chosen and not has_cuda():
        chosen.remove("gpu")
        notes.append("gpu: no CUDA device here, gpu_transfer.py skipped")

    mode = "quick" if args.quick else "full"
    documents, rows = {}, []
    for name in chosen:
        argv_ = commands(args.quick, others, args.repeat)[name]
        print(f"run_all: {' '.join(argv_)} ...", file=sys.stderr, flush=True)
        documents[name] = run_benchmark(argv_, TIMEOUT_S[mode])
        rows += TO_ROWS[name](documents[name])

    where = machine()
    table = markdown(rows, others)
    text = "\n".join(
        [
            f"Machine: {where}. Command: `python benchmarks/run_all.py"
            f"{' '.join(['', *(argv if argv is not None else sys.argv[1:])])}`.",
            "Ratio: aioloader against the baseline, above 1 when aioloader is ahead (for the "
            "first batch and memory: the baseline's figure over aioloader's).",
            "",
            table,
            "",
            *(f"- {note}" for note in notes),
        ]
    )
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text.rstrip() + "\n")
    record = {
        "machine": where,
        "mode": mode,
        "notes": notes,
        "rows": [asdict(r) for r in rows],
        "benchmarks": documents,
    }
    (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
    written = [args.out / "results.md", args.out / "results.json"]
    if not args.no_plot and rows:
        # Every row, aioloader's ratio only; then the warm rows with every loader measured.
        written.append(args.out / "ratios.png")
        plot(rows, [], written[-1], f"aioloader against each baseline, {mode} run\n{where}")
        warm = [r for r in rows if r.benchmark == "warm"]
        if warm and others:
            written.append(args.out / "loaders.png")
            title = f"data loaders against torch's DataLoader (warm), {mode} run\n{where}"
            plot(warm, others, written[-1], title)
    print(f"\nwrote {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
