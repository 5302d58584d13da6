"""Awaiting the items of an async dataset, at most ``io_concurrency`` at once across batches.

::

    produce task (batch b) ──fetch(request)──▶ one task per index ── async with io semaphore ──▶
        await dataset.fetch(i)   (a SourceDataset: raw bytes; decode runs later, off the loop)
        await dataset[i]         (any other async map dataset)
    ◀── BatchRequest with raw items, in index order (failed items skipped or raised)

The semaphore is shared by every batch of the epoch, so ``io_concurrency`` bounds the epoch's
requests in flight however many batches are scheduled (``prefetch`` bounds those). Two epochs
iterated at once each have their own: a source's ``max_connections`` bounds them together.

Deadline (``timeout``): a batch's clock runs only while at least one of its items holds an io
slot, and stops while none does. So the time a prefetched batch waits for slots behind the items
of earlier batches is not its time, as in the CPU stage (``_deadline``); the time it is served
is: its items' fetches (the source's retries included), and meanwhile the wait of its other
items for slots (below ``batch_size``, ``io_concurrency`` queues a batch's items behind each
other). At the deadline the batch's fetches are cancelled, and a :class:`LoaderTimeoutError`
names the items still awaited.

Invariant: every held io slot belongs to a batch whose clock runs. So an item that holds a slot
and never returns is cut off at its batch's deadline, and a batch that waits for slots (the
semaphore is FIFO) waits only until the batches ahead of it finish or miss their deadlines: it
never waits forever, and never times out merely for having been queued for a slot. (A wait
inside the source, for a connection of its own pool, is served time: the item holds a slot.)

Cancellation edges: cancelling the produce task cancels the task group, and with it every item
fetch of the batch; nothing is left running. The deadline cancels the same way, from inside.

Errors: the user's exception is raised, not an ``ExceptionGroup`` (``except KeyError`` in the
training loop must keep working), annotated with the index and batch; other items that failed
too are summarised in a note. With ``on_error='skip'`` failed items are dropped and reported to
the skip budget.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from .._batch import annotate, indices_text, stray_cancel
from .._errors import LoaderTimeoutError, timeout_error
from .._stats import Counters
from .._types import BatchRequest, NamedItems, SourceDataset
from ._failures import FailureBudget

__all__ = ["Fetcher"]


class Fetcher:
    """Fetches the items of batches of one async dataset.

    Args:
        dataset: an async map dataset (``await dataset[i]``) or a :class:`SourceDataset`
            (``await dataset.fetch(i)``).
        io_concurrency: item fetches in flight at once, all batches together.
        timeout: seconds a batch's fetch may be served (see the module docstring), or None.
        skip_errors: skip failed items (``on_error='skip'``) instead of failing the batch.
        budget: the epoch's skip budget.
        counters: the loader's live statistics.
    """

    def __init__(
        self,
        dataset: Any,
        io_concurrency: int,
        *,
        timeout: float | None = None,
        skip_errors: bool,
        budget: FailureBudget,
        counters: Counters,
    ) -> None:
        self._get = dataset.fetch if isinstance(dataset, SourceDataset) else dataset.__getitem__
        expect = getattr(dataset, "expect_in_flight", None)
        if callable(expect):
            expect(io_concurrency)  # before any fetch: pools are opened at the first
        self._name = dataset.item_name if isinstance(dataset, NamedItems) else None
        self._io = asyncio.Semaphore(io_concurrency)  # binds to the loop at first use
        self._timeout = timeout
        self._skip_errors = skip_errors
        self._budget = budget
        self._counters = counters

    async def fetch(self, request: BatchRequest) -> BatchRequest:
        """``request`` with its items fetched (``raw``), in the same nesting as its indices.

        Raises:
            Exception: the first failed item's own exception (without ``on_error='skip'``).
            TooManyFailuresError: skipping crossed the skip budget.
            LoaderTimeoutError: the batch was served for ``timeout`` and still awaited items.
        """
        started = time.perf_counter()
        shards: list[Sequence[int]] = cast(
            "list[Sequence[int]]", list(request.indices) if request.sharded else [request.indices]
        )
        tasks: list[list[asyncio.Task[Any]]] = []
        failed_group: BaseExceptionGroup[BaseException] | None = None
        clock = _ServedClock(self._timeout)
        try:
            async with clock.deadline, asyncio.TaskGroup() as group:
                for shard in shards:
                    tasks.append([group.create_task(self._one(i, request, clock)) for i in shard])
        except BaseExceptionGroup as exc:
            failed_group = exc
        except TimeoutError as exc:
            if not clock.deadline.expired():  # pragma: no cover - items' errors come grouped
                raise
            # The deadline and the last item can land in one turn of the loop: then it is whole.
            if not all(t.done() and not t.cancelled() for shard in tasks for t in shard):
                self._counters.timeouts += 1
                raise self._timed_out(request, shards, tasks, clock.served()) from exc
        if failed_group is not None:
            # Raised outside the ``except`` block so the group does not become its context.
            raise _first_failure(tasks, failed_group)
        raws = [[t.result() for t in shard_tasks] for shard_tasks in tasks]
        self._counters.fetch_s += time.perf_counter() - started
        failed = [r for shard in raws for r in shard if isinstance(r, _Failed)]
        if failed:
            shards, raws = _drop_failed(shards, raws)
            skipped = [(f.index, f"{type(f.error).__name__}: {f.error}") for f in failed]
            self._budget.record(0, skipped, request.batch_id)
            error = self._budget.over(request.batch_id, [i for shard in shards for i in shard])
            if error is not None:
                raise error
        if request.sharded:
            return BatchRequest(request.epoch, request.batch_id, shards, True, raws)
        return BatchRequest(request.epoch, request.batch_id, shards[0], False, raws[0])

    def _timed_out(
        self,
        request: BatchRequest,
        shards: list[Sequence[int]],
        tasks: list[list[asyncio.Task[Any]]],
        served: float,
    ) -> LoaderTimeoutError:
        """The error of a batch whose fetch missed its deadline, naming the items it still
        awaited (cut short by the deadline) as the dataset names them (a URL, a path)."""
        awaited = [
            index
            for shard, shard_tasks in zip(shards, tasks, strict=False)
            for index, task in zip(shard, shard_tasks, strict=False)
            if task.cancelled()
        ]
        named = [
            f"{index} ({self._name(index)})" if self._name is not None else str(index)
            for index in awaited[:_NAMED]
        ]
        more = f" and {len(awaited) - _NAMED} more" if len(awaited) > _NAMED else ""
        return timeout_error(
            request.batch_id,
            f"fetching {indices_text(request)}",
            served,
            self._timeout,
            None,
            f"It still awaited item(s) {', '.join(named)}{more}. Try a larger timeout; a read "
            "that never answers is better bounded by the source itself (HTTPDataset's "
            "item_deadline=), which retries it.",
        )

    async def _one(self, index: int, request: BatchRequest, clock: _ServedClock) -> Any:
        async with self._io:
            clock.slot_taken()
            started = time.perf_counter()  # the fetch slot's busy time (fetch_share)
            try:
                try:
                    return await self._get(index)
                except asyncio.CancelledError as exc:
                    # Not this task's own cancellation: the dataset's error (see stray_cancel).
                    if (error := stray_cancel(exc, "the dataset's fetch")) is None:
                        raise
                    raise error from exc
            except Exception as exc:
                if self._skip_errors:
                    return _Failed(index, exc)
                annotate(exc, f"fetching sample index {index} of batch {request.batch_id}")
                raise
            finally:
                self._counters.io_busy_s += time.perf_counter() - started
                clock.slot_given_back()


_NAMED = 4  # items a timeout names (the rest are counted)


class _ServedClock:
    """One batch's fetch deadline, whose clock runs only while an item of the batch holds an io
    slot (see the module docstring); ``deadline`` is entered around the batch's fetches.

    The deadline is moved when the clock starts or stops, never polled: while no item holds a
    slot it is unset, else it is when the time served so far reaches ``timeout``.
    """

    def __init__(self, timeout: float | None) -> None:
        self.deadline = asyncio.timeout(None)
        self._timeout = timeout
        self._holding = 0  # items of the batch holding an io slot
        self._since = 0.0  # loop time the clock last started
        self._served = 0.0  # seconds served before that

    def slot_taken(self) -> None:
        self._holding += 1
        if self._holding == 1 and self._timeout is not None:  # the clock starts
            self._since = asyncio.get_running_loop().time()
            self._move(self._since + self._timeout - self._served)

    def slot_given_back(self) -> None:
        self._holding -= 1
        if self._holding == 0 and self._timeout is not None:  # the clock stops
            self._served += asyncio.get_running_loop().time() - self._since
            self._move(None)

    def served(self) -> float:
        """Seconds the batch has been served (held at least one io slot), until now."""
        running = asyncio.get_running_loop().time() - self._since if self._holding else 0.0
        return self._served + running

    def _move(self, when: float | None) -> None:
        # Once expired, the deadline is cancelling the batch: its items stop, and are not timed.
        if not self.deadline.expired():
            self.deadline.reschedule(when)


@dataclass(frozen=True, slots=True)
class _Failed:
    """An item whose fetch failed under ``on_error='skip'``."""

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
) -> tuple[list[Sequence[int]], list[list[Any]]]:
    keep_idx: list[Sequence[int]] = []
    keep_raw: list[list[Any]] = []
    for shard, raw in zip(shards, raws, strict=True):
        pairs = [(i, r) for i, r in zip(shard, raw, strict=True) if not isinstance(r, _Failed)]
        keep_idx.append([i for i, _ in pairs])
        keep_raw.append([r for _, r in pairs])
    return keep_idx, keep_raw
