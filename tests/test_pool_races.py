"""Races of the worker pool (``_workers._pool``) with its workers and with other threads: a
close from another thread while a dead worker is replaced, a reply pipe that turns corrupt
while a given-up job still runs, and a worker that dies between making a batch and writing
its reply.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fault_datasets as fd
import psutil
import pytest
from helpers import open_fds
from test_failure_contract import _fork_a_stray_writer

from aioloader import WorkerCrashedError, _workers
from aioloader._workers import _channel, _pool
from aioloader._workers._channel import Channel

pytestmark = pytest.mark.usefixtures("baseline")


def echo(x: Any) -> tuple[int, Any]:
    """A job: this worker's pid, and what it was given."""
    return os.getpid(), x


# -- a close from another thread while a worker is replaced ----------------------------------


async def test_a_close_racing_a_workers_replacement_leaves_no_pipe_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A worker dies; as the pool makes its replacement's pipes, another thread closes the pool
    # (the fault: that close is started at that very moment, and given a second to finish).
    # Either the close comes first and no pipes are made, or it closes the new ones: none may
    # stay open for the pool's life.
    pool = _workers.WorkerPool(1, _workers.resolve_context(None, allow_fork=False), 0)
    closing = threading.Thread(target=pool.close, name="test-close")
    real_open = _channel.open_channel

    def open_while_closed(*args: Any) -> Any:
        if not closing.is_alive() and closing.ident is None:
            closing.start()
            closing.join(1.0)  # a close that waits for this replacement cannot end here
        return real_open(*args)

    try:
        async with asyncio.timeout(30.0):
            await pool.submit(echo, 1, batch_id=0, worker=0)  # the worker is up
            before = open_fds()  # the start method's server's pipes among them
            monkeypatch.setattr(_pool, "open_channel", open_while_closed)
            with pytest.raises(WorkerCrashedError):
                await pool.submit(os._exit, 3, batch_id=1, worker=0, resubmit_innocent=False)
            assert closing.ident is not None  # the replacement's pipes were asked for
            await asyncio.to_thread(closing.join, 30.0)
            assert not closing.is_alive()
            assert pool.closed
    finally:
        await asyncio.to_thread(pool.close)
    assert await _new_pipes(before) == []  # the new worker's pipes were closed too


async def _new_pipes(before: dict[int, str], grace_s: float = 5.0) -> list[str]:
    """The pipes this process holds that it did not hold ``before``, once none is left or
    ``grace_s`` passed."""
    deadline = time.monotonic() + grace_s
    while True:
        new = [name for fd, name in open_fds().items() if before.get(fd) != name]
        pipes = [name for name in new if name.startswith("pipe:")]
        if not pipes or time.monotonic() > deadline:
            return pipes
        await asyncio.sleep(0.05)


# -- a reply pipe that carries garbage while a given-up job runs (RELIABILITY.md row 41) -----

# How long the given-up job below would go on writing if nothing killed its worker: far past
# every bound the test waits.
_WRITES_FOR_S = 10.0


def garbage_while_given_up(arg: tuple[int, str]) -> str:
    """A job (in a worker): say it runs, wait until the main process gave it up, then "write
    the batch" (a line per write, with its time) for :data:`_WRITES_FOR_S`, as a job whose
    slot the main process must not reuse yet; after the first write, a child forked here
    writes garbage into this worker's reply pipe."""
    main_pid, marker_dir = arg
    markers = Path(marker_dir)
    (markers / "running").touch()
    deadline = time.monotonic() + 30.0
    while not (markers / "given-up").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    end = time.monotonic() + _WRITES_FOR_S
    while time.monotonic() < end:
        with open(markers / "writes", "a") as f:
            f.write(f"{time.time()!r}\n")
        if not (markers / "stray").exists():
            (markers / "stray").touch()
            _fork_a_stray_writer(main_pid)
        time.sleep(0.01)
    return "done"


def _gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


async def _until(done: Any, bound_s: float) -> bool:
    """Poll ``done()`` until it is true or ``bound_s`` passed; its last answer."""
    deadline = time.monotonic() + bound_s
    while not done() and time.monotonic() < deadline:  # noqa: ASYNC110 - a condition, no event
        await asyncio.sleep(0.01)
    return bool(done())


async def test_garbage_on_the_pipe_of_a_worker_running_a_given_up_job_kills_it_before_release(
    tmp_path: Path,
) -> None:
    # An epoch gives a batch up while its worker runs it; then a child forked in the worker
    # writes garbage into the worker's reply pipe. The job's slot (on_abandon) may go back to
    # the pool only once the worker is dead: it is killed at once, with no other job routed to
    # it, and nothing it wrote comes after the release.
    pool = _workers.WorkerPool(1, _workers.resolve_context(None, allow_fork=False), 0)
    released: list[tuple[float, bool]] = []  # when, and whether the worker was gone then
    try:
        async with asyncio.timeout(30.0):
            pid, _ = await pool.submit(echo, 1, batch_id=0, worker=0)

            def on_abandon() -> None:
                released.append((time.time(), _gone(pid)))

            job = asyncio.create_task(
                pool.submit(
                    garbage_while_given_up,
                    (os.getpid(), str(tmp_path)),
                    batch_id=1,
                    worker=0,
                    on_abandon=on_abandon,
                )
            )
            assert await _until((tmp_path / "running").exists, 20.0)
            job.cancel()  # the epoch gives the batch up
            with pytest.raises(asyncio.CancelledError):
                await job
            (tmp_path / "given-up").touch()
            given_up = time.time()
            assert await _until(lambda: bool(released), 10.0), "the job was never released"
            [(at, gone)] = released
            assert gone, "released while its worker was still alive"
            assert at - given_up < _WRITES_FOR_S / 2  # killed: its job did not run to its end
            writes = [float(w) for w in (tmp_path / "writes").read_text().split()]
            assert writes
            assert max(writes) <= at

            new_pid, answer = await pool.submit(echo, 2, batch_id=2, worker=0)
            assert answer == 2
            assert new_pid != pid
    finally:
        await asyncio.to_thread(pool.close)


async def test_a_corrupt_channel_releases_given_up_jobs_only_once_the_worker_is_gone() -> None:
    # The worker's side of the pipes is held here: the test writes what a stray process would.
    replies_r, replies_w = os.pipe()
    requests_r, requests_w = os.pipe()
    seen: list[str] = []
    released: list[str] = []
    channel = Channel(replies_r, requests_w, lambda _, why: seen.append(why))
    try:
        given_up, _ = channel.send(echo, "given up")
        awaited, future = channel.send(echo, "awaited")
        channel.abandon(given_up, lambda: released.append("given up"))
        os.write(replies_w, b"Traceback (most recent call last):\n")
        async with asyncio.timeout(5.0):
            with pytest.raises(BrokenProcessPool, match="cannot be valid"):
                await future  # the job awaited fails at once
        assert len(seen) == 1
        assert "cannot be valid" in seen[0]
        channel.abandon(awaited, lambda: released.append("awaited"))  # its caller gives up
        assert released == []  # the worker may still be writing into their slots
        assert not channel.answered(given_up)
        channel.fail("the worker exited")  # its death is seen
        assert sorted(released) == ["awaited", "given up"]
        assert channel.answered(given_up)
        assert channel.answered(awaited)
    finally:
        channel.close()
        for fd in (replies_w, requests_r):
            os.close(fd)


# -- a worker that dies between making a batch and writing its reply -------------------------


@dataclass
class DiesBeforeItReplies(fd.Faulty):
    """:class:`fault_datasets.Faulty` whose faulty index, on its first visit, has its worker
    killed by SIGKILL (as the out-of-memory killer would) once the batch is made, as its
    reply is about to be written: the fault is injected into this worker's serve loop."""

    def __getitem__(self, index: int) -> Any:
        marker_dir = self.marker_dir
        if index in self.faults and marker_dir and fd.claim_visit(marker_dir, index) == 0:
            from aioloader._workers import _channel as worker_side

            def die_instead(fd_: int, parts: list[Any]) -> None:
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(fd.HANG_S)  # a signal is delivered asynchronously

            worker_side._writev_all = die_instead  # type: ignore[assignment]
        return index


async def test_a_worker_dead_before_its_reply_is_written_is_blamed_for_that_batch(
    tmp_path: Path,
) -> None:
    # The batch was made but its reply never left the worker: that batch is the crash's (a
    # WorkerCrashedError naming it), not a job that only waited behind another one and is
    # silently made again (a map job whose fetched bytes came in its slot would then read
    # the collated batch there as its bytes; a stream's would be said to have waited).
    ds = DiesBeforeItReplies(48, faults={21: fd.SIGKILL}, marker_dir=str(tmp_path))
    expected = fd.sequential_batches(48, 4)
    async with fd.make_loader(ds) as loader:
        run = await fd.run_epoch(aiter(loader))
        [err] = run.errors
        assert isinstance(err, WorkerCrashedError)
        [(pid, _)] = fd.visits(str(tmp_path), 21)
        text = str(err)
        assert f"(pid {pid}) was killed by SIGKILL" in text, text
        assert "while making batch 5" in text, text
        fd.assert_exact(run, expected)
        assert loader.statistics().worker_restarts == 1

        again = await fd.run_epoch(aiter(loader))  # the replacement serves the next epoch
        assert again.errors == []
        assert again.batches == expected
