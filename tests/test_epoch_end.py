"""The end of an epoch, as the resume state sees it.

- A consumer that counts to ``len(loader)`` (Lightning, accelerate) never makes the ``anext``
  that would end the epoch: once it took the last batch the epoch is complete, for a stream
  whose length is known as for map-style data, and ``state_dict()`` starts the next epoch.
- The ``anext`` that ends an epoch closes it; cancelled in that close (a timeout around it),
  the epoch is still over: the state starts the next epoch, and loads.
- ``aclose()`` cancelled while it waits for the epoch's tasks still wakes a consumer waiting
  for a batch of that epoch, and drops what was produced.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from datasets import Range, Slow, Stream

from aioloader import DataLoader

pytestmark = pytest.mark.usefixtures("baseline")

BOUND_S = 20.0


class SizedStream(Stream):
    """A stream that says its length, as a dataset of counted records does."""

    def __len__(self) -> int:
        return self.n


def items(batches: list[Any]) -> list[int]:
    return [i for batch in batches for i in batch.tolist()]


def state_once_over(loader: DataLoader) -> dict[str, Any]:
    """The loader's state once its epoch is booked complete: a stream's readers find its end
    a moment after (or before) the consumer took the last batch, on their own threads."""
    deadline = time.monotonic() + BOUND_S
    state = loader.state_dict()
    while state["epoch"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
        state = loader.state_dict()
    return state


@pytest.mark.parametrize(
    ("dataset", "kwargs"),
    [
        (Range(12), {}),
        (Range(12), {"num_workers": 2, "thread_pool": True}),
        (SizedStream(12), {"num_workers": 2, "thread_pool": True}),
        (SizedStream(16), {"num_workers": 2}),
    ],
    ids=["map", "map-threads", "stream-threads", "stream-processes"],
)
def test_an_epoch_taken_to_its_length_is_complete_in_the_state(
    dataset: Any, kwargs: dict[str, Any]
) -> None:
    # (A stream read in the caller's thread, num_workers=0, finds its end only at the read
    # after its last batch, which a consumer counting to len(loader) never asks for.)
    # (A stream read by two worker processes ends each reader's share with a batch of its own,
    # as torch's does: 16 items, 4 per batch, leave no partial batch to shift the count.)
    n = dataset.n
    with DataLoader(dataset, batch_size=4, **kwargs) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(len(loader))]
        assert sorted(items(first)) == list(range(n))
        state = state_once_over(loader)
    assert state["epoch"] == 1
    assert state["done"] == []
    resumed = DataLoader(type(dataset)(n), batch_size=4, **kwargs)
    with resumed:
        resumed.load_state_dict(state)
        assert sorted(items(list(resumed))) == list(range(n))  # a whole epoch, the next one


async def test_a_consumer_cancelled_in_the_close_that_ends_a_stream_epoch_leaves_it_over() -> None:
    async with asyncio.timeout(BOUND_S):
        loader = DataLoader(Stream(12), batch_size=4)
        try:
            it = aiter(loader)
            got = [await anext(it) for _ in range(3)]
            assert items(got) == list(range(12))
            ending = asyncio.ensure_future(anext(it))
            epoch = it.epoch
            assert epoch is not None
            for _ in range(10_000):  # until the anext is inside the epoch's close
                if epoch._closed:
                    break
                await asyncio.sleep(0)
            assert epoch._closed, "the ending anext never reached the close"
            ending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await ending
            with pytest.raises(StopAsyncIteration):
                await anext(it)
            state = loader.state_dict()
        finally:
            await loader.aclose()
    assert (state["epoch"], state["done"]) == (1, [])
    resumed = DataLoader(Stream(12), batch_size=4)
    resumed.load_state_dict(state)
    async with resumed:
        assert items([b async for b in resumed]) == list(range(12))


async def test_a_cancelled_aclose_still_wakes_the_consumer_waiting_on_the_epoch() -> None:
    loader = DataLoader(Slow(8, 0.5), batch_size=4, num_workers=2, thread_pool=True)
    try:
        async with asyncio.timeout(BOUND_S):
            it = aiter(loader)
            waiting = asyncio.ensure_future(anext(it))
            await asyncio.sleep(0.05)  # the consumer waits for batch 0 (both batches in threads)
            closing = asyncio.ensure_future(it.aclose())
            await asyncio.sleep(0)  # the close now waits for the epoch's tasks
            closing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await closing
            async with asyncio.timeout(3.0):  # the threads' reads end within 0.5 s
                with pytest.raises(StopAsyncIteration):
                    await waiting
            assert it.epoch is not None
            assert len(it.epoch.reorder) == 0
    finally:
        await loader.aclose()
