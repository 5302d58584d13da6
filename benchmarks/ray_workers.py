"""Ray actors as workers against local worker processes, Ray Data and bare Ray, in one run.

The same pipeline four ways, at the same worker count (``--workers``): samples of float32
images made by a CPU-bound per-sample transform (a decode stand-in, normalisation and a blur),
collated into batches of about 1 MB (16 x 1x128x128) and 9.6 MB (16 x 3x224x224):

- ``local``: ``DataLoader(num_workers=W)``: worker processes, batches in shared memory;
- ``ray``: ``DataLoader(workers=RayWorkers(W))``: Ray actors, batches through the object store;
- ``ray data``: ``ray.data.range(n).map_batches(...).iter_torch_batches(...)``, the tool a Ray
  user would pick instead (unordered, and no resume; ``W`` tasks of ``--num-cpus`` each);
- ``bare ray``: ``W`` plain (threaded) Ray actors, one call per batch returning it (a numpy
  array, copied out of the object store as the loader copies a tensor), two calls in flight
  per actor (the loader's default prefetch), results taken in order: what one Ray call per
  batch costs without the loader (no retries, no deadlines, no resume, no statistics).

Reported per batch size: samples/s of each (the best of ``--repeat`` epochs, after one warm-up
epoch), the ratios ray/local, ray/ray-data and bare-ray/local, and the added p50 latency of one
batch: the wall time per batch with one batch in flight at a time (``prefetch=1``, so nothing
overlaps), ray's p50 minus local's. Then where the CPU went during the timed epochs of
``local``, ``ray`` and ``bare ray``, in ms per batch: the training process, the workers (worker
processes or actors), and Ray's own processes (raylet with its object store, GCS, agents) on
this machine. On a machine whose cores all run the batches, the ratio of samples/s cannot beat
the inverse ratio of CPU per batch.

    python benchmarks/ray_workers.py                 # a local Ray, started for the run
    python benchmarks/ray_workers.py --address host:6379 --workers 8
    python benchmarks/ray_workers.py --quick         # seconds: a smoke run
    python benchmarks/ray_workers.py --call-cost     # Ray's own CPU per call, apart

``--call-cost`` measures what one Ray call costs apart from any work: ``--workers`` actors
(async, as the loader's, and threaded), two calls in flight each, each returning a fresh 1 MB
array through the object store (copied out, as the loader copies a tensor) or a few hundred
bytes (the reply alone, as a batch handed over in this machine's shared memory is): CPU ms
per call across the caller, the actors and Ray's own processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import psutil

from aioloader import DataLoader, RayWorkers

#: (name, shape of one sample): 16 samples make a batch of about 1 MB and about 9.6 MB.
SIZES = {"1MB": (1, 128, 128), "9.6MB": (3, 224, 224)}
BATCH = 16


def make_sample(index: int, shape: tuple[int, ...], work: int) -> np.ndarray[Any, Any]:
    """Sample ``index``: a deterministic uint8 image 'decoded', normalised and blurred
    ``work`` times (the CPU-bound transform)."""
    rng = np.random.default_rng(index)
    image = rng.integers(0, 256, size=shape, dtype=np.uint8).astype(np.float32)
    image = (image - 127.5) / 64.0
    for _ in range(work):
        image[..., 1:-1, 1:-1] = (
            image[..., :-2, 1:-1]
            + image[..., 2:, 1:-1]
            + image[..., 1:-1, :-2]
            + image[..., 1:-1, 2:]
        ) * 0.25
    return image


class Images:
    """The map-style dataset of the loader runs."""

    def __init__(self, n: int, shape: tuple[int, ...], work: int) -> None:
        self.n = n
        self.shape = shape
        self.work = work

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray[Any, Any]:
        return make_sample(index, self.shape, self.work)


@dataclass(frozen=True, slots=True)
class Row:
    size: str
    local_sps: float
    ray_sps: float
    data_sps: float
    local_p50_ms: float
    ray_p50_ms: float
    bare_sps: float = 0.0
    local_cpu_ms: dict[str, float] | None = None  # per batch: "main", "workers", "ray"
    ray_cpu_ms: dict[str, float] | None = None
    bare_cpu_ms: dict[str, float] | None = None

    @property
    def vs_local(self) -> float:
        return self.ray_sps / self.local_sps

    @property
    def vs_data(self) -> float:
        return self.ray_sps / self.data_sps


def timed_epochs(
    batches: Callable[[], Iterable[Any]], repeat: int, cpu: CpuProbe | None = None
) -> float:
    """Samples/s of the best of ``repeat`` epochs, after one warm-up epoch; ``cpu`` measures
    the timed epochs."""
    best = 0.0
    for attempt in range(repeat + 1):
        if attempt == 1 and cpu is not None:
            cpu.begin()
        started, samples = time.perf_counter(), 0
        for batch in batches():
            samples += len(batch)
            if cpu is not None and attempt:
                cpu.batches += 1
        rate = samples / (time.perf_counter() - started)
        if attempt:
            best = max(best, rate)
    if cpu is not None:
        cpu.end()
    return best


#: Names of Ray's own processes (besides its workers, whose titles begin with ``ray::``).
RAY_PROCESSES = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env")


class CpuProbe:
    """CPU seconds (user + system) of this process, of the workers (``workers()``'s pids, or
    this process's descendants that are not Ray's), and of Ray's processes on this machine,
    between :meth:`begin` and :meth:`end`, per batch counted in ``batches``."""

    def __init__(self, workers: Callable[[], Iterable[int]] | None = None) -> None:
        self._workers = workers
        self._start: dict[int, tuple[str, float]] = {}
        self.batches = 0
        self.ms_per_batch: dict[str, float] = {}

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        me = psutil.Process()
        workers = set(self._workers()) if self._workers is not None else set()
        kids = {child.pid for child in me.children(recursive=True)}
        out: dict[int, tuple[str, float]] = {}
        for proc in psutil.process_iter(["pid", "name", "cmdline"]):
            try:
                pid, name = proc.info["pid"], proc.info["name"] or ""
                cmd = " ".join(proc.info["cmdline"] or ())
                if pid == me.pid:
                    kind = "main"
                elif pid in workers:
                    kind = "workers"
                elif name.startswith("ray::") or any(n in cmd for n in RAY_PROCESSES):
                    kind = "ray"
                elif pid in kids and self._workers is None:
                    kind = "workers"
                else:
                    continue
                times = proc.cpu_times()
                out[pid] = (kind, times.user + times.system)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def begin(self) -> None:
        self._start, self.batches = self._snapshot(), 0

    def end(self) -> None:
        spent = {"main": 0.0, "workers": 0.0, "ray": 0.0}
        for pid, (kind, seconds) in self._snapshot().items():
            spent[kind] += seconds - self._start.get(pid, (kind, 0.0))[1]
        self.ms_per_batch = {k: v / max(1, self.batches) * 1e3 for k, v in spent.items()}


def p50_batch_ms(loader: DataLoader, batches: int) -> float:
    """Wall ms per batch with one batch in flight at a time (``loader`` has prefetch=1)."""
    times = []
    it = iter(loader)
    next(it)  # warm
    for _ in range(batches):
        started = time.perf_counter()
        next(it)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def run_size(name: str, args: argparse.Namespace, pool: RayWorkers) -> Row:
    import ray

    shape = SIZES[name]
    dataset = Images(args.samples, shape, args.work)
    local = DataLoader(dataset, batch_size=BATCH, num_workers=args.workers, persistent_workers=True)
    remote = DataLoader(dataset, batch_size=BATCH, workers=pool, persistent_workers=True)
    local_cpu, ray_cpu = CpuProbe(), CpuProbe(lambda: pool.worker_pids)
    with local, remote:
        local_sps = timed_epochs(lambda: local, args.repeat, local_cpu)
        ray_sps = timed_epochs(lambda: remote, args.repeat, ray_cpu)
    one_local = DataLoader(
        Images(BATCH * (args.latency_batches + 2), shape, args.work),
        batch_size=BATCH,
        num_workers=args.workers,
        prefetch=1,
    )
    one_ray = DataLoader(
        Images(BATCH * (args.latency_batches + 2), shape, args.work),
        batch_size=BATCH,
        workers=pool,
        prefetch=1,
    )
    with one_local, one_ray:
        local_p50 = p50_batch_ms(one_local, args.latency_batches)
        ray_p50 = p50_batch_ms(one_ray, args.latency_batches)

    work, n = args.work, args.samples

    def transform(block: dict[str, np.ndarray[Any, Any]]) -> dict[str, np.ndarray[Any, Any]]:
        return {"x": np.stack([make_sample(int(i), shape, work) for i in block["id"]])}

    def data_batches() -> Iterable[Any]:
        ds = ray.data.range(n).map_batches(
            transform, batch_size=BATCH, num_cpus=args.num_cpus, concurrency=args.workers
        )
        for batch in ds.iter_torch_batches(batch_size=BATCH):
            yield batch["x"]

    data_sps = timed_epochs(data_batches, args.repeat)

    # No logical CPU asked: they run beside the pool's idle actors, which hold theirs.
    bare_actor: Any = ray.remote(num_cpus=0)(Bare)
    bare: list[Any] = [bare_actor.remote(shape, work) for _ in range(args.workers)]
    bare_pids = ray.get([actor.ready.remote() for actor in bare])

    def bare_batches() -> Iterable[Any]:
        starts = iter(range(0, n - n % BATCH, BATCH))
        pending: list[Any] = []
        while True:
            while len(pending) < 2 * len(bare):
                start = next(starts, None)
                if start is None:
                    break
                actor = bare[start // BATCH % len(bare)]
                pending.append(actor.make.remote(start, BATCH))
            if not pending:
                return
            yield np.array(ray.get(pending.pop(0)))  # a copy of its own, as the loader's tensor

    bare_cpu = CpuProbe(lambda: bare_pids)
    bare_sps = timed_epochs(bare_batches, args.repeat, bare_cpu)
    for actor in bare:
        ray.kill(actor)
    return Row(
        name,
        local_sps,
        ray_sps,
        data_sps,
        local_p50,
        ray_p50,
        bare_sps,
        local_cpu.ms_per_batch,
        ray_cpu.ms_per_batch,
        bare_cpu.ms_per_batch,
    )


class Bare:
    """A plain Ray actor making the same batches, one call per batch (the ``bare ray`` run)."""

    def __init__(self, shape: tuple[int, ...], work: int) -> None:
        self.shape = shape
        self.work = work

    def ready(self) -> int:
        """Placed and started: its pid."""
        return os.getpid()

    def make(self, start: int, size: int) -> np.ndarray[Any, Any]:
        return np.stack([make_sample(i, self.shape, self.work) for i in range(start, start + size)])


class _CallAsync:
    """An async actor that answers at once (``--call-cost``)."""

    def __init__(self) -> None:
        self.base = np.ones(1 << 20, dtype=np.uint8)

    async def ready(self) -> int:
        return os.getpid()

    async def call(self, big: bool) -> Any:
        return self.base.copy() if big else b"x" * 300


class _CallThreaded:
    """The same, threaded (``--call-cost``)."""

    def __init__(self) -> None:
        self.base = np.ones(1 << 20, dtype=np.uint8)

    def ready(self) -> int:
        return os.getpid()

    def call(self, big: bool) -> Any:
        return self.base.copy() if big else b"x" * 300


def call_cost(workers: int, calls: int) -> str:
    """The ``--call-cost`` table: CPU ms per call by kind of actor and of reply."""
    import ray

    lines = [
        "| actor | reply | CPU ms per call | caller | actors | Ray's processes | calls/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, cls, options in (
        ("async", _CallAsync, {}),
        ("threaded", _CallThreaded, {"max_concurrency": 2}),
    ):
        actors = [ray.remote(num_cpus=0)(cls).options(**options).remote() for _ in range(workers)]
        pids = ray.get([actor.ready.remote() for actor in actors])
        for big in (True, False):

            async def drive(n: int, *, big: bool = big, actors: list[Any] = actors) -> None:
                slots = asyncio.Semaphore(2 * len(actors))

                async def one(i: int) -> None:
                    async with slots:
                        reply = await actors[i % len(actors)].call.remote(big)
                        if big:
                            reply.copy()

                await asyncio.gather(*(one(i) for i in range(n)))

            asyncio.run(drive(calls // 4))  # warm-up
            probe = CpuProbe(lambda pids=pids: pids)
            probe.begin()
            start = time.perf_counter()
            asyncio.run(drive(calls))
            wall = time.perf_counter() - start
            probe.batches = calls
            probe.end()
            ms = probe.ms_per_batch
            reply = "1 MB, object store" if big else "300 B, inline"
            lines.append(
                f"| {kind} | {reply} | {sum(ms.values()):.2f} | {ms['main']:.2f} | "
                f"{ms['workers']:.2f} | {ms['ray']:.2f} | {calls / wall:,.0f} |"
            )
        for actor in actors:
            ray.kill(actor)
    return "\n".join(lines)


def table(rows: list[Row], workers: int) -> str:
    lines = [
        f"| batch | local workers={workers} (samples/s) | ray actors={workers} | ray / local | "
        "ray data | ray / ray data | bare ray | bare ray / local | p50 per batch, local | "
        "added by ray |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.size} | {r.local_sps:.0f} | {r.ray_sps:.0f} | {r.vs_local:.2f}x | "
            f"{r.data_sps:.0f} | {r.vs_data:.2f}x | {r.bare_sps:.0f} | "
            f"{r.bare_sps / r.local_sps:.2f}x | {r.local_p50_ms:.1f} ms | "
            f"{r.ray_p50_ms - r.local_p50_ms:+.1f} ms |"
        )
    lines += [
        "",
        "| batch | CPU ms per batch | training process | workers | Ray's processes | in all |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        for what, cpu in (
            ("local workers", r.local_cpu_ms),
            ("ray actors", r.ray_cpu_ms),
            ("bare ray", r.bare_cpu_ms),
        ):
            if cpu:
                lines.append(
                    f"| {r.size} | {what} | {cpu['main']:.1f} | {cpu['workers']:.1f} | "
                    f"{cpu['ray']:.1f} | {sum(cpu.values()):.1f} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=512, help="samples per epoch")
    parser.add_argument("--work", type=int, default=6, help="blur passes per sample (CPU cost)")
    parser.add_argument("--repeat", type=int, default=2, help="timed epochs; the best counts")
    parser.add_argument("--latency-batches", type=int, default=10)
    parser.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPUs per actor / task")
    parser.add_argument(
        "--sizes", default=",".join(SIZES), help="comma-separated of " + str(list(SIZES))
    )
    parser.add_argument("--address", default=None, help="a Ray cluster to join (default: local)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument(
        "--call-cost", action="store_true", help="Ray's own CPU per call, without the loader"
    )
    parser.add_argument("--calls", type=int, default=800, help="calls per --call-cost row")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.work, args.repeat, args.latency_batches = 64, 1, 1, 3
    if args.call_cost and args.address is not None:
        parser.error("--call-cost measures a local Ray only (it reads the CPU of this machine)")

    import ray

    if not ray.is_initialized():
        init: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
        if args.address is None:
            # The pool's actors hold theirs for the whole run, so Ray Data runs in the one
            # left. Given more logical CPUs (7 for 2 workers) it ran more tasks at once on
            # the same cores and was slower (775-816 against 1194-1302 samples/s at 1 MB in
            # alternating runs): this keeps its better setting.
            init["num_cpus"] = max(args.workers, 1) * max(args.num_cpus, 1) + 1
            init["include_dashboard"] = False
        ray.init(address=args.address, **init)
    if args.call_cost:
        print(call_cost(args.workers, args.calls))
        ray.shutdown()
        return
    ray.data.DataContext.get_current().enable_progress_bars = False
    rows = []
    with RayWorkers(args.workers, num_cpus=args.num_cpus) as pool:
        for name in args.sizes.split(","):
            rows.append(run_size(name, args, pool))
    print(table(rows, args.workers))
    if args.json:
        print(
            json.dumps([{**asdict(r), "vs_local": r.vs_local, "vs_data": r.vs_data} for r in rows])
        )
    ray.shutdown()


if __name__ == "__main__":
    main()
