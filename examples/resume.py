"""Resume after an interruption: the resumed run sees exactly the batches the first one did not.

    python examples/resume.py                                      # uninterrupted, for reference
    python examples/resume.py --stop-after 21      # "crash" after 21 batches, save the state
    python examples/resume.py --resume             # a new process carries on from the state

Each run trains a small classifier for ``--epochs`` epochs over a shuffled data set and prints
two checksums at the end: one over the sample indices of every batch in the order they were
trained on, and one over the model's final weights. The interrupted run stops in the middle of
an epoch, after ``--stop-after`` batches, with batches still in flight in the loader, and saves
``loader.state_dict()`` beside the model's and the optimiser's state (what a crash handler or a
periodic checkpoint would save). The resumed run, a fresh process, loads them and carries on:
the loader yields exactly the batches of that epoch not yet taken, in the same order, then the
remaining epochs, so both checksums equal the uninterrupted run's.

The data set draws its noise from the sample's index, and the loader's shuffle from
``seed=0`` and the epoch, so a run is repeatable; the loader's state holds its seed too.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import aioloader

FEATURES = 16
CLASSES = 4
MODULUS = 2**61 - 1  # the index checksum: a polynomial hash, so the order counts


class Points:
    """Points around one centre per class; ``len()`` and ``[i]``, deterministic per index."""

    def __init__(self, n: int) -> None:
        self.centres = np.random.default_rng(0).standard_normal((CLASSES, FEATURES))
        self.labels = np.random.default_rng(1).integers(0, CLASSES, size=n)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        label = int(self.labels[i])
        noise = np.random.default_rng(i).standard_normal(FEATURES)
        x = (self.centres[label] + noise).astype(np.float32)
        return {"index": i, "x": x, "y": label}


def weights_checksum(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()[:16]


async def main(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = aioloader.DataLoader(
        Points(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        seed=0,
    )
    first_epoch, taken, checksum = 0, 0, 0
    if args.resume:
        checkpoint = torch.load(args.checkpoint, weights_only=False)
        loader.load_state_dict(checkpoint["loader"])
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        first_epoch, taken, checksum = checkpoint["epoch"], checkpoint["taken"], checkpoint["sum"]
        left = len(loader) - checkpoint["taken_in_epoch"]
        print(f"resumed in epoch {first_epoch} after {taken} batches: {left} left in this epoch")

    async with loader:
        for epoch in range(first_epoch, args.epochs):
            in_epoch = 0
            async for batch in loader:
                loss = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                for index in batch["index"].tolist():
                    checksum = (checksum * 1_000_003 + index + 1) % MODULUS
                taken += 1
                in_epoch += 1
                if taken == args.stop_after:
                    # The checkpoint a crash handler (or a periodic save) writes. The loader's
                    # state says which batches of this epoch were taken; those in flight are not.
                    torch.save(
                        {
                            "loader": loader.state_dict(),
                            "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "epoch": epoch,
                            "taken": taken,
                            "taken_in_epoch": in_epoch,
                            "sum": checksum,
                        },
                        args.checkpoint,
                    )
                    print(
                        f"stopped in epoch {epoch} after {taken} batches ({in_epoch} of "
                        f"{len(loader)} in this epoch); state saved to {args.checkpoint}"
                    )
                    return 3  # as a crashed job would: not 0
            if args.resume and epoch == first_epoch:
                print(f"epoch {epoch}: {in_epoch} batches after the resume")
    print(f"{taken} batches in {args.epochs} epochs")
    print(f"batches checksum: {checksum:016x}")
    print(f"weights checksum: {weights_checksum(model)}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0, help="0: one helper thread")
    parser.add_argument("--stop-after", type=int, default=0, help="batches, then stop (0: never)")
    parser.add_argument("--resume", action="store_true", help="carry on from --checkpoint")
    parser.add_argument(
        "--checkpoint", type=Path, default=Path(tempfile.gettempdir()) / "aioloader_resume.pt"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread: the same sums in the same order, run after run
    sys.exit(aioloader.run(main(args)))
