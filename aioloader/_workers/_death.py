"""A worker's death: how it is seen, what its error says, what happens to its jobs.

How it is seen. A worker's death normally shows first as end-of-file on its reply pipe
(``_channel``): every job it held then fails with ``BrokenProcessPool``. That fails when another
process still holds the pipe's write end open: a sibling under ``fork`` that inherited it, or a
child the dataset forked in the worker. :class:`ExitWatch` is the backstop: one thread per pool
that waits on every live worker's sentinel (a descriptor that becomes readable when the process
ends) and reports each exit once. A reply pipe that carries a frame that cannot be valid (bytes
a process forked in the worker wrote into it: ``_frames.reply_header_fault``) fails the worker as
a death would, though it may be alive: it is killed as the channel sees the garbage
(:func:`kill_corrupt`, the pool's hook on its channel), and a job given up while it ran is
released only once that death is seen, as it may write into the job's slot until then. Its exit
status, which names the killing signal, is read once (:meth:`Deaths.reap`), off the event loop.

What its error says. :class:`Crash` is what the pool records of one worker's death, once per
process (every job the worker held asks for it): which worker and pid, how it ended
(:func:`describe_exit`), which job it ran (the tag it published, ``_records.running_tag``),
whether the loader killed it and why::

    the worker's pipe ─ EOF / corrupt ─┐
    its sentinel ─ readable (ExitWatch) ┴▶ every job it held: BrokenProcessPool
                                            └▶ WorkerPool.submit: Deaths.reap (off the loop),
                                               Deaths.crashed(w): one Crash, the worker replaced
                                               └▶ Crash.error(batch, tag) for each job

What happens to its jobs (:meth:`Crash.error`):

- the job it ran (its culprit) fails with :class:`~aioloader.WorkerCrashedError` naming batch,
  worker, pid and signal;
- a job only queued behind it did nothing wrong: it goes to the replacement, unless it is a
  stream's, which only that worker's iterator could make (then it fails, saying so);
- a worker that dies before it answered any job, :data:`MAX_START_FAILURES` times in a row,
  fails its jobs with :class:`~aioloader.WorkerInitError` rather than loop through process
  starts; one killed because it hung while starting fails them with its stack (``_starting``);
- a worker the loader killed (a batch past its deadline) is not blamed for the jobs queued
  behind it, including a retry of the hung batch itself;
- a job given up while its worker runs it (its epoch ended) is watched by
  :func:`watch_abandoned`: past the batch deadline its worker is killed, as nothing else would
  free the jobs queued behind it.

Sharp edges:
- A forkserver child's exit status is read from a pipe, once: a second reader at the same time
  gets end-of-file and records 255 instead of the signal. So it is read under one lock per pool
  (:meth:`Deaths.reap`, :meth:`Deaths.join`), and the forked server's Popen keeps a status once
  read (``_zygote._Popen.poll``).
- Reading the status waits (bounded) for the process: the pool does it off the loop, then the
  bookkeeping on it, so no other job's submit races with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection
from typing import TYPE_CHECKING, Any

from .._errors import WorkerCrashedError, WorkerInitError
from .._log import workers_log
from .._stats import current_counters
from ._starting import Hang

if TYPE_CHECKING:
    from ._launch import Worker

__all__ = [
    "EXIT_STATUS_WAIT_S",
    "MAX_START_FAILURES",
    "Crash",
    "Deaths",
    "ExitWatch",
    "describe_exit",
    "kill_corrupt",
    "reap",
    "watch_abandoned",
]

# How long to wait for a dead worker's exit status (it names the signal that killed it). The
# status normally arrives within milliseconds.
EXIT_STATUS_WAIT_S = 1.0

# How many times in a row a worker may die before it ran any job (an import or unpickling that
# crashes the interpreter, the OOM killer at start-up) before its jobs fail with
# WorkerInitError instead of being resubmitted to yet another fresh worker. Higher: more
# patience with a transient start-up fault; lower: a worker that can never start is reported
# sooner. Each try costs one process start.
MAX_START_FAILURES = 3


# -- how a death is seen ---------------------------------------------------------------------


class ExitWatch:
    """A thread that calls ``on_exit()`` once for each watched process that ends.

    It only waits for a process's sentinel to become readable; it never reads the exit status
    (:func:`reap` does). A process stays referenced here while it is waited on, so its
    sentinel is not closed under the wait.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[Any, Callable[[], None]]] = {}  # by sentinel
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, process: Any, on_exit: Callable[[], None]) -> None:
        """Watch ``process`` (started): ``on_exit()`` runs in the watch's thread when it ends."""
        with self._lock:
            if self._closed:
                return
            self._watched[process.sentinel] = (process, on_exit)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="aioloader-exits", daemon=True
                )
                self._thread.start()
        self._wake()

    def discard(self, process: Any) -> None:
        """Stop watching ``process`` (it was replaced, or is about to be closed)."""
        with self._lock:
            self._watched.pop(process.sentinel, None)
        self._wake()

    def close(self) -> None:
        """Stop the thread (wait for it) and forget every process. Idempotent in effect: a
        call interrupted while it waits for the thread is finished by the next one."""
        with self._lock:
            self._closed = True
            thread = self._thread
            self._watched.clear()
            if self._wake_r < 0:
                return  # done already
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        with self._lock:
            fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # closed, or full: a wake-up is pending anyway
            os.write(self._wake_w, b"w")

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                watched = dict(self._watched)  # holds the processes while they are waited on
            ready = connection.wait([self._wake_r, *watched])
            for fd in ready:
                assert isinstance(fd, int)  # only descriptors are waited on
                if fd == self._wake_r:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                    continue
                with self._lock:
                    entry = self._watched.get(fd) if not self._closed else None
                    if entry is not None and entry[0] is watched[fd][0]:
                        del self._watched[fd]
                    else:
                        entry = None  # replaced meanwhile by a process reusing the number
                if entry is not None:
                    entry[1]()


def reap(process: Any, lock: threading.Lock) -> None:
    """Wait (bounded) for ``process``'s exit status, once it is dead or dying, under ``lock``
    (its pool's): see the module's sharp edges. Blocking."""
    if process is not None:
        with lock:
            process.join(timeout=EXIT_STATUS_WAIT_S)


def kill_corrupt(w: Worker, why: str) -> None:
    """SIGKILL worker ``w``, whose reply pipe carried garbage (``why``): it may be well, but
    nothing it writes can be read any more, and a stray writer may still hold the pipe. Done
    as the channel finds the garbage, on the event loop, while the process cannot have been
    reaped (its pid not yet reused), not when a job next goes to it: meanwhile it may run a
    job given up, writing into that job's slot. Its death is then seen like any other (the
    job it ran is its culprit)."""
    process = w.process
    if process is None or process.pid is None:
        return
    workers_log.warning("worker process pid %d killed: its reply pipe carried %s", process.pid, why)
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGKILL)


# -- what its error says ---------------------------------------------------------------------


def describe_exit(exitcode: int | None) -> str:
    """How a worker ended, from its exit code (negative: the signal; None: unknown)."""
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


@dataclass(frozen=True, slots=True)
class Crash:
    """One worker's death, as its jobs learn of it.

    Attributes:
        worker_id: the worker's number.
        pid: the dead process's pid, if it had started.
        exitcode: its exit code (negative: the signal), None if it could not be read.
        culprit: the tag (:func:`._records.running_tag`) of the job it was running, if any.
        failed_starts: the worker's consecutive deaths before answering any job.
        hang: why it was killed while it started, if it was.
        killed: the loader killed it, for a job that ran past its deadline.
        corrupt: the loader killed it because its reply pipe carried a frame that cannot be
            valid (what was wrong with it).
    """

    worker_id: int
    pid: int | None
    exitcode: int | None
    culprit: int | None
    failed_starts: int = 0
    hang: Hang | None = None
    killed: bool = False
    corrupt: str | None = None

    def error(self, batch_id: int, tag: int, *, resubmit_innocent: bool) -> BaseException | None:
        """What the job tagged ``tag`` (making ``batch_id``) gets for this death; None: it
        goes to the replacement worker (see the module docstring)."""
        if self.hang is not None:
            return WorkerInitError(self.hang.message(batch_id))
        if self.culprit is None and self.failed_starts >= MAX_START_FAILURES:
            return start_error(self, batch_id)
        if self.culprit != tag and resubmit_innocent:
            return None
        return crash_error(self, batch_id, ran=self.culprit == tag)


def crash_error(crash: Crash, batch_id: int, *, ran: bool = True) -> WorkerCrashedError:
    """The error of ``batch_id``, lost with its worker: the job the worker was running when it
    died, or (``ran=False``) one queued behind it that cannot go to another worker (a
    stream's: only that worker's iterator knows where the stream stands)."""
    if crash.corrupt is not None:
        how = (
            f"was killed by the loader: its reply pipe carried {crash.corrupt} (most likely "
            "a process forked in the worker, by the dataset or a library it calls, that wrote "
            "into the pipe it inherited; such a child must end with os._exit, never return or "
            "raise)"
        )
    elif crash.killed:
        how = "was killed by the loader (a batch it ran was past its deadline)"
    else:
        how = describe_exit(crash.exitcode)
    what = (
        f"while making batch {batch_id}"
        if ran
        else f"while batch {batch_id} waited behind another job (a stream's batch is not "
        "re-sent to another worker: only this worker's iterator knew where its stream stood)"
    )
    return WorkerCrashedError(
        f"worker {crash.worker_id} (pid {crash.pid}) {how} {what}; "
        "the worker was replaced and the loader can go on",
        pid=crash.pid,
        exitcode=crash.exitcode,
    )


def start_error(crash: Crash, batch_id: int) -> WorkerInitError:
    """The error of ``batch_id`` when its worker keeps dying before it ran any job."""
    how = describe_exit(crash.exitcode)
    return WorkerInitError(
        f"worker {crash.worker_id} (pid {crash.pid}) {how} before it ran any job, "
        f"{crash.failed_starts} times in a row, so batch {batch_id} was not run: the worker "
        "cannot start. Check what a worker does at start: unpickling the dataset, "
        "worker_init_fn, the imports they trigger, and the memory they need."
    )


# -- what happens to its jobs ----------------------------------------------------------------


class Deaths:
    """A pool's record of its workers' deaths: the watch on their exits, their exit statuses
    (read once), and one :class:`Crash` per worker process, whose recording replaces it.

    Args:
        current: the cells in which each worker publishes the tag of the job it runs
            (``_records.Cells.current``).
        replace: gives worker ``w`` a new process's pipes once its death is recorded (the
            pool's rebuild).
    """

    def __init__(self, current: Any, replace: Callable[[Worker], None]) -> None:
        self.exits = ExitWatch()
        self._current = current
        self._replace = replace
        self._lock = threading.Lock()  # exit statuses are read once (see the module doc)
        self._crashes: dict[tuple[int, int], Crash] = {}  # by (worker, generation)

    def reap(self, process: Any) -> None:
        """Wait (bounded) for dead ``process``'s exit status. Blocking: off the loop."""
        reap(process, self._lock)

    def join(self, process: Any, timeout: float) -> None:
        """``process.join(timeout)``, its exit status read under the one lock."""
        with self._lock:
            process.join(timeout=timeout)

    def crashed(self, w: Worker, generation: int) -> Crash:
        """The death of ``w``'s process of ``generation``: recorded the first time (it names
        the job the worker ran, and whether it died while starting), then ``w`` replaced.
        Reap it first, off the loop (:meth:`reap`): here it must not wait."""
        key = (w.id, generation)
        crash = self._crashes.get(key)
        if crash is not None:
            return crash
        process = w.process
        pid = getattr(process, "pid", None)
        self.reap(process)  # returns at once: reaped already, off the loop
        exitcode = process.exitcode if process is not None else None
        culprit: int | None = int(self._current[w.id])  # the running job's tag, 0 for none
        self._current[w.id] = 0
        if w.killed:
            # We killed it for hanging: that batch was already reported by its deadline, and
            # a retry of it, submitted here before the death was noticed, is innocent.
            culprit = None
        elif culprit is not None and culprit <= 0:
            culprit = None
        if culprit is None and not w.served and not w.killed:
            w.failed_starts += 1  # it died before it answered anything: while starting
        else:
            w.failed_starts = 0
        corrupt = w.channel.corrupt
        crash = Crash(w.id, pid, exitcode, culprit, w.failed_starts, w.hang, w.killed, corrupt)
        self._crashes[key] = crash
        self._replace(w)
        return crash


def watch_abandoned(w: Worker, job_id: int, tag: int, after: float, current: Any) -> None:
    """Watch job ``job_id`` of worker ``w``'s current process, given up while the worker runs
    it: once it has run ``after`` seconds (at least), kill the process. On the event loop of
    the job's pipes.

    A batch's deadline (``aioloader._epoch._deadline``) is watched by the task that awaits the
    batch. When its epoch is left (a ``break``, the iterator dropped), those tasks are
    cancelled: the jobs still queued are withdrawn (``Channel.abandon``), but a job a worker
    already runs goes on, since only killing the process could stop it. If such a job hangs,
    no deadline watches it any more, and the jobs queued behind it on that worker (the next
    epoch's, another loader's on a shared pool) wait for ever: their own deadlines count from
    when their batch starts running, which it never does. So it is watched here: seen running
    at one look and still running at the next, a deadline later, its worker is killed as a
    hung batch's is; the jobs queued behind it are not to blame, and go to the replacement.
    The kill counts in the ``timeouts`` of the loader that gave the batch up, at the time of
    the kill: in the figures of the epoch running then (the given-up one has ended).

    Args:
        w: the worker the job was sent to.
        job_id: the job (its channel's id).
        tag: what the worker publishes in ``current`` while it runs the job.
        after: the batch deadline, seconds.
        current: the pool's cells of running tags (``_records.Cells.current``).
    """
    loop = asyncio.get_running_loop()
    generation, channel, process = w.generation, w.channel, w.process
    counters = current_counters.get()  # the giving-up loader's: this runs in its task
    seen_running = False

    def pending() -> bool:
        return w.generation == generation and w.channel is channel and not channel.answered(job_id)

    def look() -> None:
        nonlocal seen_running
        if w.process is not process or not pending():
            return  # the worker is done with it, or gone (closing the pool fails every job)
        # The tag is this job's own: each attempt has one (see _records.running_tag).
        running = int(current[w.id]) == tag
        if running and seen_running:
            pid = w.kill()
            if pid is not None:
                if counters is not None:
                    counters.timeouts += 1  # a missed deadline, as a watched batch's
                workers_log.warning(
                    "worker process pid %d killed: a batch given up by its epoch ran past the "
                    "%s s deadline, holding up the jobs queued behind it",
                    pid,
                    after,
                )
            return
        seen_running = running
        loop.call_later(after, look)

    loop.call_later(after, look)
