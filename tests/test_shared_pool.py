"""One WorkerPool shared by several loaders (``aioloader._loader._shared_pool``): a training and an
evaluation loader interleaved on one loop, over one set of worker processes started once and
one shared-memory budget, each with its own dataset copy, worker_init_fn, seeds and worker
info, each told of its own failures only.

Every scenario runs real worker processes; faults are injected by the datasets themselves
(``fault_datasets``), and markers left in a temporary directory tell what ran in the workers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import os
import pathlib
import subprocess
import sys
import time
import warnings
from typing import Any

import fault_datasets as fd
import pytest
from datasets import InitMarker, Range, Stream, Tagged, markers

from aioloader import DataLoader, LoaderTimeoutError, WorkerCrashedError, WorkerPool

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

SHAPE = (32, 32, 16)  # 16 KiB samples: batches of 8 travel in shared-memory slots
WAIT_S = 10.0  # bound on waiting for what workers do after the fact (markers)


async def epoch_of(loader: DataLoader) -> fd.EpochRun:
    return await fd.run_epoch(aiter(loader))


def tagged_epoch(batches: list[Any]) -> list[dict[str, Any]]:
    """The samples of an epoch of :class:`Tagged` (collated: a dict of lists per batch)."""
    out = []
    for batch in batches:
        keys = list(batch)
        columns = zip(*batch.values(), strict=True)
        out += [dict(zip(keys, values, strict=True)) for values in columns]
    return out


def plain(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: v.item() if hasattr(v, "item") else v for k, v in sample.items()}


def wait_for(predicate: Any) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- two loaders, one pool --------------------------------------------------------------------


async def test_train_and_eval_interleaved_share_the_workers_and_the_budget() -> None:
    budget = 6 << 20  # six 1 MiB slots for both loaders together
    async with WorkerPool(num_workers=2, shm_max_bytes=budget) as pool:
        pids = pool.worker_pids
        assert len(pids) == 2
        train = DataLoader(
            fd.Faulty(96, shape=SHAPE),
            batch_size=8,
            shuffle=True,
            seed=1,
            workers=pool,
            persistent_workers=True,
        )
        val = DataLoader(fd.Faulty(40, shape=(16, 32, 32)), batch_size=8, workers=pool)
        async with train, val:
            assert train.num_workers == val.num_workers == 2
            for _ in range(3):
                # Both at once on one loop, then an evaluation epoch between training epochs.
                runs = [*await asyncio.gather(epoch_of(train), epoch_of(val))]
                runs.append(await epoch_of(val))
                for run, n in zip(runs, (96, 40, 40), strict=True):
                    assert run.errors == []
                    assert sorted(i for b in run.batches for i in b) == list(range(n))
                assert pool.worker_pids == train.worker_pids == val.worker_pids == pids
                stats, a, b = pool.statistics(), train.statistics(), val.statistics()
                assert stats.loaders == 2
                assert stats.shm_max_bytes == budget
                assert 0 < stats.shm_bytes <= budget  # the first batches' segments too
                # One slot pool: each loader reports the pool's, not a share of its own.
                assert a.live_shm_slots == b.live_shm_slots == stats.live_shm_slots > 0
                assert a.shm_bytes == b.shm_bytes == stats.shm_bytes
            assert pool.statistics().worker_restarts == 0
        assert pool.statistics().loaders == 0
        assert not pool.closed
    assert pool.closed
    assert pool.worker_pids == ()
    assert fd.wait_gone(pids) == []


async def test_each_loader_has_its_own_copy_init_fn_seeds_and_worker_info(
    tmp_path: pathlib.Path,
) -> None:
    marks = str(tmp_path)
    async with WorkerPool(2) as pool:
        train = DataLoader(
            Tagged(24, "train", marks),
            batch_size=4,
            seed=11,
            workers=pool,
            worker_init_fn=InitMarker(marks, "train"),
            persistent_workers=True,
        )
        val = DataLoader(
            Tagged(12, "val", marks),
            batch_size=4,
            seed=22,
            workers=pool,
            worker_init_fn=InitMarker(marks, "val"),
        )
        seeds: dict[str, list[set[int]]] = collections.defaultdict(list)
        async with train, val:
            for _ in range(3):
                for loader, tag, n in ((train, "train", 24), (val, "val", 12)):
                    run = [plain(s) for s in tagged_epoch([b async for b in loader])]
                    assert sorted(s["index"] for s in run) == list(range(n))
                    assert {s["tag"] for s in run} == {tag}
                    assert all(s["mine"] and s["num_workers"] == 2 for s in run)
                    assert {s["pid"] for s in run} <= set(pool.worker_pids)
                    seeds[tag].append({s["seed"] for s in run})
        inits = collections.Counter(markers(marks, "init-"))
        # train keeps its copy (persistent_workers=True): one init per worker that served it,
        # however many val epochs came between; val renews its copy every epoch.
        train_inits = {k: v for k, v in inits.items() if k.startswith("init-train-")}
        val_inits = {k: v for k, v in inits.items() if k.startswith("init-val-")}
        assert train_inits, inits
        assert set(train_inits.values()) == {1}, inits
        assert sum(val_inits.values()) >= 3, inits
        for name in [*train_inits, *val_inits]:
            pid, worker_id = name.split("-")[2:]
            assert int(pid) in pool.worker_pids
            assert worker_id in ("0", "1")
    # Seeds: the loader's own (two loaders never share one), train's the same every epoch.
    assert seeds["train"][0] == seeds["train"][1] == seeds["train"][2]
    assert not set().union(*seeds["train"]) & set().union(*seeds["val"])
    assert seeds["val"][0] != seeds["val"][1]


def test_sync_for_over_loaders_on_a_shared_pool(sync_loop: str) -> None:
    # Validation in the middle of a training epoch, both with `for`: the epochs of both run on
    # the pool's one private loop, so neither takes the workers' pipes from the other. The
    # validation set is a stream: each worker keeps its share of it beside train's copy.
    with WorkerPool(2) as pool:
        pids = pool.worker_pids
        with (
            DataLoader(fd.Faulty(64, shape=SHAPE), batch_size=8, workers=pool) as train,
            DataLoader(Stream(30), batch_size=4, workers=pool) as val,
        ):
            for _ in range(2):
                seen, checked = [], []
                for step, batch in enumerate(train):
                    seen += fd.batch_indices(batch)
                    if step in (2, 5):
                        checked.append(sorted(int(i) for b in val for i in b))
                assert sorted(seen) == list(range(64))
                assert checked == [list(range(30))] * 2
            assert pool.worker_pids == pids
    assert fd.wait_gone(pids) == []


# -- failures stay each loader's own ----------------------------------------------------------


async def test_a_worker_killed_mid_epoch_loses_nothing_of_either_loader(
    tmp_path: pathlib.Path,
) -> None:
    # One worker. It dies making train's batch 5 while val's batches 0..5 wait in its pipe:
    # val numbers its batches alike, and none of them may be blamed, lost or made twice.
    gate = tmp_path / "gate"
    train_set = fd.GatedKill(48, at=22, gate=str(gate), shape=SHAPE)  # in batch 5
    async with WorkerPool(1) as pool:
        [first_pid] = pool.worker_pids
        train = DataLoader(train_set, batch_size=4, workers=pool, prefetch=4)
        val = DataLoader(
            fd.Faulty(64, shape=(16, 32, 32)),
            batch_size=4,
            workers=pool,
            prefetch=6,
            persistent_workers=True,
        )
        async with train, val:
            warm = await epoch_of(val)  # val's copy is loaded: its next jobs go out at once
            assert warm.errors == []
            train_task = asyncio.create_task(epoch_of(train))
            assert await asyncio.to_thread(wait_for, pathlib.Path(f"{gate}.waiting").exists)
            val_task = asyncio.create_task(epoch_of(val))
            for _ in range(1000):  # val's six jobs are sent on this loop, with no thread hop
                if val.statistics().in_flight == 6:
                    break
                await asyncio.sleep(0.001)
            for _ in range(20):
                await asyncio.sleep(0)
            gate.touch()
            train_run, val_run = await asyncio.gather(train_task, val_task)
            # The next epochs are whole, on the replacement worker.
            again = await asyncio.gather(epoch_of(train), epoch_of(val))
            [second_pid] = pool.worker_pids
    [err] = train_run.errors
    assert isinstance(err, WorkerCrashedError)
    assert fd.failed_batch_id(err) == 5
    assert err.pid == first_pid
    assert f"pid {first_pid}" in str(err)
    fd.assert_exact(train_run, fd.sequential_batches(48, 4))  # only the killed batch is missing
    assert val_run.errors == []
    assert val_run.batches == fd.sequential_batches(64, 4)
    assert second_pid != first_pid
    assert pool.statistics().worker_restarts == 1
    for run, n in zip(again, (48, 64), strict=True):
        assert run.errors == []
        assert run.batches == fd.sequential_batches(n, 4)


async def test_a_retried_crash_loses_nothing_of_either_loader(tmp_path: pathlib.Path) -> None:
    train_set = fd.Faulty(32, shape=SHAPE, faults={9: fd.SIGKILL}, marker_dir=str(tmp_path))
    async with WorkerPool(2) as pool:
        train = DataLoader(train_set, batch_size=4, workers=pool, max_retries=1)
        val = DataLoader(fd.Faulty(32, shape=SHAPE), batch_size=4, workers=pool)
        async with train, val:
            runs = await asyncio.gather(epoch_of(train), epoch_of(val))
    for run in runs:
        assert run.errors == []
        assert run.batches == fd.sequential_batches(32, 4)


async def test_a_hung_batch_is_killed_at_its_own_loaders_deadline(tmp_path: pathlib.Path) -> None:
    # One worker hangs in train's batch 2; val's batches wait behind it. Train's deadline kills
    # the worker and reports the batch to train; val's batches run on the replacement.
    hung = fd.Faulty(16, faults={9: fd.HANG}, marker_dir=str(tmp_path))
    async with WorkerPool(1) as pool:
        train = DataLoader(hung, batch_size=4, workers=pool, timeout=1.0, prefetch=2)
        val = DataLoader(fd.Faulty(24), batch_size=4, workers=pool)  # no deadline of its own
        async with train, val:
            train_run, val_run = await asyncio.gather(epoch_of(train), epoch_of(val))
    [err] = train_run.errors
    assert isinstance(err, LoaderTimeoutError)
    assert fd.failed_batch_id(err) == 2
    [(pid, _)] = fd.visits(str(tmp_path), 9)
    assert f"worker pid {pid} was killed" in str(err)
    fd.assert_exact(train_run, fd.sequential_batches(16, 4))
    assert val_run.errors == []
    assert val_run.batches == fd.sequential_batches(24, 4)


# -- lifetimes --------------------------------------------------------------------------------


async def test_closing_one_loader_drops_its_copies_and_leaves_the_other_working(
    tmp_path: pathlib.Path,
) -> None:
    marks = str(tmp_path)
    async with WorkerPool(2) as pool:
        pids = pool.worker_pids
        train = DataLoader(
            Tagged(16, "train", marks), batch_size=4, workers=pool, persistent_workers=True
        )
        val = DataLoader(Tagged(16, "val", marks), batch_size=4, workers=pool)
        async with train:
            async with val:
                served = {s["pid"].item() for s in tagged_epoch([b async for b in val])}
                await epoch_of_tagged(train)
                assert pool.statistics().loaders == 2
            # Closed: each worker that held val's copy drops it, at once; train's stays.
            assert val.closed
            assert pool.statistics().loaders == 1
            assert wait_for(lambda: len(markers(marks, "dropped-val-")) == len(served))
            assert {int(m.split("-")[2]) for m in markers(marks, "dropped-val-")} == served
            for _ in range(2):
                assert sorted(await epoch_of_tagged(train)) == list(range(16))
            assert markers(marks, "dropped-train-") == []
            with pytest.raises(RuntimeError, match="this DataLoader is closed"):
                aiter(val)
        assert pool.worker_pids == pids


async def epoch_of_tagged(loader: DataLoader) -> list[int]:
    return [s["index"].item() for s in tagged_epoch([b async for b in loader])]


async def test_a_loader_used_after_its_pool_closed_errors_clearly() -> None:
    pool = WorkerPool(1)
    loader = DataLoader(Range(8), batch_size=4, workers=pool)
    try:
        assert [b.tolist() async for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    finally:
        await pool.aclose()
    with pytest.raises(RuntimeError, match=r"WorkerPool this loader uses .*is closed"):
        await anext(aiter(loader))
    with pytest.raises(RuntimeError, match=r"WorkerPool this loader uses .*is closed"):
        next(iter(loader))
    with pytest.raises(ValueError, match=r"^workers=<WorkerPool num_workers=1 .*closed> is closed"):
        DataLoader(Range(8), workers=pool)
    # Nothing is held any more: collecting the unclosed loader warns of nothing.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del loader
        gc.collect()
    assert [str(w.message) for w in caught] == []


def test_an_unclosed_pool_warns_and_stops_its_workers() -> None:
    pool = WorkerPool(1)
    pool.start()
    pids = pool.worker_pids
    with pytest.warns(ResourceWarning, match="WorkerPool was not closed"):
        del pool  # no reference cycle holds it: the finalizer runs here
    assert fd.wait_gone(pids) == []


def test_a_pool_collected_on_a_thread_that_holds_its_lock_is_closed_without_deadlock() -> None:
    """The collector runs a dead pool's finalizer on whichever thread allocates, possibly one
    inside a method that holds the pool's lock (making its slot pool, dropping a loader's
    copy): the finalizer must not wait there for that lock. Its workers still stop, once the
    lock is free."""
    import threading

    from aioloader._loader import _shared_pool

    pool = WorkerPool(1)
    pool.start()
    pids = pool.worker_pids
    held = pool._held
    returned = threading.Event()

    def collected_under_the_lock() -> None:
        with held.lock:
            _shared_pool._finalize(held)
            returned.set()

    def run_bounded() -> None:
        thread = threading.Thread(target=collected_under_the_lock, daemon=True)
        thread.start()
        thread.join(10.0)

    with pytest.warns(ResourceWarning, match="WorkerPool was not closed"):  # from that thread
        run_bounded()
    assert returned.is_set(), "the finalizer waited for a lock its own thread holds"
    assert wait_for(lambda: held.closed)
    assert fd.wait_gone(pids) == []
    pool.close()


# -- arguments --------------------------------------------------------------------------------


@contextlib.contextmanager
def unstarted(**kwargs: Any) -> Any:
    """A pool whose workers never start (the argument checks need none)."""
    pool = WorkerPool(**kwargs)
    try:
        yield pool
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(num_workers=3), ValueError, r"^num_workers=3 conflicts with workers=<WorkerPool "),
        (dict(thread_pool=True), ValueError, r"^thread_pool=True conflicts with workers=<Worker"),
        (dict(mp_context="spawn"), ValueError, r"^multiprocessing_context='spawn' conflicts wi"),
        (dict(shm_max_bytes=1 << 20), ValueError, r"^shm_max_bytes=1048576 conflicts with work"),
        (dict(start_timeout=5), ValueError, r"^start_timeout=5.0 conflicts with workers=<Worke"),
        (dict(allow_fork=True), ValueError, r"^allow_fork=True conflicts with workers=<WorkerP"),
    ],
)
def test_loader_arguments_that_conflict_with_the_pool_are_named(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with unstarted(num_workers=1) as pool:
        with pytest.raises(error, match=message) as info:
            DataLoader(Range(8), workers=pool, **kwargs)
        text = str(info.value)
        assert "workers=<WorkerPool num_workers=1 (" in text
        assert " there): leave " in text  # the pool's value too


def test_the_pools_own_values_may_be_repeated() -> None:
    with unstarted(num_workers=1, mp_context="spawn", shm_max_bytes=0) as pool:
        loader = DataLoader(
            Range(8), workers=pool, num_workers=1, mp_context="spawn", shm_max_bytes=0
        )
        assert loader.num_workers == 1
        assert loader.multiprocessing_context is pool.multiprocessing_context
        loader.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(num_workers=0), ValueError, r"^num_workers must be a positive int, got 0$"),
        (dict(num_workers="2"), TypeError, r"^num_workers must be a positive int, got '2'$"),
        (dict(num_workers=1, mp_context="telepathy"), ValueError, r"mp_context='telepathy'"),
        (dict(num_workers=1, shm_max_bytes=-1), ValueError, r"^shm_max_bytes must be a non-n"),
        (dict(num_workers=1, start_timeout=0), ValueError, r"^start_timeout must be finite a"),
        (dict(num_workers=1, allow_fork="yes"), TypeError, r"^allow_fork must be a bool, got"),
    ],
)
def test_bad_pool_arguments_are_named(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        WorkerPool(**kwargs)


def test_workers_must_be_a_pool() -> None:
    with pytest.raises(TypeError, match=r"^workers must be a WorkerPool or None, got 4$"):
        DataLoader(Range(8), workers=4)  # type: ignore[arg-type]


SCRIPT = """
import os, time
from aioloader import DataLoader, WorkerPool
from datasets import Range

pool = WorkerPool(2)
train = DataLoader(Range(64), batch_size=4, workers=pool)
val = DataLoader(Range(16), batch_size=4, workers=pool)

if __name__ == "__main__":
    assert sorted(int(x) for batch in train for x in batch) == list(range(64))
    assert sorted(int(x) for batch in val for x in batch) == list(range(16))
    print("PIDS", *pool.worker_pids, flush=True)
    print("END", time.monotonic(), flush=True)
"""


@pytest.mark.slow
def test_a_script_that_never_closes_its_pool_exits_promptly(tmp_path: pathlib.Path) -> None:
    # Neither the loaders nor the pool closed, as torch users write scripts: the exit hook
    # closes them before Python joins its threads, and the script ends at once.
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    tests = pathlib.Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONWARNINGS="default")
    paths = [str(tests.parent), str(tests), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    proc = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=60
    )
    ended = time.monotonic()
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert ended - float(lines["END"]) < 5.0
    for word in ("was not closed", "leaked", "ResourceWarning", "Exception ignored"):
        assert word not in proc.stderr, proc.stderr
    assert fd.wait_gone([int(p) for p in lines["PIDS"].split()]) == []
