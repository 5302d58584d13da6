"""Tests of aioloader._validate: one rule for every argument, and every public check using it."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aioloader._validate import (
    WrongTypeError,
    boolean,
    callable_or_none,
    check_state_keys,
    finite_number,
    fraction_or_count,
    is_int,
    non_negative_int,
    one_of,
    positive_int,
    seconds,
    to_int,
    value_errors,
)

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
