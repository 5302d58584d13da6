"""Tests of distributed training: a loader under torch.distributed reads its rank's share.

Two kinds of test:

- in this process, without a process group: the ``shard`` argument's checks, the rule that
  nothing changes without a group, and the pure pieces (which sampler is rank-aware, how a
  stream is split among ranks and workers);
- real jobs: ``tests/scripts/dist_ranks.py`` runs as two processes that form a gloo process
  group on 127.0.0.1 (a free port found by binding port 0), builds loaders as a training
  script does and reports what each rank read; ``examples/ddp_train.py`` runs under
  ``python -m torch.distributed.run``. Each job runs once per module (its report is shared by
  the tests that read it), in its own session, killed as a whole at its time limit; afterwards
  no process of it and no shared-memory segment of its processes may be left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import torch.utils.data as tud
from conftest import SHM_DIR, SHM_PREFIX
from datasets import AsyncStream, Range
from helpers import BOUND_S, assert_raises_naming

from aioloader import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    ShardedBatchSampler,
    StreamOrderWarning,
)
from aioloader._sampling._distributed import (
    DEFAULT_SHARE_SEED,
    ORDER_CHECK_ITEMS,
    Shard,
    StreamOrders,
    every_nth,
    every_nth_async,
    first_items_noted,
    item_digest,
    rank_aware,
    stream_items,
    stream_share,
)

ROOT = Path(__file__).resolve().parent.parent
RANKS_SCRIPT = ROOT / "tests" / "scripts" / "dist_ranks.py"
EXAMPLE = ROOT / "examples" / "ddp_train.py"
WORLD = 2

# Limits on a whole job (every process of it): generous for two ranks that each import torch
# and start worker processes on a loaded 2-core machine; a job past it is killed and fails.
RANKS_LIMIT_S = 150.0
EXAMPLE_LIMIT_S = 120.0
# pytest-timeout's limit for the tests whose fixture runs a job: the job's limit, and margin.
JOB_TEST_TIMEOUT_S = 200


# -- the shard argument, without a process group ------------------------------------------------


@pytest.mark.parametrize("bad", ["yes", 1, 0, "auto"])
def test_shard_must_be_none_true_or_false(bad: object) -> None:
    assert_raises_naming(
        lambda: DataLoader(Range(8), shard=bad),
        TypeError,
        ["shard", repr(bad)],
    )


@pytest.mark.parametrize("value", [True, np.True_])
def test_shard_true_needs_a_process_group(value: object) -> None:
    assert_raises_naming(
        lambda: DataLoader(Range(8), shard=value),
        ValueError,
        ["shard=True", "init_process_group"],
    )


def test_without_a_process_group_nothing_changes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="aioloader.distributed")
    for shard in (None, False, np.False_):
        with DataLoader(Range(10), batch_size=4, shuffle=True, seed=0, shard=shard) as loader:
            assert isinstance(loader.sampler, RandomSampler)
            assert sorted(i for batch in loader for i in batch.tolist()) == list(range(10))
        # A plain sampler warns only where ranks exist (filterwarnings=error would fail here).
        DataLoader(Range(10), sampler=SequentialSampler(10), shard=shard)
    assert [r for r in caplog.records if r.name == "aioloader.distributed"] == []


# -- the pure pieces ----------------------------------------------------------------------------


def test_rank_aware_samplers_are_recognised_through_their_wrappers() -> None:
    ours = DistributedSampler(10, num_replicas=2, rank=1)
    theirs: Any = tud.DistributedSampler(range(10), num_replicas=2, rank=1)  # type: ignore[arg-type]
    aware = [
        ours,
        theirs,
        BatchSampler(ours, 4),
        ShardedBatchSampler(BatchSampler(ours, 4), 2),
        tud.BatchSampler(theirs, 4, drop_last=False),
    ]
    unaware = [
        SequentialSampler(10),
        RandomSampler(10, seed=0),
        [0, 1, 2],
        BatchSampler(range(10), 4),
    ]
    assert [rank_aware(s) for s in aware] == [True] * len(aware)
    assert [rank_aware(s) for s in unaware] == [False] * len(unaware)


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_stream_shares_split_a_stream_among_ranks_and_workers(replicas: int, workers: int) -> None:
    for n in range(0, 3 * replicas * workers + 2):
        by_rank: dict[int, list[int]] = {}
        for rank in range(replicas):
            shard = Shard(rank, replicas)
            for worker in range(workers):
                start, step = stream_share(shard, worker, workers)
                by_rank.setdefault(rank, []).extend(every_nth(iter(range(n)), start, step))
            # A rank's share is r, r + R, ... whatever its number of workers (or threads).
            assert sorted(by_rank[rank]) == list(range(rank, n, replicas))
            assert len(by_rank[rank]) == stream_items(shard, n)
            alone = every_nth(iter(range(n)), *stream_share(shard, 0, 1))
            assert list(alone) == list(range(rank, n, replicas))
        everything = [i for share in by_rank.values() for i in share]
        assert sorted(everything) == list(range(n))  # each item once: disjoint and covering
    assert stream_share(None, 1, 3) == (1, 3)  # no shard: the worker split alone, as before


async def test_an_async_share_reads_its_items_and_closes_its_stream() -> None:
    for rank in range(3):
        stream = AsyncStream(10)
        share = every_nth_async(aiter(stream), *stream_share(Shard(rank, 3), 0, 1))
        async with asyncio.timeout(BOUND_S):
            got = [item async for item in share]
        assert got == list(range(rank, 10, 3))
        assert stream.closed == 1
    stream = AsyncStream(10)
    share = every_nth_async(aiter(stream), 1, 3)
    assert isinstance(share, AsyncGenerator)
    assert await anext(share) == 1
    await share.aclose()  # taken early: the dataset's stream is closed with it
    assert stream.closed == 1
    whole = aiter(AsyncStream(3))
    assert every_nth_async(whole, 0, 1) is whole  # one reader: no wrapper at all


def test_item_digests_tell_data_apart_and_not_the_process_it_lives_in() -> None:
    # The same data in another process is another object at another address: the digest reads
    # values (numbers, strings, the head of arrays and tensors), never addresses.
    same = [
        (3, 3),
        ("a.jpg", "a.jpg"),
        ({"x": np.arange(6), "y": torch.ones(2)}, {"x": np.arange(6), "y": torch.ones(2)}),
        ((np.zeros(3, np.float32), 1), (np.zeros(3, np.float32), 1)),
        (object(), object()),  # another object of the type: by type alone
        (np.array([object()]), np.array([object()])),  # object arrays: shape and dtype
        (torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16)),
    ]
    for one, other in same:
        assert item_digest(one) == item_digest(other), one
    differ = [
        (3, 4),
        ("a.jpg", "b.jpg"),
        (np.arange(6), np.arange(1, 7)),
        (torch.arange(3), torch.arange(1, 4)),
        (np.zeros(3, np.float32), np.zeros(3, np.float64)),
        (np.zeros(3), np.zeros(4)),
        ({"x": 1}, {"x": 2}),
    ]
    for one, other in differ:
        assert item_digest(one) != item_digest(other), one


@dataclass
class _Part:
    """Has a ``shape`` and a ``dtype`` that are not an array's."""

    shape: int
    dtype: str


def test_item_digests_read_a_bounded_head_and_never_fail() -> None:
    # The head only: the first 64 leaves, and the first 64 bytes, characters or elements of
    # each (with the length or shape), so a 50 MB blob or a million-leaf list costs the same.
    assert item_digest([*range(64), 1]) == item_digest([*range(64), 2])
    assert item_digest(b"x" * 100 + b"a") == item_digest(b"x" * 100 + b"b")
    assert item_digest(b"x" * 100) != item_digest(b"x" * 101)
    wide = np.zeros((100, 100), np.float32)
    wide[0, 1] = 1.0
    assert item_digest(wide) != item_digest(np.zeros((100, 100), np.float32))  # its first row
    assert item_digest(wide.T) == item_digest(np.ascontiguousarray(wide.T))  # no copy needed
    assert item_digest(_Part(3, "poly")) == item_digest(_Part(3, "poly"))  # by type, no error


def test_the_head_of_a_stream_is_noted_as_it_passes() -> None:
    notes: list[int] = []
    passed = first_items_noted(iter(range(20)), notes)
    assert list(every_nth(passed, 1, 2)) == list(range(1, 20, 2))  # the stream is unchanged
    assert notes == [item_digest(i) for i in range(ORDER_CHECK_ITEMS)]


def test_stream_orders_warn_once_when_the_workers_saw_different_heads() -> None:
    heads = [tuple(item_digest(i) for i in order) for order in ([0, 1, 2], [0, 1, 2, 3], [0])]
    agreeing = StreamOrders("Stream", 3)
    for head in heads:  # the same head, as far as each read it: nothing to say
        agreeing.note(head)
    orders = StreamOrders("Stream", 2)
    orders.note(heads[0])
    with pytest.warns(StreamOrderWarning, match="each of the 2 workers reads the whole stream"):
        orders.note(tuple(item_digest(i) for i in (0, 2, 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        orders.note(tuple(item_digest(i) for i in (5, 6)))  # told once: no second warning


def test_len_after_a_resume_on_other_ranks_counts_the_epoch_it_resumes() -> None:
    # Saved by rank 0 of 4 after one batch (the 4 ranks took 16 of 45 samples); loaded on
    # rank 0 of 2, the rest (29) is shared out: 15 samples, 4 batches of 4, not a whole
    # epoch's 6. len() is asked before the first batch, as Lightning's progress bar does.
    def make(ranks: int) -> DataLoader:
        sampler = DistributedSampler(45, num_replicas=ranks, rank=0, seed=1)
        return DataLoader(Range(45), batch_size=4, sampler=sampler)

    with make(4) as saver:
        it = iter(saver)
        next(it)
        state = saver.state_dict()
        del it
    with make(2) as resumed:
        assert len(resumed) == 6  # a whole epoch on 2 ranks
        resumed.load_state_dict(state)
        assert len(resumed) == 4
        assert len(list(resumed)) == 4
        assert len(resumed) == 6  # the next epoch is whole again
    with make(4) as same:
        same.load_state_dict(state)
        assert len(same) == 3  # the same ranks: the whole epoch, one batch of it done
        assert len(list(same)) == 2


# -- real process groups: the harness -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Finished:
    """One process of a job, once it ended."""

    pid: int
    returncode: int
    output: str


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback_interface() -> str:
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return str(name)
    pytest.skip("no loopback interface with 127.0.0.1")


def job_environment(**extra: str) -> dict[str, str]:
    """The environment of a job's process: gloo on loopback only, this tree's package first."""
    env = dict(os.environ)
    paths = [str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")]
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in paths if p),
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME=loopback_interface(),  # gloo listens there only
        OMP_NUM_THREADS="1",
        **extra,
    )
    return env


def session_processes(sids: set[int]) -> list[int]:
    """Live processes (zombies aside) of the given sessions."""
    left = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(process.pid) in sids and process.status() != psutil.STATUS_ZOMBIE:
                left.append(process.pid)
    return left


def run_job(
    commands: list[tuple[list[str], dict[str, str]]], limit_s: float, logs: Path
) -> list[Finished]:
    """Run ``commands`` at once, each in its own session; kill every process of them that is
    still there at ``limit_s``, or after a grace period once all ended."""
    processes: list[subprocess.Popen[bytes]] = []
    outputs = []
    try:
        for k, (argv, env) in enumerate(commands):
            output = logs / f"process{k}.log"
            outputs.append(output)
            with output.open("wb") as sink:
                processes.append(
                    subprocess.Popen(
                        argv,
                        env=env,
                        cwd=ROOT,
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + limit_s
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.0, deadline - time.monotonic()))
    finally:
        sids = {p.pid for p in processes}
        for process in processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        # Workers and forkservers of a rank that ended exit on their own, promptly.
        grace = time.monotonic() + 5.0
        while (left := session_processes(sids)) and time.monotonic() < grace:
            time.sleep(0.1)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the job left behind: {left}"
    return [
        Finished(p.pid, p.returncode, out.read_text(errors="replace"))
        for p, out in zip(processes, outputs, strict=True)
    ]


def segments_of(pids: list[int]) -> list[str]:
    prefixes = tuple(f"{SHM_PREFIX}{pid}_" for pid in pids)
    return [name for name in os.listdir(SHM_DIR) if name.startswith(prefixes)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's report from one run of ``dist_ranks.py`` (index = rank)."""
    logs = tmp_path_factory.mktemp("ranks")
    port = str(free_port())
    commands = [
        (
            [sys.executable, str(RANKS_SCRIPT), str(logs / f"rank{rank}.json")],
            job_environment(
                RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_PORT=port
            ),
        )
        for rank in range(WORLD)
    ]
    finished = run_job(commands, RANKS_LIMIT_S, logs)
    for rank, done in enumerate(finished):
        assert done.returncode == 0, f"rank {rank} exited {done.returncode}:\n{done.output}"
    reports = [json.loads((logs / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    pids = [r["pid"] for r in reports] + [p for r in reports for p in r["worker_pids"]]
    assert segments_of(pids) == [], "shared-memory segments left by the ranks"
    return reports


def case(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Each rank's report of one case, after checking that no rank's case failed."""
    reports = [r[name] for r in ranks]
    for rank, report in enumerate(reports):
        assert "error" not in report, f"rank {rank}, case {name}:\n{report['error']}"
    return reports


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def assert_disjoint_cover(shares: list[list[int]], n: int) -> None:
    """The ranks' shares read each of ``n`` items exactly once."""
    assert sorted(i for share in shares for i in share) == list(range(n))


# -- real process groups: map-style data --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_ranks_finish_and_leave_nothing(ranks: list[dict[str, Any]]) -> None:
    # The fixture checked the processes and segments; here: the job was a real group of two.
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, WORLD), (1, WORLD)]
    assert all(r["worker_pids"] for r in ranks)  # worker processes took part


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_a_map_dataset_is_sharded_like_a_distributed_sampler(ranks: list[dict[str, Any]]) -> None:
    reports = case(ranks, "auto")
    n, per_rank = 23, 12  # 23 samples on 2 ranks: padded by wrapping to 24
    assert [r["sampler"] for r in reports] == ["DistributedSampler"] * WORLD
    assert [r["len"] for r in reports] == [3] * WORLD
    for epoch in range(2):
        shares = [flat(r["epochs"][epoch]) for r in reports]
        assert [len(r["epochs"][epoch]) for r in reports] == [3] * WORLD  # as many batches
        assert [len(s) for s in shares] == [per_rank] * WORLD
        assert set(shares[0]) | set(shares[1]) == set(range(n))
        assert len(shares[0]) + len(shares[1]) - len(set(shares[0]) | set(shares[1])) == 1
    # Reshuffled per epoch, the same way on every rank: no seed given, the share's order comes
    # from the default share seed (each rank's own loader seed differs: it was drawn per rank).
    assert [r["epochs"][0] != r["epochs"][1] for r in reports] == [True] * WORLD
    assert [r["again0"] == r["epochs"][0] for r in reports] == [True] * WORLD
    assert [r["sampler_seed"] for r in reports] == [DEFAULT_SHARE_SEED] * WORLD


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_the_share_is_logged_once_at_info(ranks: list[dict[str, Any]]) -> None:
    for rank, report in enumerate(case(ranks, "auto")):
        assert report["warnings"] == []
        assert len(report["log"]) == 1, report["log"]
        message = report["log"][0]
        assert message.startswith("INFO ")
        assert f"rank {rank} of world size {WORLD}" in message
        assert "Range" in message
        assert "shard=False" in message


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_without_shuffle_the_shares_are_torchs(ranks: list[dict[str, Any]]) -> None:
    for rank, report in enumerate(case(ranks, "sequential")):
        theirs: list[int] = list(tud.DistributedSampler(range(11), WORLD, rank, shuffle=False))  # type: ignore[arg-type]
        assert flat(report["epoch"]) == theirs
        assert report["len"] == len(report["epoch"]) == 3


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_the_given_seed_shuffles_and_set_epoch_picks_the_epoch(ranks: list[dict[str, Any]]) -> None:
    reports = case(ranks, "seeded")
    assert [r["seed"] for r in reports] == [100, 100]
    for epoch in ("epoch5", "epoch6"):
        assert_disjoint_cover([flat(r[epoch]) for r in reports], 40)
    for report in reports:
        # seed=100: every rank shuffles as a loader seeded 100 does at epoch 5
        assert report["epoch5"] == report["fresh5"]
        assert report["epoch5"] != report["epoch6"]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_a_shuffled_loader_built_on_one_rank_only_does_not_wait_for_the_others(
    ranks: list[dict[str, Any]],
) -> None:
    """Nothing at construction talks to the other ranks (evaluation on rank 0 is common)."""
    reports = case(ranks, "rank0_only")
    share = flat(reports[0]["epoch"])
    assert len(share) == 5  # rank 0's share of 10 samples, as the log line says
    assert len(set(share)) == 5


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_drop_last_trims_the_tail_instead_of_padding(ranks: list[dict[str, Any]]) -> None:
    reports = case(ranks, "drop_last")
    # 23 samples: 11 a rank (torch's drop_last=True), then 2 full batches of 4 each.
    assert [r["len"] for r in reports] == [2, 2]
    assert [[len(b) for b in r["epoch"]] for r in reports] == [[4, 4], [4, 4]]
    assert not set(flat(reports[0]["epoch"])) & set(flat(reports[1]["epoch"]))


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_ranks_step_together_through_every_epoch(ranks: list[dict[str, Any]]) -> None:
    # An all_reduce per batch (as DDP's backward) over 2 epochs of 29 samples, 3 a batch.
    assert [r["steps"] for r in case(ranks, "step_locked")] == [10, 10]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_resume_is_exact_on_each_rank(ranks: list[dict[str, Any]]) -> None:
    reports = case(ranks, "resume")
    for report in reports:
        assert report["taken"] + report["rest"] == report["whole"]
        assert report["rest_from_rank0"] == report["rest"]
        assert len(report["rest"]) == 3
    assert_disjoint_cover([flat(r["whole"]) for r in reports], 40)


# -- real process groups: samplers of the user's, the switch ------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_a_sampler_that_is_not_rank_aware_warns_once(ranks: list[dict[str, Any]]) -> None:
    for name, argument, n in (
        ("plain_sampler", "sampler=", 12),
        ("plain_batch_sampler", "batch_sampler=", 4),
    ):
        for report in case(ranks, name):
            assert len(report["warnings"]) == 1, report["warnings"]
            warning = report["warnings"][0]
            assert warning.startswith("UserWarning: " + argument)
            for needle in (
                "not rank-aware",
                "every rank will read all of it",
                "DistributedSampler",
                "shard=False",
            ):
                assert needle in warning
            assert sorted(flat(report["epoch"])) == list(range(n))  # used as it is
            assert report["log"] == []


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_rank_aware_samplers_are_used_as_they_are(ranks: list[dict[str, Any]]) -> None:
    reports = case(ranks, "rank_aware")
    for name in ("torch", "ours", "ours_batches"):
        assert_disjoint_cover([r[name] for r in reports], 12)
    for report in reports:
        assert report["warnings"] == []
        assert report["log"] == []


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_shard_false_reads_everything_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for report in case(ranks, "shard_off"):
        assert sorted(report["epoch"]) == list(range(12))
        assert report["stream"] == list(range(12))
        assert report["warnings"] == []
        assert report["log"] == []


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_shard_true_refuses_a_sampler_it_cannot_shard(ranks: list[dict[str, Any]]) -> None:
    for report in case(ranks, "shard_true_refuses"):
        assert "shard=True" in report["refused"]
        assert "sampler=[0, 1, 2]" in report["refused"]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_a_loader_built_before_the_group_takes_its_share_at_its_first_epoch(
    ranks: list[dict[str, Any]],
) -> None:
    """A script builds the loader, then Lightning's fit() (or accelerate) makes the group: the
    share is decided once the group exists, at the first len() or epoch."""
    built = case(ranks, "early_build")
    assert [r["warnings"] for r in built] == [[], []]
    assert [flat(r["before"]) for r in built] == [list(range(10))] * 2
    reports = case(ranks, "early")
    assert [r["len"] for r in reports] == [1, 1]  # 10 samples, 5 a rank, batches of 5
    for epoch in range(2):
        assert_disjoint_cover([flat(r["epochs"][epoch]) for r in reports], 10)
        # A stream too, though its workers started before the group (at construction).
        assert_disjoint_cover([r["stream_epochs"][epoch] for r in reports], 24)
    # The other loader ran an epoch before the group existed: it keeps reading everything
    # (switching mid-run would split what it reads), and says so once.
    for report in reports:
        assert len(report["warnings"]) == 1, report["warnings"]  # once, not every epoch
        assert "before torch.distributed.init_process_group" in report["warnings"][0]
        assert "shard=False" in report["warnings"][0]
        assert [flat(e) for e in report["started_epochs"]] == [list(range(10))] * 2


# -- real process groups: streams ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_streams_are_split_among_ranks_and_workers(ranks: list[dict[str, Any]]) -> None:
    reports = case(ranks, "streams")
    for name in ("workers", "self_sharded", "shuffled", "thread"):
        for epoch in range(2):
            assert_disjoint_cover([r[name][epoch] for r in reports], 37)
    assert_disjoint_cover([r["async"] for r in reports], 37)
    for rank, report in enumerate(reports):
        # Without workers, or with: rank r reads items r, r + 2, ... (a self-sharded stream's
        # split follows its own per-worker order instead).
        assert sorted(report["workers"][0]) == sorted(report["thread"][0])
        assert sorted(report["thread"][0]) == list(range(rank, 37, WORLD))
        assert report["async"] == list(range(rank, 37, WORLD))
        # len() of a stream that has one counts this rank's share: 19 or 18 items, 5 batches
        assert report["counted_len"] == report["counted_batches"] == 5
        assert len(report["log"]) == 6  # one line per loader made
        assert all(f"rank {rank} of world size" in m for m in report["log"])


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_tar_shards_are_read_once_across_ranks_and_workers(ranks: list[dict[str, Any]]) -> None:
    from datasets import tar_keys

    reports = case(ranks, "tar")
    every = tar_keys(7, lambda shard: 3 + shard % 4)
    for epoch in range(2):
        shares = [r["epochs"][epoch] for r in reports]
        assert sorted(shares[0] + shares[1]) == every  # each sample once, on one rank
        for share in shares:  # whole shards: a rank has all of a shard's samples or none
            shards = {key.split("/")[0] for key in share}
            assert len(share) == sum(3 + int(s) % 4 for s in shards)
    assert reports[0]["epochs"][0] != reports[0]["epochs"][1]  # reshuffled each epoch
    for rank, report in enumerate(reports):  # decoded by worker processes, not the rank
        assert 1 <= len(report["decoded_by"]) <= 2, rank
        assert ranks[rank]["pid"] not in report["decoded_by"]
        # resumed on its rank, under another number of workers: the rest of its share exactly
        assert report["head"] + report["rest"] == report["epochs"][0], rank


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_parquet_row_groups_are_read_once_across_ranks_and_workers(
    ranks: list[dict[str, Any]],
) -> None:
    reports = case(ranks, "parquet")
    rows = (5, 7, 3, 9)  # per file, in row groups of 3 (dist_ranks.PARQUET_ROWS)
    every = sorted(f * 1000 + i for f, n in enumerate(rows) for i in range(n))
    for epoch in range(2):
        shares = [r["epochs"][epoch] for r in reports]
        assert sorted(shares[0] + shares[1]) == every  # each row once, on one rank
        for share in shares:  # whole row groups: a rank has all of a row group's rows or none
            groups: dict[tuple[int, int], int] = {}
            for i in share:
                key = (i // 1000, i % 1000 // 3)
                groups[key] = groups.get(key, 0) + 1
            assert all(n == min(3, rows[f] - g * 3) for (f, g), n in groups.items())
    assert reports[0]["epochs"][0] != reports[0]["epochs"][1]  # reshuffled each epoch
    for rank, report in enumerate(reports):  # decoded by worker processes, not the rank
        assert 1 <= len(report["decoded_by"]) <= 2, rank
        assert ranks[rank]["pid"] not in report["decoded_by"]
        # resumed on its rank, under another number of workers: the rest of its share exactly
        assert report["head"] + report["rest"] == report["epochs"][0], rank


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_worker_randomness_differs_between_ranks_and_rank_0_keeps_its_seeds(
    ranks: list[dict[str, Any]],
) -> None:
    # Every rank has the same seed= and numbers its batches from 0: without the rank in the
    # worker seeds, batch b drew the same augmentations on every rank.
    draws = [report["draws"] for report in case(ranks, "augment")]
    assert len(draws[0]) == len(draws[1]) == 2
    for batch0, batch1 in zip(*draws, strict=True):
        assert batch0 != batch1
    # Rank 0's worker seeds are those of the same loader without a process group.
    alone = case(ranks, "early_build")[0]["draws_before"]
    assert draws[0] == alone[:2]


# -- the example under torchrun -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_the_ddp_example_trains_on_disjoint_covering_shares(tmp_path: Path) -> None:
    samples, epochs = 30, 2
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={WORLD}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(EXAMPLE),
        f"--samples={samples}",
        "--batch-size=4",
        f"--epochs={epochs}",
        "--workers=1",  # a worker process per rank, started under torchrun
        "--indices",
    ]
    (done,) = run_job([(argv, job_environment())], EXAMPLE_LIMIT_S, tmp_path)
    assert done.returncode == 0, done.output
    shares: dict[tuple[int, int], list[int]] = {}
    pids = set()
    for line in done.output.splitlines():
        if line.startswith("share "):
            try:
                share = json.loads(line.removeprefix("share "))
            except ValueError:
                pytest.fail(f"a mangled share line {line!r} in:\n{done.output}")
            assert share["world"] == WORLD
            shares[(share["epoch"], share["rank"])] = share["indices"]
            pids.add(share["pid"])
    assert segments_of(sorted(pids)) == [], "shared-memory segments left by the ranks"
    assert sorted(shares) == [(e, r) for e in range(epochs) for r in range(WORLD)], done.output
    for epoch in range(epochs):
        assert_disjoint_cover([shares[(epoch, r)] for r in range(WORLD)], samples)
    assert shares[(0, 0)] != shares[(1, 0)]  # reshuffled per epoch
    for rank in range(WORLD):
        assert f"rank {rank}/{WORLD} epoch {epochs - 1}: 15 of {samples} samples" in done.output
