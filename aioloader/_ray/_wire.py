"""How a batch crosses from an actor to the training process, both sides in one place.

::

    actor:  collate_fn's batch ──as_arrays──▶ torch CPU tensors become ``TensorLeaf(numpy view)``
            ──▶ Ray pickles it (protocol 5): every array's bytes go out of band, into the object
                store of the actor's node, without a copy
    main:   ``await ref`` ──▶ the object arrives in this node's object store (moved between nodes
            by Ray, or already here) ──▶ numpy arrays are zero-copy, *read-only* views of it
            ──opened──▶ ``TensorLeaf`` becomes a writable tensor (see the rule below)

The rule for read-only memory (the user's side of it is in ``docs/ray.md``):

- A numpy leaf stays a view of the object store: no copy, and read-only (``flags.writeable``
  is False; writing raises ``ValueError: assignment destination is read-only``). The memory
  stays pinned in the store while any view of it lives.
- A tensor leaf is copied once into memory of its own, writable as any tensor. torch cannot
  mark a tensor read-only: ``torch.from_numpy`` of a read-only array warns and hands out a
  tensor whose in-place ops would write into the store's shared, immutable pages. Never that,
  silently or not. (Small objects Ray keeps in the caller's own memory arrive writable: those
  are wrapped without a copy.)

Why torch's own pickling is not used for tensors: it copies the bytes into the pickle stream
(twice more: in and out), where a numpy view goes out of band.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .._tree import map_tree

__all__ = ["TensorLeaf", "as_arrays", "opened", "wire_nbytes"]


class TensorLeaf:
    """A CPU tensor on its way from an actor: its bytes as a numpy array (out of band)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, ...]:
        return TensorLeaf, (self.array,)


def as_arrays(batch: Any) -> Any:
    """``batch`` with every CPU tensor as a :class:`TensorLeaf` (in the actor)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return batch  # no tensor can be in it

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.is_sparse:
            try:
                return TensorLeaf(value.detach().numpy())
            except (TypeError, RuntimeError):  # no numpy dtype for it (bfloat16): torch's way
                return value
        return value

    return map_tree(batch, leaf)


def opened(batch: Any) -> Any:
    """``batch`` as the consumer gets it (in the training process): tensors back, writable."""

    def leaf(value: Any) -> Any:
        if not isinstance(value, TensorLeaf):
            return value
        import torch  # an actor sent a tensor: torch is there

        array = value.array
        if not array.flags.writeable:
            array = array.copy()  # see the module docstring: never a tensor over the store
        return torch.from_numpy(array)

    return map_tree(batch, leaf)


def wire_nbytes(batch: Any) -> int:
    """Bytes of the arrays of ``batch`` as it arrived (before :func:`opened`), for statistics."""
    total = 0

    def leaf(value: Any) -> Any:
        nonlocal total
        if isinstance(value, TensorLeaf):
            total += value.array.nbytes
        elif isinstance(value, np.ndarray):
            total += value.nbytes
        return value

    map_tree(batch, leaf)
    return total
