"""aioloader under Hugging Face accelerate: prepare, skip_first_batches, checkpoints, 2 ranks.

``Accelerator.prepare`` rebuilds only ``torch.utils.data.DataLoader`` objects; any other
iterable, an aioloader loader included, comes back unchanged: batches flow as aioloader makes
them (on CPU here; with ``device=`` aioloader copies them itself). ``skip_first_batches``
builds a *torch* DataLoader over the loader's ``dataset``, its ``batch_sampler`` (wrapped to
skip) and its settings read by torch's names (``collate_fn``, ``num_workers``, ``timeout``,
``prefetch_factor`` ...): exact for map-style datasets whose samples depend on the index (no
``transform``, no async dataset: that loader is torch's, not aioloader's). The exact way for
every dataset is the loader's own state: ``register_for_checkpointing(loader)``, then
``save_state`` / ``load_state``.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
from typing import Any

import pytest
import torch
from accelerate import Accelerator
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

import aioloader

SEED = 7
SCRIPT = pathlib.Path(__file__).parent / "scripts" / "accelerate_ddp.py"
TWO_RANKS_LIMIT_S = 50.0


def make_loader(num_workers: int = 0) -> aioloader.DataLoader:
    return aioloader.DataLoader(
        Indexed(), batch_size=BATCH, shuffle=True, seed=SEED, num_workers=num_workers
    )


def plain_epochs(num_workers: int = 0, epochs: int = 3) -> list[list[Record]]:
    with make_loader(num_workers) as loader:
        return [[record(batch) for batch in loader] for _ in range(epochs)]


def test_prepare_returns_the_loader_itself_and_trains_on_its_batches() -> None:
    expected = plain_epochs(epochs=2)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[list[Record]] = []
    with make_loader() as loader:
        model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
        assert prepared is loader
        for _ in range(2):
            seen.append([])
            for batch in prepared:
                seen[-1].append(record(batch))
                loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    assert [without_noise(e) for e in seen] == [without_noise(e) for e in expected]


@pytest.mark.parametrize("epoch", [0, 1])
def test_skip_first_batches_yields_exactly_the_rest_of_the_epoch(epoch: int) -> None:
    expected = plain_epochs()
    accelerator = Accelerator(cpu=True)
    with make_loader() as loader:
        loader.set_epoch(epoch)  # as a resumed script does for the epoch it resumes
        skipped = accelerator.skip_first_batches(loader, 2)
        assert isinstance(skipped, torch.utils.data.DataLoader)
        assert len(skipped) == len(loader) - 2
        rest = [record(batch) for batch in skipped]
        # The loader itself goes on with the next epoch.
        loader.set_epoch(epoch + 1)
        following = [record(batch) for batch in loader]
    assert without_noise(rest) == without_noise(expected[epoch][2:])
    assert without_noise(following) == without_noise(expected[epoch + 1])


@pytest.mark.slow
def test_register_for_checkpointing_resumes_exactly(tmp_path: pathlib.Path) -> None:
    # Worker processes: even the random augmentation of the remaining batches is the same.
    expected = plain_epochs(num_workers=2, epochs=3)
    accelerator = Accelerator(cpu=True)
    with make_loader(num_workers=2) as loader:
        accelerator.register_for_checkpointing(loader)
        first = [record(batch) for batch in loader]
        it = iter(loader)
        first += [record(next(it)) for _ in range(2)]
        accelerator.save_state(str(tmp_path))
        del it
    accelerator = Accelerator(cpu=True)  # as a new process would
    with make_loader(num_workers=2) as loader:
        accelerator.register_for_checkpointing(loader)
        accelerator.load_state(str(tmp_path))
        rest = [record(batch) for _ in range(2) for batch in loader]
    assert first + rest == expected[0] + expected[1] + expected[2]


# -- two processes ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the script as 2 ranks, with the environment torchrun gives its workers."""
    outdir = tmp_path_factory.mktemp("accelerate")
    base = {
        **os.environ,
        **gloo_environment(),
        "PYTHONPATH": child_pythonpath(),
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
    }
    children = []
    try:
        for rank in range(2):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            children.append(
                subprocess.Popen(
                    [sys.executable, str(SCRIPT), str(outdir)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        outputs = [child.communicate(timeout=TWO_RANKS_LIMIT_S)[0].decode() for child in children]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the 2-rank run overran {TWO_RANKS_LIMIT_S} s")
    finally:
        for child in children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
    found: dict[str, Any] = {"outputs": outputs, "returncodes": [c.returncode for c in children]}
    for path in outdir.glob("*.json"):
        found[path.stem] = json.loads(path.read_text())
    return found


def trained(run: dict[str, Any], case: str) -> list[dict[str, Any]]:
    """What each of the 2 ranks reported for ``case``."""
    ranks = [run.get(f"{case}-rank{r}") for r in range(2)]
    assert all(ranks), f"a rank wrote nothing: {run['returncodes']}\n{run['outputs'][0][-3000:]}"
    return ranks  # type: ignore[return-value]


def batches_per_rank(ranks: list[dict[str, Any]]) -> list[list[list[int]]]:
    return [[r[0] for r in rank["records"]] for rank in ranks]


@pytest.mark.slow
def test_two_ranks_with_a_distributed_sampler_train_in_step_on_disjoint_shares(
    two_ranks: dict[str, Any],
) -> None:
    ranks = trained(two_ranks, "explicit")
    assert [rank["world_size"] for rank in ranks] == [2, 2]
    assert_disjoint_shares(batches_per_rank(ranks))
    # Gradients were averaged across the ranks: both hold the same weights.
    assert ranks[0]["weights"] == ranks[1]["weights"]


@pytest.mark.slow
def test_two_ranks_default_loader_reads_its_ranks_share(two_ranks: dict[str, Any]) -> None:
    # Made after the Accelerator, which made the process group: it shards by itself.
    ranks = trained(two_ranks, "default")
    assert_disjoint_shares(batches_per_rank(ranks))
    assert ranks[0]["weights"] == ranks[1]["weights"]
