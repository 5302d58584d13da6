"""From torch's DataLoader to aioloader: change one import, get the same batches.

    python examples/migrate_from_torch.py              # seconds: one worker process each
    python examples/migrate_from_torch.py --samples 2048 --workers 2   # larger

The pipeline below is ordinary torch code: a ``torch.utils.data.Dataset`` subclass of
variable-length token sequences, a ``collate_fn`` that pads them into a dict of tensors, a
seeded ``RandomSampler``, workers with a ``worker_init_fn``, ``drop_last`` and persistent
workers. ``build_loader`` takes the ``DataLoader`` class as its only varying part::

    from torch.utils.data import DataLoader      # before
    from aioloader import DataLoader             # after: nothing else changes

The script builds it with each class, runs ``--epochs`` epochs of both (``for`` loops), checks
that every batch is equal, key by key, dtype by dtype, and then runs aioloader's the
asyncio way (``async with`` / ``async for``), which yields the same batches again.

Two things give the same order here and are worth knowing when migrating: the sampler is
torch's own ``RandomSampler`` with its own seeded generator, which both loaders simply
iterate (with ``shuffle=True`` aioloader orders each epoch from its ``seed`` and the epoch:
repeatable and resumable, but not torch's order after the first epoch); and the data set
draws no randomness of its own (torch seeds each worker once, aioloader each batch, from
(seed, epoch, batch), so random augmentations differ between the two, by design).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import numpy as np
import torch
import torch.utils.data

import aioloader

VOCABULARY = 1000


class Sentences(torch.utils.data.Dataset[dict[str, Any]]):
    """Token sequences of 4 to 40 tokens with a label, as a text classifier reads them."""

    def __init__(self, n: int) -> None:
        rng = np.random.default_rng(0)
        self.lengths = rng.integers(4, 41, size=n)
        self.labels = rng.integers(0, 2, size=n)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        tokens = np.random.default_rng(i).integers(1, VOCABULARY, size=self.lengths[i])
        return {"tokens": torch.from_numpy(tokens), "label": int(self.labels[i])}


def pad_collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pad the sequences of a batch to its longest one (token 0 pads)."""
    lengths = torch.tensor([len(s["tokens"]) for s in samples])
    tokens = torch.zeros(len(samples), int(lengths.max()), dtype=torch.int64)
    for row, sample in enumerate(samples):
        tokens[row, : len(sample["tokens"])] = sample["tokens"]
    return {
        "tokens": tokens,
        "lengths": lengths,
        "label": torch.tensor([s["label"] for s in samples]),
    }


def quiet_worker(worker_id: int) -> None:
    torch.set_num_threads(1)


def build_loader(DataLoader: Any, args: argparse.Namespace) -> Any:
    """The same code for both loaders: only the class differs."""
    dataset = Sentences(args.samples)
    return DataLoader(
        dataset,
        batch_size=32,
        sampler=torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(0)),
        num_workers=args.workers,
        collate_fn=pad_collate,
        drop_last=True,
        worker_init_fn=quiet_worker,
        persistent_workers=args.workers > 0,
    )


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def epochs_of(loader: Any, epochs: int) -> list[list[dict[str, torch.Tensor]]]:
    return [list(loader) for _ in range(epochs)]


async def async_epochs(args: argparse.Namespace) -> list[list[dict[str, torch.Tensor]]]:
    out = []
    async with build_loader(aioloader.DataLoader, args) as loader:
        for _ in range(args.epochs):
            out.append([batch async for batch in loader])
    return out


def main(args: argparse.Namespace) -> None:
    torch_loader = build_loader(torch.utils.data.DataLoader, args)
    theirs = epochs_of(torch_loader, args.epochs)
    del torch_loader  # its persistent workers go with it

    with build_loader(aioloader.DataLoader, args) as loader:  # `with` closes the workers
        ours = epochs_of(loader, args.epochs)
    ours_async = aioloader.run(async_epochs(args))

    for name, got in (("for", ours), ("async for", ours_async)):
        batches = sum(len(e) for e in got)
        equal = [
            len(a) == len(b) and all(map(same, a, b)) for a, b in zip(theirs, got, strict=True)
        ]
        print(
            f"aioloader ({name}): {batches} batches in {len(got)} epochs; "
            f"equal to torch's, epoch by epoch: {equal}"
        )
        if not all(equal) or len(got) != len(theirs):
            raise SystemExit(f"the batches of aioloader ({name}) differ from torch's")
    first = ours[0][0]
    shapes = ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in first.items())
    print(f"torch: {sum(len(e) for e in theirs)} batches; the first: {shapes}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    asyncio.set_event_loop_policy(None)
    main(args)
