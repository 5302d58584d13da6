"""The loader's settings (_config): checked once, derived once, the same rules everywhere; and
through the loader, every bad argument rejected at construction, naming it."""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import numpy as np
import pytest
from datasets import Range, Stream
from helpers import build_config

from aioloader import BatchSampler, DataLoader, SequentialSampler
from aioloader._batch._collate import default_collate
from aioloader._validate import WrongTypeError


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


def test_numpy_integers_are_ints_for_the_loader_as_for_the_batch_sampler() -> None:
    # numpy integers are not ints to the type checker; accepting them at runtime is the point.
    four, zero = np.int64(4), np.int32(0)
    with DataLoader(Squares(), batch_size=four, num_workers=zero) as loader:  # type: ignore[arg-type]
        assert loader.batch_size == 4
        assert type(loader.batch_size) is int
        assert [b.tolist() for b in loader] == [[0, 1, 4, 9], [16, 25, 36, 49], [64, 81]]
    sampler = BatchSampler(SequentialSampler(10), four)  # type: ignore[arg-type]
    assert [len(b) for b in sampler] == [4, 4, 2]


def test_default_prefetch_is_two_per_worker() -> None:
    assert build_config(num_workers=0).prefetch == 2
    assert build_config(num_workers=3).prefetch == 6
    assert build_config(num_workers=3, prefetch=1).prefetch == 1


def test_default_prefetch_of_async_data_keeps_io_concurrency_fetches_in_flight() -> None:
    config = build_config(kind="async_map", batch_size=8, io_concurrency=64)
    assert config.prefetch == math.ceil(64 / 8) + 2
    assert DataLoader(AsyncSquares(), batch_size=8, io_concurrency=64).prefetch == 10


def test_timeout_zero_means_no_limit_as_in_torch() -> None:
    assert build_config(timeout=0).timeout is None
    assert build_config(timeout=np.float32(1.5)).timeout == 1.5


def test_pin_device_id_decides_the_pin_memory_device() -> None:
    config = build_config(pin_memory=True, pin_device_id=np.int64(3))
    assert (config.pin_device_id, config.pin_memory_device) == (3, "cuda:3")
    assert type(config.pin_device_id) is int
    assert build_config(pin_device_id=0, pin_memory_device="cuda:0").pin_memory_device == "cuda:0"
    assert build_config().pin_device_id is None


def test_derived_views() -> None:
    config = build_config(num_workers=3, thread_pool=True, on_error="skip", last_batch="discard")
    assert (config.uses_processes, config.threads) == (False, 3)
    assert config.skip_errors
    assert config.drop_last
    assert build_config(num_workers=2).uses_processes
    assert build_config(num_workers=0).threads == 1
    assert build_config().collate_fn is default_collate


@pytest.mark.parametrize(
    ("argument", "value", "error"),
    [
        ("batch_size", 0, ValueError),
        ("batch_size", True, WrongTypeError),
        ("batch_size", 2.0, WrongTypeError),
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
        ("thread_pool", 2, TypeError),
        ("thread_pool", "1", TypeError),
        ("in_order", "yes", TypeError),
        ("pin_memory", None, TypeError),
        ("shm_max_bytes", -1, ValueError),
    ],
)
def test_a_bad_argument_is_named_with_its_value(argument: str, value: Any, error: type) -> None:
    with pytest.raises(error, match=argument) as info:
        build_config(**{argument: value})
    assert repr(value) in str(info.value)
    with pytest.raises(error, match=argument):  # and the loader says the same
        DataLoader(Squares(), **{"batch_size": 2, argument: value})


FLAGS = ("shuffle", "pin_memory", "persistent_workers", "in_order", "thread_pool")


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("value", [0, 1, np.int64(1), np.True_])
def test_flags_take_the_ints_0_and_1_as_configs_give_them(name: str, value: Any) -> None:
    # YAML (`shuffle: 1`) and argparse (type=int) configs give ints; torch takes them.
    kwargs: dict[str, Any] = {name: value}
    if name == "persistent_workers":  # needs workers: threads, as cheap to start
        kwargs.update(num_workers=1, thread_pool=True)
    loader = DataLoader(Squares(), **kwargs)
    try:
        shown = {
            "shuffle": lambda: type(loader.sampler).__name__ == "RandomSampler",
            "pin_memory": lambda: loader.pin_memory,
            "persistent_workers": lambda: loader.persistent_workers,
            "in_order": lambda: loader.in_order,
            "thread_pool": lambda: loader.thread_pool,
        }[name]()
        assert shown is bool(value)
    finally:
        loader.close()
    if name != "shuffle":  # the loader's settings, checked once
        assert getattr(build_config(**kwargs), name) is bool(value)


# -- through the loader: every argument checked, named in the error ---------------------------


BAD_ARGUMENTS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"num_workers": -1}, ValueError, "num_workers"),
    ({"num_workers": 1.5}, TypeError, "num_workers"),
    ({"num_workers": True}, TypeError, "num_workers"),
    ({"num_workers": "2"}, TypeError, "num_workers"),
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"batch_size": -3}, ValueError, "batch_size"),
    ({"batch_size": 2.0}, WrongTypeError, "batch_size"),  # TypeError, ValueError as in torch
    ({"batch_size": True}, WrongTypeError, "batch_size"),
    ({"batch_size": None, "drop_last": True}, ValueError, "drop_last"),
    ({"prefetch": 0}, ValueError, "prefetch"),
    ({"prefetch": -1}, ValueError, "prefetch"),
    ({"prefetch": 2.5}, TypeError, "prefetch"),
    ({"prefetch": False}, TypeError, "prefetch"),
    ({"timeout": -1}, ValueError, "timeout"),
    ({"timeout": float("nan")}, ValueError, "timeout"),
    ({"timeout": float("inf")}, ValueError, "timeout"),
    ({"timeout": "1"}, TypeError, "timeout"),
    ({"timeout": True}, TypeError, "timeout"),
    ({"sampler": SequentialSampler(10), "shuffle": True}, ValueError, "shuffle"),
    ({"batch_sampler": [[0, 1]], "batch_size": 2}, ValueError, "batch_size"),
    ({"batch_sampler": [[0, 1]], "shuffle": True}, ValueError, "shuffle"),
    ({"batch_sampler": [[0, 1]], "sampler": [0, 1]}, ValueError, "sampler"),
    ({"batch_sampler": [[0, 1]], "drop_last": True}, ValueError, "drop_last"),
    ({"batch_sampler": [[0, 1]], "last_batch": "discard"}, ValueError, "last_batch"),
    ({"last_batch": "drop"}, ValueError, "last_batch"),
    ({"last_batch": 3}, ValueError, "last_batch"),
    ({"drop_last": True, "last_batch": "keep"}, ValueError, "drop_last"),
    ({"drop_last": 1}, WrongTypeError, "drop_last"),
    ({"shuffle": 2}, TypeError, "shuffle"),
    ({"shuffle": "yes"}, TypeError, "shuffle"),
    ({"pin_memory": -1}, TypeError, "pin_memory"),
    ({"in_order": 1.0}, TypeError, "in_order"),
    ({"persistent_workers": "1", "num_workers": 1}, TypeError, "persistent_workers"),
    ({"mp_context": "telepathy"}, ValueError, "mp_context"),
    ({"mp_context": "telepathy", "num_workers": 2}, ValueError, "mp_context"),
    ({"mp_context": 3}, TypeError, "mp_context"),
    ({"collate_fn": "stack"}, TypeError, "collate_fn"),
    ({"batchify_fn": 3}, TypeError, "collate_fn"),
    ({"transform": 3}, TypeError, "transform"),
    ({"worker_init_fn": "init"}, TypeError, "worker_init_fn"),
    ({"max_failures": -1}, ValueError, "max_failures"),
    ({"max_failures": float("nan")}, ValueError, "max_failures"),
    ({"max_failures": float("inf")}, ValueError, "max_failures"),
    ({"max_failures": 1.5}, ValueError, "max_failures"),
    ({"max_failures": "3"}, TypeError, "max_failures"),
    ({"max_failures": True}, TypeError, "max_failures"),
    ({"on_error": "ignore"}, ValueError, "on_error"),
    ({"device": "cuda:x"}, ValueError, "device"),
    ({"device": "gpu"}, ValueError, "device"),
    ({"device": -1}, ValueError, "device"),
    ({"device": 1.0}, TypeError, "device"),
    ({"seed": "42"}, TypeError, "seed"),
    ({"io_concurrency": 0}, ValueError, "io_concurrency"),
    ({"max_retries": -1}, ValueError, "max_retries"),
    ({"in_order": "yes"}, TypeError, "in_order"),
    ({"thread_pool": None}, TypeError, "thread_pool"),
    ({"shm_max_bytes": -1}, ValueError, "shm_max_bytes"),
    ({"pin_device_id": -1}, ValueError, "pin_device_id"),
    ({"pin_device_id": "0"}, TypeError, "pin_device_id"),
    ({"pin_device_id": 1, "pin_memory_device": "cuda"}, ValueError, "pin_device_id"),
]


BAD_FOR_ITERABLES: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"shuffle": True}, ValueError, "shuffle"),
    ({"sampler": SequentialSampler(5)}, ValueError, "sampler"),
    ({"batch_sampler": [[0, 1]]}, ValueError, "batch_sampler"),
    ({"last_batch": "rollover"}, ValueError, "rollover"),
    ({"batch_size": None, "drop_last": True}, ValueError, "batch_size=None"),
]


def _construction_error(dataset: Any, kwargs: dict[str, Any]) -> Exception | None:
    try:
        DataLoader(dataset, **kwargs).close()
    except Exception as exc:
        return exc
    return None


def test_bad_arguments_are_rejected_naming_the_argument() -> None:
    # One test over a table (each case is cheap; a test each would mostly measure teardown).
    cases: list[tuple[Any, dict[str, Any], type[Exception], str]]
    cases = [(Range(10), *case) for case in BAD_ARGUMENTS]
    cases += [(Stream(5), *case) for case in BAD_FOR_ITERABLES]
    cases += [(42, {}, TypeError, "dataset")]
    wrong = []
    for dataset, kwargs, error, name in cases:
        exc = _construction_error(dataset, kwargs)
        if type(exc) is not error or name not in str(exc):
            wrong.append(
                f"{type(dataset).__name__} {kwargs}: want {error.__name__} naming "
                f"{name!r}, got {exc!r}"
            )
    assert wrong == []


def test_unpicklable_arguments_for_worker_processes_are_reported() -> None:
    # A lambda travels by value; one holding what cannot travel at all (a lock) cannot.
    lock = threading.Lock()
    local = Range(4)
    local.fn = lambda x: (lock, x)  # type: ignore[attr-defined]
    # The dataset is pickled when the first epoch needs it (once, not at construction too).
    with DataLoader(local, num_workers=2) as loader, pytest.raises(TypeError, match=r"^dataset"):
        next(iter(loader))
    # A function costs little to check: at construction.
    with pytest.raises(TypeError, match="collate_fn"):
        DataLoader(Range(4), num_workers=2, collate_fn=lambda s: (lock, s))
    # Threads need no pickling.
    DataLoader(local, num_workers=2, thread_pool=True, collate_fn=lambda s: (lock, s)).close()


def test_more_worker_processes_than_cpus_warns() -> None:
    cpus = os.cpu_count() or 1
    with pytest.warns(UserWarning, match=f"num_workers={cpus + 1}"):
        loader = DataLoader(Range(4), num_workers=cpus + 1)
    loader.close()
    # Threads wait on IO; more of them than CPUs is normal and does not warn.
    DataLoader(Range(4), num_workers=cpus + 1, thread_pool=True).close()
