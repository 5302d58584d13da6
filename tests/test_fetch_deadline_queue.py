"""The fetch deadline of async datasets (_fetch) counts only the time a batch is served.

A batch's items wait for ``io_concurrency`` slots behind the items of the batches prefetched
before it; that wait is not its time (as ``_deadline`` promises for the CPU stage). Its clock
runs while one of its items holds a slot, so an item that holds a slot and never returns still
misses the deadline, and frees its slot for the batches queued behind it.

Every test makes the queue several times longer than ``timeout`` and a batch's own service
several times shorter, so no outcome rests on a close race. The deadline logic is driven as the
producer drives it (a ``Fetcher``, one fetch per batch, started in batch order) on a loop whose
clock skips idle waits (``loop_time``): the times are exact and take no real time. The last
test takes the same contract through a loader and a real server, in real time (it waits for no
deadline).
"""

from __future__ import annotations

import asyncio

import pytest
from datasets import AsyncRange
from helpers import BOUND_S, collect, expected_batches
from http_server import FaultServer, payload
from loop_time import run_skipping

from aioloader import DataLoader, LoaderTimeoutError
from aioloader._epoch._failures import FailureBudget
from aioloader._epoch._fetch import Fetcher
from aioloader._stats._counters import Counters
from aioloader._types import BatchRequest
from aioloader.sources import HTTPDataset

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

ITEM_S = 0.05  # each item's fetch
TIMEOUT_S = 0.5  # 10 x an item, 5 x a batch served with a slot per item
BATCHES = 20  # the last one queues 19 rounds of items (~1 s) behind the others: 2 x TIMEOUT_S


class HangsAt(AsyncRange):
    """Items take ``delay``; the items in ``bad`` never arrive. Items are named like the URLs
    of a remote source."""

    async def __getitem__(self, index: int) -> int:
        if index in self.bad:
            await asyncio.Event().wait()
        return await super().__getitem__(index)

    def item_name(self, index: int) -> str:
        return f"http://store/obj/{index}"


def fetched(
    dataset: AsyncRange, batch_size: int, *, io_concurrency: int, timeout: float
) -> tuple[list[object], Counters, float]:
    """Every batch of ``dataset`` fetched as an epoch's producer fetches them (all prefetched:
    one fetch per batch, started in batch order), on a loop whose clock skips idle waits: the
    raw items of each batch, or its error in its place; the counters; the loop time it took."""
    counters = Counters()

    async def main() -> tuple[list[object], float]:
        loop = asyncio.get_running_loop()
        fetcher = Fetcher(
            dataset,
            io_concurrency,
            timeout=timeout,
            skip_errors=False,
            budget=FailureBudget(0, counters),
            counters=counters,
        )
        started = loop.time()
        requests = [
            BatchRequest(0, b, list(range(b * batch_size, (b + 1) * batch_size)))
            for b in range(len(dataset) // batch_size)
        ]
        tasks = [asyncio.ensure_future(fetcher.fetch(r)) for r in requests]
        async with asyncio.timeout(BOUND_S * 100):  # loop time: a hang still ends
            done = await asyncio.gather(*tasks, return_exceptions=True)
        got: list[object] = [d if isinstance(d, BaseException) else d.raw for d in done]
        return got, loop.time() - started

    got, took = run_skipping(main())
    return got, counters, took


def test_prefetched_batches_queued_for_io_slots_do_not_time_out() -> None:
    # Before, the deadline began when a batch's fetch was scheduled: every batch prefetched
    # more than TIMEOUT_S worth of items behind the head missed it without being served.
    dataset = AsyncRange(4 * BATCHES, delay=ITEM_S)
    got, counters, took = fetched(dataset, 4, io_concurrency=4, timeout=TIMEOUT_S)
    assert got == expected_batches(4 * BATCHES, 4)
    assert counters.timeouts == 0
    assert dataset.max_running == 4  # the slots were the bottleneck: the batches queued
    # 20 rounds of items through the slots: the last batch queued for 19 of them, ~2 deadlines.
    assert took == pytest.approx(BATCHES * ITEM_S, abs=0.01)


def test_a_hung_item_holding_a_slot_times_out_naming_it_and_only_its_batch() -> None:
    # Item 5 holds a slot for ever: its batch misses the deadline (served, not queued), and
    # the batches queued behind it, served in the slots left, do not.
    dataset = HangsAt(4 * BATCHES, delay=ITEM_S, bad={5})
    got, counters, took = fetched(dataset, 4, io_concurrency=4, timeout=TIMEOUT_S)
    assert took < BOUND_S / 2  # no hang: the slot held for ever was freed at the deadline
    assert counters.timeouts == 1
    error = got[1]
    assert isinstance(error, LoaderTimeoutError)
    assert isinstance(error, TimeoutError)
    message = str(error)
    # Its clock ran from its first item's slot on: the deadline to the loop clock's tick.
    assert f"batch 1 (fetching indices [4, 5, 6, 7]) was not ready after {TIMEOUT_S:.2f} s" in (
        message
    )
    assert f"(timeout={TIMEOUT_S})" in message
    assert "still awaited item(s) 5 (http://store/obj/5)." in message
    assert got[:1] + got[2:] == [
        b for i, b in enumerate(expected_batches(4 * BATCHES, 4)) if i != 1
    ]


def test_a_batch_waiting_on_slots_a_hung_batch_holds_gets_them_at_its_deadline() -> None:
    # Batch 0 holds every slot and never returns. Batch 1, queued behind it, is not cut off
    # with it (before, both missed the deadline at once) and is served once batch 0's
    # deadline frees the slots: it neither hangs nor times out.
    dataset = HangsAt(4, delay=ITEM_S, bad={0, 1})
    got, counters, took = fetched(dataset, 2, io_concurrency=2, timeout=TIMEOUT_S)
    assert counters.timeouts == 1
    assert isinstance(got[0], LoaderTimeoutError)
    assert "still awaited item(s) 0 (http://store/obj/0), 1 (http://store/obj/1)." in str(got[0])
    assert got[1:] == [[2, 3]]
    assert took == pytest.approx(TIMEOUT_S + ITEM_S, abs=0.01)  # served right at the deadline


def test_a_batch_waiting_behind_its_own_items_is_served_and_can_miss_its_deadline() -> None:
    # With one slot, the batch's items are served one after another: all of it is its own
    # time (4 x 0.3 s served against a 0.4 s deadline), so the batch misses it.
    got, counters, _took = fetched(AsyncRange(4, delay=0.3), 4, io_concurrency=1, timeout=0.4)
    assert counters.timeouts == 1
    assert isinstance(got[0], LoaderTimeoutError)
    assert "still awaited item(s) 1, 2, 3." in str(got[0])  # item 0 was served in time


async def test_http_batches_queued_for_io_slots_do_not_time_out() -> None:
    # HTTPDataset: io_concurrency bounds the requests on the wire; the prefetched batches'
    # requests wait for it, and the server answers each in ITEM_S.
    async with FaultServer(latency=ITEM_S) as server:
        urls = [server.obj_url(i) for i in range(8 * BATCHES)]
        async with HTTPDataset(urls) as ds:
            loader = DataLoader(
                ds,
                batch_size=8,
                io_concurrency=8,
                prefetch=BATCHES,
                timeout=TIMEOUT_S,
                collate_fn=list,
            )
            async with loader:
                batches = await collect(loader)
                assert loader.statistics().timeouts == 0
    assert [raw for batch in batches for raw in batch] == [payload(i) for i in range(8 * BATCHES)]
