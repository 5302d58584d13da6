"""Equal steps on every rank, the slow rank named, data-parallel groups.

- in this process: the arguments' checks, and the agreement's sequencing (which steps run a
  collective, in which order) with the collective swapped for a recorder;
- a real job: ``tests/scripts/dist_lockstep.py`` as four gloo ranks on 127.0.0.1 (the harness
  of ``test_distributed``: each process in its own session, killed as a whole at the job's
  limit, nothing left behind), run once for the module.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from datasets import Range, Stream
from helpers import assert_raises_naming
from test_distributed import (
    JOB_TEST_TIMEOUT_S,
    ROOT,
    free_port,
    job_environment,
    run_job,
    segments_of,
)

from aioloader import DataLoader, LoaderTimeoutError
from aioloader._sampling import EpochAgreement, Lockstep
from aioloader.distributed import gather_statistics

SCRIPT = ROOT / "tests" / "scripts" / "dist_lockstep.py"
EXIT_SCRIPT = ROOT / "tests" / "scripts" / "dist_exit.py"
WORLD = 4
LIMIT_S = 240.0
EXIT_LIMIT_S = 120.0


# -- without a process group ----------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["yes", 1, "auto"])
def test_equal_steps_must_be_none_true_or_false(bad: object) -> None:
    assert_raises_naming(
        lambda: DataLoader(Stream(8), equal_steps=bad),  # type: ignore[arg-type]
        TypeError,
        ["equal_steps", repr(bad)],
    )


@pytest.mark.parametrize("bad", ["keep", None, 1, "Carry"])
def test_leftover_must_be_carry_or_drop(bad: object) -> None:
    assert_raises_naming(
        lambda: DataLoader(Stream(8), leftover=bad),  # type: ignore[arg-type]
        ValueError,
        ["leftover", repr(bad), "carry", "drop"],
    )


def test_equal_steps_true_needs_a_stream_read_in_shares() -> None:
    assert_raises_naming(
        lambda: DataLoader(Stream(8), equal_steps=True, shard=False),
        ValueError,
        ["equal_steps=True", "Stream", "shard=False"],
    )


def test_equal_steps_true_on_map_style_data_is_refused_at_construction() -> None:
    assert_raises_naming(
        lambda: DataLoader(Range(8), equal_steps=True),
        ValueError,
        ["equal_steps=True", "Range", "map-style"],
    )


def test_equal_steps_true_without_a_process_group_is_refused_at_the_first_epoch() -> None:
    # Built before init_process_group is allowed (the group may come later); an epoch begun
    # with none cannot be read in shares, so True cannot apply.
    with DataLoader(Stream(8), batch_size=4, equal_steps=True) as loader:
        assert_raises_naming(
            lambda: next(iter(loader)),
            ValueError,
            ["equal_steps=True", "Stream", "no process group"],
        )


def test_without_a_process_group_a_stream_is_read_as_before() -> None:
    with DataLoader(Stream(10), batch_size=4) as loader:
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        stats = loader.statistics()
    assert (stats.leftover_batches, stats.dropped_batches) == (0, 0)
    assert [t.name for t in threading.enumerate() if "equal-steps" in t.name] == []


def test_gather_statistics_needs_a_process_group() -> None:
    with DataLoader(Stream(4)) as loader:
        assert_raises_naming(
            lambda: gather_statistics(loader), RuntimeError, ["init_process_group"]
        )


class Recorded:
    """Stands in for the all-reduce: records each step's ``have``; the "others" have
    ``others`` batches, and are at the same epoch and step (or at ``drift`` steps on)."""

    def __init__(self, others: int, drift: int = 0) -> None:
        self.others = others
        self.drift = drift
        self.calls: list[int] = []

    def __call__(self, values: list[int]) -> list[int]:
        have, epoch, _, step, _ = values
        self.calls.append(have)
        theirs = step + self.drift
        return [
            min(have, int(step < self.others)),
            epoch,
            -epoch,
            min(step, theirs),
            -max(step, theirs),
        ]


def verdict(agreement: EpochAgreement, step: int) -> bool:
    """The verdict of ``step``, once its job ran."""
    future = agreement.verdict(step)
    assert future is not None, f"step {step} was not offered"
    return future.result(timeout=10)


def agreement_with(record: Recorded) -> tuple[Lockstep, EpochAgreement]:
    lockstep = Lockstep((0, 1), "carry", all_min=record)
    return lockstep, lockstep.begin(0)


def test_steps_are_agreed_in_order_and_none_after_the_end() -> None:
    # This rank has 5 batches, the others 2: steps 0 and 1 pass, step 2 ends the epoch; steps
    # 3 and 4, offered ahead, run no collective (the others never run theirs).
    record = Recorded(others=2)
    lockstep, agreement = agreement_with(record)
    agreement.offer(5, complete=True)
    verdicts = [verdict(agreement, step) for step in range(6)]
    assert verdicts == [True, True, False, False, False, False]
    assert record.calls == [1, 1, 1]
    assert agreement.end == 2
    lockstep.close()


def test_a_short_share_offers_0_at_its_end_and_an_epoch_closed_early_gives_up() -> None:
    record = Recorded(others=9)
    lockstep, agreement = agreement_with(record)
    agreement.offer(2, complete=False)
    agreement.offer(3, complete=True)
    assert [verdict(agreement, s) for s in range(4)] == [True] * 3 + [False]
    assert record.calls == [1, 1, 1, 0]
    # The next epoch is closed after one batch: it offers -1 ("left") at its next step, once.
    nxt = lockstep.begin(1)
    nxt.offer(1, complete=False)
    nxt.give_up()
    nxt.give_up()
    assert verdict(nxt, 1) is False
    assert record.calls == [1, 1, 1, 0, 1, -1]
    assert (agreement.left_elsewhere, nxt.left_elsewhere) == (False, False)  # it left itself
    lockstep.close()


def test_an_epoch_ended_by_another_rank_that_left_it_says_so() -> None:
    def others_left_at_step_1(values: list[int]) -> list[int]:
        have, epoch, _, step, _ = values
        return [min(have, -1 if step == 1 else 1), epoch, -epoch, step, -step]

    lockstep = Lockstep((0, 1), "carry", all_min=others_left_at_step_1)
    agreement = lockstep.begin(0)
    agreement.offer(3, complete=True)
    assert [verdict(agreement, s) for s in range(3)] == [True, False, False]
    assert agreement.end == 1
    assert agreement.left_elsewhere is True
    lockstep.close()


def test_a_step_paired_with_another_step_fails_and_every_later_one_with_its_cause() -> None:
    # The others run a step ahead (their iterations drifted): the first pairing fails,
    # naming both steps; the agreement is broken: a later step, of this epoch or the next,
    # fails at once with that error as its cause and runs no collective.
    record = Recorded(others=9, drift=1)
    lockstep, agreement = agreement_with(record)
    agreement.offer(2, complete=False)
    with pytest.raises(RuntimeError) as first:
        verdict(agreement, 0)
    for part in ("epoch 0, step 0", "epochs 0, steps 0 to 1", "drifted apart", "equal_steps=False"):
        assert part in str(first.value), str(first.value)
    nxt = lockstep.begin(1)
    nxt.offer(1, complete=False)
    for later in ((agreement, 1), (nxt, 0)):
        with pytest.raises(RuntimeError, match="broke earlier") as again:
            verdict(*later)
        assert again.value.__cause__ is first.value
    assert record.calls == [1]
    lockstep.close()


def test_a_collective_that_fails_at_once_is_not_reported_as_a_timeout() -> None:
    calls = []

    def closed_by_peer(values: list[int]) -> list[int]:
        calls.append(values)
        raise ConnectionResetError("Connection closed by peer [127.0.0.1]:4242")

    lockstep = Lockstep((0, 1), "carry", timeout_s=60, all_min=closed_by_peer)
    agreement = lockstep.begin(0)
    agreement.offer(1, complete=False)
    with pytest.raises(RuntimeError) as info:
        verdict(agreement, 0)
    message = str(info.value)
    assert "did not join" not in message, message
    for part in ("failed after 0.", "60 s", "ConnectionResetError", "closed by peer"):
        assert part in message, message
    assert isinstance(info.value.__cause__, ConnectionResetError)
    # Never retried: the next epoch fails at once, with the first failure as its cause.
    nxt = lockstep.begin(1)
    nxt.offer(1, complete=False)
    with pytest.raises(RuntimeError, match="broke earlier") as again:
        verdict(nxt, 0)
    assert again.value.__cause__ is info.value
    assert len(calls) == 1
    lockstep.close()


def test_a_collective_that_ran_out_its_bound_is_reported_as_a_timeout() -> None:
    def timed_out(values: list[int]) -> list[int]:
        time.sleep(0.05)  # the bound, as torch's own timeout would take it
        raise RuntimeError("[gloo] Timed out waiting 50ms for recv operation to complete")

    lockstep = Lockstep((0, 1), "carry", timeout_s=0.05, all_min=timed_out)
    agreement = lockstep.begin(3)
    agreement.offer(1, complete=False)
    with pytest.raises(RuntimeError) as info:
        verdict(agreement, 0)
    for part in ("epoch 3, step 0", "did not join", "within 0.05 s", "equal_steps=False"):
        assert part in str(info.value), str(info.value)
    lockstep.close()


def test_the_consumer_waits_for_a_verdict_at_most_the_bound_plus_the_margin() -> None:
    # The thread is stuck in its collective (past its own bound): the consumer's wait ends
    # at the deadline with an error naming the epoch, the step and the bound. The deadline is
    # already over (bound 0 + margin 0): no time is waited for it.
    release = threading.Event()

    def stuck(values: list[int]) -> list[int]:
        release.wait(10)
        return values

    lockstep = Lockstep((0, 1), "carry", timeout_s=0.0, all_min=stuck, margin_s=0.0)
    agreement = lockstep.begin(2)
    agreement.offer(1, complete=False)

    async def consumer() -> None:
        offered = agreement.verdict(0)
        assert offered is not None
        await agreement.wait(0, asyncio.wrap_future(offered), time.monotonic())

    try:
        with pytest.raises(LoaderTimeoutError) as info:
            asyncio.run(consumer())
        assert isinstance(info.value, TimeoutError)
        assert isinstance(info.value, RuntimeError)
        for part in ("epoch 2, step 0", "no verdict", "within 0 s", "equal_steps=False"):
            assert part in str(info.value), str(info.value)
        assert lockstep.broken is info.value
    finally:
        release.set()
        lockstep.close()


def test_a_verdict_within_the_deadline_is_waited_for() -> None:
    lockstep = Lockstep((0, 1), "carry", all_min=Recorded(others=9))
    agreement = lockstep.begin(0)
    agreement.offer(1, complete=False)

    async def consumer() -> bool:
        offered = agreement.verdict(0)
        assert offered is not None
        future = asyncio.wrap_future(offered)
        await agreement.wait(0, future, time.monotonic())
        return future.result()

    assert asyncio.run(consumer()) is True
    assert lockstep.broken is None
    lockstep.close()


def test_the_rendezvous_reaches_the_store_within_the_bound() -> None:
    # The store's server is gone (its rank died); the store's own timeout is 30 s, the
    # agreement's 2 s: the rendezvous fails at once (refused), not after 30 s.
    import torch.distributed as dist

    TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    del server
    gc.collect()
    lockstep = Lockstep((0, 1), "carry", timeout_s=2.0, store=client)
    agreement = lockstep.begin(0)
    agreement.offer(1, complete=False)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        verdict(agreement, 0)
    assert time.monotonic() - started < 10, "waited under the store's own timeout"
    assert "ConnectionRefusedError" in str(info.value), str(info.value)
    assert isinstance(info.value.__cause__, ConnectionRefusedError)
    lockstep.close()


def test_the_exit_hook_waits_once_for_everything_up_to_its_deadline() -> None:
    # A step that never returns: closing waits for the thread, then the hook joins it; both
    # waits together end at the one deadline (they took twice the wait before).
    release = threading.Event()

    def stuck(values: list[int]) -> list[int]:
        release.wait(10)
        return values

    lockstep = Lockstep((0, 1), "carry", all_min=stuck)
    lockstep.begin(0).offer(1, complete=False)
    wait_s = 1.0
    started = time.monotonic()
    try:
        assert lockstep.finish_at_exit(started + wait_s) is False  # the thread is still stuck
        elapsed = time.monotonic() - started
    finally:
        release.set()
    assert wait_s * 0.9 <= elapsed < wait_s * 1.5, elapsed


# -- a real job of two ranks that exit with their loaders open ----------------------------------


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S)
def test_a_rank_that_exits_with_its_stream_loader_open_exits_cleanly(tmp_path: Path) -> None:
    """Rank 1 reads to the agreed end after rank 0 left, and exits without closing its
    loader: the exit hook closes the agreement first; no SIGABRT at the interpreter's end."""
    port = str(free_port())
    commands = [
        (
            [sys.executable, str(EXIT_SCRIPT)],
            job_environment(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_PORT=port),
        )
        for rank in range(2)
    ]
    finished = run_job(commands, EXIT_LIMIT_S, tmp_path)
    for rank, done in enumerate(finished):
        assert done.returncode == 0, f"rank {rank} exited {done.returncode}:\n{done.output}"
        assert "terminate called" not in done.output, done.output
    assert "rank 1 leaves, its loader open" in finished[1].output, finished[1].output


# -- a real job of four ranks -------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("lockstep")
    port = str(free_port())
    commands = [
        (
            [sys.executable, str(SCRIPT), str(logs / f"rank{rank}.json")],
            job_environment(
                RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_PORT=port
            ),
        )
        for rank in range(WORLD)
    ]
    finished = run_job(commands, LIMIT_S, logs)
    for rank, done in enumerate(finished):
        assert done.returncode == 0, f"rank {rank} exited {done.returncode}:\n{done.output}"
    reports = [json.loads((logs / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    pids = [r["pid"] for r in reports] + [p for r in reports for p in r["workers"]]
    assert segments_of(pids) == [], "shared-memory segments left by the ranks"
    return reports


def case(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    reports = [r[name] for r in ranks]
    for rank, report in enumerate(reports):
        assert "error" not in report, f"rank {rank}, case {name}:\n{report['error']}"
    return reports


def share(rank: int) -> list[int]:
    """Rank ``rank``'s share of its copy of the uneven stream (dist_lockstep.UNEVEN)."""
    return list(range(rank, (40, 13, 27, 8)[rank], WORLD))


def batches(rank: int, workers: int) -> list[list[int]]:
    """The batches of 4 of rank ``rank``'s share in the order the loader yields them: reader
    ``k`` of ``W`` keeps every ``W``-th item of the share from the ``k``-th, and the readers'
    batches come in turn (a reader whose stream ended is skipped)."""
    readers = max(1, workers)
    chunks = []
    for k in range(readers):
        items = share(rank)[k::readers]
        chunks.append([items[i : i + 4] for i in range(0, len(items), 4)])
    return [c[j] for j in range(max(map(len, chunks))) for c in chunks if j < len(c)]


def flat(batches: list[list[Any]]) -> list[Any]:
    return [i for batch in batches for i in batch]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_an_uneven_stream_ends_every_epoch_at_the_same_step(ranks: list[dict[str, Any]]) -> None:
    """Shares of 10, 3, 7 and 2 items under DDP: every rank's epoch ends at the step of the
    shortest share (in batches of 4), nothing is read twice, what a rank read past the end is
    counted and comes first in the next epoch (or is counted as dropped); no hang."""
    reports = case(ranks, "uneven")
    for name, workers in (("thread_carry", 0), ("workers_carry", 2), ("thread_drop", 0)):
        runs = [r[name] for r in reports]
        expected = [batches(rank, workers) for rank in range(WORLD)]
        steps = min(map(len, expected))
        assert steps == (1 if workers == 0 else 2)
        for epoch in range(2):
            assert [len(run["epochs"][epoch]) for run in runs] == [steps] * WORLD, name
        for rank, run in enumerate(runs):
            mine = expected[rank]
            assert run["epochs"][0] == mine[:steps], (name, rank)  # the head, each item once
            if name.endswith("carry"):
                # What was read past the end comes first in the next epoch: nothing is lost.
                following = mine[steps] if len(mine) > steps else mine[0]
                assert run["epochs"][1][0] == following, (name, rank)
                # Carried, up to prefetch batches (the rest counted as dropped: the capped
                # case): so never all of what was read past an end.
                assert run["dropped_batches"] < max(1, run["leftover_batches"]), (name, run)
            else:
                assert run["epochs"][1][0] == mine[0], name  # a fresh epoch
                assert (run["dropped_batches"], run["dropped_samples"]) == (
                    run["leftover_batches"],
                    run["leftover_samples"],
                )
            if len(mine) > steps:
                # It had batch `steps` ready when the ranks agreed (it offered that step
                # only then): read past the end, and counted.
                assert run["leftover_batches"] >= 1, (name, rank)
                assert run["leftover_samples"] >= len(mine[steps])
            else:
                assert run["leftover_batches"] == 0, (name, rank)  # the shortest read no more
    log = reports[0]["log"]
    assert any("past it" in line and "carried into the next epoch" in line for line in log)
    assert any("past it" in line and "dropped" in line for line in log)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_an_uneven_async_stream_ends_at_the_same_step(ranks: list[dict[str, Any]]) -> None:
    reports = case(ranks, "async_uneven")
    for epoch in range(2):
        assert [len(r["epochs"][epoch]) for r in reports] == [1] * WORLD
    for rank, report in enumerate(reports):
        assert report["epochs"][0] == batches(rank, 0)[:1]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_tar_shards_of_unequal_sizes_give_every_rank_as_many_steps(
    ranks: list[dict[str, Any]],
) -> None:
    from datasets import tar_keys

    reports = case(ranks, "tar")
    every = set(tar_keys(9, lambda shard: 2 + (shard * 5) % 8))
    leftover = sum(r["leftover_samples"] for r in reports)
    for epoch in range(2):
        steps = [len(r["epochs"][epoch]) for r in reports]
        assert len(set(steps)) == 1, steps  # the same step count on every rank
        delivered = [key for r in reports for key in flat(r["epochs"][epoch])]
        assert set(delivered) <= every
        # Each sample at most once, on one rank; in the next epoch, samples carried from the
        # last come first, and their shards' new owners may read them again in that epoch.
        assert len(delivered) - len(set(delivered)) <= (leftover if epoch else 0)
    # Shares of whole shards differ: some rank read past the end, and says how much.
    assert sum(r["leftover_batches"] for r in reports) >= 1
    assert all(r["dropped_batches"] == 0 for r in reports)  # carried, by default


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_an_epoch_left_early_ends_and_the_next_one_is_in_step(
    ranks: list[dict[str, Any]],
) -> None:
    """Ranks 1-3 leave after one batch, rank 0 asks for two: it gets the second only if the
    others had offered that step before they left (they offer ahead), never more; nobody
    hangs in the agreement, and the next epoch runs to the same step everywhere."""
    reports = case(ranks, "left_early")
    assert [len(r["first"]) for r in reports[1:]] == [1] * (WORLD - 1)
    assert 1 <= len(reports[0]["first"]) <= 2
    expected = [batches(rank, 2) for rank in range(WORLD)]
    steps = min(map(len, expected))
    assert [len(r["after"]) for r in reports] == [steps] * WORLD


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_a_second_open_epoch_of_one_loader_is_refused_and_the_first_is_whole(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, report in enumerate(case(ranks, "zip_self")):
        assert "second" not in report, report
        for part in ("epoch 0", "still open", "equal_steps=False"):
            assert part in report["refused"], report["refused"]
        mine = list(range(rank, 40 + rank, WORLD))  # 10 items: 5 batches of 2
        whole = [mine[i : i + 2] for i in range(0, len(mine), 2)]
        assert [report["head"], *report["rest"]] == whole  # not cut short by the refused one
        assert report["after"] == whole


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_a_loader_collected_unclosed_leaves_no_thread_group_or_batches(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, report in enumerate(case(ranks, "collected")):
        assert report["steps"] == 1, report  # the shortest share: 2 items, 1 batch of 2
        assert len(report["threads_while_open"]) == 1, report
        assert report["connections_while_open"] >= WORLD - 1, report  # its gloo group's
        assert report["threads_after"] == [], (rank, report)
        assert report["locksteps_after"] == 0, (rank, report)
        assert report["connections_after"] == 0, (rank, report)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_steps_queued_behind_a_close_use_its_group_and_the_next_loader_pairs(
    ranks: list[dict[str, Any]],
) -> None:
    """Rank 0 closes its loader while its agreement thread still has steps queued: they run
    on that loader's group, not on a second one made on rank 0 alone (which shifted every
    later group's pairing until each rendezvous timed out); the next loader agrees at once."""
    reports = case(ranks, "closed_behind_jobs")
    for rank, report in enumerate(reports):
        assert report["head"] == [rank, rank + WORLD]
        assert report["next"] == [[rank, rank + WORLD]], (rank, report)
    # Rank 0 left after one batch: the others' epoch ended at a step it had offered, and
    # they say that another rank left it (at WARNING: how a peek on one rank looks).
    assert all(len(r["rest"]) <= 3 for r in reports[1:]), [r["rest"] for r in reports[1:]]
    for rank, report in enumerate(reports[1:], start=1):
        warned = [line for line in report["log"] if line.startswith("WARNING")]
        assert any("because another rank left it" in line for line in warned), (rank, warned)
    assert not any("another rank left" in line for line in reports[0]["log"])


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_two_loaders_whose_epochs_start_in_another_order_per_rank_never_cross(
    ranks: list[dict[str, Any]],
) -> None:
    """Loader ``a`` (shares of 3 batches) and ``b`` (1 batch), built in the same order on
    every rank, their first epochs begun a -> b on even ranks and b -> a on odd ones: each
    agrees with the same loader of the others (crossed, ``a`` would end at ``b``'s step)."""
    for rank, report in enumerate(case(ranks, "crossed")):
        mine_a = list(range(rank, 24, WORLD))
        assert report["a"] == [mine_a[i : i + 2] for i in range(0, 6, 2)], (rank, report)
        assert report["b"] == [[rank, rank + WORLD]], (rank, report)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_an_error_past_the_agreed_end_is_logged_not_swallowed(
    ranks: list[dict[str, Any]],
) -> None:
    reports = case(ranks, "past_the_end")
    assert [r["epoch"] for r in reports] == [[[rank, rank + WORLD]] for rank in range(WORLD)]
    warned = [line for line in reports[0]["log"] if line.startswith("WARNING")]
    assert len(warned) == 1, reports[0]["log"]
    for part in ("epoch 0", "step 1", "batch 1", "OSError", "the stream broke at item 8"):
        assert part in warned[0], warned


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_a_consumer_cancelled_at_the_agreed_end_loses_no_carried_batch(
    ranks: list[dict[str, Any]],
) -> None:
    """Rank 0's consumer is cancelled at the agreed end while the epoch closes (its stream
    takes seconds to hang up): what it read past the end was settled first, so the next
    ``anext`` ends the epoch and the next epoch begins with the carried batch."""
    reports = case(ranks, "end_cancelled")
    for rank, report in enumerate(reports):
        assert report["head"] == [rank, rank + WORLD]
        assert report.get("ended") is True, (rank, report)  # no batch past the end
    long = reports[0]
    assert long["settled_before_cancel"] is True, long
    assert long["next"] == [[8, 12]], long  # carried: read first in the next epoch
    assert long["leftover"] >= 2, long
    # Everything read past either end was carried (prefetch batches) or counted as dropped.
    assert long["cut_epochs"] == 2, long
    assert [r["next"] for r in reports[1:]] == [[[r, r + WORLD]] for r in range(1, WORLD)]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_carried_batches_are_in_the_state_and_a_resume_hands_them_first(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, report in enumerate(case(ranks, "carried_resume")):
        mine = batches(rank, 0)  # shares of 3, 1, 2 and 1 batches: the epoch ends at step 1
        assert report["first"] == mine[:1]
        if len(mine) > 1:
            assert report["saved"] >= 1, report  # read past the end, carried, saved
            assert report["next"] == [mine[1]], (rank, report)  # handed first after resume
        else:
            assert report["saved"] == 0, report
            assert report["next"] == [mine[0]], (rank, report)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_the_unread_rest_of_a_longer_share_is_counted_and_logged(
    ranks: list[dict[str, Any]],
) -> None:
    reports = case(ranks, "unread")
    long = reports[0]
    assert long["epoch"] == [[0, 4]]
    assert long["cut_epochs"] == 1, long
    # Its share of 100 samples: 2 handed over, the rest read past the end or not read.
    assert long["unread_samples"] == long["share"] - 2 - long["leftover_samples"], long
    assert long["unread_samples"] > 0, long
    logged = [line for line in long["log"] if "ends at step 1" in line]
    assert f"({long['unread_samples']} samples)" in logged[0], logged
    for report in reports[1:]:  # read to their end
        assert (report["cut_epochs"], report["unread_samples"]) == (0, 0), report


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_what_is_carried_stays_within_prefetch_and_the_excess_is_counted_dropped(
    ranks: list[dict[str, Any]],
) -> None:
    reports = case(ranks, "capped")
    assert all(r["steps"] == [1] * 6 for r in reports), [r["steps"] for r in reports]
    long = reports[0]
    carried_at_close = long["dropped_closed"] - long["dropped_open"]
    assert 0 < carried_at_close <= 3, long  # prefetch=3, not 5 more per epoch
    assert long["dropped_open"] > 0, long  # the excess, counted while running
    # Nothing unnamed: every batch read past an end was either handed first in a later epoch
    # (one per epoch after the first) or counted as dropped.
    assert long["leftover"] == long["dropped_closed"] + 5, long


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_a_stream_loader_on_one_rank_only_does_not_wait(ranks: list[dict[str, Any]]) -> None:
    report = case(ranks, "alone")[0]
    assert report["whole"] == list(range(10))  # shard=False: everything
    assert report["share"] == [0, 4, 8]  # equal_steps=False: its share, alone


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_a_sharded_stream_iterated_on_rank_0_only_fails_within_the_bound(
    ranks: list[dict[str, Any]],
) -> None:
    report = case(ranks, "rank0_only")[0]
    assert "batches" not in report, report  # it cannot agree with ranks that never come
    kind, message = report["raised"]
    assert kind == "RuntimeError"
    for part in ("epoch 0", "did not join", "equal_steps=False", "shard=False", "within 1 s"):
        assert part in message, message
    assert report["elapsed"] < 30, report  # the bound (1 s), not 30 minutes
    # Never retried under the same keys: the next epoch fails at once, with that cause.
    assert "batches_again" not in report, report
    kind, again, cause = report["again"]
    assert kind == "RuntimeError"
    assert "broke earlier" in again, again
    assert cause == message
    assert report["again_elapsed"] < 2, report
    assert report["keys_added"] == 0, report  # its rendezvous key deleted after the failure


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_the_rank_slowed_on_purpose_is_named_with_its_stage(ranks: list[dict[str, Any]]) -> None:
    reports = case(ranks, "slow_rank")
    for report in reports:
        assert report["slowest"] == WORLD - 1, report["table"]
        assert report["again"] == WORLD - 1
        assert report["ranks"] == list(range(WORLD))
        assert report["stage"] == "workers", report["table"]
        assert f"slowest: rank {WORLD - 1} (workers)" in report["table"]
    logged = [line for line in reports[0]["log"] if "across 4 ranks" in line]
    assert len(logged) == 1, reports[0]["log"]  # rank 0 only, once for the epoch
    assert all(not any("across" in line for line in r["log"]) for r in reports[1:])


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_ranks_of_one_model_parallel_group_get_identical_batches(
    ranks: list[dict[str, Any]],
) -> None:
    reports = case(ranks, "dp_groups")
    for key in ("map", "stream", "draws"):
        assert reports[0][key] == reports[1][key], key  # model-parallel pair (0, 1)
        assert reports[2][key] == reports[3][key], key  # pair (2, 3)
        assert reports[0][key] != reports[2][key], key  # data-parallel peers differ
    assert sorted(flat(reports[0]["map"]) + flat(reports[2]["map"])) == list(range(24))
    assert sorted(flat(reports[0]["stream"]) + flat(reports[2]["stream"])) == list(range(30))


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_a_state_of_four_ranks_resumes_exactly_on_two_three_and_four(
    ranks: list[dict[str, Any]],
) -> None:
    """Saved on 4 ranks x 2 workers, resumed on 2 x 1, 3 x 2 and 4 x 0: the rest of the epoch
    exactly once across the new ranks (padding aside, as a DistributedSampler pads), nothing
    taken again, and the next epoch that of an uninterrupted run on the new ranks."""
    reports = case(ranks, "elastic")
    n = 45
    for taken in ("1", "2"):
        head = [i for r in reports for i in r[taken]["head"]]
        assert len(head) == WORLD * 4 * int(taken)
        for name, size in (("2x1", 2), ("3x2", 3), ("4x0", 4)):
            runs = [r[taken][name] for r in reports[:size]]
            rest = [i for run in runs for i in run["rest"]]
            again = set(head) & set(rest)
            if size == WORLD:
                # The same ranks resume by batch ids, as the uninterrupted epoch goes: its
                # padding (48 places for 45 samples) repeats 3 samples of its first batches.
                assert len(again) <= 3, (taken, name)
            else:
                assert not again, (taken, name)  # the rest is shared out of what is left
            assert set(head) | set(rest) == set(range(n)), (taken, name)
            assert len(head) + len(rest) - n < (WORLD - 1) + size, (taken, name)  # padding
            assert len({len(run["rest"]) for run in runs}) == 1  # as many on every rank
            for run in runs:
                assert run["next"] == run["fresh1"], (taken, name)
                # len(loader) right after the load counts the epoch it resumes: on other
                # ranks, the rest shared out (its batches count from 0); on the same ranks,
                # the whole epoch, of which `taken` batches are done.
                done = int(taken) if size == WORLD else 0
                assert run["len"] == run["rest_batches"] + done, (taken, name, run)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_loaders_of_two_subgroups_one_after_the_other_each_agree_over_their_group(
    ranks: list[dict[str, Any]],
) -> None:
    """Ranks 0-1 read a stream of ``new_group([0, 1])``, then ranks 0-2 one of
    ``new_group([0, 1, 2])``: each ends at its group's shortest share, at once (rank 2's
    first loader of that group pairs with the others' though they built one more before)."""
    reports = case(ranks, "subgroups")
    for name, streams in (("two", (20, 7)), ("three", (24, 10, 17))):
        size = len(streams)
        shares = [list(range(r, streams[r], size)) for r in range(size)]
        steps = min(-(-len(share) // 2) for share in shares)
        for rank in range(size):
            mine = [shares[rank][i : i + 2] for i in range(0, len(shares[rank]), 2)]
            assert reports[rank][name] == mine[:steps], (name, rank, reports[rank])
        assert all(name not in r for r in reports[size:]), name
    # The bound of the agreement's making is 60 s: the groups met at once instead.
    assert all(r["elapsed"] < 30 for r in reports), [r["elapsed"] for r in reports]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_the_rendezvous_leaves_no_key_in_the_store(ranks: list[dict[str, Any]]) -> None:
    for rank, report in enumerate(case(ranks, "store_keys")):
        assert report["steps"] == [1, 1], report
        assert report["keys_added"] == 0, (rank, report)  # one a rank before: 4 left


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_a_forked_childs_epoch_under_its_parents_group_refuses_at_once(
    ranks: list[dict[str, Any]],
) -> None:
    """Each rank forks after an epoch under equal steps: the child's epoch of its copy of the
    loader fails at once naming both processes (never a wait for an agreement thread the
    child does not have), the child exits normally (its copy of the parent's group is never
    destroyed there, which waited forever), and the parent's next epoch is in step."""
    for rank, report in enumerate(case(ranks, "forked")):
        assert report["child_status"] == 0, (rank, report)  # -14: SIGALRM, it hung
        child = report["child"]
        assert "batches" not in child, child
        kind, message = child["raised"]
        assert kind == "RuntimeError", child
        for part in (
            f"process {child['pid']}",
            f"forked from process {ranks[rank]['pid']}",
            "init_process_group",
            "equal_steps=False",
            "shard=False",
        ):
            assert part in message, message
        assert child["elapsed"] < 5, child
        mine = batches(rank, 0)  # shares of 3, 1, 2 and 1 batches: every epoch ends at step 1
        assert len(report["before"]) == len(report["after"]) == 1, report
        assert report["before"] == mine[:1], report


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_an_extra_epoch_on_one_rank_fails_when_it_pairs_another_epoch(
    ranks: list[dict[str, Any]],
) -> None:
    """Rank 0 peeks (``next(iter(loader))``), then every rank runs epochs 0 and 1 by
    ``set_epoch``: rank 0's epoch 0 meets the others' epoch 1. Every rank fails there, naming
    both epochs; rank 0's next epoch fails at once with that error as its cause."""
    reports = case(ranks, "peeked")
    assert reports[0]["peek"] == [0, WORLD]
    first, after = reports[0]["epochs"]
    assert first["batches"] == [], first  # its first step is the mismatch
    for part in ("this rank's epoch 0, step 0", "epochs 0 to 1", "drifted apart"):
        assert part in first["error"], first
    assert "broke earlier" in after["error"], after
    assert after["cause"] == first["error"], after
    assert after["elapsed"] < 5, after  # at once, not after the bound
    for rank, report in enumerate(reports[1:], start=1):
        paired, failed = report["epochs"]
        assert "error" not in paired, (rank, paired)  # paired with rank 0's peek: no drift yet
        assert failed["batches"] == [], (rank, failed)
        for part in ("this rank's epoch 1, step 0", "epochs 0 to 1", "drifted apart"):
            assert part in failed["error"], (rank, failed)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TEST_TIMEOUT_S + 60)
def test_a_mid_epoch_state_holds_the_carried_batches_not_handed_yet(
    ranks: list[dict[str, Any]],
) -> None:
    reports = case(ranks, "carried_mid_epoch")
    long = reports[0]
    assert long["epoch0"] == [[0, WORLD]], long
    carried = long["between"]
    assert len(carried) >= 2, long  # read past the end (a full read-ahead: 4)
    assert len(carried) <= 4, long  # prefetch
    assert long["head1"] == carried[0], long  # handed first in epoch 1
    assert long["mid"] == carried[1:], long  # the rest, not the one handed
    assert long["loaded"] == carried[1:], long
    assert long["after_break"] == carried[1:], long  # an epoch left early loses none of them
    handed = [batch for epoch in long["resumed"] for batch in epoch]
    assert handed[0] == carried[1], long  # the resumed loader hands them first
    for report in reports[1:]:  # one batch each, nothing read past an end
        assert (report["between"], report["mid"], report["loaded"]) == ([], [], []), report
