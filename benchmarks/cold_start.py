"""Cold start: aioloader against torch's DataLoader and other loaders, each run a fresh process.

What a user sees first, and what every evaluation loader, short job and notebook pays: the
import, the time from construction to the first batch, and the rate of a whole run counted
from construction (worker start-up and the first touch of fresh memory included). Each run
imports torch first, before any clock starts, as a training script does for its model:
``import aioloader`` does not import torch, so without that the first batch would pay for
torch's import in aioloader's runs only (and its worker processes, started before torch was
loaded, would each import it too: about two seconds more here). Every figure is one fresh
interpreter; the loaders take turns, run after run (aioloader, torch, then each other loader),
and the median of ``--repeat`` runs counts. The machine is shared and noisy: read the ratios.

Loaders: torch's DataLoader (its default start method, no persistent workers, as a user
writes it) and aioloader at the same ``num_workers``; torchdata.nodes, SPDL and seqtools
(``--peers``; by default those installed), each set up as ``other_loaders.py`` sets it up for
the warm benchmark, by the same function, at the same worker count. Every loader touches every
byte of every batch (a sum over its bytes, read as 64-bit integers: see ``read_every_byte``),
as a training step would. The data set is made before the clock (the other loaders' worker
processes that do not fork make their own inside it, as they would in a script).

Workloads (the samples of ``bench_loader``):

- ``first``: time to the first batch, ints, batch 64. ``first with``: aioloader inside
  ``async with``, which first waits until every worker is up (torch as in ``first``).
- ``short``: 64 batches of 64 x 3x224x224 uint8.
- ``W1``: 1,000 remote objects of 64 KiB on the loopback server of ``remote_http.py`` (its own
  process, started once for the whole run, 20 ms added to every response), batch 32, every
  object read once and checked (its bytes and its index). ``W1 w0``: aioloader in one process
  (``HTTPDataset``, ``io_concurrency=64``, ``async for``); torch at its best worker count
  here, 8; SPDL with an async stage of concurrency 64; torchdata and seqtools with 64 threads;
  and the bare aiohttp loop (a semaphore of 64, no loader) as the ceiling. ``W1 w2``: aioloader
  collating in 2 worker processes against torch with 2 workers (the other loaders' IO runs in
  one process: see ``W1 w0``). ``W1 w0 jitter``: ``W1 w0`` against a second server whose
  latency is spread uniformly over 15-25 ms (``--jitter 0.25``, the same mean), as a remote
  store's is. With every wait exactly equal, the one-process server answers the requests that
  arrive together together, a one-loop client sends the next ones together, and the bursts
  last; spread out, they do not. The row shows how much of ``W1 w0`` is that lockstep.
- ``W2``: large images, 1280 samples, batch 64 (2 and 0 workers).
- ``W3``: ~2 ms of Python per sample, 640 samples, batch 32.
- ``W4``: Python ints, 102,400 samples, batch 256 (2 and 0 workers; 0 workers with ``for`` too).

The table gives each loader's first batch and samples/s, the best other loader (torch
included) by rate, aioloader's rate over it, and the fastest other first batch over
aioloader's (above 1: aioloader is ahead). A loader that fails is reported and left out of its
workload. ``--json`` prints the results as one JSON document on stdout (the table goes to
stderr), for ``benchmarks/run_all.py``.

    python benchmarks/cold_start.py                  # everything, 5 runs each
    python benchmarks/cold_start.py --only first short --repeat 9
    python benchmarks/cold_start.py --only "W1 w0" --peers spdl --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import other_loaders

HTTP = other_loaders.HTTP
#: W1: object size, added latency, requests in flight (aioloader's ``io_concurrency``, SPDL's
#: ``concurrency``, the other loaders' threads, the bare loop's semaphore).
HTTP_SIZE = 64 * 1024
HTTP_LATENCY_S = 0.02
IO_CONCURRENCY = other_loaders.IO_CONCURRENCY


@dataclass(frozen=True, slots=True)
class Workload:
    kind: str  # bench_loader's data set, or HTTP
    n: int  # samples
    batch: int
    workers: int  # num_workers of aioloader, torch and the other loaders
    # How aioloader iterates: "async" (async for), "with" (async for inside async with, which
    # first waits until every worker is up) or "sync" (for).
    mode: str = "async"
    torch_workers: int | None = None  # torch's num_workers, where it is not ``workers``
    peers: bool = True  # the other loaders run it too
    ceiling: bool = False  # the bare aiohttp loop runs it too
    jitter: float = 0.0  # remote objects: the server's latency spread (``--jitter``)

    @property
    def torch_w(self) -> int:
        return self.workers if self.torch_workers is None else self.torch_workers


WORKLOADS: dict[str, Workload] = {
    "first": Workload("tiny", 64 * 64, 64, 2),
    "first with": Workload("tiny", 64 * 64, 64, 2, mode="with", peers=False),
    "short": Workload("large", 64 * 64, 64, 2),
    "W1 w0": Workload(HTTP, 1000, 32, 0, torch_workers=8, ceiling=True),
    "W1 w0 jitter": Workload(HTTP, 1000, 32, 0, torch_workers=8, ceiling=True, jitter=0.25),
    "W1 w2": Workload(HTTP, 1000, 32, 2, peers=False),
    "W2 w2": Workload("large", 1280, 64, 2),
    "W2 w0": Workload("large", 1280, 64, 0),
    "W3 w2": Workload("cpu", 640, 32, 2),
    "W4 w2": Workload("tiny", 256 * 400, 256, 2),
    "W4 w0": Workload("tiny", 256 * 400, 256, 0),
    "W4 w0 for": Workload("tiny", 256 * 400, 256, 0, mode="sync"),
}
#: The module each loader imports (timed apart, after torch); the bare loop's is aiohttp.
IMPORTS = {"torch": "torch.utils.data", "aioloader": "aioloader", **other_loaders.MODULES}
IMPORTS["bare"] = "aiohttp"
PEERS = tuple(other_loaders.MODULES)


def read_every_byte(batch: Any) -> Any:
    """A sum that reads every byte of a uint8 tensor at memory speed, as a training step's
    first pass over its input does (a copy to the GPU, a conversion to float). torch's own
    uint8 sum takes 20-30 ms for a 9.6 MB batch here, ten times a pass over memory: it would
    weigh as much as the loading it is there to check."""
    import torch

    flat = batch.reshape(-1)
    if flat.numel() % 8:
        return flat.sum()
    return flat.view(torch.int64).sum()  # wraps around: only the reading counts


class Consumer:
    """What the training step does with a batch: reads every byte; and, for remote objects,
    checks that every object came exactly once with all its bytes."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.samples = 0
        self.nbytes = 0
        self.heads: list[int] = []

    def take(self, batch: Any) -> None:
        import torch

        self.samples += len(batch)
        if isinstance(batch, torch.Tensor):
            if batch.dtype == torch.uint8:
                int(read_every_byte(batch))
            return
        for item in batch:  # remote objects: bytes, the first eight of them the index
            self.nbytes += len(item)
            self.heads.append(int.from_bytes(item[:8], "little"))

    def check(self) -> None:
        w = self.workload
        if w.kind == HTTP and (
            sorted(self.heads) != list(range(w.n)) or self.nbytes != w.n * HTTP_SIZE
        ):
            raise RuntimeError(
                f"read {len(self.heads)} objects ({len(set(self.heads))} distinct) and "
                f"{self.nbytes} bytes; expected {w.n} objects of {HTTP_SIZE} bytes"
            )


def child(impl: str, name: str, port: int) -> dict[str, float | None]:
    """One cold run in this (fresh) process: import, construct, iterate one epoch, close."""
    w = WORKLOADS[name]
    only_first = name.startswith("first")
    import torch  # noqa: F401  (the training script's own import, outside every clock)

    t_import = time.perf_counter()
    importlib.import_module(IMPORTS[impl])
    t_made = time.perf_counter()
    # The data and its libraries, imported and made before the clock, alike for every loader.
    import bench_loader  # noqa: F401
    import remote_http

    urls = remote_http.object_urls(port, w.n) if w.kind == HTTP else []
    if w.kind == HTTP:
        import aiohttp  # noqa: F401

        if impl == "aioloader":
            import aioloader.sources  # noqa: F401
    else:
        other_loaders.dataset_for(w.kind, w.n)
    consumer = Consumer(w)
    first_at = 0.0

    t0 = time.perf_counter()
    if impl == "bare":
        remote_http.run_bare(urls, HTTP_SIZE, IO_CONCURRENCY)  # checks the byte count
        consumer.samples = w.n
    elif impl in ("torch", "aioloader"):
        first_at = run_dataloader(impl, w, urls, consumer, only_first)
    else:
        epoch, close = other_loaders.BUILDERS[impl](w.kind, w.n, w.batch, w.workers, port)
        batches = iter(epoch())
        try:
            for b in batches:
                if not first_at:
                    first_at = time.perf_counter()
                    if only_first:
                        break
                consumer.take(b)
        finally:
            with contextlib.suppress(AttributeError):
                batches.close()  # type: ignore[attr-defined]  # a generator: stop its pipeline
            del batches
            close()
    end = time.perf_counter()
    if not only_first and impl != "bare":  # the bare loop checks its byte count itself
        consumer.check()
    total = end - t0
    return {
        "import_s": t_made - t_import,
        "first_s": first_at - t0 if first_at else None,
        "total_s": total,
        "rate": consumer.samples / total if consumer.samples else 0.0,
    }


def run_dataloader(
    impl: str, w: Workload, urls: list[str], consumer: Consumer, only_first: bool
) -> float:
    """Construct torch's or aioloader's DataLoader and run one epoch; the first batch's time."""
    import remote_http

    dataset: Any
    kwargs: dict[str, Any] = {}
    if impl == "torch":
        from torch.utils.data import DataLoader

        workers = w.torch_w
        if w.kind == HTTP:
            dataset = remote_http.SyncHTTPDataset(urls)
            kwargs["collate_fn"] = remote_http.keep_list
        else:
            dataset = other_loaders.dataset_for(w.kind, w.n)
    else:
        from aioloader import DataLoader  # type: ignore[assignment]

        workers = w.workers
        if w.kind == HTTP:
            from aioloader.sources import HTTPDataset

            dataset = HTTPDataset(urls)
            kwargs = {"collate_fn": remote_http.keep_list, "io_concurrency": IO_CONCURRENCY}
        else:
            dataset = other_loaders.dataset_for(w.kind, w.n)
    loader = DataLoader(dataset, batch_size=w.batch, num_workers=workers, **kwargs)
    first_at = 0.0
    if impl == "aioloader" and w.mode in ("async", "with"):
        import aioloader

        async def run() -> float:
            # As torch's loop is written: iterate at once, close after. ``async with`` would
            # first wait until every worker is up (its documented start barrier), which torch's
            # iterator does not do.
            first_at = 0.0
            if w.mode == "with":  # the start barrier, asked for
                await loader.__aenter__()  # type: ignore[attr-defined]
            try:
                async for b in loader:  # type: ignore[attr-defined]
                    if not first_at:
                        first_at = time.perf_counter()
                        if only_first:
                            break
                    consumer.take(b)
            finally:
                await loader.aclose()  # type: ignore[attr-defined]
            return first_at

        return aioloader.run(run())
    for b in loader:
        if not first_at:
            first_at = time.perf_counter()
            if only_first:
                break
        consumer.take(b)
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return first_at  # the loader goes with this frame, before the caller's clock stops


def measure(impl: str, name: str, port: int) -> dict[str, float | None]:
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, __file__, "--child", impl, name, "--port", str(port)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{impl} {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def compile_bytecode(package: str) -> None:
    """Cache the bytecode of ``package``, as installing its wheel does (torch and the other
    loaders here were installed with theirs). Installed in place (``pip install -e``), it is
    otherwise compiled from source at every import where ``PYTHONDONTWRITEBYTECODE`` is set:
    aioloader's import took 50 ms that way, against 32 ms from cached bytecode."""
    import compileall

    spec = importlib.util.find_spec(package)
    for where in (spec.submodule_search_locations or []) if spec is not None else []:
        compileall.compile_dir(where, quiet=1)


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


@contextlib.contextmanager
def http_servers(chosen: list[str]) -> Iterator[dict[float, int]]:
    """The loopback object servers of the chosen W1 workloads, one per latency spread, each
    for the whole run; yields their ports by spread (none where no workload needs one)."""
    spreads = sorted({WORKLOADS[name].jitter for name in chosen if WORKLOADS[name].kind == HTTP})
    with contextlib.ExitStack() as stack:
        ports = {}
        for spread in spreads:
            import remote_http

            args = ["--size", str(HTTP_SIZE), "--latency", str(HTTP_LATENCY_S)]
            args += ["--jitter", str(spread)]
            ports[spread] = stack.enter_context(remote_http.server_process(args))
        yield ports


def summarise(
    name: str, runs: dict[str, list[dict[str, Any]]], failed: dict[str, str]
) -> dict[str, Any]:
    """One workload's medians, its best other loader and aioloader's ratios to it."""
    w = WORKLOADS[name]
    done = {impl: r for impl, r in runs.items() if r and impl not in failed}
    first = {
        impl: statistics.median(x["first_s"] for x in r)
        for impl, r in done.items()
        if impl != "bare"
    }
    rate = {impl: statistics.median(x["rate"] for x in r) for impl, r in done.items()}
    others = [impl for impl in first if impl not in ("aioloader", "bare")]
    row: dict[str, Any] = {
        "workload": name,
        "workers": w.workers,
        "torch_workers": w.torch_w,
        "first_batch_s": first,
        # "first" and "first with" stop at the first batch: they have no rate.
        "samples_per_s": rate if not name.startswith("first") else None,
        "failed": failed,
    }
    if others and "aioloader" in first:
        fastest = min(others, key=first.__getitem__)
        row["fastest_first_peer"] = fastest
        row["first_ratio_to_fastest_peer"] = first[fastest] / first["aioloader"]
        if not name.startswith("first"):
            best = max(others, key=rate.__getitem__)
            row["best_peer"] = best
            row["best_peer_samples_per_s"] = rate[best]
            row["ratio_to_best_peer"] = rate["aioloader"] / rate[best]
        if "bare" in rate:
            row["ratio_to_ceiling"] = rate["aioloader"] / rate["bare"]
    return row


def cells(row: dict[str, Any], columns: list[str]) -> str:
    """One workload's line of the markdown table."""
    rate = row["samples_per_s"] or {}
    name = row["workload"]
    if row["torch_workers"] != row["workers"]:
        name += f" (torch w{row['torch_workers']})"
    out = [name]
    for impl in columns:
        parts = []
        if impl in row["first_batch_s"]:
            parts.append(f"{row['first_batch_s'][impl] * 1e3:,.0f} ms")
        if impl in rate:
            parts.append(f"{rate[impl]:,.0f}/s")
        if impl == "bare" and "ratio_to_ceiling" in row:
            parts.append(f"aioloader {row['ratio_to_ceiling']:.2f}x")
        out.append(", ".join(parts) or ("failed" if impl in row["failed"] else "-"))
    if "best_peer" in row:
        out += [
            f"{row['best_peer']} {row['best_peer_samples_per_s']:,.0f}/s",
            f"{row['ratio_to_best_peer']:.2f}x",
        ]
    else:
        out += ["-", "-"]
    if "fastest_first_peer" in row:
        out.append(f"{row['first_ratio_to_fastest_peer']:.2f}x ({row['fastest_first_peer']})")
    else:
        out.append("-")
    return "| " + " | ".join(out) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=list(WORKLOADS), help="these workloads")
    parser.add_argument("--repeat", type=int, default=5, help="fresh runs per loader (median)")
    parser.add_argument(
        "--peers",
        nargs="*",
        choices=PEERS,
        help="other loaders to run beside torch (default: those installed; none: --peers)",
    )
    parser.add_argument("--json", action="store_true", help="results as JSON on stdout")
    parser.add_argument("--child", nargs=2, metavar=("IMPL", "WORKLOAD"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        # torch warns that 8 workers exceed the CPU count; W1 runs them on purpose.
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        print(json.dumps(child(*args.child, args.port)))
        return
    table = sys.stderr if args.json else sys.stdout
    asked = list(PEERS) if args.peers is None else list(dict.fromkeys(args.peers))
    peers = [p for p in asked if installed(other_loaders.MODULES[p])]
    notes = [
        f"{p}: not installed ({other_loaders.MODULES[p]}), skipped" for p in asked if p not in peers
    ]
    chosen = args.only or list(WORKLOADS)
    ceiling = any(WORKLOADS[name].ceiling for name in chosen)
    columns = ["torch", "aioloader", *peers, *(["bare"] if ceiling else [])]
    print(
        f"{sys.version.split()[0]}, {os.cpu_count()} CPUs, median of {args.repeat} fresh runs; "
        "each cell: first batch, samples/s from construction\n",
        file=table,
    )
    head = [
        "workload",
        *("bare aiohttp" if c == "bare" else c for c in columns),
        "best other (rate)",
        "aioloader / best",
        "first batch: fastest other / aioloader",
    ]
    print("| " + " | ".join(head) + " |", file=table)
    print("|" + "---|" * len(head), file=table)
    imports: dict[str, list[float]] = {impl: [] for impl in columns}
    rows = []
    compile_bytecode("aioloader")
    with http_servers(chosen) as ports:
        for name in chosen:
            w = WORKLOADS[name]
            port = ports.get(w.jitter, 0)
            impls = [
                "aioloader",
                "torch",
                *(peers if w.peers else []),
                *(["bare"] if w.ceiling else []),
            ]
            runs: dict[str, list[dict[str, Any]]] = {impl: [] for impl in impls}
            failed: dict[str, str] = {}
            for _ in range(args.repeat):
                for impl in impls:  # interleaved: a slow minute on the machine hits all
                    if impl in failed:
                        continue
                    try:
                        result = measure(impl, name, port)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        if impl in ("torch", "aioloader"):
                            raise
                        failed[impl] = str(exc).strip().splitlines()[-1]
                        print(f"{name}: {exc}\n(left out of {name})", file=sys.stderr)
                        continue
                    runs[impl].append(result)
                    imports[impl].append(result["import_s"])
            row = summarise(name, runs, failed)
            rows.append(row)
            print(cells(row, columns), file=table, flush=True)
    import_s = {k: statistics.median(v) for k, v in imports.items() if v}
    print(
        "\nimport (median, after torch): "
        + ", ".join(f"{IMPORTS[k]} {v * 1e3:.0f} ms" for k, v in import_s.items())
        + ". Best other: the fastest of torch and the other loaders by samples/s; bare aiohttp: "
        "the ceiling, no loader; ratios above 1: aioloader is ahead.",
        file=table,
    )
    for note in notes:
        print(note, file=table)
    if args.json:
        document = {
            "benchmark": "cold_start",
            "repeat": args.repeat,
            "cpus": os.cpu_count(),
            "peers": peers,
            "notes": notes,
            "http": {
                "size": HTTP_SIZE,
                "latency_s": HTTP_LATENCY_S,
                "jitter": {
                    name: WORKLOADS[name].jitter for name in chosen if WORKLOADS[name].kind == HTTP
                },
                "io_concurrency": IO_CONCURRENCY,
            },
            "import_s": import_s,
            "rows": rows,
        }
        print(json.dumps(document))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
