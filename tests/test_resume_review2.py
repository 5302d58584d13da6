"""Resume states checked where they are loaded, the second review's cases (_epoch._resume,
_epoch._chain; RELIABILITY.md rows 25, 35 and 43): a state the previous release wrote and
resumed still resumes; the check copies nothing; a later state replaces a pending one whole;
a rank's own state loaded before the process group is checked once the share is taken;
merge_states compares arrays and names what it cannot compare, briefly.

The loaders of several ranks are built in one process (``DistributedSampler(n, R, r)`` given
explicitly), except those built before a process group exists: two spawned processes in a
gloo group on loopback.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import torch.utils.data as tud
from datasets import Range
from helpers import as_lists, first_and_state, flat, gloo_group, reporting, run_spawned_ranks

from aioloader import BatchSampler, DataLoader, DistributedSampler, RandomSampler
from aioloader.distributed import merge_states

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")


# -- a state of the previous release ----------------------------------------------------------

# Written by the previous release (format 1, before 'replacement' was recorded) for torch's
# BatchSampler around aioloader's DistributedSampler(40, 2, 0, seed=7), the user calling
# sampler.set_epoch(e) each epoch, in epoch 2 after 2 batches. That release saved no sampler
# state for a stateless batch sampler, and resumed the epoch exactly.
PREVIOUS_RELEASE_STATE: dict[str, Any] = {
    "version": 1,
    "epoch": 2,
    "done": [0, 1],
    "sampler": None,
    "generators": None,
    "set_epoch": False,
    "seed": 8406836737476967186,
    "streams": None,
    "layout": {
        "shuffle": True,
        "sampler": "DistributedSampler",
        "generator": False,
        "batch_sampler": "BatchSampler",
        "batch_size": 4,
        "last_batch": "keep",
        "samples": 40,
        "indices": 20,
        "replicas": 2,
        "batches": 5,
    },
    "failures": {"rank": 0, "seen": 8, "skipped": []},
}


def _torch_batches() -> tuple[DataLoader, DistributedSampler]:
    sampler = DistributedSampler(40, 2, 0, shuffle=True, seed=7)
    return DataLoader(Range(40), batch_sampler=tud.BatchSampler(sampler, 4, False)), sampler


def _epoch_2() -> list[list[int]]:
    sampler = DistributedSampler(40, 2, 0, shuffle=True, seed=7)
    sampler.set_epoch(2)
    return [list(batch) for batch in tud.BatchSampler(sampler, 4, False)]


def test_a_previous_release_state_around_a_stateless_batch_sampler_resumes_exactly() -> None:
    # Refused: "saved by other samplers", though only the saving of the sampler inside torch's
    # BatchSampler was new; only a state of epoch 0 passed.
    whole = _epoch_2()
    loader, sampler = _torch_batches()
    with loader:
        # The state holds no sampler state: the sampler's own epoch orders the rest, so it is
        # set before the load, which checks it (at 0 it was resumed with epoch 0's order).
        sampler.set_epoch(2)
        loader.load_state_dict(copy.deepcopy(PREVIOUS_RELEASE_STATE))
        assert as_lists(list(loader)) == whole[2:]
    loader, _ = _torch_batches()
    with loader:  # saved after loader.set_epoch(2): the loader drives the epoch it names
        loader.load_state_dict({**copy.deepcopy(PREVIOUS_RELEASE_STATE), "set_epoch": True})
        assert as_lists(list(loader)) == whole[2:]


def test_a_state_without_a_sampler_state_is_still_refused_by_a_stateful_batch_sampler() -> None:
    def make() -> DataLoader:
        return DataLoader(Range(40), batch_size=4, sampler=DistributedSampler(40, 2, 0, seed=7))

    with make() as saver:
        _, state = first_and_state(saver, 2)
    with make() as loader, pytest.raises(ValueError, match="saved by other samplers"):
        loader.load_state_dict({**state, "sampler": None})


# -- the trial load copies nothing --------------------------------------------------------------


class _NoCopy:
    """Something a sampler holds that must not be copied (a dataset, a file, a group)."""

    copies = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> _NoCopy:
        type(self).copies += 1
        raise TypeError("cannot copy this")


class _Locked(DistributedSampler):
    """A DistributedSampler that holds what deepcopy refuses (a lock, as a subclass may)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lock = threading.Lock()
        self.held = _NoCopy()


def _elastic_rest(cls: type[DistributedSampler]) -> list[list[list[int]]]:
    """The rest of an epoch saved on 2 ranks and resumed on 3, saved there again after a
    batch a rank, and resumed on 3 again: each rank's batches."""

    def ranks(replicas: int) -> list[DataLoader]:
        return [
            DataLoader(Range(23), batch_size=2, sampler=cls(23, replicas, r, seed=3))
            for r in range(replicas)
        ]

    two = ranks(2)
    its = [iter(loader) for loader in two]
    [next(it) for it in its]
    state = two[0].state_dict()
    del its
    for loader in two:
        loader.close()
    three = ranks(3)
    for loader in three:
        loader.load_state_dict(state)
    its = [iter(loader) for loader in three]
    [next(it) for it in its]
    again = three[0].state_dict()
    del its
    for loader in three:
        loader.close()
    out = []
    for loader in ranks(3):
        with loader:
            loader.load_state_dict(again)
            out.append(as_lists(list(loader)))
    return out


def test_an_elastic_rest_is_refused_clearly_where_its_sampler_cannot_be_copied() -> None:
    # Its layout depends on the sampler state, tried in a copy of the chain: a sampler that
    # cannot be copied is named with why, and the live one is never loaded for the check.
    _NoCopy.copies = 0
    with pytest.raises(ValueError, match=r"_Locked.*cannot be copied \(TypeError: cannot"):
        _elastic_rest(_Locked)
    assert _elastic_rest(DistributedSampler)


class _Counting:
    """A user's stateful sampler that holds what must not be copied, and whose load changes
    its epoch before it refuses a bad state."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.held = n, 0, _NoCopy()

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        order = np.random.default_rng(self.epoch).permutation(self.n).tolist()
        self.epoch += 1
        return iter(order)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        if not isinstance(self.epoch, int):
            raise TypeError(f"epoch must be an int, got {self.epoch!r}")


def test_a_refused_sampler_state_leaves_the_samplers_as_they_were_and_nothing_is_copied() -> None:
    _NoCopy.copies = 0
    sampler = _Counting(12)
    with DataLoader(Range(12), batch_size=4, sampler=sampler) as loader:
        list(loader)  # epoch 0; the sampler is at 1
        state = loader.state_dict()
        loader.load_state_dict(state)
        bad = {**state, "sampler": {**state["sampler"], "sampler": {"epoch": "x"}}}
        with pytest.raises(ValueError, match="cannot be loaded into the samplers") as info:
            loader.load_state_dict(bad)
        assert "epoch must be an int, got 'x'" in str(info.value)
        assert sampler.epoch == 1  # the trial load's change undone
        expected = np.random.default_rng(1).permutation(12).tolist()
        assert flat(list(loader)) == expected
    assert _NoCopy.copies == 0


# -- a later state replaces a pending one whole -------------------------------------------------


def _carrying() -> DataLoader:
    return DataLoader(Range(23), batch_size=4, last_batch="rollover", seed=1, shuffle=True)


def test_a_later_state_replaces_the_sampler_state_of_a_pending_one() -> None:
    # Loading A (a rollover carry), then B without a sampler state: the epoch handed A's
    # carry first (6 batches where B's epoch has 5).
    with _carrying() as saver:
        list(saver)
        carrying = saver.state_dict()
    assert carrying["sampler"]["carry"]
    without = {**carrying, "sampler": None}
    with _carrying() as fresh:
        fresh.load_state_dict(without)
        expected = as_lists(list(fresh))
    assert len(expected) == 5
    with _carrying() as loader:
        loader.load_state_dict(carrying)
        assert len(loader) == 6  # A's carry counted
        loader.load_state_dict(without)
        assert len(loader) == 5
        assert as_lists(list(loader)) == expected


# -- a rank's own state: refusals with a way on, and before the process group -----------------


def _unordered(rank: int) -> DataLoader:
    sampler = DistributedSampler(40, 2, rank, shuffle=False)
    return DataLoader(Range(40), batch_size=2, in_order=False, sampler=sampler)


def _rollover(rank: int) -> DataLoader:
    sampler = DistributedSampler(22, 2, rank, shuffle=False)  # 11 a rank: 3 carried
    return DataLoader(Range(22), batch_size=4, last_batch="rollover", seed=0, sampler=sampler)


def test_the_rank_refusal_gives_a_way_on_from_that_state_alone() -> None:
    with _unordered(0) as saver:
        _, unordered = first_and_state(saver, 2)
    with _rollover(0) as saver:
        list(saver)
        carried = saver.state_dict()
    for make, state in ((_unordered, unordered), (_rollover, carried)):
        with make(1) as reference:
            whole = as_lists(list(reference))
        with make(1) as other:
            with pytest.raises(ValueError, match="rank 0's of 2 ranks") as info:
                other.load_state_dict(state)
            way = (
                "{**state, 'rank': None, 'done': [], 'sampler': {**state['sampler'], 'carry': []}}"
            )
            assert way in str(info.value)
            other.load_state_dict(
                {**state, "rank": None, "done": [], "sampler": {**state["sampler"], "carry": []}}
            )
            assert sorted(flat(list(other))) == sorted(flat(whole))  # the epoch replayed


def test_the_rank_way_on_replays_a_shuffled_samplers_own_epoch_in_order() -> None:
    # Dropping the sampler state dropped its seed and epoch: epoch 0's order came back.
    def make() -> DataLoader:
        return DataLoader(
            Range(10), batch_sampler=BatchSampler(RandomSampler(Range(10), seed=1), 3, "rollover")
        )

    with make() as saver:
        epochs = [flat(list(saver)) for _ in range(3)]
    with make() as saver:
        list(saver)
        list(saver)
        state = dict(saver.state_dict())
    state["rank"] = 1
    state["layout"] = dict(state["layout"], replicas=2)
    carry = state["sampler"]["carry"]
    assert state["epoch"] == 2
    assert carry
    assert epochs[2] != epochs[0]
    with make() as other:
        with pytest.raises(ValueError, match="rank 1's of 2 ranks"):
            other.load_state_dict(state)
        other.load_state_dict(
            {**state, "rank": None, "done": [], "sampler": {**state["sampler"], "carry": []}}
        )
        got = flat(list(other))
    assert got == epochs[2][len(carry) : len(carry) + len(got)]  # epoch 2, in its order


def test_a_rank_state_in_a_loader_no_group_will_shard_is_refused_at_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No launcher's WORLD_SIZE > 1: no group may come, so the check is not deferred (it was,
    # and every iter() then raised, epoch after epoch).
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with _rollover(1) as saver:
        list(saver)
        state = saver.state_dict()
    assert state["rank"] == 1
    unsharded = DataLoader(Range(22), batch_size=4, last_batch="rollover", shuffle=True, seed=0)
    with unsharded as loader:
        with pytest.raises(ValueError, match="this loader is not sharded"):
            loader.load_state_dict(state)
        assert len(as_lists(list(loader))) == 5  # a fresh epoch: no carry adopted


def _loopback() -> str:
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return str(name)
    pytest.skip("no loopback interface with 127.0.0.1")


def _rollover_loader() -> DataLoader:
    return DataLoader(list(range(22)), batch_size=4, shuffle=True, seed=0, last_batch="rollover")


def _rank_saves_its_state(rank: int, store: str, interface: str, conn: Any) -> None:
    """One rank of a gloo group of two: its rollover state after an epoch, and the next
    epoch's batches, uninterrupted."""
    with reporting(conn):
        import torch.distributed as dist

        gloo_group(rank, 2, store, interface)
        try:
            with _rollover_loader() as saver:
                list(saver)
                mine = saver.state_dict()
                following = as_lists(list(saver))
        finally:
            dist.destroy_process_group()
        conn.send(("ok", mine, following))


def _rank_loads_before_group(
    rank: int, store: str, interface: str, states: list[Any], following: list[Any], conn: Any
) -> None:
    """A fresh process of a new job: loads its own and the other rank's state into loaders
    built before the group, then makes the group. Fresh processes, as a new job's are: a second
    gloo group made in the processes of the first failed once under a loaded suite
    ("Connection closed by peer" while connecting), not reproduced alone."""
    import os

    with reporting(conn):
        os.environ["WORLD_SIZE"] = "2"  # as a launcher sets it: a group may still come
        import torch.distributed as dist

        own, other = _rollover_loader(), _rollover_loader()
        try:
            own.load_state_dict(states[rank])  # refused: "rank None's share of None"
            other.load_state_dict(states[1 - rank])
            gloo_group(rank, 2, store, interface)
            try:
                try:
                    len(other)
                    refused = ""
                except ValueError as exc:
                    refused = str(exc)
                length = len(own)
                resumed = as_lists(list(own))
                conn.send(("ok", states[rank]["rank"], refused, length, resumed == following))
            finally:
                dist.destroy_process_group()
        finally:
            own.close()
            other.close()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_a_rank_state_loaded_before_the_group_is_checked_when_the_share_is_taken(
    tmp_path: Any,
) -> None:
    interface, limit_s = _loopback(), 60.0
    saved = run_spawned_ranks(
        _rank_saves_its_state, lambda rank: (rank, str(tmp_path / "s0"), interface), 2, limit_s
    )
    assert all(r[0] == "ok" for r in saved), saved
    states = [r[1] for r in saved]
    results = run_spawned_ranks(
        _rank_loads_before_group,
        lambda rank: (rank, str(tmp_path / "s1"), interface, states, saved[rank][2]),
        2,
        limit_s,
    )
    assert all(r[0] == "ok" for r in results), results
    for rank, result in enumerate(results):
        _, saved_rank, refused, length, exact = result
        assert saved_rank == rank
        assert f"the state is rank {1 - rank}'s of 2 ranks" in refused, refused
        assert f"rank {rank}'s share of 2" in refused
        assert length == 3  # 11 a rank and 3 carried: 14 = 3 batches of 4, 2 carried on
        assert exact


# -- merge_states: arrays compared by value, messages short -----------------------------------


class _NumpyState:
    """A user's sampler whose state holds a numpy array (RandomState.get_state())."""

    def __init__(self, n: int, rank: int, seed: int = 0) -> None:
        self.n, self.rank, self.num_replicas = n, rank, 2
        self.rs = np.random.RandomState(seed)

    def __len__(self) -> int:
        return self.n // 2

    def __iter__(self) -> Any:
        return iter(self.rs.permutation(self.n)[self.rank :: 2].tolist())

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rs.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rs.set_state(state["rng"])


def _states_of(samplers: list[Any]) -> list[dict[str, Any]]:
    states = []
    for sampler in samplers:
        with DataLoader(Range(20), batch_size=2, sampler=sampler, seed=5) as loader:
            states.append(loader.state_dict())
    return states


def test_merge_states_compares_arrays_in_sampler_states_by_value() -> None:
    # "The truth value of an array with more than one element is ambiguous", naming nothing.
    states = _states_of([_NumpyState(20, 0), _NumpyState(20, 1)])
    merged = merge_states(states)
    assert merged["epoch"] == states[0]["epoch"]
    differing = _states_of([_NumpyState(20, 0), _NumpyState(20, 1, seed=1)])
    with pytest.raises(ValueError, match=r"state 1's 'sampler' .* differs from state 0's"):
        merge_states(differing)


class _Incomparable:
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing this")

    __hash__ = None  # type: ignore[assignment]


def test_merge_states_names_the_key_it_cannot_compare_and_shows_values_briefly() -> None:
    state = {"version": 1, "epoch": 0, "seed": 0, "done": [], "sampler": {"x": _Incomparable()}}
    with pytest.raises(ValueError, match="state 0's 'sampler' cannot be compared") as info:
        merge_states([state, dict(state)])
    assert "no comparing this" in str(info.value)
    long = {**state, "sampler": None, "done": list(range(5000))}
    other = {**long, "done": list(range(1, 5001))}
    with pytest.raises(ValueError, match="state 1's 'done'") as info:
        merge_states([long, other])
    assert "(5000 items)" in str(info.value)
    assert len(str(info.value)) < 600  # first items only, never 5000 ids


# -- a batch sampler iter() takes -------------------------------------------------------------


class _SequenceBatches:
    """Batches by the sequence protocol only (``__getitem__`` and ``__len__``)."""

    def __init__(self) -> None:
        self.batches = [[0, 1], [2, 3], [4, 5]]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> list[int]:
        return self.batches[i]


def test_a_batch_sampler_with_the_sequence_protocol_is_iterated_as_torch_does() -> None:
    # (torch's type says Iterable; its DataLoader iterates the sequence protocol as iter() does)
    torch_loader: Any = tud.DataLoader(Range(6), batch_sampler=_SequenceBatches())  # type: ignore[arg-type]
    expected = [batch.tolist() for batch in torch_loader]
    with DataLoader(Range(6), batch_sampler=_SequenceBatches()) as loader:
        assert as_lists(list(loader)) == expected == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(TypeError, match="batch_sampler must be an iterable of batches"):
        DataLoader(Range(6), batch_sampler=object())
