"""Elastic resume of streams read in units (``TarDataset``, ``ParquetDataset``): every rank's
state, merged, resumes on any number of ranks (RELIABILITY.md row 35).

Here each rank is a copy of the dataset in this process, told its rank as the loader tells it
(``set_rank``), and iterated directly: the properties are the dataset's, whatever runs it. A
real job of gloo ranks, through the loader with worker processes, is in
``test_stream_elastic_job``.

Invariants, for any cut of any rank (ranks may stop at different points), shuffled or not:

- the merged state's rest, read by any number of new ranks, and what the old ranks took before
  the cut, hold every record of the epoch exactly once;
- a state saved in such a rest, merged again, resumes on yet other ranks with the same
  guarantee;
- a rank's own state in a rest resumes that rank exactly (the records the uninterrupted rest
  would still have given, in order);
- the next epoch of each new rank is that of an uninterrupted run on the new ranks.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from datasets import parquet_bytes, tar_shard
from helpers import assert_raises_naming
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader._epoch import deal_carried
from aioloader.distributed import merge_states
from aioloader.sources import ParquetDataset, TarDataset

pytestmark = pytest.mark.usefixtures("baseline")

#: Tar shards of 1 to 7 samples, and Parquet files of row groups of 3 rows (the last shorter).
TAR_SIZES = (3, 7, 1, 5, 6, 2, 4, 7, 3)
PARQUET_ROWS = (5, 7, 3, 9, 4)
GROUP = 3

_WRITTEN: dict[str, list[str]] = {}


def data(kind: str, factory: pytest.TempPathFactory) -> list[str]:
    """The files of ``kind``, written once per session for the Hypothesis examples."""
    if kind not in _WRITTEN:
        directory = factory.mktemp(kind)
        paths = []
        if kind == "tar":
            for shard, size in enumerate(TAR_SIZES):
                path = directory / f"s{shard:02d}.tar"
                path.write_bytes(tar_shard(shard, size))
                paths.append(str(path))
        else:
            for file, rows in enumerate(PARQUET_ROWS):
                path = directory / f"part-{file:03d}.parquet"
                path.write_bytes(parquet_bytes(file, rows, GROUP))
                paths.append(str(path))
        _WRITTEN[kind] = paths
    return _WRITTEN[kind]


def everything(kind: str) -> list[Any]:
    if kind == "tar":
        return [f"{s:03d}/{i:04d}" for s, n in enumerate(TAR_SIZES) for i in range(n)]
    return [f * 1000 + i for f, n in enumerate(PARQUET_ROWS) for i in range(n)]


def maker(kind: str, paths: list[str], shuffle: bool, even: bool = False) -> Callable[[], Any]:
    options: dict[str, Any] = {"seed": 7, "shuffle": shuffle, "shuffle_buffer": 4}
    options["even_shares"] = even
    if kind == "tar":
        return lambda: TarDataset(paths, shards_in_flight=2, lengths=TAR_SIZES, **options)
    return lambda: ParquetDataset(paths, row_groups_in_flight=2, **options)


def key(record: dict[str, Any]) -> Any:
    return record["__key__"] if "__key__" in record else int(record["id"])


async def read(
    make: Callable[[], Any],
    rank: int,
    world: int,
    epoch: int,
    state: dict[str, Any] | None = None,
    cut: float | None = None,
) -> tuple[list[Any], dict[str, Any] | None]:
    """Rank ``rank`` of ``world``'s records of ``epoch`` (from ``state``, as the loader loads
    it: the state, then the epoch and the rank); with ``cut``, only that share of them
    (of its whole share) and its state then."""
    ds = make()
    if state is not None:
        ds.load_state_dict(state)
    ds.set_epoch(epoch)
    ds.set_rank(rank, world)
    records = [key(r) async for r in ds]
    if cut is None:
        return records, None
    ds = make()
    if state is not None:
        ds.load_state_dict(state)
    ds.set_epoch(epoch)
    ds.set_rank(rank, world)
    it = aiter(ds)
    taken = [key(await anext(it)) for _ in range(int(cut * len(records)))]
    saved = ds.state_dict()
    await it.aclose()
    return taken, saved


def as_loader_state(dataset_state: dict[str, Any], epoch: int) -> dict[str, Any]:
    """A loader's state holding ``dataset_state`` (an async stream's one reader)."""
    streams = {"readers": 1, "last": 0, "states": {0: dataset_state}}
    return {"version": 1, "epoch": epoch, "done": [0], "seed": 1, "streams": streams}


def merged(states: list[dict[str, Any]], epoch: int) -> dict[str, Any]:
    """Every rank's dataset state, merged as the loaders' states are."""
    loader_state = merge_states([as_loader_state(s, epoch) for s in states])
    assert loader_state["done"] == []  # no batch of the rest taken yet
    result: dict[str, Any] = loader_state["streams"]["states"][0]
    return result


async def elastic(
    make: Callable[[], Any],
    kind: str,
    cuts: list[float],
    middle: list[float],
    last: int,
    even: bool,
) -> None:
    epoch = 2
    old = len(cuts)
    head: list[Any] = []
    states = []
    shares = [len((await read(make, rank, old, epoch))[0]) for rank in range(old)]
    if even:  # evened up front: as many records on every rank, give or take the remainder
        assert max(shares) - min(shares) <= 1, shares
        assert sum(shares) == len(everything(kind))
    for rank, cut in enumerate(cuts):
        taken, state = await read(make, rank, old, epoch, cut=cut)
        assert state is not None
        head += taken
        states.append(state)
    rest_state = merged(states, epoch)
    # On len(middle) ranks: each takes its share of the rest up to its cut, then is saved.
    second: list[Any] = []
    again = []
    wholes = []
    for rank, cut in enumerate(middle):
        whole, _ = await read(make, rank, len(middle), epoch, rest_state)
        wholes.append(len(whole))
        taken, state = await read(make, rank, len(middle), epoch, rest_state, cut=cut)
        assert state is not None
        assert taken == whole[: len(taken)]
        # The rank's own state in the rest resumes it exactly.
        after, _ = await read(make, rank, len(middle), epoch, state)
        assert taken + after == whole
        second += taken
        again.append(state)
    if even:  # the rest is evened up too
        assert max(wholes) - min(wholes) <= 1, wholes
    last_state = merged(again, epoch)
    rest: list[Any] = []
    for rank in range(last):
        records, _ = await read(make, rank, last, epoch, last_state)
        rest += records
        following, _ = await read(make, rank, last, epoch + 1, last_state)
        fresh, _ = await read(make, rank, last, epoch + 1)
        assert following == fresh  # the rest applies to its own epoch only
    counts = Counter(head + second + rest)
    assert counts == Counter(everything(kind)), (cuts, middle, last)


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(["tar", "parquet"]),
    shuffle=st.booleans(),
    even=st.booleans(),
    cuts=st.lists(st.floats(0, 1), min_size=4, max_size=4),
    middle=st.lists(st.floats(0, 1), min_size=1, max_size=5),
    last=st.integers(1, 5),
)
def test_every_ranks_state_merged_resumes_exactly_on_any_number_of_ranks(
    tmp_path_factory: pytest.TempPathFactory,
    kind: str,
    shuffle: bool,
    even: bool,
    cuts: list[float],
    middle: list[float],
    last: int,
) -> None:
    make = maker(kind, data(kind, tmp_path_factory), shuffle, even)
    asyncio.run(elastic(make, kind, cuts, middle, last, even))


@settings(max_examples=30, deadline=None)
@given(
    said=st.lists(st.integers(0, 9), min_size=len(TAR_SIZES), max_size=len(TAR_SIZES)),
    shuffle=st.booleans(),
    cuts=st.lists(st.floats(0, 1), min_size=4, max_size=4),
    middle=st.lists(st.floats(0, 1), min_size=1, max_size=5),
    last=st.integers(1, 5),
)
def test_shares_evened_by_a_stale_index_resume_exactly_on_any_number_of_ranks(
    tmp_path_factory: pytest.TempPathFactory,
    said: list[int],
    shuffle: bool,
    cuts: list[float],
    middle: list[float],
    last: int,
) -> None:
    """``lengths=`` from an index that is wrong (shards longer or shorter than it says, or
    said empty): the shares are uneven, but merged and resumed on any number of ranks, every
    sample of the epoch still comes out exactly once, and none of a state is refused."""
    paths = data("tar", tmp_path_factory)
    options: dict[str, Any] = {"seed": 7, "shuffle": shuffle, "shuffle_buffer": 4}
    make = lambda: TarDataset(  # noqa: E731
        paths, shards_in_flight=2, lengths=said, even_shares=True, **options
    )
    asyncio.run(elastic(make, "tar", cuts, middle, last, even=False))


def test_the_rest_is_dealt_so_that_each_new_rank_reads_its_own_units(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A unit left whole is read by one new rank; a unit the old ranks read in part is read
    again (from its start, the consumed records left out) by one new rank only."""
    make = maker("tar", data("tar", tmp_path_factory), shuffle=False)

    async def run() -> None:
        states = [(await read(make, r, 4, 0, cut=0.5))[1] for r in range(4)]
        state = merged([s for s in states if s is not None], 0)
        shares = [(await read(make, r, 3, 0, state))[0] for r in range(3)]
        shards = [{k.split("/")[0] for k in share} for share in shares]
        assert all(not (a & b) for i, a in enumerate(shards) for b in shards[i + 1 :])

    asyncio.run(run())


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_shard_longer_than_its_length_gives_its_extra_samples_to_one_rank(
    tmp_path: Path, world: int
) -> None:
    """``lengths`` comes from an index that may be stale: a shard with more samples than it
    says still gives each sample to exactly one rank (the one with its last part)."""
    paths = []
    for shard, size in enumerate(TAR_SIZES):
        paths.append(str(tmp_path / f"s{shard}.tar"))
        Path(paths[-1]).write_bytes(tar_shard(shard, size + (3 if shard == 1 else 0)))
    make = lambda: TarDataset(paths, lengths=TAR_SIZES, even_shares=True, seed=1)  # noqa: E731

    async def run() -> list[Any]:
        return [k for r in range(world) for k in (await read(make, r, world, 0))[0]]

    got = asyncio.run(run())
    assert Counter(got) == Counter([*everything("tar"), "001/0007", "001/0008", "001/0009"])


def test_even_shares_needs_the_lengths_of_every_shard(tmp_path: Path) -> None:
    path = str(tmp_path / "s.tar")
    assert_raises_naming(
        lambda: TarDataset([path], even_shares=True), ValueError, ["even_shares", "lengths"]
    )
    assert_raises_naming(
        lambda: TarDataset([path, path], lengths=[3]), ValueError, ["lengths", "2 shards"]
    )
    assert_raises_naming(lambda: TarDataset([path], lengths=[-1]), ValueError, ["lengths[0]"])


def test_a_state_of_even_shares_is_refused_by_a_dataset_without(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    paths = data("parquet", tmp_path_factory)

    async def run() -> dict[str, Any]:
        _, state = await read(maker("parquet", paths, True, even=True), 0, 2, 0, cut=0.5)
        return state or {}

    state = asyncio.run(run())
    assert_raises_naming(
        lambda: maker("parquet", paths, True)().load_state_dict(state),
        ValueError,
        ["even_shares=True", "even_shares=False"],
    )


# -- what is refused ---------------------------------------------------------------------------


def test_a_ranks_own_state_on_another_number_of_ranks_names_merge_states(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    make = maker("tar", data("tar", tmp_path_factory), shuffle=True)

    async def run() -> None:
        _, state = await read(make, 1, 4, 0, cut=0.5)
        ds = make()
        ds.load_state_dict(state)
        ds.set_epoch(0)
        ds.set_rank(1, 2)
        refused = r"rank=\[1, 4\], this dataset has rank=\[1, 2\].*merge_states"
        with pytest.raises(ValueError, match=refused):
            async for _ in ds:
                pass

    asyncio.run(run())


def test_merging_refuses_states_that_are_not_one_of_each_rank_at_one_epoch(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    make = maker("parquet", data("parquet", tmp_path_factory), shuffle=True)

    async def run() -> list[dict[str, Any]]:
        return [(await read(make, r, 2, 0, cut=0.5))[1] or {} for r in range(2)]

    states = [as_loader_state(s, 0) for s in asyncio.run(run())]
    assert_raises_naming(lambda: merge_states(states[:1]), ValueError, ["ranks", "[0, 2]"])
    assert_raises_naming(lambda: merge_states([states[0], states[0]]), ValueError, ["ranks"])
    # Ranks that read one share (one model-parallel group under shard=dp_group) save one
    # state: it counts once; the same rank saying two things is refused.
    assert merge_states([*states, states[1]]) == merge_states(states)
    moved = {**states[1]["streams"]["states"][0], "yielded": 0, "ended": []}
    other_step = {**states[1], "streams": {**states[1]["streams"], "states": {0: moved}}}
    assert_raises_naming(
        lambda: merge_states([*states, other_step]), ValueError, ["rank [1, 2]", "different"]
    )
    other = {**states[1], "epoch": 1}
    assert_raises_naming(lambda: merge_states([states[0], other]), ValueError, ["epoch=1"])
    seeded = {**states[1]["streams"]["states"][0], "seed": 8}
    edited = {**states[1], "streams": {**states[1]["streams"], "states": {0: seeded}}}
    assert_raises_naming(lambda: merge_states([states[0], edited]), ValueError, ["'seed'"])
    assert_raises_naming(lambda: merge_states([]), ValueError, ["every rank"])
    assert_raises_naming(lambda: merge_states([states[0], {}]), ValueError, ["state 1", "epoch"])


async def parquet_state(paths: list[str], rank: int, world: int, taken: int) -> dict[str, Any]:
    """Rank ``rank`` of ``world``'s ParquetDataset state after ``taken`` records (a failed
    row group's record counts as one)."""
    ds = ParquetDataset(paths, row_groups_in_flight=2, seed=7)
    ds.set_epoch(0)
    ds.set_rank(rank, world)
    it: Any = aiter(ds)
    for _ in range(taken):
        await anext(it)
    state = ds.state_dict()
    await it.aclose()
    return state


def test_merging_refuses_ranks_whose_footers_differed(tmp_path: Path) -> None:
    """Each rank reads the footers itself: a footer that fails on one rank only (the file
    changed, a transient error past the retries) makes that rank's row groups other than the
    others'; the merge names the ranks rather than resume shares that overlap."""
    paths = []
    for file, rows in enumerate((6, 3, 6)):
        paths.append(str(tmp_path / f"part-{file}.parquet"))
        Path(paths[-1]).write_bytes(parquet_bytes(file, rows, GROUP))

    saved = [asyncio.run(parquet_state(paths, rank, 3, 1)) for rank in range(2)]
    Path(paths[1]).write_bytes(b"not a footer")  # rank 2 lists it, and its footer fails
    saved.append(asyncio.run(parquet_state(paths, 2, 3, 1)))
    states = [as_loader_state(s, 0) for s in saved]
    assert_raises_naming(
        lambda: merge_states(states), ValueError, ["ranks 0, 1:", "rank 2:", "footer"]
    )


def test_merging_refuses_ranks_whose_listings_differed(tmp_path: Path) -> None:
    """Two ranks listed other files of the same shape (as many row groups and rows): their
    shares were planned from different data, so the merge refuses, naming both ranks."""
    paths = []
    for file in range(3):
        paths.append(str(tmp_path / f"part-{file}.parquet"))
        Path(paths[-1]).write_bytes(parquet_bytes(file, 6, GROUP))

    async def run() -> list[dict[str, Any]]:
        return [
            await parquet_state([paths[0], paths[1]], 0, 2, 2),
            await parquet_state([paths[0], paths[2]], 1, 2, 2),
        ]

    states = [as_loader_state(s, 0) for s in asyncio.run(run())]
    assert_raises_naming(lambda: merge_states(states), ValueError, ["rank 0:", "rank 1:"])


def test_merging_refuses_even_shares_cut_by_other_lengths(tmp_path: Path) -> None:
    """Tar ranks given other ``lengths=`` (an index that differed) cut other shares."""
    paths = [str(tmp_path / f"s{shard}.tar") for shard in range(2)]
    for shard, path in enumerate(paths):
        Path(path).write_bytes(tar_shard(shard, 4))

    async def run() -> list[dict[str, Any]]:
        states = []
        for rank, lengths in enumerate(([4, 4], [4, 5])):
            make = lambda lengths=lengths: TarDataset(  # noqa: E731
                paths, lengths=lengths, even_shares=True
            )
            states.append((await read(make, rank, 2, 0, cut=0.5))[1] or {})
        return states

    states = [as_loader_state(s, 0) for s in asyncio.run(run())]
    assert_raises_naming(
        lambda: merge_states(states), ValueError, ["rank 0: [4, 4]", "rank 1: [4, 5]"]
    )


def carrying(state: dict[str, Any], rank: int, samples: list[int]) -> dict[str, Any]:
    """``state`` as a loader under equal steps on 3 ranks saves it on ``rank`` when that rank
    carries batches of ``samples`` samples each into its next epoch (a batch: its samples'
    values, ``rank * 100 + i``)."""
    carried = [[[rank * 100 + i] * n, n, 8 * n] for i, n in enumerate(samples)]
    return {**state, "equal_steps": {"rank": rank, "world": 3, "carried": carried}}


def test_every_ranks_carried_batches_are_in_the_merged_state_and_dealt_to_the_new_ranks(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Under equal steps each rank's state holds the batches it carries into its next epoch.
    The merged state holds every rank's (a rank's repeated state once): on as many ranks as
    saved them each takes its own, on another number they are dealt out in rank order, so
    across the new ranks each carried batch is handed exactly once."""
    make = maker("tar", data("tar", tmp_path_factory), shuffle=False)

    async def run() -> list[dict[str, Any]]:
        return [(await read(make, r, 3, 0, cut=0.5))[1] or {} for r in range(3)]

    streams = [as_loader_state(s, 0) for s in asyncio.run(run())]
    between = {"version": 1, "epoch": 1, "done": [], "seed": 1, "sampler": None}
    for states in (streams, [dict(between) for _ in range(3)]):
        states[0] = carrying(states[0], 0, [4, 4])
        states[2] = carrying(states[2], 2, [3])
        merged_state = merge_states([*states, states[2]])
        assert merge_states(states) == merged_state
        without = merge_states([{k: v for k, v in s.items() if k != "equal_steps"} for s in states])
        assert {k: v for k, v in merged_state.items() if k != "equal_steps"} == without
        saved = merged_state["equal_steps"]
        own = [
            carrying({}, 0, [4, 4])["equal_steps"]["carried"],
            [],
            carrying({}, 2, [3])["equal_steps"]["carried"],
        ]
        # The same 3 ranks: each its own, in its order.
        assert [deal_carried(saved, r, 3) for r in range(3)] == own
        every = [tuple(map(str, item)) for items in own for item in items]
        for world in (1, 2, 4, 5):
            parts = [deal_carried(saved, r, world) for r in range(world)]
            handed = [tuple(map(str, item)) for part in parts for item in part or []]
            assert sorted(handed) == sorted(every), (world, parts)  # each once, none lost
            sizes = [len(part or []) for part in parts]
            assert max(sizes) - min(sizes) <= 1, (world, sizes)  # dealt evenly
    assert deal_carried({"rank": 0, "carried": []}, 0, 2) is None  # a rank's own state
    assert_raises_naming(
        lambda: deal_carried({"by_rank": [[0, "nope"]], "world": 3}, 0, 2),
        ValueError,
        ["by_rank", "nope"],
    )


def test_a_stream_read_in_workers_is_not_merged() -> None:
    state = as_loader_state({"position": 3}, 0)
    state["streams"]["readers"] = 2
    assert_raises_naming(lambda: merge_states([state]), ValueError, ["worker processes"])


def test_map_style_states_merge_to_rank_zeros(tmp_path: Path) -> None:
    state = {"version": 1, "epoch": 0, "done": [0, 1], "seed": 3, "consumed": [[0, 8]]}
    assert merge_states([state, dict(state)]) == state
    assert_raises_naming(
        lambda: merge_states([state, {**state, "done": [0]}]), ValueError, ["'done'"]
    )


def test_a_malformed_rest_is_refused_where_it_is_loaded(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    make = maker("tar", data("tar", tmp_path_factory), shuffle=False)

    async def run() -> dict[str, Any]:
        states = [(await read(make, r, 2, 0, cut=0.5))[1] or {} for r in range(2)]
        return merged(states, 0)

    state = asyncio.run(run())
    bad_unit = {**state, "rest": {**state["rest"], "consumed": [[99, [[0, 1]]]]}}
    assert_raises_naming(lambda: make().load_state_dict(bad_unit), ValueError, ["unit 99"])
    bad_range = {**state, "rest": {**state["rest"], "consumed": [[0, [[2, 1]]]]}}
    assert_raises_naming(lambda: make().load_state_dict(bad_range), ValueError, ["[2, 1]"])
    yielded = {**state, "yielded": 3}
    assert_raises_naming(lambda: make().load_state_dict(yielded), ValueError, ["no rank"])


@pytest.mark.parametrize("taken", [2, 4, 6, 7])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_shard_longer_than_its_length_resumes_exactly_when_merged(
    tmp_path: Path, taken: int, world: int
) -> None:
    """The index says 4 and 4 samples, shard 1 really has 7: rank 1 (shard 1, its extra
    samples too) stops after ``taken`` of them, rank 0 halfway; the merged state loads, and
    the rest on any number of ranks holds every sample not taken exactly once (none lost past
    the length said, none refused)."""
    sizes = (4, 7)
    paths = [str(tmp_path / f"s{shard}.tar") for shard in range(2)]
    for shard, size in enumerate(sizes):
        Path(paths[shard]).write_bytes(tar_shard(shard, size))

    def make() -> TarDataset:
        return TarDataset(paths, lengths=[4, 4], even_shares=True)

    every = [f"{s:03d}/{i:04d}" for s, n in enumerate(sizes) for i in range(n)]

    async def run() -> list[Any]:
        head: list[Any] = []
        states = []
        for rank, count in enumerate([2, taken]):
            share, _ = await read(make, rank, 2, 0)
            assert len(share) == sizes[rank]  # rank 1 reads shard 1 to its real end
            got, state = await read(make, rank, 2, 0, cut=count / len(share))
            assert len(got) == count
            assert state is not None
            head += got
            states.append(state)
        rest_state = merged(states, 0)
        make().load_state_dict(rest_state)  # never refused for records past the length said
        rest = [k for r in range(world) for k in (await read(make, r, world, 0, rest_state))[0]]
        return head + rest

    assert Counter(asyncio.run(run())) == Counter(every)
