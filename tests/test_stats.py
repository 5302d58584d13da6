"""Statistics (_stats): per-epoch and total numbers, busy shares, the bottleneck verdict.

The verdict is checked twice: on synthetic sums (exact, no loop, every branch) and on three
deliberately slowed pipelines whose delays are known (a dataset that sleeps per sample, an async
dataset over HTTP with server latency, a consumer that sleeps per batch). Bounds on measured
shares are loose on purpose (``> 0.6``, ``< 0.2``): the machine running the tests is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from datasets import AsyncRange, FailAt, Slow
from helpers import collect, flat
from http_server import FaultServer, payload

import aioloader
from aioloader import DataLoader, LoaderStatistics
from aioloader._stats._counters import (
    CPU_SAMPLE_INTERVAL_S,
    CPU_SATURATED,
    SKIP_RECORDS,
    WAIT_SHARE_THRESHOLD,
    Capacity,
    Counters,
    EpochStatistics,
    cpus_available,
    process_tree_cpu,
)
from aioloader.sources import HTTPDataset, RetryPolicy

TOKEN = object()


class Arrays:
    """Sample ``i``: 1000 float32 (4000 bytes) filled with ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(1000, index, dtype=np.float32)


class FakeCpu:
    """A process tree's CPU clock that reads ``(main_s, tree_s, wait_s)`` from a list, in turn
    (the last one again once they are used up); counts its reads."""

    def __init__(self, *reads: tuple[float, float, float]) -> None:
        self.reads = list(reads)
        self.count = 0

    def __call__(self) -> tuple[float, float, float]:
        self.count += 1
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]


def measured(capacity: Capacity, wall: float = 10.0, **sums: float) -> EpochStatistics:
    """The statistics of an epoch of ``wall`` seconds with these sums (the rest zero), whose
    processes' CPU time is unknown."""
    return epoch_of(capacity, wall, Counters(cpu_clock=lambda: None), sums)


def measured_cpu(
    capacity: Capacity, cpu: tuple[float, float, float], cpus: float, **sums: float
) -> EpochStatistics:
    """As :func:`measured` (10 s), the processes having used ``cpu`` (``main_s, tree_s,
    wait_s``) of ``cpus`` CPUs."""
    counters = Counters(cpu_clock=FakeCpu((0.0, 0.0, 0.0), cpu), cpus=cpus)
    return epoch_of(capacity, 10.0, counters, sums)


def epoch_of(
    capacity: Capacity, wall: float, counters: Counters, sums: dict[str, float]
) -> EpochStatistics:
    counters.begin_epoch(0, capacity, TOKEN, now=0.0)
    for name, value in sums.items():
        setattr(counters, name, value)
    stats = counters.end_epoch(TOKEN, now=wall)
    assert stats is not None
    return stats


# -- the verdict, on synthetic sums ---------------------------------------------------------------

WORKERS4 = Capacity(makers=4, prefetch=8, batch_size=32, processes=True)
ASYNC = Capacity(makers=1, io_concurrency=64, prefetch=8, batch_size=16)


@pytest.mark.parametrize(
    ("capacity", "sums", "stage", "knob"),
    [
        # The consumer waited 1 s of 10: the training step is the limit.
        (WORKERS4, {"consumer_wait_s": 1.0, "read_s": 39.0}, "consumer", ""),
        # Waited 8 s; 4 workers busy 36 of 40 s: more workers.
        (
            WORKERS4,
            {"consumer_wait_s": 8.0, "read_s": 30.0, "collate_s": 6.0},
            "workers",
            "num_workers",
        ),
        # 4 workers but prefetch=2: only 2 can be busy, and they are: prefetch is the knob.
        (
            Capacity(makers=4, prefetch=2, processes=True),
            {"consumer_wait_s": 8.0, "read_s": 19.0},
            "workers",
            "prefetch",
        ),
        # Waited 7 s; 64 fetch slots in use 600 of 640 slot-seconds: more io_concurrency.
        (ASYNC, {"consumer_wait_s": 7.0, "io_busy_s": 600.0}, "io", "io_concurrency"),
        # io_concurrency=64 but prefetch 2 x 4 items: the 8 possible fetches are all running.
        (
            Capacity(io_concurrency=64, prefetch=2, batch_size=4),
            {"consumer_wait_s": 7.0, "io_busy_s": 78.0},
            "io",
            "prefetch",
        ),
        # Waited mostly for device copies.
        (WORKERS4, {"consumer_wait_s": 1.0, "transfer_s": 5.0}, "transfer", "pin_memory"),
        # Nothing busy, every permit taken: prefetch.
        (WORKERS4, {"consumer_wait_s": 5.0, "permit_wait_s": 9.0}, "prefetch", "prefetch"),
        # Nothing busy, permits free, yet the consumer waited: the loop.
        (WORKERS4, {"consumer_wait_s": 5.0, "read_s": 4.0}, "loop", ""),
        # An async iterable that yields slowly.
        (
            Capacity(prefetch=4, stream=True),
            {"consumer_wait_s": 9.0, "stream_s": 9.5},
            "source",
            "",
        ),
    ],
)
def test_verdict_names_the_limiting_stage_and_its_knob(
    capacity: Capacity, sums: dict[str, float], stage: str, knob: str
) -> None:
    stats = measured(capacity, batches_yielded=100, **sums)
    assert (stats.bottleneck, stats.knob) == (stage, knob)
    assert stats.hint
    if knob:
        assert knob in stats.hint


# The CPU weighs before any knob: (capacity, sums, cpu (main_s, tree_s, wait_s) of 10 s on 2
# CPUs, the stage and the knob).
CPU_CASES = [
    # Prefetch full and workers idle by their own clocks, but this process and its workers
    # ran 18 of the 20 CPU-seconds: the machine, not prefetch (the quickstart on 2 cores).
    (WORKERS4, {"consumer_wait_s": 5.0, "permit_wait_s": 9.0}, (6.0, 18.0, 0.0), "cpu", ""),
    # Workers busy 90% by their clocks, and the CPUs all used: more workers cannot help.
    (WORKERS4, {"consumer_wait_s": 8.0, "read_s": 36.0}, (2.0, 19.0, 0.0), "cpu", ""),
    # The processes ran only 6 CPU-seconds but waited 12 for a CPU: other processes hold the
    # cores (a shared machine): still the machine.
    (WORKERS4, {"consumer_wait_s": 5.0, "permit_wait_s": 9.0}, (2.0, 6.0, 12.0), "cpu", ""),
    # The CPUs full, and this process spent more than its workers (tiny batches handed over):
    # the machine, and batch_size cuts the part paid per batch.
    (
        WORKERS4,
        {"consumer_wait_s": 5.0, "permit_wait_s": 9.0},
        (12.0, 18.0, 0.0),
        "cpu",
        "batch_size",
    ),
    # The same waits with CPUs to spare: prefetch is still the answer.
    (
        WORKERS4,
        {"consumer_wait_s": 5.0, "permit_wait_s": 9.0},
        (1.0, 3.0, 1.0),
        "prefetch",
        "prefetch",
    ),
    # Workers that measured little (their time goes to work outside read and collate) but
    # whose processes ran 3.6 CPUs of an 8-CPU machine: num_workers, not prefetch.
    (
        Capacity(makers=4, prefetch=8, batch_size=32, processes=True),
        {"consumer_wait_s": 5.0, "permit_wait_s": 9.0, "read_s": 4.0},
        (2.0, 38.0, 0.0),
        "workers",
        "num_workers",
    ),
    # This process busy a whole CPU handing tiny batches over, the workers idle, CPUs to
    # spare: the cost per batch: batch_size.
    (
        WORKERS4,
        {"consumer_wait_s": 6.0, "permit_wait_s": 9.0},
        (9.5, 11.0, 0.0),
        "loop",
        "batch_size",
    ),
    # A consumer that rarely waited is the limit, whatever the CPUs do.
    (WORKERS4, {"consumer_wait_s": 1.0, "read_s": 39.0}, (2.0, 19.5, 0.0), "consumer", ""),
]


@pytest.mark.parametrize(("capacity", "sums", "cpu", "stage", "knob"), CPU_CASES)
def test_the_verdict_weighs_the_cpus_before_it_names_a_knob(
    capacity: Capacity,
    sums: dict[str, float],
    cpu: tuple[float, float, float],
    stage: str,
    knob: str,
) -> None:
    cpus = 8.0 if stage == "workers" else 2.0
    stats = measured_cpu(capacity, cpu, cpus, batches_yielded=100, **sums)
    assert (stats.bottleneck, stats.knob) == (stage, knob), stats.hint
    if stage == "cpu":
        assert "the machine is the limit" in stats.hint
        assert f"of the {stats.cpus:g} CPUs" in stats.hint
        assert "num_workers" not in stats.hint  # more workers cannot help
    if knob:
        assert knob in stats.hint


def test_cpu_fields_are_the_tree_over_the_cpus_it_may_use() -> None:
    stats = measured_cpu(WORKERS4, (3.0, 12.0, 2.0), 2.0, batches_yielded=1)
    assert (stats.cpus, stats.cpu_s) == (2.0, 12.0)
    assert stats.cpu_share == pytest.approx(12.0 / 20.0)
    assert stats.main_cpus == pytest.approx(0.3)
    assert stats.worker_cpus == pytest.approx(0.9)
    assert stats.cpu_wait_share == pytest.approx(0.1)
    assert "CPU of 2" in str(LoaderStatistics(epoch_stats=stats, total=stats))
    unknown = measured(WORKERS4, batches_yielded=1, consumer_wait_s=5.0, read_s=1.0)
    assert (unknown.cpus, unknown.cpu_share, unknown.bottleneck) == (0.0, 0.0, "loop")
    assert "CPU of" not in str(LoaderStatistics(epoch_stats=unknown, total=unknown))


def test_cpu_time_is_read_at_most_every_interval_while_an_epoch_runs() -> None:
    # statistics() in a loop must stay cheap: a read of /proc walks every process.
    clock = FakeCpu((0.0, 0.0, 0.0), (1.0, 2.0, 0.0), (1.0, 3.0, 0.0))
    counters = Counters(cpu_clock=clock, cpus=2.0, batches_yielded=0)
    counters.begin_epoch(0, WORKERS4, TOKEN, now=0.0)
    counters.batches_yielded = 1
    first = counters.measure(now=1.0)
    for step in range(10):
        assert counters.measure(now=1.0 + step * CPU_SAMPLE_INTERVAL_S / 20).cpu_s == 2.0
    assert clock.count == 2
    assert first.cpu_s == 2.0
    later = counters.measure(now=1.0 + CPU_SAMPLE_INTERVAL_S)
    assert (clock.count, later.cpu_s) == (3, 3.0)
    ended = counters.end_epoch(TOKEN, now=1.0 + CPU_SAMPLE_INTERVAL_S * 1.1)  # read afresh
    assert ended is not None
    assert clock.count == 4
    assert counters.measure_total().cpu_s == 3.0


def test_the_process_tree_cpu_counts_children_and_the_cpus_are_the_affinity() -> None:
    before = process_tree_cpu()
    assert before is not None
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass",
        ],
        check=True,
        timeout=30,
    )
    assert child.returncode == 0
    after = process_tree_cpu()
    assert after is not None
    main_s, tree_s, wait_s = (b - a for a, b in zip(before, after, strict=True))
    assert main_s >= 0.3  # a reaped child's time counts to its parent
    # Each is a difference of two sums of clock ticks in floats: equal ones may differ in the
    # last bits.
    assert tree_s >= main_s - 1e-9
    assert wait_s >= 0
    assert 0 < cpus_available() <= len(os.sched_getaffinity(0))
    assert 0 < CPU_SATURATED < 1


@pytest.mark.parametrize("walk", ["children lists", "scan of /proc"])
def test_the_process_tree_cpu_counts_a_live_grandchild(
    walk: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Workers are grandchildren (through the worker server) and alive while an epoch runs: their
    # CPU counts, whether the tree is found from the threads' children lists or by a scan.
    from aioloader._stats import _cpu

    if walk == "scan of /proc":
        monkeypatch.setattr(_cpu, "_descendants", lambda root: None)
    elif _cpu._descendants(os.getpid()) is None:
        pytest.skip("this kernel keeps no children lists (CONFIG_PROC_CHILDREN)")
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    middle = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {spin!r} + 'time.sleep(30)'])\n"
        "print(p.pid, flush=True)\n"
        "p.wait()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", middle], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        grandchild = int(parent.stdout.readline())
        own_wait = _cpu._run_queue_wait(os.getpid())
        before = process_tree_cpu()
        assert before is not None
        deadline = time.monotonic() + 20
        while True:  # bounded: the grandchild spins 0.4 s of CPU, then sleeps
            after = process_tree_cpu()
            assert after is not None
            if after[1] - after[0] >= 0.4 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert after[1] - after[0] >= 0.4  # the live grandchild's CPU, not this process's
        assert after[2] >= own_wait  # the run-queue waits of this process's threads, at least
        if walk == "children lists":
            assert grandchild in (_cpu._descendants(os.getpid()) or [])
        with contextlib.suppress(ProcessLookupError):
            os.kill(grandchild, signal.SIGKILL)
    finally:
        parent.kill()
        parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()


def test_shares_are_busy_time_over_wall_times_parallelism() -> None:
    stats = measured(
        WORKERS4,
        wall=10.0,
        batches_yielded=50,
        samples_yielded=1600,
        bytes_yielded=16_000_000,
        read_s=20.0,  # of 4 workers x 10 s
        collate_s=4.0,
        consumer_wait_s=2.0,
        transfer_s=1.0,
        permit_wait_s=3.0,
    )
    assert stats.worker_share == pytest.approx(24.0 / 40.0)
    assert stats.wait_share == pytest.approx(0.3)  # waits for batches and for copies
    assert stats.transfer_share == pytest.approx(0.1)
    assert stats.prefetch_full_share == pytest.approx(0.3)
    assert (stats.batches_per_s, stats.samples_per_s) == (5.0, 160.0)
    assert stats.bytes_per_s == pytest.approx(1_600_000.0)
    assert stats.fetch_share == 0.0  # not an async dataset


def test_shares_stay_within_zero_and_one() -> None:
    stats = measured(Capacity(makers=1), wall=1.0, batches_yielded=1, read_s=5.0)
    assert stats.worker_share == 1.0


def test_an_epoch_with_no_batch_has_no_verdict() -> None:
    stats = measured(WORKERS4, consumer_wait_s=9.0)
    assert (stats.bottleneck, stats.knob, stats.hint) == ("", "", "")
    assert EpochStatistics().bottleneck == ""


def test_epoch_statistics_are_the_difference_since_the_epoch_began() -> None:
    counters = Counters()
    counters.batches_yielded, counters.read_s = 10, 5.0  # an earlier epoch's
    counters.wall_s = 4.0
    counters.begin_epoch(3, Capacity(), TOKEN, now=100.0)
    counters.batches_yielded, counters.read_s = 14, 6.0
    running = counters.measure(now=102.0)
    assert (running.epoch, running.batches, running.wall_s) == (3, 4, 2.0)
    total = counters.measure_total(now=102.0)
    assert (total.epoch, total.batches, total.wall_s) == (None, 14, 6.0)
    # Only the epoch that began the clock ends it; another epoch's end changes nothing.
    assert counters.end_epoch(object(), now=103.0) is None
    ended = counters.end_epoch(TOKEN, now=104.0)
    assert ended is not None
    assert ended.wall_s == 4.0
    assert counters.measure(now=200.0) == ended  # between epochs: the last one
    assert counters.measure_total(now=200.0).wall_s == 8.0  # time between epochs not counted


def test_skip_records_are_bounded_and_all_counted() -> None:
    counters = Counters()
    for start in range(0, 1000, 10):
        counters.skip([(i, f"KeyError: {i}") for i in range(start, start + 10)])
    assert counters.skipped_count == 1000
    assert len(counters.skipped) <= 2 * SKIP_RECORDS  # memory stays bounded
    stats = LoaderStatistics.build(counters)
    assert stats.skipped_count == 1000
    assert stats.skipped == tuple((i, f"KeyError: {i}") for i in range(900, 1000))


# -- the snapshot: table, dict, counters ----------------------------------------------------------


async def test_statistics_count_per_epoch_and_in_total() -> None:
    async with DataLoader(Arrays(20), batch_size=4) as loader:
        for _ in range(2):
            await collect(loader)
        stats = loader.statistics()
    epoch = stats.epoch_stats
    assert (epoch.epoch, epoch.batches, epoch.samples) == (1, 5, 20)
    assert (stats.total.epoch, stats.total.batches, stats.total.samples) == (None, 10, 40)
    assert epoch.bytes == 20 * 4000
    assert stats.total.bytes == stats.bytes_yielded == 2 * 20 * 4000
    assert 0 < epoch.wall_s < stats.total.wall_s == stats.wall_s
    assert stats.total.samples_per_s == pytest.approx(40 / stats.total.wall_s)
    assert (stats.batches_yielded, stats.samples_yielded) == (10, 40)  # the old names still work


async def test_statistics_can_be_read_while_an_epoch_runs() -> None:
    async with DataLoader(Slow(12, 0.01), batch_size=2) as loader:
        iterator = aiter(loader)
        await anext(iterator)
        await anext(iterator)
        running = loader.statistics()
        await collect(iterator)
        done = loader.statistics()
    assert (running.epoch_stats.batches, running.epoch_batches_yielded) == (2, 2)
    assert running.epoch_stats.wall_s > 0
    assert done.epoch_stats.batches == 6
    assert done.epoch_stats.wall_s >= running.epoch_stats.wall_s


async def test_statistics_are_cheap_to_read() -> None:
    async with DataLoader(Arrays(8), batch_size=4) as loader:
        await collect(loader)
        started = time.perf_counter()
        for _ in range(1000):
            loader.statistics()
        per_call = (time.perf_counter() - started) / 1000
    assert per_call < 0.002  # ~30 us here; a loaded machine gets a wide margin


async def test_str_is_a_table_and_as_dict_is_flat_json() -> None:
    async with DataLoader(FailAt(12, {3}), batch_size=4, on_error="skip", max_failures=2) as loader:
        await collect(loader)
        stats = loader.statistics()
    table = str(stats)
    for row in ("wall (s)", "batches/s", "samples/s", "MB/s", "consumer waited", "workers busy"):
        assert row in table
    assert "epoch 0" in table
    assert "total" in table
    assert f"bottleneck: {stats.bottleneck}" in table
    flat_dict = stats.as_dict()
    assert json.loads(json.dumps(flat_dict)) == flat_dict
    assert all(not isinstance(v, dict | list | tuple) for v in flat_dict.values())
    assert flat_dict["epoch/samples"] == 11
    assert flat_dict["total/skipped"] == flat_dict["skipped_count"] == 1
    assert flat_dict["bottleneck"] == stats.epoch_stats.bottleneck
    assert "skipped" not in flat_dict  # the records: their count is in


# -- the three slowed pipelines -------------------------------------------------------------------


async def test_verdict_for_a_slow_dataset_is_num_workers() -> None:
    # 20 ms per sample on each of two threads, a consumer that takes nothing: the readers are
    # the limit, busy nearly all the time, and the consumer waits for them.
    async with DataLoader(Slow(48, 0.02), batch_size=4, num_workers=2, thread_pool=True) as loader:
        await collect(loader)
        stats = loader.statistics().epoch_stats
    assert stats.wait_share > 0.6
    assert stats.worker_share > 0.6
    assert (stats.bottleneck, stats.knob) == ("workers", "num_workers")
    assert "num_workers" in stats.hint


async def test_verdict_for_slow_remote_reads_is_io_concurrency() -> None:
    # 30 ms of server latency per object, 4 requests in flight: the fetch slots are the limit.
    async with FaultServer(latency=0.03, size=2000) as server:
        dataset = HTTPDataset([server.obj_url(i) for i in range(48)])
        async with DataLoader(dataset, batch_size=8, io_concurrency=4, collate_fn=list) as loader:
            batches = await collect(loader)
            stats = loader.statistics()
    assert [raw for batch in batches for raw in batch] == [payload(i, 2000) for i in range(48)]
    epoch = stats.epoch_stats
    assert epoch.wait_share > 0.6
    assert epoch.fetch_share > 0.6
    assert (epoch.bottleneck, epoch.knob) == ("io", "io_concurrency")
    assert "io_concurrency" in epoch.hint
    assert (stats.remote_requests, stats.bytes_read, stats.requests_in_flight) == (48, 96_000, 0)
    assert epoch.bytes_read == 96_000
    assert epoch.read_bytes_per_s > 0


async def test_verdict_for_a_slow_consumer_is_the_consumer() -> None:
    # Batches are ready at once; the consumer takes 20 ms a step, 32 steps.
    async with DataLoader(Arrays(128), batch_size=4) as loader:
        async for _ in loader:
            await asyncio.sleep(0.02)
        stats = loader.statistics().epoch_stats
    assert stats.wait_share < WAIT_SHARE_THRESHOLD
    assert stats.bottleneck == "consumer"
    assert "consumer is slow" in stats.hint
    assert "loader keeps up" in stats.hint


async def test_a_slow_async_dataset_is_io_bound_without_a_server() -> None:
    async with DataLoader(AsyncRange(48, delay=0.03), batch_size=8, io_concurrency=4) as loader:
        assert flat(await collect(loader)) == list(range(48))
        stats = loader.statistics().epoch_stats
    assert (stats.bottleneck, stats.knob) == ("io", "io_concurrency")
    assert stats.fetch_share > 0.6


# -- remote counters ------------------------------------------------------------------------------


async def test_remote_retries_are_counted_apart_from_batch_reruns() -> None:
    from http_server import Fault

    policy = RetryPolicy(max_attempts=4, backoff_initial=0.001, backoff_max=0.01, jitter=False)
    async with FaultServer() as server:
        for i in (1, 5):
            server.fail(f"/obj/{i}", Fault.http(503), Fault.http(503))
        dataset = HTTPDataset([server.obj_url(i) for i in range(8)], retry=policy)
        async with DataLoader(dataset, batch_size=4, collate_fn=list) as loader:
            await collect(loader)
            stats = loader.statistics()
    assert stats.remote_retries == 4
    assert stats.remote_requests == 12
    assert stats.retries == 0  # no batch was re-run
    assert stats.epoch_stats.remote_retries == 4
    assert "remote_retries=4" in str(stats)


async def test_requests_in_flight_are_counted_while_they_run() -> None:
    async with FaultServer(latency=0.3) as server:
        dataset = HTTPDataset([server.obj_url(i) for i in range(6)])
        async with DataLoader(dataset, batch_size=3, io_concurrency=3, collate_fn=list) as loader:
            iterator = aiter(loader)
            first = asyncio.ensure_future(anext(iterator))
            seen = 0
            deadline = time.monotonic() + 5
            while seen < 3 and time.monotonic() < deadline:  # each counts once on the wire
                await asyncio.sleep(0.01)
                seen = loader.statistics().requests_in_flight
            assert seen == 3  # io_concurrency of them
            await first
            await collect(iterator)
            assert loader.statistics().requests_in_flight == 0


class RemoteStream:
    """An async iterable dataset that reads its items from a remote source."""

    def __init__(self, source: HTTPDataset) -> None:
        self.source = source

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(len(self.source)):
            yield await self.source.fetch(i)


async def test_an_async_iterable_over_a_remote_source_is_counted_too() -> None:
    async with FaultServer() as server:
        source = HTTPDataset([server.obj_url(i) for i in range(6)])
        async with DataLoader(RemoteStream(source), batch_size=3, collate_fn=list) as loader:
            assert len(await collect(loader)) == 2
            stats = loader.statistics()
        await source.aclose()
    assert (stats.remote_requests, stats.bytes_read) == (6, 6 * 1024)


async def test_a_source_used_without_a_loader_counts_nowhere() -> None:
    async with FaultServer() as server, HTTPDataset([server.obj_url(0)]) as dataset:
        assert await dataset.fetch(0) == payload(0)  # no loader's counters: nothing breaks


def test_statistics_before_any_epoch_are_empty() -> None:
    loader = aioloader.DataLoader(Arrays(4), batch_size=2)
    stats = loader.statistics()
    assert stats.epoch_stats == EpochStatistics(epoch=0)
    assert stats.total.wall_s == 0.0
    assert stats.bottleneck == ""
    assert "bottleneck" not in str(stats)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "verdict"),
    [
        # The "dataset" case is the example's default run: tests/test_examples.py runs it and
        # checks its table and verdict ("workers", knob num_workers) there.
        ("remote", "io (knob: io_concurrency)"),
        ("consumer", "consumer (knob: none)"),
        ("cpu", "cpu (knob: none)"),
    ],
)
def test_the_why_slow_example_names_each_case(case: str, verdict: str) -> None:
    # 128 samples, 16 steps of 20 ms in the consumer case, whose verdict is of its second
    # epoch: the first batch of the first waits for the loader's thread to start (a quarter
    # of the epoch on a loaded machine, which then looked like too little prefetch).
    script = Path(__file__).resolve().parent.parent / "examples" / "why_slow.py"
    result = subprocess.run(
        [sys.executable, str(script), "--case", case, "--samples", "128", "--no-fix"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert f"verdict: {verdict}" in result.stdout
    assert "consumer waited" in result.stdout  # the table came first
