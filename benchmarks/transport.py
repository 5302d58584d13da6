"""Worker-to-consumer transport: large payloads, no per-item work, one worker process.

Each item is a payload of 2, 8 or 32 MiB: ``bytes`` (one object made once per worker, handed
over again and again: pickling copies it anyway), or a numpy array or torch tensor copied from
one made once per worker (a fresh array per item, as a real batch is: handing the same tensor
over again would let torch send the handle of a storage it already shared, at no cost, which
no training run does). A tensor item wraps such a numpy copy (``torch.from_numpy``): a
``clone()`` of 32 MiB takes torch's allocator 20 ms of page faults here (numpy asks for huge
pages for large arrays and copies the same in 4-5 ms), and where the producer has two intra-op
threads (SPDL's subprocess) it takes half as long, so the clone, not the transport, set the
tensor rows' rate at 32 MiB. The worker does nothing else; the consumer drops each item at
once:

- ``pipe``: a process sending each item through a ``multiprocessing.Pipe`` (pickled, copied
  through the kernel, unpickled): the floor every loader should beat;
- ``torch``: torch's ``DataLoader(batch_size=None, num_workers=1, persistent_workers=True)``
  (tensors, and numpy
  arrays it converts to tensors, travel in a fresh shared-memory segment each; bytes pickled);
- ``aioloader``: ``DataLoader(batch_size=None, num_workers=1, persistent_workers=True)``, as
  torch's (arrays and tensors written
  into a reused shared-memory slot, the consumer maps it; bytes pickled);
- ``spdl``: ``spdl.pipeline.iterate_in_subprocess`` with its ``SharedMemorySegmentPool``
  arena (a reused segment per item), where SPDL is installed.

Each loader and payload kind runs in a fresh interpreter (one epoch to warm up, one timed);
reported: MB/s, the consumer's CPU seconds per GB moved (its own process, every thread), and
the PSS of the process tree after the timed epoch, read once (sampling it all along reads the
memory maps of processes mapping hundreds of MB of segments, and slowed what it measured).
The machine is shared: read the ratios.

    python benchmarks/transport.py                   # 2, 8, 32 MiB; 256 MiB moved per size
    python benchmarks/transport.py --mib 8 --total-mib 1024 --kinds numpy
    python benchmarks/transport.py --quick           # the smoke test: seconds
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import multiprocessing
import pickle
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from harness import run_child, tree_pss_mb  # noqa: E402  (benchmarks/ is not a package)

LOADERS = ("pipe", "torch", "aioloader", "spdl")
KINDS = ("bytes", "numpy", "torch")
MiB = 2**20


def make_payload(kind: str, nbytes: int) -> Any:
    import numpy as np

    if kind == "bytes":
        return bytes(nbytes)
    array = np.arange(nbytes // 4, dtype=np.float32)
    if kind == "numpy":
        return array
    import torch

    return torch.from_numpy(array)


class Payloads:
    """``n`` items, each the same payload, made once in the process that reads it."""

    def __init__(self, kind: str, nbytes: int, n: int) -> None:
        self.kind, self.nbytes, self.n = kind, nbytes, n
        self._payload: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if self._payload is None:
            self._payload = make_payload(self.kind, self.nbytes)
        if self.kind == "bytes":
            return self._payload
        if self.kind == "numpy":
            return self._payload.copy()
        import torch

        return torch.from_numpy(self._payload.numpy().copy())  # see the module docstring

    def __iter__(self) -> Iterator[Any]:  # SPDL iterates it in its subprocess
        return (self[i] for i in range(self.n))

    def __getstate__(self) -> dict[str, Any]:
        return {"kind": self.kind, "nbytes": self.nbytes, "n": self.n, "_payload": None}


# -- the loaders ------------------------------------------------------------------------------


def _send(conn: Any, kind: str, nbytes: int, n: int) -> None:
    # Plain pickle (protocol 5), not the connection's ForkingPickler: with torch imported, that
    # one sends a tensor as a file descriptor of shared memory, which is torch's road, not a
    # pipe's.
    payloads = Payloads(kind, nbytes, n)
    for i in range(n):
        conn.send_bytes(pickle.dumps(payloads[i], protocol=5))
    conn.close()


def epochs_pipe(data: Payloads) -> tuple[Callable[[], Iterable[Any]], Callable[[], None]]:
    ctx = multiprocessing.get_context("forkserver")

    def epoch() -> Iterator[Any]:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_send, args=(send, data.kind, data.nbytes, data.n))
        proc.start()
        send.close()
        for _ in range(data.n):
            yield pickle.loads(recv.recv_bytes())
        proc.join()
        recv.close()

    return epoch, lambda: None


def epochs_torch(data: Payloads) -> tuple[Callable[[], Iterable[Any]], Callable[[], None]]:
    from torch.utils.data import DataLoader

    loader = DataLoader(data, batch_size=None, num_workers=1, persistent_workers=True)
    return (lambda: loader), lambda: None


def epochs_aioloader(data: Payloads) -> tuple[Callable[[], Iterable[Any]], Callable[[], None]]:
    import aioloader

    # persistent_workers as torch's above: without it each epoch loads a fresh dataset copy,
    # whose payload the worker then makes again (~30 ms at 32 MiB, in an epoch of four items).
    loader = aioloader.DataLoader(data, batch_size=None, num_workers=1, persistent_workers=True)
    return (lambda: loader), loader.close


def epochs_spdl(data: Payloads) -> tuple[Callable[[], Iterable[Any]], Callable[[], None]]:
    from spdl.pipeline import SharedMemorySegmentPool, iterate_in_subprocess

    # The arena's condition variable comes from the default context: make it the one the
    # subprocess starts with.
    multiprocessing.set_start_method("forkserver", force=True)
    arena = SharedMemorySegmentPool(segment_size=data.nbytes + MiB, count=4)
    source = iterate_in_subprocess(
        functools.partial(Payloads, data.kind, data.nbytes, data.n),
        buffer_size=3,
        mp_context="forkserver",
        arena=arena,
    )
    return (lambda: source), lambda: None


EPOCHS = {
    "pipe": epochs_pipe,
    "torch": epochs_torch,
    "aioloader": epochs_aioloader,
    "spdl": epochs_spdl,
}


def consumer_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(loader: str, kind: str, sizes: list[int], total: int) -> list[dict[str, Any]]:
    """One loader, one payload kind, each size: one warm-up epoch, then one timed."""
    import torch

    torch.set_num_threads(1)
    rows = []
    for mib in sizes:
        n = max(4, total // mib)
        data = Payloads(kind, mib * MiB, n)
        epoch, close = EPOCHS[loader](data)
        try:
            assert sum(1 for _ in epoch()) == n
            cpu, started = consumer_cpu_s(), time.perf_counter()
            seen = 0
            for item in epoch():
                seen += 1
                del item
            elapsed = time.perf_counter() - started
            cpu = consumer_cpu_s() - cpu
            pss = tree_pss_mb()
        finally:
            close()
        assert seen == n
        moved = n * mib * MiB
        rows.append(
            {
                "loader": loader,
                "kind": kind,
                "mib": mib,
                "items": n,
                "mb_s": moved / elapsed / 1e6,
                "consumer_cpu_s_per_gb": cpu / (moved / 1e9),
                "pss_mb": pss,
            }
        )
    return rows


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[2, 8, 32], help="payload MiB")
    parser.add_argument("--total-mib", type=int, default=256, help="MiB moved per size")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--loaders", default=",".join(LOADERS))
    parser.add_argument("--quick", action="store_true", help="the smoke test: 2 MiB, 16 MiB")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    parser.add_argument("--child", nargs=2, metavar=("LOADER", "KIND"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.total_mib = [2], 16
    if min(args.mib) < 1 or args.total_mib < 1:
        parser.error(f"--mib and --total-mib must be >= 1, got {args.mib}, {args.total_mib}")
    if args.child:
        loader, kind = args.child
        print(json.dumps(child(loader, kind, args.mib, args.total_mib)))
        return 0
    chosen = [n for n in args.loaders.split(",") if n]
    if set(chosen) - set(LOADERS):
        parser.error(f"--loaders: unknown {sorted(set(chosen) - set(LOADERS))}")
    skipped = {}
    if "spdl" in chosen and not installed("spdl.pipeline"):
        skipped["spdl"] = "not installed (pip install spdl)"
    common = ["--mib", *map(str, args.mib), "--total-mib", str(args.total_mib)]
    rows: list[dict[str, Any]] = []
    for kind in args.kinds:
        for loader in chosen:
            if loader in skipped:
                continue
            print(f"transport: {loader}, {kind} ...", file=sys.stderr, flush=True)
            rows += run_child(
                __file__, [*common, "--child", loader, kind], f"transport: {loader} {kind}"
            )
    document = {"benchmark": "transport", "skipped": skipped, "rows": rows}
    print(table(document), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(document))
    return 0


def table(doc: dict[str, Any]) -> str:
    lines = [
        "| payload | loader | MB/s | / pipe | / torch | / spdl | consumer CPU s/GB "
        "| PSS MB after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rates = {(r["kind"], r["mib"], r["loader"]): r["mb_s"] for r in doc["rows"]}
    for r in doc["rows"]:
        cells = []
        for base in ("pipe", "torch", "spdl"):
            value = rates.get((r["kind"], r["mib"], base))
            cells.append(f"{r['mb_s'] / value:.2f}x" if value else "")
        lines.append(
            f"| {r['kind']} {r['mib']} MiB | {r['loader']} | {r['mb_s']:,.0f} | "
            + " | ".join(cells)
            + f" | {r['consumer_cpu_s_per_gb']:.3f} | {r['pss_mb']:.0f} |"
        )
    for name, why in doc["skipped"].items():
        lines.append(f"| | {name} | {why} | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
