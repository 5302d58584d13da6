"""Batches as trees: walking a host batch and viewing its numpy / torch leaves as tensors.

The device stage walks a batch twice (once to plan each leaf's route, once to enqueue its copy)
with :func:`map_arrays`, pairing the walks by visiting order; the other helpers turn numpy leaves
into tensors without copying where torch allows it.

Sharp edges:

- The walk is :mod:`aioloader._tree`'s: leaves are visited in a deterministic order (callers
  rely on it to pair a first walk with a second one) and containers are rebuilt by its one rule
  (namedtuples field by field, a ``defaultdict`` keeps its factory).
- Only tensors and ndarrays are array leaves; anything else (numbers, strings) is kept as is.
- Only numeric numpy arrays (:data:`NUMERIC_KINDS`) become device tensors (``torch.from_numpy``
  semantics); strings, objects and datetimes pass through unchanged.
- ``torch.from_numpy`` refuses (or warns about) read-only, byte-swapped, non-contiguous,
  negatively strided (even the one-item arrays numpy calls contiguous) and misaligned arrays:
  :func:`array_as_tensor_view` returns ``None`` for them and the caller copies them instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import PackedSequence

from .._tree import map_tree

__all__ = [
    "NUMERIC_KINDS",
    "array_as_tensor_view",
    "array_ptr",
    "empty_like_leaf",
    "map_arrays",
    "torch_dtype",
]

NUMERIC_KINDS = frozenset("biufc")  # bool, signed, unsigned, float, complex


def map_arrays(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` rebuilt with ``fn`` applied to its tensor and ndarray leaves (others kept).

    The walk is :func:`aioloader._tree.map_tree`: ``fn`` sees the array leaves in visiting
    order, which callers rely on to pair a first walk with a second one.
    """

    def on_leaf(leaf: Any) -> Any:
        if isinstance(leaf, PackedSequence):
            # As PackedSequence.to() and torch's pin_memory do: batch_sizes stays on the CPU
            # (the constructor refuses it anywhere else); the other fields travel.
            data, batch_sizes, sorted_indices, unsorted_indices = leaf
            return type(leaf)(
                map_arrays(data, fn),
                batch_sizes,
                map_arrays(sorted_indices, fn),
                map_arrays(unsorted_indices, fn),
            )
        return fn(leaf) if isinstance(leaf, torch.Tensor | np.ndarray) else leaf

    return map_tree(obj, on_leaf, is_leaf=_is_packed_sequence)


def _is_packed_sequence(obj: Any) -> bool:
    return isinstance(obj, PackedSequence)


@functools.lru_cache(maxsize=64)
def torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    """The torch dtype of a numpy dtype of either byte order."""
    return torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype


def array_as_tensor_view(arr: np.ndarray[Any, Any]) -> torch.Tensor | None:
    """A zero-copy tensor over ``arr``; None where ``torch.from_numpy`` cannot (or would warn)."""
    if (
        not arr.flags.writeable
        or not arr.dtype.isnative
        or not arr.flags.c_contiguous
        or not arr.flags.aligned
        # numpy calls a reversed one-item array contiguous; torch refuses its negative stride
        or any(stride < 0 for stride in arr.strides)
    ):
        return None
    return torch.from_numpy(arr)


def array_ptr(arr: np.ndarray[Any, Any]) -> int:
    """The address of ``arr``'s first byte."""
    return int(arr.__array_interface__["data"][0])


def empty_like_leaf(leaf: torch.Tensor | np.ndarray[Any, Any]) -> torch.Tensor:
    """An uninitialised CPU tensor of ``leaf``'s shape and (torch) dtype."""
    dtype = torch_dtype(leaf.dtype) if isinstance(leaf, np.ndarray) else leaf.dtype
    return torch.empty(tuple(leaf.shape), dtype=dtype)
