"""The completion thread: learns that copies finished, in start order, and says so at once.

A copy to the device is finished when the event recorded after it completes. Polling the event
from the loop rounds a 0.1 ms copy up to the loop's timer tick; synchronizing it on the loop
blocks every other task. So each :class:`~aioloader._device._stage.DeviceStage` has one
:class:`Completer`, a thread that blocks in the backend's ``event_waiter`` (CUDA's
``cudaEventSynchronize``, the GIL released) on each copy's end event, in the order the copies
were enqueued, and then calls that copy's ``on_done`` with the time it saw the event complete::

    stage (loop thread, or its staging thread) ── push(end_event, on_done) ──▶ SimpleQueue
        completion thread: event_waiter(end_event) ── returns ──▶ on_done(stamp, error)
            on_done (the stage's): loop.call_soon_threadsafe(complete the copy, wake its task)

No timer is on that path: the awaiting task is woken by the future the loop sets. The stage
measures the hand-off, from the thread's stamp (taken when ``cudaEventSynchronize`` returned)
to the task's resumption; the time from the event's completion on the device to that return is
not visible here (``benchmarks/gpu_transfer.py`` measures the whole wake latency end to end).

Sharp edges:

- Queue order is completion order: every copy of a stage runs on its one side stream, and the
  stage records each copy's end event and pushes it under one lock, so the queue holds the
  events in the stream's order, in which they complete. The stage also enqueues its copies in
  start order (while a batch is being staged on its staging thread, later batches go through
  that thread too), so start order is completion order as well. Waiting on a later event first
  would only delay an earlier one's wake-up, never wake a copy early.
- Only recorded events are pushed: CUDA reports an event that was never recorded as complete.
- The thread calls ``prepare`` once before its first wait: the stage makes its device the
  thread's current one there (a fresh thread's is device 0, where ``cudaEventSynchronize``
  would create a context). Should ``prepare`` fail, every copy pushed is told that error.
- ``on_done`` runs on the completion thread: it must only hand over to the loop (it must not
  touch the stage's bookkeeping, which belongs to the loop thread), and must not raise.
- :meth:`Completer.close` lets the thread finish what it was given, then ends it. The stage
  closes it only after it has itself waited for its copies, so that join is short; a device
  that never completes an event leaves the (daemon) thread behind after
  :data:`COMPLETER_JOIN_S` rather than hanging the program.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["COMPLETER_JOIN_S", "Completer", "OnDone"]

#: How long closing waits for the completion thread to end. It waits only for copies the stage
#: has already waited for, so it ends at once unless the device hangs.
COMPLETER_JOIN_S = 10.0

#: Told when an event completed (or waiting for it failed): ``(perf_counter stamp, error)``.
OnDone = Callable[[float, BaseException | None], None]

_STOP = object()


class Completer:
    """One thread waiting on events in the order they were pushed (see the module docstring).

    Args:
        wait: blocks the calling thread until an event has completed (the backend's
            ``event_waiter``).
        prepare: called once on the thread before its first wait (the stage makes its device
            the thread's current one).
        name: the thread's name.
    """

    def __init__(
        self,
        wait: Callable[[Any], None],
        prepare: Callable[[], None] | None = None,
        name: str = "aioloader-copy-done",
    ) -> None:
        self._wait = wait
        self._prepare = prepare
        self._name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def push(self, event: Any, on_done: OnDone) -> bool:
        """Wait for ``event`` after those pushed before it, then call ``on_done``.

        Returns False (and calls nothing) once closed.
        """
        with self._lock:
            if self._closed:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put((event, on_done))
        return True

    @property
    def alive(self) -> bool:
        """Whether the thread runs."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def close(self, timeout: float = COMPLETER_JOIN_S) -> None:
        """Let the thread finish what it was given, then end it. Idempotent."""
        thread = self.stop()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def stop(self) -> threading.Thread | None:
        """Tell the thread to end once it has finished what it was given, without waiting
        (for a stage collected unclosed); returns the thread, if it was started."""
        with self._lock:
            if self._closed:
                return self._thread
            self._closed = True
            if self._thread is not None:
                self._queue.put(_STOP)
            return self._thread

    def _run(self) -> None:
        broken: BaseException | None = None
        if self._prepare is not None:
            try:
                self._prepare()
            except Exception as exc:  # the device cannot be made current: nothing can be waited
                broken = exc
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            event, on_done = item
            error: BaseException | None = broken
            if error is None:
                try:
                    self._wait(event)
                except Exception as exc:  # a device fault: reported to the copy's owner
                    error = exc
            stamp = time.perf_counter()
            with contextlib.suppress(Exception):  # on_done is the stage's and does not raise
                on_done(stamp, error)
            del item, event, on_done
