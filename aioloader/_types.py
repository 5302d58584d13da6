"""The protocols users plug in through.

Nothing here needs subclassing: a torch ``Dataset``, a list, a numpy array, or any object with
the right methods fits. The loader tells the kinds of dataset apart at construction with
:func:`dataset_kind`:

- map-style: ``__getitem__`` and ``__len__``; ``__getitem__`` may be ``async def``
  (an :class:`AsyncDataset`), and an optional ``__getitems__`` (sync or async) reads a whole
  batch at once;
- iterable: ``__iter__`` (an :class:`IterableDataset`) or ``__aiter__`` (an
  :class:`AsyncIterableDataset`) and no usable ``__getitem__``; one that can continue where it
  was is a :class:`ResumableStream` too.

It also holds the records and seams that cross module boundaries inside the package, so that
every module can name them without importing a module above its own level:

- :class:`BatchRequest` / :class:`StreamRequest`: what a producer asks a runner for;
- :class:`StreamPosition` / :class:`StreamResume`: where a resumable stream stood after a
  batch, and how a resumed epoch of a stream begins; :class:`SkipsTaken`: the skip budget's
  count that a resumed epoch starts from;
- :class:`Made`: a batch as made (in a thread or a worker) with its skips and timings; it is
  the one record of a made batch from the worker back to the epoch;
- :data:`END` and :data:`EMPTY_BATCH`: the only two "no batch here" markers (a stream ran out;
  every sample of a batch was skipped);
- :class:`Runner`: where the CPU work of a batch runs (threads or worker processes);
- :class:`SourceDataset`: a two-stage dataset (``fetch`` on the loop, ``decode`` off it);
  :class:`DecodingStream`: an async stream whose raw items are decoded off the loop;
  :class:`RankShardedStream`: an async stream that takes its epoch and rank share itself;
  :class:`NamedItems`: a dataset that names where an item comes from, for error notes.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, TypeVar, runtime_checkable

import numpy as np

__all__ = [
    "EMPTY_BATCH",
    "END",
    "Alloc",
    "AsyncDataset",
    "AsyncIterableDataset",
    "BatchRequest",
    "CollateFn",
    "Dataset",
    "DatasetKind",
    "DecodingStream",
    "InlineMaking",
    "IterableDataset",
    "Made",
    "NamedItems",
    "RankShardedStream",
    "ResumableStream",
    "Route",
    "Runner",
    "Sampler",
    "SkipsTaken",
    "SourceDataset",
    "Stateful",
    "StreamPosition",
    "StreamRequest",
    "StreamResume",
    "check_readers",
    "dataset_kind",
    "stream_state",
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


Alloc = Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray[Any, Any]]
"""``alloc(shape, dtype)`` returns a writable C-contiguous array of exactly that shape and dtype:
where a collate function places a stacked leaf (a worker's shared-memory slot, memory a loader
thread reuses)."""


class CollateFn(Protocol):
    """Turns a list of samples into one batch."""

    def __call__(self, samples: Sequence[Any], /) -> Any: ...


@runtime_checkable
class Stateful(Protocol):
    """Something whose position can be saved and restored exactly."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


@runtime_checkable
class ResumableStream(Protocol):
    """An iterable dataset (sync or async) that can continue its stream where it stood, so a
    loader's ``load_state_dict`` resumes it mid-epoch exactly.

    The loader reads a stream in several places at once (one reader per worker process, each
    with its own copy of the dataset, or one thread; an async stream is read by the loader's
    event loop, one reader whatever ``num_workers`` is), and batches run ahead of the
    consumer. So it does not ask the dataset in the main process where it is; it asks each
    reader's copy, right after taking a batch's items from it, and keeps per reader the
    answer of the last batch the consumer took with every earlier batch of that reader (with
    ``in_order=False`` a batch taken past one still in flight is repeated on resume, never
    lost)::

        reader k: items of batch b ──▶ state = dataset.state_dict() ──▶ with batch b
        consumer takes batch b ──▶ loader.state_dict()["streams"]["states"][k] = state
        resumed epoch, reader k: dataset.load_state_dict(state) ──▶ iter(dataset) ──▶ on

    - ``state_dict()`` describes the position of the iteration in progress (the newest
      ``iter()``): just after the last item it yielded. It is called between items, so a
      generator that records its next position before each ``yield`` answers exactly. Keep it
      small and plain (numbers, strings, lists, dicts): it is pickled with every batch of a
      worker and saved with checkpoints.
    - ``load_state_dict(state)`` makes the *next* ``iter()`` (``aiter()``) continue from
      ``state``, as if it were the iterator ``state`` was taken from; later ones start at the
      beginning again, as every new epoch does.

    A copy of the dataset sees the stream it reads: when a worker's share is every ``W``-th
    item (the loader splits a stream that does not shard itself), the state is still the
    position in the whole stream, and the loader takes up the split from there. A stream
    that shards itself (by :func:`aioloader.get_worker_info`) is resumed per worker the same
    way. Resuming needs the same number of readers (worker processes for a sync stream) and
    ranks as when the state was saved; an async stream, one reader, resumes under any
    ``num_workers``.

    Without this protocol, an iterable dataset's mid-epoch state cannot be resumed:
    :meth:`aioloader.DataLoader.load_state_dict` refuses it rather than silently replaying
    the epoch from its start.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


@runtime_checkable
class SourceDataset(Protocol[T_co]):
    """A two-stage async dataset: ``await fetch(i)`` gets raw bytes on the event loop (many at
    once), ``decode(raw)`` turns them into a sample off the loop (in a worker or a thread).

    The ready sources (:mod:`aioloader.sources`) are of this kind; so is any dataset with
    ``__len__``, an async ``fetch`` and a sync ``decode``. An async dataset may also have
    ``expect_in_flight(n)``: the loader calls it with its ``io_concurrency`` before the first
    fetch of each epoch (:meth:`aioloader.sources.Source.expect_in_flight`); a wrapper around
    a source forwards it, so the source's connection pools are sized for the loader.
    """

    def __len__(self) -> int: ...

    def fetch(self, index: int, /) -> Awaitable[Any]: ...

    def decode(self, raw: Any, /) -> T_co: ...


@runtime_checkable
class NamedItems(Protocol):
    """A dataset that can say where item ``index`` comes from (a URL, a path): an error while
    decoding or transforming the item then names it beside the index, as the user knows it."""

    def item_name(self, index: int, /) -> str: ...


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

    If it is also a :class:`ResumableStream`, the loader loads a saved state into it before
    ``set_epoch`` (with the saved epoch) and ``set_rank``, so it can check the state's rank.
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
    """The next batch of a stream (iterable datasets) for ``epoch``. ``opens`` marks an
    epoch's first request to a reader: it opens the stream afresh (an epoch number may be read
    again: ``set_epoch``, a loaded state), at ``resume``, a :class:`ResumableStream` state,
    when one is given. ``reading`` tells apart the epochs iterated in this process: two
    iterators of one epoch number (``set_epoch`` before each) read the stream apart, each
    whole, where the epoch number alone would have them share one reading."""

    epoch: int
    batch_id: int
    batch_size: int
    drop_last: bool
    opens: bool = False
    resume: Any = None
    reading: int = 0

    @property
    def key(self) -> tuple[int, int]:
        """Which reading of which epoch: a reader keeps one stream per key."""
        return self.reading, self.epoch


@dataclass(slots=True)
class SkipsTaken:
    """The skip budget's count of an epoch's batches the consumer took: the samples seen, and
    the indices skipped in the order seen (the resume state's ``"failures"``). Mutable: the
    epoch's budget adds to it as batches are taken, and the resume book saves it."""

    seen: int = 0
    skipped: list[Any] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StreamResume:
    """How a resumed epoch of a stream begins: its first batch id (after those taken), and
    for a :class:`ResumableStream`, the state each reader continues from (``states``, by
    reader), the number of readers they were saved with, and the reader of the last batch
    taken (the next batch is the following reader's, as it would have been)."""

    first_id: int
    streams: int | None = None
    last: int = -1
    states: Mapping[int, Any] = field(default_factory=dict)
    #: What the skip budget counted in the batches taken so far (of any epoch, not only a
    #: stream's): the resumed epoch's budget starts from it, and adds each batch as it is taken.
    skips: SkipsTaken = field(default_factory=SkipsTaken)


def check_readers(saved: object, readers: int) -> None:
    """Refuse stream positions saved from another number of readers than ``readers``."""
    if saved != readers:
        raise ValueError(
            f"the state was saved from {saved} stream readers (worker processes, or 1 for "
            f"threads and async streams) and this loader has {readers}: a stream resumes only "
            "with as many readers as it was saved with"
        )


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """Where reader ``stream`` of ``streams`` stood after its batch number ``seq`` of the
    epoch (0, 1, ... per reader): its dataset's :meth:`ResumableStream.state_dict`."""

    stream: int
    streams: int
    state: Any
    seq: int


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
    position: Any = None  # a ResumableStream's state after this batch's items
    # Digests of the first items a worker read from a stream it splits with the others (on its
    # first batch of an epoch): the main process checks that every worker read the same.
    order: tuple[int, ...] | None = None


class Route(enum.Enum):
    """Where a ``num_workers=0`` batch is made; chosen by ``_threads.RoutePolicy`` alone."""

    CALLER = "the caller's thread"  # ``for``: the thread that iterates, no loop
    LOOP = "the event loop"  # on the loop, where the batch is asked for
    THREAD = "the helper thread"  # handed over; made while the consumer works


class InlineMaking(Protocol):
    """Makes batches without a hand-over where its route policy says so (``num_workers=0``;
    see ``_threads._routes``)."""

    def route(self, *, on_loop: bool) -> Route:
        """Where the next batch asked for on the loop (``on_loop``), or in the caller's own
        thread, is to be made."""
        ...

    def make(self, request: BatchRequest, route: Route) -> Made | None:
        """Make the batch here, by ``route``; None on :attr:`Route.LOOP` while a thread is
        making one (the loop never waits for it)."""
        ...


class Runner(Protocol):
    """The worker-backend seam: where the CPU work of a batch runs.

    Threads of this process (``_threads.ThreadRunner``) and local worker processes
    (``_workers.ProcessRunner``, one loader's runner over a ``WorkerPool``) implement it; the
    epoch (``_epoch``) and the loader's resources (``_loader._resources``) use nothing else of
    a runner once it is made, so a backend on other machines is one more implementation and
    nothing above the seam changes: ordering, deadlines, retries, resume state and statistics
    stay in the training process. What a backend does, by part:

    - start: :meth:`start` (or at the first job); report :meth:`worker_pids`;
    - load a dataset copy: :meth:`load`, asked from the loader at each epoch that needs one
      (:attr:`has_copy` says whether it holds one); :meth:`begin_epoch` as each epoch begins;
    - submit a job, get a batch handle or a failure: :meth:`start_make` (map-style) and
      :meth:`pull` (a stream); the future or coroutine ends with a :class:`Made` or raises
      the batch's error, a backend failure (a death) as ``WorkerCrashedError`` naming the
      worker;
    - learn of a death: the failed handle above, and :attr:`restarts` counting replacements;
      a late batch: :meth:`is_running`, :meth:`on_deadline` (stop what runs it);
    - close: :meth:`stop_if_idle` (close at once, nothing to wait for), :meth:`close`.
    """

    @property
    def inline(self) -> InlineMaking | None:
        """Makes batches without a hand-over while they are cheap, or None (processes)."""
        ...

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

    def worker_pids(self) -> tuple[int, ...]:
        """Pids of the worker processes started so far (threads: none)."""
        ...

    def shm_stats(self) -> Any:
        """The shared-memory slots' ``ShmStats`` (``aioloader._shm``), or None without any."""
        ...

    @property
    def has_copy(self) -> bool:
        """Whether the workers hold this loader's dataset copy (threads read the dataset
        itself: always)."""
        ...

    def load(self, make: Callable[[], Any], epoch: int, seed: int) -> None:
        """Give the workers the dataset copy for ``epoch``: ``make()`` builds what they load
        (a pickled payload), seeded from ``seed``. Threads: nothing to load."""
        ...

    def begin_epoch(self) -> None:
        """An epoch begins, called from the consumer's thread (threads take its torch grad
        mode)."""
        ...

    def start_make(self, request: BatchRequest) -> asyncio.Future[Made]:
        """Start making a map-style batch; its future completes with the :class:`Made`."""
        ...

    async def pull(self, request: StreamRequest, stream: int) -> Made:
        """Make the next batch of stream ``stream`` (``Made.batch is END`` once it ran out)."""
        ...

    def is_running(self, request: BatchRequest | StreamRequest) -> bool:
        """Whether the batch of ``request`` (the object given to :meth:`start_make` or
        :meth:`pull`) is being worked on now, not merely queued. By the object, not the batch
        id: ids repeat every epoch, and a batch given up with its epoch, or another
        iterator's, may run beside this one."""
        ...

    def on_deadline(self, request: BatchRequest | StreamRequest) -> int | None:
        """The batch of ``request`` missed its deadline: stop what runs it if possible;
        returns the pid of a killed worker process, if one was killed."""
        ...

    def stop_if_idle(self) -> bool:
        """Stop taking jobs and return True if none is queued or running and closing waits
        for nothing; else False, and nothing changes."""
        ...

    def close(self) -> None:
        """Release every thread, process and segment (blocking)."""
        ...


def stream_state(dataset: Any) -> Any:
    """``dataset.state_dict()`` for a :class:`ResumableStream`, else ``None``."""
    return dataset.state_dict() if isinstance(dataset, ResumableStream) else None


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
