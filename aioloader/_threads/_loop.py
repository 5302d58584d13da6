"""The thread that runs the pipeline for ``for batch in loader``.

Synchronous code gets the same pipeline as async code: a private event loop (uvloop when
installed) runs in a daemon thread, and the calling thread asks it for one batch at a time::

    caller thread: next(it) ──run_coroutine_threadsafe(epoch.__anext__())──▶ loop thread
                   ◀──────────────── batch (or StopAsyncIteration, or the error) ────┘

There is no queue between the two: the pipeline's own prefetch is the only buffer, so the
permit of a batch is still returned exactly when the caller takes it. Abandoning the iterator
(``break``, an exception, garbage collection) closes the epoch on the loop thread; closing the
loader stops the loop and joins the thread.

Sharp edge: with a CUDA ``device``, the hand-over of each copied batch orders it before work on
the *loop thread's* current stream (the default stream). A training thread that runs its own
``torch.cuda.stream(s)`` should call ``s.wait_stream(torch.cuda.default_stream())`` or
iterate asynchronously, where the consumer's stream is the current one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any, Final, TypeVar

from .._errors import out_of_descriptors_note

__all__ = [
    "NOT_INLINE",
    "LoopThread",
    "SyncIterator",
    "forked_mid_epoch",
    "mark_loader_thread",
    "new_event_loop",
]

T = TypeVar("T")

#: What an epoch's ``next_inline()`` returns when its next batches are to come from the loop.
NOT_INLINE: Final[Any] = object()

# How long closing waits for the loop thread to wind down before giving up on it.
CLOSE_TIMEOUT_S = 10.0


# Which threads are the loader's own: a dataset's code that runs there must never wait for a
# sync iterator's next(), which may be waiting for the very batch that code is making.
_loader_thread = threading.local()


def mark_loader_thread() -> None:
    """Mark the calling thread as one that runs the loader's work (a batch, the loop)."""
    _loader_thread.marked = True


def _on_loader_thread() -> bool:
    return getattr(_loader_thread, "marked", False) is True


# uvloop, the loop this package makes, is imported with the package rather than at the first
# loop: that comes as the first batch is asked for, while the processes just forked for the
# workers compete for the CPUs, and there its import (2 ms alone) took 4-5 ms, measured on 2 cores.
_uvloop: ModuleType | None
try:
    import uvloop as _uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
    _uvloop = None


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop where uvloop is installed, else the stock asyncio loop."""
    if _uvloop is None:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = _uvloop.new_event_loop()
    return loop


class LoopThread:
    """An event loop running forever in a daemon thread, until :meth:`close`."""

    def __init__(self) -> None:
        try:
            self.loop = new_event_loop()
        except OSError as exc:  # no descriptor left for the loop's own (epoll, a wake-up pipe)
            where = (
                "making the event loop of a loader iterated with `for` (an open loader keeps "
                "one, and its workers, until it is closed or collected)"
            )
            if (note := out_of_descriptors_note(exc, where)) is not None:
                exc.add_note(note)
            raise
        self._thread = threading.Thread(target=self._run, name="aioloader-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        mark_loader_thread()  # batches are made on the loop too (cheap ones)
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            # The loop winds down on its own thread: close() may be called from a thread whose
            # own event loop is running, where run_until_complete() is refused.
            with contextlib.suppress(Exception):  # a generator's finally may hang: bounded
                shutdown = self.loop.shutdown_asyncgens()
                self.loop.run_until_complete(asyncio.wait_for(shutdown, CLOSE_TIMEOUT_S))
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.loop.shutdown_default_executor())
            asyncio.set_event_loop(None)
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Cancel what still runs on the loop, stop it and join the thread. Idempotent."""
        if not self._thread.is_alive() or self.loop.is_closed():
            return
        if threading.current_thread() is self._thread:
            # Closed from the loop itself (a finalizer run by the garbage collector there):
            # waiting for the loop would wait for ourselves. Stop it; the thread winds down.
            self.loop.stop()
            return
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                self.run(_cancel_all(), timeout=CLOSE_TIMEOUT_S)
        with contextlib.suppress(RuntimeError):  # closed meanwhile: the thread is ending
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)


class SyncIterator:
    """One epoch, iterated from a thread that is not the loop's (see the module docstring).

    ``next()`` after a batch raised goes on with the following batches, as torch's iterator
    does: the error was that batch's, the epoch is still there. What ends the epoch early is
    :meth:`close`, the iterator being dropped, or an interruption of the wait itself (Ctrl-C
    while the calling thread waits for a batch): then the epoch is closed on the loop thread.
    The epoch starts at the first ``next()``: ``start`` then returns the epoch (an async
    iterator with ``aclose()``, ``close_nowait()`` and ``next_inline()``). While the epoch
    makes its batches in this thread (``next_inline``: cheap batches, no workers), no loop is
    involved; once it says ``NOT_INLINE``, ``loop`` gives the loop thread that runs the rest.

    One iterator shared by threads (a producer thread beside the training loop, two threads
    pulling from one epoch) is served one ``next()`` at a time: a second caller waits for the
    first's batch, then gets the following one, so each batch goes to exactly one caller (the
    epoch is not made for two at once: made in the caller's thread, a batch was lost). A
    ``next()`` called from inside a running ``next()`` (a dataset that iterates its own
    loader, in the caller's thread or a loader thread) is refused, as a generator refuses it:
    it would wait for itself.
    """

    def __init__(
        self, start: Callable[[], Any], loop: Callable[[], LoopThread], length: Callable[[], int]
    ) -> None:
        # Kept for the iterator's life, not only until the start: they hold the loader, which
        # must live as long as its iterator does (``next(iter(DataLoader(...)))``).
        self._start = start
        self._loop = loop
        self._length = length
        self._started = False
        self._pid = 0  # the process the epoch began in
        self._loop_thread: LoopThread | None = None
        self._epoch: Any = None
        self._done = False
        # One next() at a time (see the class docstring); the thread in it, to refuse it a
        # second one from inside the first.
        self._turn = threading.Lock()
        self._in_next: int | None = None

    def __iter__(self) -> SyncIterator:
        return self

    def __len__(self) -> int:
        """The epoch's batches, as ``len(loader)`` (torch's iterator has a length too)."""
        return self._length()

    def __next__(self) -> Any:
        me = threading.get_ident()
        if not self._turn.acquire(blocking=False):
            if self._in_next == me or _on_loader_thread():
                # From inside next(): in this thread, or in a loader thread making the batch
                # the running next() may wait for. Waiting would wait for itself.
                raise ValueError(
                    "this loader iterator is already executing next(), and it was called again "
                    "from inside it (from the dataset, a transform or collate_fn?), where "
                    "waiting for its turn would wait for itself: iterate another iterator of "
                    "the loader there"
                )
            self._turn.acquire()  # another thread's next(): ours takes the batch after it
        self._in_next = me
        try:
            return self._next()
        finally:
            self._in_next = None
            self._turn.release()

    def _next(self) -> Any:
        if self._done:
            raise StopIteration
        if not self._started:
            self._started = True
            self._pid = os.getpid()
            self._epoch = self._start()
        elif self._pid != os.getpid():  # forked mid-epoch: its threads and workers are not here
            raise forked_mid_epoch(self._pid, "for batch in loader")
        # Read once: close() from another thread may clear self._epoch meanwhile.
        epoch = self._epoch
        if epoch is None:  # closed from another thread
            raise StopIteration
        if self._loop_thread is None:
            try:
                batch = epoch.next_inline()
            except StopIteration:
                self._done = True
                self._epoch = None
                raise StopIteration from None
            except BaseException as exc:
                if not isinstance(exc, Exception):  # interrupted: the epoch closed itself
                    self._done = True
                epoch.raised_last = True
                raise
            epoch.raised_last = False
            if batch is not NOT_INLINE:
                return batch
            self._loop_thread = self._loop()
        step = _step(epoch)
        try:
            future = asyncio.run_coroutine_threadsafe(step, self._loop_thread.loop)
        except RuntimeError:  # the loop is closed: the loader was closed under this iterator
            step.close()
            raise self._closed_under() from None
        try:
            more, batch = future.result()
        except BaseException as exc:
            if isinstance(exc, concurrent.futures.CancelledError) and future.cancelled():
                raise self._closed_under() from None  # its loop closed and cancelled the step
            if not future.done() or future.cancelled():  # the wait was interrupted, not a batch
                future.cancel()
                self.close()
            else:
                epoch.raised_last = True
            raise
        epoch.raised_last = False
        if not more:
            self._done = True
            self._epoch = None
            raise StopIteration
        return batch

    def _closed_under(self) -> BaseException:
        """What ``next()`` raises once the loop closed under it (the loader's or its worker
        pool's close): the end of an epoch that was over, else the epoch's ``RuntimeError``."""
        self._done = True
        epoch, self._epoch = self._epoch, None
        if epoch is None:
            return RuntimeError("the DataLoader was closed while this iterator was in use")
        error = epoch.end_error()
        return StopIteration() if isinstance(error, StopAsyncIteration) else error

    def close(self) -> None:
        """End the epoch now (batches in flight are cancelled). Idempotent."""
        self._done = True
        epoch, self._epoch = self._epoch, None
        loop_thread = self._loop_thread
        if epoch is None:
            return
        if loop_thread is None:  # it made its batches here: nothing runs on a loop
            epoch.close_nowait()
            return
        if threading.current_thread() is loop_thread._thread:
            epoch.close_nowait()  # collected on the loop thread: it cannot wait for itself
        elif loop_thread._thread.is_alive() and loop_thread.loop.is_running():
            # (A forked child's copy says the loop runs, but its thread is the parent's.)
            with contextlib.suppress(Exception):
                loop_thread.run(epoch.aclose(), timeout=CLOSE_TIMEOUT_S)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def forked_mid_epoch(began_in: int, restart: str) -> RuntimeError:
    """What an iterator inherited mid-epoch by a forked child raises there, at once (sync and
    async alike): its epoch's threads, loop and workers are the parent's, which goes on.
    ``restart``: how this process starts an epoch of its own (``for batch in loader``)."""
    return RuntimeError(
        f"this iterator's epoch began in process {began_in}, and this is process "
        f"{os.getpid()}, forked from it mid-epoch: the epoch cannot go on here (the "
        f"parent's goes on). Start a new one in this process (`{restart}`): it gets workers "
        "of its own"
    )


async def _step(epoch: Any) -> tuple[bool, Any]:
    try:
        return True, await epoch.__anext__()
    except StopAsyncIteration:
        return False, None


async def _cancel_all() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
