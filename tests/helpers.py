"""Helpers the tests share: bounded iteration, batches as lists, a config to build, a fake sleep.

Every wait here is bounded by :data:`BOUND_S`, which no wait in the tests comes near: it only
turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any

import pytest
import torch
from datasets import Recorder

from aioloader._collate import default_collate
from aioloader._config import LoaderConfig

BOUND_S = 10.0


def as_lists(batches: list[Any]) -> list[list[int]]:
    return [b.tolist() if isinstance(b, torch.Tensor) else list(b) for b in batches]


def flat(batches: list[Any]) -> list[int]:
    return [i for b in as_lists(batches) for i in b]


def chunks(items: list[int], size: int, drop_last: bool = False) -> list[list[int]]:
    out = [items[i : i + size] for i in range(0, len(items), size)]
    if drop_last and out and len(out[-1]) < size:
        out.pop()
    return out


def expected_batches(n: int, size: int, drop: bool = False) -> list[list[int]]:
    """The batches of a sequential sampler over ``range(n)``."""
    return chunks(list(range(n)), size, drop)


def assert_raises_naming(
    make: Callable[[], object], error: type[Exception], needles: list[str]
) -> None:
    """``make()`` raises ``error`` whose message contains every one of ``needles`` (the
    argument's name and the value it got, for bad-input errors)."""
    with pytest.raises(error) as info:
        make()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def notes_of(exc: BaseException) -> str:
    """The notes added to an exception, one a line."""
    return "\n".join(getattr(exc, "__notes__", ()))


async def collect(loader: AsyncIterable[Any]) -> list[Any]:
    """Every batch of one epoch."""
    async with asyncio.timeout(BOUND_S):
        return [batch async for batch in loader]


async def take(iterator: AsyncIterator[Any], k: int) -> list[Any]:
    async with asyncio.timeout(BOUND_S):
        return [await anext(iterator) for _ in range(k)]


async def drain(batches: AsyncIterable[Any], into: list[Any]) -> None:
    """Append every batch (as lists) to ``into`` until the iteration ends or raises."""
    async with asyncio.timeout(BOUND_S):
        async for batch in batches:
            into.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)


def drain_sync(batches: Iterable[Any], into: list[Any]) -> None:
    """Append every batch of one sync epoch (as lists) to ``into`` until it ends or raises."""
    for batch in batches:
        into.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)


async def quiet(dataset: Recorder, for_s: float = 0.1) -> None:
    """Wait until the dataset has not been read for ``for_s`` seconds."""
    async with asyncio.timeout(BOUND_S):
        last = -1
        while True:
            count = len(dataset.read)
            if count == last and dataset.running == 0:
                return
            last = count
            await asyncio.sleep(for_s)


class Sleeps(list[float]):
    """An injectable ``sleep`` that records each delay and returns at once."""

    async def __call__(self, seconds: float) -> None:
        self.append(seconds)


def build_config(**overrides: Any) -> LoaderConfig:
    """A :class:`LoaderConfig` with the loader's defaults (batches of 4), ``overrides`` set."""
    arguments: dict[str, Any] = {
        "kind": "map",
        "batch_size": 4,
        "num_workers": 0,
        "thread_pool": False,
        "in_order": True,
        "prefetch": None,
        "timeout": None,
        "io_concurrency": 64,
        "max_retries": 0,
        "device_prefetch": 1,
        "on_error": "raise",
        "max_failures": 0,
        "collate_fn": None,
        "worker_init_fn": None,
        "transform": None,
        "seed": 0,
        "pin_memory": False,
        "shm_max_bytes": None,
        "last_batch": "keep",
        "default_collate": default_collate,
    }
    arguments.update(overrides)
    return LoaderConfig.build(**arguments)
