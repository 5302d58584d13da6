"""Ray actors as the loader's workers (``aioloader.RayWorkers``), on a real two-node cluster on
loopback (``ray_cluster``: started once per session, stopped at its end).

What local workers guarantee holds with actors: the batches (values, seeds, worker info) are the
very ones local worker processes make; an actor killed by its pid mid-epoch is replaced and its
batch re-run, every sample once; a hung actor is killed at the deadline; resume is exact at any
cut, into local workers too; an async dataset is fetched inside the actors, many items in
flight; and the loader runs inside an actor's own event loop while the actor serves other calls.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from datasets import (
    AsyncResumable,
    Resumable,
    keep,
    parquet_bytes,
    parquet_row,
    tar_keys,
    tar_sample,
    tar_shard,
)
from helpers import as_lists
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aioloader
from aioloader import (
    DataLoader,
    LoaderTimeoutError,
    RayWorkers,
    WorkerCrashedError,
    WorkerInitError,
    get_worker_info,
    numpy_collate,
)
from aioloader.sources import ParquetDataset, TarDataset

N = 24
BATCH = 4
#: Seconds a test may wait for one batch where a replacement actor must start first.
SLOW_BATCH_S = 60
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# -- datasets (imported by the actors from this module: the nodes' PYTHONPATH names tests/) ----


class Numbered:
    """Sample ``i``: the index, a random draw (per-batch seeding), and which worker made it."""

    def __init__(self, n: int = N, delay: float = 0.0) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.delay:
            time.sleep(self.delay)
        info = get_worker_info()
        return {
            "index": np.array([i], dtype=np.int64),
            "draw": np.random.randint(0, 2**31, size=1),
            "workers": np.array([info.num_workers if info else 0]),
            "init": np.array([_INIT.get("value", -1)]),
        }


_INIT: dict[str, int] = {}


def init_worker(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    assert info.id == worker_id
    _INIT["value"] = 100 + worker_id


#: int64 values per sample of a large one: 64 KiB, so that a batch of :data:`BATCH` (256
#: KiB) is past what travels inline, and an actor on this machine hands it over in a slot.
LARGE = 8192


class Large(Numbered):
    """:class:`Numbered` with an ``image`` of 64 KiB per sample, all ``i``."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = super().__getitem__(i)
        sample["image"] = np.full(LARGE, i, dtype=np.int64)
        return sample


class HangsOnce:
    """Sample ``hang_at`` hangs for ever the first time it is read anywhere (a marker file says
    it was), and reads at once after that. Sample ``i`` is ``width`` times ``i``."""

    def __init__(self, marker: str, hang_at: int, width: int = 1) -> None:
        self.marker = marker
        self.hang_at = hang_at
        self.width = width

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray[Any, Any]:
        if i == self.hang_at and not os.path.exists(self.marker):
            Path(self.marker).write_text("hung")
            time.sleep(3600)
        return np.full(self.width, i)


class FailsOn:
    def __init__(self, bad: frozenset[int]) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> np.ndarray[Any, Any]:
        if i in self.bad:
            raise KeyError(f"sample {i} is corrupt")
        return np.array([i])


class Concurrent:
    """An async dataset that reports how many of its reads were in flight at once in its copy."""

    def __init__(self, n: int = 32) -> None:
        self.n = n
        self.now = 0
        self.peak = 0

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> np.ndarray[Any, Any]:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(0.05)
        finally:
            self.now -= 1
        return np.array([i, self.peak, os.getpid()])


class SlowResumable(Resumable):
    """:class:`datasets.Resumable` whose every item takes ``delay`` seconds: an actor can be
    killed while it reads."""

    def __init__(self, n: int, delay: float = 0.0, *, self_sharded: bool = False) -> None:
        super().__init__(n, self_sharded=self_sharded)
        self.delay = delay

    def __iter__(self) -> Iterator[int]:
        for i in super().__iter__():
            if self.delay:
                time.sleep(self.delay)
            yield i


def indices(batches: list[Any]) -> list[int]:
    return [int(i) for b in batches for i in np.asarray(b["index"]).ravel()]


@pytest.fixture(scope="module")
def workers(ray_cluster: str) -> Iterator[RayWorkers]:
    """Two actors, one CPU each, shared by the tests of this module that do not kill them."""
    with RayWorkers(2, num_cpus=0.5) as pool:
        pool.loop()  # its thread for `for`, made now: the tests' leak checks see it as there
        yield pool


@pytest.fixture(scope="module")
def one_actor(ray_cluster: str) -> Iterator[RayWorkers]:
    """One actor: a loader resumed on it continues a state saved with two."""
    with RayWorkers(1, num_cpus=0.25) as pool:
        pool.loop()
        yield pool


# -- construction --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"num_actors": 0}, ValueError, "num_actors"),
        ({"num_actors": 1.5}, TypeError, "num_actors"),
        ({"num_actors": 1, "num_cpus": -1}, ValueError, "num_cpus"),
        ({"num_actors": 1, "num_gpus": float("nan")}, ValueError, "num_gpus"),
        ({"num_actors": 1, "resources": ["preprocess"]}, TypeError, "resources"),
        ({"num_actors": 1, "resources": {"preprocess": -1}}, ValueError, "preprocess"),
        ({"num_actors": 1, "resources": {"CPU": 1}}, ValueError, "num_cpus"),
        ({"num_actors": 1, "address": 6379}, TypeError, "address"),
        ({"num_actors": 1, "start_timeout": 0}, ValueError, "start_timeout"),
    ],
)
def test_bad_arguments_are_refused_naming_them(
    kwargs: dict[str, Any], error: type[Exception], names: str
) -> None:
    with pytest.raises(error, match=names):
        RayWorkers(**kwargs)


def test_an_unreachable_cluster_is_named_at_once_and_nothing_is_left() -> None:
    """In a process that has not joined a cluster (Ray would retry the address for minutes)."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'aioloader[ray]')")
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    code = (
        "import aioloader\n"
        f"pool = aioloader.RayWorkers(1, address='127.0.0.1:{port}')\n"
        "try:\n    pool.start()\nexcept ConnectionError as exc:\n    print('REFUSED', exc)\n"
        "pool.close()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"REFUSED could not join the Ray cluster at address='127.0.0.1:{port}'" in result.stdout


def test_the_pool_decides_the_worker_count(workers: RayWorkers) -> None:
    with pytest.raises(ValueError, match="num_workers=3 conflicts with workers="):
        DataLoader(Numbered(), batch_size=BATCH, num_workers=3, workers=workers)
    loader = DataLoader(Numbered(), batch_size=BATCH, workers=workers)
    assert loader.num_workers == 2
    loader.close()


# -- the batches ------------------------------------------------------------------------------


def test_actors_make_the_batches_local_worker_processes_make(workers: RayWorkers) -> None:
    """Same order, values, per-batch random draws, worker count and worker_init_fn as two local
    worker processes, with shuffle; numpy leaves arrive read-only, tensors writable."""
    common: dict[str, Any] = {
        "batch_size": BATCH,
        "shuffle": True,
        "seed": 7,
        "worker_init_fn": init_worker,
    }
    with DataLoader(Numbered(), workers=workers, **common) as loader:
        remote = list(loader)
    with DataLoader(Numbered(), num_workers=2, **common) as loader:
        local = list(loader)
    assert len(remote) == len(local) == N // BATCH
    for a, b in zip(remote, local, strict=True):
        for key in ("index", "draw", "workers"):
            assert a[key].tolist() == b[key].tolist(), key
        assert set(a["init"].ravel().tolist()) <= {100, 101}
    assert sorted(indices(remote)) == list(range(N))
    tensor = remote[0]["index"]
    tensor += 1  # writable memory of its own
    with DataLoader(Numbered(), batch_size=BATCH, collate_fn=numpy_collate, workers=workers) as ld:
        array = next(iter(ld))["index"]
    assert isinstance(array, np.ndarray)
    assert not array.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        array += 1


def test_actors_on_a_preprocessing_node_send_batches_across_object_stores(
    ray_cluster: str,
) -> None:
    """Actors that ask for the second node's resource run there only; their batches cross to
    the head's object store, whole and in order; statistics name each actor's node. (Both
    nodes run on this machine, so large batches would come in its shared memory: here they
    may not, ``shm_max_bytes=0``.)"""
    import ray

    head = ray.get_runtime_context().get_node_id()
    with RayWorkers(2, num_cpus=0, resources={"preprocess": 1}, shm_max_bytes=0) as pool:
        with DataLoader(Large(), batch_size=BATCH, workers=pool, in_order=True) as loader:
            got = list(loader)
        stats = pool.statistics()
    assert indices(got) == list(range(N))
    assert [b["image"][:, 0].tolist() for b in got] == [b["index"][:, 0].tolist() for b in got]
    assert stats.live_shm_slots == 0
    nodes = {a.node_id for a in stats.actors}
    assert len(nodes) == 1
    assert head not in nodes
    assert sum(a.batches for a in stats.actors) == N // BATCH
    assert all(a.busy_s > 0 for a in stats.actors if a.batches)
    assert stats.worker_restarts == 0


def test_actors_on_this_machine_hand_large_batches_over_in_its_shared_memory(
    ray_cluster: str,
) -> None:
    """Once a batch's size is known, the actors (this machine's) collate into slots of the
    training process's shared memory, as local workers do: the batches sent before the first
    came back travel through the object store, every later one lives in a slot while the
    consumer holds it; nothing falls back, no slot stays leased. The batches are local
    workers' own; tensors are writable, numpy arrays read-only as from the object store."""
    common: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "seed": 3, "prefetch": 2}
    with DataLoader(Large(), num_workers=2, **common) as loader:
        local = [list(loader) for _ in range(2)]
    with (
        RayWorkers(2, num_cpus=0) as pool,
        DataLoader(Large(), workers=pool, persistent_workers=True, **common) as loader,
    ):
        for epoch in range(2):
            got = list(loader)
            held = pool.statistics().held_shm_slots
            assert held >= len(got) - (2 if epoch == 0 else 0), (epoch, held)
            for a, b in zip(got, local[epoch], strict=True):
                for key in ("index", "draw", "image"):
                    assert a[key].tolist() == b[key].tolist(), key
            got[-1]["image"] += 1  # a tensor: writable
            del got
        stats = loader.statistics()
        assert stats.shm_fallbacks == 0
        after = pool.statistics()
        assert after.leased_shm_slots == 0
        with DataLoader(Large(), batch_size=BATCH, collate_fn=numpy_collate, workers=pool) as ld:
            arrays = [b["image"] for b in ld]
        assert pool.statistics().held_shm_slots >= len(arrays) - ld.prefetch
        assert not any(a.flags.writeable for a in arrays)
        with pytest.raises(ValueError, match="read-only"):
            arrays[-1] += 1


def test_shared_memory_can_be_left_out_and_batches_use_the_object_store(
    ray_cluster: str,
) -> None:
    with pytest.raises(ValueError, match="shm_max_bytes"):
        RayWorkers(1, shm_max_bytes=-1)
    with (
        RayWorkers(1, num_cpus=0, shm_max_bytes=0) as pool,
        DataLoader(Large(), batch_size=BATCH, workers=pool) as loader,
    ):
        got = list(loader)
        stats = pool.statistics()
    assert indices(got) == list(range(N))
    assert (stats.live_shm_slots, stats.shm_max_bytes) == (0, 0)


def test_the_loaders_statistics_have_each_actors_figures_and_the_verdict_names_them(
    workers: RayWorkers,
) -> None:
    """Slow samples: the actors are the bottleneck, and the loader's own ``statistics()``
    says so per actor (batches, bytes, busy share, restarts), as the pool's does."""
    with DataLoader(
        Numbered(delay=0.05), batch_size=BATCH, workers=workers, persistent_workers=True
    ) as loader:
        list(loader)  # the first epoch's wall time includes loading the copy in the actors
        got = list(loader)
        stats = loader.statistics()
    assert indices(got) == list(range(N))
    figures = stats.workers
    assert [w.id for w in figures] == [0, 1]
    assert sum(w.batches for w in figures) == 2 * N // BATCH
    assert sum(w.bytes for w in figures) == stats.bytes_yielded
    assert all(w.node is not None and w.restarts == 0 for w in figures)
    busy = [w for w in figures if w.batches]
    assert busy
    assert all(0 < w.busy_share <= 1 for w in busy)
    assert all(w.busy_s >= BATCH * 0.05 * w.batches for w in busy)
    assert stats.as_dict()["workers/0/batches"] == figures[0].batches
    assert f"worker 0 (node {str(figures[0].node)[:12]}" in str(stats)
    assert stats.bottleneck == "workers", stats.epoch_stats.hint
    assert "per worker, busiest: worker" in stats.epoch_stats.hint


def test_errors_keep_their_type_and_skips_are_named(workers: RayWorkers) -> None:
    with DataLoader(FailsOn(frozenset({5})), batch_size=BATCH, workers=workers) as loader:
        it = iter(loader)
        assert next(it).ravel().tolist() == [0, 1, 2, 3]
        with pytest.raises(KeyError, match="corrupt") as caught:
            list(it)
    notes = "\n".join(caught.value.__notes__)
    assert "Ray actor" in notes
    assert "batch 1" in notes
    with DataLoader(
        FailsOn(frozenset({5, 9})),
        batch_size=BATCH,
        workers=workers,
        on_error="skip",
        max_failures=2,
    ) as loader:
        got = [int(i) for b in loader for i in b.ravel()]
        skipped = loader.statistics().skipped
    assert got == [i for i in range(N) if i not in (5, 9)]
    assert sorted(index for index, _ in skipped) == [5, 9]  # in the order batches came in
    assert all("corrupt" in why for _, why in skipped)


def test_a_failing_worker_init_fn_fails_the_first_batch_without_retries(
    workers: RayWorkers,
) -> None:
    with DataLoader(
        Numbered(), batch_size=BATCH, workers=workers, worker_init_fn=_broken_init, max_retries=3
    ) as loader:
        with pytest.raises(WorkerInitError, match="broken on purpose"):
            next(iter(loader))
        assert loader.statistics().retries == 0


def _broken_init(worker_id: int) -> None:
    raise OSError("broken on purpose")


class Offset(Numbered):
    """Sample ``i`` is ``i + offset``: a change the loader's next dataset copy carries."""

    offset = 0

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": np.array([i + self.offset])}


@pytest.mark.parametrize("persistent", [False, True])
def test_persistent_workers_decides_whether_each_epoch_brings_a_new_copy(
    workers: RayWorkers, persistent: bool
) -> None:
    dataset = Offset(n=8)
    with DataLoader(dataset, batch_size=4, workers=workers, persistent_workers=persistent) as ld:
        first = indices(list(ld))
        dataset.offset = 100  # after the first epoch's copy was made
        second = indices(list(ld))
    assert first == list(range(8))
    assert second == (first if persistent else [i + 100 for i in range(8)])


def test_one_loader_iterated_with_for_then_async_for(workers: RayWorkers) -> None:
    """The first epoch runs on the pool's loop, the second on the caller's: the actors' copy
    and their readiness carry over from one loop to the other."""

    async def epoch(loader: DataLoader) -> list[int]:
        return [int(i) for b in [b async for b in loader] for i in b["index"].ravel()]

    with DataLoader(Numbered(), batch_size=BATCH, workers=workers) as loader:
        first = indices(list(loader))
        second = asyncio.run(epoch(loader))
    assert first == second == list(range(N))


# -- faults -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", [Numbered, Large], ids=["object-store", "shared-memory"])
def test_an_actor_killed_by_its_pid_mid_epoch_is_replaced_and_nothing_is_lost(
    ray_cluster: str, dataset: type[Numbered]
) -> None:
    """Also when its batch was being collated into a slot of this process's shared memory (the
    second epoch's batches all are, their size known): the batch is made again and no slot
    stays leased. (That the dead actor's slot is never leased again, since it may write on as
    it dies, is tested in ``test_ray_actor``: here nothing tells which slot it held.)"""
    # No CPU reservation, as in the hung-actor test: the replacement is placed at once.
    with RayWorkers(2, num_cpus=0) as pool:
        loader = DataLoader(
            dataset(delay=0.05),
            batch_size=BATCH,
            workers=pool,
            max_retries=2,
            timeout=SLOW_BATCH_S,
            persistent_workers=True,
        )
        with loader:
            if dataset is Large:
                assert indices(list(loader)) == list(range(N))
                assert pool.statistics().live_shm_slots > 0
            it = iter(loader)
            got = [next(it)]
            victim = pool.statistics().actors[0]
            assert victim.pid is not None
            os.kill(victim.pid, signal.SIGKILL)
            got.extend(it)
            stats = loader.statistics()
        after = pool.statistics()
    assert indices(got) == list(range(N))  # in order, each sample once
    assert after.leased_shm_slots == 0
    assert stats.worker_restarts >= 1
    assert after.actors[0].restarts >= 1
    assert after.actors[0].pid != victim.pid


@pytest.mark.parametrize("width", [1, LARGE], ids=["object-store", "shared-memory"])
def test_a_hung_actor_is_killed_at_the_deadline_and_its_batch_re_run(
    ray_cluster: str, tmp_path: Path, width: int
) -> None:
    """Batch 4 hangs: it was sent once batch 0 came back, so large batches' went into a slot,
    which no job holds once the hung actor is killed (it is dropped from the pool: the dying
    actor may write on)."""
    dataset = HangsOnce(str(tmp_path / "hung"), hang_at=17, width=width)
    # No CPU reservation: the replacement is placed at once even while the other test
    # processes' actors hold the shared cluster's CPUs (else it waits for one, up to its 120 s
    # start deadline, past this test's time limit, on a busy machine).
    with (
        RayWorkers(2, num_cpus=0) as pool,
        DataLoader(dataset, batch_size=BATCH, workers=pool, timeout=3, max_retries=1) as loader,
    ):
        got = [int(i) for b in loader for i in b[:, 0]]
        stats = loader.statistics()
        after = pool.statistics()
    assert got == list(range(N))
    assert after.leased_shm_slots == 0
    assert (after.live_shm_slots > 0) == (width == LARGE)
    assert stats.timeouts == 1
    assert stats.retries == 1
    assert stats.worker_restarts == 1


def test_a_hung_actor_without_retries_times_out_naming_the_batch(
    ray_cluster: str, tmp_path: Path
) -> None:
    dataset = HangsOnce(str(tmp_path / "hung"), hang_at=0)
    with RayWorkers(1, num_cpus=0.5) as pool:
        with (
            DataLoader(dataset, batch_size=BATCH, workers=pool, timeout=2) as loader,
            pytest.raises(LoaderTimeoutError, match="batch 0"),
        ):
            next(iter(loader))
        assert pool.statistics().worker_restarts == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_lost_node_s_actor_is_replaced_and_an_unplaceable_one_times_out_naming_why(
    ray_cluster: str,
) -> None:
    """A node of the cluster goes away mid-epoch (every process of it killed): its actor's
    batches are re-run on its replacement, placed on the head, every sample once and in order;
    a loader whose actor asked for what only that node had gets, within its ``timeout`` per
    attempt, a timeout error that says no CPU is free to place the replacement actor."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from ray_cluster import EXTRA_NODE_CPUS, HEAD_RESOURCE, extra_node

    head = ray.get_runtime_context().get_node_id()
    with extra_node(ray_cluster) as (node, lose):
        there = NodeAffinitySchedulingStrategy(node, soft=True)  # elsewhere once it is lost
        with (
            RayWorkers(
                1, num_cpus=0, resources={HEAD_RESOURCE: 1}, scheduling_strategy=there
            ) as movable,
            RayWorkers(1, num_cpus=EXTRA_NODE_CPUS - 1) as stranded,  # fits that node alone
            DataLoader(
                Numbered(delay=0.05),
                batch_size=BATCH,
                workers=movable,
                max_retries=2,
                timeout=SLOW_BATCH_S / 3,
            ) as loader,
            DataLoader(
                Numbered(delay=0.2),
                batch_size=BATCH,
                workers=stranded,
                max_retries=1,
                timeout=3,
                prefetch=1,
            ) as doomed,
        ):
            assert {a.node_id for a in movable.statistics().actors} == {node}
            assert {a.node_id for a in stranded.statistics().actors} == {node}
            it, lost_it = iter(loader), iter(doomed)
            got = [next(it)]
            assert indices([next(lost_it)]) == list(range(BATCH))
            lose()
            started = time.monotonic()
            _, error = take_until_error(lost_it, N // BATCH)  # one made before it was lost
            waited = time.monotonic() - started
            got.extend(it)
            movable.start()  # every replacement up (the last one may have had no batch left)
            moved = movable.statistics()
            del it, lost_it
    assert indices(got) == list(range(N))  # in order, each sample once
    assert {a.node_id for a in moved.actors} == {head}
    assert all(a.restarts >= 1 for a in moved.actors)
    assert isinstance(error, LoaderTimeoutError), error
    message = str(error)
    assert "no CPU free to place the replacement actor 0" in message
    assert f"'CPU': {float(EXTRA_NODE_CPUS - 1)}" in message  # what it asks for
    assert waited < SLOW_BATCH_S  # two attempts of 3 s each, and the death noticed


# -- resume ---------------------------------------------------------------------------------


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(cut=st.integers(0, N // BATCH), into=st.sampled_from(["threads", "actors", "one actor"]))
def test_resume_at_any_cut_continues_exactly_into_actors_or_local_workers(
    workers: RayWorkers, one_actor: RayWorkers, cut: int, into: str
) -> None:
    common: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "seed": 3}
    with DataLoader(Numbered(), workers=workers, **common) as loader:
        whole = list(loader)
    with DataLoader(Numbered(), workers=workers, **common) as loader:
        it = iter(loader)
        taken = [next(it) for _ in range(cut)]
        state = loader.state_dict()
        del it
    choices: dict[str, dict[str, Any]] = {
        "threads": {"num_workers": 0},
        "actors": {"workers": workers},
        "one actor": {"workers": one_actor},  # another actor count than the state's
    }
    resumed_with = choices[into]
    with DataLoader(Numbered(), **resumed_with, **common) as loader:
        loader.load_state_dict(state)
        rest = list(loader)
    if cut == len(whole):  # saved after the epoch's last batch: the next epoch, whole
        assert sorted(indices(rest)) == list(range(N))
        return
    assert indices(taken + rest) == indices(whole)
    draws = [b["draw"].tolist() for b in whole[cut:]]
    if into != "threads":  # threads share the process's generators: not reseeded per batch
        assert [b["draw"].tolist() for b in rest] == draws


# -- streams (iterable datasets) ----------------------------------------------------------------

STREAM_N = 30
STREAM_BATCH = 3


@pytest.mark.parametrize("self_sharded", [False, True], ids=["split-by-loader", "self-sharded"])
def test_actors_read_a_stream_as_worker_processes_do(
    workers: RayWorkers, self_sharded: bool
) -> None:
    """Each actor reads its share: split by the loader, or by the dataset itself from
    ``get_worker_info()`` in the actor. The batches and their order are two local worker
    processes' (round-robin over the readers); every item once."""

    def loader(**how: Any) -> DataLoader:
        dataset = Resumable(STREAM_N, self_sharded=self_sharded)
        return DataLoader(dataset, batch_size=STREAM_BATCH, **how)

    with loader(workers=workers) as remote:
        got = as_lists(list(remote))
        again = as_lists(list(remote))  # the next epoch opens the streams afresh
    with loader(num_workers=2) as local:
        expected = as_lists(list(local))
    assert got == again == expected
    assert sorted(i for b in got for i in b) == list(range(STREAM_N))


class LargeStream(Resumable):
    """:class:`datasets.Resumable` whose item ``i`` is 64 KiB, all ``i``: its batches go in
    slots from an actor on this machine."""

    def __iter__(self) -> Iterator[Any]:
        for i in super().__iter__():
            yield np.full(LARGE, i, dtype=np.int64)


def test_a_large_stream_comes_in_shared_memory_as_local_workers_read_it_and_resumes_exactly(
    ray_cluster: str,
) -> None:
    """A stream's pulls go into slots too (once a batch came back): the batches and their
    order are two local worker processes', and a state taken mid-epoch resumes exactly into
    local workers."""

    def loader(**how: Any) -> DataLoader:
        return DataLoader(LargeStream(STREAM_N), batch_size=STREAM_BATCH, prefetch=2, **how)

    def firsts(batches: list[Any]) -> list[list[int]]:
        return [b[:, 0].tolist() for b in batches]

    with loader(num_workers=2) as local:
        expected = firsts(list(local))
    with RayWorkers(2, num_cpus=0) as pool:
        with loader(workers=pool) as remote:
            got = list(remote)
            assert pool.statistics().held_shm_slots >= len(got) - 2
            assert firsts(got) == expected
            del got
            it = iter(remote)
            taken = firsts([next(it) for _ in range(3)])
            state = remote.state_dict()
            del it
        # The pulls given up with the iterator keep their slots until their actors answer
        # (the closed loader's copy dropped, a pull waiting for its turn fails at once).
        deadline = time.monotonic() + SLOW_BATCH_S
        while pool.statistics().leased_shm_slots and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.statistics().leased_shm_slots == 0
    with loader(num_workers=2) as resumed:
        resumed.load_state_dict(state)
        assert taken + firsts(list(resumed)) == expected


@pytest.mark.parametrize(
    ("saved_on", "resumed_on"),
    [("actors", "local"), ("local", "actors"), ("actors", "actors")],
)
def test_a_stream_resumes_exactly_between_actors_and_worker_processes(
    workers: RayWorkers, saved_on: str, resumed_on: str
) -> None:
    def loader(on: str) -> DataLoader:
        how: dict[str, Any] = {"workers": workers} if on == "actors" else {"num_workers": 2}
        return DataLoader(Resumable(STREAM_N), batch_size=STREAM_BATCH, **how)

    with loader("actors") as whole:
        expected = as_lists(list(whole))
    with loader(saved_on) as first:
        it = iter(first)
        taken = as_lists([next(it) for _ in range(3)])  # readers 0, 1, 0: reader 1's turn
        state = first.state_dict()
        del it
    assert state["streams"]["readers"] == 2
    with loader(resumed_on) as resumed:
        resumed.load_state_dict(state)
        assert taken + as_lists(list(resumed)) == expected


def take_until_error(it: Iterator[Any], most: int) -> tuple[list[list[int]], Exception | None]:
    """The batches ``it`` yields (``most`` at most) before one raises, and that error."""
    got: list[list[int]] = []
    for _ in range(most):
        try:
            batch = next(it)
        except StopIteration:
            break
        except Exception as exc:
            return got, exc
        got += as_lists([batch])
    return got, None


def test_a_killed_actors_stream_ends_its_reader_and_its_state_resumes_it_exactly(
    ray_cluster: str,
) -> None:
    """As with worker processes: the batch the actor was reading fails naming it, once (a
    stream is never read twice), the other readers go on, and a ``state_dict()`` taken at the error
    resumes the dead reader where its last batch taken left it: every item exactly once."""
    dataset = SlowResumable(STREAM_N, delay=0.05)
    with RayWorkers(2, num_cpus=0) as pool:
        with DataLoader(dataset, batch_size=STREAM_BATCH, workers=pool) as loader:
            expected = as_lists(list(loader))
        with DataLoader(dataset, batch_size=STREAM_BATCH, workers=pool, prefetch=4) as loader:
            it = iter(loader)
            taken = as_lists([next(it)])
            victim = pool.statistics().actors[0].pid
            assert victim is not None
            os.kill(victim, signal.SIGKILL)
            more, error = take_until_error(it, len(expected))  # read before the kill
            taken += more
            assert isinstance(error, WorkerCrashedError), error
            assert f"Ray actor 0 (pid {victim}" in str(error)
            state = loader.state_dict()
            # The dead reader's other pulls on their way (prefetch) end it with that one
            # error: the other reader's batches come, and no second WorkerCrashedError.
            after, again = take_until_error(it, len(expected))
            del it
        restarts = pool.statistics().actors[0].restarts
    assert restarts == 1
    with DataLoader(SlowResumable(STREAM_N), batch_size=STREAM_BATCH, num_workers=2) as resumed:
        resumed.load_state_dict(state)
        rest = as_lists(list(resumed))
    assert taken + rest == expected
    assert again is None, again
    assert after
    assert all(batch in rest for batch in after)


def test_async_streams_and_tar_shards_are_decoded_in_the_actors_and_resume_exactly(
    workers: RayWorkers, tmp_path: Path
) -> None:
    """An async iterable dataset is read on the training process's loop (one reader) and its
    samples decoded and collated in the actors; ``TarDataset`` likewise, shuffled."""
    with DataLoader(AsyncResumable(STREAM_N), batch_size=4, workers=workers) as loader:
        it = iter(loader)
        taken = as_lists([next(it) for _ in range(2)])
        state = loader.state_dict()
        del it
    with DataLoader(AsyncResumable(STREAM_N), batch_size=4, workers=workers) as loader:
        loader.load_state_dict(state)
        rest = as_lists(list(loader))
    assert taken + rest == [list(range(i, min(i + 4, STREAM_N))) for i in range(0, STREAM_N, 4)]

    paths = []
    for shard in range(4):
        path = tmp_path / f"shard-{shard}.tar"
        path.write_bytes(tar_shard(shard, 3 + shard))
        paths.append(str(path))

    def tar_loader(**how: Any) -> DataLoader:
        ds = TarDataset(paths, decode=tar_sample, shuffle=True, shuffle_buffer=6, seed=9)
        return DataLoader(ds, batch_size=3, collate_fn=keep, **how)

    def keys(batches: list[Any]) -> list[str]:
        return [sample["key"] for batch in batches for sample in batch]

    async def read(state: dict[str, Any] | None, cut: int | None) -> tuple[list[Any], Any]:
        # On a loop of its own (asyncio.run), whose file-reading threads end with it.
        async with tar_loader(workers=workers) as loader:
            if state is not None:
                loader.load_state_dict(state)
            it = aiter(loader)
            if cut is None:
                return [batch async for batch in it], None
            head = [await anext(it) for _ in range(cut)]
            saved = loader.state_dict()
            await it.aclose()
            return head, saved

    with tar_loader(num_workers=0) as local:
        full = keys(list(local))
    head, state = asyncio.run(read(None, 2))
    tail, _ = asyncio.run(read(state, None))
    assert keys(head + tail) == full
    assert sorted(full) == tar_keys(4, lambda shard: 3 + shard)
    assert os.getpid() not in {s["pid"] for batch in head + tail for s in batch}  # in actors


def test_parquet_rows_are_decoded_in_the_actors_in_local_workers_order_and_resume_there(
    workers: RayWorkers, tmp_path: Path
) -> None:
    """A ``ParquetDataset`` (an async iterable one, shuffled): every row once, in the order two
    local worker processes give; a state taken mid-epoch on actors resumes in local workers
    with exactly the rest."""
    rows = (5, 7, 3)
    paths = []
    for file, count in enumerate(rows):
        path = tmp_path / f"part-{file}.parquet"
        path.write_bytes(parquet_bytes(file, count, 3))  # row groups of 3 rows
        paths.append(str(path))

    def loader(**how: Any) -> DataLoader:
        ds = ParquetDataset(paths, decode=parquet_row, shuffle=True, shuffle_buffer=4, seed=5)
        return DataLoader(ds, batch_size=2, collate_fn=keep, **how)

    def ids(batches: list[Any]) -> list[int]:
        return [row["id"] for batch in batches for row in batch]

    with loader(num_workers=2) as local:
        expected = ids(list(local))
    assert sorted(expected) == [f * 1000 + i for f, n in enumerate(rows) for i in range(n)]

    async def on_actors(cut: int | None) -> tuple[list[Any], Any]:
        # On a loop of its own (asyncio.run), whose file-reading threads end with it (the
        # pool's own loop, that `for` would use, keeps them as long as the pool).
        async with loader(workers=workers) as remote:
            it = aiter(remote)
            if cut is None:
                return [batch async for batch in it], None
            head = [await anext(it) for _ in range(cut)]
            state = remote.state_dict()
            await it.aclose()
            return head, state

    whole, _ = asyncio.run(on_actors(None))
    head, state = asyncio.run(on_actors(3))
    assert ids(whole) == expected
    assert os.getpid() not in {row["pid"] for batch in whole + head for row in batch}
    with loader(num_workers=2) as resumed:
        resumed.load_state_dict(state)
        assert ids(head) + ids(list(resumed)) == expected


# -- async datasets in the actors -------------------------------------------------------------


def test_an_async_dataset_is_fetched_in_the_actors_many_items_at_once(ray_cluster: str) -> None:
    with (
        RayWorkers(1, num_cpus=0.5) as pool,
        DataLoader(
            Concurrent(), batch_size=8, workers=pool, io_concurrency=16, collate_fn=numpy_collate
        ) as loader,
    ):
        got = list(loader)
    rows = np.concatenate(got)
    assert rows[:, 0].tolist() == list(range(32))
    assert rows[:, 2].tolist().count(os.getpid()) == 0  # fetched in the actor, not here
    assert rows[:, 1].max() > 8  # items of several batches in flight in the actor at once


def test_an_http_dataset_is_read_through_actors(workers: RayWorkers) -> None:
    from http_server import FaultServer, payload

    from aioloader.sources import HTTPDataset

    with FaultServer().in_thread() as server:
        dataset = HTTPDataset([server.url(f"/obj/{i}") for i in range(12)])
        with DataLoader(dataset, batch_size=4, workers=workers, collate_fn=list) as loader:
            got = [body for batch in loader for body in batch]
    assert got == [payload(i) for i in range(12)]


# -- the loader inside an actor -----------------------------------------------------------------


def test_the_loader_runs_inside_an_actors_event_loop_while_it_serves_calls(
    ray_cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/ray_actor.py: a trainer actor iterates a loader (on RayWorkers) with
    ``async for``, and answers other calls while it is mid-epoch (paused between two steps)."""
    import ray

    monkeypatch.syspath_prepend(str(EXAMPLES))
    import ray_actor  # type: ignore[import-not-found]  # examples/, put on the path above

    batches = 6
    trainer = ray_actor.Trainer.options(num_cpus=0).remote(samples=batches * 4, batch_size=4)
    try:
        done = trainer.train.remote(actors=2, num_cpus=0.25)
        for _ in range(int(SLOW_BATCH_S / 0.05)):
            if ray.get(trainer.progress.remote(), timeout=SLOW_BATCH_S) > 0:
                break
            time.sleep(0.05)
        ray.get(trainer.pause.remote(), timeout=SLOW_BATCH_S)
        paused_at = ray.get(trainer.progress.remote(), timeout=SLOW_BATCH_S)
        ready, _ = ray.wait([done], timeout=0.3)
        assert not ready
        assert 0 < paused_at < batches
        assert ray.get(trainer.progress.remote(), timeout=SLOW_BATCH_S) == paused_at
        ray.get(trainer.resume.remote(), timeout=SLOW_BATCH_S)
        assert ray.get(done, timeout=SLOW_BATCH_S) == list(range(batches * 4))
    finally:
        ray.kill(trainer)


def test_closing_the_pool_kills_its_actors(ray_cluster: str) -> None:
    import psutil

    pool = RayWorkers(2, num_cpus=0)
    pool.start()
    pids = pool.worker_pids
    assert len(pids) == 2
    pool.close()
    deadline = time.monotonic() + 20
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(psutil.pid_exists(p) for p in pids)
    assert pool.closed
    assert pool.worker_pids == ()
    with pytest.raises(ValueError, match="closed"):
        DataLoader(Numbered(), workers=pool)


def test_exported_through_the_facade() -> None:
    assert aioloader.RayWorkers.__module__ == "aioloader"
    assert threading.current_thread() is threading.main_thread()
