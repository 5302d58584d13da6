"""Live statistics: mutable counters inside, frozen snapshots outside, and the verdict.

::

    pipeline (event loop thread) ── bumps ──▶ Counters (cumulative, loader-wide)
      Epoch: begin_epoch / end_epoch ──▶ a baseline copy of the sums and the epoch's clock
    DataLoader.statistics() ── snapshot ──▶ LoaderStatistics
                                              ├─ epoch_stats: EpochStatistics (this epoch)
                                              └─ total: EpochStatistics (every epoch)

The pipeline bumps :class:`Counters` from the event loop thread only (worker processes report
their timings in their replies; remote sources reach them through :data:`current_counters`).
Snapshots are read from any thread (``statistics()`` from a monitoring thread, the consumer's
thread while a sync loader's loop runs in another), and no lock is taken, so that the loop
never waits for a reader. What makes that safe:

- the running epoch's start (number, capacity, clock, baseline sums, CPU read) is one frozen
  :class:`RunningEpoch`, published by one assignment when the epoch begins and cleared by one
  when it ends: a reader never sees a clock without its baseline, or another epoch's baseline;
- a snapshot reads it, then the sums (which only grow), then checks it again, and reads anew if
  an epoch began meanwhile (:meth:`Counters.snapshot`): no difference is negative or spans two
  epochs, and every difference is clamped at 0 all the same;
- an epoch's end moves it into the totals (wall time, CPU) and clears it between two steps of
  a change count (odd meanwhile): a snapshot that overlaps them reads again, so the total never
  holds the epoch's batches without its wall time, nor its wall time twice;
- one snapshot reads the sums and the CPU time once for the epoch and the total together, so
  that the total always holds the epoch;
- the newest CPU read is a cache any thread may replace, with one immutable
  :class:`CpuSample`; the epoch's end measures with the read it made itself.

A snapshot is a few dozen additions, 0.1-0.25 ms in all (``LoaderStatistics.build`` with its
tables); re-reading the CPU time (at most every :data:`CPU_SAMPLE_INTERVAL_S`) walks ``/proc``
and brings it to 0.6-1.2 ms on a 2-core machine.

How a stage's share of the wall time is measured: its busy time divided by the wall time times
its parallelism (``busy_s / (wall_s * parallelism)``), i.e. how much of its capacity it used,
between 0 and 1. Busy time is summed per worker or per item fetch, so the division by the
parallelism turns the sum into an average utilisation; a union of busy intervals would need a
timestamp per event, and would call a stage with one busy worker out of eight "busy".

- ``worker_share``: time reading and collating samples (``read_s + collate_s``, measured where
  the work ran) over ``wall_s * makers`` (worker processes, or threads: 1 with
  ``num_workers=0``);
- ``fetch_share``: time item fetches of an async dataset were in flight, per item, over
  ``wall_s * io_concurrency``;
- ``wait_share``: time the consumer waited inside ``__anext__`` for a batch that was not
  ready or for its device copy (``consumer_wait_s + transfer_s``) over ``wall_s``;
- ``prefetch_full_share``: time the scheduler waited for a permit (all ``prefetch`` batches
  in flight or unclaimed) over ``wall_s``.
- ``cpu_share``: CPU seconds of this process and every descendant (read from ``/proc`` at the
  epoch's start and now) over ``wall_s * cpus``, the CPUs they may use (affinity and cgroup
  quota); ``cpu_wait_share``: the time their threads waited in a run queue for a CPU, over the
  same. Their sum is how much CPU the loader asked for: near 1, the machine is the limit, and
  the verdict says so before it names any knob (on two cores, two decoding workers and the
  training loop fill them: more workers or prefetch would only queue).

The wall time of an epoch runs from its first ``__anext__`` to its end (or to now, while it
runs); the total is the sum over epochs, so time between epochs (an evaluation) is not counted.
Two epochs iterated at once (``zip(loader, loader)``) share one baseline: the newer one's.
"""

from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ._cpu import CpuSample, cpus_available, process_tree_cpu

__all__ = [
    "CPU_SAMPLE_INTERVAL_S",
    "CPU_SATURATED",
    "GIL_BOUND_MARGIN",
    "SATURATED",
    "SKIP_RECORDS",
    "VERDICT_WARNING_MIN_S",
    "WAIT_SHARE_THRESHOLD",
    "Capacity",
    "Counters",
    "CpuSample",
    "EpochStatistics",
    "LoaderStatistics",
    "RunningEpoch",
    "WorkerFigures",
    "cpus_available",
    "current_counters",
    "process_tree_cpu",
]

#: Skip records kept (the newest): every skip is counted (``skipped_count``), but an epoch of
#: millions of bad samples must not grow memory without bound.
SKIP_RECORDS = 100

#: The consumer waiting more than this share of an epoch makes the loader the bottleneck: the
#: epoch's verdict is then logged as a WARNING (else as INFO). A training step always waits a
#: little (the first batch, an uneven one); a fifth of the time is worth acting on.
WAIT_SHARE_THRESHOLD = 0.2

#: An epoch shorter than this (seconds) never makes its verdict a WARNING: in a short epoch the
#: wait for the first batch (workers starting, a dataset opening) is most of the consumer's wait,
#: and a run that is over in seconds needs no action. Longer, and a fifth of the time waiting is
#: a cost worth a warning; lower it and a newcomer's first runs warn for nothing.
VERDICT_WARNING_MIN_S = 10.0

#: A stage busy for this share of its capacity, while the consumer waits, is the limit. Below
#: 1 because a saturated stage still idles between handing a batch over and getting the next.
SATURATED = 0.6

#: The loader's processes (this one and every descendant: the worker server, the workers) using
#: or waiting in a run queue for this share of the CPUs they may use make the machine the
#: limit: no setting of the loader can make batches faster, only cheaper work per sample (or
#: per batch) or more cores. Below 1 because the processes' own idle moments (a batch handed
#: over) take some; well above :data:`SATURATED`, because naming the machine must be sure. On a
#: loaded 2-core machine (docs/benchmarks.md): sleep-bound pipelines read 12-35%, a
#: latency-bound one (2 MiB arrays, 2 permits, where prefetch was the truth) up to 77%,
#: decode-bound ones 86-102%.
CPU_SATURATED = 0.85

#: While an epoch runs, the process tree's CPU time is read at most this often (seconds): a
#: read walks ``/proc`` (~3 ms on a 2-core machine with ~100 processes), and ``statistics()``
#: must stay cheap to read in a loop. An epoch's start and end always read it afresh.
CPU_SAMPLE_INTERVAL_S = 0.5

#: Two threads or more making batches while this process used at most this many CPUs above
#: one, on a machine with CPUs to spare, are held by the GIL (a pure-Python ``__getitem__``):
#: more threads only take turns, processes would run at once (one thread proves nothing: it
#: uses one CPU at most, GIL or not). One CPU exactly is the GIL's ceiling;
#: the margin admits the loop's own moments in C code (numpy, I/O) that run beside it. On a
#: loaded 2-core machine a GIL-bound pipeline (1 or 4 threads) used 0.5-0.76 CPUs and waited
#: in a run queue for another 0.7-1.1; the review measured 1.0 used on an idle one.
GIL_BOUND_MARGIN = 0.25


# -- CPU: the process tree's time, and the CPUs it may use (read by _cpu) ------------------------

#: ``(wall_s, main_s, tree_s, wait_s)``: CPU use over ``wall_s`` seconds (see CpuSample).
_Cpu = tuple[float, float, float, float]
_NO_CPU: _Cpu = (math.inf, 0.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class Capacity:
    """How parallel each stage may be, for the shares and the verdict.

    Attributes:
        makers: batches made at once (worker processes or threads).
        io_concurrency: item fetches in flight at once (0: the dataset is not async map-style).
        prefetch: batches in flight or unclaimed at once.
        batch_size: samples per batch (1 without batching); 0 where a batch sampler decides:
            the verdict then takes the mean samples per batch handed over.
        processes: whether the makers are processes.
        stream: the dataset is an async iterable (pulled one item at a time on the loop).
        thread_pool: the makers are threads the user asked for (``thread_pool=True``), not
            the one helper thread of ``num_workers=0``.
        pin_memory: ``pin_memory=True`` was given. With no device that is the stage's whole
            job (pin-only mode: each batch is copied into page-locked memory); with a CUDA
            device it changes nothing (see ``staged``).
        staged: batches are copied to a CUDA device, through pinned memory (staging buffers,
            or shared memory registered as pinned) whatever ``pin_memory`` says.
        device_prefetch: device copies (or pinnings) in flight at once.
    """

    makers: int = 1
    io_concurrency: int = 0
    prefetch: int = 1
    batch_size: int = 1
    processes: bool = False
    stream: bool = False
    thread_pool: bool = False
    pin_memory: bool = False
    staged: bool = False
    device_prefetch: int = 1


# The sums that an epoch's statistics are the difference of (end minus its start).
_SUMS = (
    "batches_yielded",
    "samples_yielded",
    "bytes_yielded",
    "retries",
    "timeouts",
    "skipped_count",
    "fetch_s",
    "io_busy_s",
    "read_s",
    "collate_s",
    "transfer_s",
    "consumer_wait_s",
    "permit_wait_s",
    "stream_s",
    "remote_requests",
    "remote_retries",
    "remote_bytes",
    "remote_stalls",
)


@dataclass(slots=True)
class Counters:
    """What the pipeline counts as it runs, all epochs (see :class:`LoaderStatistics`)."""

    epoch: int = 0
    batches_yielded: int = 0
    samples_yielded: int = 0
    bytes_yielded: int = 0
    epoch_batches_yielded: int = 0
    retries: int = 0
    timeouts: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)  # the newest, see skip()
    skipped_count: int = 0
    fetch_s: float = 0.0
    io_busy_s: float = 0.0
    read_s: float = 0.0
    collate_s: float = 0.0
    transfer_s: float = 0.0
    consumer_wait_s: float = 0.0
    permit_wait_s: float = 0.0
    stream_s: float = 0.0
    remote_requests: int = 0
    remote_retries: int = 0
    remote_bytes: int = 0
    remote_stalls: int = 0
    remote_in_flight: int = 0
    leftover_batches: int = 0  # read past the ranks' agreed end of an epoch (equal_steps)
    leftover_samples: int = 0
    dropped_batches: int = 0  # of those, released (leftover='drop')
    dropped_samples: int = 0
    cut_epochs: int = 0  # epochs that ended at the agreed step before this rank's share did
    unread_samples: int = 0  # of those shares, samples not read (where a stream has a len())
    wall_s: float = 0.0  # of the epochs that ended
    capacity: Capacity = field(default_factory=Capacity)  # the running (or last) epoch's
    # The running epoch, published whole (one assignment) by begin_epoch and cleared by
    # end_epoch: a reader on another thread reads it once and sees one epoch's start, never
    # a start with another epoch's baseline (see the module docstring).
    running: RunningEpoch | None = None
    last_epoch: EpochStatistics | None = None  # the epoch that ended last
    # The process tree's CPU time: how it is read (injectable: tests give a fake), the CPUs it
    # may use, the newest read (a cache any thread may replace: a sample is immutable), and
    # (wall covered, main_s, tree_s, wait_s) of the epochs that ended.
    cpu_clock: Callable[[], tuple[float, float, float] | None] = process_tree_cpu
    cpus: float = field(default_factory=cpus_available)
    cpu_last: CpuSample | None = None
    cpu_ended: _Cpu = (0.0, 0.0, 0.0, 0.0)
    # Odd while end_epoch moves an epoch into the totals (wall_s, cpu_ended) and clears
    # running: a snapshot that saw it odd, or saw it move, reads again (a sequence lock that
    # the loop thread never waits for).
    changes: int = 0

    def skip(self, records: list[tuple[int, str]]) -> None:
        """Count skipped samples and keep the newest :data:`SKIP_RECORDS` of their records."""
        self.skipped_count += len(records)
        self.skipped.extend(records)
        if len(self.skipped) > 2 * SKIP_RECORDS:  # trimmed in bulk: amortised O(1)
            del self.skipped[:-SKIP_RECORDS]

    def sums(self) -> tuple[float, ...]:
        return tuple(getattr(self, name) for name in _SUMS)

    def begin_epoch(
        self, epoch: int, capacity: Capacity, owner: object, now: float | None = None
    ) -> None:
        """Epoch ``epoch`` (its token ``owner``) starts its clock; its statistics count from
        here. An epoch still running beside it (two iterators at once) stops counting."""
        running = self.running
        if running is not None:
            self.end_epoch(running.owner, now)
        started = time.perf_counter() if now is None else now
        begin = self.read_cpu(started, fresh=True)
        self.epoch = epoch
        self.capacity = capacity
        self.running = RunningEpoch(epoch, capacity, owner, started, self.sums(), begin)

    def end_epoch(self, owner: object, now: float | None = None) -> EpochStatistics | None:
        """The epoch of token ``owner`` ended: its statistics (None if it is not the one
        running)."""
        running = self.running
        if running is None or owner is not running.owner:
            return None
        now = time.perf_counter() if now is None else now
        cpu = self.read_cpu(now, fresh=True)
        stats = self._epoch(running, now, self.sums(), cpu)
        use = _cpu_use(running, cpu, now)
        self.last_epoch = stats  # read only once running is None
        # The totals take the epoch in, then the epoch stops running, inside an odd count of
        # changes: a reader that overlaps any of it reads again (see snapshot), so none sees
        # the epoch's batches without its wall time, nor its wall time twice.
        self.changes += 1
        if use is not None:
            self.cpu_ended = _plus(self.cpu_ended, use)
        self.wall_s += stats.wall_s
        self.running = None
        self.changes += 1
        return stats

    def measure(self, now: float | None = None, *, fresh: bool = False) -> EpochStatistics:
        """The running epoch's statistics so far, or the last epoch's if none runs.

        ``fresh`` reads the CPU time now; else a read younger than
        :data:`CPU_SAMPLE_INTERVAL_S` serves (the CPU shares then cover the epoch up to it).
        """
        return self.snapshot(now, fresh=fresh)[0]

    def measure_total(self, now: float | None = None) -> EpochStatistics:
        """Every epoch's statistics together."""
        return self.snapshot(now)[1]

    def snapshot(
        self, now: float | None = None, *, fresh: bool = False
    ) -> tuple[EpochStatistics, EpochStatistics]:
        """``(epoch, total)``: the running (or last) epoch's statistics and every epoch's, from
        one read of the running epoch, of the sums and of the CPU time, so that they agree (the
        total holds the epoch) while the loop thread goes on counting.

        Safe from any thread: the running epoch is read before the sums, which only grow, and
        read again after them: if another epoch began meanwhile, they are read anew (a
        sequence lock without the lock: the loop thread never waits). So no difference is
        negative (each is clamped at 0 all the same) and none spans two epochs.
        """
        now = time.perf_counter() if now is None else now
        # The CPU first (a read of /proc takes milliseconds), then the running epoch and the
        # sums, again if an epoch began or ended meanwhile, so that the sums are the epoch's.
        cpu = self.read_cpu(now, fresh=fresh) if self.running is not None else None
        for _ in range(_SNAPSHOT_TRIES):  # bounded: each try is a few dozen attribute reads
            changes = self.changes
            running = self.running
            sums = self.sums()
            ended_wall, ended_cpu = self.wall_s, self.cpu_ended
            if self.running is running and self.changes == changes and changes % 2 == 0:
                break
            time.sleep(0)  # let the loop thread finish what it was changing
        else:  # epochs ending faster than this thread reads (or a reader run by the loop
            # thread in the middle of an epoch's end): the last epoch and the totals as read
            running = None
        if running is None:
            epoch = self.last_epoch or EpochStatistics(epoch=self.epoch)
            capacity, wall, total_cpu = self.capacity, ended_wall, ended_cpu
        else:
            epoch = self._epoch(running, now, sums, cpu)
            capacity, wall, total_cpu = running.capacity, ended_wall + epoch.wall_s, ended_cpu
            use = _cpu_use(running, cpu, now)
            if use is not None:
                total_cpu = _plus(ended_cpu, use)
        total = EpochStatistics.build(
            None,
            wall,
            list(sums),
            capacity,
            cpu=total_cpu if total_cpu[0] > 0 else None,
            cpus=self.cpus,
        )
        return epoch, total

    def _epoch(
        self, running: RunningEpoch, now: float, sums: tuple[float, ...], cpu: CpuSample | None
    ) -> EpochStatistics:
        return EpochStatistics.build(
            running.epoch,
            max(0.0, now - running.started),
            [max(0.0, a - b) for a, b in zip(sums, running.baseline, strict=True)],
            running.capacity,
            cpu=_cpu_use(running, cpu, now),
            cpus=self.cpus,
        )

    def read_cpu(self, now: float, *, fresh: bool) -> CpuSample | None:
        """The process tree's CPU time at ``now`` (or the newest read, if it is younger than
        :data:`CPU_SAMPLE_INTERVAL_S`, not newer than ``now``, and ``fresh`` is false); None
        where it cannot be read. Any thread may call it: the newest read is one immutable
        sample, replaced whole."""
        last = self.cpu_last
        if not fresh and last is not None and 0 <= now - last.at < CPU_SAMPLE_INTERVAL_S:
            return last
        read = self.cpu_clock()
        sample = None if read is None else CpuSample(now, *read)
        self.cpu_last = sample
        return sample


#: Reads of the running epoch and the sums a snapshot tries before it settles for the last
#: epoch that ended: another epoch begins (or ends) between two reads only when epochs last
#: about a thread switch (5 ms), and three in a row only when the reader is starved (it yields
#: its turn between tries, so that an epoch's end under way completes).
_SNAPSHOT_TRIES = 3


@dataclass(frozen=True, slots=True)
class RunningEpoch:
    """The running epoch's start, as :meth:`Counters.begin_epoch` publishes it (whole).

    Attributes:
        epoch: its number.
        capacity: how parallel its stages may be.
        owner: its token: only it ends the clock.
        started: ``time.perf_counter()`` at its start.
        baseline: :data:`_SUMS` at its start.
        cpu_begin: the process tree's CPU time at its start (None: unknown).
    """

    epoch: int
    capacity: Capacity
    owner: object
    started: float
    baseline: tuple[float, ...]
    cpu_begin: CpuSample | None


def _cpu_use(running: RunningEpoch, last: CpuSample | None, now: float) -> _Cpu | None:
    """``(wall_s, main_s, tree_s, wait_s)`` of ``running`` from its start to the read ``last``;
    None when either read is missing or they cover no time."""
    begin = running.cpu_begin
    if begin is None or last is None or last.at <= begin.at or last.at > now:
        return None
    return (
        last.at - begin.at,
        max(0.0, last.main_s - begin.main_s),
        max(0.0, last.tree_s - begin.tree_s),
        max(0.0, last.wait_s - begin.wait_s),
    )


#: The counters of the loader whose epoch runs this task (set by the epoch's scheduler task,
#: inherited by the produce and fetch tasks it creates): remote sources count requests,
#: retries, bytes and stalls there without knowing the loader. None outside a loader.
current_counters: contextvars.ContextVar[Counters | None] = contextvars.ContextVar(
    "aioloader_counters", default=None
)


@dataclass(frozen=True, slots=True)
class EpochStatistics:
    """Throughput and where the time went, over one epoch (or all of them: ``epoch`` None).

    Shares are fractions of the wall time, between 0 and 1 (see the module docstring for how
    each is measured). The verdict (``bottleneck``, ``knob``, ``hint``) is made only from the
    shares, see :meth:`verdict`.

    Attributes:
        epoch: the epoch number, or None for the total over epochs.
        wall_s: seconds from the epoch's first batch asked for to its end (or now).
        batches, samples: handed to the consumer.
        bytes: bytes of the arrays and tensors in those batches (batches of many leaves are
            walked now and then, the others estimated per sample: see ``_produce``).
        bytes_read: bytes read by remote sources (bodies returned, retries excluded).
        batches_per_s, samples_per_s, bytes_per_s, read_bytes_per_s: the rates over wall_s.
        wait_share: the consumer waited for a batch (or its device copy).
        worker_share: the workers (or threads) were busy reading and collating.
        fetch_share: the ``io_concurrency`` fetch slots were in use (async datasets).
        transfer_share: the consumer waited for device copies.
        prefetch_full_share: every ``prefetch`` permit was taken and the scheduler waited.
        stream_share: pulling items from an async iterable dataset, on the loop.
        cpus: CPUs the loader's processes may use (affinity, cgroup quota); 0 if unknown.
        cpu_s: CPU seconds (user + system) of this process and every descendant (the worker
            server, the workers), over the epoch; 0 where ``/proc`` cannot tell.
        cpu_share: ``cpu_s`` over the wall time times ``cpus``: how much of the machine the
            loader's processes used. The training step's own work in this process counts too.
        main_cpus, worker_cpus: CPUs this process, and its descendants, used on average (1.0:
            one CPU all the time).
        cpu_wait_share: the time their threads were ready to run but waited for a CPU, over
            the wall time times ``cpus``: with ``cpu_share``, how much CPU they asked for.
        retries: batches re-run after a worker crash or a deadline.
        remote_retries: remote reads retried (HTTP 5xx/429, resets, timeouts, ...).
        remote_requests: remote read attempts started.
        timeouts: batches that missed their deadline.
        skipped: samples skipped (``on_error='skip'``).
        bottleneck: the limiting stage: ``'consumer'``, ``'workers'``, ``'io'``,
            ``'transfer'``, ``'prefetch'``, ``'source'``, ``'loop'``, ``'cpu'`` (the machine:
            the CPUs the processes may use are all busy), or ``''`` (no batch yet).
        knob: the setting to turn: ``'num_workers'``, ``'thread_pool'`` (two threads or more
            held by the GIL: use processes), ``'io_concurrency'``, ``'prefetch'``,
            ``'pin_memory'`` (pin-only mode, no device: pinning is the limit),
            ``'device_prefetch'`` (copies to a device, pinned already), ``'batch_size'``, or
            ``''`` when no setting of the loader helps.
        hint: the verdict in a sentence, with the numbers behind it.
    """

    epoch: int | None = None
    wall_s: float = 0.0
    batches: int = 0
    samples: int = 0
    bytes: int = 0
    bytes_read: int = 0
    batches_per_s: float = 0.0
    samples_per_s: float = 0.0
    bytes_per_s: float = 0.0
    read_bytes_per_s: float = 0.0
    wait_share: float = 0.0
    worker_share: float = 0.0
    fetch_share: float = 0.0
    transfer_share: float = 0.0
    prefetch_full_share: float = 0.0
    stream_share: float = 0.0
    cpus: float = 0.0
    cpu_s: float = 0.0
    cpu_share: float = 0.0
    main_cpus: float = 0.0
    worker_cpus: float = 0.0
    cpu_wait_share: float = 0.0
    retries: int = 0
    remote_retries: int = 0
    remote_requests: int = 0
    timeouts: int = 0
    skipped: int = 0
    bottleneck: str = ""
    knob: str = ""
    hint: str = ""

    @classmethod
    def build(
        cls,
        epoch: int | None,
        wall_s: float,
        sums: list[float],
        capacity: Capacity,
        *,
        cpu: _Cpu | None = None,
        cpus: float = 0.0,
    ) -> EpochStatistics:
        """The statistics of ``wall_s`` seconds whose :data:`_SUMS` were ``sums``; ``cpu`` is
        ``(wall_s, main_s, tree_s, wait_s)``: the CPU seconds of this process and of its tree over
        ``wall_s`` seconds (a CPU read may cover a little less than the epoch), None unknown."""
        s = dict(zip(_SUMS, sums, strict=True))
        known = cpu is not None and cpu[0] > 0 and cpus > 0
        covered, main_s, tree_s, wait_s = cpu if cpu is not None and known else _NO_CPU
        if not known:  # unknown: every CPU field stays 0, and the verdict ignores them
            cpus = 0.0
        wall = wall_s if wall_s > 0 else math.inf  # no time yet: every rate and share is 0
        wait = s["consumer_wait_s"] + s["transfer_s"]
        io = capacity.io_concurrency
        base = cls(
            epoch=epoch,
            wall_s=wall_s,
            batches=int(s["batches_yielded"]),
            samples=int(s["samples_yielded"]),
            bytes=int(s["bytes_yielded"]),
            bytes_read=int(s["remote_bytes"]),
            batches_per_s=s["batches_yielded"] / wall,
            samples_per_s=s["samples_yielded"] / wall,
            bytes_per_s=s["bytes_yielded"] / wall,
            read_bytes_per_s=s["remote_bytes"] / wall,
            wait_share=_share(wait, wall),
            worker_share=_share(s["read_s"] + s["collate_s"], wall * max(1, capacity.makers)),
            fetch_share=_share(s["io_busy_s"], wall * io) if io else 0.0,
            transfer_share=_share(s["transfer_s"], wall),
            prefetch_full_share=_share(s["permit_wait_s"], wall),
            stream_share=_share(s["stream_s"], wall),
            retries=int(s["retries"]),
            remote_retries=int(s["remote_retries"]),
            remote_requests=int(s["remote_requests"]),
            timeouts=int(s["timeouts"]),
            skipped=int(s["skipped_count"]),
            cpus=cpus,
            cpu_s=tree_s,
            cpu_share=_share(tree_s, covered * cpus),
            main_cpus=main_s / covered,
            worker_cpus=max(0.0, tree_s - main_s) / covered,
            cpu_wait_share=_share(wait_s, covered * cpus),
        )
        if not base.batches:
            return base
        stage, knob, hint = base.verdict(capacity, s)
        return replace(base, bottleneck=stage, knob=knob, hint=hint)

    @property
    def needs_action(self) -> bool:
        """Whether the verdict asks the user to act: the consumer waited for more than
        :data:`WAIT_SHARE_THRESHOLD` of an epoch that lasted at least
        :data:`VERDICT_WARNING_MIN_S` (the loader is the bottleneck, and not only for its
        start). The epoch's log line is a WARNING only then (and once per process)."""
        return self.wait_share > WAIT_SHARE_THRESHOLD and self.wall_s >= VERDICT_WARNING_MIN_S

    def verdict(self, capacity: Capacity, sums: dict[str, float]) -> tuple[str, str, str]:
        """``(bottleneck, knob, hint)``: which stage limits the epoch and what to turn.

        In order: a consumer that rarely waited is the limit itself; else the copies to the
        device if the consumer waited for them more than for batches (``device_prefetch``:
        they are pinned already), or the pinning of batches where ``pin_memory`` is all the
        stage does (``pin_memory``: a device would overlap it); else the machine, when
        the loader's processes used or waited for :data:`CPU_SATURATED` of the CPUs they may
        use (more workers share the same cores, more prefetch only queues: only where this
        process spent more than its workers does a knob help, ``batch_size``: fewer batches
        to hand over); else the busiest stage that used :data:`SATURATED` of the capacity it
        could use (the smaller of its own setting and what ``prefetch`` lets it have: when
        ``prefetch`` is the smaller, it is the knob; the workers' busy share is the larger of
        the time they measured and the CPU their processes used); else this process, busy on
        one CPU handing batches over (per-batch cost: ``batch_size``); else ``prefetch`` if
        the scheduler mostly waited for permits; else the loop itself (no stage was busy, yet
        batches came late).
        """
        waited = f"the consumer waited {self.wait_share:.0%} of the time"
        if self.wait_share < WAIT_SHARE_THRESHOLD:
            return (
                "consumer",
                "",
                f"the consumer is slow ({waited}): the loader keeps up; speed up the training "
                "step, not the loader",
            )
        # Copies are timed only where a device stage runs: to a device (staged), or pinning.
        if sums["transfer_s"] > sums["consumer_wait_s"]:
            more = f"device_prefetch (now {capacity.device_prefetch})"
            if capacity.staged:  # pin_memory=True or not: the copies are pinned already
                return (
                    "transfer",
                    "device_prefetch",
                    f"copies to the device ({waited}, mostly for copies, from pinned memory "
                    f"already): raise {more} to overlap more copies, or send smaller batches "
                    "(or smaller dtypes) to the device",
                )
            return (  # pin-only mode: each batch is copied into page-locked memory
                "transfer",
                "pin_memory",
                f"pinning batches ({waited}, mostly for pinning): pass device= instead of "
                "pin_memory=True (the loader then copies on a side stream, overlapped with the "
                f"step), or set pin_memory=False; a larger {more} overlaps more pinnings",
            )
        wall = self.wall_s
        makers = max(1, capacity.makers)
        if self.cpus and self.cpu_share + self.cpu_wait_share >= CPU_SATURATED:
            others = ""
            if self.cpu_share < CPU_SATURATED:
                others = (
                    f", and waited for a CPU {self.cpu_wait_share:.0%} of it: other processes "
                    "or too many threads hold the rest"
                )
            machine = (
                f"the machine is the limit: the loader's processes used "
                f"{self.cpu_share * self.cpus:.1f} of the {self.cpus:g} CPUs they may use "
                f"({self.cpu_share:.0%}: this process {self.main_cpus:.1f}, its workers "
                f"{self.worker_cpus:.1f}{others}; {waited})"
            )
            if capacity.processes and self.main_cpus >= self.worker_cpus:
                # This process, not the workers, spent the most: handing batches over (and
                # the training step). Fewer, larger batches cut the part paid per batch.
                return (
                    "cpu",
                    "batch_size",
                    f"{machine}: this process spends more than its workers, much of it per "
                    "batch (receiving, mapping, handing over): raise batch_size; more workers "
                    "or prefetch cannot help on these cores",
                )
            return (
                "cpu",
                "",
                f"{machine}: more workers or prefetch cannot help on these cores; make "
                "__getitem__, the transform or collate_fn cheaper, or run on more CPUs",
            )
        # A batch sampler's size is not known up front: the mean of the batches handed over.
        size = capacity.batch_size or sums["samples_yielded"] / max(1.0, sums["batches_yielded"])
        items = capacity.prefetch * max(1.0, size)
        running = min(makers, capacity.prefetch)
        worker_busy = _share(sums["read_s"] + sums["collate_s"], wall * running)
        if capacity.processes and self.cpus:
            worker_busy = max(worker_busy, _share(self.worker_cpus, running))
        candidates = [(worker_busy, "workers", makers > capacity.prefetch)]
        if capacity.io_concurrency:
            used = _share(sums["io_busy_s"], wall * min(capacity.io_concurrency, items))
            candidates.append((used, "io", capacity.io_concurrency > items))
        if capacity.stream:
            candidates.append((self.stream_share, "source", False))
        busy, stage, by_prefetch = max(candidates)
        if busy >= SATURATED:
            if by_prefetch:
                return (
                    stage,
                    "prefetch",
                    f"{_STAGE[stage]} is busy {busy:.0%} of what prefetch={capacity.prefetch} "
                    f"lets it run at once ({waited}): raise prefetch",
                )
            if stage == "workers" and self._gil_bound(capacity):
                return (
                    stage,
                    "thread_pool",
                    f"reading and collating samples is the limit: {makers} threads busy "
                    f"{busy:.0%} of the time ({waited}), yet this process used "
                    f"{self.main_cpus:.1f} CPUs of {self.cpus:g}: Python code (__getitem__, "
                    "the transform or collate_fn) holds the GIL, so the loader's threads run "
                    "one at a time: use processes (thread_pool=False); more threads cannot "
                    "run at once",
                )
            if stage == "workers":
                nouns = ("worker process", "worker processes", "thread", "threads")
                what = nouns[2 * (not capacity.processes) + (makers > 1)]
                # One thread uses one CPU at most whatever it runs: whether the GIL holds it
                # back cannot be told, so both ways out are named.
                threads = _GIL_OR_NOT if capacity.thread_pool and not capacity.processes else ""
                return (
                    stage,
                    "num_workers",
                    f"reading and collating samples is the limit: {makers} {what} busy "
                    f"{busy:.0%} of the time ({waited}): raise num_workers{threads}, or make "
                    "__getitem__, the transform or collate_fn cheaper",
                )
            if stage == "io":
                return (
                    stage,
                    "io_concurrency",
                    f"remote reads are the limit: {capacity.io_concurrency} fetches in flight "
                    f"{busy:.0%} of the time ({waited}): raise io_concurrency (and the "
                    "source's connection limit)",
                )
            return (
                stage,
                "",
                f"the async iterable dataset yields too slowly ({waited}); it is read one "
                "item at a time on the loop: make it faster or use a map-style dataset",
            )
        if self.cpus and self.main_cpus >= SATURATED and capacity.processes:
            return (
                "loop",
                "batch_size",
                f"this process is busy {self.main_cpus:.1f} CPUs handing batches over "
                f"while its workers are busy {busy:.0%} ({waited}): the cost per batch on the "
                "event loop is the limit: raise batch_size (fewer, larger batches)",
            )
        if self.prefetch_full_share >= SATURATED:
            return (
                "prefetch",
                "prefetch",
                f"every one of the {capacity.prefetch} permits was taken "
                f"{self.prefetch_full_share:.0%} of the time while the workers were busy "
                f"{busy:.0%} ({waited}): raise prefetch",
            )
        return (
            "loop",
            "",
            f"no stage is saturated, yet {waited}: something blocks the event loop (a "
            "blocking call, long GC pauses: see gc.freeze) or per-batch overhead dominates "
            "(tiny batches: raise batch_size or prefetch)",
        )

    def _gil_bound(self, capacity: Capacity) -> bool:
        """Whether the threads of ``thread_pool=True`` make batches one at a time under the
        GIL: they could use two CPUs or more (``min(makers, cpus)``), yet this process used at
        most about one (:data:`GIL_BOUND_MARGIN`) while they were busy, and asked for about
        one at least (used, or waited for in a run queue: on a loaded machine a GIL-bound
        process gets less than a CPU). Threads that wait for I/O ask for far less, and more of
        them do help. One thread uses one CPU at most whatever it runs (GIL-bound Python, or
        numpy and PIL that release it): the check cannot tell them apart, and says nothing."""
        asked = self.main_cpus + self.cpu_wait_share * self.cpus  # threads: the tree is this
        return (
            capacity.thread_pool
            and not capacity.processes
            and min(capacity.makers, self.cpus) >= 2  # what they could use
            and self.main_cpus <= 1.0 + GIL_BOUND_MARGIN
            and asked >= 1.0 - GIL_BOUND_MARGIN
        )

    def as_dict(self) -> dict[str, Any]:
        """The statistics as a flat dict of numbers and strings (JSON-able)."""
        return asdict(self)


_STAGE = {"workers": "reading and collating", "io": "fetching", "source": "the async stream"}

#: The num_workers verdict's words for threads of thread_pool=True, where the GIL cannot be
#: told from work that releases it (numpy, PIL), as with one thread: more threads help there.
_GIL_OR_NOT = " (or use processes, thread_pool=False, where Python code holds the GIL)"


@dataclass(frozen=True, slots=True)
class WorkerFigures:
    """What one worker did for this loader, where its backend reports it (Ray actors: each
    actor slot, every incarnation of it together), in ``LoaderStatistics.workers``.

    Attributes:
        id: the worker id (``get_worker_info().id`` in it).
        node: the node it runs on now (a Ray node id), None before it started.
        host: that node's host name.
        pid: its process id now (on its node).
        batches: batches it made for this loader.
        bytes: bytes of the arrays and tensors in those batches.
        busy_s: seconds it spent reading, fetching and collating them.
        busy_share: ``busy_s`` over the loader's wall time (all epochs): how much of the
            time it was busy for this loader.
        restarts: times it was replaced (a death, a kill at a deadline, a lost node).
    """

    id: int
    node: str | None = None
    host: str | None = None
    pid: int | None = None
    batches: int = 0
    bytes: int = 0
    busy_s: float = 0.0
    busy_share: float = 0.0
    restarts: int = 0


@dataclass(frozen=True, slots=True)
class LoaderStatistics:
    """A snapshot of the loader's state and where its time went.

    The counters below are cumulative over every epoch; ``epoch_stats`` holds the current
    epoch's throughput, shares and bottleneck verdict (the last epoch's between epochs), and
    ``total`` the same over every epoch. ``str()`` is a small table; :meth:`as_dict` a flat
    dict for TensorBoard, W&B or JSON.

    Attributes:
        epoch: the epoch being iterated (or last iterated).
        batches_yielded: batches handed to the consumer, all epochs.
        samples_yielded: samples in those batches, all epochs.
        bytes_yielded: bytes of the arrays and tensors in those batches.
        epoch_batches_yielded: batches handed to the consumer in the current epoch.
        in_flight: batches scheduled whose result has not arrived.
        waiting: batches finished, waiting in the reorder buffer for their turn.
        prefetch: the permit count bounding in_flight + waiting (+ batches being handed over).
        live_shm_slots: shared-memory segments alive (free, leased or held by batches).
        leased_shm_slots: segments lent to a worker for a batch it is making.
        held_shm_slots: segments holding batches the consumer or the pipeline still holds.
        shm_bytes: bytes of all shared-memory segments.
        shm_fallbacks: batches that travelled inline (pickled) because no shared-memory segment
            could be had (``/dev/shm`` full, descriptors exhausted); logged once as a warning.
        worker_restarts: worker processes replaced after a crash or a kill.
        retries: batches re-run after a worker crash or a deadline (``max_retries``).
        timeouts: batches that missed their deadline.
        remote_requests: remote read attempts (HTTP requests, object-store reads) started.
        remote_retries: remote reads retried after a transient failure.
        requests_in_flight: remote read attempts running now.
        bytes_read: bytes that remote reads returned.
        remote_stalls: remote reads that went silent for their ``stall_warning`` (logged).
        skipped: ``(index, reason)`` of the newest :data:`SKIP_RECORDS` samples skipped with
            ``on_error='skip'``; ``skipped_count`` counts them all.
        skipped_count: samples skipped, all epochs.
        leftover_batches: batches a rank had read past the end the ranks agreed on for an
            epoch of a stream (``equal_steps``), all epochs; ``leftover_samples`` their samples.
            With ``leftover='carry'`` they are handed first in the next epoch.
        leftover_samples: samples in ``leftover_batches``.
        dropped_batches: leftover batches released (``leftover='drop'``; under ``'carry'``
            those beyond the ``prefetch`` batches an epoch may carry, and carried batches left
            when the loader closed); ``dropped_samples`` their samples.
        dropped_samples: samples in ``dropped_batches``.
        cut_epochs: epochs that ended at the agreed step before this rank's share of the
            stream did (the rest of the share is not read in that epoch; logged).
        unread_samples: samples of those shares neither handed over nor read past the end,
            counted where the stream has a ``len()`` (and the epoch began at its start).
        fetch_s: seconds the event loop spent awaiting async dataset items (summed per batch).
        read_s: seconds spent reading samples (``dataset[i]``), in threads or workers.
        collate_s: seconds spent collating, in threads or workers.
        transfer_s: seconds the consumer waited for device copies.
        consumer_wait_s: seconds the consumer waited for a batch that was not ready.
        device_batches: batches the device stage copied to the device (or pinned), all epochs.
        device_bytes: bytes of those batches.
        device_staged_bytes: host bytes copied on the way to the device by a host memcpy
            (pageable leaves into pinned staging): 0 for batches in registered shared memory
            (process workers) or collated straight into pinned memory (threads,
            ``num_workers=0``). Per batch: ``device_staged_bytes / device_batches``.
        device_copies_in_flight: device copies started and not completed now.
        device_wait_s: seconds ``wait()`` on device copies was suspended for copies not
            complete yet (the part of ``transfer_s`` spent on the copy itself).
        device_handoff_p50_us: median microseconds from the stage's completion thread seeing a
            copy complete to the waiting task resuming (the hand-off; the wake latency end to
            end is measured by ``benchmarks/gpu_transfer.py``).
        device_handoff_p99_us: the 99th percentile of the same.
        device_ring_slots: reusable device buffers the stage holds now.
        device_ring_bytes: their bytes.
        device_ring_fallbacks: batches that got fresh device tensors because no ring slot was
            free, all epochs.
        device_pinned_fallbacks: batches made on the loader's threads that got pageable memory
            (then staged) because pinned memory could not be had, all epochs.
        wall_s: seconds iterated, all epochs (see :class:`EpochStatistics`).
        epoch_stats: the current (or last) epoch's rates, shares and verdict.
        total: the same over every epoch.
        workers: each worker's :class:`WorkerFigures`, where the backend reports them (Ray
            actors); empty otherwise. Where the workers are the bottleneck, the verdict's
            hint names the busiest and the idlest of them.
    """

    epoch: int = 0
    batches_yielded: int = 0
    samples_yielded: int = 0
    bytes_yielded: int = 0
    epoch_batches_yielded: int = 0
    in_flight: int = 0
    waiting: int = 0
    prefetch: int = 0
    live_shm_slots: int = 0
    leased_shm_slots: int = 0
    held_shm_slots: int = 0
    shm_bytes: int = 0
    shm_fallbacks: int = 0
    worker_restarts: int = 0
    retries: int = 0
    timeouts: int = 0
    remote_requests: int = 0
    remote_retries: int = 0
    requests_in_flight: int = 0
    bytes_read: int = 0
    remote_stalls: int = 0
    skipped: tuple[tuple[int, str], ...] = ()
    skipped_count: int = 0
    leftover_batches: int = 0
    leftover_samples: int = 0
    dropped_batches: int = 0
    dropped_samples: int = 0
    cut_epochs: int = 0
    unread_samples: int = 0
    fetch_s: float = 0.0
    read_s: float = 0.0
    collate_s: float = 0.0
    transfer_s: float = 0.0
    consumer_wait_s: float = 0.0
    device_batches: int = 0
    device_bytes: int = 0
    device_staged_bytes: int = 0
    device_copies_in_flight: int = 0
    device_wait_s: float = 0.0
    device_handoff_p50_us: float = 0.0
    device_handoff_p99_us: float = 0.0
    device_ring_slots: int = 0
    device_ring_bytes: int = 0
    device_ring_fallbacks: int = 0
    device_pinned_fallbacks: int = 0
    wall_s: float = 0.0
    epoch_stats: EpochStatistics = field(default_factory=EpochStatistics)
    total: EpochStatistics = field(default_factory=EpochStatistics)
    workers: tuple[WorkerFigures, ...] = ()

    @classmethod
    def build(cls, counters: Counters, **now: Any) -> LoaderStatistics:
        """A snapshot of ``counters``; ``now`` gives the fields only the loader knows (in
        flight, shared memory, restarts, each worker's figures)."""
        c = counters
        epoch_stats, total = c.snapshot()  # one read of the CPU time serves both
        workers = tuple(
            replace(w, busy_share=_share(w.busy_s, total.wall_s)) for w in now.pop("workers", ())
        )
        if workers and epoch_stats.bottleneck == "workers":
            epoch_stats = replace(epoch_stats, hint=f"{epoch_stats.hint}; {_per_worker(workers)}")
        return cls(
            epoch=c.epoch,
            batches_yielded=c.batches_yielded,
            samples_yielded=c.samples_yielded,
            bytes_yielded=c.bytes_yielded,
            epoch_batches_yielded=c.epoch_batches_yielded,
            retries=c.retries,
            timeouts=c.timeouts,
            remote_requests=c.remote_requests,
            remote_retries=c.remote_retries,
            requests_in_flight=c.remote_in_flight,
            bytes_read=c.remote_bytes,
            remote_stalls=c.remote_stalls,
            skipped=tuple(c.skipped[-SKIP_RECORDS:]),
            skipped_count=c.skipped_count,
            leftover_batches=c.leftover_batches,
            leftover_samples=c.leftover_samples,
            dropped_batches=c.dropped_batches,
            dropped_samples=c.dropped_samples,
            cut_epochs=c.cut_epochs,
            unread_samples=c.unread_samples,
            fetch_s=c.fetch_s,
            read_s=c.read_s,
            collate_s=c.collate_s,
            transfer_s=c.transfer_s,
            consumer_wait_s=c.consumer_wait_s,
            wall_s=total.wall_s,
            epoch_stats=epoch_stats,
            total=total,
            workers=workers,
            **now,
        )

    @property
    def bottleneck(self) -> str:
        """The current epoch's limiting stage (see :attr:`EpochStatistics.bottleneck`)."""
        return self.epoch_stats.bottleneck

    @property
    def hint(self) -> str:
        """The current epoch's verdict in a sentence: the stage and the knob to turn."""
        return self.epoch_stats.hint

    def as_dict(self) -> dict[str, Any]:
        """A flat dict of numbers and strings, JSON-able: the counters, then the current
        epoch's statistics as ``epoch/<name>`` and the total's as ``total/<name>`` (the
        grouping TensorBoard and W&B show as sections). Skip records are left out (their
        count is in)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, EpochStatistics):
                prefix = "epoch" if f.name == "epoch_stats" else f.name
                out.update({f"{prefix}/{k}": v for k, v in value.as_dict().items()})
            elif f.name == "workers":
                for w in value:
                    out.update({f"workers/{w.id}/{k}": v for k, v in asdict(w).items()})
            elif f.name != "skipped":
                out[f.name] = value
        out["bottleneck"] = self.bottleneck
        return out

    def __str__(self) -> str:
        return format_table(self)


def format_table(s: LoaderStatistics) -> str:
    """A small table: the current epoch and the total side by side, then the live state."""
    e, t = s.epoch_stats, s.total
    title = f"epoch {e.epoch}" if e.epoch is not None else "epoch"

    def pct(x: float) -> str:
        return f"{x:.0%}"

    rows: list[tuple[str, str, str]] = [
        ("wall (s)", f"{e.wall_s:.2f}", f"{t.wall_s:.2f}"),
        ("batches", f"{e.batches}", f"{t.batches}"),
        ("samples", f"{e.samples}", f"{t.samples}"),
        ("batches/s", f"{e.batches_per_s:.1f}", f"{t.batches_per_s:.1f}"),
        ("samples/s", f"{e.samples_per_s:.1f}", f"{t.samples_per_s:.1f}"),
        ("MB/s", f"{e.bytes_per_s / 1e6:.1f}", f"{t.bytes_per_s / 1e6:.1f}"),
        ("consumer waited", pct(e.wait_share), pct(t.wait_share)),
        ("workers busy", pct(e.worker_share), pct(t.worker_share)),
    ]
    if t.fetch_share or t.bytes_read or t.remote_requests:
        rows += [
            ("fetch slots busy", pct(e.fetch_share), pct(t.fetch_share)),
            ("read MB/s", f"{e.read_bytes_per_s / 1e6:.1f}", f"{t.read_bytes_per_s / 1e6:.1f}"),
            ("remote retries", f"{e.remote_retries}", f"{t.remote_retries}"),
        ]
    if t.transfer_share:
        rows.append(("device copy wait", pct(e.transfer_share), pct(t.transfer_share)))
    if t.stream_share:
        rows.append(("async stream", pct(e.stream_share), pct(t.stream_share)))
    rows.append(("prefetch full", pct(e.prefetch_full_share), pct(t.prefetch_full_share)))
    if t.cpus:
        rows += [
            (f"CPU of {t.cpus:g}", pct(e.cpu_share), pct(t.cpu_share)),
            ("  this process", f"{e.main_cpus:.2f}", f"{t.main_cpus:.2f}"),
            ("  workers", f"{e.worker_cpus:.2f}", f"{t.worker_cpus:.2f}"),
            ("waited for a CPU", pct(e.cpu_wait_share), pct(t.cpu_wait_share)),
        ]
    width = max(len(r[0]) for r in rows)
    cols = [max(len(title), *(len(r[1]) for r in rows)), max(5, *(len(r[2]) for r in rows))]
    lines = [f"{'':<{width}}  {title:>{cols[0]}}  {'total':>{cols[1]}}"]
    lines += [f"{a:<{width}}  {b:>{cols[0]}}  {c:>{cols[1]}}" for a, b, c in rows]
    lines.append(
        f"now: in_flight={s.in_flight} waiting={s.waiting} prefetch={s.prefetch} "
        f"shm_slots={s.live_shm_slots} ({s.held_shm_slots} held, {s.shm_bytes / 1e6:.1f} MB) "
        f"requests_in_flight={s.requests_in_flight}"
    )
    lines.append(
        f"events: worker_restarts={s.worker_restarts} retries={s.retries} "
        f"remote_retries={s.remote_retries} timeouts={s.timeouts} "
        f"skipped={s.skipped_count} shm_fallbacks={s.shm_fallbacks}"
    )
    if s.device_batches:
        lines.append(
            f"device: batches={s.device_batches} staged_bytes/batch="
            f"{s.device_staged_bytes / s.device_batches:.0f} "
            f"copies_in_flight={s.device_copies_in_flight} copy_wait={s.device_wait_s:.3f}s "
            f"handoff_us p50={s.device_handoff_p50_us:.0f} p99={s.device_handoff_p99_us:.0f} "
            f"ring_slots={s.device_ring_slots} ring_fallbacks={s.device_ring_fallbacks}"
        )
    for w in s.workers:
        where = f"node {w.node[:12]}" if w.node else "not started"
        lines.append(
            f"worker {w.id} ({where}, pid {w.pid}): {w.batches} batches, "
            f"{w.bytes / 1e6:.1f} MB, busy {w.busy_share:.0%}, restarts {w.restarts}"
        )
    if e.bottleneck:
        lines.append(f"bottleneck: {e.bottleneck}: {e.hint}")
    return "\n".join(lines)


def _per_worker(workers: tuple[WorkerFigures, ...]) -> str:
    """The busiest and the idlest worker, for a verdict that names the workers: one far
    busier than the others is a straggler (its node is slower, or busy with other work)."""
    busiest = max(workers, key=lambda w: (w.busy_share, -w.id))
    idlest = min(workers, key=lambda w: (w.busy_share, w.id))

    def named(w: WorkerFigures) -> str:
        where = f" on node {w.node[:12]}" if w.node else ""
        return f"worker {w.id}{where} {w.busy_share:.0%} ({w.batches} batches)"

    if busiest is idlest:
        return f"per worker: {named(busiest)}"
    return f"per worker, busiest: {named(busiest)}; idlest: {named(idlest)}"


def _plus(a: _Cpu, b: _Cpu) -> _Cpu:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3])


def _share(busy: float, capacity: float) -> float:
    """``busy / capacity``, in [0, 1] (0 when there is no capacity or time yet)."""
    if capacity <= 0 or math.isinf(capacity):
        return 0.0
    return min(1.0, max(0.0, busy / capacity))
