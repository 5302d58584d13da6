"""Quickstart: load a built-in synthetic image data set end to end and print throughput.

    python examples/quickstart.py                  # 2 worker processes, shared memory
    python examples/quickstart.py --workers 0      # one helper thread
    python examples/quickstart.py --sync           # plain `for batch in loader`
    python examples/quickstart.py --prefetch 16    # more batches in flight (see the verdict)

The data set is made here, in memory: 2,048 images of 3x64x64 uint8 with a label, and a random
crop + flip per sample, decoded off the event loop. The loop also runs a heartbeat task beside
the loader, to show that loading never stalls other work on the same loop.

At the end it prints ``loader.statistics()``: throughput, where the time went, the CPU the
process tree used of the CPUs it may use, and the bottleneck verdict. On a 2-core machine the
cores are the limit here (two workers and this loop share them): the verdict says so, and
``--prefetch 16`` leaves the rate where it was.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import torch

import aioloader


class SyntheticImages:
    """A map-style data set: `len()` and `[i]`, like a torch Dataset."""

    def __init__(self, n: int = 2048, size: int = 64, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.images = rng.integers(0, 256, size=(n, 3, size + 8, size + 8), dtype=np.uint8)
        self.labels = rng.integers(0, 10, size=n)
        self.size = size

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, object]:
        # Per-sample randomness comes from numpy's global RNG, which the loader reseeds from
        # (seed, epoch, batch) in each worker process: the same seed gives the same crops with
        # any number of workers. (Threads share the global RNG, so --workers 0 is not seeded.)
        y, x = np.random.randint(0, 9, size=2)
        img = self.images[i, :, y : y + self.size, x : x + self.size]
        if np.random.rand() < 0.5:
            img = img[:, :, ::-1]
        return {"image": np.ascontiguousarray(img), "label": int(self.labels[i])}


async def heartbeat(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.005)
        lags.append(time.perf_counter() - t - 0.005)


async def main(args: argparse.Namespace) -> None:
    dataset = SyntheticImages()
    stop, lags = asyncio.Event(), []
    beat = asyncio.create_task(heartbeat(stop, lags))
    async with aioloader.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        seed=0,
        prefetch=args.prefetch,
    ) as loader:
        for epoch in range(args.epochs):
            start, samples, checksum = time.perf_counter(), 0, 0
            async for batch in loader:
                images = batch["image"].float().div_(255)  # a zero-copy view of shared memory
                samples += images.shape[0]
                checksum += int(batch["label"].sum())
            elapsed = time.perf_counter() - start
            print(
                f"epoch {epoch}: {len(loader)} batches, {samples} samples in {elapsed:.2f} s "
                f"= {len(loader) / elapsed:.1f} batches/s, {samples / elapsed:.0f} samples/s "
                f"(label checksum {checksum})"
            )
        print(loader.statistics())
    stop.set()
    await beat
    lags.sort()
    print(
        f"event loop lag while loading: p50 {lags[len(lags) // 2] * 1e3:.2f} ms, "
        f"p99 {lags[int(len(lags) * 0.99)] * 1e3:.2f} ms (this includes the example's own "
        "per-batch work on the loop: the float conversion above)"
    )


def main_sync(args: argparse.Namespace) -> None:
    with aioloader.DataLoader(
        SyntheticImages(),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        seed=0,
        prefetch=args.prefetch,
    ) as loader:
        for epoch in range(args.epochs):
            start = time.perf_counter()
            n = sum(1 for _ in loader)
            print(f"epoch {epoch} (sync): {n / (time.perf_counter() - start):.1f} batches/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="aioloader quickstart")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--prefetch", type=int, default=None, help="batches in flight")
    parser.add_argument("--sync", action="store_true", help="iterate with a plain for loop")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.sync:
        main_sync(args)
    else:
        aioloader.run(main(args))
