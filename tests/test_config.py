"""The loader's settings (_config): checked once, derived once, the same rules everywhere."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from aioloader import BatchSampler, DataLoader, SequentialSampler
from aioloader._collate import default_collate
from aioloader._config import LoaderConfig


class Squares:
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        return i * i


class AsyncSquares:
    def __len__(self) -> int:
        return 10

    async def __getitem__(self, i: int) -> int:
        return i * i


def build(**overrides: Any) -> LoaderConfig:
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


def test_numpy_integers_are_ints_for_the_loader_as_for_the_batch_sampler() -> None:
    with DataLoader(Squares(), batch_size=np.int64(4), num_workers=np.int32(0)) as loader:
        assert loader.batch_size == 4
        assert type(loader.batch_size) is int
        assert [b.tolist() for b in loader] == [[0, 1, 4, 9], [16, 25, 36, 49], [64, 81]]
    sampler = BatchSampler(SequentialSampler(10), np.int64(4))
    assert [len(b) for b in sampler] == [4, 4, 2]


def test_default_prefetch_is_two_per_worker() -> None:
    assert build(num_workers=0).prefetch == 2
    assert build(num_workers=3).prefetch == 6
    assert build(num_workers=3, prefetch=1).prefetch == 1


def test_default_prefetch_of_async_data_keeps_io_concurrency_fetches_in_flight() -> None:
    config = build(kind="async_map", batch_size=8, io_concurrency=64)
    assert config.prefetch == math.ceil(64 / 8) + 2
    assert DataLoader(AsyncSquares(), batch_size=8, io_concurrency=64).prefetch == 10


def test_timeout_zero_means_no_limit_as_in_torch() -> None:
    assert build(timeout=0).timeout is None
    assert build(timeout=np.float32(1.5)).timeout == 1.5


def test_derived_views() -> None:
    config = build(num_workers=3, thread_pool=True, on_error="skip", last_batch="discard")
    assert (config.uses_processes, config.threads) == (False, 3)
    assert config.skip_errors
    assert config.drop_last
    assert build(num_workers=2).uses_processes
    assert build(num_workers=0).threads == 1
    assert build().collate_fn is default_collate


@pytest.mark.parametrize(
    ("argument", "value", "error"),
    [
        ("batch_size", 0, ValueError),
        ("batch_size", True, TypeError),
        ("batch_size", 2.0, TypeError),
        ("num_workers", -1, ValueError),
        ("num_workers", "2", TypeError),
        ("prefetch", 0, ValueError),
        ("timeout", -1, ValueError),
        ("timeout", math.nan, ValueError),
        ("timeout", math.inf, ValueError),
        ("timeout", "1", TypeError),
        ("io_concurrency", 0, ValueError),
        ("max_retries", -2, ValueError),
        ("device_prefetch", 0, ValueError),
        ("on_error", "ignore", ValueError),
        ("max_failures", -1, ValueError),
        ("max_failures", 1.5, ValueError),
        ("collate_fn", 3, TypeError),
        ("worker_init_fn", "f", TypeError),
        ("transform", 1, TypeError),
        ("thread_pool", 1, TypeError),
        ("in_order", "yes", TypeError),
        ("pin_memory", None, TypeError),
        ("shm_max_bytes", -1, ValueError),
    ],
)
def test_a_bad_argument_is_named_with_its_value(argument: str, value: Any, error: type) -> None:
    with pytest.raises(error, match=argument) as info:
        build(**{argument: value})
    assert repr(value) in str(info.value)
    with pytest.raises(error, match=argument):  # and the loader says the same
        DataLoader(Squares(), **{"batch_size": 2, argument: value})
