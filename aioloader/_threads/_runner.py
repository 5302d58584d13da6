"""CPU work on threads of this process: ``num_workers=0`` (one helper thread) and
``thread_pool=True`` (``num_workers`` threads). Implements :class:`aioloader._types.Runner`.

::

    producer: start_make(request) ──(loop, future, fn, request)──▶ SimpleQueue ──▶ thread k
              ◀────────── call_soon_threadsafe(settle future) ◀── BatchMaker.make(request)

Why not ``loop.run_in_executor``: it chains a ``concurrent.futures.Future`` to an asyncio one,
and for batches that take tens of microseconds that bookkeeping is a visible share of the
loader's cost. Here a job carries its loop and asyncio future, and the thread settles it with
one ``call_soon_threadsafe``. A job whose future was cancelled before a thread took it is
skipped.

Cheap batches skip the thread (``num_workers=0`` only): :class:`InlineMaker` makes them where
they are asked for, on the route :class:`aioloader._threads._routes.RoutePolicy` chooses from
the times it measures (the event loop, the caller's own thread of ``for``, or the thread); see
``_routes`` for the routes and why.

Sharp edges:
- A thread cannot be killed: a batch that misses its deadline times out, but the thread runs on
  until the user code returns, and jobs queued behind it wait. ``close()`` waits
  :data:`THREAD_JOIN_TIMEOUT_S` and then warns, naming the stuck threads.
- ``SystemExit`` and ``KeyboardInterrupt`` from the dataset arrive as ``WorkerError`` naming
  the batch, as from a worker process: only the main thread receives the user's Ctrl-C.
- Threads share the process's global random generators with the user's code, so they are not
  reseeded per batch (as in torch).
- torch's grad mode is per thread: the threads (and a sync epoch's loop) take the one the
  consumer had as its epoch began (:meth:`ThreadRunner.begin_epoch`), so a dataset that
  runs a module under the consumer's ``torch.no_grad()`` records no graph, as in torch's
  ``num_workers=0``. Other
  per-thread state (a ``sqlite3`` connection, an LMDB transaction, ``threading.local``) is
  the thread's own: a dataset opens such handles per thread (a ``threading.local``).
- An iterable dataset is one stream here, pulled by one thread at a time (of which a rank
  keeps its share, in a distributed job).
- Large leaves of the batches made on the threads are collated into memory reused from batch
  to batch (:mod:`aioloader._threads._reuse`): such a batch is a view of a mapping the runner keeps,
  written again only once the consumer has let go of all of it.
- With a CUDA device stage after it (``pinned``), every leaf is collated into page-locked memory
  the stage gives instead, on every route (the loop's too): the stage then copies it to the
  device directly, with no staging memcpy. Only collate functions that take ``alloc``
  (``default_collate``, ``numpy_collate``) can; another one's batches are staged as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from .._batch import (
    BatchMaker,
    StreamCursor,
    annotate,
    continued_share,
    not_an_exit,
    stop_as_error,
    users_interrupt,
)
from .._errors import WorkerError
from .._sampling import every_nth, stream_share
from .._types import END, Alloc, BatchRequest, Made, Route, StreamRequest, stream_state
from ._loop import mark_loader_thread
from ._reuse import ReusedBuffers
from ._routes import RoutePolicy

__all__ = ["THREAD_JOIN_TIMEOUT_S", "InlineMaker", "ThreadPool", "ThreadRunner"]

A = TypeVar("A")
R = TypeVar("R")

# How long closing waits for the loader's threads to finish what they run. Longer: more patience
# with a slow last batch; shorter: a hung dataset read delays close() less (it is warned about).
THREAD_JOIN_TIMEOUT_S = 10.0


class InlineMaker:
    """Makes the batches of a runner with one helper thread, on every route, timing each for
    its :class:`RoutePolicy` (see the module docstring).

    Every make of the runner, on its thread or where asked, goes through :meth:`make`, under
    one lock: the dataset is only ever read by one thread at a time, as with a single helper
    thread (two epochs at once, one iterated with ``for`` and one with ``async for``, would
    otherwise read it from two threads).

    Args:
        maker: builds batches.
        routes: the route policy, told the time of every batch.
    """

    def __init__(self, maker: BatchMaker, routes: RoutePolicy) -> None:
        self._maker = maker
        self._lock = threading.Lock()
        self.routes = routes
        self.grad: bool | None = None  # the consumer's torch grad mode (ThreadRunner's)

    def route(self, *, on_loop: bool) -> Route:
        """The route of the next batch (:meth:`RoutePolicy.route`)."""
        return self.routes.route(on_loop=on_loop)

    def make(self, request: BatchRequest, route: Route, alloc: Alloc | None = None) -> Made | None:
        """Make ``request``'s batch here and now, by ``route``, and time it; None on
        :attr:`Route.LOOP` while another thread is making one (the loop never waits for that).
        ``alloc``: where collated arrays go (the runner's reused memory, on its thread)."""
        on_loop = route is Route.LOOP
        if not self._lock.acquire(blocking=not on_loop):
            return None
        try:
            started = time.perf_counter()
            try:
                if on_loop:  # a sync epoch's loop thread is not the consumer's
                    with self._grad_mode():
                        return self._maker.make(request, alloc)
                return self._maker.make(request, alloc)
            finally:
                self.routes.record(time.perf_counter() - started, route)
        finally:
            self._lock.release()

    def _grad_mode(self) -> contextlib.AbstractContextManager[Any]:
        """The consumer's grad mode for a batch made on the loop, restored after."""
        grad, torch = self.grad, sys.modules.get("torch")
        if grad is not None and torch is not None and torch.is_grad_enabled() != grad:
            return torch.set_grad_enabled(grad)  # type: ignore[no-any-return]
        return contextlib.nullcontext()


class ThreadRunner:
    """CPU work on ``threads`` threads of this process.

    Args:
        maker: builds batches.
        threads: thread count (started on demand).
        inline: make cheap batches without the thread (:class:`InlineMaker`); for one thread
            (see ``_routes.skips_thread``).
        prefetch: batches asked ahead: what the reused memory keeps is sized by it.
        routes: the route policy of ``inline`` (default: :class:`RoutePolicy` with the
            package's thresholds).
        pinned: where to collate every leaf instead of the reused memory: page-locked memory
            of the device stage that copies the batches to a GPU.
    """

    def __init__(
        self,
        maker: BatchMaker,
        threads: int,
        *,
        inline: bool = False,
        prefetch: int = 2,
        routes: RoutePolicy | None = None,
        pinned: Alloc | None = None,
    ) -> None:
        self._maker = maker
        self._threads = ThreadPool(threads)
        self._grad: bool | None = None  # the consumer's torch grad mode (begin_epoch)
        self.inline: InlineMaker | None = (
            InlineMaker(maker, routes if routes is not None else RoutePolicy())
            if inline and threads == 1
            else None
        )
        # One stream for all threads: the rank split only (every thread reads from it).
        start, step = stream_share(maker.shard, 0, 1)

        def open_stream(resume: Any) -> Iterator[Any]:
            if resume is not None:
                maker.dataset.load_state_dict(resume)
            return every_nth(iter(maker.dataset), *continued_share(start, step, resume is not None))

        self._cursor = StreamCursor(open_stream, lambda: stream_state(maker.dataset))
        self._stream_lock = threading.Lock()  # one stream, pulled by one thread at a time
        self._running: set[int] = set()  # ids of the requests a thread works on now
        # Large leaves of the batches made on the threads go to memory reused from batch to
        # batch (see _reuse); batches made inline are cheap, and small.
        self.buffers = ReusedBuffers(keep=2 * (prefetch + threads + 1))
        self._pinned = pinned
        self._alloc: Alloc = pinned if pinned is not None else self.buffers.alloc

    @property
    def streams(self) -> int:
        return 1

    @property
    def restarts(self) -> int:
        return 0

    @property
    def shm_fallbacks(self) -> int:
        return 0  # threads hand batches over in memory

    def start(self) -> None:
        """Threads start on demand: nothing to do ahead."""

    def worker_pids(self) -> tuple[int, ...]:
        return ()  # threads of this process

    def shm_stats(self) -> None:
        return None  # threads hand batches over in memory

    @property
    def has_copy(self) -> bool:
        return True  # the threads read the loader's own dataset

    def load(self, make: Callable[[], Any], epoch: int, seed: int) -> None:
        """Nothing to load: the threads read the loader's own dataset."""

    def begin_epoch(self) -> None:
        """From the consumer's thread, as an epoch begins: its torch grad mode (if torch is
        imported) becomes the threads' (see the module docstring)."""
        torch = sys.modules.get("torch")
        self._grad = None if torch is None else bool(torch.is_grad_enabled())
        if self.inline is not None:  # for batches it makes on the loop (a sync epoch's thread)
            self.inline.grad = self._grad

    def _take_grad_mode(self) -> None:
        """On a thread, before it makes a batch: the consumer's grad mode, if it differs."""
        grad, torch = self._grad, sys.modules.get("torch")
        if grad is not None and torch is not None and torch.is_grad_enabled() != grad:
            torch.set_grad_enabled(grad)  # this thread's, kept: the thread is the runner's

    def start_make(self, request: BatchRequest) -> asyncio.Future[Made]:
        inline = self.inline
        # Never while the thread makes one: the lock tells, and the loop does not wait for it.
        if inline is not None and inline.route(on_loop=True) is Route.LOOP:
            future: asyncio.Future[Made] = asyncio.get_running_loop().create_future()
            try:
                made = inline.make(request, Route.LOOP, self._pinned)
            except BaseException as exc:
                if users_interrupt(exc):
                    raise
                if not isinstance(exc, Exception):  # SystemExit would end the program here too
                    exc = not_an_exit(exc, "the event loop (a batch made inline)", request.batch_id)
                future.set_exception(exc)
                return future
            if made is not None:
                future.set_result(made)
                return future
        return self._threads.run(self._make, request)

    def _make(self, request: BatchRequest) -> Made:
        self._running.add(id(request))  # set.add/discard are atomic: no lock needed
        try:
            self._take_grad_mode()
            inline = self.inline
            alloc = self._alloc
            made = (
                self._maker.make(request, alloc)
                if inline is None
                else inline.make(request, Route.THREAD, alloc)
            )
            assert made is not None  # a make that waits for the lock always makes
            return made
        except BaseException as exc:
            if isinstance(exc, Exception):
                raise  # the user's own error, as it is
            raise _not_an_exit(exc, request.batch_id) from None
        finally:
            self._running.discard(id(request))

    async def pull(self, request: StreamRequest, stream: int) -> Made:
        return await self._threads.run(self._pull, request)

    def _pull(self, request: StreamRequest) -> Made:
        self._running.add(id(request))
        try:
            self._take_grad_mode()
            with self._stream_lock:
                samples, position = self._cursor.next_samples(request)
            if samples is END:
                return Made(batch=END)
            made = self._maker.make_from_stream(request, samples, self._alloc)
            made.position = position
            return made
        except BaseException as exc:
            if isinstance(exc, Exception):
                _note_stream(exc, request.batch_id)
                raise  # the user's own error, as it is, named
            raise _not_an_exit(exc, request.batch_id) from None
        finally:
            self._running.discard(id(request))

    def is_running(self, request: BatchRequest | StreamRequest) -> bool:
        return id(request) in self._running  # alive while its attempt runs: the id is its own

    def stop_if_idle(self) -> bool:
        """If no batch is queued or being made on a thread, take no more and say so:
        :meth:`close` then returns at once."""
        return self._threads.stop_if_idle()

    def on_deadline(self, request: BatchRequest | StreamRequest) -> int | None:
        return None  # a thread cannot be killed; its late result is dropped

    def close(self) -> None:
        stuck = self._threads.close(THREAD_JOIN_TIMEOUT_S)
        self.buffers.close()
        if stuck:
            warnings.warn(
                f"{len(stuck)} loader thread(s) still run user code after close ({stuck}): "
                "a dataset read or collate_fn that never returns cannot be interrupted in a "
                "thread; use process workers (num_workers > 0) to have it killed",
                ResourceWarning,
                stacklevel=3,
            )


class ThreadPool:
    """A minimal thread pool whose jobs complete asyncio futures directly (see the module)."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        # Jobs handed in and jobs done (or skipped): equal while no job is queued or running.
        # Counted under a lock: two loops may hand jobs in (an async and a sync epoch).
        self._handed_in = 0
        self._done = 0
        self._closed = False  # no more jobs: see stop_if_idle and close
        self._count_lock = threading.Lock()

    @property
    def idle(self) -> bool:
        """No job queued or running (a job counts as done before its result is posted)."""
        with self._count_lock:
            return self._done == self._handed_in

    def stop_if_idle(self) -> bool:
        """If no job is queued or running, take no more and say so: :meth:`close` then only
        joins threads that wait for work. One step, so no job can slip in after the check."""
        with self._count_lock:
            if self._done == self._handed_in:
                self._closed = True
            return self._closed

    def run(self, fn: Callable[[A], R], arg: A) -> asyncio.Future[R]:
        loop = asyncio.get_running_loop()  # raises outside a loop, before anything is counted
        with self._count_lock:
            if self._closed:
                raise RuntimeError("the loader is closed: its threads take no more batches")
            self._handed_in += 1
        future: asyncio.Future[R] = loop.create_future()
        if len(self._threads) < self._count:  # started on demand, like ThreadPoolExecutor
            thread = threading.Thread(
                target=self._work, name=f"aioloader-{len(self._threads)}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        self._jobs.put((loop, future, fn, arg))
        return future

    def _work(self) -> None:
        mark_loader_thread()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, future, fn, arg = job
            result: Any = None
            error: BaseException | None = None
            skipped = future.cancelled()
            if not skipped:
                try:
                    result = fn(arg)
                except BaseException as exc:
                    error = exc
            # Done before the result is posted: a consumer that has it may close at once.
            with self._count_lock:
                self._done += 1
            if not skipped:
                _post(loop, future, result, error)
            del job, loop, future, arg, result, error

    def close(self, timeout: float) -> list[str]:
        """Stop the threads; returns the names of those still busy after ``timeout``."""
        with self._count_lock:
            self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]


def _not_an_exit(exc: BaseException, batch_id: int) -> WorkerError:
    """A :class:`~aioloader.WorkerError` for ``exc``, which would end the program (a
    ``SystemExit`` from the dataset, see :func:`aioloader._batch._make.not_an_exit`)."""
    return not_an_exit(exc, f"loader thread {threading.current_thread().name}", batch_id)


def _note_stream(exc: Exception, batch_id: int) -> None:
    """Note on ``exc``, raised reading or batching the stream for ``batch_id``, the thread and
    the batch (the thread alone where a note names the batch already), as a worker process
    names itself and the batch."""
    where = f"in the stream, read by loader thread {threading.current_thread().name}"
    notes = "\n".join(getattr(exc, "__notes__", ()))
    named = re.search(rf"\bbatch {batch_id}\b", notes)  # as the batch maker names it
    annotate(exc, where if named else f"{where}, making batch {batch_id}")


def _post(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any,
    error: BaseException | None,
) -> None:
    def settle() -> None:
        if future.cancelled():
            return
        if isinstance(error, StopIteration | StopAsyncIteration):
            # A future refuses these (set_exception raises TypeError, and the awaiting
            # consumer would wait for ever): a RuntimeError carries them, as in a generator.
            future.set_exception(stop_as_error(error, "running a loader thread's job"))
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(settle)
