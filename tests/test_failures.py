"""The skip budget (_failures): a pure state machine, no loop needed; then ``on_error='skip'``
through the loader (a fraction of the samples seen, a batch that lost every sample)."""

from __future__ import annotations

from typing import Any

import pytest
from datasets import AsyncRange, FailAt
from helpers import as_lists, flat
from procs import no_worker_left_behind

from aioloader import (
    BatchSampler,
    DataLoader,
    SequentialSampler,
    ShardedBatchSampler,
    TooManyFailuresError,
)
from aioloader._epoch._failures import MESSAGE_INDICES, FailureBudget
from aioloader._stats._counters import Counters


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


def test_a_fraction_is_of_the_epochs_length() -> None:
    budget = FailureBudget(0.05, Counters(), epoch_samples=1000)
    budget.record(16, [(3, "E: a")])  # the first failure among 17 samples: 1 of 50 allowed
    assert budget.over(0, list(range(16))) is None
    budget.record(0, [(i, "E: b") for i in range(100, 149)])  # 50 of 1000: still allowed
    assert budget.over() is None
    budget.record(3, [(999, "E: c")])  # the 51st: over, before the epoch ends
    error = budget.over(7, [996, 997, 998])
    assert isinstance(error, TooManyFailuresError)
    message = str(error)
    assert "batch 7 crossed the skip budget" in message
    assert "max_failures=0.05 of this epoch's 1000 samples allows 50" in message
    assert str([3, *range(100, 149), 999]) in message  # every skipped index, in order
    assert "not delivered: indices [996, 997, 998]" in message
    assert (error.batch_id, error.undelivered) == (7, [996, 997, 998])
    assert error.skipped == [3, *range(100, 149), 999]


def test_a_fraction_of_an_epoch_of_unknown_length_is_of_the_samples_seen() -> None:
    budget = FailureBudget(0.25, Counters())
    budget.record(0, [(0, "E: a")])  # a first failure is always allowed, even alone
    assert budget.over() is None
    budget.record(6, [(7, "E: b")])  # 2 of 8 = 25%: allowed
    assert budget.over() is None
    budget.record(0, [(9, "E: c")])  # 3 of 9: over
    error = budget.over(2, 5)
    assert isinstance(error, TooManyFailuresError)
    assert "3 samples failed out of 9 seen" in str(error)
    assert "of the 9 samples seen so far (the epoch's length is unknown)" in str(error)
    assert "its 5 sample(s) read successfully are not delivered" in str(error)
    assert error.undelivered == 5


def test_the_message_lists_a_bounded_number_of_indices_and_the_error_all() -> None:
    budget = FailureBudget(0.5, Counters(), epoch_samples=10_000)
    budget.record(0, [(i, "E") for i in range(MESSAGE_INDICES + 5_000)])
    error = budget.over()
    assert error is not None
    assert f"and {5_000} more (all in .skipped)" in str(error)
    assert error.skipped == list(range(MESSAGE_INDICES + 5_000))


# -- through the loader -----------------------------------------------------------------------


def test_sync_dataset_skip_with_a_fraction() -> None:
    dataset = FailAt(40, {7, 30}, error_type=ValueError)
    with DataLoader(dataset, batch_size=5, on_error="skip", max_failures=0.1) as loader:
        assert flat(list(loader)) == [i for i in range(40) if i not in (7, 30)]
        assert sorted(i for i, _ in loader.statistics().skipped) == [7, 30]
    # 0.1 of the epoch's 40 samples: 4 may fail, a fifth crosses the budget (in batch 1).
    dataset = FailAt(40, {1, 2, 3, 6, 7}, error_type=ValueError)
    loader = DataLoader(dataset, batch_size=5, on_error="skip", max_failures=0.1)
    with loader, pytest.raises(TooManyFailuresError, match="batch 1 crossed"):
        list(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
@no_worker_left_behind()
def test_an_early_failure_is_well_inside_a_fraction_of_the_epoch(num_workers: int) -> None:
    # 1 failure among the first 17 samples is 6% of what was seen, but 0.1% of the epoch.
    bad = {3, *range(500, 549)}  # 50 of 1000: exactly 0.05
    dataset = FailAt(1000, bad, error_type=ValueError)
    kwargs: dict[str, Any] = {"on_error": "skip", "max_failures": 0.05, "timeout": 30}
    with DataLoader(dataset, batch_size=17, num_workers=num_workers, **kwargs) as loader:
        delivered = flat(list(loader))
        skipped = [i for i, _ in loader.statistics().skipped]
    assert delivered == [i for i in range(1000) if i not in bad]  # in order, none twice
    assert sorted(skipped) == sorted(bad)


@pytest.mark.parametrize("num_workers", [0, 2])
@no_worker_left_behind()
def test_crossing_the_budget_names_the_batch_every_skip_and_the_samples_read(
    num_workers: int,
) -> None:
    dataset = FailAt(40, {5, 6, 13, 14}, error_type=ValueError)
    kwargs: dict[str, Any] = {"on_error": "skip", "max_failures": 3, "timeout": 30}
    delivered: list[int] = []

    def consume(loader: DataLoader) -> None:
        for batch in loader:
            delivered.extend(batch.tolist())

    loader = DataLoader(dataset, batch_size=4, num_workers=num_workers, **kwargs)
    with loader, pytest.raises(TooManyFailuresError) as info:
        consume(loader)
    error = info.value
    message = str(error)
    assert "batch 3 crossed the skip budget" in message
    assert "4 samples failed" in message
    assert "max_failures=3 allows 3" in message
    assert "Skipped indices in this epoch: [5, 6, 13, 14]" in message
    assert "ValueError: sample 14 is broken" in message
    assert "not delivered: indices [12, 15]" in message
    assert (error.batch_id, error.skipped, error.undelivered) == (3, [5, 6, 13, 14], [12, 15])
    # Every sample up to the crossing batch is delivered, skipped or named: none vanished.
    assert delivered == [0, 1, 2, 3, 4, 7, 8, 9, 10, 11]
    assert isinstance(error.undelivered, list)
    assert sorted(delivered + error.skipped + error.undelivered) == list(range(16))


def test_crossing_the_budget_in_an_async_fetch_names_the_samples_read() -> None:
    dataset = AsyncRange(12, bad={1, 2}, error_type=ValueError)
    kwargs: dict[str, Any] = {"on_error": "skip", "max_failures": 1, "timeout": 30}
    loader = DataLoader(dataset, batch_size=4, **kwargs)
    with loader, pytest.raises(TooManyFailuresError) as info:
        list(loader)
    error = info.value
    assert "batch 0 crossed" in str(error)
    assert (error.batch_id, error.skipped, error.undelivered) == (0, [1, 2], [0, 3])


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
