"""The producer side of an epoch: the scheduler task and one produce task per batch.

::

    scheduler task (one per epoch) ── permits.acquire() ──▶ reorder.expect(batch_id)
       │ map data:   pulls (batch_id, indices) from the plan (the batch sampler)
       │ streams:    round-robin over the runner's streams (one per worker)
       │ async stream: pulls items on this loop, then hands them over like map data;
       │               a resumable one's state is taken after each batch (one reader)
       ▼
    produce task (one per batch)
       │ async map data: Fetcher.fetch: await the items, io_concurrency at once,
       │                 under a deadline that counts only time being served      (_fetch)
       │ make: runner.start_make / runner.pull under the deadline, with retries  (_deadline)
       ▼
    reorder.put_nowait(Outcome) ──▶ wake the consumer (_epoch)

Who owns what: the scheduler owns the sampler iterator (or the streams) and creates produce
tasks; it stops at the end of the plan or of every stream. A produce task owns its batch until
it stores an :class:`Outcome` (a value or an exception) in the reorder buffer: it never raises,
so no task exception goes unretrieved. A failing sampler or stream is delivered in order too: it
takes a permit and the next unused batch id like any batch, or, if it failed after its batch id
was already expected (a batch that cannot become a request), that id.

Invariant: every batch id the reorder buffer expects gets exactly one outcome (else the consumer
waits for it forever: no deadline covers a batch that no task produces).

Resume of a stream (a :class:`~aioloader._types.ResumableStream`): each made batch carries its
reader's dataset state (``Made.position``; the async stream's is read here), kept by batch id
until the consumer takes the batch (:meth:`Producer.position`). A resumed epoch hands each
reader its saved state with its first request and begins the round-robin at the reader after
the last batch taken, so batches come in the order an uninterrupted epoch gives them. The
async stream is read on this loop, so it is one reader (0 of 1) whatever ``num_workers`` is.
Each position is numbered per reader (``seq``), for the book's "every earlier batch of the
reader taken" rule (``_resume``).

The skip budget of a resumed epoch (any kind of data) starts from the count of the batches
taken before (``StreamResume.skips``); each batch's own count joins it as the consumer takes the
batch (:meth:`Producer.position`), so a state saved mid-epoch holds the skips of exactly the
batches it says were taken (``_failures``).

A reader whose batch failed (its stream's error, its deadline, its worker's death) has ended
for good: its requests for later batches still on their way are cancelled and end (``END``),
never served from a stuck thread's queue or a replacement worker's fresh stream.

Fast path: a sync map dataset on threads with no deadline and no retries needs no task per
batch: the thread's future (done at once if made inline) reports straight into the reorder
buffer. For batches of tens of microseconds, the task machinery is most of the cost."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import sys
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from typing import Any, Final

import numpy as np

from .._batch import (
    annotate,
    continued_share,
    indices_text,
    not_an_exit,
    stray_cancel,
    stream_batch,
    users_interrupt,
)
from .._config import LoaderConfig
from .._errors import LoaderTimeoutError, WorkerCrashedError, out_of_descriptors_note
from .._sampling import StreamOrders, every_nth_async, stream_share
from .._stats import Counters, current_counters
from .._tree import iter_leaves
from .._types import (
    END,
    BatchRequest,
    InlineMaking,
    Made,
    RankShardedStream,
    Route,
    Runner,
    StreamPosition,
    StreamRequest,
    StreamResume,
    check_readers,
    stream_state,
)
from ._deadline import DeadlinePolicy, run_attempts
from ._failures import FailureBudget
from ._fetch import Fetcher
from ._reorder import Outcome, ReorderBuffer

__all__ = ["BUSY", "BYTES_WALK_BUDGET_S", "Producer"]

#: What :meth:`Producer.make_inline` says on the loop while a thread is making a batch.
BUSY: Final = Outcome(-1)

# The tasks and futures of every running epoch, per loop, each held until it is done. The loop
# holds its tasks only weakly: when a consumer drops an epoch whose iterator is in a reference
# cycle (an error it kept holds the frame that held the iterator), the garbage collector would
# find the epoch and its pending tasks unreachable together and finalize the tasks, closing
# their coroutines mid-await ("Task was destroyed but it is pending!", then "cannot reuse already
# awaited coroutine" when the close cancels them), instead of letting the iterator's finalizer
# close the epoch, which cancels them properly.
_RUNNING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, set[asyncio.Future[Any]]] = (
    weakref.WeakKeyDictionary()
)


def _hold(future: asyncio.Future[Any]) -> None:
    """Keep ``future`` reachable until it is done (see :data:`_RUNNING`)."""
    held = _RUNNING.setdefault(future.get_loop(), set())
    held.add(future)
    future.add_done_callback(held.discard)


#: Counting a batch's bytes (for bytes/s) walks its leaves on the loop: microseconds for a few
#: tensors, hundreds of them for a list of hundreds of objects. Batches are walked often enough
#: that the walks cost at most this much per batch on average; the batches in between are
#: estimated from the last walked one's bytes per sample (exact for batches of one shape).
BYTES_WALK_BUDGET_S = 5e-6
_MAX_UNWALKED = 256  # walk at least every this many batches, to follow a change of shape


_READINGS = itertools.count()  # one number per epoch iterated: see StreamRequest.reading


class Producer:
    """Schedules and produces the batches of one epoch into ``reorder``.

    Args:
        config: the loader's settings.
        epoch: the epoch number.
        runner: where batches are made.
        counters: the loader's live statistics.
        plan: for map-style data, the ``(batch_id, indices)`` pairs still to produce.
        epoch_samples: the whole epoch's length in samples, None where unknown (a fraction of
            ``max_failures`` is of it).
        dataset: the dataset (async fetches and async streams read it on the loop).
        reorder: where outcomes go; the consumer takes them out.
        permits: taken per batch before it is scheduled; the consumer gives them back.
        wake: tells the consumer an outcome arrived (or scheduling ended).
        resume: for a stream, how a resumed epoch begins (``None``: from the start).
    """

    def __init__(
        self,
        config: LoaderConfig,
        epoch: int,
        runner: Runner,
        counters: Counters,
        *,
        plan: Iterable[tuple[int, Any]] | None,
        epoch_samples: int | None = None,
        dataset: Any,
        reorder: ReorderBuffer,
        permits: asyncio.Semaphore,
        wake: Callable[[], None],
        resume: StreamResume | None = None,
    ) -> None:
        self._config = config
        self._resume = resume if resume is not None else StreamResume(first_id=0)
        self._positions: dict[int, StreamPosition] = {}  # batch id -> stream position, until taken
        self._epoch = epoch
        self._runner = runner
        self._counters = counters
        self._plan = plan
        self._dataset = dataset
        self._orders = StreamOrders(type(dataset).__qualname__, config.num_workers)
        self._reading = next(_READINGS)  # this epoch's reading of a stream, apart from others
        self._ended: set[int] = set()  # the readers whose stream ended (stream epochs)
        # Each reader's requests on their way, by batch id (stream epochs): a reader that
        # failed ends them (see _end_reader).
        self._pulls: dict[int, dict[int, asyncio.Future[Any]]] = {}
        self._failed_at: dict[int, int] = {}  # reader -> the batch id its stream failed at
        self._reorder = reorder
        self._permits = permits
        self._wake = wake
        self._policy = DeadlinePolicy(config.timeout, config.max_retries)
        self._budget = FailureBudget(
            config.max_failures, counters, epoch_samples, taken=self._resume.skips
        )
        self._fetcher = (
            Fetcher(
                dataset,
                config.io_concurrency,
                timeout=config.timeout,
                skip_errors=config.skip_errors,
                budget=self._budget,
                counters=counters,
            )
            # Ray actors fetch an async dataset's items themselves (aioloader._ray).
            if config.kind == "async_map" and not getattr(runner, "fetches", False)
            else None
        )
        self._scheduler: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Future[Any]] = set()  # produce tasks and fast-path futures
        self._sizes: dict[int, tuple[int, int]] = {}  # batch id -> (samples, bytes), until taken
        self._next_id = 0  # the next batch id no scheduled batch uses
        # make_inline reads the plan one ahead: the pair read, the error reading it, or None.
        self._ahead: tuple[int, Any] | Exception | None = None
        self._claimed: int | None = None  # expected, and not yet handed to a task or future
        self._unwalked = 0  # batches whose bytes are estimated before the next walk
        self._bytes_per_sample = 0.0  # of the last walked batch
        self.done = False  # the scheduler has scheduled its last batch
        # The consumer may make the plan's batches itself on the loop (Epoch sets it): then
        # the scheduler parks once batches prove cheap, and the consumer takes over.
        self.may_park = False
        self.parked = False  # the scheduler stopped for the consumer; done is not set
        self.closed = False  # outcomes that arrive now are dropped

    def start(self) -> None:
        """Start the scheduler on the running loop."""
        kind = self._config.kind
        body: Callable[[], Awaitable[None]]
        if kind in ("map", "async_map"):
            body = self._schedule_plan
        elif kind == "iterable":
            body = self._schedule_streams
        else:
            body = self._schedule_async_stream
        self._scheduler = asyncio.create_task(
            self._run_scheduler(body), name=f"aioloader-epoch-{self._epoch}"
        )
        _hold(self._scheduler)

    def taken(self, batch_id: int) -> tuple[int, int]:
        """The samples and bytes in ``batch_id``, forgotten once asked (the batch was taken)."""
        return self._sizes.pop(batch_id, (0, 0))

    def position(self, batch_id: int) -> StreamPosition | None:
        """Where a resumable stream's reader stood after ``batch_id``, forgotten once asked.

        Asked as the consumer takes the batch (its batch, its error, or an empty batch), when
        the batch's skips join the count a resumed epoch starts from (``StreamResume.skips``)."""
        self._budget.took(batch_id)
        return self._positions.pop(batch_id, None)

    def cancel(self) -> list[asyncio.Future[Any]]:
        """Stop storing outcomes and cancel every task; returns them, to be awaited."""
        self.closed = True
        tasks = [t for t in (self._scheduler, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        return tasks

    # -- inline, with no loop -------------------------------------------------------------------

    def make_inline(self, inline: InlineMaking, *, on_loop: bool = False) -> Outcome | None:
        """Make the plan's next batch in the calling thread (``Epoch.next_inline``, or on the
        loop with the scheduler parked); None once the plan ran out, :data:`BUSY` (on the loop,
        which never waits) while a thread makes a batch. Read one pair ahead, so ``done`` is
        set as the last batch is made; a failing sampler is delivered in order and ends the
        epoch, as scheduled. On the loop, a ``SystemExit`` from the dataset is the batch's
        error, as from the helper thread (only Ctrl-C is raised as it is)."""
        assert self._plan is not None
        if self._ahead is None:
            self._read_ahead()
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if isinstance(ahead, Exception):
            self.done = True
            return Outcome(self._next_id, error=ahead)
        batch_id, indices = ahead
        self._next_id = batch_id + 1
        request = request_for(self._epoch, batch_id, indices)
        try:
            made = inline.make(request, Route.LOOP if on_loop else Route.CALLER)
        except Exception as exc:
            outcome = Outcome(batch_id, error=exc)
        except BaseException as exc:
            if not on_loop or users_interrupt(exc):
                raise  # in the caller's own thread, as torch's num_workers=0; or Ctrl-C
            where = "the event loop (a batch made inline)"
            outcome = Outcome(batch_id, error=not_an_exit(exc, where, batch_id))
        else:
            if made is None:  # a thread makes one: the pair waits for the scheduler
                self._ahead = ahead
                return BUSY
            outcome = self._accounted(batch_id, made, request)
        self._read_ahead()
        return outcome

    def _read_ahead(self) -> None:
        assert self._plan is not None
        try:
            self._ahead = next(iter(self._plan))
        except StopIteration:
            self._ahead = None
            self.done = True
        except Exception as exc:
            self._ahead = exc

    @property
    def can_leave_inline(self) -> bool:
        """Whether the loop can take over now (a sampler's error read ahead is delivered here)."""
        return not isinstance(self._ahead, Exception)

    def leave_inline(self, put_back: Callable[[tuple[int, Any]], None]) -> None:
        """Hand the pair read ahead back to the plan (``put_back``), for the scheduler."""
        ahead, self._ahead = self._ahead, None
        if isinstance(ahead, tuple):
            put_back(ahead)

    def unpark(self, put_back: Callable[[tuple[int, Any]], None]) -> None:
        """The consumer stops making batches on the loop: the scheduler goes on from the
        pair read ahead (batches got costly, or a thread makes one)."""
        self.leave_inline(put_back)
        self.parked = False
        self.start()

    # -- scheduling ----------------------------------------------------------------------------

    async def _scheduled(self, batch_id: int) -> None:
        if self._permits.locked():  # every permit taken: the time until one comes back counts
            started = time.perf_counter()
            try:
                await self._permits.acquire()
            finally:
                self._counters.permit_wait_s += time.perf_counter() - started
        else:
            await self._permits.acquire()
        self._reorder.expect(batch_id)
        self._claimed = batch_id  # until a task, a future or an outcome owns it

    def _store(self, outcome: Outcome) -> None:
        if outcome.batch_id == self._claimed:
            self._claimed = None
        if outcome.error is not None:
            note = out_of_descriptors_note(outcome.error, f"batch {outcome.batch_id}")
            if note is not None:
                annotate(outcome.error, note)
        if self.closed:
            return  # dropped: its batch's views go, and with the last one its slot
        self._reorder.put_nowait(outcome)
        self._wake()

    def _spawn(self, coro: Coroutine[Any, Any, None], batch_id: int) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=f"aioloader-batch-{batch_id}")
        self._claimed = None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        _hold(task)
        return task

    async def _run_scheduler(self, body: Callable[[], Awaitable[None]]) -> None:
        """Run a scheduler body; if the sampler or stream fails, deliver the error in order."""
        # In this task's own context, inherited by the produce and fetch tasks it creates:
        # remote sources read there count their requests, retries and bytes in these counters.
        current_counters.set(self._counters)
        try:
            await body()
        except (asyncio.CancelledError, GeneratorExit):
            raise  # cancelled, or the task is being collected with its abandoned epoch
        except BaseException as exc:
            batch_id = self._claimed
            if batch_id is None:  # failed before taking a batch id: the error takes the next
                batch_id = self._next_id
                await self._scheduled(batch_id)
            self._claimed = None
            self._reorder.put_nowait(Outcome(batch_id, error=exc))
        finally:
            self.done = self.done or not self.parked
            self._wake()

    async def _schedule_plan(self) -> None:
        assert self._plan is not None
        config = self._config
        fast = config.kind == "map" and config.timeout is None and config.max_retries == 0
        for batch_id, indices in self._plan:
            self._next_id = batch_id + 1
            await self._scheduled(batch_id)
            request = request_for(self._epoch, batch_id, indices)
            if fast:
                future = self._runner.start_make(request)
                self._claimed = None
                if future.done():  # made inline (cheap): no callback round through the loop
                    self._made_fast(request, future)
                    inline = self._runner.inline
                    if (
                        self.may_park
                        and inline is not None
                        and inline.route(on_loop=True) is Route.LOOP
                    ):
                        # The consumer makes the rest (Epoch._next_on_loop) from the pair read
                        # here, so that the end of the plan sets done at the last batch still.
                        self._read_ahead()
                        self.parked = not self.done
                        return
                    continue
                self._tasks.add(future)
                _hold(future)
                future.add_done_callback(functools.partial(self._made_fast, request))
            else:
                self._spawn(self._produce_map(request), batch_id)

    async def _schedule_streams(self) -> None:
        """Round-robin over the runner's streams (one per worker); ids stay in that order."""
        ended = self._ended
        streams = self._runner.streams
        states = dict(self._resumed_states(streams))
        opened: set[int] = set()
        pulled = [0] * streams  # requests made to each reader this epoch
        counter = itertools.count(self._resume.first_id)
        first = (self._resume.last + 1) % streams
        for turn in itertools.cycle([*range(first, streams), *range(first)]):
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
                self._epoch,
                batch_id,
                self._batch_size,
                self._config.drop_last,
                opens=turn not in opened,
                resume=states.pop(turn, None),  # a reader's first request only
                reading=self._reading,
            )
            opened.add(turn)
            reader = (turn, pulled[turn])
            pulled[turn] += 1
            task = self._spawn(self._produce_stream(request, reader, ended), batch_id)
            self._pulls.setdefault(turn, {})[batch_id] = task
            task.add_done_callback(functools.partial(self._pulled, turn, batch_id))

    @property
    def readers_ended(self) -> bool:
        """A stream epoch whose every reader's stream ended (their ends may wait in the
        reorder buffer for the consumer)."""
        return bool(self._ended) and len(self._ended) >= self._runner.streams

    def _resumed_states(self, streams: int) -> dict[int, Any]:
        """The saved state of each reader of a resumed epoch (checked against ``streams``)."""
        resume = self._resume
        if resume.streams is not None:
            check_readers(resume.streams, streams)
        return dict(resume.states)

    async def _schedule_async_stream(self) -> None:
        dataset = self._dataset
        shard = self._config.shard
        saved = self._resumed_states(1).get(0)  # the loop is the one reader
        if saved is not None:
            dataset.load_state_dict(saved)
        iterator: AsyncIterator[Any]
        if isinstance(dataset, RankShardedStream):
            # It splits itself (by whole shards) and orders itself by the epoch.
            dataset.set_epoch(self._epoch)
            if shard is not None:
                dataset.set_rank(shard.rank, shard.replicas)
            iterator = aiter(dataset)
        else:
            start, step = stream_share(shard, 0, 1)  # a rank's share, distributed
            share = continued_share(start, step, saved is not None)
            iterator = every_nth_async(aiter(dataset), *share)
        size = self._batch_size
        self._next_id = self._resume.first_id
        try:
            while True:
                started = time.perf_counter()
                samples, error = await take_async(iterator, size)
                self._counters.stream_s += time.perf_counter() - started
                position = stream_state(self._dataset) if samples else None
                short = len(samples) < size
                batch = END
                if samples:
                    batch, error = stream_batch(samples, error, size, self._config.drop_last)
                if batch is not END:
                    batch_id = self._next_id
                    self._next_id += 1
                    if position is not None:  # the stream stands right after this batch
                        seq = batch_id - self._resume.first_id
                        self._positions[batch_id] = StreamPosition(0, 1, position, seq)
                    await self._scheduled(batch_id)
                    request = BatchRequest(
                        self._epoch, batch_id, list(range(len(batch))), raw=batch
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

    @property
    def _batch_size(self) -> int:
        return self._config.batch_size or 1

    # -- producing -------------------------------------------------------------------------------

    def _made_fast(self, request: BatchRequest, future: asyncio.Future[Made]) -> None:
        self._tasks.discard(future)
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            if isinstance(error, WorkerCrashedError):
                annotate(error, f"batch {request.batch_id}: {indices_text(request)}")
            self._store(Outcome(request.batch_id, error=error))
        else:
            self._store(self._accounted(request.batch_id, future.result(), request))

    async def _produce_map(self, request: BatchRequest) -> None:
        if self._fetcher is not None:
            # The fetch has a deadline of its own (_fetch): an item that never arrives must not
            # stall the epoch. (The CPU stage after it gets a deadline of its own.)
            try:
                request = await self._fetcher.fetch(request)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                self._store(Outcome(request.batch_id, error=exc))
                return
        await self._produce_request(request)

    async def _produce_request(self, request: BatchRequest) -> None:
        self._store(
            await self._attempts(
                request,
                lambda: self._runner.start_make(request),
                lambda: indices_text(request),
            )
        )

    async def _produce_stream(
        self, request: StreamRequest, reader: tuple[int, int], ended: set[int]
    ) -> None:
        stream = reader[0]  # (stream, seq)
        outcome = await self._attempts(
            request,
            lambda: self._runner.pull(request, stream),
            lambda: f"the stream of worker {stream}",
            retry=False,  # a stream cannot be rewound: a lost batch is an error, never a re-read
            reader=reader,
        )
        if outcome.value is END or outcome.error is not None:
            ended.add(stream)
        if outcome.error is not None:
            # One failure (a Ray actor's death) can fail several requests of a reader at once,
            # in any order: the reader ends once, at its earliest failed batch; the outcomes
            # of its later requests are the end of it (END), not more errors.
            earlier = [
                task
                for batch_id, task in self._pulls.get(stream, {}).items()
                if batch_id < request.batch_id and not task.done()
            ]
            if earlier:
                await asyncio.wait(earlier)
            failed_at = self._failed_at.get(stream)
            if failed_at is not None and failed_at < request.batch_id:
                self._store(Outcome(request.batch_id, value=END))
                return
            self._failed_at[stream] = request.batch_id
            if isinstance(outcome.error, LoaderTimeoutError):
                annotate(
                    outcome.error,
                    f"the stream of worker {stream} ends here: a stream's batch is never read "
                    "again (max_retries does not apply to it)",
                )
            self._end_reader(stream, request.batch_id)
        self._store(outcome)

    def _end_reader(self, stream: int, failed: int) -> None:
        """Reader ``stream`` failed at batch ``failed`` (its error, or its deadline): it has
        ended for good, so its requests for later batches end too (each stores ``END``).

        They may never be served: a thread stuck in a hung stream holds the stream, and the
        requests queued behind it never start, so no deadline of theirs runs (the epoch
        waited for ever). A worker process that was replaced would read the stream afresh
        from its start for them (samples twice)."""
        for batch_id, task in list(self._pulls.get(stream, {}).items()):
            if batch_id > failed and not task.done():
                task.cancel()  # (its END is stored by _pulled, even if it never started)

    def _pulled(self, stream: int, batch_id: int, task: asyncio.Future[Any]) -> None:
        """A request of reader ``stream`` is over; one cancelled by :meth:`_end_reader` (not
        by the epoch's close) gets its outcome here: ``END``."""
        self._pulls.get(stream, {}).pop(batch_id, None)
        if task.cancelled() and not self.closed and stream in self._ended:
            self._store(Outcome(batch_id, value=END))

    async def _attempts(
        self,
        request: BatchRequest | StreamRequest,
        attempt: Callable[[], Awaitable[Made]],
        describe: Callable[[], str],
        *,
        retry: bool = True,
        reader: tuple[int, int] | None = None,
    ) -> Outcome:
        batch_id = request.batch_id
        try:
            made = await run_attempts(
                attempt,
                request=request,
                describe=describe,
                runner=self._runner,
                policy=self._policy,
                counters=self._counters,
                retry=retry,
            )
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            return Outcome(batch_id, error=exc)
        if made.order is not None:  # a worker's first batch of a stream it splits with others
            try:
                self._orders.note(made.order)
            except Exception as exc:  # the warning, where the warnings filter makes it an error
                return Outcome(batch_id, error=exc)
        if reader is not None and made.position is not None:  # (stream, seq)
            stream, seq = reader
            streams = self._runner.streams
            self._positions[batch_id] = StreamPosition(stream, streams, made.position, seq)
        return self._accounted(
            batch_id, made, request if isinstance(request, BatchRequest) else None
        )

    def _bytes(self, made: Made) -> int:
        """Bytes of the arrays and tensors of ``made``, walked or estimated (see
        :data:`BYTES_WALK_BUDGET_S`)."""
        if self._unwalked > 0:
            self._unwalked -= 1
            return round(made.samples * self._bytes_per_sample)
        started = time.perf_counter()
        nbytes = nbytes_of(made.batch)
        cost = time.perf_counter() - started
        self._unwalked = min(_MAX_UNWALKED, int(cost / BYTES_WALK_BUDGET_S))
        self._bytes_per_sample = nbytes / made.samples if made.samples else 0.0
        return nbytes

    def _accounted(self, batch_id: int, made: Made, request: BatchRequest | None) -> Outcome:
        """Count a made batch in the statistics and the skip budget; its outcome.

        ``request`` is the map-style batch's (None for a stream's): where the batch crosses the
        skip budget, the error names its samples that were read, by index where known.

        Never raises: it runs where nothing else would store the batch's outcome (the fast
        path's done callback, after the attempts' ``try``), so an error here is the batch's
        (the invariant of the module docstring). Its bytes are counted by a walk that cannot
        fail (:func:`nbytes_of`)."""
        try:
            return self._counted(batch_id, made, request)
        except Exception as exc:  # whatever failed in the counting: never a batch without one
            return Outcome(batch_id, error=exc)

    def _counted(self, batch_id: int, made: Made, request: BatchRequest | None) -> Outcome:
        self._counters.read_s += made.read_s
        self._counters.collate_s += made.collate_s
        self._sizes[batch_id] = (made.samples, self._bytes(made))
        self._budget.record(made.samples, made.skipped, batch_id)
        if made.skipped:
            read: list[int] | int = made.samples
            if request is not None and self._config.kind in ("map", "async_map"):  # dataset indices
                failed = {index for index, _ in made.skipped}
                read = [i for i in flat_indices(request) if i not in failed]
            error = self._budget.over(batch_id, read)
            if error is not None:
                return Outcome(batch_id, error=error)  # named in the error, not delivered
        return Outcome(batch_id, value=made.batch)


# -- helpers of the producer alone ------------------------------------------------------------


def request_for(epoch: int, batch_id: int, indices: Any) -> BatchRequest:
    """The request for ``indices``: a list of indices, or of shards' lists of them."""
    sharded = bool(indices) and isinstance(indices[0], list)  # keys may be tuples
    return BatchRequest(epoch, batch_id, indices, sharded=sharded)


def flat_indices(request: BatchRequest) -> list[int]:
    """A map-style request's indices, its shards' one after another."""
    if request.sharded:
        return [i for shard in request.indices for i in shard]  # type: ignore[union-attr]
    return list(request.indices)  # type: ignore[arg-type]


def nbytes_of(batch: Any) -> int:
    """Bytes of the arrays and tensors in ``batch`` (for the bytes/s of the statistics); 0
    where its leaves cannot be walked.

    A statistic never fails a batch nor loses it: the batch is the user's (a ``collate_fn``'s
    Mapping whose ``values()`` raises, a list that holds itself), it is handed over as it is,
    and only its bytes go uncounted. (Raised here, the walk's error left the batch without an
    outcome, and the consumer waited for it for ever.)
    """
    torch = sys.modules.get("torch")  # a batch can hold tensors only once torch is imported
    total = 0
    try:
        for leaf in iter_leaves(batch):
            if isinstance(leaf, np.ndarray):
                total += leaf.nbytes
            elif torch is not None and isinstance(leaf, torch.Tensor):
                total += leaf.element_size() * leaf.nelement()
    except Exception:  # RecursionError too: a container that holds itself
        return 0
    return total


async def take_async(
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
        except asyncio.CancelledError as exc:
            if (error := stray_cancel(exc, "the async stream")) is None:
                raise
            return out, error
    return out, None
