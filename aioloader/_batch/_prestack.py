"""Stacking a batch's large arrays as its samples are read, while each is still in cache.

Collation stacks each array leaf once every sample of the batch has been read. For large
samples (images) that is a second trip through memory: every sample is written once where
``__getitem__`` makes it, fresh memory since the samples before it are all still held, and
read again when the batch is stacked, by when the ones after it have pushed it out of the
CPU's caches. :class:`Prestack` copies each sample's large arrays into the batch's output the
moment the sample is read, and keeps in its place a view of the copy: the sample's own memory
goes back to the allocator at once, and the next sample is made in it, still cached.
:func:`aioloader._batch._collate.collate_prestacked` then takes the stacked arrays as the leaves.

Measured on 2 cores, 64 samples of 3x224x224 uint8 flipped by ``__getitem__`` (9.6 MB a batch),
into memory already faulted in, two processes side by side as two workers run: 2.65 ms a batch
copied as each sample is read, against 3.1 ms read first and stacked after (2.9 ms copied as
read but with every sample kept).

What it never changes is the batch. It handles only what the default collate functions would
stack unchanged: a leaf that is a numpy array in every sample (``np.memmap`` slices too; not
masked arrays), or a plain CPU tensor in every sample (``torch.Tensor`` itself, strided, not
requiring grad, no conjugate or negative bit: what a ``ToTensor`` or ``permute`` makes, often
a strided view whose copy is the costly part of stacking), of one shape and one numeric dtype
(in native byte order), with at least one dimension, the sample itself or one level down in
a ``dict``, ``list``, ``tuple`` or namedtuple (``(image, label)``, ``{"image": ..., "label":
...}``). The samples the collate function gets have the same values and container types (a
container is copied, never changed: the dataset may hold it; a tensor's place gets a tensor
view of its copy), and it checks them all as before, so its errors are the ones it always gave.

A sample that differs at a leaf (another shape, dtype or type) leaves that leaf to the collate
function, which stacks it (or promotes it, or raises) from the samples; the array begun for it
then goes unused in the batch's memory, so that batch needs a slot up to twice its size, or
travels inline once. The caller stops stacking after such a batch (:attr:`Prestack.broke`):
a data set that mixes dtypes costs that once, not every batch.

One difference is deliberate: a data set that hands out one buffer and then overwrites it
(a sample that is not its own memory) gets each sample as it was when read, where stacking at
the end would repeat the last one. And where a collate function keeps samples as they are
(a field that is None in some samples becomes a list of them), such a list holds the views of
the copies: the same values, C-contiguous (a permuted tensor's strides are not kept).
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import numpy as np

from .._types import Alloc

__all__ = ["MIN_BATCH_BYTES", "Prestack", "paths"]

#: A leaf is stacked as it is read when its batch holds at least this many bytes of it: below,
#: every sample still sits in the CPU's caches when the collate function stacks it.
MIN_BATCH_BYTES = 1 << 20

# numpy dtype kinds stacked as they are read: bool, signed and unsigned ints, floats, complex.
_NUMERIC = frozenset("biufc")


def paths(sample: Any) -> list[tuple[str, Any]]:
    """Where ``sample``'s arrays may be, named as the collate functions name key paths (the
    root ``batch``, ``batch['image']``, ``batch[0]``, ``batch.image``), each with its key, index
    or field in the sample (None for the root). Empty for any other type of sample."""
    kind = _kind(sample)
    if kind is np.ndarray or kind is _Tensor:
        return [("batch", None)]
    if kind is dict:
        named = [(f"batch[{key!r}]", key) for key in sample]
        # Two keys that print alike would name one leaf: the collate function could not tell
        # which array is whose.
        counts = collections.Counter(path for path, _ in named)
        return [(path, key) for path, key in named if counts[path] == 1]
    if _is_namedtuple(kind):
        return [(f"batch.{name}", name) for name in sample._fields]
    if kind is list or kind is tuple:
        return [(f"batch[{i}]", i) for i in range(len(sample))]
    return []


def _is_namedtuple(kind: type) -> bool:
    return issubclass(kind, tuple) and hasattr(kind, "_fields") and hasattr(kind, "_replace")


class _Tensor:
    """The kind of a sample that is a plain tensor (:func:`_kind`)."""


def _kind(sample: Any) -> type:
    """What decides where a sample's arrays are: its type (any plain array counts as one, and
    any plain tensor)."""
    if _plain_array(sample):
        return np.ndarray
    return _Tensor if _plain_tensor(sample) else type(sample)


def _plain_array(value: Any) -> bool:
    """A numpy array whose values are all it holds (a masked array's mask would be lost)."""
    return isinstance(value, np.ndarray) and not isinstance(value, np.ma.MaskedArray)


def _plain_tensor(value: Any) -> bool:
    """A ``torch.Tensor`` (not a subclass) the collate functions stack by numpy: on the CPU,
    strided, not requiring grad, no conjugate or negative bit, neither nested nor quantized."""
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and type(value) is torch.Tensor
        and value.device.type == "cpu"
        and value.layout == torch.strided
        and not value.requires_grad
        and not value.is_conj()
        and not value.is_neg()
        and not value.is_nested
        and not value.is_quantized
    )


def _as_array(value: Any) -> np.ndarray[Any, Any] | None:
    """The numpy view of a plain array or tensor leaf (a tensor's dtype numpy has), else None."""
    if _plain_array(value):
        return value  # type: ignore[no-any-return]
    if _plain_tensor(value):
        try:
            return value.numpy()  # type: ignore[no-any-return]
        except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16)
            return None
    return None


def _get(sample: Any, route: Any, by_name: bool) -> Any:
    if route is None:
        return sample
    return getattr(sample, route) if by_name else sample[route]


class _Leaf:
    __slots__ = ("array", "path", "route", "tensor", "whole")

    def __init__(self, path: str, route: Any, array: np.ndarray[Any, Any], tensor: Any) -> None:
        self.path = path
        self.route = route  # key, index or field name in the sample; None: the sample itself
        self.array = array
        self.tensor = tensor  # the torch dtype of a tensor leaf; None: a numpy leaf
        self.whole = True  # every sample so far was copied in


class Prestack:
    """The large array leaves of one batch of ``size`` samples, stacked as the samples come.

    Feed every sample in order (:meth:`feed`, positions 0, 1, ...) and keep what it returns in
    the sample's place; then :attr:`stacked` maps the key path of each leaf that every sample
    filled to its stacked array, made by ``alloc``. Not thread-safe: one batch, one thread.
    """

    __slots__ = ("_alloc", "_by_name", "_kind", "_leaves", "_size", "active")

    def __init__(self, alloc: Alloc, size: int) -> None:
        self._alloc = alloc
        self._size = size
        self._kind: type | None = None  # the first sample's type
        self._by_name = False  # leaves are namedtuple fields
        self._leaves: list[_Leaf] = []
        #: Whether the first sample had a leaf to stack (:meth:`feed` does nothing else).
        self.active = False

    def feed(self, position: int, sample: Any) -> Any:
        """Copy the large arrays of ``sample``, the batch's sample at ``position``, into place;
        return the sample to keep: ``sample`` with each of them replaced by a view of its copy
        (a container copied for that), or ``sample`` itself."""
        if position == 0:
            self._begin(sample)
        elif not self._leaves:
            return sample
        elif _kind(sample) is not self._kind:
            for leaf in self._leaves:
                leaf.whole = False
            return sample
        views: dict[Any, Any] = {}  # route -> the view of the copy (an array, or a tensor)
        for leaf in self._leaves:
            if not leaf.whole:
                continue
            try:
                value = _get(sample, leaf.route, self._by_name)
            except (KeyError, IndexError):  # the collate function says what differs
                leaf.whole = False
                continue
            array = leaf.array
            if leaf.tensor is None:
                if (
                    not _plain_array(value)
                    or value.dtype != array.dtype
                    or value.shape != array.shape[1:]
                ):
                    leaf.whole = False
                    continue
                if position:
                    array[position] = value
                views[leaf.route] = array[position]
                continue
            if (
                not _plain_tensor(value)
                or value.dtype != leaf.tensor
                or tuple(value.shape) != array.shape[1:]
            ):
                leaf.whole = False
                continue
            if position:
                array[position] = value.numpy()
            views[leaf.route] = _from_numpy(array[position])
        return self._replaced(sample, views) if views else sample

    @property
    def broke(self) -> bool:
        """Whether a sample differed at a leaf begun (its array goes unused)."""
        return not all(leaf.whole for leaf in self._leaves)

    @property
    def stacked(self) -> dict[str, np.ndarray[Any, Any]]:
        """Key path -> the stacked array, for every leaf each sample fed so far filled."""
        return {leaf.path: leaf.array for leaf in self._leaves if leaf.whole}

    def _begin(self, first: Any) -> None:
        self._kind = _kind(first)
        self._by_name = _is_namedtuple(self._kind)
        for path, route in paths(first):
            leaf = _get(first, route, self._by_name)
            value = _as_array(leaf)
            if (
                value is None
                or value.ndim == 0  # its row of the stack would be a scalar, not a view
                or value.dtype.kind not in _NUMERIC
                or not value.dtype.isnative
                or value.nbytes * self._size < MIN_BATCH_BYTES
            ):
                continue
            try:
                array = self._alloc((self._size, *value.shape), value.dtype)
            except Exception:  # the collate function allocates it again and says why
                continue
            array[0] = value
            tensor = None if value is leaf else leaf.dtype
            self._leaves.append(_Leaf(path, route, array, tensor))
        self.active = bool(self._leaves)

    def _replaced(self, sample: Any, views: dict[Any, Any]) -> Any:
        """``sample`` with the leaves in ``views`` replaced, the sample itself never changed."""
        if None in views:
            return views[None]
        kind = self._kind
        if kind is dict:
            return {**sample, **views}
        if self._by_name:
            return sample._replace(**views)
        items = [views.get(i, item) for i, item in enumerate(sample)]
        return items if kind is list else tuple(items)


def _from_numpy(array: np.ndarray[Any, Any]) -> Any:
    return sys.modules["torch"].from_numpy(array)
