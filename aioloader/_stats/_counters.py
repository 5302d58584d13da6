"""Live statistics: mutable counters inside, frozen snapshots outside, and the verdict.

::

    pipeline (event loop thread) ── bumps ──▶ Counters (cumulative, loader-wide)
      Epoch: begin_epoch / end_epoch ──▶ a baseline copy of the sums and the epoch's clock
    DataLoader.statistics() ── snapshot ──▶ LoaderStatistics
                                              ├─ epoch_stats: EpochStatistics (this epoch)
                                              └─ total: EpochStatistics (every epoch)

The pipeline bumps :class:`Counters` from the event loop thread only (worker processes report
their timings in their replies; remote sources reach them through :data:`current_counters`),
so no lock is needed. A snapshot is a few dozen additions: cheap enough to read while running.

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

The wall time of an epoch runs from its first ``__anext__`` to its end (or to now, while it
runs); the total is the sum over epochs, so time between epochs (an evaluation) is not counted.
Two epochs iterated at once (``zip(loader, loader)``) share one baseline: the newer one's.
"""

from __future__ import annotations

import contextvars
import math
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

__all__ = [
    "SATURATED",
    "SKIP_RECORDS",
    "VERDICT_WARNING_MIN_S",
    "WAIT_SHARE_THRESHOLD",
    "Capacity",
    "Counters",
    "EpochStatistics",
    "LoaderStatistics",
    "current_counters",
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


@dataclass(frozen=True, slots=True)
class Capacity:
    """How parallel each stage may be, for the shares and the verdict.

    Attributes:
        makers: batches made at once (worker processes or threads).
        io_concurrency: item fetches in flight at once (0: the dataset is not async map-style).
        prefetch: batches in flight or unclaimed at once.
        batch_size: samples per batch (1 without batching).
        processes: whether the makers are processes.
        stream: the dataset is an async iterable (pulled one item at a time on the loop).
    """

    makers: int = 1
    io_concurrency: int = 0
    prefetch: int = 1
    batch_size: int = 1
    processes: bool = False
    stream: bool = False


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
    wall_s: float = 0.0  # of the epochs that ended
    capacity: Capacity = field(default_factory=Capacity)
    epoch_started: float | None = None  # perf_counter at the running epoch's start
    owner: object = None  # the running epoch's token: only it ends its clock
    baseline: tuple[float, ...] = ()  # _SUMS at the running epoch's start
    last_epoch: EpochStatistics | None = None  # the epoch that ended last

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
        self.end_epoch(self.owner, now)
        self.epoch = epoch
        self.capacity = capacity
        self.owner = owner
        self.epoch_started = time.perf_counter() if now is None else now
        self.baseline = self.sums()

    def end_epoch(self, owner: object, now: float | None = None) -> EpochStatistics | None:
        """The epoch of token ``owner`` ended: its statistics (None if it is not the one
        running)."""
        if self.epoch_started is None or owner is not self.owner:
            return None
        now = time.perf_counter() if now is None else now
        stats = self.measure(now)
        self.wall_s += stats.wall_s
        self.epoch_started = None
        self.last_epoch = stats
        return stats

    def measure(self, now: float | None = None) -> EpochStatistics:
        """The running epoch's statistics so far, or the last epoch's if none runs."""
        if self.epoch_started is None:
            return self.last_epoch or EpochStatistics(epoch=self.epoch)
        now = time.perf_counter() if now is None else now
        sums = [a - b for a, b in zip(self.sums(), self.baseline, strict=True)]
        return EpochStatistics.build(
            self.epoch, max(0.0, now - self.epoch_started), sums, self.capacity
        )

    def measure_total(self, now: float | None = None) -> EpochStatistics:
        """Every epoch's statistics together."""
        running = 0.0
        if self.epoch_started is not None:
            running = (time.perf_counter() if now is None else now) - self.epoch_started
        wall = self.wall_s + max(0.0, running)
        return EpochStatistics.build(None, wall, list(self.sums()), self.capacity)


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
        retries: batches re-run after a worker crash or a deadline.
        remote_retries: remote reads retried (HTTP 5xx/429, resets, timeouts, ...).
        remote_requests: remote read attempts started.
        timeouts: batches that missed their deadline.
        skipped: samples skipped (``on_error='skip'``).
        bottleneck: the limiting stage: ``'consumer'``, ``'workers'``, ``'io'``,
            ``'transfer'``, ``'prefetch'``, ``'source'``, ``'loop'``, or ``''`` (no batch yet).
        knob: the setting to turn: ``'num_workers'``, ``'io_concurrency'``, ``'prefetch'``,
            ``'pin_memory'``, or ``''`` when no setting of the loader helps.
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
        cls, epoch: int | None, wall_s: float, sums: list[float], capacity: Capacity
    ) -> EpochStatistics:
        """The statistics of ``wall_s`` seconds whose :data:`_SUMS` were ``sums``."""
        s = dict(zip(_SUMS, sums, strict=True))
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
        device if the consumer waited for them more than for batches; else the busiest stage
        that used :data:`SATURATED` of the capacity it could use (the smaller of its own
        setting and what ``prefetch`` lets it have: when ``prefetch`` is the smaller, it is
        the knob); else ``prefetch`` if the scheduler mostly waited for permits; else the
        loop itself (no stage was busy, yet batches came late).
        """
        waited = f"the consumer waited {self.wait_share:.0%} of the time"
        if self.wait_share < WAIT_SHARE_THRESHOLD:
            return (
                "consumer",
                "",
                f"the consumer is slow ({waited}): the loader keeps up; speed up the training "
                "step, not the loader",
            )
        if sums["transfer_s"] > sums["consumer_wait_s"]:
            return (
                "transfer",
                "pin_memory",
                f"copies to the device ({waited}, mostly for copies): use pin_memory=True and "
                "a larger device_prefetch, or smaller batches on the device",
            )
        wall = self.wall_s
        makers = max(1, capacity.makers)
        items = capacity.prefetch * max(1, capacity.batch_size)
        candidates = [
            (
                _share(sums["read_s"] + sums["collate_s"], wall * min(makers, capacity.prefetch)),
                "workers",
                makers > capacity.prefetch,
            )
        ]
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
            if stage == "workers":
                nouns = ("worker process", "worker processes", "thread", "threads")
                what = nouns[2 * (not capacity.processes) + (makers > 1)]
                return (
                    stage,
                    "num_workers",
                    f"reading and collating samples is the limit: {makers} {what} busy "
                    f"{busy:.0%} of the time ({waited}): raise num_workers, or make "
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
        if self.prefetch_full_share >= SATURATED:
            return (
                "prefetch",
                "prefetch",
                f"every one of the {capacity.prefetch} permits was taken "
                f"{self.prefetch_full_share:.0%} of the time ({waited}): raise prefetch",
            )
        return (
            "loop",
            "",
            f"no stage is saturated, yet {waited}: something blocks the event loop (a "
            "blocking call, long GC pauses: see gc.freeze) or per-batch overhead dominates "
            "(tiny batches: raise batch_size or prefetch)",
        )

    def as_dict(self) -> dict[str, Any]:
        """The statistics as a flat dict of numbers and strings (JSON-able)."""
        return asdict(self)


_STAGE = {"workers": "reading and collating", "io": "fetching", "source": "the async stream"}


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
        fetch_s: seconds the event loop spent awaiting async dataset items (summed per batch).
        read_s: seconds spent reading samples (``dataset[i]``), in threads or workers.
        collate_s: seconds spent collating, in threads or workers.
        transfer_s: seconds the consumer waited for device copies.
        consumer_wait_s: seconds the consumer waited for a batch that was not ready.
        wall_s: seconds iterated, all epochs (see :class:`EpochStatistics`).
        epoch_stats: the current (or last) epoch's rates, shares and verdict.
        total: the same over every epoch.
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
    fetch_s: float = 0.0
    read_s: float = 0.0
    collate_s: float = 0.0
    transfer_s: float = 0.0
    consumer_wait_s: float = 0.0
    wall_s: float = 0.0
    epoch_stats: EpochStatistics = field(default_factory=EpochStatistics)
    total: EpochStatistics = field(default_factory=EpochStatistics)

    @classmethod
    def build(cls, counters: Counters, **now: Any) -> LoaderStatistics:
        """A snapshot of ``counters``; ``now`` gives the fields only the loader knows (in
        flight, shared memory, restarts)."""
        c = counters
        clock = time.perf_counter()
        total = c.measure_total(clock)
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
            fetch_s=c.fetch_s,
            read_s=c.read_s,
            collate_s=c.collate_s,
            transfer_s=c.transfer_s,
            consumer_wait_s=c.consumer_wait_s,
            wall_s=total.wall_s,
            epoch_stats=c.measure(clock),
            total=total,
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
    if e.bottleneck:
        lines.append(f"bottleneck: {e.bottleneck}: {e.hint}")
    return "\n".join(lines)


def _share(busy: float, capacity: float) -> float:
    """``busy / capacity``, in [0, 1] (0 when there is no capacity or time yet)."""
    if capacity <= 0 or math.isinf(capacity):
        return 0.0
    return min(1.0, max(0.0, busy / capacity))
