"""aioloader under PyTorch Lightning 2.x: fit, same data as a plain loop, exact resume, DDP.

Lightning takes any iterable with ``len()`` as a dataloader. It probes it with ``iter()``
before training (an iterator made and dropped: aioloader's iterators are lazy, so the probe
costs no epoch), counts ``len(loader)`` batches an epoch and never asks for the one past the
end, and saves ``loader.state_dict()`` into checkpoints (any loader with ``state_dict`` and
``load_state_dict`` is one it saves), restoring it with ``load_state_dict`` before the resumed
epoch. Single-process tests run here; multi-process ones (``ddp`` re-runs a script, so it
cannot run inside pytest) run ``scripts/lightning_ddp.py`` in a child process, once per
strategy.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
from typing import Any

import lightning as L
import pytest
import torch
from framework_data import (
    BATCH,
    Indexed,
    Record,
    assert_disjoint_shares,
    child_pythonpath,
    gloo_environment,
    record,
    without_noise,
)
from lightning_model import Recorder, SaveThenStop, Stop, ValRecorder, trainer

import aioloader

pytestmark = [
    # torch 2.15 deprecates a pytree idiom that Lightning 2.6 still uses.
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning"),
]

SEED = 7
SCRIPTS = pathlib.Path(__file__).parent / "scripts"
# A hang guard, not a speed check: two fits of two spawned processes each. On a GPU host with a
# CUDA build of torch (slower to import) and mpi4py, the script alone took 49 s.
DDP_LIMIT_S = 150.0


def make_loader(num_workers: int = 0, n: int = 40) -> aioloader.DataLoader:
    return aioloader.DataLoader(
        Indexed(n), batch_size=BATCH, shuffle=True, seed=SEED, num_workers=num_workers
    )


def plain_loop(num_workers: int, epochs: int = 2) -> list[Record]:
    """What a plain ``for`` loop over a fresh loader with the same settings yields."""
    with make_loader(num_workers) as loader:
        return [record(batch) for _ in range(epochs) for batch in loader]


def comparable(records: list[Record], num_workers: int) -> list[Any]:
    # Noise is reproducible in worker processes only (see framework_data.Indexed).
    return list(records) if num_workers else without_noise(records)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_fit_trains_on_the_batches_a_plain_loop_yields(num_workers: int) -> None:
    expected = plain_loop(num_workers)
    model = ValRecorder()
    with make_loader(num_workers) as train, aioloader.DataLoader(Indexed(16), batch_size=8) as val:
        fit = trainer()
        fit.fit(model, train_dataloaders=train, val_dataloaders=val)
        assert fit.num_training_batches == len(train) == 5
        # Lightning's iter() probes and its len() took no batch: two epochs, nothing more.
        assert train.statistics().batches_yielded == 2 * len(train)
        assert train.statistics().epoch == 1
    assert comparable(model.train_records, num_workers) == comparable(expected, num_workers)
    # The sanity check (2 batches), then the whole validation set after each epoch.
    assert [r[0] for r in model.val_records] == [list(range(8)), list(range(8, 16))] * 3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("steps", "num_workers"),
    [
        (3, 0),  # mid epoch 0
        (5, 0),  # the last batch of epoch 0: the epoch is complete, resume starts epoch 1
        (7, 0),  # mid epoch 1
        (7, 2),  # worker processes: the resumed batches carry the same random augmentation
    ],
)
def test_resume_from_a_checkpoint_trains_on_exactly_the_remaining_batches(
    steps: int, num_workers: int, tmp_path: pathlib.Path
) -> None:
    expected = plain_loop(num_workers)
    checkpoint = str(tmp_path / "stopped.ckpt")
    first, second = Recorder(), Recorder()
    with make_loader(num_workers) as loader, pytest.raises(Stop):
        trainer(callbacks=[SaveThenStop(steps, checkpoint)]).fit(first, loader)
    assert len(first.train_records) == steps
    # A new process would make a new loader with the same settings: so does this.
    with make_loader(num_workers) as loader:
        trainer().fit(second, loader, ckpt_path=checkpoint, weights_only=True)
    got = first.train_records + second.train_records
    assert comparable(got, num_workers) == comparable(expected, num_workers)


def test_checkpoint_holds_the_loaders_state_as_plain_data(tmp_path: pathlib.Path) -> None:
    checkpoint = str(tmp_path / "stopped.ckpt")
    with make_loader() as loader, pytest.raises(Stop):
        trainer(callbacks=[SaveThenStop(2, checkpoint)]).fit(Recorder(), loader)
    # weights_only: nothing but containers, numbers and strings (a safe checkpoint).
    saved = torch.load(checkpoint, weights_only=True)
    (state,) = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert (state["epoch"], state["done"], state["seed"]) == (0, [0, 1], SEED)


@pytest.fixture
def lightning_seed_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """seed_everything writes PL_GLOBAL_SEED and PL_SEED_WORKERS into os.environ: undo them."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")
    monkeypatch.setenv("PL_SEED_WORKERS", "0")


@pytest.mark.slow
@pytest.mark.usefixtures("lightning_seed_env")
def test_seed_everything_with_workers_sets_the_loaders_worker_init_fn() -> None:
    # Lightning then assigns its own worker_init_fn to every loader that has none.
    expected = plain_loop(num_workers=2)
    L.seed_everything(3, workers=True)
    model = Recorder()
    loader = make_loader(num_workers=2)  # not started yet: its workers get Lightning's function
    try:
        trainer().fit(model, loader)
        assert isinstance(loader.worker_init_fn, functools.partial)
    finally:
        loader.close()
    # The workers reseed before each batch from (seed, epoch, batch): same data as before.
    assert model.train_records == expected


@pytest.mark.usefixtures("lightning_seed_env")
def test_seed_everything_fixes_the_order_of_a_loader_made_without_a_seed() -> None:
    orders = []
    for _ in range(2):
        L.seed_everything(3)
        with aioloader.DataLoader(Indexed(), batch_size=BATCH, shuffle=True) as loader:
            orders.append([r[0] for r in map(record, loader)])
    assert orders[0] == orders[1]


@pytest.mark.slow
def test_the_example_trains(tmp_path: pathlib.Path) -> None:
    example = pathlib.Path(__file__).parent.parent / "examples" / "lightning_train.py"
    done = subprocess.run(
        [sys.executable, str(example), "--epochs", "1", "--workers", "0"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": child_pythonpath()},
        capture_output=True,
        text=True,
        timeout=DDP_LIMIT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("step")]
    assert len(steps) == 8  # 64 samples, batch 8, 1 epoch


# -- several processes ------------------------------------------------------------------------


def run_ddp_script(strategy: str, outdir: pathlib.Path) -> dict[str, Any]:
    """Run ``scripts/lightning_ddp.py`` with ``strategy``; returns what each case left."""
    # PYTHONFAULTHANDLER: a rank that dies of a signal prints every thread's stack into the
    # output a failure shows.
    env = {
        **os.environ,
        **gloo_environment(),
        "PYTHONPATH": child_pythonpath(),
        "PYTHONFAULTHANDLER": "1",
    }
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, str(SCRIPTS / "lightning_ddp.py"), strategy, str(outdir)]
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    ) as child:
        try:
            output, _ = child.communicate(timeout=DDP_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the script and the ranks it started
            output, _ = child.communicate()
            pytest.fail(f"{strategy} run overran {DDP_LIMIT_S} s:\n{output.decode()[-3000:]}")
    found: dict[str, Any] = {"output": output.decode(), "returncode": child.returncode}
    for path in outdir.iterdir():
        if path.suffix == ".json":
            found[path.stem] = json.loads(path.read_text())
        elif path.suffix == ".txt":
            found[path.stem] = path.read_text()
    return found


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ddp_script("ddp", tmp_path_factory.mktemp("ddp"))


@pytest.fixture(scope="module")
def ddp_spawn_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ddp_script("ddp_spawn", tmp_path_factory.mktemp("ddp_spawn"))


def batches_per_rank(run: dict[str, Any], case: str) -> list[list[list[int]]]:
    """The indices of every batch each of the 2 ranks trained on in ``case``."""
    tail = run["output"][-4000:]
    assert f"{case}-error" not in run, f"{run[f'{case}-error']}\nthe ranks' output:\n{tail}"
    ranks = [run.get(f"{case}-rank{r}") for r in range(2)]
    assert all(ranks), f"a rank wrote nothing:\n{tail}"
    assert [rank["world_size"] for rank in ranks] == [2, 2]  # type: ignore[index]
    return [[r[0] for r in rank["records"]] for rank in ranks]  # type: ignore[index]


@pytest.mark.slow
def test_ddp_loader_made_in_the_hook_reads_its_ranks_share(ddp_run: dict[str, Any]) -> None:
    # Made once Lightning has made the process group: it shards by itself.
    assert_disjoint_shares(batches_per_rank(ddp_run, "hook"))


@pytest.mark.slow
def test_ddp_loader_made_in_the_hook_with_a_distributed_sampler(ddp_run: dict[str, Any]) -> None:
    assert_disjoint_shares(batches_per_rank(ddp_run, "sampler"))


@pytest.mark.slow
def test_ddp_loader_passed_to_fit_gives_each_rank_a_disjoint_share(
    ddp_run: dict[str, Any],
) -> None:
    assert_disjoint_shares(batches_per_rank(ddp_run, "passed"))


@pytest.mark.slow
def test_ddp_spawn_loader_made_in_the_hook(ddp_spawn_run: dict[str, Any]) -> None:
    assert_disjoint_shares(batches_per_rank(ddp_spawn_run, "hook"))


@pytest.mark.slow
def test_ddp_spawn_pickles_the_loader_passed_to_fit(ddp_spawn_run: dict[str, Any]) -> None:
    # The loader travels pickled into each spawned rank, and takes its share there once fit()
    # has made the group.
    assert_disjoint_shares(batches_per_rank(ddp_spawn_run, "passed"))
