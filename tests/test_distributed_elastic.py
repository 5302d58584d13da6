"""Elastic resume: a mid-epoch state saved on R ranks resumes on R' (RELIABILITY.md row 35).

The state records which positions of the epoch's order every rank read (``"consumed"``), and
a loader on another number of ranks shares out the rest of that order among its own. Here
the ranks are loaders in this process, each with the rank's DistributedSampler (what a
loader makes under a process group); a real job of four gloo ranks resuming on two, three and
four is in ``test_distributed_lockstep`` (its ``elastic`` case).

Tar shards and Parquet row groups (the last part): a real job of four gloo ranks
(``tests/scripts/elastic_streams.py``, started once for the module) saves at steps Hypothesis
chose, merges every rank's state and resumes on 2 ranks x 1 worker, 3 x 2 and 4 x 0; the
properties, for any cut of any rank, are proven in this process in ``test_stream_elastic``.

Invariants, for any epoch length, batch size, cut point and last-batch policy:

- nothing taken before the cut comes again after it, on any new rank (on as many ranks, the
  epoch goes on by batch ids as it would have, its padding included);
- the taken and the rest together hold every sample of the epoch: at least once (padding
  repeats a few, as a DistributedSampler pads) or, with ``drop_last``, at most once;
- every new rank gets as many batches of the rest;
- the next epoch is what an uninterrupted run on the new ranks gives.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from datasets import Range, parquet_bytes, tar_shard
from helpers import as_lists, flat
from hypothesis import Phase, given, settings
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


# -- streams read in units, on real ranks (tests/scripts/elastic_streams.py) -----------------------

STREAMS_SCRIPT = Path(__file__).resolve().parent / "scripts" / "elastic_streams.py"
STREAMS_WORLD = 4
STREAMS_LIMIT_S = 150.0
#: Tar shards of 2 to 9 samples (ranks' shares of whole shards differ), Parquet files of row
#: groups of 3 rows (the last of a file shorter).
TAR_SIZES = (5, 9, 2, 7, 4, 8, 3, 6, 9, 5, 2, 7, 8, 4, 9, 6)
PARQUET_ROWS = (10, 14, 7, 12, 9, 11, 13, 8)
ROW_GROUP = 3


def save_points() -> list[float]:
    """Where the 4 ranks save, as fractions of the shortest share: a few points Hypothesis
    chooses, with a fixed seed (the job runs once for all of them, not once per example)."""
    chosen: list[float] = []

    @settings(
        max_examples=4, derandomize=True, database=None, deadline=None, phases=[Phase.generate]
    )
    @given(st.floats(0, 1, exclude_max=True))
    def choose(fraction: float) -> None:
        chosen.append(fraction)

    choose()
    return chosen


@pytest.fixture(scope="module")
def stream_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's report from one run of ``elastic_streams.py`` (index = rank)."""
    from test_distributed import free_port, job_environment, run_job, segments_of

    root = tmp_path_factory.mktemp("elastic-streams")
    tar, parquet = [], []
    for shard, size in enumerate(TAR_SIZES):
        tar.append(str(root / f"s{shard:02d}.tar"))
        Path(tar[-1]).write_bytes(tar_shard(shard, size))
    for file, rows in enumerate(PARQUET_ROWS):
        parquet.append(str(root / f"part-{file}.parquet"))
        Path(parquet[-1]).write_bytes(parquet_bytes(file, rows, ROW_GROUP))
    config = root / "config.json"
    config.write_text(json.dumps({"tar": tar, "parquet": parquet, "cuts": save_points()}))
    port = str(free_port())
    commands = [
        (
            [sys.executable, str(STREAMS_SCRIPT), str(config), str(root / f"rank{rank}.json")],
            job_environment(RANK=str(rank), WORLD_SIZE=str(STREAMS_WORLD), MASTER_PORT=port),
        )
        for rank in range(STREAMS_WORLD)
    ]
    finished = run_job(commands, STREAMS_LIMIT_S, root)
    for rank, done in enumerate(finished):
        assert done.returncode == 0, f"rank {rank} exited {done.returncode}:\n{done.output}"
    reports = [json.loads((root / f"rank{r}.json").read_text()) for r in range(STREAMS_WORLD)]
    pids = [r["pid"] for r in reports] + [p for r in reports for p in r["workers"]]
    assert segments_of(pids) == [], "shared-memory segments left by the ranks"
    assert any(r["workers"] for r in reports)  # worker processes took part
    return reports


@pytest.mark.slow
@pytest.mark.timeout(STREAMS_LIMIT_S + 60)
def test_shares_evened_by_the_footers_take_as_many_steps_before_and_after_a_resume(
    stream_ranks: list[dict[str, Any]],
) -> None:
    """Parquet shares evened up front (``even_shares``): on 4 ranks under equal steps every
    rank takes as many steps, nothing comes twice and what no rank delivered is the remainder
    only (fewer records than ranks, dropped and counted); the rest of a state saved there,
    merged, is evened up too over 2 ranks x 1 worker, 3 x 2 and 4 x 0, under equal steps
    again (as many steps and records on every rank, give or take one record; what none
    delivered is the remainder, dropped and counted)."""
    reports = [r["parquet_even"] for r in stream_ranks]
    for rank, report in enumerate(reports):
        assert "error" not in report, f"rank {rank}:\n{report['error']}"
    every = Counter(every_record("parquet"))
    wholes = [r["whole"] for r in reports]
    delivered = Counter(flat(wholes))
    assert len({len(whole) for whole in wholes}) == 1  # as many steps, all full but the last
    assert max(delivered.values()) == 1
    assert sum((every - delivered).values()) == sum(r["whole_dropped"] for r in reports)
    assert sum((every - delivered).values()) < STREAMS_WORLD  # the remainder at most
    for step in map(str, reports[0]["steps"]):
        head = flat([r["cuts"][step]["head"] for r in reports])
        for name, size in (("2x1", 2), ("3x2", 3), ("4x0", 4)):
            runs = [r["cuts"][step][name] for r in reports[:size]]
            got = Counter(head + flat([run["rest"] for run in runs]))
            assert max(got.values()) == 1, (step, name)  # nothing twice
            lengths = [len(run["rest"]) for run in runs]
            assert len({run["steps"] for run in runs}) == 1, (step, name)
            missing = sum((every - got).values())
            assert missing == sum(run["dropped"] for run in runs), (step, name)
            assert missing < size, (step, name)
            assert max(lengths) - min(lengths) <= 1, (step, name, lengths)
            for run in runs:
                assert run["next"] == run["fresh"], (step, name)


def every_record(kind: str) -> list[Any]:
    if kind == "tar":
        return [f"{s:03d}/{i:04d}" for s, n in enumerate(TAR_SIZES) for i in range(n)]
    return [f * 1000 + i for f, n in enumerate(PARQUET_ROWS) for i in range(n)]


@pytest.mark.slow
@pytest.mark.timeout(STREAMS_LIMIT_S + 60)
@pytest.mark.parametrize("kind", ["tar", "parquet"])
def test_a_stream_saved_on_four_ranks_resumes_exactly_on_two_three_and_four(
    stream_ranks: list[dict[str, Any]], kind: str
) -> None:
    """Saved on 4 ranks x 2 workers at steps Hypothesis chose, every rank's state merged,
    resumed on 2 x 1, 3 x 2 and 4 x 0: across the new ranks the rest of the epoch exactly once
    (with what was taken, every record of the epoch once), nothing taken again, and the next
    epoch that of an uninterrupted run on the new ranks."""
    reports = [r[kind] for r in stream_ranks]
    for rank, report in enumerate(reports):
        assert "error" not in report, f"rank {rank}:\n{report['error']}"
    wholes = [r["whole"] for r in reports]
    assert Counter(flat(wholes)) == Counter(every_record(kind))  # the uninterrupted epoch
    steps = reports[0]["steps"]
    assert steps
    assert all(r["steps"] == steps for r in reports)
    for step in map(str, steps):
        heads = [r["cuts"][step]["head"] for r in reports]
        for whole, head in zip(wholes, heads, strict=True):
            assert len(head) == int(step) * 4  # full batches, as a DDP step takes
            assert Counter(head) <= Counter(whole)
        head = flat(heads)
        for name, size in (("2x1", 2), ("3x2", 3), ("4x0", 4)):
            runs = [r["cuts"][step][name] for r in reports[:size]]
            rest = flat([run["rest"] for run in runs])
            assert not set(head) & set(rest), (kind, step, name)  # nothing taken comes again
            assert Counter(head + rest) == Counter(every_record(kind)), (kind, step, name)
            for run in runs:
                assert run["next"] == run["fresh"], (kind, step, name)
