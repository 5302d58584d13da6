"""From MXNet Gluon's DataLoader to aioloader: the same argument names, the same batches.

    python examples/migrate_from_gluon.py              # 2 helper threads, as thread_pool=True
    python examples/migrate_from_gluon.py --samples 90 --batch-size 32   # larger

A Gluon pipeline reads::

    from mxnet.gluon.data import ArrayDataset, DataLoader      # before
    loader = DataLoader(
        ArrayDataset(features, labels), batch_size=32, shuffle=False,
        last_batch="rollover", batchify_fn=stack, num_workers=2,
        thread_pool=True, prefetch=4, timeout=120,
    )

and with aioloader only the import changes (the data set here is a stand-in for
``ArrayDataset``: any object with ``len()`` and ``[i]`` is one)::

    from aioloader import DataLoader                           # after

``last_batch`` (``"keep"``, ``"discard"`` or ``"rollover"``), ``batchify_fn`` (the collate
function), ``thread_pool`` (workers are threads, not processes), ``prefetch`` (batches in flight)
and ``timeout`` (seconds a batch may take) mean what they mean in Gluon. MXNet itself is not
needed (nor installed here): the script checks each ``last_batch`` policy over three epochs
against Gluon's documented rule, written out below in a few lines (``gluon_batches``), and
checks every batch's contents too. Batches come out as ``batchify_fn`` makes them: numpy arrays
here, where Gluon's default would make NDArrays; aioloader's default makes torch tensors.

Keep the arguments as keywords: Gluon's positional order (``sampler``, then ``last_batch``) is
not torch's, and aioloader's positional parameters are torch's.
"""

from __future__ import annotations

import argparse

import numpy as np

import aioloader


class Table:
    """A stand-in for ``gluon.data.ArrayDataset(features, labels)``: ``[i]`` is a pair."""

    def __init__(self, n: int) -> None:
        self.features = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
        self.labels = np.arange(n) % 3

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.features[i], int(self.labels[i])


def stack(samples: list[tuple[np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
    """A ``batchify_fn``: stack the features and the labels, as numpy arrays."""
    features, labels = zip(*samples, strict=True)
    return np.stack(features), np.array(labels)


def same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    return all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def gluon_batches(n: int, batch_size: int, last_batch: str, epochs: int) -> list[list[list[int]]]:
    """The indices of each batch under Gluon's rule, with ``shuffle=False``.

    keep: the last batch may be smaller; discard: it is dropped; rollover: its indices are kept
    and start the next epoch, before that epoch's own indices.
    """
    out, carry = [], []
    for _ in range(epochs):
        order = carry + list(range(n))
        full = len(order) // batch_size * batch_size
        batches = [order[i : i + batch_size] for i in range(0, full, batch_size)]
        rest = order[full:]
        carry = rest if last_batch == "rollover" else []
        if rest and last_batch == "keep":
            batches.append(rest)
        out.append(batches)
    return out


def run(policy: str, args: argparse.Namespace) -> tuple[list[list[int]], bool]:
    """Three epochs with ``last_batch=policy``: the batch sizes and whether all are Gluon's."""
    table = Table(args.samples)
    expected = gluon_batches(args.samples, args.batch_size, policy, args.epochs)
    sizes, equal = [], True
    with aioloader.DataLoader(
        table,
        batch_size=args.batch_size,
        shuffle=False,
        last_batch=policy,
        batchify_fn=stack,
        num_workers=args.workers,
        thread_pool=True,
        prefetch=4,
        timeout=120,
    ) as loader:
        for epoch in range(args.epochs):
            got = list(loader)
            sizes.append([len(labels) for _, labels in got])
            want = [stack([table[i] for i in indices]) for indices in expected[epoch]]
            equal = equal and len(got) == len(want) and all(map(same, got, want))
    return sizes, equal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.samples} samples, batch_size={args.batch_size}, {args.epochs} epochs")
    for policy in ("keep", "discard", "rollover"):
        sizes, equal = run(policy, args)
        shown = "; ".join(" ".join(str(s) for s in epoch) for epoch in sizes)
        print(f"last_batch={policy!r:<11} batch sizes per epoch: {shown}  (Gluon's rule: {equal})")
        if not equal:
            raise SystemExit(f"last_batch={policy!r}: the batches differ from Gluon's rule")


if __name__ == "__main__":
    main()
