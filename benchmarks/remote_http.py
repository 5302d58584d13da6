"""Remote HTTP objects: aioloader vs torch's DataLoader vs a bare aiohttp loop.

One run on this machine. A server process (``tests/http_server.py``, on uvloop) serves
``--objects`` objects of ``--size`` bytes on 127.0.0.1 and adds ``--latency`` seconds to every
response, standing in for an object store. The server runs in its own process so that it does
not share an event loop (or the GIL) with the loader being measured. Then, one after another:

- ``aioloader``: ``DataLoader(HTTPDataset(urls), io_concurrency=64)`` in one process, with a
  ``collate_fn`` that keeps the batch as a list of bytes;
- ``torch@N``: ``torch.utils.data.DataLoader`` over a synchronous dataset that GETs each URL with
  ``http.client`` (one keep-alive connection per worker), ``num_workers=N`` for N in
  ``--torch-workers``;
- ``bare``: aiohttp and a semaphore of ``--io-concurrency``, no loader: what the network and the
  server allow, the ceiling for the loader.

Each run reads every object once and checks the byte count. Prints one table and the ratios
ours/torch@2, ours/torch@8 and ours/bare (targets: >= 20x, >= 5x, >= 0.9). With ``--repeat N``
each loader runs N times, interleaved, and the best run counts: on a busy machine the best run
is the one least disturbed by others.

Sharp edge: on a small machine the server and the client share the CPUs, so ``bare`` and
``aioloader`` are bounded by CPU (HTTP parsing on both sides), not by latency and concurrency
(64 / 20 ms = 3,200 requests/s), while torch's workers are bounded by latency alone.

Quick run: ``python benchmarks/remote_http.py --objects 300 --torch-workers 2``. ``--json``
prints the results as one JSON document on stdout (the table goes to stderr), for
``benchmarks/run_all.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVER = Path(__file__).resolve().parent.parent / "tests" / "http_server.py"
#: How long the server process may take to print its port.
SERVER_START_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    samples: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.samples / self.seconds


def object_urls(port: int, count: int) -> list[str]:
    """The URLs of the server's first ``count`` objects; object ``i`` starts with ``i``'s eight
    bytes (``http_server.payload``)."""
    return [f"http://127.0.0.1:{port}/obj/{i}" for i in range(count)]


def keep_list(samples: list[bytes]) -> list[bytes]:
    """A collate_fn that keeps the batch as it is: a list of bytes."""
    return list(samples)


@contextlib.contextmanager
def serve(size: int, latency: float) -> Iterator[int]:
    """Run the test server in a child process serving ``size``-byte payloads; yield its port."""
    with server_process(["--size", str(size), "--latency", str(latency)]) as port:
        yield port


@contextlib.contextmanager
def server_process(server_args: list[str]) -> Iterator[int]:
    """Run ``tests/http_server.py`` with ``server_args`` in a child process (on uvloop where
    installed); yield its port; stop it on exit. ``tar_shards.py`` uses it too."""
    command = [sys.executable, str(SERVER), *server_args]
    with contextlib.suppress(ImportError):
        import uvloop  # noqa: F401

        command.append("--uvloop")
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=SERVER.parent
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # "PORT <n>", or "" if it died
        if not line.startswith("PORT "):
            raise RuntimeError(f"the server did not start (said {line!r})")
        yield int(line.split()[1])
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- aioloader --------------------------------------------------------------------------------


def run_aioloader(
    urls: list[str], size: int, batch_size: int, concurrency: int, prefetch: int | None
) -> Result:
    import aioloader
    from aioloader.sources import HTTPDataset

    async def main() -> Result:
        dataset = HTTPDataset(urls)  # connections: as many as io_concurrency
        loader = aioloader.DataLoader(
            dataset,
            batch_size=batch_size,
            io_concurrency=concurrency,
            collate_fn=keep_list,
            prefetch=prefetch,
        )
        total = 0
        async with loader:
            started = time.perf_counter()
            async for batch in loader:
                total += sum(len(item) for item in batch)
            seconds = time.perf_counter() - started
        check(total, len(urls), size, "aioloader")
        return Result("aioloader", len(urls), seconds)

    return aioloader.run(main())


# -- torch ------------------------------------------------------------------------------------


class SyncHTTPDataset:
    """A map-style dataset that GETs its URLs with http.client: one keep-alive connection per
    process and thread (torch's workers read on one thread each; other loaders read on many)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self._local = threading.local()

    def __len__(self) -> int:
        return len(self.urls)

    def __getitem__(self, index: int) -> bytes:
        parts = urllib.parse.urlsplit(self.urls[index])
        local = self._local
        for attempt in range(3):
            # A forked process inherits its parent's thread-local connection: not its own.
            if getattr(local, "connection", None) is None or local.pid != os.getpid():
                assert parts.hostname is not None
                local.connection = http.client.HTTPConnection(
                    parts.hostname, parts.port, timeout=30
                )
                local.pid = os.getpid()
            connection: http.client.HTTPConnection = local.connection
            try:
                connection.request("GET", parts.path)
                response = connection.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException):
                connection.close()
                local.connection = None
                if attempt == 2:
                    raise
                continue
            if response.status != 200:
                raise OSError(f"{self.urls[index]}: HTTP {response.status}")
            return body
        raise AssertionError("unreachable")

    def __getstate__(self) -> dict[str, Any]:
        return {"urls": self.urls}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.urls = state["urls"]
        self._local = threading.local()


def run_torch(urls: list[str], size: int, batch_size: int, workers: int) -> Result:
    import torch.utils.data

    loader = torch.utils.data.DataLoader(
        SyncHTTPDataset(urls),  # type: ignore[arg-type]
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=keep_list,
        persistent_workers=False,
    )
    total = 0
    started = time.perf_counter()  # worker start-up counts: it is part of an epoch
    for batch in loader:
        total += sum(len(item) for item in batch)
    seconds = time.perf_counter() - started
    check(total, len(urls), size, f"torch@{workers}")
    return Result(f"torch@{workers}", len(urls), seconds)


# -- bare aiohttp -----------------------------------------------------------------------------


def run_bare(urls: list[str], size: int, concurrency: int) -> Result:
    import aiohttp

    import aioloader

    async def main() -> Result:
        gate = asyncio.Semaphore(concurrency)
        connector = aiohttp.TCPConnector(limit=max(256, concurrency))
        async with aiohttp.ClientSession(connector=connector) as session:

            async def one(url: str) -> int:
                async with gate, session.get(url) as response:
                    return len(await response.read())

            started = time.perf_counter()
            sizes = await asyncio.gather(*(one(url) for url in urls))
            seconds = time.perf_counter() - started
        check(sum(sizes), len(urls), size, "bare")
        return Result("bare", len(urls), seconds)

    return aioloader.run(main())


def check(total: int, count: int, size: int, name: str) -> None:
    if total != count * size:
        raise RuntimeError(f"{name}: read {total} bytes, expected {count * size}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--size", type=int, default=64 * 1024, help="bytes per object")
    parser.add_argument("--latency", type=float, default=0.02, help="seconds per request")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--io-concurrency", type=int, default=64)
    parser.add_argument(
        "--prefetch", type=int, default=None, help="aioloader batches in flight (its default)"
    )
    parser.add_argument(
        "--torch-workers",
        default="2,8",
        help="comma-separated num_workers values for torch ('' to skip torch)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of each loader; the best one is reported"
    )
    parser.add_argument("--json", action="store_true", help="results as JSON on stdout")
    args = parser.parse_args()
    # torch warns that 8 workers exceed the CPU count; that is the point of the comparison.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    workers = [int(w) for w in args.torch_workers.split(",") if w.strip()]

    with serve(args.size, args.latency) as port:
        urls = object_urls(port, args.objects)
        runs: list[tuple[str, Callable[[], Result]]] = [
            ("bare", lambda: run_bare(urls, args.size, args.io_concurrency)),
            (
                "aioloader",
                lambda: run_aioloader(
                    urls, args.size, args.batch_size, args.io_concurrency, args.prefetch
                ),
            ),
        ]
        for n in workers:
            runs.append((f"torch@{n}", lambda n=n: run_torch(urls, args.size, args.batch_size, n)))  # type: ignore[misc]
        results: dict[str, Result] = {}
        for round_ in range(args.repeat):
            for name, run in runs:
                result = run()
                print(f"  round {round_}: {name}: {result.rate:,.0f} samples/s", file=sys.stderr)
                if name not in results or result.rate > results[name].rate:
                    results[name] = result

    table = sys.stderr if args.json else sys.stdout
    print(
        f"\n{args.objects} objects x {args.size // 1024} KiB, {args.latency * 1000:g} ms latency, "
        f"batch {args.batch_size}, io_concurrency {args.io_concurrency}, {os.cpu_count()} CPUs, "
        f"best of {args.repeat}",
        file=table,
    )
    print(f"{'loader':<12} {'samples/s':>12} {'seconds':>9}", file=table)
    for result in results.values():
        print(f"{result.name:<12} {result.rate:>12,.0f} {result.seconds:>9.2f}", file=table)
    ours = results["aioloader"].rate
    print(file=table)
    for name, target in (("torch@2", 20.0), ("torch@8", 5.0), ("bare", 0.9)):
        if name in results:
            ratio = ours / results[name].rate
            verdict = "ok" if ratio >= target else "below target"
            print(f"ours/{name:<8} {ratio:6.2f}x  (target >= {target:g}x: {verdict})", file=table)
    if args.json:
        document = {
            "benchmark": "remote_http",
            "objects": args.objects,
            "size": args.size,
            "latency_s": args.latency,
            "batch_size": args.batch_size,
            "io_concurrency": args.io_concurrency,
            "repeat": args.repeat,
            "cpus": os.cpu_count(),
            "samples_per_s": {name: result.rate for name, result in results.items()},
        }
        print(json.dumps(document))


if __name__ == "__main__":
    main()
