"""Workers that hang while they start: the start deadline, the worker's stack, the report.

A worker starts in two steps, and either may hang: its process starts (the interpreter, the
start method's imports and unpickling, then :func:`._worker.init_worker`, which says the
worker is up in a shared array), and it loads its dataset copy (:func:`._worker.load_copy`:
unpickling the dataset, with the imports that brings, then ``worker_init_fn``), at its first
job and again at every epoch with ``persistent_workers=False``. A batch's own deadline cannot
see either: its job is only queued behind the start. So the pool watches the start itself
(``_pool``): a job waiting on a starting worker looks at the start's clock every
:data:`START_POLL_S`, and past the deadline the worker is asked for its stack, killed, and its
jobs fail with :class:`~aioloader.WorkerInitError` (no retry: a start that hung once will
most likely hang again, and each try would cost a whole deadline).

The clock of a load starts when the worker begins it (it publishes ``time.monotonic()`` in a
shared array: the clock is system-wide), not when it was sent: a worker finishing a batch of
an earlier epoch first is not starting yet. Nor does the clock of a process start before the
process could begin: its launch (until the start method gives it a process) has a deadline of
its own, :data:`LAUNCH_TIMEOUT_S` at least, as the standard forkserver's one-time start comes
first (``_launch``); past it, the jobs waiting fail (:func:`describe_launch`).

The stack: each worker registers ``faulthandler`` on :data:`~._worker.STACK_SIGNAL` to write
every thread's Python stack to a pipe of its own (:class:`StackPipe`). The handler runs in C,
so it answers even while the main thread is stuck in C code holding the GIL. Before the
initializer ran there is no handler (the signal would only kill the process): the report then
says so instead.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from ._worker import STACK_SIGNAL

__all__ = [
    "LAUNCH_TIMEOUT_S",
    "STACK_WAIT_S",
    "START_POLL_S",
    "Hang",
    "StackPipe",
    "describe_launch",
    "describe_start",
    "kill",
    "take_stack",
]

# How often a job waiting on a starting worker looks at the start deadline. Shorter: a hang is
# reported closer to its deadline; longer: fewer wake-ups while workers start (only then).
START_POLL_S = 0.25

# How long a worker's launch may take, until its start method gives it a process, when the start
# deadline is shorter: counted apart from it, as the first launch under the standard forkserver
# waits for the server's own start, once per program (a fresh interpreter importing aioloader,
# numpy and torch: about a second here, far more from a slow file system). Longer: more
# patience with that start; shorter: a server that never forks is reported sooner.
LAUNCH_TIMEOUT_S = 60.0

# How long a hung worker may take to write its stacks once asked, and how long the pipe must
# then stay quiet for the dump to count as complete. The handler writes it at once: these only
# bound a worker that does not answer (it hung before its initializer, or in the kernel).
STACK_WAIT_S = 1.0
_STACK_QUIET_S = 0.1

# The most of a stack dump kept for the error (deep recursion in many threads is long).
_STACK_MAX_BYTES = 32 << 10


class StackPipe:
    """The pipe a worker writes its stacks to: the read end stays here, the write end is
    handed to the worker process (and closed here once it started, with its other pipes)."""

    def __init__(self) -> None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        self._fd = r
        self._lock = threading.Lock()  # a read and the close never overlap
        self.child = Connection(w, readable=False)

    def read(self, wait_s: float) -> str:
        """What arrives within ``wait_s`` seconds, until the pipe was quiet a moment after the
        first bytes (blocking: call it off the event loop)."""
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + wait_s
        with self._lock:
            if self._fd < 0:
                return ""
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            while size < _STACK_MAX_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wait = min(left, _STACK_QUIET_S) if chunks else left
                if not poller.poll(wait * 1000):
                    if chunks:
                        break  # quiet after the dump: it is complete
                    continue
                try:
                    data = os.read(self._fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    break  # every writer closed it: the worker is gone
                chunks.append(data)
                size += len(data)
        return b"".join(chunks)[:_STACK_MAX_BYTES].decode("utf-8", "replace")

    def close(self) -> None:
        """Close both ends held here. Idempotent."""
        self.child.close()
        with self._lock:
            if self._fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._fd)
                self._fd = -1


def take_stack(pid: int, pipe: StackPipe) -> str:
    """Ask worker ``pid`` for its threads' stacks and return them ("" if none came)."""
    pipe.read(0)  # nothing should be there: drop it if there is
    try:
        os.kill(pid, STACK_SIGNAL)
    except ProcessLookupError:
        return ""
    return pipe.read(STACK_WAIT_S)


@dataclass(frozen=True, slots=True)
class Hang:
    """What a worker killed for hanging at start was doing, for every job it held.

    Attributes:
        head: "worker K (pid P) did not finish starting within ...: <what it was doing>".
        stack: its threads' Python stacks when it was killed ("" if none could be taken).
    """

    head: str
    stack: str

    def message(self, batch_id: int | None) -> str:
        """The :class:`~aioloader.WorkerInitError` message, naming ``batch_id`` if one waited."""
        held = f"; batch {batch_id} was not run" if batch_id is not None else ""
        stack = (
            f" Its Python stacks when it was killed:\n{self.stack.rstrip()}"
            if self.stack
            else " No Python stack could be taken from it."
        )
        return (
            f"{self.head}{held}. The worker was killed (a new one starts at the next batch). "
            "Check what a worker does at start: unpickling the dataset and the imports that "
            "brings (a slow or stuck file system), worker_init_fn; or give it more time with "
            f"start_timeout.{stack}"
        )


def describe_start(
    worker_id: int,
    pid: int | None,
    deadline: tuple[float, str],
    *,
    initialized: bool,
    loading_epoch: int | None,
) -> str:
    """The head of a :class:`Hang` report: the worker, its pid, the deadline ``(seconds, the
    setting that gave it)`` and what it was doing: starting its process (before the
    initializer ran), or loading the copy for ``loading_epoch``."""
    if not initialized:
        doing = (
            "its process had not started (the interpreter, the start method's imports and "
            "unpickling, before the loader's initializer ran in it)"
        )
    elif loading_epoch is not None:
        doing = (
            f"it was loading its dataset copy for epoch {loading_epoch} (unpickling the "
            "dataset, then worker_init_fn)"
        )
    else:
        doing = "it had not begun the jobs it was sent"
    seconds, setting = deadline
    return (
        f"worker {worker_id} (pid {pid}) did not finish starting within {seconds} s "
        f"({setting}): {doing}"
    )


def kill(pid: int) -> None:
    """SIGKILL ``pid`` if it still runs."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def describe_launch(
    worker_id: int, deadline: tuple[float, str], method: str, batch_id: int | None
) -> str:
    """The :class:`~aioloader.WorkerInitError` message of a launch that passed its deadline
    ``(seconds, the setting that gave them)``: worker ``worker_id`` got no process from its
    start method ``method``, so batch ``batch_id`` (if one waited) was not run."""
    seconds, setting = deadline
    held = f"; batch {batch_id} was not run" if batch_id is not None else ""
    server = (
        " The forkserver starts once per program, a fresh interpreter that imports aioloader, "
        "numpy and torch: check for a slow or stuck file system, or an import that hangs."
        if method == "forkserver"
        else ""
    )
    return (
        f"worker {worker_id} (no pid yet) was not launched within {seconds} s ({setting}): its "
        f"start method ({method}) did not give it a process{held}.{server} The launch goes on: a "
        "later batch gets the worker once it ends."
    )
