"""The wire between the main process and one worker: two pipes carrying length-prefixed pickles.

Why not the executor's own queues: a ``ProcessPoolExecutor`` job crosses three threads of the
main process on its way (the caller, the queue's feeder thread, the executor's manager thread)
and a fourth hop back to the event loop. Measured on 2 cores with a 2 KB payload, that costs
~200 us of main-process CPU per job and caps two workers at ~4,500 trivial jobs/s, the whole
budget of a tiny batch. The executor still owns each worker process (start, initializer, death
detection); it runs one long job, :func:`serve`, and the batches travel here instead:

- main side, :class:`Channel`: non-blocking pipe ends watched by the event loop itself
  (``add_reader`` / ``add_writer``), no thread, no hop: ~25 us of CPU per job;
- worker side, :func:`serve`: a blocking loop that runs one job at a time.

A frame is a fixed header ``(payload length, job id, kind)`` and a pickle. Requests are jobs
``(fn, arg)`` or cancellations; replies are a result, an error ``(exception, traceback text)``,
or "cancelled" (the job was dropped before it ran). A worker that dies closes its pipe: the
main side sees end-of-file at once and fails every job the worker held with
``BrokenProcessPool``.

Sharp edges:
- Pipe ends are bound to one event loop at a time. A loader iterated first synchronously (on
  its private loop) and later with ``async for`` moves them, which is only allowed while no job
  is pending.
- A cancelled job still in the worker's pipe is skipped when the worker reaches it; one it has
  started runs to the end. Either way the canceller learns when the worker is done with it
  (``on_abandon``), so a shared-memory slot is never reused while a worker may write into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import select
import struct
import threading
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

__all__ = ["Channel", "RemoteTraceback", "picklable", "serve"]

_HEADER = struct.Struct("<QQB")  # payload length, job id, kind

# Request kinds.
_JOB = 0
_CANCEL = 1
# Reply kinds.
_RESULT = 0
_ERROR = 1
_CANCELLED = 2

# Largest single read. Replies are small descriptors unless a batch travels inline.
_READ_CHUNK = 1 << 20

# How long moving a channel off a loop that runs in another thread may wait for that loop.
_DETACH_WAIT_S = 5.0


class RemoteTraceback(Exception):
    """The worker's traceback text, attached as ``__cause__`` of an exception it raised."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def picklable(exc: BaseException) -> BaseException:
    """``exc`` itself if it survives pickling, else a RuntimeError that tells what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        text = "".join(traceback.format_exception(exc))
        replacement = RuntimeError(
            f"{type(exc).__module__}.{type(exc).__qualname__}: {exc} "
            f"(the exception could not be pickled; its traceback follows)\n{text}"
        )
        for note in getattr(exc, "__notes__", ()):
            replacement.add_note(note)
        return replacement
    return exc


# -- worker side -----------------------------------------------------------------------------


def serve(rfd: int, wfd: int) -> None:
    """Run jobs read from ``rfd`` and write their replies to ``wfd`` until ``rfd`` closes.

    Before each job it drains whatever else has arrived, so a cancellation sent while the job
    waited in the pipe is seen in time to skip it.
    """
    os.set_blocking(rfd, False)
    inbox = bytearray()
    queue: deque[tuple[int, bytes]] = deque()
    cancelled: set[int] = set()
    while True:
        if not queue:
            select.select([rfd], [], [])
        if _drain(rfd, inbox):
            return  # the main process closed the channel: it wants no more replies
        for job_id, kind, payload in _frames(inbox):
            if kind == _CANCEL:
                cancelled.add(job_id)
            else:
                queue.append((job_id, payload))
        if not queue:
            continue
        job_id, payload = queue.popleft()
        if job_id in cancelled:
            cancelled.discard(job_id)
            _write_all(wfd, _frame(job_id, _CANCELLED, b""))
            continue
        try:
            fn, arg = pickle.loads(payload)
            del payload
            kind, data = _RESULT, pickle.dumps(fn(arg), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # sent back, never raised here: the worker goes on
            kind, data = _ERROR, _dump_error(exc)
        try:
            _write_all(wfd, _frame(job_id, kind, data))
        except BrokenPipeError:
            return


def _dump_error(exc: BaseException) -> bytes:
    text = "".join(traceback.format_exception(exc))
    return pickle.dumps((picklable(exc), text), protocol=pickle.HIGHEST_PROTOCOL)


def _drain(fd: int, inbox: bytearray) -> bool:
    """Read what is there without blocking; True at end-of-file."""
    while True:
        try:
            chunk = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return False
        if not chunk:
            return True
        inbox += chunk


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _frame(job_id: int, kind: int, payload: bytes) -> bytes:
    return _HEADER.pack(len(payload), job_id, kind) + payload


def _frames(inbox: bytearray) -> list[tuple[int, int, bytes]]:
    """Take the complete frames off the front of ``inbox``."""
    out: list[tuple[int, int, bytes]] = []
    start = 0
    size = _HEADER.size
    with memoryview(inbox) as view:  # released before the buffer is resized below
        while len(inbox) - start >= size:
            length, job_id, kind = _HEADER.unpack_from(view, start)
            end = start + size + length
            if len(inbox) < end:
                break
            out.append((job_id, kind, bytes(view[start + size : end])))
            start = end
    if start:
        del inbox[:start]
    return out


# -- main side -------------------------------------------------------------------------------


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[Any]
    on_abandon: Callable[[], None] | None = None


class Channel:
    """The main process's end of one worker's pipes, driven by an event loop.

    Args:
        rfd: the read end of the worker's reply pipe (owned from now on).
        wfd: the write end of the worker's request pipe (owned from now on).
    """

    def __init__(self, rfd: int, wfd: int) -> None:
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        self._rfd = rfd
        self._wfd = wfd
        self._inbox = bytearray()
        self._outbox = bytearray()
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broken: str | None = None
        self._closed = False

    @property
    def pending(self) -> int:
        return len(self._pending)

    def send(self, fn: Callable[[Any], Any], arg: Any) -> tuple[int, asyncio.Future[Any]]:
        """Queue ``fn(arg)`` for the worker; returns the job id and the future of its result.

        Must run on the event loop. The future fails with ``BrokenProcessPool`` if the worker
        dies first, and with the job's own exception (its traceback text as ``__cause__``).
        """
        loop = asyncio.get_running_loop()
        if self._broken is not None or self._closed:
            raise BrokenProcessPool(self._broken or "the channel is closed")
        self._attach(loop)
        payload = pickle.dumps((fn, arg), protocol=pickle.HIGHEST_PROTOCOL)
        job_id = self._next_id
        self._next_id += 1
        future: asyncio.Future[Any] = loop.create_future()
        self._pending[job_id] = _Pending(future)
        self._write(_frame(job_id, _JOB, payload))
        return job_id, future

    def abandon(self, job_id: int, on_abandon: Callable[[], None] | None) -> None:
        """The caller no longer wants job ``job_id``. ``on_abandon`` runs once the worker is
        done with it: skipped, finished, or dead. Must run on the event loop."""
        pending = self._pending.get(job_id)
        if pending is None:  # already answered (or failed): the worker is done with it
            if on_abandon is not None:
                on_abandon()
            return
        if not pending.future.done():
            pending.future.cancel()
        pending.on_abandon = on_abandon
        if self._broken is None and not self._closed:
            self._write(_frame(job_id, _CANCEL, b""))

    def fail(self, reason: str) -> None:
        """The worker is gone: fail every pending job with ``BrokenProcessPool``. Must run on
        the event loop (see :meth:`fail_threadsafe`)."""
        if self._closed:
            return  # closing failed the jobs; the pipe numbers may belong to others by now
        if self._broken is None:
            self._broken = reason
        self._unwatch()
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            if not entry.future.done():
                entry.future.set_exception(BrokenProcessPool(reason))
            elif entry.on_abandon is not None:
                entry.on_abandon()

    def fail_threadsafe(self, reason: str) -> None:
        """:meth:`fail`, from any thread."""
        loop = self._loop
        if loop is None:
            self.fail(reason)
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits on it any more
            loop.call_soon_threadsafe(self.fail, reason)

    def close(self) -> None:
        """Stop watching and close both pipe ends (the worker sees end-of-file). Callable from
        any thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        if loop is not None:
            _call_on(loop, self._close_now)
        else:
            self._close_now()

    def _close_now(self) -> None:
        self._unwatch()
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            if not entry.future.done():
                entry.future.set_exception(BrokenProcessPool("the worker pool was closed"))
            elif entry.on_abandon is not None:
                entry.on_abandon()
        for fd in (self._rfd, self._wfd):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- event-loop plumbing -----------------------------------------------------------------

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop:
            return
        if self._pending:
            raise RuntimeError(
                "a loader's worker jobs are still pending on another event loop; iterate a "
                "loader from one event loop at a time"
            )
        old = self._loop
        if old is not None:
            _call_on(old, self._unwatch)
        self._loop = loop
        loop.add_reader(self._rfd, self._on_readable)
        if self._outbox:
            loop.add_writer(self._wfd, self._on_writable)

    def _unwatch(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            loop.remove_reader(self._rfd)
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            loop.remove_writer(self._wfd)

    def _write(self, data: bytes) -> None:
        if self._outbox:
            self._outbox += data
            return
        try:
            written = os.write(self._wfd, data)
        except BlockingIOError:
            written = 0
        except OSError as exc:  # EPIPE: the worker is gone; its end-of-file tells the rest
            self.fail(f"writing to the worker failed: {exc}")
            return
        if written < len(data):
            self._outbox += memoryview(data)[written:]
            assert self._loop is not None
            self._loop.add_writer(self._wfd, self._on_writable)

    def _on_writable(self) -> None:
        try:
            written = os.write(self._wfd, self._outbox)
        except BlockingIOError:
            return
        except OSError as exc:
            self.fail(f"writing to the worker failed: {exc}")
            return
        del self._outbox[:written]
        if not self._outbox and self._loop is not None:
            self._loop.remove_writer(self._wfd)

    def _on_readable(self) -> None:
        try:
            eof = _drain(self._rfd, self._inbox)
        except OSError as exc:
            self.fail(f"reading from the worker failed: {exc}")
            return
        for job_id, kind, payload in _frames(self._inbox):
            self._deliver(job_id, kind, payload)
        if eof:
            self.fail("the worker closed its pipe (it exited or was killed)")

    def _deliver(self, job_id: int, kind: int, payload: bytes) -> None:
        entry = self._pending.pop(job_id, None)
        if entry is None:
            return
        if entry.future.done():  # abandoned: the worker is done with it now
            if entry.on_abandon is not None:
                entry.on_abandon()
            return
        try:
            if kind == _RESULT:
                entry.future.set_result(pickle.loads(payload))
            elif kind == _ERROR:
                exc, text = pickle.loads(payload)
                exc.__cause__ = RemoteTraceback(text)
                entry.future.set_exception(exc)
            else:
                entry.future.cancel()
        except Exception as exc:  # a reply that does not unpickle here
            error = RuntimeError(f"the worker's reply to job {job_id} could not be unpickled")
            error.__cause__ = exc
            entry.future.set_exception(error)


def _call_on(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """Run ``fn`` where it may touch ``loop``'s watchers: here if the loop is this thread's
    or is not running, else on the loop's thread (waiting, bounded, until it ran)."""
    try:
        current = asyncio.get_running_loop()
    except RuntimeError:
        current = None
    if loop.is_closed() or current is loop or not loop.is_running():
        fn()
        return
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        finally:
            done.set()

    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:  # closed meanwhile
        fn()
        return
    done.wait(_DETACH_WAIT_S)
