"""Train a small CNN on the GPU from worker processes, shared memory and the device stage.

    python examples/train_gpu.py                   # sized for the hardware (below)
    python examples/train_gpu.py --epochs 1 --samples 2048 --workers 2

Its defaults follow the hardware: with CUDA, 16,384 samples in batches of 256 from 4 worker
processes for 3 epochs; without, 64 samples in batches of 32 from 2 workers for 2 epochs,
which take seconds on the CPU (the GPU-sized run would take most of an hour there).

Each sample is a 3x64x64 float32 image made in a worker process: its class's fixed pattern plus
noise, with the sample's index written into its first pixel. Batches are collated in the
workers into shared memory, copied to the GPU from that (page-locked) memory on a side stream
by the loader, and the training step runs on the GPU. Every batch is checked there: the first
pixel of each image must equal its index and the label the index's class, so a batch that
arrived corrupted, out of order or twice would be counted (the counts are read once per epoch,
so the check adds no host-device sync per step).

Each epoch prints the loss, samples per second, the GPU busy share (the time the GPU spent
in training steps, measured with CUDA events, over the epoch's wall time: how well the loader
keeps the GPU fed) and the share of the epoch the loop waited for data. With CUDA, a second
line gives the device stage's counters from ``statistics()``: host bytes staged per batch (0
when batches come from registered shared memory), the time the loop waited on copies, and the
wake latency from a copy's completion to the loop resuming (p50 and p99). Without a CUDA
device it trains on the CPU and says so.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch import nn

import aioloader

CLASSES = 10
SHAPE = (3, 64, 64)


class IndexedPatterns:
    """Map-style: sample ``i`` is class ``i % 10``'s pattern plus noise, with ``i`` in pixel 0."""

    def __init__(self, n: int) -> None:
        self.n = n
        rng = np.random.default_rng(0)
        self.patterns = rng.standard_normal((CLASSES, *SHAPE)).astype(np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int, int]:
        label = i % CLASSES
        image = self.patterns[label] + np.random.standard_normal(SHAPE).astype(np.float32) * 0.5
        image[0, 0, 0] = i
        return image, label, i


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, CLASSES),
    )


async def train(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("no CUDA device: training on the CPU (no device stage, no GPU busy share)")
    torch.manual_seed(0)
    model = make_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = aioloader.DataLoader(
        IndexedPatterns(args.samples),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        device="cuda" if cuda else None,
        device_prefetch=2,
        seed=0,
    )
    bad = 0
    async with loader:
        for epoch in range(args.epochs):
            mismatches = torch.zeros((), dtype=torch.int64, device=device)
            seen = torch.zeros(args.samples, dtype=torch.int64, device=device)
            loss_sum = torch.zeros((), device=device)
            events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
            steps = samples = 0
            started = time.perf_counter()
            async for images, labels, index in loader:
                if images.device.type != device.type:
                    raise AssertionError(f"batch arrived on {images.device}, expected {device}")
                if cuda:
                    begin, end = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    begin.record()
                mismatches += (images[:, 0, 0, 0].long() != index).sum()
                mismatches += (labels != index % CLASSES).sum()
                seen.index_add_(0, index, torch.ones_like(index))
                loss = nn.functional.cross_entropy(model(images), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_sum += loss.detach()
                if cuda:
                    end.record()
                    events.append((begin, end))
                steps += 1
                samples += len(labels)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            busy = sum(b.elapsed_time(e) for b, e in events) / 1e3 / elapsed if cuda else None
            wrong = int(mismatches) + int((seen != 1).sum())
            bad += wrong
            stats = loader.statistics()
            waited = stats.epoch_stats.wait_share
            print(
                f"epoch {epoch}: loss {float(loss_sum) / steps:.3f}, "
                f"{samples / elapsed:,.0f} samples/s, "
                + (f"GPU busy {busy:.0%}, " if busy is not None else "")
                + f"waited for data {waited:.0%}, wrong or missing samples {wrong}",
                flush=True,
            )
            if cuda and stats.device_batches:
                print(
                    f"  device stage (all epochs): staged "
                    f"{stats.device_staged_bytes / stats.device_batches:,.0f} B/batch, "
                    f"waited on copies {stats.device_wait_s:.3f} s, hand-off "
                    f"p50 {stats.device_handoff_p50_us:.0f} us "
                    f"p99 {stats.device_handoff_p99_us:.0f} us",
                    flush=True,
                )
        print(f"loader: {loader.statistics().hint}")
    return 1 if bad else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, help="default: 16384 with CUDA, else 64")
    parser.add_argument("--epochs", type=int, help="default: 3 with CUDA, else 2")
    parser.add_argument("--batch-size", type=int, help="default: 256 with CUDA, else 32")
    parser.add_argument("--workers", type=int, help="default: 4 with CUDA, else 2")
    args = parser.parse_args()
    sized = (16384, 3, 256, 4) if torch.cuda.is_available() else (64, 2, 32, 2)
    for name, default in zip(("samples", "epochs", "batch_size", "workers"), sized, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    raise SystemExit(aioloader.run(train(args)))
