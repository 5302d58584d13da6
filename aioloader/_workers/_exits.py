"""How a worker's end is seen and read: watching for it, waiting for its exit status, and
saying what it means.

A worker's death normally shows first as end-of-file on its reply pipe (``_channel``). That
fails when another process still holds the pipe's write end open: a sibling under ``fork``
that inherited it, or a child the dataset forked in the worker. :class:`ExitWatch` is the
backstop: one thread per pool that waits on every live worker's sentinel (a descriptor that
becomes readable when the process ends) and reports each exit once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing import connection
from typing import Any

__all__ = ["EXIT_STATUS_WAIT_S", "ExitWatch", "describe_exit", "reap"]

# How long to wait for a dead worker's exit status (it names the signal that killed it). The
# status normally arrives within milliseconds.
EXIT_STATUS_WAIT_S = 1.0


def reap(process: Any, lock: threading.Lock) -> None:
    """Wait (bounded) for ``process``'s exit status, once it is dead or dying, under ``lock``
    (its pool's): a forkserver child's status is read from a pipe, once, and a second reader
    at the same time gets end-of-file and records 255 instead of the signal that killed it.
    Blocking: :meth:`._pool.WorkerPool.submit` runs it in a thread before the crash is looked
    at."""
    if process is not None:
        with lock:
            process.join(timeout=EXIT_STATUS_WAIT_S)


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
