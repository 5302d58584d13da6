"""Data-parallel training with DistributedDataParallel, on CPU (gloo): each rank reads its share.

    torchrun --nproc_per_node=2 examples/ddp_train.py
    torchrun --nproc_per_node=2 examples/ddp_train.py --epochs 3 --workers 2
    python -m torch.distributed.run --nproc_per_node=2 examples/ddp_train.py --indices
    torchrun --nproc_per_node=2 examples/ddp_train.py --stream

The loader is built after ``init_process_group``, with no sampler: it sees the process group
and reads this rank's share of every epoch (a DistributedSampler over the indices, reshuffled
each epoch from a seed all ranks share), so every rank gets as many batches and DDP's gradient
all-reduce never waits for a rank that ran out. Each rank prints how many samples it read per
epoch; ``--indices`` prints them too (one JSON line per rank and epoch), to check that the ranks
read disjoint shares that cover the data set.

``--stream`` reads a stream instead (an iterable dataset), whose copy on each rank is longer
than the last rank's: the shares differ in length, yet every rank ends each epoch at the same
step (the loader's ``equal_steps``; what a rank read past the end is carried into the next
epoch and logged), so the gradient all-reduce never waits for a rank that ran out. After each
epoch every rank calls ``aioloader.distributed.gather_statistics``, and rank 0 logs which rank
waited longest for data.

The data set is made here, in memory: a linear regression, ``y = x @ w + noise``, small enough
that a few epochs fit the weights on any CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import aioloader
import aioloader.distributed

FEATURES = 8


class SyntheticRegression:
    """A map-style data set: `len()` and `[i]`, like a torch Dataset; each sample knows its
    index, so a rank can report what it read."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((n, FEATURES), dtype=np.float32)
        self.weights = rng.standard_normal(FEATURES, dtype=np.float32)
        noise = 0.01 * rng.standard_normal(n, dtype=np.float32)
        self.y = (self.x @ self.weights + noise).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"index": i, "x": self.x[i], "y": self.y[i : i + 1]}


class SyntheticStream:
    """The same samples as an iterable dataset (a stream): ``n`` of them, in order."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.data = SyntheticRegression(n, seed)

    def __iter__(self) -> Iterator[dict[str, object]]:
        for i in range(len(self.data)):
            yield self.data[i]


def say(line: str) -> None:
    """Print ``line`` in one write: torchrun runs the ranks unbuffered on one output, where
    print() writes the newline apart and two ranks' lines could mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # DDP also broadcasts rank 0's weights when it wraps the model
    model = DistributedDataParallel(torch.nn.Linear(FEATURES, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    dataset: SyntheticRegression | SyntheticStream
    if args.stream:
        # Each rank's copy is longer than the next one's: the shares differ in length.
        dataset = SyntheticStream(args.samples + 8 * args.batch_size * (world - 1 - rank))
        options: dict[str, object] = {}
    else:
        dataset = SyntheticRegression(args.samples)
        options = {"shuffle": True}
    # No sampler and no shard=: under the process group the loader reads this rank's share.
    with aioloader.DataLoader(
        dataset, batch_size=args.batch_size, num_workers=args.workers, seed=0, **options
    ) as loader:
        for epoch in range(args.epochs):
            seen: list[int] = []
            total = 0.0
            for batch in loader:  # the epoch's order follows the loader's own epoch counter
                loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
                optimizer.zero_grad()
                loss.backward()  # DDP averages the gradients over the ranks here
                optimizer.step()
                total += loss.item() * len(batch["index"])
                seen.extend(batch["index"].tolist())
            steps = loader.statistics().epoch_stats.batches
            size = len(dataset.data) if isinstance(dataset, SyntheticStream) else len(dataset)
            say(
                f"rank {rank}/{world} epoch {epoch}: {len(seen)} of {size} samples in "
                f"{steps} batches, mean loss {total / max(1, len(seen)):.4f}"
            )
            # One small collective, at the epoch's end on every rank: rank 0 logs the table.
            aioloader.distributed.gather_statistics(loader, log=True)
            if args.indices:
                share = {"rank": rank, "world": world, "epoch": epoch, "pid": os.getpid()}
                share["indices"] = seen
                say("share " + json.dumps(share))
    dist.destroy_process_group()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--samples", type=int, default=4096, help="data set size")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0, help="worker processes per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--indices", action="store_true", help="print each rank's indices")
    parser.add_argument(
        "--stream", action="store_true", help="a stream whose shares differ in length"
    )
    return parser.parse_args()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    main(parse_args())
