"""A third review of the resume state's checks: a state is never loaded into the user's live
samplers for a check that may fail, and once accepted it is loaded into them once."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from helpers import as_lists

from aioloader import DataLoader, DistributedSampler, RandomSampler


class _Yielded(torch.utils.data.Sampler[int]):
    """A torchdata-style stateful sampler: its state is how many it yielded, a load sets where
    the next iter() starts (loading its earlier state back does not undo a load)."""

    def __init__(self, n: int) -> None:
        self.n, self.yielded, self.next_yielded = n, 0, None
        self.loads: list[dict[str, Any]] = []

    def __iter__(self) -> Any:
        self.yielded = 0
        if self.next_yielded is not None:
            self.yielded, self.next_yielded = self.next_yielded, None
        for i in itertools.islice(range(self.n), self.yielded, None):
            self.yielded += 1
            yield i

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loads.append(dict(state))
        self.next_yielded = state["yielded"]


def _flat(batches: list[Any]) -> list[int]:
    return [int(i) for batch in batches for i in batch]


def test_a_refused_state_never_touches_the_samplers_and_the_next_epoch_is_whole() -> None:
    with DataLoader(list(range(10)), batch_size=2, sampler=_Yielded(10)) as other:
        it = iter(other)
        next(it)
        state = other.state_dict()
        del it
    sampler = _Yielded(10)
    with DataLoader(list(range(10)), batch_size=3, sampler=sampler) as loader:
        assert _flat(list(loader)) == list(range(10))
        with pytest.raises(ValueError, match="batch_size"):
            loader.load_state_dict(state)
        assert sampler.loads == []
        assert _flat(list(loader)) == list(range(10))


class _Picky(torch.utils.data.Sampler[int]):
    """Its state before the first iter() is one its own load_state_dict refuses."""

    def __init__(self, n: int) -> None:
        self.n, self.start, self.loads = n, 0, 0
        self.pos: int | None = None

    def __iter__(self) -> Any:
        pos, self.start = self.start, 0
        while pos < self.n:
            pos += 1
            self.pos = pos
            yield pos - 1

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loads += 1
        if not isinstance(state["pos"], int):
            raise TypeError(f"pos must be an int, got {state['pos']!r}")
        self.start = state["pos"]


def test_a_valid_state_is_loaded_once_and_not_refused_by_a_restore() -> None:
    with DataLoader(list(range(10)), batch_size=3, sampler=_Picky(10)) as saver:
        list(saver)
        state = saver.state_dict()  # {"pos": 10}; this loader's samplers are at {"pos": None}
    sampler = _Picky(10)
    with DataLoader(list(range(10)), batch_size=3, sampler=sampler) as loader:
        loader.load_state_dict(state)
        assert sampler.start == 10
        list(loader)
        assert sampler.loads <= 2  # at load, and again at the epoch's start


def test_a_state_the_sampler_refuses_at_its_load_names_the_sampler() -> None:
    with DataLoader(list(range(10)), batch_size=3, sampler=_Picky(10)) as saver:
        list(saver)
        state = saver.state_dict()
    bad = {**state, "sampler": {**state["sampler"], "sampler": {"pos": "x"}}}
    with DataLoader(list(range(10)), batch_size=3, sampler=_Picky(10)) as loader:
        with pytest.raises(ValueError, match=r"_Picky.*pos must be an int, got 'x'"):
            loader.load_state_dict(bad)
        assert _flat(list(loader)) == list(range(10))


def _dies(code: int, sender: Any) -> None:
    import os

    os._exit(code)


def test_a_rank_that_dies_before_reporting_is_named_with_its_exit_code() -> None:
    from helpers import run_spawned_ranks

    with pytest.raises(AssertionError, match="rank 0 exited with code 3 before reporting"):
        run_spawned_ranks(_dies, lambda rank: (3,), 1, 60.0)


def _rank_state() -> dict[str, Any]:
    """Rank 1's state between epochs, holding its rollover carry (a rank's own), seed 0."""
    sampler = DistributedSampler(22, 2, 1, shuffle=False)  # 11 a rank: 3 carried
    with DataLoader(list(range(22)), batch_size=4, last_batch="rollover", seed=0,
                    sampler=sampler) as saver:  # fmt: skip
        list(saver)
        state = saver.state_dict()
    assert state["rank"] == 1
    assert state["seed"] == 0
    return state


def _unsharded(seed: int | None = None) -> DataLoader:
    return DataLoader(list(range(22)), batch_size=4, last_batch="rollover", shuffle=True,
                      seed=seed)  # fmt: skip


def test_a_rank_state_refused_at_the_first_epoch_is_dropped_with_its_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A launcher's WORLD_SIZE > 1 and no group yet: the check waits for the group, and none
    # came. The first iter() refuses the state; the next runs the loader's own first epoch
    # (it raised again, epoch after epoch, the state's seed and carry adopted).
    state = _rank_state()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with _unsharded() as loader:
        own = loader.seed
        assert own != 0
        loader.load_state_dict(state)  # deferred: a group may still come
        assert loader.seed == 0
        with pytest.raises(ValueError, match=r"this loader is not sharded.*the state is dropped"):
            list(loader)
        assert loader.seed == own
        assert len(loader) == 5  # no carry of the state's: 22 samples, 5 batches, 2 carried
        got = as_lists(list(loader))
        assert loader.state_dict()["epoch"] == 1
    with _unsharded(own) as reference:
        assert got == as_lists(list(reference))


def test_a_rank_state_is_checked_at_load_where_torch_distributed_is_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No torch.distributed in this build: no group will ever come, so nothing waits for one.
    import torch.distributed as dist

    state = _rank_state()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_available", lambda: False)
    with _unsharded() as loader:
        own = loader.seed
        with pytest.raises(ValueError, match="this loader is not sharded"):
            loader.load_state_dict(state)
        assert loader.seed == own
        assert len(as_lists(list(loader))) == 5


def _in_torch_batches(sampler: Any) -> DataLoader:
    batches = torch.utils.data.BatchSampler(sampler, 3, False)
    return DataLoader(list(range(10)), batch_sampler=batches)


def _previous_release_state(make: Any, epoch: int, drive: bool) -> tuple[dict[str, Any], Any]:
    """A state saved mid-epoch ``epoch`` after 2 batches, as the previous release wrote it
    around torch's BatchSampler (no sampler state), and the rest of that epoch."""
    with make() as saver:
        for e in range(epoch + 1):
            if drive:
                saver.set_epoch(e)
            it = iter(saver)
            first = [next(it), next(it)]
            if e == epoch:
                state = saver.state_dict()
            rest = as_lists(list(it))
            del it, first
    assert state["sampler"] is not None  # this release saves it: the previous one did not
    return {**state, "sampler": None, "generators": None}, rest


def test_a_previous_release_state_whose_sampler_epoch_differs_is_refused() -> None:
    # aioloader's RandomSampler moves to its next epoch at every iter(): the state's epoch 2
    # was its own epoch 2, and a fresh sampler is at 0 (resumed with epoch 0's order, silently).
    def seeded() -> DataLoader:
        return _in_torch_batches(RandomSampler(list(range(10)), seed=5))

    state, rest = _previous_release_state(seeded, 2, drive=False)
    sampler = RandomSampler(list(range(10)), seed=5)
    with _in_torch_batches(sampler) as loader:
        refused = r"RandomSampler's own epoch.*epoch 0, not the state's epoch 2"
        with pytest.raises(ValueError, match=refused + r".*sampler\.set_epoch\(2\) before load_"):
            loader.load_state_dict(state)
        sampler.set_epoch(2)  # the way on the refusal names
        loader.load_state_dict(state)
        assert as_lists(list(loader)) == rest
    # Where the loader drove the epoch (loader.set_epoch), it sets it again.
    state, rest = _previous_release_state(seeded, 2, drive=True)
    with seeded() as loader:
        loader.load_state_dict(state)
        assert as_lists(list(loader)) == rest


def test_a_previous_release_state_of_a_generator_sampler_is_refused_past_epoch_0() -> None:
    def drawn() -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        return _in_torch_batches(RandomSampler(list(range(10)), generator=generator))

    for drive in (False, True):
        state, _ = _previous_release_state(drawn, 2, drive)
        with drawn() as loader:
            with pytest.raises(ValueError, match=r"no state of RandomSampler's generator.*epoch 2"):
                loader.load_state_dict(state)
            assert len(_flat(list(loader))) == 10  # refused whole: the loader's own epoch
    state, rest = _previous_release_state(drawn, 0, drive=False)
    with drawn() as loader:  # epoch 0: the generator as seeded is where the epoch began
        loader.load_state_dict(state)
        assert as_lists(list(loader)) == rest
