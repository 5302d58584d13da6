"""How a worker's end is read: waiting for its exit status, and saying what it means."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from typing import Any

__all__ = ["EXIT_STATUS_WAIT_S", "describe_exit", "reap"]

# How long to wait for a dead worker's exit status (it names the signal that killed it). The
# status normally arrives within milliseconds.
EXIT_STATUS_WAIT_S = 1.0


def reap(executor: ProcessPoolExecutor, process: Any) -> None:
    """Wait (bounded) until a broken executor's manager thread has reaped its dead process.

    A forkserver child's exit status is read from a pipe, once: a second reader at the same
    time gets EOF and records 255 instead of the signal. Blocking: :meth:`._pool.WorkerPool.submit`
    runs it in a thread before the crash is looked at.
    """
    manager = getattr(executor, "_executor_manager_thread", None)
    if manager is not None and manager is not threading.current_thread():
        manager.join(timeout=EXIT_STATUS_WAIT_S)
    if process is not None:
        process.join(timeout=EXIT_STATUS_WAIT_S)


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        text = f"was killed by {name}"
        if -exitcode == signal.SIGKILL:
            text += " (often the out-of-memory killer: check `dmesg`, lower batch size or workers)"
        return text
    return f"exited unexpectedly with code {exitcode}"
