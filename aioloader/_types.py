"""The protocols users plug in through.

Nothing here needs subclassing: a torch ``Dataset``, a list, a numpy array, or any object with
the right methods fits. The loader tells the kinds of dataset apart at construction with
:func:`dataset_kind`:

- map-style: ``__getitem__`` and ``__len__``; ``__getitem__`` may be ``async def``
  (an :class:`AsyncDataset`), and an optional ``__getitems__`` (sync or async) reads a whole
  batch at once;
- iterable: ``__iter__`` (an :class:`IterableDataset`) or ``__aiter__`` (an
  :class:`AsyncIterableDataset`) and no usable ``__getitem__``.

It also holds the records and seams that cross module boundaries inside the package, so that
every module can name them without importing a module above its own level:

- :class:`BatchRequest` / :class:`StreamRequest`: what a producer asks a runner for;
- :class:`Made`: a batch as made (in a thread or a worker) with its skips and timings; it is
  the one record of a made batch from the worker back to the epoch;
- :data:`END` and :data:`EMPTY_BATCH`: the only two "no batch here" markers (a stream ran out;
  every sample of a batch was skipped);
- :class:`Runner`: where the CPU work of a batch runs (threads or worker processes);
- :class:`SourceDataset`: a two-stage dataset (``fetch`` on the loop, ``decode`` off it);
  :class:`DecodingStream`: an async stream whose raw items are decoded off the loop;
  :class:`RankShardedStream`: an async stream that takes its epoch and rank share itself.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, TypeVar, runtime_checkable

__all__ = [
    "EMPTY_BATCH",
    "END",
    "AsyncDataset",
    "AsyncIterableDataset",
    "BatchRequest",
    "CollateFn",
    "Dataset",
    "DatasetKind",
    "DecodingStream",
    "IterableDataset",
    "Made",
    "RankShardedStream",
    "Runner",
    "Sampler",
    "SourceDataset",
    "Stateful",
    "StreamRequest",
    "dataset_kind",
]

T_co = TypeVar("T_co", covariant=True)

DatasetKind = Literal["map", "async_map", "iterable", "async_iterable"]


@runtime_checkable
class Dataset(Protocol[T_co]):
    """A map-style dataset: ``dataset[i]`` for ``0 <= i < len(dataset)``."""

    def __getitem__(self, index: int, /) -> T_co: ...

    def __len__(self) -> int: ...


@runtime_checkable
class AsyncDataset(Protocol[T_co]):
    """A map-style dataset whose items are awaited: ``await dataset[i]``."""

    def __getitem__(self, index: int, /) -> Awaitable[T_co]: ...

    def __len__(self) -> int: ...


@runtime_checkable
class IterableDataset(Protocol[T_co]):
    """A stream of samples. In a worker, shard with :func:`aioloader.get_worker_info`."""

    def __iter__(self) -> Iterator[T_co]: ...


@runtime_checkable
class AsyncIterableDataset(Protocol[T_co]):
    """An asynchronous stream of samples, pulled on the event loop."""

    def __aiter__(self) -> AsyncIterator[T_co]: ...


@runtime_checkable
class Sampler(Protocol):
    """Yields dataset indices (a sampler) or lists of them (a batch sampler)."""

    def __iter__(self) -> Iterator[Any]: ...


class CollateFn(Protocol):
    """Turns a list of samples into one batch."""

    def __call__(self, samples: Sequence[Any], /) -> Any: ...


@runtime_checkable
class Stateful(Protocol):
    """Something whose position can be saved and restored exactly."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


@runtime_checkable
class SourceDataset(Protocol[T_co]):
    """A two-stage async dataset: ``await fetch(i)`` gets raw bytes on the event loop (many at
    once), ``decode(raw)`` turns them into a sample off the loop (in a worker or a thread).

    The ready sources (:mod:`aioloader.sources`) are of this kind; so is any dataset with
    ``__len__``, an async ``fetch`` and a sync ``decode``.
    """

    def __len__(self) -> int: ...

    def fetch(self, index: int, /) -> Awaitable[Any]: ...

    def decode(self, raw: Any, /) -> T_co: ...


@runtime_checkable
class DecodingStream(Protocol[T_co]):
    """An async stream in two stages: ``__aiter__`` yields raw items on the event loop, and
    ``decode(raw)`` turns each into a sample off the loop (in a worker or a thread), as a
    :class:`SourceDataset` does for map-style data (``aioloader.sources.TarDataset``)."""

    def __aiter__(self) -> AsyncIterator[Any]: ...

    def decode(self, raw: Any, /) -> T_co: ...


@runtime_checkable
class RankShardedStream(Protocol):
    """An async stream that splits itself between ranks (by whole shards, say) and orders
    itself by epoch: before each epoch the loader calls ``set_epoch`` and, when it shards by
    rank, ``set_rank``, instead of keeping every ``R``-th item of the stream.

    If it is also :class:`Stateful`, its ``state_dict()`` must describe the position after the
    items yielded so far: the loader takes one after each batch it pulls and saves the one of
    the last batch its consumer took; ``load_state_dict`` must make the next ``__aiter__``
    continue from there.
    """

    def __aiter__(self) -> AsyncIterator[Any]: ...

    def set_epoch(self, epoch: int, /) -> None: ...

    def set_rank(self, rank: int, world_size: int, /) -> None: ...


@runtime_checkable
class AsyncCloseable(Protocol):
    """A dataset that holds sessions or connections: the loader awaits ``aclose()`` when it
    closes."""

    def aclose(self) -> Awaitable[Any]: ...


# -- records that cross module boundaries ----------------------------------------------------


class _Marker:
    """The type of :data:`END` and :data:`EMPTY_BATCH`. A marker pickles by reference, so it is
    the same object in the main process after a round trip from a worker (``is`` tests work)."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __reduce__(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return self._name


END: Final[Any] = _Marker("END")
"""In place of a batch: the stream ran out (iterable datasets). Never reaches the consumer."""

EMPTY_BATCH: Final[Any] = _Marker("EMPTY_BATCH")
"""In place of a batch whose every sample was skipped (``on_error='skip'``). Never reaches the
consumer; the batch counts as done for resume."""


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """A map-style batch to make: its id, the indices (a list of shards for sharded batches), and
    the samples already fetched by the event loop (async datasets), in the same nesting."""

    epoch: int
    batch_id: int
    indices: Sequence[int] | Sequence[Sequence[int]]
    sharded: bool = False
    raw: Sequence[Any] | None = None


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """The next batch of a stream (iterable datasets) for ``epoch``."""

    epoch: int
    batch_id: int
    batch_size: int
    drop_last: bool


@dataclass(slots=True)
class Made:
    """A made batch (or :data:`END` / :data:`EMPTY_BATCH`), the samples skipped on the way, and
    where the time went. Made in a thread or a worker; a worker's travels back whole, with
    ``batch`` in its wire form until the main process opens it."""

    batch: Any
    skipped: list[tuple[int, str]] = field(default_factory=list)
    read_s: float = 0.0
    collate_s: float = 0.0
    samples: int = 0


class Runner(Protocol):
    """Where the CPU work of a batch runs: threads of this process or worker processes.

    The producer side of an epoch (``_produce``) talks to either through this interface only.
    """

    @property
    def streams(self) -> int:
        """How many independent streams an iterable dataset is read as (one per worker)."""
        ...

    @property
    def restarts(self) -> int:
        """Worker processes replaced after a crash or a kill (0 for threads)."""
        ...

    @property
    def shm_fallbacks(self) -> int:
        """Batches sent inline because no shared-memory segment could be had."""
        ...

    def start(self) -> None:
        """Start the workers now and wait until they are ready (blocking; threads: nothing)."""
        ...

    def start_make(self, request: BatchRequest) -> asyncio.Future[Made]:
        """Start making a map-style batch; its future completes with the :class:`Made`."""
        ...

    async def pull(self, request: StreamRequest, stream: int) -> Made:
        """Make the next batch of stream ``stream`` (``Made.batch is END`` once it ran out)."""
        ...

    def is_running(self, batch_id: int) -> bool:
        """Whether ``batch_id`` is being worked on now (not merely queued)."""
        ...

    def on_deadline(self, batch_id: int) -> int | None:
        """``batch_id`` missed its deadline: stop what runs it if possible; returns the pid of
        a killed worker process, if one was killed."""
        ...

    def close(self) -> None:
        """Release every thread, process and segment (blocking)."""
        ...


def _is_async_callable(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's async __call__
    )


def dataset_kind(dataset: Any) -> DatasetKind:
    """Classify ``dataset`` as map, async map, iterable or async iterable.

    A torch ``IterableDataset`` inherits a ``__getitem__`` that raises ``NotImplementedError``;
    it counts as iterable because it defines ``__iter__`` and no ``__len__``-backed indexing
    of its own.

    Raises:
        TypeError: if ``dataset`` is none of the four kinds.
    """
    cls = type(dataset)
    if hasattr(cls, "__aiter__"):
        return "async_iterable"
    torch_iterable = _is_torch_iterable(dataset)
    if hasattr(cls, "__getitem__") and hasattr(cls, "__len__") and not torch_iterable:
        if _is_async_callable(cls.__getitem__):
            return "async_map"
        return "map"
    if hasattr(cls, "__iter__"):
        return "iterable"
    raise TypeError(
        f"dataset={dataset!r} is not a dataset: it needs __getitem__ and __len__ (map-style), "
        "__iter__ (iterable) or __aiter__ (async iterable)"
    )


def _is_torch_iterable(dataset: Any) -> bool:
    # A torch IterableDataset can only exist once torch.utils.data was imported: no need to
    # import torch (about a second) to find out that this dataset is not one.
    data = sys.modules.get("torch.utils.data")
    return data is not None and isinstance(dataset, data.IterableDataset)
