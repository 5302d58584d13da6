"""Starting worker processes: one worker's state, and the launch of its process.

A worker's process runs :func:`._worker.run_worker`, started through the pool's
multiprocessing context. No job launches a process on the event loop's thread: whatever its
start method, a launch may wait (for a fork, which copies the page tables of a process with
torch loaded, or for the standard forkserver's own start, about a second: a fresh interpreter
that imports aioloader, numpy and torch). Each launch runs on a thread of its own
(:meth:`Launcher.launching`), and the jobs for its worker wait for it off the loop, under the
launch deadline (:data:`._starting.LAUNCH_TIMEOUT_S`, no shorter than the start deadline):
past it they fail with :class:`~aioloader.WorkerInitError` saying that the start method did
not give the worker a process, never a silent wait.

From the forked server (``_zygote``), the loader's start thread asks for every worker's process
before it waits for any (the server forks them back to back, in worker order: worker 0, which
gets the first batch, comes first). Under the standard forkserver, the server's one-time start
is waited for first, holding no worker (:func:`._context.await_server`): a worker's start
deadline counts from when its process could begin, and closing the pool never waits for the
server's start. Under ``fork`` the launches fork one at a time: a fork made beside another
launch's thread could copy a lock that thread holds.

Under ``'fork'`` (a :class:`._context.ForkContext`) the workers are instead forked from the
main process itself, from its main thread where no other thread runs, as an epoch begins
(:meth:`._pool.WorkerPool.fork_here`, through :meth:`Launcher.launch_here`): every fork is
made before any is waited for, before the exit watch's thread starts. Such a child runs
:func:`._worker.run_forked_worker`, which first sheds what the server would have shed. A
worker launched anywhere else (its replacement, ``async with``'s start) starts through the
context's fallback, and the first such launch warns (:meth:`Launcher.not_forked`).

A job waits for its worker's launch before it is sent: the launch under way (the loader's
start thread's), or one begun for it. If a launch the job began fails, its error reaches that
job's caller. If a launch fails, the worker's ends of its pipes are closed: a job then sent to
it fails at the channel's end-of-file and goes to a replacement worker, whose launch it makes
itself, so that the error of that launch reaches a caller.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from .._errors import WorkerInitError
from .._log import first_time, workers_log
from ._channel import Channel
from ._context import await_server
from ._copy import DatasetCopy
from ._cpython import forget_parents_children, resource_tracker_fd
from ._death import ExitWatch
from ._starting import LAUNCH_TIMEOUT_S, Hang, StackPipe, describe_launch
from ._worker import run_forked_worker, run_worker
from ._zygote import SHED_SIGNALS, is_zygote, sockets_and_pipes

__all__ = ["Launch", "Launcher", "Worker"]

# A child the program forks (os.fork(), then sys.exit or the end of its script) must not take
# its parent's workers with it: multiprocessing's exit handler terminates every daemon process
# in the record of children the child inherited, and the workers are there.
os.register_at_fork(after_in_child=forget_parents_children)


@dataclass(slots=True, eq=False)
class Launch:
    """One launch of a worker's process, under way until ``done`` is: what jobs wait for."""

    began: float  # time.monotonic() when it was asked for: its deadline counts from here
    done: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)
    reported: bool = False  # it passed its deadline, and that was logged


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
    pending: Launch | None = None  # the launch of its process under way (Launcher._lock)
    load_job: int | None = None  # the job id of the copy sent to it, until answered
    stopping: bool = False  # found hung while starting: one job deals with it (see _reply)
    hang: Hang | None = None  # why it was killed while starting (set before the kill)
    lock: threading.Lock = field(default_factory=threading.Lock)  # its launch, its stop

    def kill(self) -> int | None:
        """SIGKILL this generation's process (it hung), its death then being ours (see
        ``_death.Deaths.crashed``); its pid, or None if it has none."""
        process = self.process
        if process is None:
            return None
        pid = int(process.pid)
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return pid


Args = Callable[[Worker], tuple[Any, ...]]


class Launcher:
    """Starts the processes of a pool's workers.

    Args:
        context: the multiprocessing context.
        exits: where each started process is watched for its end.
        closed: whether the pool is closed (nothing is launched then).
        start_deadline: the workers' start deadline, and the setting that gave it (for
            errors): a launch gets as long, and at least :data:`._starting.LAUNCH_TIMEOUT_S`.
        fork_asked: the pool was asked to fork its workers (``'fork'``): a launch through
            ``context`` (the fallback) warns, once per process (:meth:`not_forked`).
    """

    def __init__(
        self,
        context: BaseContext,
        exits: ExitWatch,
        closed: Callable[[], bool],
        start_deadline: tuple[float, str] = (LAUNCH_TIMEOUT_S, "the default"),
        *,
        fork_asked: bool = False,
    ):
        self._context = context
        self._fork_asked = fork_asked
        self._exits = exits
        self._closed = closed
        seconds, setting = start_deadline
        self.deadline = (  # seconds from a launch's beginning, and what gave them (for errors)
            start_deadline
            if seconds >= LAUNCH_TIMEOUT_S
            else (LAUNCH_TIMEOUT_S, f"{setting}, but at least {LAUNCH_TIMEOUT_S} s for a launch")
        )
        self._lock = threading.Lock()  # each worker's pending launch
        self._forks = threading.Lock()  # under fork: one at a time (see the module docstring)

    def launch(self, w: Worker, args: Args) -> None:
        """Start ``w``'s process with ``args(w)`` if it has not started (blocking: from a thread
        of :meth:`launching`, or the loader's start thread)."""
        if w.process is not None or self._closed():
            return
        await_server(self._context, self._closed)  # holding no worker: see the module doc
        process = self._begin(w, args)
        if process is not None:
            self._end(w, process)

    def launching(self, w: Worker, args: Args) -> tuple[Launch, bool] | None:
        """The launch of ``w``'s process under way, or one begun now on a thread of its own,
        and whether it was begun now; None if ``w`` has its process."""
        with self._lock:
            if w.process is not None:
                return None
            if w.pending is not None:
                return w.pending, False
            launch = w.pending = Launch(time.monotonic())
        thread = threading.Thread(
            target=self._launch_for,
            args=(w, args, launch),
            name=f"aioloader-launch-{w.id}",
            daemon=True,
        )
        try:
            thread.start()
        except BaseException as exc:  # no thread to be had: the launch fails with it
            self._settle(w, launch, exc)
            raise
        return launch, True

    def launch_all(self, workers: list[Worker], args: Args) -> list[Launch | None]:
        """Start every worker's process that has not started: from the forked server, here
        (blocking while they are forked; the first error is raised once every launch begun was
        finished); else each on a thread of its own. Returns the launches still under way."""
        if not is_zygote(self._context):
            return [found[0] if (found := self.launching(w, args)) else None for w in workers]
        self.launch_here(workers, args)
        return [None for _ in workers]

    def launch_here(
        self, workers: list[Worker], args: Args, via: BaseContext | None = None
    ) -> None:
        """Start every one of ``workers`` that has not started, here, every process begun before
        any is waited for (the forked server forks them back to back; forks from this process,
        ``via``, are all made before the exit watch's thread starts). The first error is raised
        once every launch begun was finished."""
        begun: list[tuple[Worker, Any]] = []
        errors: list[BaseException] = []
        try:
            for w in workers:
                if w.process is None and (process := self._begin(w, args, via)) is not None:
                    begun.append((w, process))
        finally:
            for w, process in begun:
                try:
                    self._end(w, process)
                except BaseException as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]

    def not_forked(self, worker_id: int, reason: str) -> None:
        """Worker ``worker_id`` of a pool asked to fork its workers (a
        :class:`._context.ForkContext`) starts through the pool's start method instead, for
        ``reason``: warn, once per process. The warning is never raised as an error (a
        warnings filter set to "error", in a launch thread, would fail the launch)."""
        if not first_time(("fork declined",)):
            return
        method = self._context.get_start_method()
        through = f"the forked server ({method})" if is_zygote(self._context) else method
        with contextlib.suppress(Warning):
            warnings.warn(
                f"multiprocessing_context='fork': worker {worker_id} starts through {through} "
                f"instead of a fork of this process: {reason}, and a process forked then can "
                "hang on a lock another thread held. Workers are forked where that is safe: from "
                "the main thread, with no other thread running, as an epoch begins (or at "
                "`with loader:`); pass allow_fork=True to fork them regardless, at your own "
                "risk. (Said once per process.)",
                UserWarning,
                stacklevel=2,
            )

    async def launched(self, w: Worker, args: Args, batch_id: int) -> None:
        """Wait, without blocking the loop, until ``w`` has its process (see
        :meth:`launching`), at most until the launch's :attr:`deadline`; ``batch_id`` is the
        job's, for the error.

        Raises:
            WorkerInitError: the launch passed its deadline.
            Exception: the error of a launch begun here; after one begun elsewhere failed,
                the job goes on to the worker's channel (see the module docstring).
        """
        found = self.launching(w, args)
        if found is None:
            return
        launch, begun = found
        outcome = asyncio.wrap_future(launch.done)
        try:
            left = launch.began + self.deadline[0] - time.monotonic()
            await asyncio.wait([outcome], timeout=max(0.0, left))
        finally:
            if not outcome.done():  # its outcome is retrieved when it comes: nobody awaits it
                outcome.add_done_callback(_retrieve)
        if not outcome.done():
            raise WorkerInitError(self._give_up(w, launch, batch_id))
        error = outcome.exception()
        if error is not None and begun:
            raise error

    def wait(self, w: Worker, launch: Launch) -> None:
        """:meth:`launched` for a thread, of a launch under way (blocking).

        Raises:
            WorkerInitError: the launch passed its deadline.
            Exception: the launch's error.
        """
        left = launch.began + self.deadline[0] - time.monotonic()
        concurrent.futures.wait([launch.done], timeout=max(0.0, left))
        if not launch.done.done():
            raise WorkerInitError(self._give_up(w, launch, None))
        launch.done.result()

    def close(self, workers: list[Worker]) -> None:
        """The pool closed: what waits for a launch under way is told so now, not when the
        launch ends (a cold or stuck server's start: exit must not wait for it)."""
        with self._lock:
            for w in workers:
                launch, w.pending = w.pending, None
                if launch is not None and not launch.done.done():
                    launch.done.set_exception(RuntimeError("the worker pool is closed"))

    def _give_up(self, w: Worker, launch: Launch, batch_id: int | None) -> str:
        """The error for a job of ``w`` whose launch passed its deadline. The launch itself
        goes on (a thread cannot be stopped, and a slow server's start may still end); the
        next job waits for it again, and fails at once while it is overdue."""
        method = self._context.get_start_method()
        message = describe_launch(w.id, self.deadline, method, batch_id)
        with self._lock:
            first, launch.reported = not launch.reported, True
        if first:
            workers_log.warning("%s", message)
        return message

    def _launch_for(self, w: Worker, args: Args, launch: Launch) -> None:
        """:meth:`launching`'s thread: launch ``w``, then settle ``launch`` if nothing did."""
        error: BaseException | None = None
        try:
            self.launch(w, args)
        except BaseException as exc:  # reaches the job that began it (see launched)
            error = exc
        self._settle(w, launch, error)

    def _settle(self, w: Worker, launch: Launch | None, error: BaseException | None) -> None:
        """``launch`` of ``w`` has ended (with ``error``): no longer pending, its outcome set."""
        with self._lock:
            if w.pending is launch or launch is None:
                launch, w.pending = w.pending, None
            if launch is None or launch.done.done():
                return
            if error is None:
                launch.done.set_result(None)
            else:
                launch.done.set_exception(error)

    def _begin(self, w: Worker, args: Args, via: BaseContext | None = None) -> Any:
        """Take ``w``'s lock and start its process: the process, with the lock held
        (:meth:`_end` releases it), or None (nothing to launch; the lock released)."""
        w.lock.acquire()
        try:
            if w.process is not None or self._closed() or w.child_pipes is None:
                w.lock.release()
                return None
            with self._lock:  # what the jobs for it wait for, if it is not a launching()'s
                if w.pending is None:
                    w.pending = Launch(time.monotonic())
            w.launched = time.monotonic()
            context = via if via is not None else self._context
            fork = context.get_start_method() == "fork"
            if via is None and self._fork_asked:
                self.not_forked(w.id, _NOT_FORKED)
            with self._forks if fork else contextlib.nullcontext():
                if via is not None:
                    return _fork_here(via, w, args(w))
                process = self._context.Process(  # type: ignore[attr-defined]
                    target=run_worker, args=args(w), name=_name(w), daemon=True
                )
                process.start()  # from the forked server: the request is sent, the pid later
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
        if self._closed():  # the pool closed while the server forked it (it gave up on us)
            with contextlib.suppress(OSError, ValueError):
                process.kill()
                process.join(5.0)
            self._failed(w, RuntimeError("the worker pool is closed"))  # settles the launch
            return
        w.process = process
        for end in w.child_pipes or ():  # the worker has its copies now
            end.close()
        w.child_pipes = None
        generation, channel = w.generation, w.channel
        w.lock.release()
        self._settle(w, None, None)

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
        w.lock.release()
        self._settle(w, None, exc)


# Why a worker of a pool asked to fork starts through its fallback, when no fork was declined
# for it before (its pool forks where an epoch begins: this one starts elsewhere).
_NOT_FORKED = (
    "it is started on a thread of the loader (a replacement for a worker that died, or a "
    "worker started before any epoch or start() of its loader could fork it)"
)


def _retrieve(outcome: asyncio.Future[None]) -> None:
    if not outcome.cancelled():
        outcome.exception()  # retrieved: no "exception was never retrieved"


def _name(w: Worker) -> str:
    return f"aioloader-worker-{w.id}"


def _fork_here(context: BaseContext, w: Worker, given: tuple[Any, ...]) -> Any:
    """Start ``w``'s process as a fork of this very process (``WorkerPool.fork_here``), in
    place of the server's: its child first lets go of what the server would have shed
    (:func:`._worker.run_forked_worker`): this process's sockets and pipes, listed now, but its
    own pipes and the resource tracker's; and its signal handlers, which may not run in the
    child before it resets them (blocked around the fork)."""
    assert w.child_pipes is not None
    keep = {end.fileno() for end in w.child_pipes}
    tracker = resource_tracker_fd()
    if tracker is not None:
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
