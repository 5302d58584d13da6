"""The soak of RELIABILITY.md row 21: many epochs of one loader, faults injected in every one.

One loader (2 persistent worker processes, 128 KiB batches: shared memory, ``timeout`` and
``max_retries=1``) runs ``epochs`` shuffled epochs. Before each epoch the faults are armed at
sample indices of that epoch's order (``fault_datasets.arm``: each fires exactly once):

- batch 0: its worker hangs past the batch deadline (killed, replaced, re-run);
- batch 1: its worker sends itself SIGKILL (re-run by ``max_retries``);
- batch 3: its worker sends itself SIGSEGV (re-run);
- batch 5: ``collate_fn`` raises (the user's error: raised at its turn, never re-run);
- the consumer gives up on batch 0 (``asyncio.timeout`` around ``anext`` in even epochs, a
  cancelled task in odd ones): the next ``anext`` must return it. The epoch starts at that
  first ``anext`` and batch 0 cannot come before its deadline, so the consumer surely gives up
  while the batch is in flight, however loaded the machine;
- every third epoch (1, 4, 7, ...) the consumer breaks out at batch 15, abandoning the rest;
  the next epoch's faults are armed only once the workers are done with them (``_settle``).

After each epoch: the index checksum (what came plus the collate failure is exactly the
sampler's batches, in order, up to the break), every armed fault fired, and the process's RSS
(after a collection). :func:`run_soak` is what ``tests/test_soak.py`` runs (a few epochs) and
``tests/scripts/full_soak.py`` runs (20 epochs, with its figures printed).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import fault_datasets as fd
import psutil

import aioloader
from aioloader._sampling._sampler import BatchSampler, RandomSampler

N, BATCH, SHAPE, SEED = 200, 8, (16, 32, 32), 7  # 25 batches of 128 KiB an epoch
HANG_AT, KILL_AT, SEGV_AT, COLLATE_AT, BREAK_AT = 0, 1, 3, 5, 15
GIVE_UP_S = 0.05  # how long the consumer waits for the hung batch (well inside its deadline)


@dataclass
class SoakFigures:
    """What a soak did and measured."""

    epochs: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    rss: list[int] = field(default_factory=list)  # main process, bytes, after each epoch
    worker_rss: list[int] = field(default_factory=list)  # both workers together
    broken_epochs: int = 0
    wall_s: float = 0.0
    restarts: int = 0
    retries: int = 0
    timeouts: int = 0

    def growth(self, series: list[int], since: int = 1) -> float:
        """Growth of ``series`` from epoch ``since`` (0-based: 1 is the second) to the last, %."""
        return 100.0 * (series[-1] - series[since]) / series[since]

    def report(self) -> str:
        mib = 1 << 20
        lines = [
            f"epochs {self.epochs} ({self.broken_epochs} broken on purpose)",
            "faults injected "
            + ", ".join(f"{kind} {count}" for kind, count in sorted(self.faults.items())),
            f"worker restarts {self.restarts}, batch re-runs {self.retries}, "
            f"timeouts {self.timeouts}",
            f"main RSS at epoch 2 {self.rss[1] / mib:.1f} MiB, at epoch {self.epochs} "
            f"{self.rss[-1] / mib:.1f} MiB, growth {self.growth(self.rss):+.2f}%",
            f"workers' RSS (both) at epoch 2 {self.worker_rss[1] / mib:.1f} MiB, at epoch "
            f"{self.epochs} {self.worker_rss[-1] / mib:.1f} MiB, growth "
            f"{self.growth(self.worker_rss):+.2f}%",
            f"wall time {self.wall_s:.1f} s",
        ]
        return "\n".join(lines)


def epoch_batches(epoch: int) -> list[list[int]]:
    """The batches the loader's sampler gives in ``epoch``."""
    sampler = RandomSampler(N, seed=SEED)
    sampler.set_epoch(epoch)
    return [list(b) for b in BatchSampler(sampler, BATCH)]


def make_loader(marker_dir: str, timeout: float) -> aioloader.DataLoader:
    return aioloader.DataLoader(
        fd.Armed(N, SHAPE, marker_dir),
        batch_size=BATCH,
        shuffle=True,
        seed=SEED,
        num_workers=2,
        persistent_workers=True,
        timeout=timeout,
        max_retries=1,
        collate_fn=fd.ArmedCollate(marker_dir),
    )


def _arm_epoch(marker_dir: str, expected: list[list[int]]) -> None:
    assert fd.armed(marker_dir) == [], "a fault of the last epoch never fired"
    fd.arm(marker_dir, expected[KILL_AT][3], fd.SIGKILL)
    fd.arm(marker_dir, expected[SEGV_AT][5], fd.SIGSEGV)
    fd.arm(marker_dir, f"collate-{expected[COLLATE_AT][0]}", fd.RAISE)
    fd.arm(marker_dir, expected[HANG_AT][2], fd.HANG)


async def _give_up_once(it: Any, epoch: int) -> None:
    """The consumer gives up on the batch it waits for (which hangs): an ``asyncio.timeout``
    around ``anext`` or a cancelled task, both ways a consumer stops waiting."""
    if epoch % 2 == 0:
        try:
            async with asyncio.timeout(GIVE_UP_S):
                await anext(it)
        except TimeoutError:
            return
        raise AssertionError("the hung batch arrived before its deadline")
    task = asyncio.ensure_future(anext(it))
    await asyncio.sleep(GIVE_UP_S)
    assert not task.done(), "the hung batch arrived before its deadline"
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return
    raise AssertionError("the cancelled wait did not end in CancelledError")


async def _one_epoch(loader: aioloader.DataLoader, epoch: int, broken: bool) -> fd.EpochRun:
    run = fd.EpochRun()
    it = aiter(loader)
    async with asyncio.timeout(fd.SCENARIO_TIMEOUT_S):
        while True:
            if len(run.order) == HANG_AT:
                await _give_up_once(it, epoch)
            try:
                batch = await anext(it)
            except StopAsyncIteration:
                break
            except Exception as exc:
                run.errors.append(exc)
                run.order.append(exc)
                continue
            run.batches.append(fd.batch_indices(batch))
            run.order.append(run.batches[-1][0])
            del batch
            if broken and len(run.order) == BREAK_AT + 1:
                break  # what `break` in `async for` does: the iterator is left, mid-epoch
    del it
    return run


async def _settle(loader: aioloader.DataLoader) -> None:
    """Wait (2 s at most) until the workers are done with the batches of the epoch just left.

    A ``break`` abandons the batches in flight; a worker already making one finishes it (only
    queued ones are withdrawn). Arming the next epoch's faults before then would let such a
    batch fire one of them: a fault spent on a batch nobody waits for, which the next epoch
    then never re-runs (seen as one retry short)."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        stats = loader.statistics()
        if not (stats.leased_shm_slots or stats.held_shm_slots or stats.in_flight):
            return
        gc.collect()
        await asyncio.sleep(0.01)
    stats = loader.statistics()
    raise AssertionError(
        f"the last epoch's batches were not done within 2 s: {stats.in_flight} in flight, "
        f"{stats.leased_shm_slots} slots leased, {stats.held_shm_slots} held"
    )


def _check_epoch(run: fd.EpochRun, expected: list[list[int]], broken: bool) -> None:
    [error] = run.errors
    assert isinstance(error, ValueError), repr(error)
    assert "injected collate failure" in str(error)
    notes = "\n".join(getattr(error, "__notes__", ()))
    assert f"while collating batch {COLLATE_AT} of indices {expected[COLLATE_AT]}" in notes, notes
    if broken:  # checked up to the break: none lost, none twice, in order
        expected = expected[: BREAK_AT + 1]
    fd.assert_exact(run, expected)


def _worker_rss(pids: Iterable[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):  # replaced between the listing and the read
            total += psutil.Process(pid).memory_info().rss
    return total


async def run_soak(epochs: int, marker_dir: str, *, deadline_s: float = 1.0) -> SoakFigures:
    """Run the soak (see the module docstring); every check fails with an ``AssertionError``."""
    figures = SoakFigures()
    me = psutil.Process()
    started = time.monotonic()
    async with make_loader(marker_dir, deadline_s) as loader:
        for epoch in range(epochs):
            expected = epoch_batches(epoch)
            broken = epoch % 3 == 1
            _arm_epoch(marker_dir, expected)
            run = await _one_epoch(loader, epoch, broken)
            _check_epoch(run, expected, broken)
            del run  # its error's traceback holds the iterator, and so the epoch and its batches
            assert fd.armed(marker_dir) == [], f"faults that never fired: {fd.armed(marker_dir)}"
            for kind in ("sigkill", "sigsegv", "collate", "hang", "cancel"):
                figures.faults[kind] = figures.faults.get(kind, 0) + 1
            if broken:
                figures.faults["break"] = figures.faults.get("break", 0) + 1
                figures.broken_epochs += 1
            figures.epochs += 1
            gc.collect()
            await asyncio.sleep(0)  # the dropped iterator's closing runs on the loop
            await _settle(loader)  # before the next epoch's faults are armed
            figures.rss.append(me.memory_info().rss)
            figures.worker_rss.append(_worker_rss(loader.worker_pids))
        stats = loader.statistics()
        figures.restarts, figures.retries = stats.worker_restarts, stats.retries
        figures.timeouts = stats.timeouts
        deadline = time.monotonic() + 2.0  # a dropped epoch's batches go within 2 s
        while loader.statistics().held_shm_slots and time.monotonic() < deadline:
            gc.collect()
            await asyncio.sleep(0.02)
        assert loader.statistics().held_shm_slots == 0
        assert stats.live_shm_slots > 0, "the batches did not go through shared memory"
    figures.wall_s = time.monotonic() - started
    # Three worker deaths an epoch (the kill, the segfault, the hang), each batch re-run once;
    # more only if a batch slower than the deadline was re-run too (a loaded machine).
    assert figures.restarts >= 3 * epochs, figures.restarts
    assert figures.retries >= 3 * epochs, figures.retries
    assert figures.timeouts >= epochs, figures.timeouts
    return figures
