"""What runs inside a Ray actor: one actor is one worker of the loader.

::

    training process                               actor k (an async actor, on any node)
    ────────────────                               ─────────────────────────────────────
    ray.put(payload) once per copy ──ref──▶ load(copy_id, ref, epoch, seed): unpickle the
                                            ActorCopy, seed, publish WorkerInfo, worker_init_fn
    make.remote(copy_id, request, slot) ───▶ make: async dataset? fetch the items here, on the
                                            actor's loop, io_concurrency at once (many batches
                                            fetching together); then, one batch at a time, on a
                                            thread: seed, read / decode / transform, collate
                                            (into the slot: an actor on the training machine)
    pull.remote(copy_id, request, turn) ──▶ pull: an iterable dataset's next batch of this
                                            actor's share of the stream (its turn in order),
                                            read as a worker process reads it (read_stream)
    await ref ◀─── Made(batch=as_arrays(batch) or a Parcel of the slot) or Failed(exception)

One actor stands for one worker process: its id (stable across replacements), its seeds
(``base + id``, and per batch from (seed, epoch, batch id)), :func:`aioloader.get_worker_info`
and ``worker_init_fn`` are a local worker's (:mod:`aioloader._workers._info`). The CPU work of
its batches runs one at a time on a thread, so the actor's event loop stays free: to fetch the
next batches' items, and to answer the training process.

The user's errors come back as values (:class:`Failed`), not as Ray's ``RayTaskError``: the
training loop then catches the exception's own type, with the notes that name the batch, the
index and the actor. An exception that is not an ``Exception`` (``SystemExit`` from a dataset)
comes back as :class:`~aioloader.WorkerError`, as from a worker process.

Sharp edges:
- The dataset copy is pickled by aioloader (``__main__``'s classes by value), and unpickled
  here: the modules it needs (aioloader included) must be importable on every node (the same
  environment, or a Ray ``runtime_env``).
- A ``worker_init_fn`` that raises makes every batch of that copy fail with
  :class:`~aioloader.WorkerInitError` (never retried), until the next copy loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import socket
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._batch import MAX_OPEN_STREAMS, BatchMaker, annotate, not_an_exit
from .._errors import WorkerError, WorkerInitError
from .._shm import Slot
from .._types import END, BatchRequest, Made, SourceDataset, StreamRequest
from .._workers import (
    Packer,
    WorkerCopy,
    WorkerInfo,
    get_worker_info,
    loads_payload,
    picklable,
    publish_worker_info,
    read_stream,
    seed_everything,
    seed_on_import,
    seed_worker,
    sharding_seen,
    torch_on_one_thread,
    watch_sharding,
    worker_seed,
)
from ._wire import as_arrays, in_parcel, shm_key

__all__ = ["ActorCopy", "Failed", "LoaderActor", "TurnTable"]


@dataclass(frozen=True, slots=True)
class ActorCopy:
    """What an actor gets of a loader, once per dataset copy (pickled in the training process).

    Attributes:
        maker: makes batches of the fetched or read samples.
        init_fn: the loader's ``worker_init_fn``.
        fetch_from: an async map dataset whose items the actor fetches itself (None: the
            maker reads a sync dataset).
        io_concurrency: item fetches in flight at once in the actor, all its batches together.
        per_batch_seeds: ``worker_seeding='batch'``: reseed before every batch.
        preload: modules to import as the copy loads (torch, where the training process has
            it): under the start deadline, not the first batch's (a fresh actor importing
            torch for its first collate took seconds of that batch's ``timeout``).
        stream: the dataset is a (sync) iterable one: the actor reads its share of the stream
            (:meth:`LoaderActor.pull`), as a worker process does.
    """

    maker: BatchMaker
    init_fn: Callable[[int], Any] | None
    fetch_from: Any = None
    io_concurrency: int = 64
    per_batch_seeds: bool = True
    preload: tuple[str, ...] = ()
    stream: bool = False


@dataclass(frozen=True, slots=True)
class Failed:
    """A batch's exception, sent back as a value (see the module docstring)."""

    error: BaseException


@dataclass(slots=True)
class _Loaded:
    copy: ActorCopy
    info: WorkerInfo
    seed: int  # the loader's seed: per-batch seeds derive from it
    init_error: str | None = None
    io: asyncio.Semaphore | None = None
    fetch: Callable[[int], Any] | None = field(default=None)
    stream: WorkerCopy | None = None  # an iterable dataset's: where its stream stands
    turns: TurnTable = field(default_factory=lambda: TurnTable())  # its readings' pull order


#: Readings whose eviction a :class:`TurnTable` remembers, so that a late pull of one fails at
#: once instead of waiting for a turn that never comes (a few dozen keys: bytes).
REMEMBERED_GONE = 64


class TurnTable:
    """Which pull of each reading of one dataset copy's stream runs next (a pure state
    machine; :meth:`LoaderActor.pull` drives it under its condition).

    One table per copy, so the readings of one loader never push out another's (a training
    and a validation loader on one pool each keep theirs), and it goes with its copy
    (:meth:`LoaderActor.drop`, or the next copy loaded). It holds at most ``keep`` readings,
    as the copy's stream cursor keeps that many streams open
    (:data:`~aioloader._batch.MAX_OPEN_STREAMS`): opening one more evicts a reading whose
    stream ended, else the least recently pulled. A pull of an evicted reading, or of a turn
    already taken, can never run: :meth:`ready` raises at once instead of letting it wait.

    Invariant: a key is in at most one of the live table and the remembered evictions.
    """

    def __init__(self, keep: int = MAX_OPEN_STREAMS, remember: int = REMEMBERED_GONE) -> None:
        self._keep = keep
        self._remember = remember
        # reading key -> its next turn; least recently pulled first
        self._next: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._ended: set[tuple[int, int]] = set()  # live readings whose stream ended
        self._gone: OrderedDict[tuple[int, int], None] = OrderedDict()  # evicted, oldest first

    def __len__(self) -> int:
        return len(self._next)

    def open(self, key: tuple[int, int]) -> None:
        """A reading's opening pull arrived: it starts afresh at turn 0."""
        self._next.pop(key, None)
        self._ended.discard(key)
        self._gone.pop(key, None)
        while len(self._next) >= self._keep:
            ended = next((k for k in self._next if k in self._ended), None)
            evicted = ended if ended is not None else next(iter(self._next))
            del self._next[evicted]
            self._ended.discard(evicted)
            self._gone[evicted] = None
            while len(self._gone) > self._remember:
                self._gone.popitem(last=False)
        self._next[key] = 0

    def ready(self, key: tuple[int, int], turn: int) -> bool:
        """Whether pull ``turn`` of reading ``key`` runs now (False: an earlier one, or the
        reading's opening pull, has not run yet).

        Raises:
            WorkerError: that turn can never come: the reading was evicted, or the turn taken.
        """
        if key in self._gone:
            raise WorkerError(
                f"pull {turn} of stream reading {key} (reading, epoch) can never run: the "
                f"reading was dropped to keep at most {self._keep} open per loader (more "
                "iterators of one loader at once than that)"
            )
        next_turn = self._next.get(key)
        if next_turn is not None and turn < next_turn:
            raise WorkerError(
                f"pull {turn} of stream reading {key} (reading, epoch) can never run: turn "
                f"{next_turn} is next (the same pull sent twice)"
            )
        return next_turn == turn

    def done(self, key: tuple[int, int], turn: int, *, ended: bool) -> None:
        """Pull ``turn`` of ``key`` ran (``ended``: its stream is over, or failed for good)."""
        if key not in self._next:
            return  # evicted meanwhile
        self._next[key] = turn + 1
        self._next.move_to_end(key)
        if ended:
            self._ended.add(key)


class LoaderActor:
    """The actor class (made a Ray actor by :mod:`._pool`, with the user's resources).

    Args:
        worker_id: this worker's number, ``0 <= worker_id < num_workers``.
        num_workers: the actor count.
    """

    def __init__(self, worker_id: int, num_workers: int) -> None:
        self._id = worker_id
        self._n = num_workers
        self._copies: dict[int, _Loaded] = {}
        self._cpu: asyncio.Lock | None = None  # one batch's CPU work at a time
        self._active: int | None = None  # the copy whose WorkerInfo is published
        self._turned: asyncio.Condition | None = None
        # numpy.random and torch imported later (numpy imports numpy.random lazily) are seeded
        # with the seed in force the moment they arrive, as in a worker process.
        seed_on_import()

    async def ready(self) -> tuple[int, str, str, str | None]:
        """This actor's pid, node id and host name (for errors and statistics), and its
        ``/dev/shm``'s :func:`~._wire.shm_key` (the same as the training process's: batches
        may come back in its shared memory)."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        return os.getpid(), node, socket.gethostname(), shm_key()

    async def load(self, copy_id: int, payload: bytes, epoch: int, seed: int) -> None:
        """Make batches of ``copy_id`` with this copy from now on (drops the one before)."""
        async with self._lock():
            await asyncio.to_thread(self._load, copy_id, payload, epoch, seed)
        await self._wake()  # pulls waiting on the copy before: theirs can never come

    def _load(self, copy_id: int, payload: bytes, epoch: int, seed: int) -> None:
        publish_worker_info(None)
        self._active = None
        previous = self._copies.pop(copy_id, None)
        if previous is not None and previous.stream is not None:
            previous.stream.release()  # its files and memory go now, as in a worker process
        try:
            copy: ActorCopy = loads_payload(payload)
        except BaseException as exc:  # reported by every batch of this copy, never a crash
            failed = ActorCopy(BatchMaker(None, list), None)
            self._copies[copy_id] = _Loaded(failed, WorkerInfo(self._id, self._n, 0, None), 0)
            self._copies[copy_id].init_error = (
                f"unpickling the dataset copy: {type(exc).__name__}: {exc}\n"
                f"{traceback.format_exc()}"
            )
            return
        for name in copy.preload:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
        wseed = worker_seed(seed, epoch, self._id)
        seed_worker(wseed, every_device=not copy.per_batch_seeds)
        torch_on_one_thread()  # as a local worker: the actor's CPUs are its own budget
        dataset = copy.maker.dataset if copy.fetch_from is None else copy.fetch_from
        loaded = _Loaded(copy, WorkerInfo(self._id, self._n, wseed, dataset), seed)
        if copy.stream:
            loaded.stream = WorkerCopy(self._id, self._n, seed, copy.per_batch_seeds)
            loaded.stream.set_maker(copy.maker)
        if copy.fetch_from is not None:
            source = copy.fetch_from
            loaded.fetch = source.fetch if isinstance(source, SourceDataset) else source.__getitem__
            expect = getattr(source, "expect_in_flight", None)
            if callable(expect):
                expect(copy.io_concurrency)
        self._copies[copy_id] = loaded
        publish_worker_info(loaded.info)
        self._active = copy_id
        if copy.init_fn is not None:
            watch_sharding()  # a worker_init_fn that reads get_worker_info() shards the stream
            try:
                copy.init_fn(self._id)
            except BaseException as exc:  # reported by every batch of this copy
                loaded.init_error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            finally:
                if loaded.stream is not None:
                    loaded.stream.init_shards = sharding_seen()
                else:
                    sharding_seen()

    async def drop(self, copy_id: int) -> None:
        """Forget ``copy_id`` (its loader was closed)."""
        loaded = self._copies.pop(copy_id, None)
        if loaded is not None and loaded.stream is not None:
            loaded.stream.release()
        if loaded is not None and self._active == copy_id:
            publish_worker_info(None)
            self._active = None
        await self._wake()  # pulls waiting on its turns: theirs can never come

    async def _wake(self) -> None:
        turned = self._turned_condition()
        async with turned:
            turned.notify_all()

    async def make(
        self, copy_id: int, request: BatchRequest, slot: Slot | None = None
    ) -> Made | Failed:
        """Make the batch of ``request`` with copy ``copy_id`` (into ``slot``, the training
        process's shared memory, if one is given: see :mod:`._wire`)."""
        try:
            loaded = self._loaded(copy_id)
            started = time.perf_counter()
            skipped: list[tuple[int, str]] = []
            if loaded.fetch is not None and request.raw is None:
                request = await self._fetch(loaded, request, skipped)
            fetched_s = time.perf_counter() - started
            async with self._lock():
                made = await asyncio.to_thread(self._make, copy_id, loaded, request, slot)
            made.read_s += fetched_s
            made.skipped[:0] = skipped
            return made
        except Exception as exc:
            annotate(exc, f"in {self._where()}, making batch {request.batch_id}")
            return Failed(picklable(exc))
        except BaseException as exc:  # SystemExit from the dataset: not this actor's end
            return Failed(not_an_exit(exc, self._where(), request.batch_id))

    async def pull(
        self, copy_id: int, request: StreamRequest, turn: int, slot: Slot | None = None
    ) -> Made | Failed:
        """Make the next batch of this actor's share of copy ``copy_id``'s stream (``END`` once
        it ran out), as a worker process does (``aioloader._workers.read_stream``), into
        ``slot`` if one is given (as :meth:`make`).

        ``turn`` numbers the pulls of one reading of the stream from 0 (its opening pull), in
        the order the runner sent them: they run in that order whatever order Ray starts them
        in (an async actor does not promise the order of its calls), since each takes the
        stream's next samples.
        """
        key = request.key
        turned = self._turned_condition()
        try:
            table = self._turn_table(copy_id)
            async with turned:
                if request.opens:
                    table.open(key)  # the same reading opened again: afresh

                def my_turn() -> bool:
                    now = self._copies.get(copy_id)
                    if now is None or now.turns is not table:
                        raise WorkerInitError(
                            f"{self._where()} dropped dataset copy {copy_id} while pull "
                            f"{turn} of its stream waited for its turn"
                        )
                    return table.ready(key, turn)

                await turned.wait_for(my_turn)
            ended = True  # unless it returns a batch: a failed stream is over for good
            try:  # from here on the next turn comes, whatever happens to this one
                loaded = self._loaded(copy_id)
                if loaded.stream is None:
                    raise WorkerInitError(f"{self._where()} holds copy {copy_id} as map data")
                async with self._lock():
                    made = await asyncio.to_thread(self._pull, copy_id, loaded, request, slot)
                ended = made.batch is END
            finally:
                async with turned:
                    table.done(key, turn, ended=ended)
                    turned.notify_all()
            return made
        except Exception as exc:
            annotate(exc, f"in the stream of {self._where()}, making batch {request.batch_id}")
            return Failed(picklable(exc))
        except BaseException as exc:  # SystemExit from the dataset: not this actor's end
            return Failed(not_an_exit(exc, f"the stream of {self._where()}", request.batch_id))

    def _pull(
        self, copy_id: int, loaded: _Loaded, request: StreamRequest, slot: Slot | None
    ) -> Made:
        stream = loaded.stream
        assert stream is not None
        self._publish(copy_id, loaded)
        if loaded.copy.per_batch_seeds:
            seed_everything(loaded.seed, request.epoch, request.batch_id)
        started = time.perf_counter()
        samples, position, order = read_stream(stream, request)
        if samples is END:
            return Made(batch=END, order=order)
        pulled_s = time.perf_counter() - started
        of_samples = BatchRequest(
            request.epoch, request.batch_id, list(range(len(samples))), raw=samples
        )
        made = _packed(loaded.copy.maker, of_samples, slot)
        made.read_s += pulled_s
        made.position = position
        made.order = order
        return made

    def _loaded(self, copy_id: int) -> _Loaded:
        loaded = self._copies.get(copy_id)
        if loaded is None:
            raise WorkerInitError(f"{self._where()} has no dataset copy {copy_id}")
        if loaded.init_error is not None:
            raise WorkerInitError(f"{self._where()} failed to start: {loaded.init_error}")
        return loaded

    def _publish(self, copy_id: int, loaded: _Loaded) -> None:
        if self._active != copy_id or get_worker_info() is not loaded.info:
            publish_worker_info(loaded.info)
            self._active = copy_id

    def _make(
        self, copy_id: int, loaded: _Loaded, request: BatchRequest, slot: Slot | None
    ) -> Made:
        self._publish(copy_id, loaded)
        if loaded.copy.per_batch_seeds:
            seed_everything(loaded.seed, request.epoch, request.batch_id)
        return _packed(loaded.copy.maker, request, slot)

    async def _fetch(
        self, loaded: _Loaded, request: BatchRequest, skipped: list[tuple[int, str]]
    ) -> BatchRequest:
        """``request`` with its items fetched here, ``io_concurrency`` at once for the actor;
        with ``on_error='skip'``, a failed item is left out and named in ``skipped``."""
        if loaded.io is None:
            loaded.io = asyncio.Semaphore(loaded.copy.io_concurrency)
        io, fetch = loaded.io, loaded.fetch
        assert fetch is not None
        skip = loaded.copy.maker.skip_errors

        async def one(index: int) -> Any:
            async with io:
                try:
                    return await fetch(index)
                except Exception as exc:
                    if skip:
                        return _Skip(index, f"{type(exc).__name__}: {exc}")
                    annotate(exc, f"fetching sample index {index} of batch {request.batch_id}")
                    raise

        indices: Any = request.indices
        shards: list[Sequence[int]] = (
            [list(s) for s in indices] if request.sharded else [list(indices)]
        )
        tasks: list[list[asyncio.Task[Any]]] = []
        failed: BaseException | None = None
        try:
            async with asyncio.TaskGroup() as group:
                tasks.extend([group.create_task(one(i)) for i in shard] for shard in shards)
        except BaseExceptionGroup as exc:
            # The first item's error in sample order, as it is (not a group: ``except
            # KeyError`` in the training loop must keep working).
            errors = [
                error
                for shard_tasks in tasks
                for task in shard_tasks
                if task.done() and not task.cancelled() and (error := task.exception())
            ]
            failed = errors[0] if errors else exc.exceptions[0]
        if failed is not None:
            raise failed
        kept_indices: list[list[int]] = []
        kept_raws: list[list[Any]] = []
        for shard, shard_tasks in zip(shards, tasks, strict=True):
            kept_indices.append([])
            kept_raws.append([])
            for index, task in zip(shard, shard_tasks, strict=True):
                value = task.result()
                if isinstance(value, _Skip):
                    skipped.append((value.index, value.why))
                    continue
                kept_indices[-1].append(index)
                kept_raws[-1].append(value)
        if request.sharded:
            return BatchRequest(request.epoch, request.batch_id, kept_indices, True, kept_raws)
        return BatchRequest(request.epoch, request.batch_id, kept_indices[0], False, kept_raws[0])

    def _turn_table(self, copy_id: int) -> TurnTable:
        loaded = self._copies.get(copy_id)
        if loaded is None:
            raise WorkerInitError(f"{self._where()} has no dataset copy {copy_id}")
        return loaded.turns

    def _turned_condition(self) -> asyncio.Condition:
        if self._turned is None:
            self._turned = asyncio.Condition()
        return self._turned

    def _lock(self) -> asyncio.Lock:
        if self._cpu is None:
            self._cpu = asyncio.Lock()
        return self._cpu

    def _where(self) -> str:
        return f"Ray actor {self._id} (pid {os.getpid()}, host {socket.gethostname()})"


def _packed(maker: BatchMaker, request: BatchRequest, slot: Slot | None) -> Made:
    """The batch of ``request`` as it goes back through Ray: collated into ``slot`` as a
    local worker's (a :class:`~aioloader._workers.Parcel`), or with no slot its tensors as
    :class:`~._wire.TensorLeaf` for the object store."""
    if slot is None:
        made = maker.make(request)
        made.batch = as_arrays(made.batch)
        return made
    packer = Packer(slot)
    made = maker.make(request, packer.alloc)
    made.batch = in_parcel(packer.pack(made.batch))
    return made


@dataclass(frozen=True, slots=True)
class _Skip:
    index: int
    why: str
