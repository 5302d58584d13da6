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

Sharp edges:
- A thread cannot be killed: a batch that misses its deadline times out, but the thread runs on
  until the user code returns, and jobs queued behind it wait. ``close()`` waits
  :data:`THREAD_JOIN_TIMEOUT_S` and then warns, naming the stuck threads.
- ``SystemExit`` and ``KeyboardInterrupt`` from the dataset arrive as ``WorkerError`` naming
  the batch, as from a worker process: only the main thread receives the user's Ctrl-C.
- Threads share the process's global random generators with the user's code, so they are not
  reseeded per batch (as in torch).
- An iterable dataset is one stream here, pulled by one thread at a time (of which a rank
  keeps its share, in a distributed job).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ._batch import BatchMaker, StreamCursor, continued_share, not_an_exit
from ._distributed import every_nth, stream_share
from ._errors import WorkerError
from ._types import END, BatchRequest, Made, StreamRequest, stream_state

__all__ = ["THREAD_JOIN_TIMEOUT_S", "ThreadPool", "ThreadRunner"]

A = TypeVar("A")
R = TypeVar("R")

# How long closing waits for the loader's threads to finish what they run. Longer: more patience
# with a slow last batch; shorter: a hung dataset read delays close() less (it is warned about).
THREAD_JOIN_TIMEOUT_S = 10.0


class ThreadRunner:
    """CPU work on ``threads`` threads of this process.

    Args:
        maker: builds batches.
        threads: thread count (started on demand).
    """

    def __init__(self, maker: BatchMaker, threads: int) -> None:
        self._maker = maker
        self._threads = ThreadPool(threads)
        # One stream for all threads: the rank split only (every thread reads from it).
        start, step = stream_share(maker.shard, 0, 1)

        def open_stream(resume: Any) -> Iterator[Any]:
            if resume is not None:
                maker.dataset.load_state_dict(resume)
            return every_nth(iter(maker.dataset), *continued_share(start, step, resume is not None))

        self._cursor = StreamCursor(open_stream, lambda: stream_state(maker.dataset))
        self._stream_lock = threading.Lock()  # one stream, pulled by one thread at a time
        self._running: set[int] = set()  # batch ids a thread works on now

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

    def start_make(self, request: BatchRequest) -> asyncio.Future[Made]:
        return self._threads.run(self._make, request)

    def _make(self, request: BatchRequest) -> Made:
        self._running.add(request.batch_id)  # set.add/discard are atomic: no lock needed
        try:
            return self._maker.make(request)
        except BaseException as exc:
            if isinstance(exc, Exception):
                raise  # the user's own error, as it is
            raise _not_an_exit(exc, request.batch_id) from None
        finally:
            self._running.discard(request.batch_id)

    async def pull(self, request: StreamRequest, stream: int) -> Made:
        return await self._threads.run(self._pull, request)

    def _pull(self, request: StreamRequest) -> Made:
        self._running.add(request.batch_id)
        try:
            with self._stream_lock:
                samples, position = self._cursor.next_samples(request)
            if samples is END:
                return Made(batch=END)
            made = self._maker.make_from_stream(request, samples)
            made.position = position
            return made
        except BaseException as exc:
            if isinstance(exc, Exception):
                raise  # the user's own error, as it is
            raise _not_an_exit(exc, request.batch_id) from None
        finally:
            self._running.discard(request.batch_id)

    def is_running(self, batch_id: int) -> bool:
        return batch_id in self._running

    def on_deadline(self, batch_id: int) -> int | None:
        return None  # a thread cannot be killed; its late result is dropped

    def close(self) -> None:
        stuck = self._threads.close(THREAD_JOIN_TIMEOUT_S)
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

    def run(self, fn: Callable[[A], R], arg: A) -> asyncio.Future[R]:
        loop = asyncio.get_running_loop()
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
        while True:
            job = self._jobs.get()
            if job is None:
                return
            loop, future, fn, arg = job
            if future.cancelled():
                continue
            try:
                result = fn(arg)
            except BaseException as exc:
                _post(loop, future, None, exc)
            else:
                _post(loop, future, result, None)
            del job, loop, future, arg

    def close(self, timeout: float) -> list[str]:
        """Stop the threads; returns the names of those still busy after ``timeout``."""
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self._threads if t.is_alive()]


def _not_an_exit(exc: BaseException, batch_id: int) -> WorkerError:
    """A :class:`~aioloader.WorkerError` for ``exc``, which would end the program (a
    ``SystemExit`` from the dataset, see :func:`aioloader._batch.not_an_exit`)."""
    return not_an_exit(exc, f"loader thread {threading.current_thread().name}", batch_id)


def _post(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future[Any],
    result: Any,
    error: BaseException | None,
) -> None:
    def settle() -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(settle)
