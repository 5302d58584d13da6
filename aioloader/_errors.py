"""The exception hierarchy of aioloader.

Errors raised by user code (a dataset's ``__getitem__``, a ``collate_fn``, a transform) are *not*
wrapped: they reach the training loop as their original type, with notes (``add_note``) naming
the batch and sample indices, so ``except KeyError`` keeps working. The classes below are for
what the loader itself detects::

    AioloaderError
    ├── LoaderTimeoutError          (also TimeoutError, RuntimeError) a batch missed its deadline
    ├── CollateError                (also ValueError)   samples that cannot form one batch
    │   ├── CollateTypeError        (also TypeError)    a type that cannot be collated or mixed
    │   └── CollateShapeError       (also RuntimeError) shapes, lengths or devices differ
    ├── WorkerError                 (also RuntimeError) a worker process misbehaved
    │   ├── WorkerCrashedError                           died: signal, exit code, pid
    │   └── WorkerInitError                              worker_init_fn or unpickling failed
    ├── SharedMemoryError           (also MemoryError)   /dev/shm too small or batch too large
    ├── TransferError                                    pinning or device copy failed
    ├── TooManyFailuresError                             on_error='skip' passed max_failures
    ├── ShardError                  (also ValueError)    a tar shard or Parquet file is corrupt
    └── RemoteError                 (also OSError)       a remote read failed for good
        ├── RemoteNotFoundError     (also FileNotFoundError)  404, no retry
        ├── RemotePermissionError   (also PermissionError)    401/403, no retry
        └── RetriesExhaustedError                             every attempt failed; lists them
            └── RemoteTimeoutError  (also TimeoutError)       ... and the last one timed out

Each error keeps its cause (``raise ... from exc``).

**torch's exception types are kept as extra bases**, so that code written against torch's
DataLoader still catches what it caught there: torch raises ``RuntimeError`` for a dead worker
and a timeout, ``TypeError`` for a type ``default_collate`` cannot handle, and ``RuntimeError``
for tensors or sequences of different sizes. Each class adds such a base; none is removed.
"""

from __future__ import annotations

import errno
import sys
from typing import Any

__all__ = [
    "AioloaderError",
    "CollateError",
    "CollateShapeError",
    "CollateTypeError",
    "DeviceUnavailableWarning",
    "LoaderTimeoutError",
    "RemoteError",
    "RemoteNotFoundError",
    "RemotePermissionError",
    "RemoteTimeoutError",
    "RetriesExhaustedError",
    "ShardError",
    "SharedMemoryError",
    "StreamOrderWarning",
    "TooManyFailuresError",
    "TransferError",
    "WorkerCrashedError",
    "WorkerError",
    "WorkerInitError",
    "out_of_descriptors_note",
    "timeout_error",
    "unpicklable_error",
]


class AioloaderError(Exception):
    """Base class of every error the loader itself raises."""


class LoaderTimeoutError(AioloaderError, TimeoutError, RuntimeError):
    """A batch was not produced within ``timeout`` seconds of producer time.

    Also a ``RuntimeError``, which torch's DataLoader raises for a timeout.
    """


class CollateError(AioloaderError, ValueError):
    """Samples cannot be collated into one batch (ragged shapes, missing keys, object dtypes)."""


class CollateTypeError(CollateError, TypeError):
    """A sample holds a type collation does not support (an object array, a set, a complex
    number), or samples hold types that cannot be combined (a string beside a number).

    Also a ``TypeError``, which torch's ``default_collate`` raises for these.
    """


class CollateShapeError(CollateError, RuntimeError):
    """Samples that must stack differ in shape, in length (sequences) or in device.

    Also a ``RuntimeError``, which torch raises for tensors or sequences of different sizes.
    """


class WorkerError(AioloaderError, RuntimeError):
    """A worker process failed in a way that is not an exception of user code.

    Also a ``RuntimeError``, which torch's DataLoader raises for a dead worker.
    """


class WorkerCrashedError(WorkerError):
    """A worker process died while it held a batch (signal, ``os._exit``, out of memory)."""

    def __init__(self, message: str, *, pid: int | None = None, exitcode: int | None = None):
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode


class WorkerInitError(WorkerError):
    """A worker could not start: ``worker_init_fn`` raised, or the dataset failed to unpickle."""


class SharedMemoryError(AioloaderError, MemoryError):
    """Shared memory could not be allocated (``/dev/shm`` full) or a batch exceeds the cap."""


class TransferError(AioloaderError):
    """Pinning a batch or copying it to the device failed."""


class TooManyFailuresError(AioloaderError):
    """With ``on_error='skip'``, more samples failed than ``max_failures`` allows.

    Attributes:
        batch_id: the batch that crossed the budget (delivered as this error instead).
        skipped: every index skipped in the epoch so far.
        undelivered: that batch's samples read successfully and not delivered: their indices,
            or their count where the indices are unknown (an iterable dataset's stream).
    """

    def __init__(
        self,
        message: str,
        *,
        batch_id: int | None = None,
        skipped: list[int] | None = None,
        undelivered: list[int] | int = 0,
    ) -> None:
        super().__init__(message)
        self.batch_id = batch_id
        self.skipped = skipped if skipped is not None else []
        self.undelivered = undelivered


class ShardError(AioloaderError, ValueError):
    """A shard could not be read to its end: a corrupt or truncated tar archive or Parquet
    file, or a read that failed for good. ``url`` names the shard; for a tar shard ``member``
    names the last member read (or None before the first), for a Parquet file ``row_group``
    the row group (None: its footer). The message says them, and the cause."""

    def __init__(
        self, message: str, *, url: str, member: str | None = None, row_group: int | None = None
    ) -> None:
        super().__init__(message)
        self.url = url
        self.member = member
        self.row_group = row_group

    def __reduce__(self) -> tuple[Any, ...]:
        return _shard_error, (str(self), self.url, self.member, self.row_group)


def _shard_error(
    message: str, url: str, member: str | None, row_group: int | None = None
) -> ShardError:
    return ShardError(message, url=url, member=member, row_group=row_group)


class RemoteError(AioloaderError, OSError):
    """A remote read failed and will not be retried further."""

    def __init__(self, message: str, *, url: str | None = None, attempts: tuple[str, ...] = ()):
        super().__init__(message)
        self.url = url
        self.attempts = attempts

    def __str__(self) -> str:
        # OSError's __str__ formats errno/strerror; ours is a plain message.
        return str(self.args[0]) if self.args else ""


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The remote object does not exist (HTTP 404, S3 NoSuchKey). Never retried."""


class RemotePermissionError(RemoteError, PermissionError):
    """Access to the remote object was refused (HTTP 401/403). Never retried."""


class RetriesExhaustedError(RemoteError):
    """Every attempt of a retryable remote read failed; ``attempts`` lists each one."""


class RemoteTimeoutError(RetriesExhaustedError, TimeoutError):
    """Every attempt failed and the last one timed out."""


class DeviceUnavailableWarning(UserWarning):
    """A device copy or pinning was requested but CUDA is not available; batches stay on CPU."""


class StreamOrderWarning(UserWarning):
    """Worker processes read an iterable dataset's stream in different orders. Each worker
    reads the whole stream and keeps its share, so the epoch loses and repeats items."""


# -- running out of file descriptors ---------------------------------------------------------


def out_of_descriptors_note(exc: BaseException, where: str) -> str | None:
    """The note to add to ``exc`` if it (or its cause) is the process running out of file
    descriptors, else None. The error keeps its type (an ``OSError``); the note names
    ``where`` (the batch, or the worker start-up) and the fix.

    A live batch holds no descriptor (see :mod:`aioloader._shm`), so whatever used them up is
    something else: files a dataset opens and keeps, sockets, or workers starting (about ten
    each: pipes and locks). The usual fix is a higher limit.
    """
    seen = 0
    cause: BaseException | None = exc
    while cause is not None and seen < 8:  # a cause chain is short; a cycle must not hang
        if isinstance(cause, OSError) and cause.errno == errno.ENFILE:
            return (
                f"{where}: the system's table of open files is full (fs.file-max); "
                "`ulimit -n` does not help, closing files elsewhere does"
            )
        if isinstance(cause, OSError) and cause.errno == errno.EMFILE:
            return (
                f"{where}: this process has no file descriptor left (the limit is "
                f"{_nofile_limit()}). A batch the loader handed out holds none; open files, "
                "sockets and worker start-up (about ten per worker) use them. Raise the limit: "
                "`ulimit -n 4096` in the shell, or resource.setrlimit(resource.RLIMIT_NOFILE, "
                "...) before creating the loader"
            )
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    return None


def _nofile_limit() -> str:
    if sys.platform == "win32":  # pragma: no cover
        return "unknown"
    import resource

    return str(resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def timeout_error(
    batch_id: int,
    what: str,
    waited: float,
    timeout: float | None,
    pid: int | None,
    advice: str = "Try a larger timeout, more workers, or max_retries to re-run a batch whose "
    "worker hung.",
) -> LoaderTimeoutError:
    """The error of a batch that missed its deadline, with what to try."""
    killed = f"; worker pid {pid} was killed and replaced" if pid is not None else ""
    return LoaderTimeoutError(
        f"batch {batch_id} ({what}) was not ready after {waited:.2f} s "
        f"(timeout={timeout}){killed}. {advice}"
    )


def unpicklable_error(name: str, obj: Any, exc: BaseException) -> TypeError:
    """The error for ``obj`` (the argument ``name``), which cannot be pickled for the workers
    (``exc``), with the fix its cause needs."""
    if isinstance(exc, TypeError) and str(exc).startswith("cannot pickle '"):
        # A handle (an open file, a lock, a connection): torch's workers fork on Linux and
        # inherit it; ours get a pickled copy of the dataset.
        fix = (
            "It holds an object that cannot be copied to another process: open it in each "
            "worker instead, lazily at the first __getitem__ (or in worker_init_fn), or use "
            "thread_pool=True"
        )
    elif "shared between processes through inheritance" in str(exc):
        # A multiprocessing Value, Array, Lock or Queue: it reaches only the processes started
        # with it, and the dataset copy is sent to running workers.
        fix = (
            "It holds a multiprocessing object (a Value, Array, Lock or Queue), which reaches "
            "only processes started with it: torch's forked workers inherit it, ours get a "
            "copy of the dataset. Share state through a tensor in torch's shared memory "
            "(share_memory_()) or an np.memmap opened 'r+': they reach the workers as "
            "references, and writes are seen both ways. Or use thread_pool=True"
        )
    else:
        # Lambdas and local functions travel by value already: what is left cannot be pickled.
        fix = (
            "It cannot be pickled, even by value: give it (or what it holds) a __reduce__ or "
            "__getstate__ that leaves the unpicklable part out, or use thread_pool=True"
        )
    return TypeError(f"{name}={obj!r} cannot be sent to worker processes: {exc}. {fix}")
