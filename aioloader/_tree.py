"""Batch trees: the one walker over the containers of a batch.

A batch is a tree: mappings, lists and tuples (namedtuples included) are containers, anything
else is a leaf. Shared memory (encoding a batch into a slot and opening it), the wire (tensors
sent inline as numpy) and the device stage (copying each tensor) all walk batches with
:func:`map_tree` and :func:`iter_leaves`, so they agree on what a container is and how it is
rebuilt.

The rule for rebuilding a container around new leaves, in order:

- ``dict`` and ``list`` and ``tuple`` exactly: a new one of the same type;
- a namedtuple: its type, field by field;
- a mutable mapping / sequence subclass (``OrderedDict``, ``defaultdict``, a ``UserList``...):
  a shallow copy with its items replaced, which keeps extra state (a default factory);
- any other mapping / sequence type: ``type(obj)(items)``;
- where that fails: a plain ``dict``, ``tuple`` or ``list``.

Leaves are visited in a deterministic order (mapping order, then sequence order); callers may
pair the leaves of two walks by that order.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence
from typing import Any

__all__ = ["iter_leaves", "map_tree"]


def iter_leaves(obj: Any) -> Iterator[Any]:
    """Every leaf of ``obj``, in visiting order."""
    if isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_leaves(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from iter_leaves(value)
    else:
        yield obj


def map_tree(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` rebuilt with ``fn`` applied to every leaf (see the module's rule)."""
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, {key: map_tree(value, fn) for key, value in obj.items()})
    if isinstance(obj, list | tuple):
        return _rebuild_sequence(obj, [map_tree(value, fn) for value in obj])
    return fn(obj)


def _rebuild_mapping(obj: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    if type(obj) is dict:
        return items
    if isinstance(obj, MutableMapping):
        with contextlib.suppress(Exception):
            clone = copy.copy(obj)
            clone.update(items)
            return clone
    with contextlib.suppress(Exception):
        return type(obj)(items)  # type: ignore[call-arg]
    return items


def _rebuild_sequence(obj: list[Any] | tuple[Any, ...], values: list[Any]) -> Any:
    cls = type(obj)
    if cls is list:
        return values
    if cls is tuple:
        return tuple(values)
    if isinstance(obj, tuple) and hasattr(cls, "_fields"):  # namedtuple
        return cls(*values)
    if isinstance(obj, MutableSequence):
        with contextlib.suppress(Exception):
            seq = copy.copy(obj)
            seq[:] = values
            return seq
    with contextlib.suppress(Exception):
        return cls(values)
    return tuple(values) if isinstance(obj, tuple) else values
