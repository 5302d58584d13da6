"""The dataset and helpers the Lightning and accelerate tests share (and their scripts).

Kept apart from the test modules so that worker processes, which import a dataset's module by
name, do not import Lightning or accelerate (seconds each on a small machine). No framework is
imported here.
"""

from __future__ import annotations

import os
from typing import Any

import torch

# Samples in the training set, and per batch: 5 batches an epoch, so a run of 2 epochs can be
# stopped mid-epoch, at an epoch's last batch, and in the second epoch.
N, BATCH = 40, 8


class Indexed:
    """Sample ``i``: features that depend on ``i`` alone, their sum as target, ``i`` itself, and
    ``noise`` drawn from torch's global generator, as a random augmentation would be.

    In worker processes the noise is reproducible: each worker reseeds torch before every
    batch from (seed, epoch, batch). On the loader's own thread (``num_workers=0``) it is not:
    that thread shares the process's generator with the training code, as in torch.
    """

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        x = torch.randn(4, generator=torch.Generator().manual_seed(index))
        return {"x": x, "y": x.sum(), "index": index, "noise": torch.rand(())}


class WorkerMarks:
    """Sample ``i`` is the worker id that :func:`mark_worker` recorded in this process (-1 if
    it never ran here): shows which ``worker_init_fn`` the worker processes started with."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return int(os.environ.get(MARK, "-1"))


MARK = "AIOLOADER_TEST_WORKER_MARK"


def mark_worker(worker_id: int) -> None:
    """A ``worker_init_fn``: records the worker id in the worker's environment."""
    os.environ[MARK] = str(worker_id)


Record = tuple[list[int], list[float], list[float]]  # indices, x (flattened), noise


def record(batch: dict[str, Any]) -> Record:
    """What a batch was, as plain lists (comparable, JSON-able, holding no shared memory)."""
    return (
        [int(i) for i in batch["index"]],
        [float(v) for v in batch["x"].flatten()],
        [float(v) for v in batch["noise"]],
    )


def without_noise(records: list[Record]) -> list[tuple[list[int], list[float]]]:
    """The records with the noise left out (for loaders whose noise is not reproducible)."""
    return [(indices, x) for indices, x, _ in records]


def assert_disjoint_shares(per_rank: list[list[list[int]]], n: int = N, epochs: int = 2) -> None:
    """Each rank's batches (indices) cover, epoch by epoch, its own part of the ``n`` samples,
    all ranks together every sample once, in equally many batches per rank."""
    lengths = {len(batches) for batches in per_rank}
    assert len(lengths) == 1, f"ranks trained on different numbers of batches: {lengths}"
    per_epoch = lengths.pop() // epochs
    for epoch in range(epochs):
        shares = [
            [i for batch in batches[epoch * per_epoch : (epoch + 1) * per_epoch] for i in batch]
            for batches in per_rank
        ]
        seen = [i for share in shares for i in share]
        assert sorted(seen) == list(range(n)), f"epoch {epoch}: shares overlap or miss samples"


def gloo_environment() -> dict[str, str]:
    """Environment for a child job whose ranks talk over gloo on the loopback interface only."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return {"GLOO_SOCKET_IFNAME": name, "MASTER_ADDR": "127.0.0.1"}
    raise RuntimeError("no loopback interface with 127.0.0.1")


def child_pythonpath() -> str:
    """PYTHONPATH for a child script: this tree's package first, then the tests directory (the
    dataset modules), then what the caller had."""
    here = os.path.dirname(os.path.abspath(__file__))
    parts = [os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)
