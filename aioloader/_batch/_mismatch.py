"""How samples that cannot form one batch are described: positions grouped by what they hold.

Collation refuses samples that disagree (shapes, devices, keys, types) with a message that
names what differs and where, position by position, so that the one bad sample in a batch of
thousands can be found: ``'(3, 32, 32) at positions [0, 1, 3]; (3, 28, 28) at position 2'``.
These functions build those phrases; :mod:`aioloader._batch._collate` decides when to raise them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["grouped", "key_mismatch", "layout_mismatch", "positions", "type_name"]

# Positions listed per group in an error message. More helps to spot a pattern, fewer keeps a
# 4096-sample batch's error readable; the rest is summarised as a count.
MAX_POSITIONS_SHOWN = 8


def positions(where: list[int]) -> str:
    """``'position 3'`` or ``'positions [0, 2, ... 5 more]'``."""
    if len(where) == 1:
        return f"position {where[0]}"
    shown = ", ".join(map(str, where[:MAX_POSITIONS_SHOWN]))
    more = len(where) - MAX_POSITIONS_SHOWN
    return f"positions [{shown}{f', ... {more} more' if more > 0 else ''}]"


def grouped(values: Sequence[Any], describe: Callable[[Any], str] = str) -> str:
    """``'a at positions [0, 2]; b at position 1'``: positions grouped by value, in order."""
    groups: dict[Any, list[int]] = {}
    for position, value in enumerate(values):
        groups.setdefault(value, []).append(position)
    return "; ".join(f"{describe(value)} at {positions(ps)}" for value, ps in groups.items())


def type_name(cls: type) -> str:
    """``'int'`` for builtins, ``'numpy.ndarray'`` for the rest."""
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _shape(shape: Sequence[int]) -> str:
    return str(tuple(int(d) for d in shape))


def layout_mismatch(samples: Sequence[Any], what: str) -> str:
    """Say which of shape, device and layout (strided, sparse) differ among arrays or tensors,
    position by position (empty if none does)."""
    problems = []
    shapes = [_shape(s.shape) for s in samples]
    if len(set(shapes)) > 1:
        problems.append(f"{what} have different shapes: {grouped(shapes)}")
    devices = [str(getattr(s, "device", "cpu")) for s in samples]
    if len(set(devices)) > 1:
        problems.append(f"{what} are on different devices: {grouped(devices)}")
    layouts = [str(getattr(s, "layout", "")) for s in samples]
    if len(set(layouts)) > 1:
        problems.append(f"{what} have different layouts: {grouped(layouts)}")
    return "; and ".join(problems)


def key_mismatch(samples: Sequence[Mapping[Any, Any]]) -> str:
    """Describe each sample's keys against those of the first sample."""
    reference = list(samples[0].keys())
    groups: dict[tuple[tuple[Any, ...], tuple[Any, ...]], list[int]] = {}
    for position, sample in enumerate(samples[1:], start=1):
        keys = sample.keys()
        missing = tuple(k for k in reference if k not in keys)
        extra = tuple(k for k in keys if k not in samples[0])
        if missing or extra:
            groups.setdefault((missing, extra), []).append(position)
    parts = [f"position 0 has keys {reference!r}"]
    for (missing, extra), where in groups.items():
        what = []
        if missing:
            what.append(f"lacks {list(missing)!r}")
        if extra:
            what.append(f"has extra {list(extra)!r}")
        parts.append(f"{positions(where)} {' and '.join(what)}")
    return f"samples have different keys: {'; '.join(parts)}"
