"""The wire between the main process and one worker: two pipes carrying length-prefixed pickles.

Why not a ``ProcessPoolExecutor``'s queues: a job crosses three threads of the main process on
its way (the caller, the queue's feeder thread, the executor's manager thread) and a fourth
hop back to the event loop. Measured on 2 cores with a 2 KB payload, that costs ~200 us of
main-process CPU per job and caps two workers at ~4,500 trivial jobs/s, the whole budget of a
tiny batch. Each worker process (``_pool``) runs :func:`serve` for its whole life, and the
batches travel here:

- main side, :class:`Channel`: non-blocking pipe ends watched by the event loop itself
  (``add_reader`` / ``add_writer``), no thread, no hop: ~25 us of CPU per job;
- worker side, :func:`serve`: a blocking loop that runs one job at a time.

A frame is a fixed header ``(payload length, job id, kind)`` and a pickle (:mod:`._records`
names the kinds, :mod:`._frames` builds and takes them apart). Requests are jobs ``(fn, arg)``,
cancellations, or "stop"; replies are a result, an error ``(exception, traceback text)``, or
"cancelled" (the job was dropped before it ran). A result's large buffers (the arrays of a batch
that travels inline) go out of band, after the pickle: the main side reads a large frame
straight into one buffer of its size and unpickles the arrays as views of it, so the bytes are
copied once, by the kernel, and the loop reads at most a few MiB per callback (a 128 MiB reply
kept the loop busy for 85 ms at most, not 430). A worker that dies closes its pipe: the main
side sees end-of-file at once and fails every job the worker held with ``BrokenProcessPool``. So
does a reply frame that cannot be valid (:func:`._frames.reply_header_fault`: bytes a stray
process wrote into the pipe): the channel is marked :attr:`Channel.corrupt` and calls its
owner's ``on_corrupt``, which kills the worker there and then. That worker was alive: the jobs
awaited fail at once, but a job given up (``on_abandon``) is not released before the worker's
death is seen (:meth:`Channel.fail`, or :meth:`Channel.close` once its owner reaped it), as
until then it may still write into that job's slot.

Sharp edges:
- Pipe ends are bound to one event loop at a time. A loader iterated first synchronously (on
  its private loop) and later with ``async for`` moves them, which is only allowed while no job
  is still awaited on the old loop (abandoned ones move along, and so do posted ones, whose
  reply nobody awaits: a dataset copy to load, :meth:`Channel.post`).
- A cancelled job still in the worker's pipe is skipped when the worker reaches it; one it has
  started runs to the end. Either way the canceller learns when the worker is done with it
  (``on_abandon``), so a shared-memory slot is never reused while a worker may write into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import pickle
import select
import threading
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .._signals import terminating
from ._frames import (
    pack_error,
    pack_result,
    reply_header_fault,
    take_frames,
    unpack_error,
    unpack_result,
)
from ._records import CANCEL, CANCELLED, ERROR, HEADER, JOB, RESULT, STOP

__all__ = ["Channel", "open_channel", "serve", "serve_over"]

# Most buffers handed to one writev (the kernel's IOV_MAX is 1024 on Linux).
_IOV_MAX = 64

# Largest single read. Replies are small descriptors unless a batch travels inline.
_READ_CHUNK = 1 << 20

# Most bytes the event loop reads in one go before it lets other callbacks run. A large inline
# batch (the first batch of a loader, or every batch without shared memory) then arrives over
# several loop iterations instead of stalling the loop for all of it.
_READ_BUDGET = 4 << 20

# A reply frame at least this large is read straight into a buffer of its size (no copies).
_BIG_FRAME = 256 << 10

# How long moving a channel off a loop that runs in another thread may wait for that loop.
_DETACH_WAIT_S = 5.0


# -- worker side -----------------------------------------------------------------------------


def serve(rfd: int, wfd: int, replied: Callable[[], None] | None = None) -> None:
    """Run jobs read from ``rfd`` and write their replies to ``wfd`` until ``rfd`` closes;
    ``replied()`` after each reply is written: only then is the job done, as the main process
    sees it (a worker that dies before has not answered it).

    Before each job it drains whatever else has arrived, so a cancellation sent while the job
    waited in the pipe is seen in time to skip it. (``poll``, not ``select``: under ``spawn``
    and ``fork`` the pipes keep the main process's descriptor numbers, which may exceed 1023.)
    """
    os.set_blocking(rfd, False)
    readable = select.poll()
    readable.register(rfd, select.POLLIN)
    inbox = bytearray()
    queue: deque[tuple[int, bytes]] = deque()
    cancelled: set[int] = set()  # ids of queued jobs the main process no longer wants
    while True:
        if not queue:
            readable.poll()
        if _drain(rfd, inbox):
            return  # the main process closed the channel: it wants no more replies
        for job_id, kind, payload in take_frames(inbox):
            if kind == STOP:
                return
            if kind == CANCEL:
                if any(queued == job_id for queued, _ in queue):  # else it ran already
                    cancelled.add(job_id)
            else:
                queue.append((job_id, payload))
        if not queue:
            continue
        job_id, payload = queue.popleft()
        if job_id in cancelled:
            cancelled.discard(job_id)
            kind, data = CANCELLED, []
        else:
            try:
                fn, arg = pickle.loads(payload)
                kind, data = RESULT, pack_result(fn(arg))
            except BaseException as exc:  # sent back, never raised here: the worker goes on
                kind, data = ERROR, [pack_error(exc)]
        del payload
        try:
            _writev_all(wfd, [HEADER.pack(sum(len(d) for d in data), job_id, kind), *data])
        except BrokenPipeError:
            return  # the main process is gone or closed the channel
        if replied is not None:
            replied()


def serve_over(
    requests: Connection, replies: Connection, replied: Callable[[], None] | None = None
) -> None:
    """:func:`serve` on the worker's ends of the pipes from :func:`open_channel`, closing them
    when it returns. The main process sees only end-of-file if serving fails, so the reason
    is printed here, on the worker's stderr."""
    try:
        serve(requests.fileno(), replies.fileno(), replied)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        requests.close()
        replies.close()


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


def _writev_all(fd: int, parts: list[Any]) -> None:
    views = deque(memoryview(p).cast("B") for p in parts if len(p))
    while views:
        _consume(views, os.writev(fd, list(itertools.islice(views, _IOV_MAX))))


def _consume(views: deque[memoryview], written: int) -> None:
    """Drop the first ``written`` bytes of ``views`` (what a writev took)."""
    while written:
        head = views[0]
        if written < len(head):
            views[0] = head[written:]
            return
        written -= len(head)
        views.popleft()


# -- main side -------------------------------------------------------------------------------


def open_channel(
    on_corrupt: Callable[[Channel, str], None] | None = None,
) -> tuple[Channel, tuple[Connection, Connection]]:
    """Two new pipes: the main side's :class:`Channel` (``on_corrupt``: see there), and the
    worker's ends (requests to read, replies to write) to hand to the worker process, then
    close here once it started."""
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    child = (Connection(requests_r, writable=False), Connection(replies_w, readable=False))
    return Channel(replies_r, requests_w, on_corrupt), child


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[Any] | None  # None: a posted job, whose reply nobody awaits
    on_abandon: Callable[[], None] | None = None


class Channel:
    """The main process's end of one worker's pipes, driven by an event loop.

    Args:
        rfd: the read end of the worker's reply pipe (owned from now on).
        wfd: the write end of the worker's request pipe (owned from now on).
        on_corrupt: called on the event loop with this channel and what was wrong, as the
            reply pipe is found to carry garbage: the owner kills the worker then (the jobs
            given up wait for that death, see :meth:`fail`). Without it, they wait for
            :meth:`fail` or :meth:`close`.
    """

    def __init__(
        self, rfd: int, wfd: int, on_corrupt: Callable[[Channel, str], None] | None = None
    ) -> None:
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        self._rfd = rfd
        self._wfd = wfd
        self._inbox = bytearray()
        self._big: tuple[int, int, bytearray] | None = None  # (job, kind, payload) being read
        self._big_filled = 0
        self._outbox: deque[memoryview] = deque()  # what the pipe did not take yet
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop jobs are sent from
        self._watching: set[asyncio.AbstractEventLoop] = set()  # loops that may watch the fds
        self._broken: str | None = None
        self._closed = False
        self._fd_lock = threading.Lock()  # the pipes are closed once, by whoever is last
        self._fds_closed = False
        self.corrupt: str | None = None  # why the reply stream cannot be trusted any more
        self._on_corrupt = on_corrupt

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop jobs are sent from now (None before the first job)."""
        return self._loop

    def send(self, fn: Callable[[Any], Any], arg: Any) -> tuple[int, asyncio.Future[Any]]:
        """Queue ``fn(arg)`` for the worker; returns the job id and the future of its result.

        Must run on the event loop. The future fails with ``BrokenProcessPool`` if the worker
        dies first, and with the job's own exception (its traceback text as ``__cause__``).
        """
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        return self._queue(fn, arg, future), future

    def post(self, fn: Callable[[Any], Any], arg: Any) -> int:
        """Queue ``fn(arg)`` for the worker without awaiting its reply (a dataset copy to load):
        the worker runs it before any job queued after it, and its failure shows in those.
        Nothing waits on it, so it never holds the pipes to this event loop. Returns its job
        id (see :meth:`answered`). Must run on the event loop."""
        return self._queue(fn, arg, None)

    def answered(self, job_id: int) -> bool:
        """Whether the worker is done with job ``job_id`` (it replied, or the channel failed)."""
        return job_id not in self._pending

    def _queue(self, fn: Callable[[Any], Any], arg: Any, future: asyncio.Future[Any] | None) -> int:
        if self._broken is not None or self._closed:
            raise BrokenProcessPool(self._broken or "the channel is closed")
        self._attach(asyncio.get_running_loop())
        payload = pickle.dumps((fn, arg), protocol=pickle.HIGHEST_PROTOCOL)
        job_id = self._next_id
        self._next_id += 1
        self._pending[job_id] = _Pending(future)
        self._write(HEADER.pack(len(payload), job_id, JOB), payload)
        return job_id

    def abandon(self, job_id: int, on_abandon: Callable[[], None] | None) -> None:
        """The caller no longer wants job ``job_id``. ``on_abandon`` runs once the worker is
        done with it: skipped, finished, or dead. Must run on the event loop."""
        pending = self._pending.get(job_id)
        if pending is None:  # already answered (or failed): the worker is done with it
            if on_abandon is not None:
                on_abandon()
            return
        if pending.future is not None and not pending.future.done():
            pending.future.cancel()
        pending.on_abandon = on_abandon
        if self._broken is None and not self._closed:
            self._write(HEADER.pack(0, job_id, CANCEL))

    def fail(self, reason: str) -> None:
        """The worker is gone: fail every pending job with ``BrokenProcessPool``, and release
        the jobs given up (their ``on_abandon``). Must run on the event loop (see
        :meth:`fail_threadsafe`)."""
        if self._closed:
            return  # closing failed the jobs already
        if self._broken is None:
            self._broken = reason
        if self._loop is not None:
            self._unwatch(self._loop)
        self._fail_pending(reason)

    def fail_threadsafe(self, reason: str) -> None:
        """:meth:`fail`, from any thread."""
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self.fail, reason)
                return
            except RuntimeError:  # the loop is closed: nobody awaits its futures any more
                pass
        # No loop to run fail() on: only mark the channel, so the next send() (on whichever
        # loop) is refused at once instead of waiting on a worker that is gone.
        if self._broken is None:
            self._broken = reason

    def close(self) -> None:
        """Stop watching, fail what is pending, and close both pipe ends (the worker sees
        end-of-file). Callable from any thread; it waits (bounded) for a loop that runs in
        another thread to let go of the pipes. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            _call_on(self._loop, lambda: self._fail_pending("the worker pool was closed"))
        for loop in list(self._watching):
            _call_on(loop, functools.partial(self._unwatch, loop))
        # A loop that did not let go in time may still poll these descriptors: closing them
        # now could make it act on whatever reuses their numbers. They stay open until that
        # loop lets go (_unwatch), if it ever runs again.
        self._close_fds_unwatched()

    def _close_fds_unwatched(self) -> None:
        """Once closed and no loop watches the pipes: tell the worker to stop and close both
        ends, once (close() and a loop letting go late may both get here, on two threads)."""
        with self._fd_lock:
            if not self._closed or self._watching or self._fds_closed:
                return
            self._fds_closed = True
            if not self._outbox:  # best effort: a full pipe means the worker is busy or gone
                with contextlib.suppress(OSError):
                    os.write(self._wfd, HEADER.pack(0, 0, STOP))
            for fd in (self._rfd, self._wfd):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _fail_pending(self, reason: str) -> None:
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            if entry.future is None:
                continue  # posted: nobody waits for it
            # A closed loop cannot schedule the callbacks of the futures made on it.
            with contextlib.suppress(RuntimeError):
                if not entry.future.done():
                    entry.future.set_exception(BrokenProcessPool(reason))
                elif entry.on_abandon is not None:
                    entry.on_abandon()

    # -- event-loop plumbing -----------------------------------------------------------------
    #
    # The pipes are watched by the loop jobs are sent from. A loader iterated on one loop and
    # later on another (its private loop for ``for``, then the caller's for ``async for``)
    # moves them: the old loop lets go on its own thread, and a callback that fires there in
    # the meantime only unregisters itself.

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop:
            return
        if any(e.future is not None and not e.future.done() for e in self._pending.values()):
            raise RuntimeError(
                "a loader's worker jobs are still awaited on another event loop; iterate a "
                "loader from one event loop at a time"
            )
        # Abandoned jobs (an epoch broken off) move along: their on_abandon runs here.
        old, self._loop = self._loop, loop
        if old is not None:

            def let_go() -> None:
                if old is not self._loop:  # not if it became current again meanwhile
                    self._unwatch(old)

            if self._pending:
                # Replies to abandoned jobs may still come: the old loop must have let go
                # before this one reads, or both would read the same pipe (bounded wait).
                _call_on(old, let_go)
            else:
                _call_soon_on(old, let_go)  # nothing can arrive: no need to wait
        self._watching.add(loop)
        loop.add_reader(self._rfd, self._on_readable, loop)
        if self._outbox:
            loop.add_writer(self._wfd, self._on_writable, loop)

    def _unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stop ``loop`` watching the pipes; on ``loop``'s thread (or with it stopped)."""
        if loop not in self._watching:
            return
        if not loop.is_closed():
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                loop.remove_reader(self._rfd)
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                loop.remove_writer(self._wfd)
        with self._fd_lock:
            self._watching.discard(loop)
        self._close_fds_unwatched()  # closed while this loop was busy: the pipes go now

    def _write(self, *parts: bytes) -> None:
        """Write ``parts`` now as far as the pipe takes them; the rest waits in the outbox
        (as views: a large request is never copied) until the pipe is writable again."""
        if self._outbox:
            self._outbox.extend(memoryview(part) for part in parts if part)
            return
        try:
            written = os.writev(self._wfd, parts)
        except BlockingIOError:
            written = 0
        except OSError as exc:  # EPIPE: the worker is gone
            self.fail(f"writing to the worker failed: {exc}")
            return
        for part in parts:
            if written >= len(part):
                written -= len(part)
                continue
            self._outbox.append(memoryview(part)[written:])
            written = 0
        if self._outbox:
            loop = self._loop
            assert loop is not None
            loop.add_writer(self._wfd, self._on_writable, loop)

    def _on_writable(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:
            self._unwatch(loop)
            return
        outbox = self._outbox
        try:
            written = os.writev(self._wfd, list(itertools.islice(outbox, _IOV_MAX)))
        except BlockingIOError:
            return
        except OSError as exc:
            self.fail(f"writing to the worker failed: {exc}")
            return
        _consume(outbox, written)
        if not outbox:
            loop.remove_writer(self._wfd)

    def _on_readable(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:
            self._unwatch(loop)
            return
        budget = _READ_BUDGET
        try:
            while budget > 0 and not self._closed:
                got = self._read_big() if self._big is not None else self._read_small(budget)
                if got is None:
                    return  # nothing more now; the loop calls again when there is
                if got == 0:
                    self.fail("the worker closed its pipe (it exited or was killed)")
                    return
                budget -= got
        except OSError as exc:
            self.fail(f"reading from the worker failed: {exc}")
        except (_CorruptReply, MemoryError) as exc:
            self._corrupted(str(exc) or "a reply too large to hold in memory")

    def _corrupted(self, why: str) -> None:
        """The reply stream is out of step for good (every later read would fail the same
        way): stop reading, have the worker killed (``on_corrupt``), as nothing it writes can
        be read now, and fail the jobs awaited. The worker was alive, maybe running a job
        given up, writing into its slot: every job stays pending (an ``abandon`` after this
        too) until its death is seen (:meth:`fail`, :meth:`close`); only then do the given-up
        jobs' ``on_abandon`` run."""
        self.corrupt = why
        self._inbox.clear()
        self._big = None
        reason = f"the worker's reply pipe carried {why}"
        if self._broken is None:
            self._broken = reason
        if self._loop is not None:
            self._unwatch(self._loop)
        if self._on_corrupt is not None:
            self._on_corrupt(self, why)  # the kill, before any awaiting job reads its status
        for entry in self._pending.values():
            if entry.future is not None and not entry.future.done():
                with contextlib.suppress(RuntimeError):  # a closed loop: nobody awaits it
                    entry.future.set_exception(BrokenProcessPool(reason))

    def _read_small(self, budget: int) -> int | None:
        """Read into the inbox and deliver the complete frames; a large frame's payload gets
        a buffer of its own. Returns bytes read, 0 at end-of-file, None if nothing was there."""
        try:
            chunk = os.read(self._rfd, min(_READ_CHUNK, budget))
        except BlockingIOError:
            return None
        if not chunk:
            return 0
        inbox = self._inbox
        inbox += chunk
        size = HEADER.size
        start = 0
        with memoryview(inbox) as view:  # released before the inbox is resized below
            while len(inbox) - start >= size:
                length, job_id, kind = HEADER.unpack_from(view, start)
                fault = reply_header_fault(length, job_id, kind, self._pending)
                if fault is not None:
                    raise _CorruptReply(f"a frame that cannot be valid ({fault})")
                body = start + size
                if len(inbox) - body >= length:
                    self._deliver(job_id, kind, bytearray(view[body : body + length]))
                    start = body + length
                    continue
                if length >= _BIG_FRAME:
                    payload = bytearray(length)
                    have = len(inbox) - body
                    payload[:have] = view[body:]
                    self._big, self._big_filled = (job_id, kind, payload), have
                    start = len(inbox)
                break
        del inbox[:start]
        return len(chunk)

    def _read_big(self) -> int | None:
        """Read straight into the payload buffer of the large frame under way."""
        assert self._big is not None
        job_id, kind, payload = self._big
        with memoryview(payload) as view:
            try:
                got = os.readv(self._rfd, [view[self._big_filled :]])
            except BlockingIOError:
                return None
        if got == 0:
            return 0
        self._big_filled += got
        if self._big_filled == len(payload):
            self._big = None
            self._deliver(job_id, kind, payload)
        return got

    def _deliver(self, job_id: int, kind: int, payload: bytearray) -> None:
        entry = self._pending.pop(job_id, None)
        if entry is None or entry.future is None:
            return
        if entry.future.done():  # abandoned: the worker is done with it now
            if entry.on_abandon is not None:
                entry.on_abandon()
            return
        try:
            if kind == RESULT:
                entry.future.set_result(unpack_result(payload))
            elif kind == ERROR:
                entry.future.set_exception(unpack_error(payload))
            else:
                entry.future.cancel()
        except Exception as exc:  # a reply that does not unpickle here
            error = RuntimeError(f"the worker's reply to job {job_id} could not be unpickled")
            error.__cause__ = exc
            entry.future.set_exception(error)


class _CorruptReply(Exception):
    """A reply frame that cannot be valid (see :func:`._frames.reply_header_fault`)."""


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _call_soon_on(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """Run ``fn`` on ``loop``'s thread: now if that is here or the loop is not running, else
    soon, without waiting for it."""
    if loop.is_closed() or _running_loop() is loop or not loop.is_running():
        fn()
        return
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # closed meanwhile
        fn()


def _call_on(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """:func:`_call_soon_on`, and wait (bounded) until ``fn`` ran."""
    if loop.is_closed() or _running_loop() is loop or not loop.is_running():
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
    # Not while a SIGTERM is being handled: the loop may be the main thread's, stopped in the
    # handler that waits for this release (the pipes are then left open: the process ends).
    done.wait(0 if terminating.is_set() else _DETACH_WAIT_S)
