"""The one set of argument checks.

Every public constructor checks its arguments here, so the same kind of value is accepted or
refused by the same rule everywhere (a numpy integer ``batch_size`` is an int to ``DataLoader``
and to ``BatchSampler`` alike) and every error names the argument and the value it got.

Rules:
- integers are ``numbers.Integral`` (numpy integers included) and never ``bool``: ``batch_size=
  True`` is a bug, not an intent; the value comes back as a plain ``int``;
- numbers of seconds are finite real numbers (numpy floats included), never ``bool``;
- a wrong type raises ``TypeError``, a value of the right type out of range ``ValueError``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection
from typing import Any, TypeVar

__all__ = [
    "boolean",
    "callable_or_none",
    "check_state_keys",
    "fraction_or_count",
    "is_int",
    "non_negative_int",
    "one_of",
    "positive_int",
    "seconds",
    "to_int",
]

T = TypeVar("T")


def is_int(value: object) -> bool:
    """Whether ``value`` counts as an integer argument (numpy integers yes, bools no)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(name: str, value: object, minimum: int | None, what: str) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    result: int = int(value)  # type: ignore[call-overload]
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return result


def to_int(name: str, value: object) -> int:
    """``value`` as a plain ``int``; raises ``TypeError`` naming ``name`` if it is not one."""
    return _int(name, value, None, "an int")


def positive_int(name: str, value: object) -> int:
    """``value`` as a plain ``int`` if it is an integer > 0.

    Raises:
        TypeError: not an integer (bools are refused).
        ValueError: zero or negative.
    """
    return _int(name, value, 1, "a positive int")


def non_negative_int(name: str, value: object) -> int:
    """``value`` as a plain ``int`` if it is an integer >= 0.

    Raises:
        TypeError: not an integer (bools are refused).
        ValueError: negative.
    """
    return _int(name, value, 0, "a non-negative int")


def boolean(name: str, value: object) -> bool:
    """``value`` if it is a ``bool`` (numpy bools too); raises ``TypeError`` otherwise."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool" and type(value).__module__ == "numpy":  # numpy.bool
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def seconds(
    name: str, value: object, *, allow_none: bool = True, zero_is_none: bool = False
) -> float | None:
    """A finite, non-negative number of seconds as a ``float`` (or ``None`` where allowed).

    Args:
        name: the argument's name, for the error.
        value: what was given.
        allow_none: ``None`` means "no limit".
        zero_is_none: ``0`` also means "no limit" (torch's ``timeout=0``).

    Raises:
        TypeError: not a number (bools are refused), or ``None`` where not allowed.
        ValueError: negative, NaN or infinite.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a number of seconds{' or None' * allow_none}, got {value!r}"
        )
    result = float(value)
    if not math.isfinite(result) or result < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    if result == 0 and zero_is_none:
        return None
    return result


def fraction_or_count(name: str, value: object) -> float:
    """A count (an integer >= 0, or a float that is a whole number) or a fraction ``0 < f < 1``.

    Returned as a float: ``>= 1`` (or 0) is a count, ``< 1`` a fraction.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a count or a fraction, got {value!r}")
    result = float(value)
    if (
        not math.isfinite(result)
        or result < 0
        or (not is_int(value) and result > 1 and not result.is_integer())
    ):
        raise ValueError(f"{name} must be a count >= 0 or a fraction 0 < f < 1, got {value!r}")
    return result


def one_of(name: str, value: T, choices: Collection[T]) -> T:
    """``value`` if it is one of ``choices``; raises ``ValueError`` naming them otherwise."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def callable_or_none(name: str, value: Any) -> Callable[..., Any] | None:
    """``value`` if it is callable or ``None``; raises ``TypeError`` otherwise."""
    if value is not None and not callable(value):
        raise TypeError(f"{name} must be callable, got {value!r}")
    return value  # type: ignore[no-any-return]


def check_state_keys(owner: str, state: object, required: Collection[str]) -> dict[str, Any]:
    """``state`` if it is a dict holding every key of ``required`` (for ``load_state_dict``)."""
    if not isinstance(state, dict):
        raise TypeError(f"{owner}.load_state_dict needs a dict, got {state!r}")
    missing = set(required) - state.keys()
    if missing:
        raise ValueError(f"{owner}.load_state_dict: state lacks {sorted(missing)}, got {state!r}")
    return state
