"""Starting worker processes: one worker's state, and the launch of its process.

A worker's process runs :func:`._worker.run_worker`, started through the pool's
multiprocessing context. From the forked server (``_zygote``), one thread asks for every
worker's process before it waits for any (the server forks them back to back, in worker
order: worker 0, which gets the first batch, comes first); under the other start methods
each launch waits for its own process, so they run on a thread each (not under ``fork``).

A pool's first worker may instead be forked from the main process itself, as the loader is
made (:meth:`._pool.WorkerPool.fork_first`): one fork, where the server path costs two in a
row (the server's own, then the worker's), on the way to the first batch. Such a child runs
:func:`._worker.run_forked_worker`, which first sheds what the server would have shed. Its
replacements come from the server.

A job may be sent to a worker whose process another thread is launching: it waits in the
pipe. If that launch fails, the worker's ends of the pipes are closed: its channel reaches
end-of-file, the jobs in it fail and are resubmitted to a replacement worker, and the launch
is tried again by the job itself, so that its error reaches that job's caller.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from ._channel import Channel
from ._copy import DatasetCopy
from ._exits import ExitWatch
from ._starting import Hang, StackPipe, each_at_once
from ._worker import run_forked_worker, run_worker
from ._zygote import SHED_SIGNALS, is_zygote, sockets_and_pipes

__all__ = ["Launcher", "Worker"]


@dataclass(slots=True)
class Worker:
    """One worker: its process, pipes and the jobs it holds."""

    id: int
    channel: Channel
    child_pipes: tuple[Connection, ...] | None  # the worker's ends, until it starts
    stacks: StackPipe  # where it writes its stacks when asked (see _starting)
    generation: int = 0
    outstanding: int = 0
    process: Any = None  # this generation's process, once launched
    served: bool = False  # this generation's process answered a job: it started fine
    killed: bool = False  # this generation's process was killed by kill() (it hung)
    failed_starts: int = 0  # consecutive generations that died before answering any job
    # Copies sent to this process by id, the last one sent, released ids it may still hold:
    loaded: dict[int, DatasetCopy] = field(default_factory=dict)
    last_load: DatasetCopy | None = None
    drops: list[int] = field(default_factory=list)
    launched: float = 0.0  # time.monotonic() when this generation's process was launched
    launching: bool = False  # a thread is starting its process now
    load_job: int | None = None  # the job id of the copy sent to it, until answered
    stopping: bool = False  # found hung while starting: one job deals with it (see _reply)
    hang: Hang | None = None  # why it was killed while starting (set before the kill)
    lock: threading.Lock = field(default_factory=threading.Lock)  # its launch, its stop

    def kill(self) -> int | None:
        """SIGKILL this generation's process (it hung), its death then being ours (see
        ``WorkerPool._on_broken``); its pid, or None if it has none."""
        process = self.process
        if process is None:
            return None
        pid = int(process.pid)
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return pid


class Launcher:
    """Starts the processes of a pool's workers.

    Args:
        context: the multiprocessing context.
        exits: where each started process is watched for its end.
        closed: whether the pool is closed (nothing is launched then).
    """

    def __init__(self, context: BaseContext, exits: ExitWatch, closed: Callable[[], bool]):
        self._context = context
        self._exits = exits
        self._closed = closed

    def launch(
        self,
        w: Worker,
        args: Callable[[Worker], tuple[Any, ...]],
        *,
        wait: bool = True,
        via: BaseContext | None = None,
    ) -> None:
        """Start ``w``'s process with ``args(w)`` if it has not started, through ``via`` rather
        than the pool's context if given. Without ``wait``, a launch that another thread is
        making is not waited for."""
        if w.process is not None or (not wait and w.launching):
            return
        process = self._begin(w, args, via)
        if process is not None:
            self._end(w, process)

    def launch_all(self, workers: list[Worker], args: Callable[[Worker], tuple[Any, ...]]) -> None:
        """Start every worker's process that has not started (blocking while they are
        forked); the first error is raised once every launch begun was finished."""
        if not is_zygote(self._context):
            together = self._context.get_start_method() != "fork"
            each_at_once(lambda w: self.launch(w, args), workers, together=together)
            return
        begun: list[tuple[Worker, Any]] = []
        errors: list[BaseException] = []
        try:
            for w in workers:
                if w.process is None and (process := self._begin(w, args)) is not None:
                    begun.append((w, process))
        finally:
            for w, process in begun:
                try:
                    self._end(w, process)
                except BaseException as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]

    def _begin(
        self, w: Worker, args: Callable[[Worker], tuple[Any, ...]], via: BaseContext | None = None
    ) -> Any:
        """Take ``w``'s lock and start its process: the process, with the lock held
        (:meth:`_end` releases it), or None (nothing to launch; the lock released)."""
        w.lock.acquire()
        try:
            if w.process is not None or self._closed() or w.child_pipes is None:
                w.lock.release()
                return None
            w.launched, w.launching = time.monotonic(), True
            if via is not None:
                return _fork_here(via, w, args(w))
            process = self._context.Process(  # type: ignore[attr-defined]
                target=run_worker, args=args(w), name=_name(w), daemon=True
            )
            process.start()  # from the forked server: the request is sent, the pid comes later
            return process
        except BaseException as exc:
            self._failed(w, exc)
            raise

    def _end(self, w: Worker, process: Any) -> None:
        """Wait until ``process`` is forked (its pid), make it ``w``'s, release the lock."""
        try:
            process.pid  # noqa: B018 - blocks until the server has forked it
        except BaseException as exc:
            self._failed(w, exc)
            raise
        w.process = process
        assert w.child_pipes is not None
        for end in w.child_pipes:  # the worker has its copies now
            end.close()
        w.child_pipes = None
        w.launching = False
        generation, channel = w.generation, w.channel
        w.lock.release()

        def exited() -> None:
            # Normally the channel's end-of-file tells first; this covers a worker whose pipe
            # another process still holds open (fork).
            if w.generation == generation:
                channel.fail_threadsafe("the worker exited")

        self._exits.add(process, exited)

    def _failed(self, w: Worker, exc: BaseException) -> None:
        """The process did not start: close the worker's ends of its pipes, release the lock.
        The channel then reaches end-of-file (on its own loop: no race with a job being sent),
        the jobs already sent to it fail and go to a replacement worker, whose launch the next
        job makes itself, so that its error reaches a caller."""
        for end in w.child_pipes or ():
            end.close()
        w.child_pipes = None
        w.launching = False
        w.lock.release()


def _name(w: Worker) -> str:
    return f"aioloader-worker-{w.id}"


def _fork_here(context: BaseContext, w: Worker, given: tuple[Any, ...]) -> Any:
    """Start ``w``'s process as a fork of this very process, in place of the server's
    (``WorkerPool.fork_first``): its child first lets go of what the server would have shed
    (:func:`._worker.run_forked_worker`): this process's sockets and pipes, listed now, but its
    own pipes and the resource tracker's; and its signal handlers, which may not run in the
    child before it resets them (blocked around the fork)."""
    assert w.child_pipes is not None
    keep = {end.fileno() for end in w.child_pipes}
    tracker = getattr(resource_tracker._resource_tracker, "_fd", None)
    if isinstance(tracker, int):
        keep.add(tracker)
    process = context.Process(  # type: ignore[attr-defined]
        target=run_forked_worker, args=(sockets_and_pipes(keep), *given), name=_name(w), daemon=True
    )
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SHED_SIGNALS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return process
