"""A resume state never moves silently to a loader where its batch ids are other samples
(_epoch._resume; RELIABILITY.md rows 25, 35 and 43): the cases a review found.

Each case builds the loaders of several ranks in one process (``DistributedSampler(n, R, r)``
given explicitly, ``num_workers=0``), except the loader built before a process group exists,
which needs a real one: two spawned processes in a gloo group on loopback.
"""

from __future__ import annotations

from typing import Any

import psutil
import pytest
import torch
import torch.utils.data as tud
from datasets import Range
from helpers import as_lists, first_and_state, flat, gloo_group, reporting, run_spawned_ranks

from aioloader import DataLoader, DistributedSampler, RandomSampler
from aioloader.distributed import merge_states

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")


def rest(loader: DataLoader, state: dict[str, Any]) -> list[list[int]]:
    loader.load_state_dict(state)
    return as_lists(list(loader))


# -- out-of-order batch ids are a rank's own (in_order=False) ---------------------------------


def _unordered(rank: int, ranks: int = 2) -> DataLoader:
    sampler = DistributedSampler(40, ranks, rank, shuffle=False)
    return DataLoader(Range(40), batch_size=2, in_order=False, sampler=sampler)


def test_an_out_of_order_state_resumes_its_own_rank_only() -> None:
    # Out of order, each rank takes the batch ids its own batches complete in: rank 0's
    # "done" says nothing of rank 1's. Loaded on rank 1 it repeated and missed samples.
    with _unordered(0) as saver:
        taken, state = first_and_state(saver, 2)
    assert state["rank"] == 0
    assert "consumed" not in state  # (rank 0's ids only: no positions every rank read)
    with _unordered(1) as other:
        with pytest.raises(ValueError, match="in_order=False") as info:
            other.load_state_dict(state)
        assert "rank 0's of 2 ranks" in str(info.value)
        assert "rank 1's share of 2" in str(info.value)
        assert len(list(other)) == 10  # refused: a whole epoch
    with _unordered(0) as same, _unordered(0) as reference:
        assert sorted(flat(taken) + flat(rest(same, state))) == sorted(flat(list(reference)))
    with (
        _unordered(0, ranks=4) as elsewhere,  # nor on another number of ranks
        pytest.raises(ValueError, match="rank 0's of 2 ranks"),
    ):
        elsewhere.load_state_dict(state)


def test_an_in_order_state_still_resumes_every_rank() -> None:
    # The documented rule where the ids are the same on every rank.
    def make(rank: int) -> DataLoader:
        return DataLoader(Range(40), batch_size=2, sampler=DistributedSampler(40, 2, rank))

    with make(0) as saver:
        _, state = first_and_state(saver, 3)
    assert "rank" not in state
    with make(1) as reference:
        whole = as_lists(list(reference))
    with make(1) as other:
        assert rest(other, state) == whole[3:]


# -- a rollover carry is a rank's own ---------------------------------------------------------


def _rollover(rank: int) -> DataLoader:
    sampler = DistributedSampler(22, 2, rank, shuffle=False)  # 11 a rank: 3 carried
    return DataLoader(Range(22), batch_size=4, last_batch="rollover", seed=0, sampler=sampler)


def test_a_rollover_carry_resumes_its_own_rank_and_is_not_merged() -> None:
    loaders = [_rollover(0), _rollover(1)]
    try:
        for loader in loaders:
            list(loader)  # epoch 0: each rank holds back its own tail
        states = [loader.state_dict() for loader in loaders]
        following = [as_lists(list(loader)) for loader in loaders]  # epoch 1, uninterrupted
    finally:
        for loader in loaders:
            loader.close()
    assert [s["rank"] for s in states] == [0, 1]
    with pytest.raises(ValueError, match="rank 0's own") as info:
        merge_states(states)
    assert "rollover carry" in str(info.value)
    with _rollover(1) as other:
        with pytest.raises(ValueError, match="last_batch='rollover'") as refused:
            other.load_state_dict(states[0])
        assert "rank 0's of 2 ranks" in str(refused.value)
    for rank in range(2):
        with _rollover(rank) as own:
            assert rest(own, states[rank]) == following[rank]


def test_merge_states_compares_the_sampler_states() -> None:
    # Two ranks' states that differ in their sampler state (here: seeds) are not one job's.
    def make(seed: int) -> DataLoader:
        sampler = DistributedSampler(20, 2, 0, seed=seed)
        return DataLoader(Range(20), batch_size=2, sampler=sampler, seed=0)

    with make(1) as one, make(2) as two:
        states = [one.state_dict(), two.state_dict()]
    with pytest.raises(ValueError, match="state 1's 'sampler'"):
        merge_states(states)


# -- a stateful sampler inside a stateless batch sampler --------------------------------------


def _inside_torch_batches() -> DataLoader:
    batches = tud.BatchSampler(RandomSampler(20, seed=1), 4, False)
    return DataLoader(Range(20), batch_sampler=batches)


def test_a_sampler_inside_torchs_batch_sampler_is_saved() -> None:
    # Its state was not saved: resumed in epoch 1, the loader replayed epoch 0's order.
    with _inside_torch_batches() as reference:
        list(reference)
        epoch1 = as_lists(list(reference))
    with _inside_torch_batches() as saver:
        list(saver)
        taken, state = first_and_state(saver, 2)
    assert state["sampler"] == {"seed": 1, "epoch": 1}
    assert taken == epoch1[:2]
    with _inside_torch_batches() as resumed:
        assert rest(resumed, state) == epoch1[2:]


# -- the rest of an epoch on other ranks, resumed again on as many ------------------------------


def _ranks(replicas: int, n: int = 23) -> list[DataLoader]:
    return [
        DataLoader(Range(n), batch_size=2, sampler=DistributedSampler(n, replicas, r, seed=3))
        for r in range(replicas)
    ]


def _close(loaders: list[DataLoader]) -> None:
    for loader in loaders:
        loader.close()


def test_a_state_saved_in_the_rest_of_an_epoch_resumes_on_as_many_ranks() -> None:
    # 2 ranks took a batch each; resumed on 3; a state saved there after a batch each was
    # refused on 3 ranks (its len(sampler) was the rest's, compared with a whole epoch's).
    two = _ranks(2)
    try:
        state = first_and_state(two[0], 1)[1]
        first_and_state(two[1], 1)
    finally:
        _close(two)
    reference, three = _ranks(3), _ranks(3)
    try:
        whole = [rest(loader, state) for loader in reference]
        for loader in three:
            loader.load_state_dict(state)
        its = [iter(loader) for loader in three]
        taken = [as_lists([next(it)]) for it in its]
        again = three[0].state_dict()
        del its
    finally:
        _close(reference + three)
    resumed = _ranks(3)
    try:
        for rank, loader in enumerate(resumed):
            assert taken[rank] + rest(loader, again) == whole[rank]
    finally:
        _close(resumed)


# -- a sampler state is refused where it is loaded, never at the first batch -------------------


def test_a_carry_loaded_into_a_loader_that_keeps_is_refused_at_once() -> None:
    with DataLoader(Range(23), batch_size=4, last_batch="rollover", seed=1) as saver:
        list(saver)
        state = saver.state_dict()
    assert state["sampler"]["carry"]
    with DataLoader(Range(23), batch_size=4, seed=1) as keeps:
        with pytest.raises(ValueError, match="last_batch='keep'"):
            keeps.load_state_dict(state)
        assert len(list(keeps)) == 6  # refused: the loader's own next epoch, whole


def test_positions_read_outside_the_dataset_are_refused_at_once() -> None:
    def make() -> DataLoader:
        return DataLoader(Range(10), batch_size=2, sampler=DistributedSampler(10, 2, 0))

    with make() as saver:
        state = saver.state_dict()
    state["sampler"]["sampler"]["consumed"] = [[0, 30]]
    with make() as loader:
        with pytest.raises(ValueError, match=r"\[0, 30\]"):
            loader.load_state_dict(state)
        assert len(list(loader)) == 3


class _FailsOnceArmed(RandomSampler):
    """Injects a fault: once armed, the next ``load_state_dict`` raises (once)."""

    armed = False

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if type(self).armed:
            type(self).armed = False
            raise RuntimeError("injected: the sampler state failed to load")
        super().load_state_dict(state)


def test_a_resume_whose_sampler_fails_at_the_epochs_start_is_kept() -> None:
    # begin() dropped the resume before loading the sampler state: iterating again then ran
    # the next epoch, silently, instead of the saved one.
    def make() -> DataLoader:
        return DataLoader(Range(20), batch_size=4, sampler=_FailsOnceArmed(20, seed=2))

    with make() as saver:
        list(saver)
        taken, state = first_and_state(saver, 2)
    with make() as reference:
        list(reference)
        epoch1 = as_lists(list(reference))
    with make() as loader:
        loader.load_state_dict(state)
        _FailsOnceArmed.armed = True  # the epoch's start loads the state again, and fails
        with pytest.raises(RuntimeError, match="injected"):
            list(loader)
        assert as_lists(list(loader)) == epoch1[2:]
    assert taken == epoch1[:2]


# -- the rollover carry: checked, and counted by len() -----------------------------------------


def _carrying(n: int) -> DataLoader:
    return DataLoader(Range(n), batch_size=4, last_batch="rollover", seed=1, shuffle=True)


def test_a_carry_outside_the_dataset_is_refused_naming_it() -> None:
    with _carrying(23) as saver:
        list(saver)
        list(saver)  # epoch 1 carries one index past 10 and one below (seed 1)
        state = saver.state_dict()
    carry = state["sampler"]["carry"]
    outside = [i for i in carry if i >= 10]
    assert outside
    assert len(outside) < len(carry)
    with _carrying(10) as shorter:
        with pytest.raises(ValueError, match="outside this loader's dataset of 10") as info:
            shorter.load_state_dict(state)
        assert f"indices {outside}" in str(info.value)  # those outside only
    tampered = {**state, "sampler": {**state["sampler"], "carry": [-1, -2]}}
    with _carrying(23) as loader:
        with pytest.raises(ValueError, match=r"negative indices \[-1, -2\]"):
            loader.load_state_dict(tampered)
        beyond = {**state, "sampler": {**state["sampler"], "carry": [23, 5]}}
        with pytest.raises(ValueError, match=r"indices \[23\] outside"):
            loader.load_state_dict(beyond)


def test_len_counts_a_loaded_carry() -> None:
    with _carrying(23) as saver:
        list(saver)
        state = saver.state_dict()
    with _carrying(23) as loader:
        loader.load_state_dict(state)
        assert len(loader) == 6  # 23 + 3 carried = 26: six batches of 4, 2 carried on
        assert len(list(loader)) == 6


# -- the layout records replacement -------------------------------------------------------------


def _drawing(replacement: bool) -> DataLoader:
    sampler = RandomSampler(20, seed=3, replacement=replacement)
    return DataLoader(Range(20), batch_size=4, sampler=sampler, seed=1)


def test_a_state_without_replacement_is_refused_by_a_loader_drawing_with_it() -> None:
    with _drawing(False) as saver:
        _, state = first_and_state(saver, 2)
    assert state["layout"]["replacement"] is False
    with _drawing(True) as other:
        with pytest.raises(ValueError, match="sampler replacement=False") as info:
            other.load_state_dict(state)
        assert "sampler replacement=True" in str(info.value)


def test_a_state_saved_before_replacement_was_recorded_still_loads() -> None:
    # Format 1 without the key (saved before): loaded as it was, and exact where it is right.
    with _drawing(False) as saver, _drawing(False) as reference:
        taken, state = first_and_state(saver, 2)
        whole = as_lists(list(reference))
    state["layout"] = {k: v for k, v in state["layout"].items() if k != "replacement"}
    with _drawing(False) as loader:
        assert taken + rest(loader, state) == whole


# -- a loader built before the process group ----------------------------------------------------


def _loopback() -> str:
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return str(name)
    pytest.skip("no loopback interface with 127.0.0.1")


def _late_group_rank(rank: int, store: str, interface: str, conn: Any) -> None:
    """One rank of a gloo group of two, whose loaders were built before the group existed."""
    with reporting(conn):
        import torch.distributed as dist

        ds = list(range(40))
        whole = DataLoader(ds, batch_size=4, shuffle=True, seed=0)  # (no group: unsharded)
        _, whole_state = first_and_state(whole, 3)
        whole.close()
        early = DataLoader(ds, batch_size=4, shuffle=True, seed=0)
        early.load_state_dict(whole_state)  # no group yet: checked as one process's
        late = DataLoader(ds, batch_size=4, shuffle=True, seed=0)  # loaded after the group
        gloo_group(rank, 2, store, interface)
        try:
            with DataLoader(ds, batch_size=4, shuffle=True, seed=0) as sharded:
                it = iter(sharded)
                next(it), next(it)
                state = sharded.state_dict()
                reference = as_lists(list(it))
                del it
            try:
                list(early)
                refused = ""
            except ValueError as exc:
                refused = str(exc)
            late.load_state_dict(state)
            resumed = as_lists(list(late))
            conn.send(("ok", refused, resumed == reference, len(resumed), len(early)))
        finally:
            early.close()
            late.close()
            dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_a_loader_built_before_the_group_checks_a_state_against_its_share(tmp_path: Any) -> None:
    # Loaded after the group appeared (before the loader's first len or epoch): the rank's
    # own state was refused. Loaded before: a single process's state was applied to each
    # rank's share at the first epoch, 12 of 40 samples lost, silently.
    interface, limit_s = _loopback(), 60.0
    results = run_spawned_ranks(
        _late_group_rank, lambda rank: (rank, str(tmp_path / "store"), interface), 2, limit_s
    )
    for rank, result in enumerate(results):
        assert result[0] == "ok", result[1]
        _, refused, exact, resumed, early_len = result
        assert "before torch.distributed's process group existed" in refused, refused
        assert f"rank {rank}'s share" in refused
        assert "num_replicas=None" in refused
        assert "num_replicas=2" in refused
        assert exact
        assert resumed == 3  # 5 batches a rank, 2 taken
        assert early_len == 5  # the refused state dropped: the share's whole epoch
