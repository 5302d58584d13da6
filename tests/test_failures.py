"""The skip budget (_failures): a pure state machine, no loop needed; then ``on_error='skip'``
through the loader (a fraction of the samples seen, a batch that lost every sample)."""

from __future__ import annotations

from typing import Any

import pytest
from datasets import FailAt
from helpers import as_lists, flat
from procs import no_worker_left_behind

from aioloader import (
    BatchSampler,
    DataLoader,
    SequentialSampler,
    ShardedBatchSampler,
    TooManyFailuresError,
)
from aioloader._failures import FailureBudget
from aioloader._stats import Counters


def test_a_count_allows_exactly_that_many_failures() -> None:
    counters = Counters()
    budget = FailureBudget(2, counters)
    budget.record(8, [(3, "KeyError: 3"), (5, "KeyError: 5")])
    assert budget.over() is None
    budget.record(0, [(9, "OSError: gone")])
    error = budget.over()
    assert isinstance(error, TooManyFailuresError)
    assert "3 samples failed out of 11 seen" in str(error)
    assert "max_failures=2" in str(error)
    assert counters.skipped == [(3, "KeyError: 3"), (5, "KeyError: 5"), (9, "OSError: gone")]


def test_zero_allows_none() -> None:
    budget = FailureBudget(0, Counters())
    budget.record(10, [])
    assert budget.over() is None
    budget.record(0, [(1, "ValueError: x")])
    assert isinstance(budget.over(), TooManyFailuresError)


def test_a_fraction_is_of_the_samples_seen() -> None:
    budget = FailureBudget(0.25, Counters())
    budget.record(3, [(0, "E: a")])  # 1 of 4 = 25%: allowed
    assert budget.over() is None
    budget.record(0, [(4, "E: b")])  # 2 of 5 = 40%: over
    error = budget.over()
    assert isinstance(error, TooManyFailuresError)
    assert "2 samples failed out of 5 seen" in str(error)


# -- through the loader -----------------------------------------------------------------------


def test_sync_dataset_skip_with_a_fraction() -> None:
    dataset = FailAt(40, {7, 30}, error_type=ValueError)
    with DataLoader(dataset, batch_size=5, on_error="skip", max_failures=0.1) as loader:
        assert flat(list(loader)) == [i for i in range(40) if i not in (7, 30)]
        assert sorted(i for i, _ in loader.statistics().skipped) == [7, 30]
    dataset = FailAt(40, {1, 2, 3}, error_type=ValueError)
    loader = DataLoader(dataset, batch_size=5, on_error="skip", max_failures=0.1)
    with loader, pytest.raises(TooManyFailuresError):
        list(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
@no_worker_left_behind()
def test_a_batch_whose_samples_all_fail_is_skipped_whole(num_workers: int) -> None:
    dataset = FailAt(12, {4, 5, 6, 7, 9}, error_type=ValueError)
    kwargs: dict[str, Any] = {"on_error": "skip", "max_failures": 5, "num_workers": num_workers}
    with DataLoader(dataset, batch_size=4, **kwargs) as loader:
        # Batch 1 lost every sample: it is not yielded (collating nothing would fail).
        assert as_lists(list(loader)) == [[0, 1, 2, 3], [8, 10, 11]]
        stats = loader.statistics()
        assert sorted(i for i, _ in stats.skipped) == [4, 5, 6, 7, 9]
        assert (stats.batches_yielded, stats.samples_yielded) == (2, 7)
    # Sharded: a shard that lost every sample is left out; a batch that lost all is skipped.
    sampler = ShardedBatchSampler(BatchSampler(SequentialSampler(12), 4), num_shards=2)
    with DataLoader(dataset, batch_size=None, batch_sampler=sampler, **kwargs) as loader:
        batches = [[shard.tolist() for shard in batch] for batch in loader]
    assert batches == [[[0, 1], [2, 3]], [[8], [10, 11]]]
