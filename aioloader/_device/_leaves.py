"""Batches as trees: walking a host batch and viewing its numpy / torch leaves as tensors.

The device stage walks a batch twice (once to plan each leaf's route, once to enqueue its copy)
with :func:`_map_tree`, pairing the walks by visiting order; the other helpers turn numpy leaves
into tensors without copying where torch allows it.

Sharp edges:

- Leaves are visited in a deterministic order; callers rely on it to pair a first walk with a
  second one. Containers keep their type where it can be rebuilt (dict subclasses through
  ``copy.copy``, namedtuples field by field), else they come back as plain dicts, tuples, lists.
- Only numeric numpy arrays (:data:`_NUMERIC_KINDS`) become device tensors (``torch.from_numpy``
  semantics); strings, objects and datetimes pass through unchanged.
- ``torch.from_numpy`` refuses (or warns about) read-only, byte-swapped, non-contiguous and
  misaligned arrays: :func:`_array_as_tensor_view` returns ``None`` for them and the caller
  copies them instead.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence
from typing import Any

import numpy as np
import torch

__all__: list[str] = []

_NUMERIC_KINDS = frozenset("biufc")  # bool, signed, unsigned, float, complex


def _map_tree(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every tensor and ndarray leaf, rebuilding the containers around them.

    Containers keep their type where it can be rebuilt (dict subclasses through ``copy.copy``,
    namedtuples field by field); leaves are visited in a deterministic order, which callers rely
    on to pair a first walk with a second one.
    """
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = {key: _map_tree(value, fn) for key, value in obj.items()}
        if type(obj) is dict:
            return items
        if isinstance(obj, MutableMapping):
            with contextlib.suppress(Exception):
                clone = copy.copy(obj)
                clone.update(items)
                return clone
        return items
    if isinstance(obj, tuple):
        values = [_map_tree(value, fn) for value in obj]
        if type(obj) is tuple:
            return tuple(values)
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*values)
        try:
            return type(obj)(values)
        except Exception:
            return tuple(values)
    if isinstance(obj, list):
        values = [_map_tree(value, fn) for value in obj]
        if type(obj) is list:
            return values
        if isinstance(obj, MutableSequence):
            with contextlib.suppress(Exception):
                seq = copy.copy(obj)
                seq[:] = values
                return seq
        return values
    return obj


@functools.lru_cache(maxsize=64)
def _torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype


def _array_as_tensor_view(arr: np.ndarray[Any, Any]) -> torch.Tensor | None:
    """A zero-copy tensor over ``arr``; None where ``torch.from_numpy`` cannot (or would warn)."""
    if (
        not arr.flags.writeable
        or not arr.dtype.isnative
        or not arr.flags.c_contiguous
        or not arr.flags.aligned
    ):
        return None
    return torch.from_numpy(arr)


def _array_ptr(arr: np.ndarray[Any, Any]) -> int:
    return int(arr.__array_interface__["data"][0])


def _empty_like_leaf(leaf: torch.Tensor | np.ndarray[Any, Any]) -> torch.Tensor:
    dtype = _torch_dtype(leaf.dtype) if isinstance(leaf, np.ndarray) else leaf.dtype
    return torch.empty(tuple(leaf.shape), dtype=dtype)
