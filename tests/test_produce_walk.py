"""A batch whose leaves cannot be walked for the statistics (_produce's ``nbytes_of``).

The producer counts a made batch's bytes by walking its leaves. A ``collate_fn`` may return
what the walk cannot go through: a Mapping whose ``values()`` raises, a list that holds
itself. The batch is the user's and must reach the consumer as it is: the walk's error once
left it without an outcome, and the consumer waited for it for ever, with or without
``timeout``. Every wait here is bounded by ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
from datasets import Range
from helpers import BOUND_S

from aioloader import DataLoader
from aioloader._epoch import nbytes_of

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")


class Unwalkable(Mapping[str, Any]):
    """A mapping that can be read by key but whose ``values()`` raises."""

    def __init__(self, samples: list[int]) -> None:
        self.samples = samples

    def __getitem__(self, key: str) -> list[int]:
        return self.samples

    def __iter__(self) -> Iterator[str]:
        return iter(["x"])

    def __len__(self) -> int:
        return 1

    def values(self) -> Any:
        raise RuntimeError("this mapping is read by key only")


def unwalkable(samples: list[int]) -> Unwalkable:
    return Unwalkable(list(samples))


def holds_itself(samples: list[int]) -> list[Any]:
    batch: list[Any] = list(samples)
    batch.append(batch)
    return batch


def contents(batch: Any) -> list[int]:
    if isinstance(batch, Unwalkable):
        return batch["x"]
    return list(batch[:-1])


def test_the_walk_of_an_unwalkable_batch_counts_nothing_and_raises_nothing() -> None:
    assert nbytes_of(unwalkable([1, 2])) == 0
    assert nbytes_of(holds_itself([1, 2])) == 0
    assert nbytes_of({"a": np.zeros(4, np.int64), "b": [np.zeros(2, np.uint8)]}) == 34


# No option: made inline; timeout: a produce task with a deadline; threads: the fast path's
# done callback. The walk ran in each, outside anything that stored the batch's outcome.
ROUTES: dict[str, dict[str, Any]] = {
    "inline": {"num_workers": 0},
    "deadline": {"num_workers": 0, "timeout": 5.0},
    "threads": {"num_workers": 2, "thread_pool": True},
}


@pytest.mark.parametrize("collate_fn", [unwalkable, holds_itself], ids=["mapping", "cycle"])
@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_a_batch_the_statistics_cannot_walk_is_handed_over_as_it_is(
    route: str, collate_fn: Callable[[list[int]], Any]
) -> None:
    loader = DataLoader(Range(10), batch_size=3, collate_fn=collate_fn, **ROUTES[route])
    async with loader:
        async with asyncio.timeout(BOUND_S):  # (it waited for ever for the first batch)
            batches = [batch async for batch in loader]
        assert all(isinstance(b, Unwalkable if collate_fn is unwalkable else list) for b in batches)
        assert [contents(b) for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
        stats = loader.statistics()
        assert stats.batches_yielded == 4
        assert stats.bytes_yielded == 0  # nothing the walk could count
        # The epoch ended normally: the next one is whole too.
        async with asyncio.timeout(BOUND_S):
            assert len([batch async for batch in loader]) == 4
