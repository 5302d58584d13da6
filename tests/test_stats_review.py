"""Statistics read from another thread while the epoch's state changes, and verdicts that
name the right knob: threads held by the GIL, a batch sampler's size, pinned copies.

A race is shown by forcing the interleaving: a counters object whose ``sums()`` (or CPU clock)
runs the other thread's step at the exact point a reader is between two reads."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from aioloader._stats._counters import (
    _SUMS,
    Capacity,
    Counters,
    EpochStatistics,
    LoaderStatistics,
)

TOKEN, NEXT = object(), object()


class Interleaved(Counters):
    """Counters whose next ``sums()`` runs ``between`` right after reading the sums (or
    ``before`` right before): what the loop thread does while a reader on another thread is
    between two reads."""

    between: Callable[[], None] | None = None
    before: Callable[[], None] | None = None

    def sums(self) -> tuple[float, ...]:
        first, Interleaved.before = Interleaved.before, None
        if first is not None:
            first()
        read = Counters.sums(self)
        step, Interleaved.between = Interleaved.between, None
        if step is not None:
            step()
        return read


@pytest.fixture(autouse=True)
def _no_step_left() -> None:
    Interleaved.between = Interleaved.before = None


def test_a_snapshot_taken_while_an_epoch_begins_sees_no_half_begun_epoch() -> None:
    counters = Interleaved(cpu_clock=lambda: None, cpus=2.0)
    seen: list[LoaderStatistics] = []
    # The reader runs inside begin_epoch, as it reads the sums for the new baseline.
    Interleaved.between = lambda: seen.append(LoaderStatistics.build(counters))
    counters.begin_epoch(0, Capacity(), TOKEN)
    assert len(seen) == 1
    assert (seen[0].epoch_stats.batches, seen[0].total.batches) == (0, 0)


def test_a_snapshot_across_an_epoch_boundary_never_counts_negative() -> None:
    counters = Interleaved(cpu_clock=lambda: None, cpus=2.0)
    counters.begin_epoch(0, Capacity(), TOKEN, now=time.perf_counter() - 1.0)
    counters.batches_yielded, counters.samples_yielded = 10, 40

    def next_epoch() -> None:  # the loop thread: 6 more batches, the epoch ends, one begins
        counters.batches_yielded, counters.samples_yielded = 16, 64
        counters.end_epoch(TOKEN)
        counters.begin_epoch(1, Capacity(), NEXT)

    Interleaved.between = next_epoch
    epoch = counters.measure()  # the reader reads the sums; the boundary passes; it goes on
    # Never 10 - 16: the epoch that ended, or the new one from its own baseline.
    assert (epoch.epoch, epoch.batches, epoch.samples) in ((0, 10, 40), (1, 0, 0))


def test_a_snapshot_never_spans_two_epochs() -> None:
    counters = Interleaved(cpu_clock=lambda: None, cpus=2.0)
    counters.begin_epoch(0, Capacity(), TOKEN, now=time.perf_counter() - 1.0)
    counters.batches_yielded, counters.samples_yielded = 10, 40

    def next_epoch() -> None:  # between the reader's read of the epoch and of the sums
        counters.batches_yielded, counters.samples_yielded = 16, 64
        counters.end_epoch(TOKEN)
        counters.begin_epoch(1, Capacity(), NEXT)
        counters.batches_yielded, counters.samples_yielded = 20, 80

    Interleaved.before = next_epoch
    epoch, total = counters.snapshot()
    assert (epoch.epoch, epoch.batches, epoch.samples) == (1, 4, 16)  # not 20 in epoch 0
    assert total.batches == 20


class ClockedCpu:
    """A CPU clock that runs ``during`` (once) when it is read: the loop thread's step while
    the reader reads ``/proc``."""

    def __init__(self) -> None:
        self.reads = 0
        self.during: Callable[[], None] | None = None

    def __call__(self) -> tuple[float, float, float]:
        self.reads += 1
        step, self.during = self.during, None
        if step is not None:
            step()
        return (0.5 * self.reads, 1.5 * self.reads, 0.0)


def test_total_holds_the_epoch_when_batches_arrive_during_a_snapshot() -> None:
    clock = ClockedCpu()
    counters = Counters(cpu_clock=clock, cpus=2.0)
    counters.begin_epoch(0, Capacity(makers=2, processes=True), TOKEN, now=time.perf_counter() - 1)
    counters.batches_yielded = counters.samples_yielded = 10
    counters.cpu_last = None  # the next snapshot reads the CPU

    def more() -> None:
        counters.batches_yielded = counters.samples_yielded = 14

    clock.during = more
    s = LoaderStatistics.build(counters)
    assert s.total.batches >= s.epoch_stats.batches


def test_the_total_cpu_is_the_epochs_own_read_not_the_one_before() -> None:
    clock = ClockedCpu()
    counters = Counters(cpu_clock=clock, cpus=2.0)
    counters.begin_epoch(0, Capacity(makers=2, processes=True), TOKEN, now=time.perf_counter() - 1)
    counters.batches_yielded = counters.samples_yielded = 10
    counters.cpu_last = None  # stale: this snapshot reads the CPU anew
    s = LoaderStatistics.build(counters)
    assert s.epoch_stats.cpu_s == pytest.approx(1.5)  # 3.0 read now, less 1.5 at the start
    assert s.total.cpu_s == s.epoch_stats.cpu_s  # one epoch so far: the same read
    assert clock.reads == 2  # the start, and once for this snapshot


def test_a_readers_cpu_read_does_not_change_what_the_epoch_end_measures() -> None:
    clock = ClockedCpu()
    counters = Interleaved(cpu_clock=clock, cpus=2.0)
    start = time.perf_counter() - 2.0
    counters.begin_epoch(0, Capacity(), TOKEN, now=start)
    counters.batches_yielded = 1

    # As the epoch ends (between its CPU read and its sums), a reader's newer read replaces
    # the cached one: the end still measures with its own.
    def a_readers_read() -> None:
        counters.read_cpu(start + 5.0, fresh=True)

    Interleaved.between = a_readers_read
    ended = counters.end_epoch(TOKEN, now=start + 2.0)
    assert ended is not None
    assert ended.cpu_s == pytest.approx(1.5)  # its own read (the second), less the start's
    assert counters.measure_total().cpu_s == pytest.approx(1.5)


# -- verdicts -------------------------------------------------------------------------------------


def sums(**values: float) -> list[float]:
    return [float(values.get(name, 0.0)) for name in _SUMS]


def test_threads_held_by_the_gil_are_told_to_use_processes() -> None:
    # 4 threads busy the whole time, yet this process used one CPU of 8.
    cpu = (10.0, 10.0, 10.0, 0.0)
    threads = Capacity(makers=4, prefetch=8, batch_size=4, thread_pool=True)
    busy = sums(batches_yielded=40, samples_yielded=160, consumer_wait_s=8, read_s=40)
    stats = EpochStatistics.build(0, 10.0, busy, threads, cpu=cpu, cpus=8.0)
    assert (stats.bottleneck, stats.knob) == ("workers", "thread_pool")
    assert "thread_pool=False" in stats.hint
    assert "1.0 CPUs of 8" in stats.hint
    # One thread uses one CPU at most, GIL or not (numpy and PIL release it): the usual
    # num_workers verdict, which names processes as the way out of the GIL.
    one = Capacity(makers=1, prefetch=8, batch_size=4, thread_pool=True)
    alone = sums(batches_yielded=40, samples_yielded=160, consumer_wait_s=8, read_s=10)
    stats = EpochStatistics.build(0, 10.0, alone, one, cpu=cpu, cpus=8.0)
    assert (stats.bottleneck, stats.knob) == ("workers", "num_workers")
    assert "thread_pool=False" in stats.hint
    assert "cannot run at once" not in stats.hint
    # On a loaded machine: half a CPU used, and 0.6 waited for in a run queue.
    loaded = EpochStatistics.build(0, 10.0, busy, threads, cpu=(10.0, 5.0, 5.0, 6.0), cpus=8.0)
    assert loaded.knob == "thread_pool"
    # Threads waiting for I/O ask for little CPU: more of them help.
    io_bound = EpochStatistics.build(0, 10.0, busy, threads, cpu=(10.0, 2.0, 2.0, 0.0), cpus=8.0)
    assert io_bound.knob == "num_workers"
    # Threads that use several CPUs (numpy releases the GIL): more of them help.
    stats = EpochStatistics.build(0, 10.0, busy, threads, cpu=(10.0, 30.0, 30.0, 0.0), cpus=8.0)
    assert stats.knob == "num_workers"
    # One CPU in all: nothing to gain from processes either; the usual verdict.
    stats = EpochStatistics.build(0, 10.0, busy, threads, cpu=(10.0, 1.0, 1.0, 0.0), cpus=1.0)
    assert stats.knob != "thread_pool"


def test_a_batch_samplers_size_is_the_mean_samples_per_batch() -> None:
    # An async dataset, a batch sampler of 32 (Capacity.batch_size unknown: 0), 64 fetches
    # at most, prefetch 4: 128 items could be in flight, so io_concurrency=64 is the bound and
    # it is not saturated (half busy): prefetch is not the knob.
    unknown = Capacity(makers=1, io_concurrency=64, prefetch=4, batch_size=0)
    io = sums(batches_yielded=100, samples_yielded=3200, consumer_wait_s=80, io_busy_s=3200)
    stats = EpochStatistics.build(0, 100.0, io, unknown)
    known = EpochStatistics.build(
        0, 100.0, io, Capacity(io_concurrency=64, prefetch=4, batch_size=32)
    )
    assert (stats.bottleneck, stats.knob) == (known.bottleneck, known.knob)
    assert stats.knob != "prefetch"


def test_the_transfer_verdict_with_pinned_memory_names_device_prefetch() -> None:
    copies = sums(batches_yielded=100, consumer_wait_s=10, transfer_s=30)
    # Copies to a device go through pinned memory whatever pin_memory says.
    for pin_memory in (False, True):
        to_device = Capacity(pin_memory=pin_memory, staged=True, device_prefetch=2)
        stats = EpochStatistics.build(0, 100.0, copies, to_device)
        assert (stats.bottleneck, stats.knob) == ("transfer", "device_prefetch")
        assert "pin_memory" not in stats.hint
        assert "device_prefetch (now 2)" in stats.hint
    # Pin-only mode (no device): pinning is the limit; a device would overlap it.
    pinning = EpochStatistics.build(0, 100.0, copies, Capacity(pin_memory=True))
    assert (pinning.bottleneck, pinning.knob) == ("transfer", "pin_memory")
    assert pinning.hint.startswith("pinning batches")
    assert "use pin_memory=True" not in pinning.hint


def test_the_loop_hint_says_cpus_not_a_percentage_above_100() -> None:
    workers = Capacity(makers=4, prefetch=8, processes=True)
    waits = sums(batches_yielded=100, consumer_wait_s=50, read_s=10)
    stats = EpochStatistics.build(0, 100.0, waits, workers, cpu=(100.0, 160.0, 170.0, 0.0), cpus=8)
    assert (stats.bottleneck, stats.knob) == ("loop", "batch_size")
    assert "busy 1.6 CPUs" in stats.hint
    assert "160%" not in stats.hint


def test_the_epochs_capacity_says_what_the_verdict_needs() -> None:
    from helpers import build_config

    from aioloader._epoch._consume import _capacity

    sampled = _capacity(build_config(kind="async_map", batch_size=None, batch_sampler_given=True))
    assert sampled.batch_size == 0  # unknown: the verdict takes the mean per batch
    assert _capacity(build_config(batch_size=None)).batch_size == 1  # no batching
    assert _capacity(build_config(batch_size=8)).batch_size == 8
    threads = _capacity(build_config(num_workers=4, thread_pool=True))
    assert (threads.thread_pool, threads.processes, threads.makers) == (True, False, 4)
    assert not _capacity(build_config(num_workers=0, thread_pool=True)).thread_pool
    pinned = _capacity(build_config(pin_memory=True, device_prefetch=3))
    assert (pinned.pin_memory, pinned.device_prefetch) == (True, 3)
