"""Several tasks awaiting ``anext()`` of one async iterator at once (_epoch, ``Epoch.__anext__``).

Several consumer tasks on one loop may pull from one iterator: each batch goes to exactly one
of them, in the sampler's order, on every route of the hand-over: through a device stage (the
copies right behind the first cross while it is awaited), the batches carried into an epoch
under equal steps, and the plain hand-over without a device. A caller cancelled while it is
served, or while it waits for its turn, loses nothing: the batch goes to the next caller.

The device stage is a fake through the epoch's ``device`` argument (the ``_epoch.DeviceStage``
protocol), as in ``test_epoch``; its copies take a few loop turns, or wait for the test. Every
wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from datasets import Range
from helpers import BOUND_S, epoch_over

from aioloader import DataLoader
from aioloader._epoch._consume import DeviceStage, Epoch
from aioloader._sampling import Lockstep
from aioloader._stats._counters import Counters

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

BATCH = 4
BATCHES = 10
TASKS = 4


@contextlib.asynccontextmanager
async def an_epoch(
    device: DeviceStage | None, *, lockstep: Lockstep | None = None, **settings: Any
) -> AsyncIterator[tuple[Epoch, Counters]]:
    """Epoch 0 over ``Range(BATCHES * BATCH)`` in sampler order, made on helper threads as a
    loader makes it, with ``device`` as its device stage (``helpers.epoch_over``), and its
    statistics."""
    counters = Counters()
    dataset = Range(BATCHES * BATCH)
    async with epoch_over(
        dataset, device, lockstep=lockstep, counters=counters, batch_size=BATCH, **settings
    ) as epoch:
        yield epoch, counters


class _Copy:
    """A device copy that takes ``turns`` loop turns, or waits for ``gate``."""

    def __init__(self, batch: Any, turns: int, gate: asyncio.Event | None) -> None:
        self.batch = batch
        self.turns = turns
        self.gate = gate

    async def wait(self) -> Any:
        for _ in range(self.turns):
            await asyncio.sleep(0)
        if self.gate is not None:
            await self.gate.wait()
        return self.batch


class FakeDevice:
    """A device stage whose copies take 1 to 3 loop turns each (uneven, so copies started
    together finish out of order), or wait until the test sets ``gate``; it notes the id of
    each copy it starts, and sets ``copying`` at the first."""

    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.gate = gate
        self.started: list[int] = []
        self.copying = asyncio.Event()

    def start(self, batch: Any, batch_id: int) -> _Copy:
        self.started.append(batch_id)
        self.copying.set()
        return _Copy(batch, 1 + batch_id % 3, self.gate)


def first_of(batch: Any) -> int:
    """The batch's number in the sampler's order (``Range``: batch i holds 4i, 4i + 1, ...)."""
    assert isinstance(batch, torch.Tensor)
    return int(batch[0]) // BATCH


async def consume(it: AsyncIterator[Any], handed: list[tuple[int, int]], task: int) -> None:
    """Take batches until the epoch ends, noting ``(batch, task)`` as each arrives."""
    async for batch in it:
        handed.append((first_of(batch), task))


async def run_tasks(it: AsyncIterator[Any], tasks: int) -> list[tuple[int, int]]:
    handed: list[tuple[int, int]] = []
    async with asyncio.timeout(BOUND_S):
        await asyncio.gather(*(consume(it, handed, task) for task in range(tasks)))
    return handed


# -- every batch exactly once, in order ----------------------------------------------------------


@pytest.mark.parametrize("device_prefetch", [1, 3])
async def test_tasks_on_one_iterator_with_a_device_stage_get_each_batch_once_in_order(
    device_prefetch: int,
) -> None:
    device = FakeDevice()
    async with an_epoch(device, device_prefetch=device_prefetch) as (epoch, counters):
        handed = await run_tasks(aiter(epoch), TASKS)
        # Handed in the sampler's order, each batch once, and one copy started per batch.
        assert [batch for batch, _ in handed] == list(range(BATCHES))
        assert sorted(device.started) == list(range(BATCHES))
        # The callers took turns (the first in line got the next batch), each in order.
        assert {task for _, task in handed} == set(range(TASKS))
        # Every permit came back: nothing is held for a batch handed twice or never.
        assert counters.batches_yielded == BATCHES
        assert epoch.reorder.pending == 0
        assert epoch.finished


async def test_tasks_on_one_loader_without_a_device_get_each_batch_once_in_order() -> None:
    async with DataLoader(Range(BATCHES * BATCH), batch_size=BATCH) as loader:
        handed = await run_tasks(aiter(loader), TASKS)
        assert [batch for batch, _ in handed] == list(range(BATCHES))
        assert loader.statistics().batches_yielded == BATCHES
        assert loader.statistics().in_flight == 0


async def test_carried_batches_under_equal_steps_go_once_each_through_the_device() -> None:
    # Three batches read past the last epoch's end come first, each copied and handed once,
    # then this epoch's own. (The others have as many steps as this rank: all_min of one.)
    lockstep = Lockstep((0, 1), "carry", all_min=lambda values: values)
    carried = [torch.tensor([-1 - k] * BATCH) for k in range(3)]
    lockstep.carried = [(batch, BATCH, batch.nbytes) for batch in carried]
    device = FakeDevice()
    try:
        async with an_epoch(device, lockstep=lockstep, device_prefetch=2) as (epoch, _):
            handed: list[int] = []

            async def take_all() -> None:
                async for batch in aiter(epoch):
                    handed.append(int(batch[0]))

            async with asyncio.timeout(BOUND_S):
                await asyncio.gather(*(take_all() for _ in range(TASKS)))
            assert handed == [-1, -2, -3] + [BATCH * i for i in range(BATCHES)]
            # One copy per carried batch (ids -1, -2, -3), one per batch of the epoch.
            assert sorted(device.started) == [-3, -2, -1, *range(BATCHES)]
            assert epoch.finished
    finally:
        lockstep.close()


# -- a cancelled caller loses nothing ------------------------------------------------------------


@pytest.mark.parametrize("cancelled", ["served", "waiting for its turn"])
async def test_a_caller_cancelled_mid_wait_leaves_its_batch_to_the_next(cancelled: str) -> None:
    gate = asyncio.Event()
    device = FakeDevice(gate)
    async with an_epoch(device, device_prefetch=2) as (epoch, counters):
        it = aiter(epoch)
        async with asyncio.timeout(BOUND_S):
            first = asyncio.ensure_future(anext(it))
            await device.copying.wait()  # the first is served: batch 0 is crossing
            second = asyncio.ensure_future(anext(it))
            await asyncio.sleep(0)  # the second waits for its turn
            assert not first.done()
            assert not second.done()
            victim, survivor = (first, second) if cancelled == "served" else (second, first)
            victim.cancel()
            with pytest.raises(asyncio.CancelledError):
                await victim
            gate.set()
            # The survivor gets batch 0 (the victim's, had it been served); nothing is lost.
            assert first_of(await survivor) == 0
            rest = await run_tasks(it, TASKS)
        assert [batch for batch, _ in rest] == list(range(1, BATCHES))
        assert sorted(device.started) == list(range(BATCHES))
        assert counters.batches_yielded == BATCHES
        assert epoch.reorder.pending == 0
        assert epoch.finished


async def test_a_cancelled_caller_of_a_loader_without_a_device_loses_nothing() -> None:
    async with DataLoader(Range(BATCHES * BATCH), batch_size=BATCH) as loader:
        it = aiter(loader)
        async with asyncio.timeout(BOUND_S):
            first = asyncio.ensure_future(anext(it))
            second = asyncio.ensure_future(anext(it))
            await asyncio.sleep(0)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            assert first_of(await second) == 0
            rest = await run_tasks(it, TASKS)
        assert [batch for batch, _ in rest] == list(range(1, BATCHES))
        assert loader.statistics().batches_yielded == BATCHES
