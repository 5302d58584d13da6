"""Tar shards over HTTP: aioloader's TarDataset against webdataset under torch's DataLoader.

One run on this machine. ``--shards`` WebDataset-style shards of ``--samples`` samples (a
``bin`` member of ``--size`` bytes and a ``cls`` member each) are written to a temporary
directory and served by a server process (``tests/http_server.py --files``, on uvloop) that adds
``--latency`` seconds before every response (time to first byte), standing in for an object
store. Then, one after another, with the same ``--workers`` and ``--batch-size``:

- ``aioloader``: ``DataLoader(TarDataset(urls, decode=decode, shards_in_flight=K),
  num_workers=W)``: shards streamed on the loader's loop, ``K`` at once, decoded and collated in
  the worker processes (the raw sample bytes reach them through shared memory);
- ``aioloader threads``: the same with ``thread_pool=True``: ``W`` threads decode and collate,
  so the bytes never leave the process;
- ``webdataset``: ``torch.utils.data.DataLoader(wds.WebDataset(urls).map(decode),
  num_workers=W)``: each worker reads its shards one after another (through ``curl``), as
  webdataset does; skipped with a message when webdataset is not installed;
- ``one shard``: a bare aiohttp GET of one shard at a time, no parsing: the time per shard
  ``t = latency + transfer``, from which the **latency ceiling** of the concurrency used is
  ``K x samples / t`` samples/s (``K`` shards always in flight, each taking ``t``);
- ``bare xK``: bare aiohttp GETs of every shard, ``K`` at once, no parsing: what the server, the
  network stack and the CPUs allow at that concurrency.

``decode`` is the same for both loaders: the ``bin`` bytes as a writable uint8 array and the
class as an int; the default collate makes tensors. Every run checks the sample count.

Prints one table, the ratio aioloader / webdataset (target >= 3x with 2 workers) and
aioloader / latency ceiling (target >= 0.9). For each run it also counts the CPU time (user +
system) of every process involved during the timed part: the server, the loader's own process
and its workers (live ones by pid; torch's, joined at the end of the epoch, through
``getrusage(RUSAGE_CHILDREN)``), per sample; and from their sum, the rate the run would reach
if every CPU worked for it alone ("CPU bound"). ``--json`` prints a JSON document on stdout (the
table goes to stderr); ``--out DIR`` writes ``tar_shards.md`` and ``tar_shards.json`` there.
Quick run: ``python benchmarks/tar_shards.py --quick``.

Sharp edge: on a small machine the server and the loaders share the CPUs; the bytes cross a
socket, the tar parser and shared memory to the workers, so a machine with two cores is bound
by CPU long before the latency ceiling (which assumes the transfer of a shard takes what it
takes alone). ``bare xK`` and the CPU columns show where that bound is; a run with a longer
latency (``--latency 0.2``) shows the loaders where the machine is not the bound.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from remote_http import server_process


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    samples: int
    seconds: float
    # CPU seconds spent during the timed run: {"server", "main", "workers"} (empty if unknown)
    cpu: dict[str, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.samples / self.seconds

    def cpu_us(self, part: str) -> float:
        """CPU microseconds per sample of ``part`` ("total": all of them)."""
        if part == "total":
            return sum(self.cpu.values()) * 1e6 / self.samples
        return self.cpu[part] * 1e6 / self.samples


class CpuClock:
    """CPU seconds (user + system) of the processes of a run: the server, this process, and
    the loader's workers: live ones by pid (aioloader's stay up until the loader closes), and
    reaped children through ``getrusage(RUSAGE_CHILDREN)`` (torch's workers are joined at the
    end of the epoch, with the ``curl`` processes they waited for)."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self.worker_pids: tuple[int, ...] = ()
        self._start: dict[str, float] = {}

    @staticmethod
    def _of_pid(pid: int | None) -> float:
        if pid is None:
            return 0.0
        try:
            with open(f"/proc/{pid}/stat") as f:  # utime and stime, in clock ticks
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return 0.0

    def _read(self) -> dict[str, float]:
        me = resource.getrusage(resource.RUSAGE_SELF)
        reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
        return {
            "server": self._of_pid(self.server_pid),
            "main": me.ru_utime + me.ru_stime,
            "workers": reaped.ru_utime
            + reaped.ru_stime
            + sum(self._of_pid(pid) for pid in self.worker_pids),
        }

    def start(self, worker_pids: tuple[int, ...] = ()) -> None:
        self.worker_pids = worker_pids
        self._start = self._read()

    def stop(self) -> dict[str, float]:
        end = self._read()
        return {part: max(0.0, end[part] - self._start[part]) for part in end}


def decode(raw: dict[str, Any]) -> tuple[np.ndarray[Any, Any], int]:
    """A sample's bytes as a writable uint8 array, and its class."""
    return np.frombuffer(bytearray(raw["bin"]), np.uint8), int(raw["cls"])


def write_shards(directory: Path, shards: int, samples: int, size: int) -> None:
    block = random.Random(size).randbytes(size + 4096)
    for shard in range(shards):
        with tarfile.open(directory / f"shard-{shard:05d}.tar", "w") as tar:
            for i in range(samples):
                offset = (shard * samples + i) % 4096
                for ext, data in (("bin", block[offset : offset + size]), ("cls", b"%d" % i)):
                    info = tarfile.TarInfo(f"{shard:05d}/{i:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


@contextlib.contextmanager
def serve(directory: Path, latency: float) -> Iterator[int]:
    """Run the test server in a child process serving ``directory``; yield its port."""
    with server_process(["--files", str(directory), "--latency", str(latency)]) as port:
        yield port


def server_pid() -> int | None:
    """The pid of our child process running the test server (for its CPU time), if found."""
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = f.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if parent == me and b"http_server.py" in command:
            return int(entry)
    return None


def check(count: int, expected: int, name: str) -> None:
    if count != expected:
        raise RuntimeError(f"{name} read {count} samples, expected {expected}")


def run_aioloader(
    urls: list[str], args: argparse.Namespace, clock: CpuClock, threads: bool = False
) -> Result:
    import aioloader
    from aioloader.sources import TarDataset

    async def main() -> Result:
        dataset = TarDataset(urls, decode=decode, shards_in_flight=args.shards_in_flight)
        loader = aioloader.DataLoader(
            dataset, batch_size=args.batch_size, num_workers=args.workers, thread_pool=threads
        )
        count = 0
        async with loader:
            await loader.astart()  # the workers start before the clock, as torch's do at iter
            clock.start(loader.worker_pids)
            started = time.perf_counter()
            async for data, _classes in loader:
                count += len(data)
            seconds = time.perf_counter() - started
            cpu = clock.stop()
        name = "aioloader threads" if threads else "aioloader"
        check(count, len(urls) * args.samples, name)
        return Result(name, count, seconds, cpu)

    return aioloader.run(main())


def run_webdataset(urls: list[str], args: argparse.Namespace, clock: CpuClock) -> Result | None:
    try:
        import webdataset as wds
    except ImportError:
        print("webdataset is not installed: skipped (pip install webdataset)", file=sys.stderr)
        return None
    import torch.utils.data

    dataset = wds.WebDataset(urls, shardshuffle=False).map(decode)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, num_workers=args.workers
    )
    clock.start()
    started = time.perf_counter()
    count = sum(len(data) for data, _classes in loader)  # its workers are joined at the end
    seconds = time.perf_counter() - started
    cpu = clock.stop()
    check(count, len(urls) * args.samples, "webdataset")
    return Result("webdataset", count, seconds, cpu)


def run_bare(
    urls: list[str], args: argparse.Namespace, concurrency: int, clock: CpuClock | None = None
) -> Result:
    import aiohttp

    import aioloader

    async def main() -> Result:
        limit = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers={"Accept-Encoding": "identity"}
        ) as session:

            async def one(url: str) -> int:
                async with limit, session.get(url) as response:
                    total = 0
                    async for chunk in response.content.iter_chunked(1 << 20):
                        total += len(chunk)
                    return total

            if clock is not None:
                clock.start()
            started = time.perf_counter()
            await asyncio.gather(*(one(url) for url in urls))
            seconds = time.perf_counter() - started
            cpu = clock.stop() if clock is not None else {}
        return Result(f"bare x{concurrency}", len(urls) * args.samples, seconds, cpu)

    return aioloader.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--samples", type=int, default=100, help="samples per shard")
    parser.add_argument("--size", type=int, default=64 * 1024, help="bytes per sample")
    parser.add_argument("--latency", type=float, default=0.02, help="seconds to first byte")
    parser.add_argument("--workers", type=int, default=2, help="num_workers of both loaders")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--shards-in-flight", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1, help="runs each; the best counts")
    parser.add_argument("--quick", action="store_true", help="8 shards of 20 samples")
    parser.add_argument("--json", action="store_true", help="results as JSON on stdout")
    parser.add_argument("--out", type=Path, help="write tar_shards.md and .json here")
    parser.add_argument("--tag", help="name the files tar_shards-TAG.md and .json instead")
    args = parser.parse_args()
    if args.quick:
        args.shards, args.samples = 8, 20
    warnings.filterwarnings("ignore", category=UserWarning, module="webdataset")

    load_before = os.getloadavg()[0]
    directory = Path(tempfile.mkdtemp(prefix="tar-shards-"))
    try:
        write_shards(directory, args.shards, args.samples, args.size)
        shard_bytes = (directory / "shard-00000.tar").stat().st_size
        with serve(directory, args.latency) as port:
            names = sorted(os.listdir(directory))
            urls = [f"http://127.0.0.1:{port}/files/{name}" for name in names]
            results: dict[str, Result] = {}
            clock = CpuClock(server_pid())
            runs = [
                ("aioloader", lambda: run_aioloader(urls, args, clock)),
                ("threads", lambda: run_aioloader(urls, args, clock, threads=True)),
                ("webdataset", lambda: run_webdataset(urls, args, clock)),
                ("bare", lambda: run_bare(urls, args, args.shards_in_flight, clock)),
            ]
            for round_ in range(args.repeat):
                for name, run in runs:
                    result = run()
                    if result is None:
                        continue
                    rate = f"{result.rate:,.0f} samples/s"
                    print(f"  round {round_}: {result.name}: {rate}", file=sys.stderr)
                    if name not in results or result.rate > results[name].rate:
                        results[name] = result
            per_shard = statistics.median(
                run_bare(urls[:1], args, 1).seconds for _ in range(max(3, args.repeat))
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    load = (load_before, os.getloadavg()[0])
    ceiling = args.shards_in_flight * args.samples / per_shard
    ours = results["aioloader"].rate
    cpus = os.cpu_count() or 1
    table = sys.stderr if args.json else sys.stdout
    lines = [
        f"{args.shards} shards x {args.samples} samples x {args.size // 1024} KiB "
        f"({shard_bytes / 2**20:.1f} MiB a shard), {args.latency * 1000:g} ms to first byte, "
        f"{args.workers} workers, batch {args.batch_size}, shards_in_flight "
        f"{args.shards_in_flight}, {os.cpu_count()} CPUs, best of {args.repeat}; load average "
        f"(runnable processes, ours and others') {load[0]:.1f} before, {load[1]:.1f} after",
        "",
        "| loader | samples/s | MB/s | seconds | CPU us/sample: server | main | workers "
        f"| total | CPU bound of {cpus} cores |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results.values():
        mb = result.rate * args.size / 1e6
        cpu = " | ".join(
            f"{result.cpu_us(part):,.0f}" for part in ("server", "main", "workers", "total")
        )
        bound = cpus * 1e6 / result.cpu_us("total")
        lines.append(
            f"| {result.name} | {result.rate:,.0f} | {mb:,.0f} | {result.seconds:.2f} | {cpu} "
            f"| {bound:,.0f} |"
        )
    lines += [
        "",
        "CPU us/sample: CPU time (user + system) of each process during the timed run, per "
        "sample; the server's is the same work for every loader. CPU bound: the samples/s "
        f"these processes would reach with all {cpus} cores to themselves and no idle core.",
        "",
        f"one shard alone: {per_shard * 1000:.1f} ms (latency + transfer); latency ceiling of "
        f"{args.shards_in_flight} in flight: {args.shards_in_flight} x {args.samples} / "
        f"{per_shard:.4f} s = {ceiling:,.0f} samples/s",
    ]
    ratios: dict[str, float] = {"ceiling": ours / ceiling}
    if "webdataset" in results:
        ratios["webdataset"] = ours / results["webdataset"].rate
        ratios["threads/webdataset"] = results["threads"].rate / results["webdataset"].rate
        lines.append(f"aioloader / webdataset: {ratios['webdataset']:.2f}x (target >= 3x)")
        lines.append(
            f"aioloader threads / webdataset: {ratios['threads/webdataset']:.2f}x "
            f"(the same {args.workers} workers as threads: no raw bytes cross a pipe)"
        )
    lines.append(f"aioloader / latency ceiling: {ratios['ceiling']:.2f} (target >= 0.9)")
    if "webdataset" in results:
        theirs, mine = results["webdataset"].cpu_us("total"), results["aioloader"].cpu_us("total")
        ratios["cpu_per_sample webdataset/aioloader"] = theirs / mine
        lines.append(
            "CPU per sample, webdataset / aioloader: "
            f"{ratios['cpu_per_sample webdataset/aioloader']:.2f}x (the ratio the two would "
            "reach where the CPUs are the bound)"
        )
    lines.append(f"aioloader / bare x{args.shards_in_flight}: {ours / results['bare'].rate:.2f}")
    text = "\n".join(lines)
    print(text, file=table)
    document = {
        "benchmark": "tar_shards",
        "shards": args.shards,
        "samples": args.samples,
        "size": args.size,
        "latency_s": args.latency,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "shards_in_flight": args.shards_in_flight,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "load_average": list(load),
        "samples_per_s": {name: result.rate for name, result in results.items()},
        "cpu_us_per_sample": {
            name: {part: result.cpu_us(part) for part in ("server", "main", "workers", "total")}
            for name, result in results.items()
        },
        "one_shard_s": per_shard,
        "latency_ceiling_samples_per_s": ceiling,
        "ratios": ratios,
    }
    if args.json:
        print(json.dumps(document))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/tar_shards.py " + " ".join(sys.argv[1:])
        stem = f"tar_shards-{args.tag}" if args.tag else "tar_shards"
        (args.out / f"{stem}.md").write_text(f"`{command.strip()}`\n\n{text}\n")
        (args.out / f"{stem}.json").write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
