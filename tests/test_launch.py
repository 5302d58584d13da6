"""Worker processes without an executor: the forked server's deferred pid, launches in worker
order, a launch that fails, and the watch on the workers' exits.

The first check runs in a fresh interpreter: the server is forked once per process, and this
test process forked its own long ago (or could not, with threads running).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from aioloader import _workers
from aioloader._workers import _death

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
BOUND_S = 60.0

_SERVER = """
import os, sys, time
from aioloader._workers import _zygote

def leave(code):
    os._exit(code)

def sleep_then_leave():
    time.sleep(0.3)
    os._exit(5)

if __name__ == "__main__":
    context = _zygote.zygote_context()
    assert context is not None
    # Asked for two processes before reading either pid: both are forked, in that order.
    first = context.Process(target=leave, args=(3,))
    second = context.Process(target=sleep_then_leave)
    first.start()
    second.start()
    pids = [first.pid, second.pid]
    print("pids", all(pid > 0 for pid in pids), pids[0] != pids[1])
    # The sentinel's first message was the pid; what follows is the exit status.
    first.join(10)
    print("first", first.exitcode)
    print("second running", second.exitcode)
    second.join(10)
    print("second", second.exitcode)
    # A wait before the pid was read: it reads the pid first, then waits for the exit.
    third = context.Process(target=sleep_then_leave)
    third.start()
    third.join(0.05)
    print("third early", third.exitcode)
    third.join(10)
    print("third", third.exitcode, third.pid > 0)
"""


def test_the_forked_servers_processes_give_their_pid_then_their_exit_status(
    tmp_path: Path,
) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    path = tmp_path / "script.py"
    path.write_text(_SERVER)
    ran = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=BOUND_S
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        "pids True True",
        "first 3",
        "second running None",
        "second 5",
        "third early None",
        "third 5 True",
    ], ran.stdout


def _echo(x: Any) -> Any:
    return x


class _FailingOnce:
    """A context whose first process fails to start, as a fork refused (EAGAIN) would."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self.failures = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def Process(self, *args: Any, **kwargs: Any) -> Any:  # the context's own name
        if not self.failures:
            self.failures += 1
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return self._context.Process(*args, **kwargs)


async def test_a_launch_that_fails_reaches_the_job_and_the_next_job_launches_again() -> None:
    context = _FailingOnce(_workers.resolve_context(None, allow_fork=False))
    pool = _workers.WorkerPool(1, context, 0)  # type: ignore[arg-type]
    try:
        with pytest.raises(BlockingIOError):
            await pool.submit(_echo, 1, batch_id=0)
        assert await asyncio.wait_for(pool.submit(_echo, 2, batch_id=1), BOUND_S) == 2
        assert context.failures == 1
        assert len(pool.pids()) == 1
    finally:
        await asyncio.to_thread(pool.close)


async def test_jobs_sent_while_another_thread_launches_wait_in_the_pipe() -> None:
    # The loader's starter thread launches the workers while the first epoch's jobs are sent.
    pool = _workers.WorkerPool(2, _workers.resolve_context(None, allow_fork=False), 0)
    try:
        launching = threading.Thread(target=pool.launch)
        launching.start()
        results = await asyncio.wait_for(
            asyncio.gather(*(pool.submit(_echo, i, batch_id=i) for i in range(6))), BOUND_S
        )
        launching.join(BOUND_S)
        assert results == list(range(6))
        assert len(set(pool.pids())) == 2
    finally:
        await asyncio.to_thread(pool.close)


def _sleep_forever() -> None:
    time.sleep(3600)


def test_the_exit_watch_reports_each_exit_once_and_forgets_what_it_discards() -> None:
    context = multiprocessing.get_context("spawn")
    watch = _death.ExitWatch()
    ended: list[str] = []
    done = threading.Event()
    kept, dropped = context.Process(target=_sleep_forever), context.Process(target=_sleep_forever)
    kept.start()
    dropped.start()
    try:

        def on_exit(name: str) -> None:
            ended.append(name)
            done.set()

        watch.add(kept, lambda: on_exit("kept"))
        watch.add(dropped, lambda: on_exit("dropped"))
        watch.discard(dropped)
        dropped.kill()
        dropped.join(BOUND_S)
        kept.kill()
        assert done.wait(BOUND_S)
        time.sleep(0.2)  # a second report, or one of the discarded process, would come now
        assert ended == ["kept"]
    finally:
        watch.close()
        for process in (kept, dropped):
            if process.is_alive():
                process.kill()
            process.join(BOUND_S)
    assert not any(t.name == "aioloader-exits" and t.is_alive() for t in threading.enumerate())
