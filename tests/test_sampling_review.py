"""The loader's samplers reached through the batch samplers that wrap them, and a batch sampler
checked where it is given (_sampling, _config): the cases a review found."""

from __future__ import annotations

import pytest
import torch.utils.data as tud
from datasets import Range
from helpers import as_lists, assert_raises_naming

from aioloader import BatchSampler, DataLoader, RandomSampler

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")


def _inside_torch_batches() -> DataLoader:
    return DataLoader(
        Range(20), batch_sampler=tud.BatchSampler(RandomSampler(20, seed=1), 4, False)
    )


def _epoch(epoch: int) -> list[list[int]]:
    """Epoch ``epoch`` of ``RandomSampler(20, seed=1)`` in batches of 4."""
    sampler = RandomSampler(20, seed=1)
    sampler.set_epoch(epoch)
    return [list(b) for b in BatchSampler(sampler, 4)]


def test_loader_set_epoch_reaches_a_sampler_inside_torchs_batch_sampler() -> None:
    # torch's BatchSampler has no set_epoch: the epoch asked for never reached the sampler,
    # and the loader yielded epoch 0's order.
    assert _epoch(3) != _epoch(0)
    with _inside_torch_batches() as loader:
        loader.set_epoch(3)
        assert as_lists(list(loader)) == _epoch(3)


def test_a_resume_in_an_epoch_the_user_named_reaches_the_sampler_inside() -> None:
    with _inside_torch_batches() as saver:
        saver.set_epoch(3)
        it = iter(saver)
        taken = as_lists([next(it)])
        state = saver.state_dict()
        del it
    with _inside_torch_batches() as resumed:
        resumed.load_state_dict(state)
        assert taken + as_lists(list(resumed)) == _epoch(3)


@pytest.mark.parametrize("bad", [5, 2.5])
def test_a_batch_sampler_that_is_not_iterable_is_refused_at_construction(bad: object) -> None:
    assert_raises_naming(
        lambda: DataLoader(Range(10), batch_sampler=bad), TypeError, ["batch_sampler", repr(bad)]
    )
