"""Data-parallel training with DistributedDataParallel, on CPU (gloo): each rank reads its share.

    torchrun --nproc_per_node=2 examples/ddp_train.py
    torchrun --nproc_per_node=2 examples/ddp_train.py --epochs 3 --workers 2
    python -m torch.distributed.run --nproc_per_node=2 examples/ddp_train.py --indices

The loader is built after ``init_process_group``, with no sampler: it sees the process group
and reads this rank's share of every epoch (a DistributedSampler over the indices, reshuffled
each epoch from a seed all ranks share), so every rank gets as many batches and DDP's gradient
all-reduce never waits for a rank that ran out. Each rank prints how many samples it read per
epoch; ``--indices`` prints them too (one JSON line per rank and epoch), to check that the ranks
read disjoint shares that cover the data set.

The data set is made here, in memory: a linear regression, ``y = x @ w + noise``, small enough
that a few epochs fit the weights on any CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import aioloader

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
    dataset = SyntheticRegression(args.samples)
    # No sampler and no shard=: under the process group the loader reads this rank's share.
    with aioloader.DataLoader(
        dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers, seed=0
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
            say(
                f"rank {rank}/{world} epoch {epoch}: {len(seen)} of {len(dataset)} samples in "
                f"{len(loader)} batches, mean loss {total / max(1, len(seen)):.4f}"
            )
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
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
