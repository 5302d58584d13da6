"""One epoch of the pipeline: schedule, produce, reorder, hand over.

::

    scheduler task ── acquire permit ──▶ reorder.expect(id) ──▶ produce task (one per batch)
         │ (one per epoch; pulls the         │                     │ fetch: await dataset items
         │  sampler or the stream)           │                     │   on this loop (async data)
         ▼                                   │                     │ make: thread or worker
    consumer: __anext__ ◀── pop_ready ◀── reorder.put_nowait(outcome) ◀─┘ (deadline, retries)
         │ release permit when the batch is taken (after the device copy, if any)

Who owns what:
- the scheduler owns the sampler iterator and creates produce tasks; it stops at the end of
  the plan or of every stream;
- a produce task owns its batch until it stores an outcome (value or exception) in the
  reorder buffer; it never raises, so no task exception goes unretrieved;
- the consumer owns batches once popped; a permit is returned when the consumer takes a
  batch, so ``prefetch`` bounds tasks, worker jobs, reorder entries and shared-memory slots
  together.

Cancellation edges:
- cancelling the consumer's ``__anext__`` (``asyncio.timeout`` around it, a cancelled task)
  loses nothing: a batch popped but not yet handed over is kept and returned by the next call;
- ``aclose()`` cancels the scheduler and every produce task and waits for them; worker jobs
  that were already running release their shared-memory slots when they finish;
- an iterator that is dropped without ``aclose()`` is closed by its handle's ``__del__``
  (:class:`EpochIterator`: the handle, unlike the epoch, is not referenced by the tasks);
- closing an epoch wakes a consumer that waits on it: it gets ``StopAsyncIteration``.

Deadlines measure producer time: a batch's clock starts when its produce task starts (after its
permit was taken), so a slow consumer never causes a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ._batch import annotate
from ._errors import LoaderTimeoutError, TooManyFailuresError, WorkerCrashedError
from ._reorder import Outcome, ReorderBuffer
from ._runner import END as THREAD_END
from ._stats import Counters
from ._types import EMPTY_BATCH, END, BatchRequest, Made, StreamRequest
from ._workers import ProcessRunner

__all__ = ["Epoch", "EpochConfig", "EpochIterator"]


@dataclass(frozen=True, slots=True)
class EpochConfig:
    """What an epoch needs to know of the loader's settings."""

    kind: str  # "map", "async_map", "iterable", "async_iterable"
    prefetch: int
    in_order: bool
    timeout: float | None
    max_retries: int
    io_concurrency: int
    batch_size: int
    drop_last: bool
    skip_errors: bool
    max_failures: float  # a count (>= 1) or a fraction of samples seen (< 1)
    device_prefetch: int


class Epoch:
    """An async iterator over one epoch's batches. Made by :class:`aioloader.DataLoader`.

    Args:
        config: the loader's settings.
        epoch: the epoch number (seeds and sampler order derive from it).
        runner: where CPU work runs (see ``_runner``).
        counters: the loader's live statistics.
        plan: for map-style data, ``(batch_id, indices)`` pairs still to produce.
        dataset: the dataset (for async fetches and async streams).
        device: the device stage, or None.
        on_batch: called with the batch id when the consumer takes a batch (resume bookkeeping).
        on_finish: called once when the epoch has run to its end.
    """

    def __init__(
        self,
        config: EpochConfig,
        epoch: int,
        runner: Any,
        counters: Counters,
        *,
        plan: Iterable[tuple[int, Any]] | None,
        dataset: Any,
        device: Any,
        on_batch: Callable[[int], None],
        on_finish: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.epoch = epoch
        self._runner = runner
        self._counters = counters
        self._plan = plan
        self._dataset = dataset
        self._device = device
        self._on_batch = on_batch
        self._on_finish = on_finish
        self.reorder = ReorderBuffer(in_order=config.in_order)
        self._permits: asyncio.Semaphore | None = None
        self._io: asyncio.Semaphore | None = None
        self._ready: asyncio.Event | None = None
        self._scheduler: asyncio.Task[None] | None = None
        # produce tasks, and futures of batches made without one (the thread fast path)
        self._tasks: set[asyncio.Future[Any]] = set()
        self._scheduling_done = False
        self._handing: list[tuple[int, Any]] = []  # popped, not yet handed over (device copy)
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_id = 0  # the next batch id no scheduled batch uses
        self._samples: dict[int, int] = {}  # batch id -> samples in it, until yielded
        self._samples_seen = 0
        self._failures = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop this epoch runs on, once started."""
        return self._loop

    # -- consumer side -----------------------------------------------------------------------

    def __aiter__(self) -> Epoch:
        return self

    async def __anext__(self) -> Any:
        if self._closed:
            raise StopAsyncIteration
        if self._scheduler is None:
            self._start()
        assert self._ready is not None
        while True:
            if self._closed:  # closed while we waited (a new epoch, the loader's close)
                raise StopAsyncIteration
            if self._handing:
                return await self._hand_over()
            outcome = self.reorder.pop_ready()
            if outcome is not None:
                if outcome.value is END:
                    self._release_permit()
                    continue
                if outcome.value is EMPTY_BATCH:  # every sample skipped: nothing to hand over
                    self._release_permit()
                    self._samples.pop(outcome.batch_id, None)
                    self._on_batch(outcome.batch_id)  # done, for resume
                    continue
                return await self._take(outcome)
            if self._scheduling_done and len(self.reorder) == 0:
                await self.aclose()
                self._on_finish()
                raise StopAsyncIteration
            self._ready.clear()
            started = time.perf_counter()
            try:
                await self._ready.wait()
            finally:
                self._counters.consumer_wait_s += time.perf_counter() - started

    async def _take(self, outcome: Outcome) -> Any:
        if outcome.error is not None:
            self._release_permit()
            self._on_batch(outcome.batch_id)
            raise outcome.error
        if self._device is None:
            self._release_permit()
            self._yielded(outcome.batch_id, outcome.value)
            return outcome.value
        self._handing.append((outcome.batch_id, self._start_copy(outcome)))
        # Start the copies of the batches right behind, so batch i+1 crosses while i is used.
        # An error, a stream end or an empty batch waits its turn in the buffer.
        while len(self._handing) <= self.config.device_prefetch:
            nxt = self.reorder.peek_ready()
            if nxt is None or nxt.error is not None or nxt.value is END or nxt.value is EMPTY_BATCH:
                break
            self.reorder.pop_ready()
            self._handing.append((nxt.batch_id, self._start_copy(nxt)))
        return await self._hand_over()

    def _start_copy(self, outcome: Outcome) -> Any:
        """Start a batch's device copy; a failure to start waits its turn like the batch would,
        so its permit and its place in the order are kept (and released) like any other."""
        assert self._device is not None
        try:
            return self._device.start(outcome.value, outcome.batch_id)
        except Exception as exc:
            return _FailedCopy(exc)

    async def _hand_over(self) -> Any:
        batch_id, transfer = self._handing[0]
        started = time.perf_counter()
        try:
            batch = await transfer.wait()
        except asyncio.CancelledError:
            raise  # the transfer stays first in line; the next __anext__ returns it
        except BaseException:
            self._handing.pop(0)
            self._release_permit()
            self._on_batch(batch_id)
            raise
        finally:
            self._counters.transfer_s += time.perf_counter() - started
        self._handing.pop(0)
        self._release_permit()
        self._yielded(batch_id, batch)
        return batch

    def _yielded(self, batch_id: int, batch: Any) -> None:
        self._counters.batches_yielded += 1
        self._counters.epoch_batches_yielded += 1
        self._counters.samples_yielded += self._samples.pop(batch_id, 0)
        self._on_batch(batch_id)

    def _release_permit(self) -> None:
        assert self._permits is not None
        self._permits.release()

    # -- producer side -----------------------------------------------------------------------

    def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._permits = asyncio.Semaphore(self.config.prefetch)
        self._io = asyncio.Semaphore(self.config.io_concurrency)
        self._ready = asyncio.Event()
        kind = self.config.kind
        if kind in ("map", "async_map"):
            coro = self._schedule_plan()
        elif kind == "iterable":
            coro = self._schedule_streams()
        else:
            coro = self._schedule_async_stream()
        self._scheduler = asyncio.create_task(coro, name=f"aioloader-epoch-{self.epoch}")

    def _spawn(self, coro: Any, batch_id: int) -> None:
        task = asyncio.create_task(coro, name=f"aioloader-batch-{batch_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _wake(self) -> None:
        assert self._ready is not None
        self._ready.set()

    async def _scheduled(self, batch_id: int) -> None:
        assert self._permits is not None
        await self._permits.acquire()
        self.reorder.expect(batch_id)

    def _store(self, outcome: Outcome) -> None:
        if self._closed:
            _discard(outcome)
            return
        self.reorder.put_nowait(outcome)
        self._wake()

    async def _run_scheduler(self, body: Callable[[], Any]) -> None:
        """Run a scheduler body; if the sampler or stream fails, deliver the error in order.

        The error takes a permit and the next unused batch id like any batch, so it reaches the
        consumer after every batch scheduled before it.
        """
        try:
            await body()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await self._scheduled(self._next_id)
            self.reorder.put_nowait(Outcome(self._next_id, error=exc))
        finally:
            self._scheduling_done = True
            if self._ready is not None:
                self._wake()

    async def _schedule_plan(self) -> None:
        async def body() -> None:
            assert self._plan is not None
            # A sync map dataset on threads with no deadline needs no task per batch: the
            # thread's future reports straight into the reorder buffer. For batches that take
            # tens of microseconds to make, the task machinery is most of the cost.
            start_make: Callable[[BatchRequest], asyncio.Future[Made]] | None = getattr(
                self._runner, "start_make", None
            )
            if (
                self.config.kind != "map"
                or self.config.timeout is not None
                or isinstance(self._runner, ProcessRunner)  # crashes: retries and notes
            ):
                start_make = None
            for batch_id, indices in self._plan:
                self._next_id = batch_id + 1
                await self._scheduled(batch_id)
                if start_make is not None:
                    future = start_make(_request(self.epoch, batch_id, indices))
                    self._tasks.add(future)
                    future.add_done_callback(functools.partial(self._made_by_thread, batch_id))
                else:
                    self._spawn(self._produce_map(batch_id, indices), batch_id)

        await self._run_scheduler(body)

    async def _schedule_streams(self) -> None:
        """Round-robin over the runner's streams (one per worker); ids stay in that order."""
        ended: set[int] = set()
        streams = self._runner.streams
        counter = itertools.count()

        async def body() -> None:
            for turn in itertools.cycle(range(streams)):
                if len(ended) == streams:
                    return
                if turn in ended:
                    continue
                batch_id = next(counter)
                self._next_id = batch_id + 1
                await self._scheduled(batch_id)
                if turn in ended:  # ended while we waited for the permit
                    self._store(Outcome(batch_id, value=END))
                    continue
                request = StreamRequest(
                    self.epoch, batch_id, self.config.batch_size, self.config.drop_last
                )
                self._spawn(self._produce_stream(request, turn, ended), batch_id)

        await self._run_scheduler(body)

    async def _schedule_async_stream(self) -> None:
        async def body() -> None:
            iterator: AsyncIterator[Any] = aiter(self._dataset)
            try:
                while True:
                    samples, error = await _take_async(iterator, self.config.batch_size)
                    short = len(samples) < self.config.batch_size
                    if samples and not (short and self.config.drop_last and error is None):
                        batch_id = self._next_id
                        self._next_id += 1
                        await self._scheduled(batch_id)
                        request = BatchRequest(
                            self.epoch, batch_id, list(range(len(samples))), raw=samples
                        )
                        self._spawn(self._produce_request(request), batch_id)
                    if error is not None:
                        annotate(error, f"in the async stream, after batch {self._next_id - 1}")
                        raise error
                    if short:
                        return
            finally:
                aclose = getattr(iterator, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()

        await self._run_scheduler(body)

    def _made_by_thread(self, batch_id: int, future: asyncio.Future[Made]) -> None:
        self._tasks.discard(future)
        if future.cancelled():
            return
        error = future.exception()
        self._store(
            Outcome(batch_id, error=error) if error else self._made(batch_id, future.result())
        )

    async def _produce_map(self, batch_id: int, indices: Any) -> None:
        request = _request(self.epoch, batch_id, indices)
        if self.config.kind == "async_map":
            # The deadline covers the fetch too: an item that never arrives must not stall the
            # epoch. (The CPU stage after it gets a deadline of its own.)
            started = time.monotonic()
            deadline = asyncio.timeout(self.config.timeout)
            try:
                async with deadline:
                    request = await self._fetch(request)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                if isinstance(exc, TimeoutError) and deadline.expired():
                    self._counters.timeouts += 1
                    error: BaseException = self._timeout_error(
                        batch_id, f"fetching {_indices_text(request)}", started, None
                    )
                    error.__cause__ = exc
                else:
                    error = exc
                self._store(Outcome(batch_id, error=error))
                return
        await self._produce_request(request)

    async def _produce_request(self, request: BatchRequest) -> None:
        outcome = await self._with_deadline(
            request.batch_id,
            lambda: self._runner.start_make(request),
            lambda: _indices_text(request),
        )
        self._store(outcome)

    async def _produce_stream(self, request: StreamRequest, worker: int, ended: set[int]) -> None:
        outcome = await self._with_deadline(
            request.batch_id,
            lambda: self._runner.pull(request, worker),
            lambda: f"the stream of worker {worker}",
            retry=False,  # a stream cannot be rewound: a lost batch is an error, never a re-read
        )
        if outcome.value is THREAD_END:  # the thread runner's own marker: until it uses END
            outcome = Outcome(request.batch_id, value=END)
        if outcome.value is END or outcome.error is not None:
            ended.add(worker)
        self._store(outcome)

    async def _with_deadline(
        self,
        batch_id: int,
        attempt: Callable[[], Any],
        what: Callable[[], str],
        *,
        retry: bool = True,
    ) -> Outcome:
        """Run ``attempt`` under the batch deadline, retrying crashes and timeouts if asked.

        The deadline counts only time in which the batch is being worked on: when it passes
        while the batch still waits in a worker's queue (behind a slow or hung batch, which has
        a deadline of its own), the clock starts again and the job keeps its place.
        """
        if self.config.timeout is None and not (retry and self.config.max_retries):
            # The common case, kept lean: no extra task per batch.
            try:
                return self._made(batch_id, await attempt())
            except asyncio.CancelledError:
                raise
            except WorkerCrashedError as exc:
                annotate(exc, f"batch {batch_id}: {what()}")
                return Outcome(batch_id, error=exc)
            except BaseException as exc:
                return Outcome(batch_id, error=exc)
        tries = 0
        while True:
            job = asyncio.ensure_future(attempt())
            try:
                timed_out, started = await self._await_job(job, batch_id)
            except asyncio.CancelledError:
                raise
            except WorkerCrashedError as exc:
                if retry and tries < self.config.max_retries:
                    tries += 1
                    self._counters.retries += 1
                    continue
                annotate(exc, f"batch {batch_id}: {what()}")
                return Outcome(batch_id, error=exc)
            except BaseException as exc:  # user code's error, TimeoutError included
                return Outcome(batch_id, error=exc)
            if not timed_out:
                return self._made(batch_id, job.result())
            self._counters.timeouts += 1
            pid = self._runner.on_deadline(batch_id)
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
            if retry and tries < self.config.max_retries:
                tries += 1
                self._counters.retries += 1
                continue
            return Outcome(batch_id, error=self._timeout_error(batch_id, what(), started, pid))

    async def _await_job(self, job: asyncio.Future[Any], batch_id: int) -> tuple[bool, float]:
        """Wait for ``job``; ``(True, start)`` once it ran past the deadline, else ``(False, _)``
        with the job done (its exception, if any, raised)."""
        timeout = self.config.timeout
        started = time.monotonic()
        try:
            if timeout is None:
                await asyncio.wait([job])
            else:
                while True:
                    done, _ = await asyncio.wait([job], timeout=timeout)
                    if done:
                        break
                    if self._runner.is_running(batch_id):
                        return True, started
                    started = time.monotonic()  # still queued: its time has not begun
        except asyncio.CancelledError:
            job.cancel()
            raise
        job.result()  # raises the job's exception
        return False, started

    def _made(self, batch_id: int, made: Made) -> Outcome:
        self._counters.read_s += made.read_s
        self._counters.collate_s += made.collate_s
        self._samples[batch_id] = made.samples
        self._samples_seen += made.samples + len(made.skipped)
        if made.skipped:
            self._counters.skipped.extend(made.skipped)
            self._failures += len(made.skipped)
            error = self._check_failures()
            if error is not None:
                _discard(Outcome(batch_id, value=made.batch))
                return Outcome(batch_id, error=error)
        return Outcome(batch_id, value=made.batch)

    def _check_failures(self) -> TooManyFailuresError | None:
        limit = self.config.max_failures
        if limit >= 1:
            over = self._failures > limit
        else:
            over = self._failures > limit * max(self._samples_seen, 1)
        if not over:
            return None
        return TooManyFailuresError(
            f"{self._failures} samples failed out of {self._samples_seen} seen, more than "
            f"max_failures={limit}; the last ones: {self._counters.skipped[-3:]}"
        )

    def _timeout_error(
        self, batch_id: int, what: str, started: float, pid: int | None
    ) -> LoaderTimeoutError:
        waited = time.monotonic() - started
        killed = f"; worker pid {pid} was killed and replaced" if pid is not None else ""
        return LoaderTimeoutError(
            f"batch {batch_id} ({what}) was not ready after {waited:.2f} s "
            f"(timeout={self.config.timeout}){killed}. Try a larger timeout, more workers, "
            "or max_retries to re-run a batch whose worker hung."
        )

    async def _fetch(self, request: BatchRequest) -> BatchRequest:
        """Await the items of an async dataset, at most ``io_concurrency`` at once overall."""
        assert self._io is not None
        fetch = getattr(self._dataset, "fetch", None)
        get = fetch if fetch is not None and hasattr(self._dataset, "decode") else None
        get = get or self._dataset.__getitem__
        started = time.perf_counter()

        async def one(index: int) -> Any:
            assert self._io is not None
            async with self._io:
                try:
                    return await get(index)
                except Exception as exc:
                    if self.config.skip_errors:
                        return _Failed(index, exc)
                    annotate(exc, f"fetching sample index {index} of batch {request.batch_id}")
                    raise

        shards: list[Sequence[int]] = cast(
            "list[Sequence[int]]", list(request.indices) if request.sharded else [request.indices]
        )
        raws: list[list[Any]] = []
        tasks: list[list[asyncio.Task[Any]]] = []
        failed_group: BaseExceptionGroup[BaseException] | None = None
        try:
            async with asyncio.TaskGroup() as group:
                for shard in shards:
                    tasks.append([group.create_task(one(i)) for i in shard])
        except BaseExceptionGroup as exc:
            failed_group = exc
        if failed_group is not None:
            # The user's exception, not a group: ``except KeyError`` must keep working. Raised
            # outside the ``except`` block so the group does not become its context.
            raise _first_failure(tasks, failed_group)
        for shard_tasks in tasks:
            raws.append([t.result() for t in shard_tasks])
        self._counters.fetch_s += time.perf_counter() - started
        failed = [r for shard in raws for r in shard if isinstance(r, _Failed)]
        if failed:
            kept, raws = _drop_failed(shards, raws)
            shards = list(kept)
            skipped = [(f.index, f"{type(f.error).__name__}: {f.error}") for f in failed]
            self._counters.skipped.extend(skipped)
            self._failures += len(skipped)
            self._samples_seen += len(skipped)
            error = self._check_failures()
            if error is not None:
                raise error
        if request.sharded:
            return BatchRequest(request.epoch, request.batch_id, shards, True, raws)
        return BatchRequest(request.epoch, request.batch_id, shards[0], False, raws[0])

    # -- closing -----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Cancel everything in flight, wait for it, release what was produced. Idempotent."""
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in (self._scheduler, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._release_all()

    def close_nowait(self) -> None:
        """Cancel the tasks and release what was produced, without waiting (from ``__del__``,
        from a new epoch, or from another thread's close). The work is done on the epoch's
        loop, which alone touches the tasks and the reorder buffer."""
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        if loop is None or loop.is_closed():
            self._release_all()  # never started, or its loop is gone: nothing runs any more
            return
        tasks = [t for t in (self._scheduler, *self._tasks) if t is not None]

        def stop() -> None:
            for task in tasks:
                task.cancel()
            self._release_all()

        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(stop)

    def _release_all(self) -> None:
        """Drop every produced batch (their shared-memory slots go back to the pool) and wake a
        consumer still waiting, who then sees the epoch closed."""
        for outcome in self.reorder.drain():
            _discard(outcome)
        self._handing.clear()
        if self._ready is not None:
            self._ready.set()

    def __del__(self) -> None:
        self.close_nowait()


class EpochIterator:
    """What ``aiter(loader)`` returns: the consumer's handle on an :class:`Epoch`.

    The epoch's own tasks reference the epoch, so the epoch cannot notice that the consumer
    dropped it. This thin handle can, because only the consumer holds it: when it is garbage
    collected (``del it``, a ``break`` out of ``async for``, an exception that unwinds the
    loop) the epoch is closed at once: its tasks are cancelled and its batches released.
    """

    __slots__ = ("__weakref__", "epoch")

    def __init__(self, epoch: Epoch) -> None:
        self.epoch = epoch

    def __aiter__(self) -> EpochIterator:
        return self

    async def __anext__(self) -> Any:
        # A coroutine of our own (rather than the epoch's) keeps this handle alive while the
        # consumer awaits: ``await anext(aiter(loader))`` must not close the epoch under it.
        return await self.epoch.__anext__()

    async def aclose(self) -> None:
        """Close the epoch now and wait until its tasks are over."""
        await self.epoch.aclose()

    def __del__(self) -> None:
        self.epoch.close_nowait()


def _request(epoch: int, batch_id: int, indices: Any) -> BatchRequest:
    sharded = bool(indices) and isinstance(indices[0], list | tuple)
    return BatchRequest(epoch, batch_id, indices, sharded=sharded)


class _FailedCopy:
    """Stands in for a transfer that could not start: waiting on it raises its error."""

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error

    async def wait(self) -> Any:
        error, self.error = self.error, None  # drop the reference: the batch's slot can go
        assert error is not None
        raise error


@dataclass(frozen=True, slots=True)
class _Failed:
    index: int
    error: BaseException


def _first_failure(
    tasks: list[list[asyncio.Task[Any]]], group: BaseExceptionGroup[BaseException]
) -> BaseException:
    """The exception of the first item, in sample order, whose fetch failed; the others are
    summarised in a note."""
    errors: list[BaseException] = [
        error
        for shard in tasks
        for task in shard
        if task.done() and not task.cancelled() and (error := task.exception()) is not None
    ]
    if not errors:  # pragma: no cover - a group always holds at least one task's error
        errors = list(group.exceptions)
    first = errors[0]
    if len(errors) > 1:
        others = ", ".join(f"{type(e).__name__}: {e}" for e in errors[1:4])
        more = f" (and {len(errors) - 4} more)" if len(errors) > 4 else ""
        annotate(first, f"{len(errors) - 1} other item(s) of this batch failed too: {others}{more}")
    return first


def _drop_failed(
    shards: Sequence[Sequence[int]], raws: list[list[Any]]
) -> tuple[list[list[int]], list[list[Any]]]:
    keep_idx, keep_raw = [], []
    for shard, raw in zip(shards, raws, strict=True):
        pairs = [(i, r) for i, r in zip(shard, raw, strict=True) if not isinstance(r, _Failed)]
        keep_idx.append([i for i, _ in pairs])
        keep_raw.append([r for _, r in pairs])
    return keep_idx, keep_raw


async def _take_async(
    iterator: AsyncIterator[Any], n: int
) -> tuple[list[Any], BaseException | None]:
    """Up to ``n`` items, and the error that stopped the stream early, if any."""
    out: list[Any] = []
    while len(out) < n:
        try:
            out.append(await anext(iterator))
        except StopAsyncIteration:
            break
        except Exception as exc:
            return out, exc
    return out, None


def _indices_text(request: BatchRequest) -> str:
    indices = list(request.indices)
    if len(indices) > 8:
        return f"indices {indices[:8]}... ({len(indices)} in all)"
    return f"indices {indices}"


def _discard(outcome: Outcome) -> None:
    """Drop a produced batch: its views go, so its shared-memory slot returns to the pool."""
    del outcome
