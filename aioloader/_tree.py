"""Batch trees: the one walker over the containers of a batch.

A batch is a tree of containers around leaves. Shared memory (encoding a batch into a slot and
opening it), the wire (tensors sent inline as numpy) and the device stage (copying each tensor)
all walk batches with :func:`map_tree` and :func:`iter_leaves`, so they agree on what a
container is, in which order its leaves come, and how it is rebuilt.

Containers:

- every ``Mapping`` (``dict``, ``OrderedDict``, ``defaultdict``, ``UserDict``, ...);
- every ``tuple`` (namedtuples included) and every ``list``;
- other mutable sequences (``UserList``, ``deque``, ...), but not ``bytearray`` or
  ``array.array``: those are buffers of numbers, leaves like ``str`` and ``bytes``.

Everything else is a leaf: arrays, tensors, numbers, strings, ``None``, immutable sequences
other than tuples (``range``), which cannot be rebuilt around new leaves in general.

The rule for rebuilding a container around new leaves, in order:

- ``dict``, ``list`` and ``tuple`` exactly: a new one of the same type;
- a namedtuple: its type, field by field. A namedtuple whose constructor checks its fields
  refuses stand-ins for them (``PackedSequence`` asks ``batch_sizes.device``; a shared-memory
  descriptor has none): it becomes a *deferred* namedtuple, a plain tuple of the new leaves
  that remembers the type, pickles, and is rebuilt as that type by the next walk whose leaves
  the constructor accepts (the main process's walk that turns descriptors into tensors);
- a ``dict``, ``list`` or ``UserDict`` / ``UserList`` subclass, or a ``deque``: a shallow copy
  with its items replaced, which keeps what a constructor call would lose (a ``defaultdict``'s
  factory, a ``deque``'s ``maxlen``, attributes of a subclass). These types' copies never share
  their items with the original, so the input is never changed;
- any other container: ``type(obj)(items)`` (a mapping's items as a ``dict``, a sequence's as a
  ``list``). Its shallow copy is not used: it may share storage with the original, and
  replacing items in it would change the caller's batch;
- where that fails: a plain ``dict``, ``tuple`` (for a tuple) or ``list``.

Leaves are visited in a deterministic order: a mapping's in its iteration order, a sequence's
by position, depth first. ``iter_leaves`` and ``map_tree`` visit the same leaves in the same
order, so callers may pair the leaves of two walks by position. Neither changes its input.
"""

from __future__ import annotations

import array
import collections
import contextlib
import copy
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableSequence
from typing import Any

__all__ = ["iter_leaves", "map_tree"]

# Containers whose shallow copy holds its own items: rebuilt as a copy with new items.
_COPYABLE_MAPPINGS = (dict, collections.UserDict)
_COPYABLE_SEQUENCES = (list, collections.UserList, collections.deque)
# Mutable sequences that are buffers of numbers: leaves, like str and bytes.
_BUFFERS = (bytearray, array.array)


class _Deferred(tuple[Any, ...]):
    """A namedtuple whose constructor refused the leaves it was rebuilt around (see the module's
    rule): a tuple of those leaves, with the type to rebuild at the next walk."""

    namedtuple_type: type

    def __new__(cls, namedtuple_type: type, items: Iterable[Any]) -> _Deferred:
        self = super().__new__(cls, items)
        self.namedtuple_type = namedtuple_type
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Deferred, (self.namedtuple_type, tuple(self)))

    def __repr__(self) -> str:
        return f"<deferred {self.namedtuple_type.__qualname__}{tuple.__repr__(self)}>"


def _is_sequence(obj: object) -> bool:
    """Whether ``obj`` is a sequence container (see the module's list)."""
    return isinstance(obj, tuple | list) or (
        isinstance(obj, MutableSequence) and not isinstance(obj, _BUFFERS)
    )


def iter_leaves(obj: Any) -> Iterator[Any]:
    """Every leaf of ``obj``, in visiting order (the order :func:`map_tree` visits them)."""
    if isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_leaves(value)
    elif _is_sequence(obj):
        for value in obj:
            yield from iter_leaves(value)
    else:
        yield obj


def map_tree(
    obj: Any, fn: Callable[[Any], Any], *, is_leaf: Callable[[Any], bool] | None = None
) -> Any:
    """``obj`` rebuilt with ``fn`` applied to every leaf (see the module's rule).

    ``fn`` is called once per leaf, in visiting order; ``obj`` itself is not changed. A
    container for which ``is_leaf`` returns True is handed to ``fn`` whole, as a leaf.
    """
    if is_leaf is not None and is_leaf(obj):
        return fn(obj)
    if isinstance(obj, Mapping):
        return _rebuild_mapping(
            obj, {key: map_tree(value, fn, is_leaf=is_leaf) for key, value in obj.items()}
        )
    if _is_sequence(obj):
        return _rebuild_sequence(obj, [map_tree(value, fn, is_leaf=is_leaf) for value in obj])
    return fn(obj)


def _rebuild_mapping(obj: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    cls = type(obj)
    if cls is dict:
        return items
    if isinstance(obj, _COPYABLE_MAPPINGS):
        with contextlib.suppress(Exception):
            clone = copy.copy(obj)
            clone.update(items)
            return clone
    with contextlib.suppress(Exception):
        return cls(items)  # type: ignore[call-arg]
    return items


def _rebuild_sequence(obj: Any, values: list[Any]) -> Any:
    cls = type(obj)
    if cls is list:
        return values
    if cls is tuple:
        return tuple(values)
    if cls is _Deferred:
        cls = obj.namedtuple_type
    if isinstance(obj, tuple) and hasattr(cls, "_fields"):  # namedtuple
        try:
            return cls(*values)
        except Exception:  # never cls(values): that would put every field into the first
            return _Deferred(cls, values)
    if isinstance(obj, _COPYABLE_SEQUENCES):
        with contextlib.suppress(Exception):
            clone = copy.copy(obj)
            for i, value in enumerate(values):
                clone[i] = value
            return clone
    with contextlib.suppress(Exception):
        return cls(values)
    return tuple(values) if isinstance(obj, tuple) else values
