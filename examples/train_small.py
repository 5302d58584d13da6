"""Train a tiny CNN end to end with the loader: the loss goes down, the throughput is printed.

    python examples/train_small.py                 # seconds: 1,024 samples, async for
    python examples/train_small.py --sync          # the same with a plain for loop
    python examples/train_small.py --samples 8192 --epochs 4 --workers 2   # larger

The data set is made here, in memory: 16x16 grey images of 10 classes, each class a fixed
random pattern, and every sample that pattern plus fresh Gaussian noise drawn in
``__getitem__`` (so the model cannot memorise samples, and each read costs a little CPU, as a
decode would). In worker processes the noise is reseeded from (seed, epoch, batch): the same
``seed`` gives the same noise with any number of workers. With no worker process (the default)
the samples are read in this process, whose global generator the loader leaves to your code,
as torch does; the script seeds it, so those runs repeat too.

Each epoch prints the mean training loss, the accuracy on the epoch's batches, samples per
second of the whole loop (loading and training), and the share of the epoch the training loop
waited for the loader; the last line is the loader's verdict on what limited the epoch.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

import aioloader

CLASSES = 10
SIZE = 16
NOISE = 2.0  # the noise's standard deviation, against patterns of standard deviation 1:
# hard enough that the loss falls over the epochs rather than at once


class NoisyPatterns:
    """A map-style data set: ``len()`` and ``[i]``, like a torch Dataset."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.patterns = rng.standard_normal((CLASSES, 1, SIZE, SIZE)).astype(np.float32)
        self.labels = rng.integers(0, CLASSES, size=n)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        label = int(self.labels[i])
        noise = np.random.standard_normal((1, SIZE, SIZE)).astype(np.float32) * NOISE
        return self.patterns[label] + noise, label


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * (SIZE // 2) ** 2, CLASSES),
    )


class Trainer:
    """The model, its optimiser and one epoch's running numbers."""

    def __init__(self, lr: float) -> None:
        torch.manual_seed(0)
        self.model = make_model()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.reset()

    def reset(self) -> None:
        self.loss_sum = 0.0
        self.correct = self.samples = self.steps = 0
        self.started = time.perf_counter()

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        images, labels = batch
        logits = self.model(images)
        loss = nn.functional.cross_entropy(logits, labels)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.loss_sum += loss.item()
        self.correct += int((logits.argmax(1) == labels).sum())
        self.samples += len(labels)
        self.steps += 1

    def report(self, epoch: int, loader: aioloader.DataLoader) -> None:
        elapsed = time.perf_counter() - self.started
        waited = loader.statistics().epoch_stats.wait_share
        print(
            f"epoch {epoch}: loss {self.loss_sum / self.steps:.3f}, "
            f"accuracy {self.correct / self.samples:.0%}, "
            f"{self.samples / elapsed:,.0f} samples/s ({self.steps} steps in {elapsed:.2f} s, "
            f"waited for data {waited:.0%})",
            flush=True,
        )


def make_loader(args: argparse.Namespace) -> aioloader.DataLoader:
    return aioloader.DataLoader(
        NoisyPatterns(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        seed=0,
    )


async def main(args: argparse.Namespace) -> None:
    trainer = Trainer(args.lr)
    async with make_loader(args) as loader:
        for epoch in range(args.epochs):
            trainer.reset()
            async for batch in loader:
                trainer.step(batch)
            trainer.report(epoch, loader)
        print(f"loader: {loader.statistics().hint}")


def main_sync(args: argparse.Namespace) -> None:
    trainer = Trainer(args.lr)
    with make_loader(args) as loader:
        for epoch in range(args.epochs):
            trainer.reset()
            for batch in loader:
                trainer.step(batch)
            trainer.report(epoch, loader)
        print(f"loader: {loader.statistics().hint}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=0, help="0: one helper thread")
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--sync", action="store_true", help="iterate with a plain for loop")
    args = parser.parse_args()
    np.random.seed(0)  # read by __getitem__ when no worker process reseeds it
    torch.set_num_threads(1)  # the workers and the training step share a small machine
    if args.sync:
        main_sync(args)
    else:
        aioloader.run(main(args))
