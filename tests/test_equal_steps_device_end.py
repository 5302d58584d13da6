"""The agreed end of an epoch under equal steps, with a device stage (_epoch, ``_end_agreed``).

At the agreed end the epoch takes out everything this rank holds past it and then awaits the
device copies already crossing. Batches still being made meanwhile are cut: their outcomes,
arriving during that wait, must be dropped as the epoch's close drops them. Stored instead,
each raised ``KeyError`` in its task or callback (the buffer no longer expected it), reported
by the loop as an unhandled exception.

Another rank is simulated by the collective (``all_min``): it has ``OTHER`` batches. The device
stage is a fake whose copies wait for the test. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from datasets import Range
from helpers import BOUND_S, epoch_over

from aioloader._sampling import Lockstep

pytestmark = pytest.mark.usefixtures("baseline")

BATCH = 2
BATCHES = 12
OTHER = 2  # the other rank's batches: the agreed end is step 2
SLOW_FROM = 4 * BATCH  # samples from here on take SLOW_S to read: in flight at the end
SLOW_S = 0.2


class SlowTail(Range):
    """``Range``, whose samples from ``SLOW_FROM`` on are slow to read (on the helper threads)."""

    def __getitem__(self, index: int) -> int:
        if index >= SLOW_FROM:
            time.sleep(SLOW_S)
        return super().__getitem__(index)


class _Copy:
    def __init__(self, batch: Any, gate: asyncio.Event) -> None:
        self.batch = batch
        self.gate = gate

    async def wait(self) -> Any:
        await self.gate.wait()
        return self.batch


class GatedDevice:
    """Copies that wait until ``gate`` is set."""

    def __init__(self, gate: asyncio.Event) -> None:
        self.gate = gate

    def start(self, batch: Any, batch_id: int) -> _Copy:
        return _Copy(batch, self.gate)


def other_rank_has(batches: int) -> Any:
    """The collective of this rank and one other that has ``batches`` batches: the minimum of
    ``[have, epoch, -epoch, step, -step]`` (see ``_sampling._lockstep``)."""

    def all_min(values: list[int]) -> list[int]:
        have, epoch, minus_epoch, step, minus_step = values
        return [min(have, 1 if step < batches else 0), epoch, minus_epoch, step, minus_step]

    return all_min


async def test_batches_still_made_at_the_agreed_end_are_cut_while_the_copies_cross() -> None:
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    lockstep = Lockstep((0, 1), "drop", all_min=other_rank_has(OTHER))
    gate = asyncio.Event()
    settings = {"num_workers": 2, "thread_pool": True, "prefetch": 8, "device_prefetch": 3}
    made = epoch_over(
        SlowTail(BATCHES * BATCH),
        GatedDevice(gate),
        lockstep=lockstep,
        batch_size=BATCH,
        **settings,
    )
    try:
        async with made as epoch, asyncio.timeout(BOUND_S):
            it = aiter(epoch)
            gate.set()  # the copies of steps 0 and 1 cross at once
            got = [int((await anext(it))[0]) for _ in range(OTHER)]
            assert got == [0, BATCH]  # steps 0 and 1, as the other rank has
            gate.clear()
            # Step 2 is the agreed end: the copies of what was read past it wait at the gate,
            # while the slow batches are still being made; they come in during that wait.
            ending = asyncio.ensure_future(anext(it))
            await asyncio.sleep(2 * SLOW_S + 0.1)
            gate.set()
            with pytest.raises(StopAsyncIteration):
                await ending
    finally:
        lockstep.close()
        loop.set_exception_handler(previous)
    assert unhandled == []
