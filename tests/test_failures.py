"""The skip budget (_failures): a pure state machine, no loop needed."""

from __future__ import annotations

from aioloader import TooManyFailuresError
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
