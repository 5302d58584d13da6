"""Host-to-device throughput of the device stage, and how much of a copy hides behind compute.

For each batch size it measures, in GB/s:

- ``stage``: :class:`aioloader._device.DeviceStage` from pageable host memory (the staging
  path), two batches in flight;
- ``stage+reg``: the same from host memory registered with ``register_host_memory`` (the
  path of a registered shared-memory slot: no staging memcpy);
- ``stage+pin``: the same from memory of the stage's ``host_alloc`` (the path of a batch
  collated on the loader's threads, ``num_workers=0`` or ``thread_pool=True``, when a CUDA
  device follows: no staging memcpy);
- ``pinned .to``: a plain loop of ``pinned.to(device, non_blocking=True)`` (an upper bound);
- ``pageable .to``: ``tensor.to(device)`` from pageable memory (what no pinning gives);

and, for a training step made of matmuls (``--step-ms``), the fraction of the copy time that
stays hidden behind the step with prefetch-style overlap (start the copy of batch i+1, run the
step on batch i, then wait for batch i+1), against running copy and step one after the other.

Beside them, the stage's own counters (:class:`aioloader._device.DeviceStats`) for each route:
host bytes staged per batch (a memcpy on the host: 0 for the registered and the pinned
routes), the hand-off latency (the completion thread saw the copy's event complete -> the
awaiting task resumed; p50 and p99, microseconds), and the device ring's slots and fallbacks;
and the wake latency end to end, which the stage cannot see: one batch at a time is started on
the idle side stream, so its copy begins as ``start()`` records the start event; the task
resumes at ``t1``; the copy took ``elapsed`` on the device (event timing). Wake latency =
``t1 - (t0 + elapsed)``, with ``t0`` taken just before ``start()`` (an upper bound: the
planning before the start event is in it) and just after it returns (a lower bound).

Usage::

    python benchmarks/gpu_transfer.py --batch-mb 16 64 256 --batches 20 --step-ms 30

Without CUDA it says so and exits 0. ``--json`` prints the results as one JSON document on
stdout (the table goes to stderr), for ``benchmarks/run_all.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import mmap
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aioloader._device import DeviceStage

GB = 1e9
F32 = np.dtype(np.float32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-mb", type=float, nargs="+", default=[4.0, 32.0, 128.0])
    parser.add_argument("--batches", type=int, default=20, help="timed batches per measurement")
    parser.add_argument("--leaves", type=int, default=4, help="tensors per batch")
    parser.add_argument("--step-ms", type=float, default=20.0, help="compute time of a step")
    parser.add_argument("--matmul-size", type=int, default=4096)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", action="store_true", help="results as JSON on stdout")
    parser.add_argument(
        "--spin-events",
        action="store_true",
        help="events wait by spinning, not by blocking sync (compare the wake latency)",
    )
    args = parser.parse_args(argv)
    if args.batches < 1 or args.leaves < 1 or any(mb <= 0 for mb in args.batch_mb):
        parser.error("--batches and --leaves must be >= 1 and every --batch-mb > 0")
    return args


def make_batch(nbytes: int, leaves: int, alloc: Callable[[int], torch.Tensor]) -> dict[str, Any]:
    per_leaf = max(nbytes // leaves // 4, 1)
    return {f"x{i}": alloc(per_leaf).normal_() for i in range(leaves)}


def registered_batch(
    stage: DeviceStage, nbytes: int, leaves: int
) -> tuple[dict[str, Any], mmap.mmap, int]:
    per_leaf = max(nbytes // leaves // 4, 1)
    region = mmap.mmap(-1, per_leaf * 4 * leaves)
    raw = np.frombuffer(region, dtype=np.float32)
    base = int(raw.__array_interface__["data"][0])
    ok = stage.register_host_memory(base, len(region))
    if not ok:
        print("  (cudaHostRegister failed: the stage+reg column uses staging)")
    raw[:] = np.random.default_rng(0).standard_normal(raw.size, dtype=np.float32)
    batch = {f"x{i}": raw[i * per_leaf : (i + 1) * per_leaf] for i in range(leaves)}
    return batch, region, base


def batch_bytes(batch: dict[str, Any]) -> int:
    return sum(int(v.nbytes) for v in batch.values())


class LagProbe:
    """How late a 1 ms timer fires on the loop: what other coroutines feel while copies run."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            due = time.perf_counter() + self.period
            await asyncio.sleep(self.period)
            self.lags.append(max(time.perf_counter() - due, 0.0))

    def __enter__(self) -> LagProbe:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def p99_ms(self) -> float:
        if not self.lags:
            return float("nan")
        return float(np.percentile(np.asarray(self.lags), 99) * 1e3)


def pinned_alloc(stage: DeviceStage) -> Callable[[int], torch.Tensor]:
    """Float32 tensors in the stage's pinned memory, as the loader's threads collate into."""
    return lambda n: torch.from_numpy(stage.host_alloc((n,), F32))


def counters(stage: DeviceStage) -> dict[str, float]:
    """The stage's counters worth a column: staged bytes per batch, hand-off latency, the ring."""
    s = stage.stats()
    return {
        "staged_bytes_per_batch": s.staged_bytes_per_batch,
        "handoff_p50_us": s.handoff_p50_s * 1e6,
        "handoff_p99_us": s.handoff_p99_s * 1e6,
        "handoffs": s.handoffs,
        "wait_s": s.wait_seconds,
        "ring_slots": s.ring_slots,
        "ring_fallbacks": s.ring_fallbacks,
    }


def _us(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q) * 1e6) if samples else float("nan")


async def wake_latency(stage: DeviceStage, batch: dict[str, Any], n: int) -> dict[str, float]:
    """End-to-end wake latency (see the module docstring): copies started one at a time on an
    idle side stream; resume time - (start + the copy's event elapsed time)."""
    await stage.drain()  # adds nothing to the stage's wait counters
    torch.cuda.synchronize()
    upper: list[float] = []
    lower: list[float] = []
    for i in range(n):
        copied = stage.stats().copy_seconds
        before = time.perf_counter()
        transfer = stage.start(batch, i)
        after = time.perf_counter()
        await transfer.wait()
        resumed = time.perf_counter()
        elapsed = stage.stats().copy_seconds - copied  # the copy's event elapsed time
        upper.append(max(resumed - before - elapsed, 0.0))
        lower.append(max(resumed - after - elapsed, 0.0))
        del transfer
    return {
        "wake_p50_us": _us(upper, 50),
        "wake_p99_us": _us(upper, 99),
        "wake_p50_us_low": _us(lower, 50),
        "wake_p99_us_low": _us(lower, 99),
    }


async def stage_gbps(stage: DeviceStage, batch: dict[str, Any], n: int) -> tuple[float, float]:
    """Throughput of the stage with two batches in flight, and the loop's p99 lag (ms) meanwhile."""
    # Warm-up with as many batches in flight as the timed loop holds: staging buffers are
    # allocated (page-locked, tens of ms for large ones) once, not inside the timing.
    for transfer in [stage.start(batch, -1 - i) for i in range(3)]:
        await transfer.wait()
    torch.cuda.synchronize()
    with LagProbe() as probe:
        gbps = await _stage_loop(stage, batch, n)
    return gbps, probe.p99_ms()


async def _stage_loop(stage: DeviceStage, batch: dict[str, Any], n: int) -> float:
    await asyncio.sleep(0.005)  # let the probe take a first reading
    started = time.perf_counter()
    pending = stage.start(batch, 0)
    for i in range(1, n):
        following = stage.start(batch, i)
        await pending.wait()
        pending = following
    await pending.wait()
    torch.cuda.synchronize()
    return batch_bytes(batch) * n / (time.perf_counter() - started) / GB


def to_gbps(batch: dict[str, Any], device: torch.device, n: int, non_blocking: bool) -> float:
    for v in batch.values():
        v.to(device, non_blocking=non_blocking)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(n):
        for v in batch.values():
            v.to(device, non_blocking=non_blocking)
    torch.cuda.synchronize()
    return batch_bytes(batch) * n / (time.perf_counter() - started) / GB


def make_step(device: torch.device, size: int, step_ms: float) -> Callable[[Any], None]:
    """A matmul-bound step of about ``step_ms``; it also reads the batch, as training would."""
    a = torch.randn(size, size, device=device, dtype=torch.float16)
    b = torch.randn(size, size, device=device, dtype=torch.float16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    per_matmul_ms = (time.perf_counter() - started) * 100
    count = max(1, round(step_ms / per_matmul_ms))

    def step(batch: Any) -> None:
        for v in batch.values():
            v.sum()
        for _ in range(count):
            a @ b
        torch.cuda.current_stream().synchronize()  # a host sync per step, like loss.item()

    return step


async def overlap(
    stage: DeviceStage, batch: dict[str, Any], step: Callable[[Any], None], n: int
) -> tuple[float, float, float]:
    """Seconds per batch: step alone, copy then step, and copy of i+1 overlapped with step i."""
    resident = await stage.start(batch, -1).wait()
    torch.cuda.synchronize()

    started = time.perf_counter()
    for _ in range(n):
        step(resident)
    compute = (time.perf_counter() - started) / n

    started = time.perf_counter()
    for i in range(n):
        step(await stage.start(batch, i).wait())
    serial = (time.perf_counter() - started) / n

    started = time.perf_counter()
    pending = stage.start(batch, 0)
    for i in range(n):
        current = await pending.wait()
        if i + 1 < n:
            pending = stage.start(batch, i + 1)
        step(current)
    overlapped = (time.perf_counter() - started) / n
    return compute, serial, overlapped


async def run(args: argparse.Namespace) -> None:
    table = sys.stderr if args.json else sys.stdout
    if args.spin_events:
        from aioloader._device import _backend

        _backend.BLOCKING_EVENTS = False  # read by each new event
    stage = DeviceStage(args.device)
    device = stage.device
    assert device is not None
    name = torch.cuda.get_device_name(device)
    print(f"device: {name}; {args.batches} batches per cell", file=table)
    step = make_step(device, args.matmul_size, args.step_ms)
    header = (
        f"{'batch MB':>9} {'stage':>8} {'stage+reg':>10} {'stage+pin':>10} {'pinned .to':>11}"
        f" {'pageable .to':>13} {'step ms':>8} {'copy ms':>8} {'hidden':>7} {'reg copy':>9}"
        f" {'reg hid':>8} {'lag p99 ms':>11} {'reg lag':>8}"
    )
    counter_header = (
        f"{'batch MB':>9} {'route':>9} {'staged B/batch':>15} {'handoff p50':>12}"
        f" {'handoff p99':>12} {'wake p50 us':>16} {'wake p99 us':>16}"
        f" {'ring slots':>11} {'ring fallbacks':>15}"
    )
    rows, records, counter_rows = [], [], []
    for mb in args.batch_mb:
        nbytes = int(mb * 1e6)
        pageable = make_batch(nbytes, args.leaves, lambda n: torch.empty(n))
        pinned = make_batch(nbytes, args.leaves, lambda n: torch.empty(n, pin_memory=True))
        page_stage = DeviceStage(device)  # one stage per route: its counters are the route's
        staged, lag = await stage_gbps(page_stage, pageable, args.batches)
        page_counters = counters(page_stage)
        page_counters |= await wake_latency(page_stage, pageable, args.batches)
        page_stage.close()
        pin_stage = DeviceStage(device)
        collated = make_batch(nbytes, args.leaves, pinned_alloc(pin_stage))
        pinned_stage_gbps, _ = await stage_gbps(pin_stage, collated, args.batches)
        pin_counters = counters(pin_stage)
        pin_counters |= await wake_latency(pin_stage, collated, args.batches)
        del collated
        pin_stage.close()
        reg_stage = DeviceStage(device)
        registered, region, base = registered_batch(reg_stage, nbytes, args.leaves)
        direct, reg_lag = await stage_gbps(reg_stage, registered, args.batches)
        reg_counters = counters(reg_stage)
        reg_counters |= await wake_latency(reg_stage, registered, args.batches)
        compute_r, serial_r, overlapped_r = await overlap(reg_stage, registered, step, args.batches)
        reg_copy_s = max(serial_r - compute_r, 1e-9)
        reg_hidden = min(max((serial_r - overlapped_r) / reg_copy_s, 0.0), 1.0)
        reg_stage.unregister_host_memory(base)
        reg_stage.close()
        del registered
        gc.collect()
        region.close()
        plain_pinned = to_gbps(pinned, device, args.batches, non_blocking=True)
        plain_pageable = to_gbps(pageable, device, args.batches, non_blocking=False)
        compute, serial, overlapped = await overlap(stage, pageable, step, args.batches)
        copy_s = max(serial - compute, 1e-9)
        hidden = min(max((serial - overlapped) / copy_s, 0.0), 1.0)
        records.append(
            {
                "batch_mb": mb,
                "stage_gbps": staged,
                "stage_registered_gbps": direct,
                "stage_pinned_collation_gbps": pinned_stage_gbps,
                "pinned_to_gbps": plain_pinned,
                "pageable_to_gbps": plain_pageable,
                "step_ms": compute * 1e3,
                "copy_ms": copy_s * 1e3,
                "hidden": hidden,
                "registered_copy_ms": reg_copy_s * 1e3,
                "registered_hidden": reg_hidden,
                "loop_lag_p99_ms": lag,
                "registered_loop_lag_p99_ms": reg_lag,
                "counters": {
                    "pageable": page_counters,
                    "pinned_collation": pin_counters,
                    "registered": reg_counters,
                },
            }
        )
        rows.append(
            f"{mb:>9.1f} {staged:>8.2f} {direct:>10.2f} {pinned_stage_gbps:>10.2f}"
            f" {plain_pinned:>11.2f} {plain_pageable:>13.2f} {compute * 1e3:>8.2f}"
            f" {copy_s * 1e3:>8.2f} {hidden:>7.0%} {reg_copy_s * 1e3:>9.2f} {reg_hidden:>8.0%}"
            f" {lag:>11.2f} {reg_lag:>8.2f}"
        )
        for route, c in (
            ("pageable", page_counters),
            ("pinned", pin_counters),
            ("reg", reg_counters),
        ):
            counter_rows.append(
                f"{mb:>9.1f} {route:>9} {c['staged_bytes_per_batch']:>15.0f}"
                f" {c['handoff_p50_us']:>12.1f} {c['handoff_p99_us']:>12.1f}"
                f" {c['wake_p50_us_low']:>7.0f}-{c['wake_p50_us']:<8.0f}"
                f" {c['wake_p99_us_low']:>7.0f}-{c['wake_p99_us']:<8.0f}"
                f" {c['ring_slots']:>11.0f} {c['ring_fallbacks']:>15.0f}"
            )
    stage.close()
    print(
        "host-to-device GB/s; copy ms = (copy then step) - step; hidden = share of it overlapped"
        " (from pageable memory, then from registered memory: reg copy, reg hid);"
        " lag = p99 lateness of a 1 ms loop timer while stage copies are awaited"
        " (pageable, registered)",
        file=table,
    )
    print(header, file=table)
    print("\n".join(rows), file=table)
    print(
        "the stage's counters per route, over its throughput loop: host bytes staged per batch,"
        " hand-off (completion thread saw the event -> task resumed), ring slots used; and the"
        " wake latency end to end (copy done on the device -> task resumed; lower-upper bound)",
        file=table,
    )
    print(counter_header, file=table)
    print("\n".join(counter_rows), file=table)
    if args.json:
        doc = {"benchmark": "gpu_transfer", "device": name, "rows": records}
        print(json.dumps({**doc, "blocking_events": not args.spin_events}))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        message = "gpu_transfer: no CUDA device is available; nothing to measure (needs a GPU)."
        if args.json:
            print(message, file=sys.stderr)
            print(json.dumps({"benchmark": "gpu_transfer", "skipped": "no CUDA device"}))
        else:
            print(message)
        return 0
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
