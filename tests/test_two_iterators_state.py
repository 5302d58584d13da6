"""Two iterators of one loader at once, and the resume state.

Each iterator runs a full epoch of its own (as torch's do); ``state_dict()`` describes the
newest. The older one's batches must not be booked into it (they were: a resume then skipped
samples the newest never took, and later listed batch ids twice), nor its end (told apart by
identity: ``set_epoch`` may give both the same epoch number). An iterator whose last batch
raised is closed when a new one starts (a traceback keeps it alive); its consumer, going on
after handling the error, is told so rather than handed a normal end.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from datasets import FailAt, Range

from aioloader import DataLoader

pytestmark = pytest.mark.usefixtures("baseline")

BOUND_S = 20.0


def loader_of(n: int = 40, **kwargs: Any) -> DataLoader:
    return DataLoader(Range(n), batch_size=4, **kwargs)


def items(batches: list[Any]) -> list[int]:
    return [i for batch in batches for i in batch.tolist()]


async def test_the_older_iterators_batches_are_not_booked_into_the_newer_epoch() -> None:
    async with asyncio.timeout(BOUND_S):
        async with loader_of() as loader:
            older, newer = aiter(loader), aiter(loader)
            for _ in range(3):
                await anext(older)  # epoch 0: ids 0, 1, 2
            await anext(newer)  # epoch 1: id 0
            await anext(older)  # epoch 0: id 3
            state = loader.state_dict()
            assert (state["epoch"], state["done"]) == (1, [0])
            for _ in range(4):
                await anext(newer)  # epoch 1: ids 1 to 4
                await anext(older)  # epoch 0: ids 4 to 7
            later = loader.state_dict()
            assert (later["epoch"], later["done"]) == (1, [0, 1, 2, 3, 4])
            resumed = loader_of()
            resumed.load_state_dict(later)
            async with resumed:
                rest = items([b async for b in resumed])
            assert rest == list(range(20, 40))  # exactly what the newer epoch had not taken


async def test_an_older_iterator_ending_does_not_end_a_newer_one_of_the_same_epoch_number() -> None:
    async with asyncio.timeout(BOUND_S):
        async with loader_of(16) as loader:
            loader.set_epoch(3)
            older = aiter(loader)
            await anext(older)
            loader.set_epoch(3)
            newer = aiter(loader)
            await anext(newer)
            await anext(newer)
            assert len([b async for b in older]) == 3  # the older runs to its end
            state = loader.state_dict()
            assert (state["epoch"], state["done"]) == (3, [0, 1])  # the newer, still open
            resumed = loader_of(16)
            resumed.load_state_dict(state)
            async with resumed:
                assert items([b async for b in resumed]) == list(range(8, 16))


def test_an_iterator_closed_by_a_new_one_after_its_error_says_so_when_it_goes_on() -> None:
    with DataLoader(FailAt(40, {5}, ValueError), batch_size=4) as loader:
        first = iter(loader)
        assert next(first).tolist() == [0, 1, 2, 3]
        with pytest.raises(ValueError, match="sample 5 is broken"):
            next(first)
        second = iter(loader)
        assert next(second).tolist() == [0, 1, 2, 3]  # a new epoch: the first is closed
        with pytest.raises(RuntimeError, match="new iterator of this DataLoader began after"):
            next(first)  # not StopIteration: its epoch was cut short
