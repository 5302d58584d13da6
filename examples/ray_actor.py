"""The loader inside a Ray actor: a trainer actor iterates a DataLoader with ``async for`` on the
actor's own event loop, its batches made by preprocessing actors (``RayWorkers``), while the
same actor keeps answering other calls (progress, pause, resume): the loader never blocks the
loop it runs on, as an RL learner beside its rollout servers needs.

    python examples/ray_actor.py            # a local Ray started for the run
    RAY_ADDRESS=host:6379 python examples/ray_actor.py   # or a cluster's

It prints the trainer's progress as another caller sees it mid-epoch, pauses it (the answer
comes while ``async for`` is suspended in the middle of the epoch), resumes it, and checks
that every sample arrived once, in order.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import ray

from aioloader import DataLoader, RayWorkers


class Squares:
    """Sample ``i`` is ``[i, i*i]``: cheap, so the example runs in seconds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, i * i])


@ray.remote
class Trainer:
    """Trains on a loader's batches; answers ``progress``, ``pause`` and ``resume`` meanwhile."""

    def __init__(self, samples: int = 48, batch_size: int = 8, step_s: float = 0.2) -> None:
        self.samples = samples
        self.batch_size = batch_size
        self.step_s = step_s
        self.steps = 0
        self._running = asyncio.Event()  # cleared: paused between two steps
        self._running.set()

    async def train(self, actors: int = 2, num_cpus: float = 0.5) -> list[int]:
        seen: list[int] = []
        async with RayWorkers(actors, num_cpus=num_cpus) as workers:
            loader = DataLoader(Squares(self.samples), batch_size=self.batch_size, workers=workers)
            async with loader:
                async for batch in loader:
                    await self._running.wait()  # paused: the loop serves other calls
                    seen.extend(batch[:, 0].tolist())
                    self.steps += 1
                    await asyncio.sleep(self.step_s)  # the training step would run here
        return seen

    async def progress(self) -> int:
        return self.steps

    async def pause(self) -> None:
        self._running.clear()

    async def resume(self) -> None:
        self._running.set()


def main() -> None:
    ray.init(logging_level="WARNING", log_to_driver=False)
    trainer = Trainer.options(num_cpus=0).remote()
    done = trainer.train.remote()
    deadline = time.monotonic() + 120
    while ray.get(trainer.progress.remote()) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    ray.get(trainer.pause.remote())
    paused_at = ray.get(trainer.progress.remote())
    still, _ = ray.wait([done], timeout=0.5)
    print(f"paused mid-epoch after {paused_at} steps; the actor answered while iterating")
    unchanged = not still and ray.get(trainer.progress.remote()) == paused_at
    print(f"still paused half a second later: {unchanged}")
    ray.get(trainer.resume.remote())
    seen = ray.get(done)
    print(f"trained on {len(seen)} samples, each once, in order: {seen == list(range(len(seen)))}")
    ray.shutdown()


if __name__ == "__main__":
    main()
