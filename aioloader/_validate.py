"""The one set of argument checks.

Every public constructor checks its arguments here, so the same kind of value is accepted or
refused by the same rule everywhere (a numpy integer ``batch_size`` is an int to ``DataLoader``
and to ``BatchSampler`` alike) and every error names the argument and the value it got.

Rules:
- integers are ``numbers.Integral`` (numpy integers included) and never ``bool``: ``batch_size=
  True`` is a bug, not an intent; the value comes back as a plain ``int``;
- a loader's on/off flags are bools, numpy bools, or the integers 0 and 1 (a YAML or argparse
  config's ``shuffle: 1``), as torch takes them (:func:`flag`); elsewhere a bool is a bool
  (:func:`boolean`), as torch's samplers require (``drop_last``, ``replacement``);
- numbers (and numbers of seconds) are finite real numbers (numpy floats included), never
  ``bool``; they come back as a plain ``float``;
- a wrong type raises ``TypeError``, a value of the right type out of range ``ValueError``.
  Where an API has always promised ``ValueError`` for both (the sources, ``RetryPolicy``), or
  torch raises it for both (``batch_size``, ``drop_last``, ``num_samples``: :func:`as_torch`),
  its checks run under :func:`value_errors`, which raises a :class:`WrongTypeError`: both.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Collection, Iterator
from typing import Any, Literal, TypeGuard, TypeVar, overload

__all__ = [
    "WrongTypeError",
    "as_torch",
    "boolean",
    "callable_or_none",
    "check_state_keys",
    "decided_by",
    "finite_number",
    "flag",
    "fraction_or_count",
    "instance_or_none",
    "is_int",
    "non_negative_int",
    "one_of",
    "positive_int",
    "seconds",
    "to_int",
    "value_errors",
]

T = TypeVar("T")


def is_int(value: object) -> TypeGuard[numbers.Integral]:
    """Whether ``value`` counts as an integer argument (numpy integers yes, bools no)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(name: str, value: object, minimum: int | None, what: str) -> int:
    if not is_int(value):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    result = int(value)
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
    # numpy.bool (numpy.bool_ before numpy 2), without importing numpy here.
    if type(value).__name__ in ("bool", "bool_") and type(value).__module__ == "numpy":
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def flag(name: str, value: object) -> bool:
    """A loader's on/off setting (``shuffle``, ``pin_memory``, ...): a ``bool`` (numpy bools
    too), or the integer 0 or 1, as YAML and argparse configs give them and torch takes them.

    Any other value is refused as :func:`boolean` refuses it: ``"no"`` or ``2`` is a bug in a
    config, where torch would read it by its truth (``shuffle="no"`` shuffles).

    Raises:
        TypeError: not a bool, nor an integer equal to 0 or 1.
    """
    if is_int(value) and value in (0, 1):
        return bool(value)
    return boolean(name, value)


def _real(name: str, value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    return float(value)


def finite_number(name: str, value: object, *, minimum: float | None = None) -> float:
    """A finite real number (numpy floats too, bools not) as a ``float``, at least ``minimum``.

    Raises:
        TypeError: not a real number.
        ValueError: NaN, infinite, or below ``minimum``.
    """
    result = _real(name, value, "a number")
    if not math.isfinite(result) or (minimum is not None and result < minimum):
        bound = "" if minimum is None else f" and >= {minimum}"
        raise ValueError(f"{name} must be finite{bound}, got {value!r}")
    return result


@overload
def seconds(
    name: str, value: object, *, allow_none: Literal[False], positive: bool = ...
) -> float: ...


@overload
def seconds(
    name: str,
    value: object,
    *,
    allow_none: bool = ...,
    zero_is_none: bool = ...,
    positive: bool = ...,
) -> float | None: ...


def seconds(
    name: str,
    value: object,
    *,
    allow_none: bool = True,
    zero_is_none: bool = False,
    positive: bool = False,
) -> float | None:
    """A finite, non-negative number of seconds as a ``float`` (or ``None`` where allowed).

    Args:
        name: the argument's name, for the error.
        value: what was given.
        allow_none: ``None`` means "no limit".
        zero_is_none: ``0`` also means "no limit" (torch's ``timeout=0``).
        positive: ``0`` is refused too (a timeout of no time at all is a bug).

    Raises:
        TypeError: not a number (bools are refused), or ``None`` where not allowed.
        ValueError: negative, NaN or infinite (or zero, with ``positive``).
    """
    if value is None and allow_none:
        return None
    result = _real(name, value, f"a number of seconds{' or None' * allow_none}")
    if not math.isfinite(result) or result < 0 or (positive and result == 0):
        raise ValueError(f"{name} must be finite and {'>' if positive else '>='} 0, got {value!r}")
    if result == 0 and zero_is_none:
        return None
    return result


def fraction_or_count(name: str, value: object) -> float:
    """A count (an integer >= 0, or a float that is a whole number) or a fraction ``0 < f < 1``.

    Returned as a float: ``>= 1`` (or 0) is a count, ``< 1`` a fraction.
    """
    result = _real(name, value, "a count or a fraction")
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


def instance_or_none(name: str, value: object, kind: type[T]) -> T | None:
    """``value`` if it is a ``kind`` or ``None``; raises ``TypeError`` naming ``name`` otherwise."""
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__} or None, got {value!r}")
    return value


def decided_by(
    owner: str,
    owner_value: object,
    name: str,
    value: object,
    decided: object,
    *,
    unset: object = None,
) -> None:
    """Refuse ``name=value`` beside ``owner=owner_value``, which decides that setting (as
    ``decided``): leaving it ``unset``, or giving the same, is fine. A bool never equals a
    number here (``num_workers=True`` is not 1).

    Raises:
        ValueError: names both arguments and both values.
    """
    if _same(value, unset) or _same(value, decided):
        return
    raise ValueError(
        f"{name}={value!r} conflicts with {owner}={owner_value!r}, which decides it "
        f"({name}={decided!r} there): leave {name} out, or give the same"
    )


def _same(a: object, b: object) -> bool:
    return a is b or (isinstance(a, bool) == isinstance(b, bool) and a == b)


def check_state_keys(owner: str, state: object, required: Collection[str]) -> dict[str, Any]:
    """``state`` if it is a dict holding every key of ``required`` (for ``load_state_dict``)."""
    if not isinstance(state, dict):
        raise TypeError(f"{owner}.load_state_dict needs a dict, got {state!r}")
    missing = set(required) - state.keys()
    if missing:
        raise ValueError(f"{owner}.load_state_dict: state lacks {sorted(missing)}, got {state!r}")
    return state


class WrongTypeError(TypeError, ValueError):
    """An argument of the wrong type, where an API has always promised ``ValueError``.

    It is a ``TypeError``, as the rule says, and still a ``ValueError``, so the ``except``
    clauses callers wrote against either keep working.
    """


@contextlib.contextmanager
def value_errors() -> Iterator[None]:
    """Run checks whose ``TypeError`` must also be a ``ValueError`` (see :class:`WrongTypeError`).

    Wrap only calls of this module's checks: any ``TypeError`` raised inside is translated.
    """
    try:
        yield
    except TypeError as exc:
        if isinstance(exc, WrongTypeError):
            raise
        raise WrongTypeError(*exc.args) from None


def as_torch(check: Callable[[str, Any], T], name: str, value: object) -> T:
    """``check(name, value)`` for an argument torch refuses with ``ValueError`` whatever is
    wrong with it (``batch_size``, ``drop_last``, ``num_samples``): a wrong type raises a
    :class:`WrongTypeError`, so code that catches torch's ``ValueError`` still catches it."""
    with value_errors():
        return check(name, value)
