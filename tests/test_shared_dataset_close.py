"""Two loaders over one dataset: closing one leaves the other's connections alone.

A training loader and an evaluation loader often read the same ``HTTPDataset``. Closing a
loader closes its dataset's sessions (``aclose()``); with two open loaders, the first to close
must not close them under the other's requests in flight: the last open loader closes them,
and until then each loader's private loop closes only its own session as it ends.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from helpers import BOUND_S
from http_server import Fault, FaultServer

from aioloader import DataLoader
from aioloader.sources import HTTPDataset

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

N = 160  # training reads 0..127, evaluation 128..159
TRAIN = range(128)
EVAL = range(128, N)
SLOW_S = 0.4  # training's items after its first batch: in flight while evaluation closes


def decode(raw: bytes) -> int:
    return int.from_bytes(raw[:8], "little")  # http_server.payload starts with the index


def slow_after_first_batch(server: FaultServer) -> None:
    for i in TRAIN[16:]:
        server.fail_always(f"/obj/{i}", Fault.latency(SLOW_S))


async def test_closing_one_async_loader_leaves_the_other_loaders_requests_in_flight() -> None:
    server = FaultServer(size=256)
    await server.start()
    try:
        slow_after_first_batch(server)
        dataset = HTTPDataset([server.obj_url(i) for i in range(N)], decode=decode)
        got: list[int] = []
        async with asyncio.timeout(BOUND_S):
            train = DataLoader(dataset, batch_size=16, sampler=TRAIN, io_concurrency=64)
            async with train:
                async for batch in train:
                    got += batch.tolist()
                    if len(got) == 16:
                        await asyncio.sleep(0.1)  # the next batches' requests are on the wire
                        assert train.statistics().requests_in_flight > 0
                        async with DataLoader(dataset, batch_size=16, sampler=EVAL) as ev:
                            assert [i async for b in ev for i in b.tolist()] == list(EVAL)
                stats = train.statistics()
            assert got == list(TRAIN)
            assert stats.remote_retries == 0  # no request of training's broke off
            assert "open_sessions=0" in repr(dataset)  # the last loader closed them
    finally:
        await server.stop()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_closing_one_sync_loader_leaves_the_other_loaders_session(num_workers: int) -> None:
    # Each `for` loop runs on its loader's private loop, with a session of its own there.
    with FaultServer(size=256).in_thread() as server:
        slow_after_first_batch(server)
        dataset = HTTPDataset([server.obj_url(i) for i in range(N)], decode=decode)
        got: list[int] = []
        started = time.monotonic()
        with DataLoader(
            dataset, batch_size=16, sampler=TRAIN, io_concurrency=64, num_workers=num_workers
        ) as train:
            for batch in train:
                got += batch.tolist()
                if len(got) == 16:
                    time.sleep(0.1)
                    with DataLoader(dataset, batch_size=16, sampler=EVAL) as ev:
                        assert [i for b in ev for i in b.tolist()] == list(EVAL)
                assert time.monotonic() - started < BOUND_S
            stats = train.statistics()
        assert got == list(TRAIN)
        assert stats.remote_retries == 0
        assert "open_sessions=0" in repr(dataset)


class Closeable:
    """A map-style dataset with ``aclose()``, counting its closes."""

    def __init__(self) -> None:
        self.closes = 0

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return index

    async def aclose(self) -> None:
        self.closes += 1


@pytest.mark.parametrize("how", ["close", "aclose"])
async def test_the_last_open_loader_closes_a_shared_dataset_once(how: str) -> None:
    dataset = Closeable()
    first, second = DataLoader(dataset, batch_size=4), DataLoader(dataset, batch_size=4)
    for loader in (first, second):
        assert len([b async for b in loader]) == 2

    async def close(loader: Any) -> None:
        if how == "close":
            await asyncio.to_thread(loader.close)
        else:
            await loader.aclose()

    await close(first)
    assert dataset.closes == 0  # the second loader still reads it
    assert len([b async for b in second]) == 2
    await close(second)
    assert dataset.closes == 1
    await close(second)  # idempotent
    assert dataset.closes == 1
