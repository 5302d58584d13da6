"""The cost of one job sent to a worker process: the executor's queues against the pipe channel.

Both send a 2 KiB payload to workers that return it unchanged, with ``--depth`` jobs in flight
over ``--workers`` single-process workers (forkserver), awaited on the event loop; they differ
only in the way there:

- ``executor``: ``loop.run_in_executor(ProcessPoolExecutor(1), ...)``: the caller, the call
  queue's feeder thread and the manager thread hand each job on, then a hop back to the loop;
- ``channel``: :class:`aioloader._workers._channel.Channel` over two pipes the loop watches itself.

Reported per job: wall time (throughput) and the main process's CPU time, which is what a
tiny batch pays in the loader's process.

    python benchmarks/worker_roundtrip.py
"""

from __future__ import annotations

import argparse
import asyncio
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import aioloader
from aioloader._workers import resolve_context
from aioloader._workers._channel import open_channel, serve_over


def echo(x: Any) -> Any:
    return x


async def pump(submit: Any, jobs: int, depth: int, payload: bytes) -> tuple[float, float]:
    """Keep ``depth`` jobs in flight until ``jobs`` are done; per-job wall and CPU seconds."""
    pending = [submit(i, payload) for i in range(depth)]
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(jobs):
        await pending.pop(0)
        pending.append(submit(i + depth, payload))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    await asyncio.gather(*pending)
    return wall / jobs, cpu / jobs


async def run_executor(workers: int, jobs: int, depth: int, payload: bytes) -> tuple[float, float]:
    context = resolve_context(None, allow_fork=False)
    pools = [ProcessPoolExecutor(1, mp_context=context) for _ in range(workers)]
    loop = asyncio.get_running_loop()
    try:

        def submit(i: int, data: bytes) -> Any:
            return loop.run_in_executor(pools[i % workers], echo, data)

        await asyncio.gather(*(submit(i, b"") for i in range(workers)))  # started
        return await pump(submit, jobs, depth, payload)
    finally:
        for pool in pools:
            pool.shutdown()


async def run_channel(workers: int, jobs: int, depth: int, payload: bytes) -> tuple[float, float]:
    context = resolve_context(None, allow_fork=False)
    channels, processes = [], []
    for _ in range(workers):
        channel, child = open_channel()
        process = context.Process(target=serve_over, args=child, daemon=True)
        process.start()
        for end in child:
            end.close()
        channels.append(channel)
        processes.append(process)
    try:

        def submit(i: int, data: bytes) -> Any:
            return channels[i % workers].send(echo, data)[1]

        await asyncio.gather(*(submit(i, b"") for i in range(workers)))  # started
        return await pump(submit, jobs, depth, payload)
    finally:
        for channel in channels:
            channel.close()
        for process in processes:
            process.join(5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--depth", type=int, default=4, help="jobs in flight")
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=3, help="runs per way; best counts")
    args = parser.parse_args()
    payload = bytes(2048)
    print(f"{'way':<9} {'us/job (wall)':>14} {'us/job (main CPU)':>18} {'jobs/s':>8}")
    for name, fn in (("executor", run_executor), ("channel", run_channel)):
        best = min(
            (aioloader.run(fn(args.workers, args.jobs, args.depth, payload)))
            for _ in range(args.repeat)
        )
        wall, cpu = best
        print(f"{name:<9} {wall * 1e6:>14.0f} {cpu * 1e6:>18.0f} {1 / wall:>8.0f}", flush=True)


if __name__ == "__main__":
    main()
