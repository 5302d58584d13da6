"""Tests of aioloader._validate: one rule for every argument, and every public check using it."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from helpers import assert_raises_naming
from hypothesis import given
from hypothesis import strategies as st

from aioloader import _validate
from aioloader._device import parse_device
from aioloader._sampling._sampler import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    ShardedBatchSampler,
    validate_non_negative_int,
    validate_positive_int,
)
from aioloader._validate import (
    WrongTypeError,
    boolean,
    callable_or_none,
    check_state_keys,
    finite_number,
    flag,
    fraction_or_count,
    is_int,
    non_negative_int,
    one_of,
    positive_int,
    seconds,
    to_int,
    value_errors,
)
from aioloader.sources import HTTPDataset, RetryPolicy, retrying

URL = "http://127.0.0.1/x"
NUMPY_INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
URL = "http://127.0.0.1/x"


# -- integers -----------------------------------------------------------------------------------


@given(n=st.integers(1, 100), dtype=st.sampled_from(NUMPY_INTS))
def test_numpy_integers_are_ints_and_come_back_plain(n: int, dtype: type[np.integer[Any]]) -> None:
    value = dtype(n)
    assert is_int(value)
    for check in (positive_int, non_negative_int, to_int):
        result = check("n", value)
        assert result == n
        assert type(result) is int


@pytest.mark.parametrize("value", [True, False, np.True_])
def test_bools_are_never_ints(value: Any) -> None:
    assert not is_int(value)
    for check in (positive_int, non_negative_int, to_int):
        with pytest.raises(TypeError, match="n must be"):
            check("n", value)


def test_integer_checks_tell_type_from_range() -> None:
    assert non_negative_int("n", 0) == 0
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        positive_int("n", 0)
    with pytest.raises(ValueError, match="n must be a non-negative int, got -1"):
        non_negative_int("n", -1)
    for wrong in (2.0, "2", None, np.float64(2)):
        with pytest.raises(TypeError, match=re.escape(f"n must be a positive int, got {wrong!r}")):
            positive_int("n", wrong)


def test_numpy_bools_are_bools_and_ints_are_not() -> None:
    assert boolean("flag", np.True_) is True
    assert boolean("flag", False) is False
    with pytest.raises(TypeError, match="flag must be a bool, got 1"):
        boolean("flag", 1)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), (np.True_, True), (np.False_, False), (1, True), (0, False)]
    + [(dtype(1), True) for dtype in NUMPY_INTS]
    + [(dtype(0), False) for dtype in NUMPY_INTS],
)
def test_a_flag_is_a_bool_or_the_int_0_or_1(value: Any, expected: bool) -> None:
    # A YAML or argparse config gives `shuffle: 1`; torch takes it.
    result = flag("shuffle", value)
    assert result is expected


@pytest.mark.parametrize("value", [2, -1, np.int64(2), 1.0, 0.0, "1", "yes", "", None, [1]])
def test_a_flag_refuses_other_values_as_a_bool_check_does(value: Any) -> None:
    with pytest.raises(TypeError, match=re.escape(f"shuffle must be a bool, got {value!r}")):
        flag("shuffle", value)
    with pytest.raises(TypeError, match=re.escape(f"shuffle must be a bool, got {value!r}")):
        boolean("shuffle", value)  # the same message as the strict check


# -- numbers and seconds ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -0.5, -1, np.float32("nan")])
def test_seconds_refuse_nan_infinite_and_negative(value: Any) -> None:
    with pytest.raises(
        ValueError, match=re.escape(f"timeout must be finite and >= 0, got {value!r}")
    ):
        seconds("timeout", value)


@pytest.mark.parametrize("value", [True, "1", [1], object()])
def test_seconds_refuse_what_is_not_a_number(value: Any) -> None:
    with pytest.raises(TypeError, match="timeout must be a number of seconds or None"):
        seconds("timeout", value)


def test_seconds_none_zero_and_numpy_floats() -> None:
    assert seconds("t", None) is None
    with pytest.raises(TypeError, match="t must be a number of seconds, got None"):
        seconds("t", None, allow_none=False)
    assert seconds("t", 0) == 0.0
    assert seconds("t", 0, zero_is_none=True) is None
    with pytest.raises(ValueError, match="t must be finite and > 0, got 0"):
        seconds("t", 0, positive=True)
    result = seconds("t", np.float32(1.5), allow_none=False)
    assert result == 1.5
    assert type(result) is float
    assert seconds("t", np.int64(2)) == 2.0


def test_finite_number_bounds() -> None:
    assert finite_number("m", 1) == 1.0
    assert finite_number("m", -3.5) == -3.5
    with pytest.raises(ValueError, match=r"m must be finite and >= 1.0, got 0.5"):
        finite_number("m", 0.5, minimum=1.0)
    with pytest.raises(ValueError, match="m must be finite, got inf"):
        finite_number("m", math.inf)
    with pytest.raises(TypeError, match="m must be a number, got True"):
        finite_number("m", True)


def test_fraction_or_count() -> None:
    assert fraction_or_count("f", 0.25) == 0.25
    assert fraction_or_count("f", np.int64(3)) == 3.0
    assert fraction_or_count("f", 2.0) == 2.0
    with pytest.raises(ValueError, match="f must be a count >= 0 or a fraction"):
        fraction_or_count("f", 2.5)
    with pytest.raises(ValueError, match="f must be a count"):
        fraction_or_count("f", -1)
    with pytest.raises(TypeError, match="f must be a count or a fraction, got True"):
        fraction_or_count("f", True)


# -- the other checks ---------------------------------------------------------------------------


def test_one_of_callable_or_none_and_state_keys() -> None:
    assert one_of("mode", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"mode must be one of \('a', 'b'\), got 'c'"):
        one_of("mode", "c", ("a", "b"))
    assert callable_or_none("fn", None) is None
    assert callable_or_none("fn", len) is len
    with pytest.raises(TypeError, match="fn must be callable, got 3"):
        callable_or_none("fn", 3)
    state = {"epoch": 1, "seed": 2}
    assert check_state_keys("Owner", state, {"epoch"}) is state
    with pytest.raises(TypeError, match=r"Owner.load_state_dict needs a dict, got \[\]"):
        check_state_keys("Owner", [], {"epoch"})
    with pytest.raises(ValueError, match=r"Owner.load_state_dict: state lacks \['seed'\]"):
        check_state_keys("Owner", {"epoch": 1}, {"epoch", "seed"})


def test_value_errors_makes_type_errors_both() -> None:
    with pytest.raises(WrongTypeError) as info, value_errors():
        positive_int("n", "3")
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, ValueError)
    assert str(info.value) == "n must be a positive int, got '3'"
    with (
        pytest.raises(ValueError, match="n must be a positive int, got 0") as plain,
        value_errors(),
    ):
        positive_int("n", 0)
    assert not isinstance(plain.value, TypeError)


# -- every public argument: numpy ints accepted, and each error's type and message --------------


def test_the_sampler_names_are_the_checks() -> None:
    assert validate_positive_int is positive_int
    assert validate_non_negative_int is non_negative_int


def test_numpy_integers_and_bools_are_accepted_by_the_samplers() -> None:
    sampler = BatchSampler(range(10), np.int64(4))
    assert sampler.batch_size == 4
    assert type(sampler.batch_size) is int
    assert [len(b) for b in sampler] == [4, 4, 2]
    assert type(ShardedBatchSampler(sampler, np.int32(2)).num_shards) is int
    assert list(SequentialSampler(np.int64(3))) == [0, 1, 2]
    rollover = BatchSampler(range(4), 2, "rollover")
    rollover.load_state_dict({"carry": [np.int64(1)]})
    assert rollover.carry == (1,)
    assert type(rollover.carry[0]) is int
    random_sampler = RandomSampler(np.int64(5), num_samples=np.uint8(3), seed=np.int64(7))
    assert len(random_sampler) == 3
    assert type(random_sampler.seed) is int
    random_sampler.set_epoch(np.int64(2))
    assert random_sampler.epoch == 2
    dist = DistributedSampler(np.int64(10), np.int64(2), np.int64(1), seed=np.uint16(3))
    assert (dist.num_replicas, dist.rank, dist.seed) == (2, 1, 3)
    assert type(dist.rank) is int
    assert RandomSampler(4, replacement=np.False_, seed=0).replacement is False
    dist = DistributedSampler(4, 2, 0, shuffle=np.True_, drop_last=np.False_)
    assert (dist.shuffle, dist.drop_last) == (True, False)
    assert BatchSampler(range(4), 2, drop_last=np.True_).last_batch == "discard"


SAMPLER_CASES: list[tuple[Callable[[], object], type[Exception], list[str]]] = [
    (lambda: BatchSampler(range(4), True), TypeError, ["batch_size", "True"]),
    (lambda: BatchSampler(range(4), -2), ValueError, ["batch_size", "-2"]),
    (lambda: BatchSampler(range(4), 2, drop_last=1), TypeError, ["drop_last", "1"]),
    (lambda: ShardedBatchSampler([[0]], 2.0), TypeError, ["num_shards", "2.0"]),
    (lambda: SequentialSampler(-1), ValueError, ["data_source", "-1"]),
    (lambda: RandomSampler(4, seed=1.5), TypeError, ["seed", "1.5"]),
    (lambda: RandomSampler(4, num_samples=-1), ValueError, ["num_samples", "-1"]),
    (lambda: RandomSampler(4, replacement=1), TypeError, ["replacement", "1"]),
    (lambda: RandomSampler(4).set_epoch(True), TypeError, ["epoch", "True"]),
    (lambda: DistributedSampler(4, True, 0), TypeError, ["num_replicas", "True"]),
    (lambda: DistributedSampler(4, 2, "0"), TypeError, ["rank", "'0'"]),
    (lambda: DistributedSampler(4, 2, 0, drop_last="no"), TypeError, ["drop_last", "'no'"]),
    (
        lambda: DistributedSampler(4, 2, 0).load_state_dict({"seed": 1, "epoch": -1}),
        ValueError,
        ["epoch", "-1"],
    ),
]


def test_numpy_integers_are_accepted_by_the_sources_and_the_device() -> None:
    policy = RetryPolicy(max_attempts=np.int64(3), retry_statuses=frozenset({np.int64(503)}))
    assert policy.max_attempts == 3
    assert type(policy.max_attempts) is int
    assert policy.retry_statuses == frozenset({503})
    assert all(type(status) is int for status in policy.retry_statuses)
    assert RetryPolicy(backoff_multiplier=np.float32(1.5)).backoff_multiplier == 1.5
    HTTPDataset([URL], max_connections=np.int64(4), connect_timeout=np.float32(2.5))
    assert parse_device(np.int64(1)) == parse_device(1)


def _retrying_with(deadline: Any) -> Callable[[], object]:
    async def op() -> None:
        return None

    def call() -> object:
        return asyncio.run(retrying(op, policy=RetryPolicy(), describe="x", deadline=deadline))

    return call


SOURCE_CASES: list[tuple[Callable[[], object], type[Exception], list[str]]] = [
    (lambda: RetryPolicy(max_attempts=True), TypeError, ["RetryPolicy.max_attempts", "True"]),
    (lambda: RetryPolicy(max_attempts=0), ValueError, ["RetryPolicy.max_attempts", "0"]),
    (
        lambda: RetryPolicy(backoff_initial=math.nan),
        ValueError,
        ["RetryPolicy.backoff_initial", "nan"],
    ),
    (lambda: RetryPolicy(backoff_max="1"), TypeError, ["RetryPolicy.backoff_max", "'1'"]),
    (lambda: RetryPolicy(jitter=1), TypeError, ["RetryPolicy.jitter", "1"]),
    (
        lambda: RetryPolicy(retry_statuses=frozenset({"503"})),
        TypeError,
        ["RetryPolicy.retry_statuses", "'503'"],
    ),
    (lambda: RetryPolicy().backoff(0), ValueError, ["failures", "0"]),
    (lambda: HTTPDataset([URL], read_timeout=-1), ValueError, ["read_timeout", "-1"]),
    (lambda: HTTPDataset([URL], read_timeout=math.inf), ValueError, ["read_timeout", "inf"]),
    (lambda: HTTPDataset([URL], connect_timeout=True), TypeError, ["connect_timeout", "True"]),
    (lambda: HTTPDataset([URL], max_connections=1.0), TypeError, ["max_connections", "1.0"]),
    (lambda: HTTPDataset([URL], decode=3), TypeError, ["decode", "3"]),
    (_retrying_with(0), ValueError, ["deadline", "0"]),
    (_retrying_with("1"), TypeError, ["deadline", "'1'"]),
]
DEVICE_CASES: list[tuple[Callable[[], object], type[Exception], list[str]]] = [
    (lambda: parse_device(np.int64(-1)), ValueError, ["device", "-1"]),
    (lambda: parse_device(np.float64(0)), TypeError, ["device", "0.0"]),
]
CASES = SAMPLER_CASES + SOURCE_CASES + DEVICE_CASES


@pytest.mark.parametrize(
    ("make", "error", "needles"),
    CASES,
    ids=[f"{i}-{needles[0]}" for i, (_, _, needles) in enumerate(CASES)],
)
def test_errors_have_the_right_type_and_name_the_argument_and_value(
    make: Callable[[], object], error: type[Exception], needles: list[str]
) -> None:
    assert_raises_naming(make, error, needles)


def test_the_sources_still_raise_value_errors_for_wrong_types() -> None:
    """The sources always promised ``ValueError``; a wrong type is now also a ``TypeError``."""
    for make in (
        lambda: RetryPolicy(max_attempts=2.0),
        lambda: RetryPolicy(retry_statuses=503),
        lambda: HTTPDataset([URL], item_deadline="5"),
        lambda: HTTPDataset([URL], max_connections=2.5),
    ):
        with pytest.raises(ValueError, match="must") as info:
            make()
        assert isinstance(info.value, TypeError)


# -- one set of checks --------------------------------------------------------------------------


DUPLICATES_REMOVED = [
    ("aioloader._sampling._batch_sampler", ["_checked_int", "_is_int", "_check_state_keys"]),
    ("aioloader._sampling._batch_sampler", ["validate_positive_int", "validate_non_negative_int"]),
    (
        "aioloader._sampling._sampler",
        ["_validate_int", "_checked_int", "_is_int", "_check_state_keys"],
    ),
    ("aioloader.sources._retry", ["_require_number"]),
    ("aioloader.sources._http", ["check_timeout"]),
    ("aioloader.sources._base", ["_check_decode"]),
]


def test_the_duplicated_helpers_are_gone() -> None:
    import importlib

    for module, names in DUPLICATES_REMOVED:
        for name in names:
            assert not hasattr(importlib.import_module(module), name), f"{module}.{name}"
    assert sorted(_validate.__all__) == _validate.__all__
