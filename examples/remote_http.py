"""Train a tiny model on images fetched over HTTP, decoded off the event loop.

The script serves a synthetic image set on 127.0.0.1 (512 random 3x32x32 uint8 images, each
with a label, encoded as ``.npy`` bytes, 10 ms of added latency per request, as a stand-in for
an object store), then trains a linear classifier on it for two epochs:

- :class:`aioloader.sources.HTTPDataset` fetches the bytes on the event loop, 64 requests in
  flight, retrying transient failures;
- ``decode`` (``np.load``) runs off the loop, in the loader's thread;
- the training loop is a plain ``async for``.

Run it with ``python examples/remote_http.py``; it takes a few seconds.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from aiohttp import web

import aioloader
from aioloader.sources import HTTPDataset, RetryPolicy

IMAGES = 512
CLASSES = 10
LATENCY_S = 0.01
RECORD = np.dtype([("image", np.uint8, (3, 32, 32)), ("label", np.int64)])


def make_images(seed: int = 0) -> list[bytes]:
    """Noise around one pattern per class, so that a linear model can learn the labels."""
    rng = np.random.default_rng(seed)
    patterns = rng.integers(0, 256, size=(CLASSES, 3, 32, 32))
    blobs = []
    for i in range(IMAGES):
        label = i % CLASSES
        noise = rng.normal(0, 60, size=(3, 32, 32))
        record = np.zeros((), dtype=RECORD)
        record["image"] = np.clip(patterns[label] + noise, 0, 255).astype(np.uint8)
        record["label"] = label
        buffer = io.BytesIO()
        np.save(buffer, record)
        blobs.append(buffer.getvalue())
    return blobs


@contextmanager
def serve(blobs: list[bytes]) -> Iterator[str]:
    """Serve ``/img/{i}`` from a thread with its own event loop; yield the base URL."""
    ready = threading.Event()
    state: dict[str, object] = {}

    async def handle(request: web.Request) -> web.Response:
        await asyncio.sleep(LATENCY_S)
        return web.Response(body=blobs[int(request.match_info["i"])])

    async def run() -> None:
        app = web.Application()
        app.router.add_get("/img/{i}", handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        stop = asyncio.Event()
        state.update(port=runner.addresses[0][1], stop=stop, loop=asyncio.get_running_loop())
        ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=asyncio.run, args=(run(),), name="image-server")
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the image server did not start")
    try:
        yield f"http://127.0.0.1:{state['port']}"
    finally:
        loop = state["loop"]
        assert isinstance(loop, asyncio.AbstractEventLoop)
        loop.call_soon_threadsafe(state["stop"].set)  # type: ignore[attr-defined]
        thread.join(30)


def decode(raw: bytes) -> tuple[np.ndarray, int]:
    """``.npy`` bytes -> (image as float32 in [0, 1], label). Runs off the event loop."""
    record = np.load(io.BytesIO(raw))
    return record["image"].astype(np.float32) / 255.0, int(record["label"])


def as_tensors(batch: object) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = batch  # type: ignore[misc]
    return torch.as_tensor(images), torch.as_tensor(labels)


async def train(base: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    dataset = HTTPDataset(
        [f"{base}/img/{i}" for i in range(IMAGES)],
        decode=decode,
        retry=RetryPolicy(max_attempts=5),
        read_timeout=10.0,
    )
    async with aioloader.DataLoader(
        dataset, batch_size=64, shuffle=True, io_concurrency=64, seed=0
    ) as loader:
        for epoch in range(2):
            started = time.perf_counter()
            seen = 0
            total_loss = 0.0
            correct = 0
            async for batch in loader:
                images, labels = as_tensors(batch)
                logits = model(images)
                loss = torch.nn.functional.cross_entropy(logits, labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                seen += len(labels)
                total_loss += loss.item() * len(labels)
                correct += int((logits.argmax(1) == labels).sum())
            rate = seen / (time.perf_counter() - started)
            print(
                f"epoch {epoch}: loss {total_loss / seen:.3f}, accuracy {correct / seen:.1%}, "
                f"{rate:,.0f} samples/s"
            )


def main() -> None:
    with serve(make_images()) as base:
        aioloader.run(train(base))


if __name__ == "__main__":
    main()
