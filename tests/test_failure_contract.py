"""The failure contract's second round (RELIABILITY.md rows 41, 42, and the slot pool's
memory after a burst): a worker's reply pipe carrying garbage, ``close()`` interrupted and
called again, and the slots a burst leaves behind. A loader inherited through ``fork()`` (row
39) has ``test_forked_program.py``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import multiprocessing.process
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fault_datasets as fd
import pytest
from helpers import Baseline

import aioloader
from aioloader._shm._pool import KEEP_SPARE

# -- a worker's pipe carries garbage (row 41) -------------------------------------------------


@dataclass
class StrayWriter(fd.Faulty):
    """:class:`fault_datasets.Faulty` whose faulty index, on its first visit, forks a child
    that writes a traceback into the worker's pipes to the main process (``main_pid``), as a
    child that raises instead of calling ``os._exit`` would, then waits in the worker (a slow
    sample) until the loader ends it."""

    main_pid: int = 0

    def __getitem__(self, index: int) -> Any:
        marker_dir = self.marker_dir
        if index in self.faults and marker_dir and fd.claim_visit(marker_dir, index) == 0:
            _fork_a_stray_writer(self.main_pid)
            fd.fire(fd.HANG, index)  # only the loader's kill ends it
        return index


def _pipes(pid: int | str, flags: int) -> dict[int, str]:
    """``fd -> pipe:[inode]`` of the pipe ends process ``pid`` holds open with ``flags``."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own)
            target = os.readlink(f"/proc/{pid}/fd/{name}")
            with open(f"/proc/{pid}/fdinfo/{name}") as info:
                mode = int(info.read().split("flags:")[1].split()[0], 8) & os.O_ACCMODE
            if target.startswith("pipe:") and mode == flags:
                out[int(name)] = target
    return out


def _fork_a_stray_writer(main_pid: int) -> None:
    """Fork a child that writes garbage into this worker's reply pipe: a pipe it writes whose
    read end the main process holds (the stack pipe matches too: garbage there is harmless;
    the pipes other helpers read, such as the resource tracker's, do not)."""
    read_there = set(_pipes(main_pid, os.O_RDONLY).values())
    ours = [n for n, pipe in _pipes("self", os.O_WRONLY).items() if pipe in read_there]
    assert ours, "no pipe to the main process found"
    pid = os.fork()
    if pid == 0:  # the stray child
        try:
            for fd_ in ours:
                os.write(fd_, b"Traceback (most recent call last):\n  File ...\n" * 8)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


async def test_garbage_on_a_workers_pipe_fails_that_worker_which_is_replaced(
    tmp_path: Path,
) -> None:
    ds = StrayWriter(48, faults={21: fd.HANG}, marker_dir=str(tmp_path), main_pid=os.getpid())
    expected = fd.sequential_batches(48, 4)
    async with fd.make_loader(ds, timeout=30.0) as loader:
        run = await fd.run_epoch(aiter(loader))
        [err] = run.errors
        assert isinstance(err, aioloader.WorkerCrashedError)
        [(pid, fired_at)] = fd.visits(str(tmp_path), 21)
        text = str(err)
        assert f"(pid {pid}) was killed by the loader" in text, text
        assert "reply pipe carried a frame that cannot be valid" in text, text
        assert "os._exit" in text, text
        assert "while making batch 5" in text, text
        assert run.error_times[0] - fired_at < 2.0  # at once, not at the batch's timeout
        fd.assert_exact(run, expected)
        assert fd.wait_gone([pid]) == []
        assert loader.statistics().worker_restarts == 1

        again = await fd.run_epoch(aiter(loader))  # the replacement serves the next epoch
        assert again.errors == []
        assert again.batches == expected
        assert pid not in loader.worker_pids


async def test_garbage_on_a_workers_pipe_is_retried_under_max_retries(tmp_path: Path) -> None:
    ds = StrayWriter(48, faults={21: fd.HANG}, marker_dir=str(tmp_path), main_pid=os.getpid())
    async with fd.make_loader(ds, max_retries=1) as loader:
        run = await fd.run_epoch(aiter(loader))
    assert run.errors == []
    assert run.batches == fd.sequential_batches(48, 4)


# -- memory a loader keeps after a burst (issue: slots pinned until close) --------------------


async def test_a_dropped_burst_of_batches_gives_its_slots_back() -> None:
    # An evaluation pass that keeps every batch (list(loader)) grows the slot pool to one
    # segment per batch; once they are dropped, the loader keeps what an epoch in flight needs
    # (at most one per batch of prefetch), not all of them until close().
    ds = fd.Faulty(64, shape=(64, 1024))  # 64 KiB samples: batches of 256 KiB, in slots
    async with fd.make_loader(ds, prefetch=2) as loader:
        burst = [batch async for batch in loader]
        assert len(burst) == 16
        assert loader.statistics().held_shm_slots >= 12  # the burst is held in slots
        del burst
        gc.collect()
        stats = loader.statistics()
        # At most the slots leased at once (prefetch=2) and the consumer's spare ones.
        assert stats.live_shm_slots <= 2 + KEEP_SPARE, stats
        assert stats.held_shm_slots == stats.leased_shm_slots == 0

        again = await fd.run_epoch(aiter(loader))  # the next epoch runs on what was kept
        assert again.batches == fd.sequential_batches(64, 4)


# -- close() interrupted, then called again (row 42) -------------------------------------------


class _Interrupt:
    """Raises KeyboardInterrupt (as a second Ctrl-C would) at the ``at``-th blocking wait while
    armed: a thread's or a process's join, a future's result, an event's wait. Counts them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int) -> None:
        self.at, self.calls, self.armed, self.fired = at, 0, False, ""
        for owner, name in (
            (threading.Thread, "join"),
            (multiprocessing.process.BaseProcess, "join"),
            (concurrent.futures.Future, "result"),
            (threading.Event, "wait"),
        ):
            monkeypatch.setattr(owner, name, self._wrap(getattr(owner, name), name))

    def _wrap(self, real: Any, name: str) -> Any:
        def wait(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if self.armed:
                self.calls += 1
                if self.calls == self.at:
                    self.armed, self.fired = False, f"{type(obj).__name__}.{name}"
                    raise KeyboardInterrupt
            return real(obj, *args, **kwargs)

        return wait


def test_close_interrupted_at_each_blocking_step_is_finished_by_a_second_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before = Baseline.record()
    interrupted = []
    for at in range(1, 40):
        ds = fd.Faulty(16, shape=(64, 1024))
        loader = fd.make_loader(ds)
        assert [fd.batch_indices(b) for b in loader] == fd.sequential_batches(16, 4)
        with monkeypatch.context() as patch:
            hook = _Interrupt(patch, at)
            hook.armed = True
            try:
                loader.close()
            except KeyboardInterrupt:
                interrupted.append(hook.fired)
            hook.armed = False
        loader.close()  # finishes what the first left
        assert loader.worker_pids == ()
        if not hook.fired:
            break  # the first close ran through: every wait was interrupted once
    assert len(interrupted) >= 4, interrupted
    assert any("Process" in step for step in interrupted), interrupted  # joining the workers
    before.check()
