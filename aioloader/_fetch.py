"""Awaiting the items of an async dataset, at most ``io_concurrency`` at once across batches.

::

    produce task (batch b) ──fetch(request)──▶ one task per index ── async with io semaphore ──▶
        await dataset.fetch(i)   (a SourceDataset: raw bytes; decode runs later, off the loop)
        await dataset[i]         (any other async map dataset)
    ◀── BatchRequest with raw items, in index order (failed items skipped or raised)

The semaphore is shared by every batch of the loader's loop, so ``io_concurrency`` bounds the
requests in flight however many batches are scheduled (``prefetch`` bounds those).

Cancellation edges: cancelling the produce task cancels the task group, and with it every item
fetch of the batch; nothing is left running.

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

from ._batch import annotate, stray_cancel
from ._failures import FailureBudget
from ._stats import Counters
from ._types import BatchRequest, NamedItems, SourceDataset

__all__ = ["Fetcher"]


class Fetcher:
    """Fetches the items of batches of one async dataset.

    Args:
        dataset: an async map dataset (``await dataset[i]``) or a :class:`SourceDataset`
            (``await dataset.fetch(i)``).
        io_concurrency: item fetches in flight at once, all batches together.
        skip_errors: skip failed items (``on_error='skip'``) instead of failing the batch.
        budget: the epoch's skip budget.
        counters: the loader's live statistics.
    """

    def __init__(
        self,
        dataset: Any,
        io_concurrency: int,
        *,
        skip_errors: bool,
        budget: FailureBudget,
        counters: Counters,
    ) -> None:
        self._get = dataset.fetch if isinstance(dataset, SourceDataset) else dataset.__getitem__
        expect = getattr(dataset, "expect_in_flight", None)
        if callable(expect):
            expect(io_concurrency)  # before any fetch: pools are opened at the first
        self._name = dataset.item_name if isinstance(dataset, NamedItems) else None
        self._awaited: dict[int, list[int]] = {}  # batch id -> indices its cancel cut short
        self._io = asyncio.Semaphore(io_concurrency)  # binds to the loop at first use
        self._skip_errors = skip_errors
        self._budget = budget
        self._counters = counters

    async def fetch(self, request: BatchRequest) -> BatchRequest:
        """``request`` with its items fetched (``raw``), in the same nesting as its indices.

        Raises:
            Exception: the first failed item's own exception (without ``on_error='skip'``).
            TooManyFailuresError: skipping crossed the skip budget.
        """
        started = time.perf_counter()
        shards: list[Sequence[int]] = cast(
            "list[Sequence[int]]", list(request.indices) if request.sharded else [request.indices]
        )
        tasks: list[list[asyncio.Task[Any]]] = []
        failed_group: BaseExceptionGroup[BaseException] | None = None
        try:
            async with asyncio.TaskGroup() as group:
                for shard in shards:
                    tasks.append([group.create_task(self._one(i, request)) for i in shard])
        except BaseExceptionGroup as exc:
            failed_group = exc
        except asyncio.CancelledError:  # a deadline, or the epoch closing: say what was awaited
            self._awaited[request.batch_id] = [
                index
                for shard, shard_tasks in zip(shards, tasks, strict=False)
                for index, task in zip(shard, shard_tasks, strict=False)
                if task.cancelled()
            ]
            raise
        if failed_group is not None:
            # Raised outside the ``except`` block so the group does not become its context.
            raise _first_failure(tasks, failed_group)
        raws = [[t.result() for t in shard_tasks] for shard_tasks in tasks]
        self._counters.fetch_s += time.perf_counter() - started
        failed = [r for shard in raws for r in shard if isinstance(r, _Failed)]
        if failed:
            shards, raws = _drop_failed(shards, raws)
            skipped = [(f.index, f"{type(f.error).__name__}: {f.error}") for f in failed]
            self._budget.record(0, skipped)
            error = self._budget.over(request.batch_id, [i for shard in shards for i in shard])
            if error is not None:
                raise error
        if request.sharded:
            return BatchRequest(request.epoch, request.batch_id, shards, True, raws)
        return BatchRequest(request.epoch, request.batch_id, shards[0], False, raws[0])

    def awaited(self, batch_id: int) -> str:
        """The items batch ``batch_id`` still awaited when its fetch was cancelled (by its
        deadline), named as the dataset names them (a URL, a path); forgotten once told."""
        indices = self._awaited.pop(batch_id, [])
        named = [
            f"{index} ({self._name(index)})" if self._name is not None else str(index)
            for index in indices[:_NAMED]
        ]
        more = f" and {len(indices) - _NAMED} more" if len(indices) > _NAMED else ""
        return ", ".join(named) + more

    def forget(self, batch_id: int) -> None:
        self._awaited.pop(batch_id, None)

    async def _one(self, index: int, request: BatchRequest) -> Any:
        async with self._io:
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


_NAMED = 4  # items a timeout names (the rest are counted)


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
