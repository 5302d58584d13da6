"""The skip budget of an epoch resumed from a mid-epoch state (_failures, _resume).

``max_failures`` is of the epoch, interrupted or not: the state records what the budget
counted in the batches taken (``"failures"``), and the resumed epoch crosses the budget at the
batch the uninterrupted one does, naming every index skipped in the epoch. Batches made ahead
and not taken are not in the count (they are made, and counted, again after the resume). A
state without the field (saved before it was recorded) starts the budget at zero, as it did;
one with a count that is not what a loader writes is refused, naming the field.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from datasets import AsyncRange, FailAt, Range

from aioloader import DataLoader, DistributedSampler, TooManyFailuresError

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

# Batches of 4 over 40 samples: batch 0 skips 1, batch 1 skips 5, batch 5 skips 20, the third
# failure, over max_failures=2.
N, SIZE, BAD, ALLOWED = 40, 4, {1, 5, 20}, 2
CROSSED_AT = 5

# Made inline; on threads with batches made ahead of the consumer; fetched on the loop (the
# fetch counts the async dataset's failures, the make the rest).
SETTINGS: dict[str, dict[str, Any]] = {
    "inline": {"num_workers": 0},
    "ahead": {"num_workers": 2, "thread_pool": True, "prefetch": 6},
    "async": {"dataset": AsyncRange(N, bad=BAD), "io_concurrency": 4, "prefetch": 4},
}


def make(**settings: Any) -> DataLoader:
    settings = {"batch_size": SIZE, "on_error": "skip", "max_failures": ALLOWED, **settings}
    return DataLoader(settings.pop("dataset", FailAt(N, BAD)), **settings)


def until_crossed(it: Iterator[Any]) -> tuple[int, TooManyFailuresError | None]:
    """How many batches ``it`` yields before the budget's error (None: its epoch ended)."""
    for yielded in range(N + 1):  # bounded: an epoch has at most N batches
        try:
            next(it)
        except StopIteration:
            return yielded, None
        except TooManyFailuresError as error:
            return yielded, error
    raise AssertionError(f"more than {N} batches in an epoch of {N} samples")


def saved_after(taken: int, **settings: Any) -> dict[str, Any]:
    """The state after ``taken`` batches of epoch 0, through ``torch.save`` and ``torch.load``
    (as a checkpoint carries it)."""
    with make(**settings) as loader:
        it = iter(loader)
        for _ in range(taken):
            next(it)
        state = loader.state_dict()
        del it
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


def resumed(state: dict[str, Any], **settings: Any) -> tuple[int, TooManyFailuresError | None]:
    with make(**settings) as loader:
        loader.load_state_dict(state)
        return until_crossed(iter(loader))


@pytest.mark.parametrize("taken", [1, 2, 3])
@pytest.mark.parametrize("route", sorted(SETTINGS))
def test_a_resumed_epoch_crosses_the_budget_at_the_batch_an_uninterrupted_one_does(
    route: str, taken: int
) -> None:
    settings = SETTINGS[route]
    with make(**settings) as loader:
        whole, error = until_crossed(iter(loader))
    assert whole == CROSSED_AT
    assert error is not None
    assert error.batch_id == CROSSED_AT
    assert error.skipped == [1, 5, 20]

    state = saved_after(taken, **settings)
    # Exactly the skips of the batches taken, not of those made ahead of the consumer.
    assert state["failures"]["skipped"] == [i for i in (1, 5) if i < taken * SIZE]
    assert state["failures"]["seen"] == taken * SIZE
    rest, error = resumed(state, **settings)
    assert taken + rest == CROSSED_AT  # (it went on to the end of the epoch, unbudgeted)
    assert error is not None
    assert error.batch_id == CROSSED_AT
    assert error.skipped == [1, 5, 20]  # those before the resume named too


def test_a_state_saved_before_the_skips_were_recorded_starts_the_budget_at_zero() -> None:
    state = saved_after(3)
    assert state["failures"]["skipped"] == [1, 5]
    older = {key: value for key, value in state.items() if key != "failures"}
    rest, error = resumed(older)
    assert (rest, error) == (N // SIZE - 3, None)  # one skip since the resume: within budget


def test_the_next_epoch_starts_the_budget_at_zero() -> None:
    with make(max_failures=3) as loader:
        for _ in range(2):
            it = iter(loader)
            assert until_crossed(it) == (N // SIZE, None)  # three skips: within, each epoch
            del it
        between = loader.state_dict()
    assert "failures" not in between  # between epochs nothing is counted


def test_the_skip_count_is_the_ranks_own() -> None:
    # Under DDP rank 0's state resumes every rank: another rank's budget starts at zero (the
    # count is of rank 0's samples), rank 0's from rank 0's count.
    def loader(rank: int) -> DataLoader:
        sampler = DistributedSampler(Range(N), 2, rank, shuffle=False)
        return make(dataset=FailAt(N, {0, 2, 11}), sampler=sampler, max_failures=10)

    with loader(0) as first:
        it = iter(first)
        next(it)  # rank 0's first batch: 0, 2, 4, 6 (two skipped)
        state = first.state_dict()
        del it
    assert state["failures"] == {"rank": 0, "seen": SIZE, "skipped": [0, 2]}
    # Resumed at batch 1: rank 0's is 8, 10, 12, 14; rank 1's 9, 11, 13, 15 (one skipped).
    for rank, skipped in ((0, [0, 2]), (1, [11])):
        with loader(rank) as other:
            other.load_state_dict(state)
            it = iter(other)
            next(it)
            assert other.state_dict()["failures"] == {
                "rank": rank,
                "seen": SIZE * (2 if rank == 0 else 1),
                "skipped": skipped,
            }
            del it


@pytest.mark.parametrize(
    ("failures", "words"),
    [
        ("many", ["'failures' must be a dict", "'many'"]),
        ({"rank": None, "seen": 4}, ["'failures'", "lacks ['skipped']"]),
        ({"rank": None, "seen": -1, "skipped": []}, ["failures 'seen'", "-1"]),
        ({"rank": "0", "seen": 4, "skipped": []}, ["failures 'rank'", "'0'"]),
        ({"rank": None, "seen": 4, "skipped": 1}, ["failures 'skipped'", "got 1"]),
        ({"rank": None, "seen": 1, "skipped": [1, 5]}, ["2 samples were skipped of 1 seen"]),
    ],
)
def test_a_tampered_skip_count_is_refused_naming_it(failures: Any, words: list[str]) -> None:
    state = {**saved_after(3), "failures": failures}
    with make() as loader:
        with pytest.raises(ValueError) as info:  # noqa: PT011  # the message is asserted after
            loader.load_state_dict(state)
        assert until_crossed(iter(loader))[0] == CROSSED_AT  # not resumed: a whole epoch
    for word in words:
        assert word in str(info.value)
