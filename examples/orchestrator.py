"""Training, periodic evaluation and a parameter server on one event loop.

    python examples/orchestrator.py                # seconds: helper threads only
    python examples/orchestrator.py --samples 32768 --eval-samples 4096 --epochs 3 --workers 2

One asyncio loop runs three things at once, as an RL learner or an online-training service does:

- **training**: ``async for batch in train_loader``; the step itself (forward, backward,
  optimiser) runs in a thread with ``asyncio.to_thread``, where torch releases the GIL;
- **evaluation**: every ``--eval-every`` steps, a task evaluates a snapshot of the model over a
  second loader (the held-out set) while training goes on;
- **a parameter server**: a client coroutine asks for the current parameters every 10 ms and
  the server coroutine answers with their version and norm; each answer's lag is the time from
  the moment it was due to the moment the client had it.

It prints the server's p50 / p99 / max lag, first on an idle loop (the machine's own noise),
then while training and evaluating. The point: two loaders feeding a model do not stall the
loop. Their batches are read and collated in worker processes or helper threads, awaited,
never waited for. What does stall a loop is work done on it (which is why the steps run in
threads), Python's garbage collector walking torch's objects (hence ``gc.freeze()``, see the
README) and, with threads busy in Python code, the interpreter's 5 ms switch interval: the loop
may wait that long for the GIL, so this script asks for 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import sys
import time
from collections.abc import Awaitable

import numpy as np
import torch
from torch import nn

import aioloader

TICK_S = 0.010  # the parameter server is asked every 10 ms
FEATURES = 256
HIDDEN = 1024  # a few milliseconds of training step on one CPU thread
CLASSES = 4


class Blobs:
    """Points around one centre per class, with noise drawn per read; ``len()`` and ``[i]``."""

    def __init__(self, n: int, seed: int) -> None:
        self.centres = np.random.default_rng(0).standard_normal((CLASSES, FEATURES)) * 0.2
        self.labels = np.random.default_rng(seed).integers(0, CLASSES, size=n)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        label = int(self.labels[i])
        noise = np.random.default_rng((self.seed, i)).standard_normal(FEATURES)
        return (self.centres[label] + noise).astype(np.float32), label


class Learner:
    """The model and its optimiser; ``version`` counts the updates."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.version = 0

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One training step; runs in a thread (``asyncio.to_thread``)."""
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.version += 1
        return loss.item()


async def train(learner: Learner, loader: aioloader.DataLoader, args: argparse.Namespace) -> None:
    async with asyncio.TaskGroup() as group:  # evaluations run here, beside training
        for epoch in range(args.epochs):
            losses = []
            async for batch in loader:
                losses.append(await asyncio.to_thread(learner.step, batch))
                if learner.version % args.eval_every == 0:
                    # Evaluate a snapshot while training goes on.
                    model = await asyncio.to_thread(copy.deepcopy, learner.model)
                    group.create_task(evaluate(model, learner.version, args))
            print(f"train epoch {epoch}: mean loss {np.mean(losses):.3f}", flush=True)


async def evaluate(model: nn.Module, version: int, args: argparse.Namespace) -> None:
    correct = total = 0
    # A loader per evaluation; a long-lived one (with persistent workers) suits large sets.
    async with aioloader.DataLoader(
        Blobs(args.eval_samples, seed=1), batch_size=256, num_workers=0
    ) as loader:
        async for x, y in loader:
            correct += await asyncio.to_thread(count_correct, model, x, y)
            total += len(y)
    print(f"eval of version {version}: accuracy {correct / total:.0%}", flush=True)


def count_correct(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    with torch.no_grad():
        return int((model(x).argmax(1) == y).sum())


async def parameter_server(learner: Learner, requests: asyncio.Queue[asyncio.Future[str]]) -> None:
    while True:
        reply = await requests.get()
        norm = sum(float(p.detach().norm()) for p in learner.model.parameters())
        reply.set_result(f"version {learner.version}, norm {norm:.3f}")


async def client(
    requests: asyncio.Queue[asyncio.Future[str]], stop: asyncio.Event, lags: list[float]
) -> None:
    """Ask every TICK_S; a request's lag is from when it was due to when its answer came."""
    loop = asyncio.get_running_loop()
    due = time.perf_counter()
    while not stop.is_set():
        due += TICK_S
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        reply: asyncio.Future[str] = loop.create_future()
        requests.put_nowait(reply)
        await reply
        lags.append(time.perf_counter() - due)
        due = max(due, time.perf_counter() - TICK_S)  # a late answer does not pile up requests


async def serve_during(learner: Learner, work: Awaitable[None]) -> list[float]:
    """Run the parameter server and its client until ``work`` is done; the lags, sorted."""
    requests: asyncio.Queue[asyncio.Future[str]] = asyncio.Queue()
    stop, lags = asyncio.Event(), []
    async with asyncio.TaskGroup() as group:
        server = group.create_task(parameter_server(learner, requests))
        asker = group.create_task(client(requests, stop, lags))
        await work
        stop.set()
        await asker
        server.cancel()
    return sorted(lags)


def describe(lags: list[float]) -> str:
    p50, p99, top = (lags[int(q * (len(lags) - 1))] * 1e3 for q in (0.5, 0.99, 1.0))
    return f"{len(lags)} answers, lag p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {top:.2f} ms"


async def main(args: argparse.Namespace) -> None:
    learner = Learner()
    # The machine's own noise first: the same server and client on an otherwise idle loop.
    idle = await serve_during(learner, asyncio.sleep(args.idle_s))
    async with aioloader.DataLoader(
        Blobs(args.samples, seed=0),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        seed=0,
    ) as loader:
        started = time.perf_counter()
        busy = await serve_during(learner, train(learner, loader, args))
        elapsed = time.perf_counter() - started
    print(f"parameter server, idle loop: {describe(idle)}")
    print(f"parameter server, while training and evaluating ({elapsed:.1f} s): {describe(busy)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--eval-samples", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=0, help="0: helper threads")
    parser.add_argument("--eval-every", type=int, default=40, help="training steps")
    parser.add_argument("--idle-s", type=float, default=0.3, help="the idle measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.setswitchinterval(0.001)  # the loop waits at most ~1 ms for the GIL, not 5 ms
    gc.freeze()  # torch's import-time objects: out of the collector's reach (see the README)
    aioloader.run(main(args))
