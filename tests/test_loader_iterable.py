"""Tests of the DataLoader over iterable datasets: sync streams (``__iter__``) on the helper
thread, on a thread pool and sharded across worker processes, and async streams (``__aiter__``)
pulled on the event loop.

The contract: every item exactly once per epoch (whether the dataset shards itself with
:func:`aioloader.get_worker_info` or leaves it to the loader), ``drop_last`` per stream, and a
stream that fails mid-way delivers everything it produced before the error, then raises it:
never a silent end (on threads and the loop that is in ``test_produce``, which delivers it in
turn). Datasets are defined at module level so worker processes can unpickle them; the plain
and failing streams and :class:`SelfSharded` are in ``datasets``.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch.utils.data as tud
from datasets import (
    AsyncStream,
    AsyncStreamCancelledAt,
    Broken,
    EntropyShuffled,
    OwnIterator,
    SelfSharded,
    ShuffledShards,
    ShuffledStream,
    Stream,
)
from helpers import BOUND_S, as_lists, chunks, drain, drain_sync
from procs import no_worker_left_behind

from aioloader import DataLoader, StreamOrderWarning, get_worker_info
from aioloader._workers._info import StreamRandom

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

# -- datasets ---------------------------------------------------------------------------------


class TorchStream(tud.IterableDataset):  # type: ignore[type-arg]
    """A torch IterableDataset (it inherits a ``__getitem__`` that must not make it map-style)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


# -- helpers ----------------------------------------------------------------------------------


async def collect(loader: DataLoader) -> list[list[int]]:
    """One epoch's batches, as lists."""
    async with asyncio.timeout(BOUND_S):
        return as_lists([batch async for batch in loader])


# -- sync streams in this process -------------------------------------------------------------


@pytest.mark.parametrize("threads", [0, 2])
async def test_stream_on_threads_yields_every_item_once_in_order(threads: int) -> None:
    kwargs: dict[str, Any] = {"num_workers": threads, "thread_pool": bool(threads)}
    for dataset in (Stream(22), SelfSharded(22), TorchStream(22)):
        async with DataLoader(dataset, batch_size=4, **kwargs) as loader:
            for _ in range(2):  # each iteration restarts the stream
                assert await collect(loader) == chunks(list(range(22)), 4)
            stats = loader.statistics()
            assert (stats.epoch, stats.samples_yielded, stats.batches_yielded) == (1, 44, 12)
            assert "yielded=6/?" in repr(loader)  # a stream has no length


async def test_stream_drop_last_and_an_exact_multiple() -> None:
    async with DataLoader(Stream(22), batch_size=4, drop_last=True) as loader:
        assert await collect(loader) == chunks(list(range(22)), 4, drop_last=True)
    async with DataLoader(Stream(8), batch_size=4, drop_last=True) as loader:
        assert await collect(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    async with DataLoader(Stream(0), batch_size=4) as loader:
        assert await collect(loader) == []


def test_sync_iteration_of_a_stream() -> None:
    with DataLoader(Stream(10), batch_size=4) as loader:
        assert as_lists(list(loader)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with DataLoader(Broken(fail_at=5), batch_size=2) as loader:
        got: list[list[int]] = []
        with pytest.raises(ValueError, match="broke at item 5"):
            drain_sync(loader, got)
        assert got == [[0, 1], [2, 3], [4]]


# -- sync streams sharded across worker processes ---------------------------------------------


@no_worker_left_behind()
def test_worker_processes_yield_every_item_exactly_once() -> None:
    for dataset in (Stream(23), SelfSharded(23)):
        with DataLoader(dataset, batch_size=4, num_workers=2) as loader:
            for _ in range(2):
                batches = as_lists(list(loader))
                items = [i for b in batches for i in b]
                assert Counter(items) == Counter(range(23)), type(dataset).__name__
                assert all(1 <= len(b) <= 4 for b in batches)
                # Each worker's share keeps its order: evens from worker 0, odds from worker 1.
                assert [i for i in items if i % 2 == 0] == list(range(0, 23, 2))
                assert [i for i in items if i % 2 == 1] == list(range(1, 23, 2))


@no_worker_left_behind()
@pytest.mark.parametrize("how", ["random", "numpy", "torch"])
def test_a_stream_that_shuffles_itself_is_split_across_workers_exactly(how: str) -> None:
    # Each worker reads the whole stream and keeps its share: that is exact only if every
    # worker's copy draws the same order. They used to draw it from the batch's seed, so each
    # worker saw another order (100 items yielded, ~80 of them distinct).
    importlib.import_module("numpy.random")  # lazy in numpy 2: seeded here only once imported
    orders = {}
    for workers, seed in ((2, 5), (2, 6)):
        with DataLoader(
            ShuffledStream(100, how), batch_size=4, num_workers=workers, seed=seed
        ) as loader:
            for epoch in range(2):
                items = [i for b in as_lists(list(loader)) for i in b]
                assert Counter(items) == Counter(range(100)), (workers, seed, epoch)
                # The stream's order depends on (seed, epoch) alone: worker k of W keeps
                # items k, k + W, ... of it, in order.
                with StreamRandom(seed).reading(epoch, epoch, True, keep=1):
                    order = list(ShuffledStream(100, how))
                at = {item: position for position, item in enumerate(order)}
                for k in range(workers):
                    kept = [i for i in items if at[i] % workers == k]
                    assert kept == order[k::workers], (workers, seed, epoch, k)
                orders[seed, epoch] = order
    assert orders[5, 0] != orders[5, 1] != orders[6, 1]  # another epoch or seed: another order


@pytest.mark.parametrize(("workers", "threads"), [(0, False), (2, True), (2, False)])
def test_a_stream_that_is_its_own_iterator_is_read_once_and_ends(
    workers: int, threads: bool
) -> None:
    # Its __iter__ starts over, as a file reader's reopens the file: read with `for` on every
    # batch, the stream restarted there (the first batch forever at num_workers=0; repeats
    # with workers). torch calls iter() once an epoch.
    with DataLoader(
        OwnIterator(11), batch_size=4, num_workers=workers, thread_pool=threads
    ) as loader:
        epochs = [as_lists(list(itertools.islice(loader, 9))) for _ in range(2)]  # 3-4 due
    for batches in epochs:
        assert sorted(i for b in batches for i in b) == list(range(11))
    assert epochs[0] == epochs[1]


@no_worker_left_behind()
def test_a_stream_that_shards_itself_shuffles_alike_then_draws_its_own() -> None:
    # Its shuffle, drawn before it reads which worker it is in, is common to the workers (so
    # each shard goes to one of them); its draws after that are the batch's, as before.
    with DataLoader(ShuffledShards(60), batch_size=4, num_workers=2, collate_fn=list) as loader:
        for _ in range(2):
            items = [item for batch in loader for item in batch]
            assert sorted(shard for shard, _ in items) == list(range(60))
            assert len({draw for _, draw in items}) == 60  # no two workers drew alike


@no_worker_left_behind()
@pytest.mark.parametrize("workers", [0, 2])
def test_two_iterators_of_one_epoch_number_each_read_the_stream_whole(workers: int) -> None:
    # set_epoch(3) before each: the same epoch number, two readings. Keyed by the number, the
    # workers' streams were shared between them: 26 and 24 of 40 items.
    with DataLoader(
        ShuffledStream(40, "random"), batch_size=2, num_workers=workers, collate_fn=list
    ) as loader:
        loader.set_epoch(3)
        one = iter(loader)
        got_one = list(next(one))
        loader.set_epoch(3)
        other = iter(loader)
        got_other: list[int] = []
        for a, b in zip(one, other, strict=False):
            got_one += a
            got_other += b
        got_one += [i for batch in one for i in batch]
        got_other += [i for batch in other for i in batch]
    assert sorted(got_one) == sorted(got_other) == list(range(40))
    if workers:
        assert got_one == got_other  # one epoch number, one order


@no_worker_left_behind()
def test_workers_that_read_a_stream_in_different_orders_are_told_not_silent() -> None:
    # Fresh entropy in each worker: no random state the loader sets can align the copies, so
    # the split loses and repeats items. The workers' first items are compared: it warns.
    told = "different items at the head of the stream of EntropyShuffled"
    with (
        DataLoader(EntropyShuffled(100), batch_size=4, num_workers=2) as loader,
        pytest.warns(StreamOrderWarning, match=told) as caught,
    ):
        items = [i for b in as_lists(list(loader)) for i in b]
    assert len(items) == 100
    assert len(caught) == 1  # once an epoch
    # Where warnings are errors, the epoch fails in the batch's turn, and nothing hangs.
    with DataLoader(EntropyShuffled(100), batch_size=4, num_workers=2) as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("error", StreamOrderWarning)
            with pytest.raises(StreamOrderWarning):
                list(loader)
        # The loader stays usable: the next epoch warns again (each epoch is checked).
        with pytest.warns(StreamOrderWarning):
            assert len([i for b in as_lists(list(loader)) for i in b]) == 100


@no_worker_left_behind()
def test_worker_processes_drop_last_per_stream_and_a_failing_stream() -> None:
    with DataLoader(Stream(22), batch_size=4, num_workers=2, drop_last=True) as loader:
        batches = as_lists(list(loader))
    # Each worker streams 11 items: 2 full batches each, the 3 left over are dropped.
    assert all(len(b) == 4 for b in batches)
    items = [i for b in batches for i in b]
    assert len(items) == len(set(items)) == 16
    assert sorted(i for i in items if i % 2 == 0) == list(range(0, 16, 2))
    assert sorted(i for i in items if i % 2 == 1) == list(range(1, 16, 2))
    with DataLoader(Broken(fail_at=7), batch_size=3, num_workers=2) as loader:
        got: list[list[int]] = []
        with pytest.raises(ValueError, match="broke at item 7"):
            drain_sync(loader, got)
        # Both workers read the whole stream up to the failure; each kept its half of it.
        assert sorted(i for batch in got for i in batch) == list(range(7))


class Undercounted(Stream):
    """Says it has ``said`` items and yields ``n``."""

    def __init__(self, n: int, said: int) -> None:
        super().__init__(n)
        self.said = said

    def __len__(self) -> int:
        return self.said


class ShardsWrongly(SelfSharded):
    """Asks which worker it is in (so the loader leaves sharding to it), then yields the whole
    stream in every worker: the mistake torch's length warning is there to catch."""

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        assert info is not None
        assert info.num_workers == 2  # read: sharding is left to the stream
        yield from range(self.n)


def test_more_batches_than_len_said_warn_once_per_epoch_and_lose_nothing() -> None:
    with DataLoader(Undercounted(12, said=8), batch_size=4) as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # len() never asked (list() would ask, for its size): nothing to contradict.
            assert sum(1 for _ in loader) == 3
        assert len(loader) == 2
        for _ in range(2):
            warned = r"epoch \d+: len\(loader\) said 2 batches.*yielded 3"
            with pytest.warns(UserWarning, match=warned) as w:
                batches = as_lists(list(loader))
            assert [i for b in batches for i in b] == list(range(12))
            assert len([x for x in w if "len(loader)" in str(x.message)]) == 1


def test_two_iterators_at_once_over_a_stream_of_the_right_length_are_not_warned_of() -> None:
    with DataLoader(Undercounted(8, said=8), batch_size=2) as loader:
        assert len(loader) == 4
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pairs = list(zip(loader, loader, strict=True))
    assert [a.tolist() for a, _ in pairs] == [b.tolist() for _, b in pairs]
    assert len(pairs) == 4


@no_worker_left_behind()
def test_a_stream_that_shards_itself_wrongly_across_workers_is_warned_of() -> None:
    with DataLoader(ShardsWrongly(8), batch_size=2, num_workers=2) as loader:
        assert len(loader) == 4
        with pytest.warns(UserWarning, match=r"said 4 batches.*workers yield more than their"):
            items = [i for b in as_lists(list(loader)) for i in b]
    assert Counter(items) == Counter({i: 2 for i in range(8)})  # as torch: each worker's copy


# -- async streams ----------------------------------------------------------------------------


async def test_async_stream_yields_every_item_once_in_order() -> None:
    dataset = AsyncStream(22)
    async with DataLoader(dataset, batch_size=4) as loader:
        assert await collect(loader) == chunks(list(range(22)), 4)
        assert await collect(loader) == chunks(list(range(22)), 4)
    assert dataset.closed == 2
    async with DataLoader(AsyncStream(22), batch_size=4, drop_last=True) as loader:
        assert await collect(loader) == chunks(list(range(22)), 4, drop_last=True)
    async with DataLoader(AsyncStream(8), batch_size=4, drop_last=True) as loader:
        assert await collect(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_a_cancelled_error_from_an_async_stream_is_an_error_not_its_end(
    num_workers: int,
) -> None:
    # Before, the stream's read ended as if cancelled: the epoch ended early without a word,
    # and the items read into the unfinished batch were dropped.
    stream = AsyncStreamCancelledAt(64, fail_at=20)
    async with DataLoader(stream, batch_size=8, num_workers=num_workers) as loader:
        got: list[list[int]] = []
        with pytest.raises(RuntimeError, match="CancelledError"):
            await drain(aiter(loader), got)
    assert [i for batch in got for i in batch] == list(range(20))


async def test_abandoned_async_stream_is_closed_and_the_next_epoch_is_complete() -> None:
    dataset = AsyncStream(30)
    async with DataLoader(dataset, batch_size=2, prefetch=2) as loader:
        async for _ in loader:
            break
        assert await collect(loader) == chunks(list(range(30)), 2)
    assert dataset.closed == 2  # the abandoned stream's generator was closed too


def test_a_reading_closed_to_make_room_fails_its_next_request_rather_than_repeat_samples() -> None:
    # One reader keeps MAX_OPEN_STREAMS readings open; opening one more closes the oldest. A
    # later request of the closed one used to open the stream again from its start and hand
    # samples it had already given; it fails instead, naming why, and an epoch that opens
    # that reading afresh reads it whole.
    from aioloader._batch._make import MAX_OPEN_STREAMS, StreamCursor
    from aioloader._types import StreamRequest

    cursor = StreamCursor(lambda resume: iter(range(10)))

    def ask(reading: int, opens: bool) -> Any:
        request = StreamRequest(
            epoch=0, batch_id=0, batch_size=2, drop_last=False, opens=opens, reading=reading
        )
        return cursor.next_samples(request)[0]

    assert ask(0, True) == [0, 1]
    for reading in range(1, MAX_OPEN_STREAMS + 1):  # the last one closes reading 0
        assert ask(reading, True) == [0, 1]
    assert ask(1, False) == [2, 3]  # still open: goes on
    with pytest.raises(RuntimeError, match=r"closed to make room.*repeat the samples"):
        ask(0, False)
    assert ask(0, True) == [0, 1]  # opened afresh: a new epoch of it, whole
