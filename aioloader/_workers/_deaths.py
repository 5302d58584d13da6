"""What a dead worker's error says: which worker, which pid, how it died, what it was doing.

:class:`Crash` is what the pool records of one worker's death, once (every job the worker held
asks for it); :func:`crash_error` and :func:`start_error` turn it into the error the job gets.
How the process ended is read and said by :mod:`._exits`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import WorkerCrashedError, WorkerInitError
from ._exits import describe_exit
from ._starting import Hang

__all__ = ["Crash", "crash_error", "start_error"]


@dataclass(frozen=True, slots=True)
class Crash:
    """One worker's death, as its jobs learn of it.

    Attributes:
        worker_id: the worker's number.
        pid: the dead process's pid, if it had started.
        exitcode: its exit code (negative: the signal), None if it could not be read.
        culprit: the tag (:func:`._wire.running_tag`) of the job it was running, if any.
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
