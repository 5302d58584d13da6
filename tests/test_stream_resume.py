"""Resuming iterable datasets mid-epoch: exactly, for a :class:`aioloader.ResumableStream`; a
clear refusal, never a silent replay, for a stream without that protocol.

The exactness contract: the batches taken before ``state_dict()`` and the batches a new loader
yields after ``load_state_dict(state)`` are, in order, the batches of an uninterrupted epoch,
whether the stream is read by the helper thread, a thread pool, worker processes (split by the
loader, or sharding itself) or pulled on the event loop.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
from typing import Any

import pytest
from datasets import AsyncResumable, Resumable, Stream
from helpers import BOUND_S, as_lists, chunks

import aioloader
from aioloader import DataLoader
from aioloader.sources import TarDataset

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

N = 20
SIZE = 3
EPOCH = chunks(list(range(N)), SIZE)  # what one uninterrupted epoch yields, in order


def take_sync(loader: DataLoader, k: int) -> tuple[list[list[int]], dict[str, Any]]:
    """The first ``k`` batches of an epoch, and the state after them."""
    it = iter(loader)
    taken = as_lists([next(it) for _ in range(k)])
    return taken, loader.state_dict()


def rest_sync(loader: DataLoader) -> list[list[int]]:
    return as_lists(list(loader))


# -- a stream that cannot resume --------------------------------------------------------------


def test_mid_epoch_state_of_a_plain_stream_is_refused() -> None:
    with DataLoader(Stream(N), batch_size=SIZE) as loader:
        _, state = take_sync(loader, 2)
    fresh = DataLoader(Stream(N), batch_size=SIZE)
    with fresh, pytest.raises(ValueError, match="cannot resume") as info:
        fresh.load_state_dict(state)
    message = str(info.value)
    assert "in epoch 0 after 2 batches" in message
    assert "dataset=Stream" in message
    assert "aioloader.ResumableStream" in message
    assert "'done': []" in message  # how to replay on purpose


def test_plain_stream_states_that_need_no_position_are_accepted() -> None:
    with DataLoader(Stream(N), batch_size=SIZE) as loader:
        before = loader.state_dict()  # before any batch
        assert rest_sync(loader) == EPOCH
        between = loader.state_dict()  # after a whole epoch: the next one
        _, mid = take_sync(loader, 1)
    with DataLoader(Stream(N), batch_size=SIZE) as fresh:
        fresh.load_state_dict(before)
        assert rest_sync(fresh) == EPOCH
        fresh.load_state_dict(between)
        assert rest_sync(fresh) == EPOCH
        assert fresh.state_dict()["epoch"] == 2
        # Replaying an epoch is possible, but only when asked for.
        fresh.load_state_dict({**mid, "done": [], "streams": None})
        assert rest_sync(fresh) == EPOCH


def test_a_pickled_loader_over_a_plain_stream_restarts_it_as_before() -> None:
    with DataLoader(Stream(N), batch_size=SIZE) as loader:
        take_sync(loader, 2)
        copy = pickle.loads(pickle.dumps(loader))
    with copy:
        assert rest_sync(copy) == EPOCH


# -- resumable streams ------------------------------------------------------------------------


def test_the_protocol_is_structural() -> None:
    assert isinstance(Resumable(3), aioloader.ResumableStream)
    assert isinstance(AsyncResumable(3), aioloader.ResumableStream)
    assert not isinstance(Stream(3), aioloader.ResumableStream)
    assert isinstance(TarDataset(["0.tar"]), aioloader.ResumableStream)  # read on the loop


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"num_workers": 2, "thread_pool": True}],
    ids=["helper-thread", "thread-pool"],
)
def test_resume_on_threads_continues_the_stream_exactly(kwargs: dict[str, Any]) -> None:
    with DataLoader(Resumable(N), batch_size=SIZE, **kwargs) as loader:
        taken, state = take_sync(loader, 3)
    dataset = Resumable(N)
    with DataLoader(dataset, batch_size=SIZE, **kwargs) as resumed:
        resumed.load_state_dict(state)
        assert taken + rest_sync(resumed) == EPOCH
        assert dataset.yielded == N - 3 * SIZE  # continued, not replayed and skipped
        assert rest_sync(resumed) == EPOCH  # the next epoch starts at the beginning


@pytest.mark.parametrize("self_sharded", [False, True], ids=["split-by-loader", "self-sharded"])
def test_resume_across_worker_processes_continues_each_share(self_sharded: bool) -> None:
    def loader() -> DataLoader:
        return DataLoader(Resumable(N, self_sharded=self_sharded), batch_size=SIZE, num_workers=2)

    with loader() as first:
        expected = rest_sync(first)  # round-robin over the two workers' shares
        taken, state = take_sync(first, 3)  # worker 0, 1, 0: the next batch is worker 1's
    assert state["streams"]["readers"] == 2
    assert state["streams"]["last"] == 0
    with loader() as second:
        second.load_state_dict(state)
        it = iter(second)
        more = as_lists([next(it)])
        again = second.state_dict()  # saved again inside the resumed epoch
        del it
    assert again["done"] == [0, 1, 2, 3]
    with loader() as third:
        third.load_state_dict(again)
        assert taken + more + rest_sync(third) == expected
    assert sorted(i for batch in expected for i in batch) == list(range(N))


@pytest.mark.parametrize(
    "kwargs", [{"num_workers": 1}, {"num_workers": 2, "thread_pool": True}], ids=["1", "threads"]
)
def test_resume_with_another_reader_count_is_refused_by_load_state_dict(
    kwargs: dict[str, Any],
) -> None:
    # Refused where the state is loaded (a checkpoint restore), not at the first batch of the
    # resumed epoch; the loader is left as it was: its next epoch is a whole one.
    with DataLoader(Resumable(N), batch_size=SIZE, num_workers=2) as loader:
        _, state = take_sync(loader, 1)
    with DataLoader(Resumable(N), batch_size=SIZE, **kwargs) as other:
        with pytest.raises(ValueError, match=r"saved from 2 stream readers .* this loader has 1"):
            other.load_state_dict(state)
        assert sorted(i for batch in rest_sync(other) for i in batch) == list(range(N))


async def take_async(loader: DataLoader, k: int) -> list[Any]:
    it = aiter(loader)
    try:
        return [await anext(it) for _ in range(k)]
    finally:
        await it.aclose()


@pytest.mark.parametrize(
    ("saved_with", "resumed_with"),
    [({}, {}), ({"num_workers": 2, "thread_pool": True}, {})],
    ids=["same", "another-worker-count"],
)
async def test_resume_of_an_async_stream_continues_it_exactly(
    saved_with: dict[str, Any], resumed_with: dict[str, Any]
) -> None:
    # The loop reads an async stream: one reader whatever num_workers is.
    async with asyncio.timeout(BOUND_S):
        async with DataLoader(AsyncResumable(N), batch_size=SIZE, **saved_with) as loader:
            taken = as_lists(await take_async(loader, 2))
            state = loader.state_dict()
        assert state["streams"] == {"readers": 1, "last": 0, "states": {0: {"next": 6}}}
        async with DataLoader(AsyncResumable(N), batch_size=SIZE, **resumed_with) as resumed:
            resumed.load_state_dict(state)
            rest = as_lists([batch async for batch in resumed])
    assert taken + rest == EPOCH


async def test_out_of_order_a_batch_taken_past_one_in_flight_is_repeated_not_lost() -> None:
    # in_order=False hands over batch 2 while batch 1 is still being made: the state must be
    # the one after batch 0 (the last taken with every earlier one), so batch 1 is not lost.
    release = threading.Event()

    def collate(samples: list[int]) -> list[int]:
        if samples[0] == SIZE:  # batch 1 waits until batches past it were taken
            release.wait(BOUND_S)
        return samples

    kwargs: dict[str, Any] = {"num_workers": 2, "thread_pool": True, "in_order": False}
    async with asyncio.timeout(BOUND_S):
        loader = DataLoader(AsyncResumable(N), batch_size=SIZE, collate_fn=collate, **kwargs)
        async with loader:
            it = aiter(loader)
            try:
                taken = [await anext(it), await anext(it)]
                state = loader.state_dict()
            finally:
                release.set()
                await it.aclose()
        assert taken == [EPOCH[0], EPOCH[2]]
        assert state["streams"]["states"] == {0: {"next": SIZE}}  # after batch 0 only
        async with DataLoader(AsyncResumable(N), batch_size=SIZE, **kwargs) as resumed:
            resumed.load_state_dict(state)
            rest = as_lists([batch async for batch in resumed])
    assert sorted(rest) == EPOCH[1:]  # batch 2 again, batch 1 not lost


@pytest.mark.parametrize(
    "kwargs", [{}, {"num_workers": 1, "persistent_workers": True}], ids=["thread", "persistent"]
)
def test_an_epoch_number_read_again_reads_the_whole_stream_again(kwargs: dict[str, Any]) -> None:
    # The readers keep a stream per epoch number; a replayed number once found it ended.
    with DataLoader(Stream(N), batch_size=SIZE, **kwargs) as loader:
        for _ in range(2):
            loader.set_epoch(0)
            assert rest_sync(loader) == EPOCH
