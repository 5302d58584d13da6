"""Tests of aioloader._sampling._sampler: coverage, determinism, state, torch compatibility."""

from __future__ import annotations

import random
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, cast

import psutil
import pytest
import torch
import torch.utils.data as tud
from helpers import assert_raises_naming, gloo_group, reporting, run_spawned_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader._sampling._sampler import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    ShardedBatchSampler,
    validate_non_negative_int,
    validate_positive_int,
)

POLICIES = ["keep", "discard", "rollover"]
# Hypothesis's default deadline trips on a loaded 2-core machine; correctness is what we test.
relaxed = settings(deadline=None, max_examples=60)


def flatten(batches: Iterable[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


# -- index samplers -----------------------------------------------------------------------------


@relaxed
@given(n=st.integers(0, 300), as_int=st.booleans())
def test_sequential_yields_every_index_in_order(n: int, as_int: bool) -> None:
    sampler = SequentialSampler(n if as_int else list(range(n)))
    assert len(sampler) == n
    assert list(sampler) == list(range(n))


def test_sequential_follows_a_growing_dataset() -> None:
    data = [0, 1]
    sampler = SequentialSampler(data)
    data.append(2)
    assert list(sampler) == [0, 1, 2]
    assert len(sampler) == 3


@relaxed
@given(n=st.integers(0, 300), seed=st.integers(0, 2**64), epoch=st.integers(0, 10**6))
def test_random_is_a_permutation_fixed_by_seed_and_epoch(n: int, seed: int, epoch: int) -> None:
    sampler = RandomSampler(n, seed=seed)
    sampler.set_epoch(epoch)
    order = list(sampler)
    assert sorted(order) == list(range(n))
    assert len(order) == len(sampler) == n
    assert all(type(i) is int for i in order)
    again = RandomSampler(list(range(n)), seed=seed)
    again.set_epoch(epoch)
    assert list(again) == order


@relaxed
@given(n=st.integers(20, 200), seed=st.integers(0, 2**32), epoch=st.integers(0, 1000))
def test_random_differs_between_epochs_and_seeds(n: int, seed: int, epoch: int) -> None:
    # 20! orders: a collision by chance is out of reach, so any equality is a bug.
    def order(seed: int, epoch: int) -> list[int]:
        sampler = RandomSampler(n, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(seed, epoch) != order(seed, epoch + 1)
    assert order(seed, epoch) != order(seed + 1, epoch)


def test_each_iteration_consumes_one_epoch_unless_set_epoch_pins_it() -> None:
    auto = RandomSampler(50, seed=3)
    first, second = list(auto), list(auto)
    assert auto.epoch == 2
    pinned = RandomSampler(50, seed=3)
    pinned.set_epoch(1)
    assert list(pinned) == second
    pinned.set_epoch(0)
    assert list(pinned) == first
    assert first != second


@relaxed
@given(n=st.integers(1, 40), num_samples=st.integers(1, 200), seed=st.integers(0, 2**32))
def test_random_num_samples_beyond_length_repeats_whole_permutations(
    n: int, num_samples: int, seed: int
) -> None:
    sampler = RandomSampler(n, num_samples=num_samples, seed=seed)
    order = list(sampler)
    assert len(order) == len(sampler) == num_samples
    whole = num_samples // n
    for k in range(whole):
        assert sorted(order[k * n : (k + 1) * n]) == list(range(n))
    tail = order[whole * n :]
    assert len(set(tail)) == len(tail)
    counts = Counter(order)
    assert all(counts[i] in (whole, whole + 1) for i in range(n))


@relaxed
@given(n=st.integers(1, 50), num_samples=st.integers(1, 300), seed=st.integers(0, 2**32))
def test_random_with_replacement(n: int, num_samples: int, seed: int) -> None:
    sampler = RandomSampler(n, replacement=True, num_samples=num_samples, seed=seed)
    order = list(sampler)
    assert len(order) == len(sampler) == num_samples
    assert all(0 <= i < n for i in order)
    again = RandomSampler(n, replacement=True, num_samples=num_samples, seed=seed)
    assert list(again) == order


def test_random_with_replacement_repeats_indices() -> None:
    order = list(RandomSampler(10, replacement=True, num_samples=1000, seed=0))
    assert len(set(order)) == 10  # all hit, and necessarily with repeats
    assert len(order) == 1000


@pytest.mark.parametrize(
    ("replacement", "num_samples"), [(False, None), (False, 23), (True, None), (True, 75)]
)
def test_random_with_generator_draws_like_torch(replacement: bool, num_samples: int | None) -> None:
    ours = RandomSampler(10, replacement, num_samples, generator=torch.Generator().manual_seed(5))
    theirs = tud.RandomSampler(
        range(10), replacement, num_samples, generator=torch.Generator().manual_seed(5)
    )
    for _ in range(3):  # successive epochs keep drawing from the same generator
        assert list(ours) == list(theirs)
    assert len(ours) == len(theirs)


def test_random_seed_is_chosen_once_and_kept() -> None:
    sampler = RandomSampler(100)
    assert isinstance(sampler.seed, int)
    state = sampler.state_dict()
    assert state["seed"] == sampler.seed
    order = list(sampler)
    clone = RandomSampler(100)  # a different seed of its own ...
    clone.load_state_dict(state)  # ... replaced by the saved one
    assert clone.seed == sampler.seed
    assert list(clone) == order


def test_random_seed_follows_python_random_seeding_without_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With torch imported the seed is torch's (see the test below); a program without torch
    # repeats from random.seed.
    monkeypatch.setitem(sys.modules, "torch", None)  # as if nobody imported torch
    saved = random.getstate()
    try:
        random.seed(1234)
        a = RandomSampler(100)
        random.seed(1234)
        b = RandomSampler(100)
    finally:
        random.setstate(saved)
    assert a.seed == b.seed
    assert list(a) == list(b)


def test_random_seed_follows_torch_manual_seed_and_is_then_kept() -> None:
    # torch's RandomSampler draws its seed from torch's global generator; so does ours, once.
    torch.manual_seed(0)
    a = RandomSampler(100)
    torch.manual_seed(0)
    b = RandomSampler(100)
    assert a.seed == b.seed
    assert a.seed is not None
    assert 0 <= a.seed < 2**63
    epochs = [list(a) for _ in range(3)]
    assert epochs == [list(b) for _ in range(3)]
    assert epochs[0] != epochs[1]  # a new order each epoch, from (seed, epoch)
    assert sorted(epochs[2]) == list(range(100))
    c = RandomSampler(100)  # the global generator moved on: another seed
    assert c.seed != a.seed
    state = a.state_dict()  # the seed drawn is the state: no global generator to restore
    torch.manual_seed(1)
    resumed = RandomSampler(100)
    resumed.load_state_dict(state)
    assert list(resumed) == list(a)
    given = torch.get_rng_state()
    RandomSampler(100, seed=3)  # a seed given, or a generator, leaves the global one alone
    RandomSampler(100, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.get_rng_state(), given)


def test_random_state_round_trip_resumes_the_next_epoch() -> None:
    sampler = RandomSampler(64, seed=9)
    list(sampler)
    state = sampler.state_dict()
    expected = [list(sampler) for _ in range(2)]
    fresh = RandomSampler(64, seed=1)
    fresh.load_state_dict(state)
    assert [list(fresh) for _ in range(2)] == expected


def test_random_generator_state_round_trip() -> None:
    sampler = RandomSampler(30, generator=torch.Generator().manual_seed(0))
    list(sampler)
    state = sampler.state_dict()
    expected = list(sampler)
    fresh = RandomSampler(30, generator=torch.Generator().manual_seed(99))
    fresh.load_state_dict(state)
    assert list(fresh) == expected


# -- distributed --------------------------------------------------------------------------------


@relaxed
@given(
    n=st.integers(0, 120),
    world=st.integers(1, 9),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 100),
)
def test_distributed_ranks_are_equal_and_cover_the_dataset(
    n: int, world: int, shuffle: bool, drop_last: bool, seed: int, epoch: int
) -> None:
    shards = []
    for rank in range(world):
        sampler = DistributedSampler(
            n, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
        assert len(shards[-1]) == len(sampler)
    lengths = {len(s) for s in shards}
    assert len(lengths) == 1, "every rank must get the same number of samples"
    per_rank = lengths.pop()
    counts = Counter(i for shard in shards for i in shard)
    assert all(0 <= i < n for i in counts)
    if n % world == 0 or drop_last:
        assert per_rank == n // world
        assert all(c == 1 for c in counts.values()), "no index may be given twice"
        if n % world == 0:
            assert set(counts) == set(range(n))
    else:
        assert per_rank == -(-n // world)
        assert set(counts) == set(range(n)), "padding must not drop an index"
        assert sum(counts.values()) == per_rank * world
        # Padding wraps around: the extra copies are the first indices of the epoch's order.
        order = [shards[k % world][k // world] for k in range(per_rank * world)]
        assert order[n:] == [order[k % n] for k in range(n, per_rank * world)]


@relaxed
@given(n=st.integers(0, 60), world=st.integers(1, 7), drop_last=st.booleans())
def test_distributed_without_shuffle_equals_torch(n: int, world: int, drop_last: bool) -> None:
    for rank in range(world):
        ours = DistributedSampler(n, world, rank, shuffle=False, drop_last=drop_last)
        # torch's annotation asks for a Dataset; any sized sequence is one to it at runtime.
        data = cast("tud.Dataset[int]", range(n))
        theirs: tud.DistributedSampler[int] = tud.DistributedSampler(
            data, world, rank, shuffle=False, drop_last=drop_last
        )
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


def test_distributed_reshuffles_by_epoch_and_restores_state() -> None:
    sampler = DistributedSampler(100, 4, 1, seed=5)
    epoch0, epoch1 = list(sampler), list(sampler)
    assert epoch0 != epoch1
    sampler.set_epoch(0)
    assert list(sampler) == epoch0
    state = sampler.state_dict()
    expected = list(sampler)
    fresh = DistributedSampler(100, 4, 1, seed=0)
    fresh.load_state_dict(state)
    assert list(fresh) == expected


def test_distributed_defaults_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    sampler = DistributedSampler(10, shuffle=False)
    assert (sampler.num_replicas, sampler.rank) == (3, 2)
    assert list(sampler) == [2, 5, 8, 1]
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    alone = DistributedSampler(10, shuffle=False)
    assert (alone.num_replicas, alone.rank) == (1, 0)
    assert list(alone) == list(range(10))


@pytest.mark.parametrize(
    ("world", "rank", "needle"),
    [
        ("two", "0", "WORLD_SIZE"),
        ("2", "x", "RANK"),
        ("2", "2", "rank"),
        ("0", "0", "num_replicas"),
    ],
)
def test_distributed_refuses_bad_environment(
    monkeypatch: pytest.MonkeyPatch, world: str, rank: str, needle: str
) -> None:
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(ValueError, match=needle):
        DistributedSampler(10)


def _loopback_interface() -> str:
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return str(name)
    pytest.skip("no loopback interface with 127.0.0.1")


def _distributed_rank(
    rank: int, world_size: int, store: str, n: int, interface: str, conn: Any
) -> None:
    """One rank of a real gloo process group; reports what its sampler saw."""
    with reporting(conn):
        import torch.distributed as dist

        gloo_group(rank, world_size, store, interface)
        try:
            sampler = DistributedSampler(n, seed=11)
            indices = list(sampler)
            # A collective over the shard sizes: it would hang, not fail, if they differed.
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
            dist.all_gather(sizes, torch.tensor([len(indices)]))
            conn.send(("ok", sampler.num_replicas, sampler.rank, indices, [int(s) for s in sizes]))
        finally:
            dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_distributed_reads_rank_and_world_from_a_real_process_group(tmp_path: Any) -> None:
    world, n, limit_s = 2, 21, 45.0
    interface = _loopback_interface()
    results = run_spawned_ranks(
        _distributed_rank,
        lambda rank: (rank, world, str(tmp_path / "store"), n, interface),
        world,
        limit_s,
    )
    for rank, result in enumerate(results):
        assert result[0] == "ok", result[1]
        _, num_replicas, seen_rank, _, sizes = result
        assert (num_replicas, seen_rank) == (world, rank)
        assert sizes == [len(results[0][3])] * world
    shards = [set(result[3]) for result in results]
    assert len(results[0][3]) == len(results[1][3]) == -(-n // world)
    assert shards[0] | shards[1] == set(range(n))
    # 21 samples on 2 ranks: exactly one index is padding, so the shards share exactly it.
    assert len(shards[0] & shards[1]) == 1


# -- batches ------------------------------------------------------------------------------------


@relaxed
@given(
    n=st.integers(0, 80),
    batch_size=st.integers(1, 20),
    policy=st.sampled_from(POLICIES),
    shuffle=st.booleans(),
    epochs=st.integers(1, 5),
)
def test_batch_sampler_policies(
    n: int, batch_size: int, policy: str, shuffle: bool, epochs: int
) -> None:
    inner = RandomSampler(n, seed=n) if shuffle else SequentialSampler(n)
    sampler = BatchSampler(inner, batch_size, policy)  # type: ignore[arg-type]
    seen: Counter[int] = Counter()
    for _ in range(epochs):
        expected_len = len(sampler)
        carry_in = list(sampler.carry)
        batches = list(sampler)
        assert len(batches) == expected_len
        assert all(type(b) is list for b in batches)
        assert all(len(b) == batch_size for b in batches[:-1])
        flat = flatten(batches)
        if policy == "keep":
            assert sorted(flat) == list(range(n))
        elif policy == "discard":
            assert all(len(b) == batch_size for b in batches)
            assert len(flat) == n - n % batch_size
            assert len(set(flat)) == len(flat)
        else:
            assert all(len(b) == batch_size for b in batches)
            # What left (batches, then the new carry) is what came in (old carry, then epoch).
            out = flat + list(sampler.carry)
            assert out[: len(carry_in)] == carry_in
            assert sorted(out[len(carry_in) :]) == list(range(n))
            assert len(sampler.carry) == (len(carry_in) + n) % batch_size
        seen.update(flat)
    if policy == "rollover":
        # Across k epochs every index is yielded k times, except the final carry (once fewer).
        expected = Counter({i: epochs for i in range(n)})
        expected.subtract(Counter(sampler.carry))
        assert seen == +expected
        assert len(sampler.carry) == (epochs * n) % batch_size


def test_rollover_is_committed_for_a_consumer_that_stops_after_len_batches() -> None:
    sampler = BatchSampler(range(10), 4, "rollover")
    iterator = iter(sampler)
    taken = [next(iterator) for _ in range(len(sampler))]
    assert taken == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sampler.carry == (8, 9)
    assert len(sampler) == 3  # (2 carried + 10) // 4: the next epoch is already counted
    assert next(iter(sampler)) == [8, 9, 0, 1]


def test_rollover_abandoned_epoch_keeps_the_previous_carry() -> None:
    sampler = BatchSampler(range(10), 4, "rollover")
    list(sampler)
    assert sampler.carry == (8, 9)
    iterator = iter(sampler)
    assert next(iterator) == [8, 9, 0, 1]
    del iterator  # abandoned mid-epoch: nothing is committed, nothing lost
    assert sampler.carry == (8, 9)
    assert flatten(sampler)[:2] == [8, 9]


def test_batch_sampler_accepts_torch_spellings_and_samplers() -> None:
    data = range(10)
    assert list(BatchSampler(data, 3, False)) == list(tud.BatchSampler(data, 3, False))
    assert list(BatchSampler(data, 3, True)) == list(tud.BatchSampler(data, 3, True))
    assert BatchSampler(data, 3, drop_last=True).last_batch == "discard"
    assert BatchSampler(data, 3, "discard", drop_last=True).drop_last is True
    assert BatchSampler(data, 3).last_batch == "keep"
    torch_inner = tud.RandomSampler(data, generator=torch.Generator().manual_seed(0))
    assert sorted(flatten(BatchSampler(torch_inner, 4))) == list(data)


def test_batch_sampler_set_epoch_forwards_to_the_sampler() -> None:
    inner = RandomSampler(30, seed=2)
    sampler = BatchSampler(inner, 7)
    sampler.set_epoch(4)
    assert inner.epoch == 4
    BatchSampler(range(5), 2).set_epoch(1)  # an inner sampler without set_epoch is fine


def test_batch_sampler_state_round_trip_restores_carry_and_sampler() -> None:
    sampler = BatchSampler(RandomSampler(23, seed=4), 5, "rollover")
    list(sampler)
    list(sampler)
    state = sampler.state_dict()
    assert state["carry"] == list(sampler.carry)
    assert len(state["carry"]) == (2 * 23) % 5
    expected = [list(sampler) for _ in range(3)]
    fresh = BatchSampler(RandomSampler(23, seed=77), 5, "rollover")
    fresh.load_state_dict(state)
    assert [list(fresh) for _ in range(3)] == expected


def test_batch_sampler_state_with_a_stateless_sampler() -> None:
    sampler = BatchSampler(range(7), 3, "rollover")
    list(sampler)
    state = sampler.state_dict()
    assert state == {"carry": [6]}
    fresh = BatchSampler(range(7), 3, "rollover")
    fresh.load_state_dict(state)
    assert list(fresh) == [[6, 0, 1], [2, 3, 4]]


@relaxed
@given(
    n=st.integers(0, 60),
    batch_size=st.integers(1, 12),
    num_shards=st.integers(1, 8),
    use_torch=st.booleans(),
)
def test_sharded_batches_split_evenly(
    n: int, batch_size: int, num_shards: int, use_torch: bool
) -> None:
    inner: Any = (
        tud.BatchSampler(range(n), batch_size, False)
        if use_torch
        else BatchSampler(range(n), batch_size)
    )
    sharded = ShardedBatchSampler(inner, num_shards)
    batches = list(inner)
    out = list(sharded)
    assert len(out) == len(sharded) == len(batches)
    for batch, shards in zip(batches, out, strict=True):
        assert flatten(shards) == batch
        assert len(shards) == min(num_shards, len(batch))
        sizes = [len(s) for s in shards]
        assert all(sizes), "no empty shard"
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)


def test_sharded_forwards_epoch_and_state() -> None:
    inner = BatchSampler(RandomSampler(11, seed=0), 4, "rollover")
    sharded = ShardedBatchSampler(inner, 2)
    sharded.set_epoch(3)
    assert inner.sampler.epoch == 3  # type: ignore[attr-defined]
    state = sharded.state_dict()
    expected = list(sharded)
    fresh = ShardedBatchSampler(BatchSampler(RandomSampler(11, seed=5), 4, "rollover"), 2)
    fresh.load_state_dict(state)
    assert list(fresh) == expected


# -- bad arguments ------------------------------------------------------------------------------


BAD_ARGUMENTS: list[tuple[Callable[[], object], type[Exception], list[str]]] = [
    (lambda: SequentialSampler(object()), TypeError, ["data_source", "object"]),  # type: ignore[arg-type]
    (lambda: SequentialSampler(-1), ValueError, ["data_source", "-1"]),
    (lambda: RandomSampler(10, num_samples=-1), ValueError, ["num_samples", "-1"]),
    (lambda: RandomSampler(10, num_samples=0), ValueError, ["num_samples", "0"]),  # as torch
    (lambda: RandomSampler(10, num_samples=2.5), TypeError, ["num_samples", "2.5"]),  # type: ignore[arg-type]
    (lambda: RandomSampler(10, replacement="yes"), TypeError, ["replacement", "'yes'"]),  # type: ignore[arg-type]
    (lambda: RandomSampler(0, num_samples=3), ValueError, ["num_samples=3", "empty"]),
    (lambda: RandomSampler(10, generator=object()), TypeError, ["generator", "object"]),  # type: ignore[arg-type]
    (
        lambda: RandomSampler(10, generator=torch.Generator(), seed=1),
        ValueError,
        ["generator", "seed=1"],
    ),
    (lambda: RandomSampler(10, seed=1.5), TypeError, ["seed", "1.5"]),  # type: ignore[arg-type]
    (lambda: RandomSampler(10).set_epoch(-1), ValueError, ["epoch", "-1"]),
    (lambda: DistributedSampler(10, num_replicas=0), ValueError, ["num_replicas", "0"]),
    (lambda: DistributedSampler(10, 2, rank=2), ValueError, ["rank", "2"]),
    (lambda: DistributedSampler(10, 2, rank=-1), ValueError, ["rank", "-1"]),
    (lambda: DistributedSampler(10, 2, 0, shuffle="no"), TypeError, ["shuffle", "'no'"]),  # type: ignore[arg-type]
    (lambda: DistributedSampler(None, 2, 0), TypeError, ["dataset", "None"]),  # type: ignore[arg-type]
    (lambda: BatchSampler(range(10), 0), ValueError, ["batch_size", "0"]),
    (lambda: BatchSampler(range(10), True), TypeError, ["batch_size", "True"]),
    (lambda: BatchSampler(range(10), 2.0), TypeError, ["batch_size", "2.0"]),  # type: ignore[arg-type]
    (lambda: BatchSampler(range(10), 2, "sometimes"), ValueError, ["last_batch", "'sometimes'"]),  # type: ignore[arg-type]
    (
        lambda: BatchSampler(range(10), 2, "rollover", drop_last=True),
        ValueError,
        ["last_batch='rollover'", "drop_last=True"],
    ),
    (
        lambda: BatchSampler(range(10), 2, "keep", drop_last=True),
        ValueError,
        ["last_batch='keep'", "drop_last=True"],
    ),
    (lambda: BatchSampler(range(10), 2, True, drop_last=True), ValueError, ["drop_last"]),
    (lambda: BatchSampler(range(10), 2, drop_last="yes"), TypeError, ["drop_last", "'yes'"]),  # type: ignore[arg-type]
    (lambda: BatchSampler(5, 2), TypeError, ["sampler", "5"]),  # type: ignore[arg-type]
    (lambda: len(BatchSampler(iter(range(5)), 2)), TypeError, ["Sized"]),
    (lambda: ShardedBatchSampler([[0, 1]], 0), ValueError, ["num_shards", "0"]),
    (lambda: ShardedBatchSampler(3, 2), TypeError, ["batch_sampler", "3"]),  # type: ignore[arg-type]
    (
        lambda: BatchSampler(range(4), 2).load_state_dict({"carry": "ab"}),
        TypeError,
        ["carry", "'ab'"],
    ),
    (lambda: BatchSampler(range(4), 2).load_state_dict({}), ValueError, ["carry"]),
    (
        lambda: BatchSampler(range(4), 2, "keep").load_state_dict({"carry": [1]}),
        ValueError,
        ["carry", "last_batch='keep'"],
    ),
    (
        lambda: BatchSampler(range(4), 2).load_state_dict({"carry": [], "sampler": {}}),
        ValueError,
        ["sampler", "load_state_dict"],
    ),
    (lambda: RandomSampler(5, seed=1).load_state_dict({"seed": 1}), ValueError, ["epoch"]),
    (lambda: validate_positive_int("workers", -3), ValueError, ["workers", "-3"]),
    (lambda: validate_non_negative_int("prefetch", "2"), TypeError, ["prefetch", "'2'"]),
]


@pytest.mark.parametrize(
    ("make", "error", "needles"),
    BAD_ARGUMENTS,
    ids=[f"{i}-{needles[0]}" for i, (_, _, needles) in enumerate(BAD_ARGUMENTS)],
)
def test_bad_arguments_name_the_argument_and_value(
    make: Callable[[], object], error: type[Exception], needles: list[str]
) -> None:
    assert_raises_naming(make, error, needles)


def test_validators_return_plain_ints() -> None:
    import numpy as np

    assert validate_positive_int("batch_size", np.int64(4)) == 4
    assert type(validate_positive_int("batch_size", np.int64(4))) is int
    assert validate_non_negative_int("prefetch", 0) == 0
