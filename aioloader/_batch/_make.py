"""BatchMaker and StreamCursor: one batch of a map-style dataset or a stream, in any thread.

The same code runs wherever the CPU work of a batch runs: the loader's helper thread
(``num_workers=0``), a thread of a pool (``thread_pool=True``), or a worker process (then with an
``alloc`` that places collated arrays straight into a shared-memory slot). Keeping it in one place
means the three modes cannot drift apart in how errors are annotated or samples are skipped.

A request names its samples by dataset index. For a sync map-style dataset the samples are read
here (``dataset[i]``, or ``dataset.__getitems__(indices)`` when the dataset has it, as torch
does); for async datasets the event loop has already fetched them and the request carries them
(``raw``), so only ``decode``/``transform`` and collation are left to do.

Errors from user code keep their type; a note names the batch and the sample index, so a
``KeyError`` from ``__getitem__`` is still caught by ``except KeyError`` in the training loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._errors import WorkerError
from .._sampling import BulkKey, Shard
from .._types import EMPTY_BATCH, END, Alloc, BatchRequest, Made, StreamRequest
from ._collate import collate_prestacked, default_collate, numpy_collate
from ._prestack import Prestack

__all__ = [
    "MAX_OPEN_STREAMS",
    "BatchMaker",
    "StreamCursor",
    "annotate",
    "continued_share",
    "indices_text",
    "not_an_exit",
    "stop_as_error",
    "stray_cancel",
    "stream_batch",
    "take",
]


# Collate functions that can write their output through an ``alloc`` (straight into shared
# memory). Any other collate_fn is called plainly and its output copied into the slot once.
# Compared by identity, never hashed: a collate_fn may be an unhashable callable object.
_ALLOC_AWARE: tuple[Callable[..., Any], ...] = (default_collate, numpy_collate)


def annotate(exc: BaseException, text: str) -> BaseException:
    """Add ``text`` as a note unless an identical note is already there."""
    if text not in getattr(exc, "__notes__", ()):
        exc.add_note(text)
    return exc


def users_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` may be the user's Ctrl-C: a ``KeyboardInterrupt`` on the main thread,
    the only one Python delivers SIGINT to. Raised by the dataset on any other thread (a
    loader thread, the private loop of sync iteration), it is the dataset's own: see
    :func:`not_an_exit`."""
    return (
        isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread()
    )


def not_an_exit(exc: BaseException, where: str, batch_id: int) -> WorkerError:
    """A :class:`WorkerError` for ``exc``, an exception that is not an ``Exception``
    (``SystemExit``, ``KeyboardInterrupt``, ...), raised while making ``batch_id`` in a
    worker process or a loader thread (``where``). Set on the consumer's future as it is, it
    would end the training program (a task re-raises it out of the event loop); and a
    ``KeyboardInterrupt`` raised there is never the user's Ctrl-C, which only the main
    thread of the main process receives (workers ignore SIGINT)."""
    text = "".join(traceback.format_exception(exc))
    error = WorkerError(
        f"{type(exc).__name__}({exc}) was raised in {where} while making batch {batch_id}; "
        "it ends neither the worker nor this program (Ctrl-C is the main process's to "
        f"handle). The traceback:\n{text}"
    )
    for note in getattr(exc, "__notes__", ()):
        error.add_note(note)
    return error


def stray_cancel(exc: BaseException, what: str) -> RuntimeError | None:
    """A RuntimeError for a ``CancelledError`` that ``what`` (the user's async code) raised
    while the loader's task awaiting it was not being cancelled: something it awaited was
    cancelled. None where the task is being cancelled: the caller re-raises ``exc``.

    Re-raised as it is, it would end the task as if the loader had cancelled it: a batch whose
    task ends so never arrives (the epoch waits for it for ever), and a stream whose read ends
    so looks finished (the epoch ends early, silently)."""
    task = asyncio.current_task()
    if task is None or task.cancelling():
        return None
    error = RuntimeError(
        f"{what} raised CancelledError although the loader did not cancel it (something it "
        "awaited was cancelled); it is reported as this error so that nothing is lost silently"
    )
    error.__cause__ = exc
    return error


def stop_as_error(exc: BaseException, where: str) -> RuntimeError:
    """A RuntimeError for a ``StopIteration`` (or ``StopAsyncIteration``) that a dataset's
    ``__getitem__``, a transform or ``collate_fn`` raised while ``where``. Left as it is, it
    would end the consumer's ``for`` loop as if the epoch were over, dropping the batch and
    every one after it without a word, and a future cannot hold it at all (as a generator
    turns it into a RuntimeError, PEP 479). Keeps the notes that name the sample."""
    error = RuntimeError(
        f"{type(exc).__name__} was raised while {where}: a map-style dataset's __getitem__, "
        "transform or collate_fn must not raise it (it would end the epoch silently and lose "
        "the samples after it); raise IndexError or another exception, or use an "
        "IterableDataset for a stream that ends"
    )
    for note in getattr(exc, "__notes__", ()):
        error.add_note(note)
    return error


class BatchMaker:
    """Reads, transforms and collates batches of one dataset.

    Args:
        dataset: a map-style dataset (``None`` when every request carries ``raw`` samples).
        collate_fn: turns a list of samples into a batch.
        transform: applied to each sample after reading (or after ``decode``).
        decode: applied to each raw item fetched by the event loop (two-stage async sources).
        skip_errors: with True, a sample whose read or transform raises is dropped and reported
            in :attr:`Made.skipped` instead of failing the batch.
        shard: the rank share of an iterable dataset's stream that is read (None: all of it;
            see :func:`aioloader._sampling._distributed.stream_share`).
        item_name: where item ``index`` comes from (a URL: :class:`~.._types.NamedItems`), for
            the note of an error while decoding or transforming it.
        stream_seed: the seed an iterable dataset's stream is read under in worker processes
            (see ``_workers._info.StreamRandom``): the same in every worker that reads it.
        batched: whether samples are collated into batches (torch's automatic batching); without
            it each sample is read alone, by ``dataset[key]`` even where ``__getitems__``
            exists, as torch reads it, and a :class:`~.._sampling.BulkKey` (a sampler's list of
            indices) is given to the dataset as the sampler yielded it.
    """

    def __init__(
        self,
        dataset: Any,
        collate_fn: Callable[[list[Any]], Any],
        *,
        transform: Callable[[Any], Any] | None = None,
        decode: Callable[[Any], Any] | None = None,
        skip_errors: bool = False,
        shard: Shard | None = None,
        item_name: Callable[[int], str] | None = None,
        stream_seed: int = 0,
        batched: bool = True,
    ) -> None:
        self.dataset = dataset
        self.stream_seed = stream_seed
        self.item_name = item_name
        self.collate_fn = collate_fn
        self.transform = transform
        self.decode = decode
        self.skip_errors = skip_errors
        self.shard = shard
        self._getitems = (
            getattr(dataset, "__getitems__", None) if dataset is not None and batched else None
        )
        self._bulk_keys = not batched  # keys may be BulkKeys, unwrapped as they are read
        # The default collate functions take arrays stacked as the samples are read (_prestack),
        # until a batch's samples differ at a leaf begun (each such batch wastes its array).
        self._to_torch = {id(default_collate): True, id(numpy_collate): False}.get(id(collate_fn))
        self._prestacking = self._to_torch is not None

    def make(self, request: BatchRequest, alloc: Alloc | None = None) -> Made:
        """Build the batch of ``request``; ``alloc`` places collated arrays (shared memory)."""
        try:
            return self._make(request, alloc)
        except (StopIteration, StopAsyncIteration) as exc:
            raise stop_as_error(exc, f"making batch {request.batch_id}") from exc

    def _make(self, request: BatchRequest, alloc: Alloc | None) -> Made:
        made = Made(batch=None)
        if request.sharded:
            shards: Sequence[Sequence[int]] = request.indices  # type: ignore[assignment]
            raws = request.raw if request.raw is not None else [None] * len(shards)
            batches = [
                self._one(request, list(shard), raw, alloc, made)
                for shard, raw in zip(shards, raws, strict=True)
            ]
            # A shard whose samples were all skipped is left out, as a batch with fewer indices
            # than shards has fewer shards; a batch with none left is not yielded at all.
            kept = [batch for batch in batches if batch is not EMPTY_BATCH]
            made.batch = kept if kept else EMPTY_BATCH
        else:
            indices: Sequence[int] = request.indices  # type: ignore[assignment]
            made.batch = self._one(request, list(indices), request.raw, alloc, made)
        return made

    def make_from_stream(
        self, request: StreamRequest, samples: list[Any], alloc: Alloc | None = None
    ) -> Made:
        """Build a batch of ``samples`` pulled from a stream (named by their position in it)."""
        positions = list(range(len(samples)))
        made = BatchRequest(request.epoch, request.batch_id, positions, raw=samples)
        return self.make(made, alloc)

    # -- internals ---------------------------------------------------------------------------

    def _one(
        self,
        request: BatchRequest,
        indices: list[int],
        raw: Sequence[Any] | None,
        alloc: Alloc | None,
        made: Made,
    ) -> Any:
        t0 = time.perf_counter()
        # Skipping would move the samples after a skipped one: not stacked as they are read.
        stack = (
            Prestack(alloc, len(indices))
            if alloc is not None and self._prestacking and not self.skip_errors
            else None
        )
        samples = self._samples(request, indices, raw, made, stack)
        t1 = time.perf_counter()
        made.read_s += t1 - t0
        made.samples += len(samples)
        if not samples and self.skip_errors:
            # Every sample was skipped (on_error='skip'): collating nothing would raise, and the
            # skips are already reported; the epoch drops the batch instead of yielding it.
            return EMPTY_BATCH
        try:
            alloc_aware = any(self.collate_fn is fn for fn in _ALLOC_AWARE)
            stacked = stack.stacked if stack is not None else None
            if stack is not None and stack.broke:
                self._prestacking = False
            if stacked:
                assert alloc is not None  # a Prestack is made only with one
                assert self._to_torch is not None
                batch = collate_prestacked(samples, self._to_torch, alloc, stacked)
            elif alloc_aware and alloc is not None:
                batch = self.collate_fn(samples, alloc=alloc)  # type: ignore[call-arg]
            else:
                batch = self.collate_fn(samples)
        except Exception as exc:
            annotate(exc, f"while collating batch {request.batch_id} of indices {_short(indices)}")
            raise
        made.collate_s += time.perf_counter() - t1
        return batch

    def _samples(
        self,
        request: BatchRequest,
        indices: list[int],
        raw: Sequence[Any] | None,
        made: Made,
        stack: Prestack | None,
    ) -> list[Any]:
        if raw is None and self._getitems is not None and not self.skip_errors:
            try:
                items = list(self._getitems(indices))
            except Exception as exc:
                annotate(
                    exc, f"in __getitems__ of batch {request.batch_id}, indices {_short(indices)}"
                )
                raise
            if len(items) != len(indices):  # zip() would silently drop or misalign samples
                raise ValueError(
                    f"__getitems__ returned {len(items)} samples for {len(indices)} indices "
                    f"(batch {request.batch_id}, indices {_short(indices)})"
                )
            samples: list[Any] = []
            for index, item in zip(indices, items, strict=True):
                self._finish_into(samples, request, index, item, made, stack)
            return samples
        if raw is None and not self.skip_errors and self.decode is None and self.transform is None:
            return self._read_plain(request, indices, stack)
        samples = []
        for pos, index in enumerate(indices):
            try:
                if raw is not None:
                    item = raw[pos]
                else:
                    item = self.dataset[_key(index) if self._bulk_keys else index]
            except Exception as exc:
                if self.skip_errors:
                    made.skipped.append((index, _describe(exc)))
                    continue
                annotate(exc, f"reading sample index {index} of batch {request.batch_id}")
                raise
            except BaseException as exc:  # never skipped (SystemExit, KeyboardInterrupt)
                annotate(exc, f"reading sample index {index} of batch {request.batch_id}")
                raise
            self._finish_into(samples, request, index, item, made, stack)
        return samples

    def _read_plain(
        self, request: BatchRequest, indices: list[int], stack: Prestack | None
    ) -> list[Any]:
        """Read ``indices`` with nothing to skip or transform: the common case, as a tight
        loop. For small samples the general path's per-sample bookkeeping costs as much as
        the reads themselves (measured: 256 ints, 24 us instead of 50)."""
        dataset = self.dataset
        get = type(dataset).__getitem__  # what dataset[i] calls
        if self._bulk_keys:
            get = _unwrapping(get)
        items: list[Any] = []
        append = items.append
        index = None
        rest = iter(indices)
        try:
            if stack is not None:  # the first sample says whether there is anything to stack
                for index in rest:
                    append(stack.feed(0, get(dataset, index)))
                    break
                if stack.active:
                    feed = stack.feed
                    for position, index in enumerate(rest, 1):
                        append(feed(position, get(dataset, index)))
            for index in rest:
                append(get(dataset, index))
        except BaseException as exc:  # SystemExit too: the note names the sample either way
            annotate(exc, f"reading sample index {index} of batch {request.batch_id}")
            raise
        return items

    def _finish_into(
        self,
        samples: list[Any],
        request: BatchRequest,
        index: int,
        item: Any,
        made: Made,
        stack: Prestack | None,
    ) -> None:
        """Decode and transform ``item`` and append it to ``samples`` (through ``stack``), or
        record it skipped."""
        if self.decode is None and self.transform is None:
            samples.append(_through(stack, samples, item))
            return
        try:
            if self.decode is not None:
                item = self.decode(item)
            if self.transform is not None:
                item = self.transform(item)
        except Exception as exc:
            if self.skip_errors:
                made.skipped.append((index, _describe(exc)))
                return
            where = "" if self.item_name is None else f" ({self.item_name(index)})"
            annotate(exc, f"transforming sample index {index}{where} of batch {request.batch_id}")
            raise
        samples.append(_through(stack, samples, item))


def _key(index: Any) -> Any:
    """What ``dataset[...]`` is given for ``index``: a bulk key's own object."""
    return index.key if isinstance(index, BulkKey) else index


def _unwrapping(get: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``get(dataset, key)`` for keys that may be bulk keys (one per batch: no hot loop)."""

    def read(dataset: Any, index: Any) -> Any:
        return get(dataset, _key(index))

    return read


def _through(stack: Prestack | None, samples: list[Any], item: Any) -> Any:
    """``item``, the next of ``samples``, as ``stack`` keeps it (the first sample says whether
    there is anything to stack)."""
    if stack is not None and (stack.active or not samples):
        return stack.feed(len(samples), item)
    return item


# Streams one cursor keeps open at once, one per epoch being read: two iterators of one loader
# (``zip(loader, loader)``) read two epochs at once. More: more concurrent iterators before the
# oldest stream is closed (its next request then fails, naming why: reopened, it would repeat
# its samples); each open stream holds its dataset iterator.
MAX_OPEN_STREAMS = 4
#: How many closed readings a :class:`StreamCursor` remembers, to refuse their requests.
EVICTED_KEPT = 64


class StreamCursor:
    """Positions in one stream of samples (an iterable dataset, read by one thread or one
    worker), one per epoch being read, turned into batches by the one rule of
    :func:`stream_batch`.

    An epoch's first request opens the stream afresh (``StreamRequest.opens``), or where a
    resumed epoch says (``StreamRequest.resume``). A stream that fails ends for good (reading
    it again would repeat samples): what it produced before the failure is delivered as a
    batch first, and the error is raised by the next :meth:`next_samples` of that epoch. One
    that fails to open raises once; the epoch's later requests of it end it.

    Args:
        open_stream: makes an iterator over the stream (called once per epoch) from the
            resume state of the epoch's first request (``None``: from the start).
        position: where the stream stands now (:func:`aioloader._types.stream_state` of the
            dataset), asked right after each batch's items were taken.
    """

    def __init__(
        self,
        open_stream: Callable[[Any], Iterator[Any]],
        position: Callable[[], Any] = lambda: None,
    ) -> None:
        self._open = open_stream
        self._position = position
        # StreamRequest.key -> [iterator, error still to raise]; oldest first
        self._streams: dict[tuple[int, int], list[Any]] = {}
        # Keys of readings closed to make room (the newest EVICTED_KEPT): a later request of
        # one must fail, since opening it again would repeat the samples it already gave.
        self._evicted: dict[tuple[int, int], None] = {}

    def next_samples(self, request: StreamRequest) -> tuple[list[Any] | Any, Any]:
        """The samples of the next batch (or :data:`END`), and the stream's position after
        them; raises the stream's error in turn."""
        key = request.key
        stream = self._streams.get(key)
        if stream is None and not request.opens and key in self._evicted:
            raise RuntimeError(
                f"the stream's reading of epoch {request.epoch} was closed to make room: more "
                f"than {MAX_OPEN_STREAMS} epochs of it were read at once by one reader (open "
                "iterators of one loader); reading it again would repeat the samples it gave, "
                "so that epoch ends here. Finish or close an iterator before starting another"
            )
        if stream is None or request.opens:
            self._streams.pop(key, None)  # the same reading opened again: afresh
            self._evicted.pop(key, None)
            while len(self._streams) >= MAX_OPEN_STREAMS:
                oldest = next(iter(self._streams))
                del self._streams[oldest]
                self._evicted[oldest] = None
                while len(self._evicted) > EVICTED_KEPT:
                    del self._evicted[next(iter(self._evicted))]
            try:
                opened = self._open(request.resume)
            except BaseException:
                # It failed to open (``__iter__`` returned no iterator, or raised): it has
                # failed for good, like one that fails while read. The requests of this
                # reading already on their way end; opened again, it would fail again.
                self._streams[key] = [iter(()), None]
                raise
            stream = self._streams[key] = [opened, None]
        if stream[1] is not None:
            pending, stream[1] = stream[1], None
            raise pending
        samples, error = take(stream[0], request.batch_size)
        position = self._position() if samples else None
        if error is not None:
            stream[0] = iter(())
        batch, stream[1] = stream_batch(samples, error, request.batch_size, request.drop_last)
        if batch is END:
            stream[0] = iter(())  # drop the dataset's iterator now; END again if asked
        return batch, position


def continued_share(start: int, step: int, resumed: bool) -> tuple[int, int]:
    """The ``(start, step)`` of a reader's share of a stream, once the dataset continues a
    saved state (``resumed``) or not.

    A reader keeps items ``start, start + step, ...``; the state it saved was taken just after
    one of them, so the continued stream's next kept item is ``step - 1`` items on.
    """
    return (step - 1, step) if resumed else (start, step)


def stream_batch(
    samples: list[Any], error: BaseException | None, batch_size: int, drop_last: bool
) -> tuple[list[Any] | Any, BaseException | None]:
    """The one rule that turns what a stream gave into a batch, for sync and async streams.

    Returns ``(batch or END, error still to raise)``: a stream that failed after giving samples
    delivers them first; a short last batch is dropped with ``drop_last`` unless the stream
    failed (then nothing it produced may vanish unnamed).

    Raises:
        BaseException: ``error``, when the stream failed before giving any sample.
    """
    if error is not None and not samples:
        raise error
    short = len(samples) < batch_size and error is None
    if not samples or (drop_last and short):
        return END, error
    return samples, error


def take(it: Iterator[Any], n: int) -> tuple[list[Any], BaseException | None]:
    """Up to ``n`` items of ``it``, and the error that stopped it early, if any.

    By ``next()`` alone: ``for item in it`` would call ``iter(it)`` for every batch, and a
    dataset that is its own iterator restarts there (its ``__iter__`` reopens a file)."""
    out: list[Any] = []
    try:
        while len(out) < n:
            out.append(next(it))
    except StopIteration:
        pass
    except Exception as exc:
        return out, exc
    return out, None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _short(indices: Sequence[int], limit: int = 16) -> str:
    if len(indices) <= limit:
        return str(list(indices))
    return f"[{', '.join(map(str, indices[:limit]))}, ... ({len(indices)} in all)]"


def indices_text(request: BatchRequest) -> str:
    """The indices of ``request`` for a message: the first eight, and the count."""
    indices = list(request.indices)
    if len(indices) > 8:
        return f"indices {indices[:8]}... ({len(indices)} in all)"
    return f"indices {indices}"
