"""Elastic resume: a mid-epoch state saved on R ranks resumes on R' (RELIABILITY.md row 35).

The state records which positions of the epoch's order every rank read (``"consumed"``), and
a loader on another number of ranks shares out the rest of that order among its own. Here
the ranks are loaders in this process, each with the rank's DistributedSampler (what a
loader makes under a process group); a real job of four gloo ranks resuming on two, three and
four is in ``test_distributed_lockstep`` (its ``elastic`` case).

Invariants, for any epoch length, batch size, cut point and last-batch policy:

- nothing taken before the cut comes again after it, on any new rank (on as many ranks, the
  epoch goes on by batch ids as it would have, its padding included);
- the taken and the rest together hold every sample of the epoch: at least once (padding
  repeats a few, as a DistributedSampler pads) or, with ``drop_last``, at most once;
- every new rank gets as many batches of the rest;
- the next epoch is what an uninterrupted run on the new ranks gives.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from datasets import Range
from helpers import as_lists, flat
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader import DataLoader, DistributedSampler

pytestmark = pytest.mark.usefixtures("baseline")

SEED = 11


def loader(n: int, size: int, ranks: int, rank: int, drop_last: bool) -> DataLoader:
    sampler = DistributedSampler(n, ranks, rank, seed=SEED, drop_last=drop_last)
    return DataLoader(Range(n), batch_size=size, sampler=sampler)


def cut(
    n: int, size: int, ranks: int, epoch: int, taken: int, drop_last: bool
) -> tuple[list[int], dict[str, Any]]:
    """Every rank takes its first ``taken`` batches of ``epoch``: what they took, together,
    and rank 0's state then (under DDP every rank has taken as many)."""
    took: list[int] = []
    state: dict[str, Any] = {}
    for rank in range(ranks):
        with loader(n, size, ranks, rank, drop_last) as dl:
            dl.sampler.set_epoch(epoch)
            it = iter(dl)
            took += flat(as_lists([next(it) for _ in range(taken)]))
            if rank == 0:
                state = dl.state_dict()
            del it
    return took, state


def rest_and_next(
    state: dict[str, Any], n: int, size: int, ranks: int, drop_last: bool
) -> tuple[list[list[int]], list[list[int]]]:
    """Each new rank's rest of the epoch after loading ``state``, and its next epoch."""
    rests, nexts = [], []
    for rank in range(ranks):
        with loader(n, size, ranks, rank, drop_last) as dl:
            dl.load_state_dict(state)
            rests.append(flat(as_lists(list(dl))))
            nexts.append(flat(as_lists(list(dl))))
    return rests, nexts


def whole_epoch(n: int, size: int, ranks: int, epoch: int, drop_last: bool) -> list[list[int]]:
    shares = []
    for rank in range(ranks):
        with loader(n, size, ranks, rank, drop_last) as dl:
            dl.sampler.set_epoch(epoch)
            shares.append(flat(as_lists(list(dl))))
    return shares


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 60),
    size=st.integers(1, 5),
    new_ranks=st.sampled_from([2, 3, 4]),
    fraction=st.floats(0, 1, exclude_max=True),
    drop_last=st.booleans(),
    epoch=st.integers(0, 3),
)
def test_the_rest_of_an_epoch_comes_out_exactly_once_on_other_ranks(
    n: int, size: int, new_ranks: int, fraction: float, drop_last: bool, epoch: int
) -> None:
    old_ranks = 4
    per_rank = n // old_ranks if drop_last else -(-n // old_ranks)
    batches = -(-per_rank // size)
    if batches == 0:
        return  # an empty share: nothing to cut
    taken = int(fraction * batches)  # 0 .. batches - 1: a mid-epoch cut
    took, state = cut(n, size, old_ranks, epoch, taken, drop_last)
    rests, nexts = rest_and_next(state, n, size, new_ranks, drop_last)
    rest = flat(rests)
    if new_ranks == old_ranks:
        # The same ranks continue by batch ids: the uninterrupted epoch, its padding included.
        assert Counter(took + rest) == Counter(
            flat(whole_epoch(n, size, old_ranks, epoch, drop_last))
        )
    else:
        assert not set(took) & set(rest)  # nothing consumed comes again
    counts = Counter(took + rest)
    slack = (old_ranks - 1) + (new_ranks - 1)  # what the two paddings (or trims) may differ
    if drop_last:
        assert max(counts.values(), default=1) == 1  # never twice
        assert n - slack <= len(counts) <= n
    else:
        assert set(counts) == set(range(n))  # every sample
        assert sum(counts.values()) - n <= slack
    lengths = {len(r) for r in rests}
    assert len(lengths) == 1  # as many samples, so as many batches, on every new rank
    assert nexts == whole_epoch(n, size, new_ranks, epoch + 1, drop_last)


def test_a_state_saved_again_in_the_rest_resumes_on_yet_other_ranks() -> None:
    # 4 ranks take 2 batches, 3 ranks take 1 batch of the rest, 2 ranks read what is left.
    n, size = 50, 3
    took, state = cut(n, size, 4, 0, 2, drop_last=True)
    second: list[int] = []
    again: dict[str, Any] = {}
    for rank in range(3):
        with loader(n, size, 3, rank, True) as dl:
            dl.load_state_dict(state)
            it = iter(dl)
            second += flat(as_lists([next(it)]))
            if rank == 0:
                again = dl.state_dict()
            del it
    rests, _ = rest_and_next(again, n, size, 2, True)
    everything = took + second + flat(rests)
    assert len(everything) == len(set(everything))  # never twice
    assert len(everything) >= n - 3 - 2 - 1  # each trim drops fewer than its ranks


def test_the_same_ranks_resume_by_batch_ids_as_before() -> None:
    took, state = cut(40, 4, 4, 1, 2, drop_last=False)
    rests, _ = rest_and_next(state, 40, 4, 4, drop_last=False)
    shares = whole_epoch(40, 4, 4, 1, drop_last=False)
    assert [share[8:] for share in shares] == rests
    assert sorted(took + flat(rests)) == list(range(40))
