"""Tests of aioloader._tree: which objects are containers, how they are rebuilt, leaf order."""

from __future__ import annotations

import array
import collections
import copy
import dataclasses
import pickle
import types
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader._tree import iter_leaves, map_tree


class Point(NamedTuple):
    x: Any
    y: Any


class Pair(tuple[Any, ...]):
    """A plain tuple subclass: rebuilt by calling it with the items."""


class Tagged(list[Any]):
    """A list subclass with an attribute a constructor call would lose."""

    tag = "class"


class Frozen(Mapping[str, Any]):
    """A read-only mapping whose constructor takes no items: it cannot be rebuilt."""

    def __init__(self) -> None:
        self._data = {"a": 1, "b": np.arange(3)}

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class Store(MutableMapping[str, Any]):
    """A mutable mapping over a dict attribute: its shallow copy shares that dict."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data = dict(data or {})

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value

    def __delitem__(self, key: str) -> None:
        del self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


class _StrictBase(NamedTuple):
    n: int


class Strict(_StrictBase):
    """A namedtuple whose constructor refuses anything but ints."""

    __slots__ = ()

    def __new__(cls, n: Any) -> Strict:
        if not isinstance(n, int):
            raise TypeError(f"n must be an int, got {n!r}")
        return super().__new__(cls, n)


@dataclasses.dataclass(frozen=True)
class Box:
    """A leaf standing in for another, as a shared-memory descriptor stands in for an array."""

    value: Any


def double(x: Any) -> Any:
    return x * 2


# -- the rebuild rule, container by container ---------------------------------------------------


def test_plain_containers_come_back_as_new_ones_of_the_same_type() -> None:
    tree = {"a": [1, (2, 3)], "b": ()}
    out = map_tree(tree, double)
    assert out == {"a": [2, (4, 6)], "b": ()}
    assert type(out["a"]) is list
    assert type(out["a"][1]) is tuple
    assert out is not tree
    assert out["a"] is not tree["a"]


def test_namedtuple_is_rebuilt_field_by_field() -> None:
    out = map_tree(Point(1, [2]), double)
    assert type(out) is Point
    assert out == Point(2, [4])


def test_namedtuple_that_refuses_the_new_leaves_is_deferred_until_it_accepts_them() -> None:
    out = map_tree(Strict(1), str)
    assert isinstance(out, tuple)
    assert not isinstance(out, Strict)
    assert out == ("1",)
    assert list(iter_leaves(out)) == ["1"]
    assert "Strict" in repr(out)
    # It pickles (a worker sends it), and the next walk whose leaves fit rebuilds the type.
    back = map_tree(pickle.loads(pickle.dumps(out)), int)
    assert type(back) is Strict
    assert back == Strict(1)
    assert type(map_tree(out, lambda leaf: leaf)) is type(out)  # still refused: still deferred


def test_packed_sequence_survives_stand_in_leaves_and_pickling() -> None:
    import torch
    from torch.nn.utils.rnn import PackedSequence, pack_sequence

    packed = pack_sequence([torch.arange(3.0), torch.arange(2.0)], enforce_sorted=False)
    stand_ins = map_tree(packed, lambda t: Box(t.tolist()))
    assert not isinstance(stand_ins, PackedSequence)  # its constructor wants tensors
    back = map_tree(pickle.loads(pickle.dumps(stand_ins)), lambda box: torch.tensor(box.value))
    assert type(back) is PackedSequence
    for field in PackedSequence._fields:
        assert torch.equal(getattr(back, field), getattr(packed, field)), field


def test_ordered_dict_keeps_its_type_and_order() -> None:
    tree = collections.OrderedDict([("z", 1), ("a", 2), ("m", 3)])
    out = map_tree(tree, double)
    assert type(out) is collections.OrderedDict
    assert list(out.items()) == [("z", 2), ("a", 4), ("m", 6)]


def test_defaultdict_keeps_its_factory() -> None:
    tree: collections.defaultdict[str, Any] = collections.defaultdict(list, {"x": 1})
    out = map_tree(tree, double)
    assert type(out) is collections.defaultdict
    assert out.default_factory is list
    assert out == {"x": 2}
    assert out["missing"] == []
    assert "missing" not in tree  # the input is not touched


def test_user_dict_and_user_list_are_containers_and_keep_their_types() -> None:
    tree = collections.UserDict({"a": collections.UserList([1, 2])})
    out = map_tree(tree, double)
    assert type(out) is collections.UserDict
    assert type(out["a"]) is collections.UserList
    assert out["a"] == collections.UserList([2, 4])
    assert list(iter_leaves(tree)) == [1, 2]
    assert tree["a"] == collections.UserList([1, 2])  # the input is not touched


def test_deque_keeps_its_maxlen() -> None:
    tree = collections.deque([1, 2], maxlen=2)
    out = map_tree(tree, double)
    assert type(out) is collections.deque
    assert out.maxlen == 2
    assert list(out) == [2, 4]


def test_list_subclass_keeps_its_type_and_attributes() -> None:
    tree = Tagged([1, 2])
    tree.tag = "instance"
    out = map_tree(tree, double)
    assert type(out) is Tagged
    assert out == [2, 4]
    assert out.tag == "instance"
    assert tree == [1, 2]


def test_tuple_subclass_is_rebuilt_with_its_type() -> None:
    out = map_tree(Pair((1, 2)), double)
    assert type(out) is Pair
    assert out == (2, 4)


def test_mapping_that_cannot_be_rebuilt_falls_back_to_dict() -> None:
    out = map_tree(Frozen(), double)
    assert type(out) is dict
    assert out["a"] == 2
    assert out["b"].tolist() == [0, 2, 4]


def test_mapping_proxy_is_rebuilt_by_its_constructor() -> None:
    out = map_tree(types.MappingProxyType({"a": 1}), double)
    assert type(out) is types.MappingProxyType
    assert out == {"a": 2}


def test_mutable_mapping_whose_copy_shares_storage_is_never_changed() -> None:
    tree = Store({"a": 1, "b": [2]})
    out = map_tree(tree, double)
    assert type(out) is Store  # rebuilt by its constructor, not by a shared copy
    assert dict(out) == {"a": 2, "b": [4]}
    assert dict(tree) == {"a": 1, "b": [2]}


@pytest.mark.parametrize(
    "leaf",
    [
        "text",
        b"bytes",
        bytearray(b"buffer"),
        array.array("i", [1, 2, 3]),
        range(3),
        None,
        3.5,
        np.arange(4),
        np.int64(7),
    ],
    ids=lambda leaf: type(leaf).__name__,
)
def test_strings_buffers_ranges_arrays_and_scalars_are_leaves(leaf: Any) -> None:
    seen: list[Any] = []

    def visit(x: Any) -> Any:
        seen.append(x)
        return x

    out = map_tree({"k": leaf}, visit)
    assert len(seen) == 1
    assert seen[0] is leaf
    assert out["k"] is leaf
    assert list(iter_leaves([leaf])) == [leaf]


def test_nested_containers_of_every_kind() -> None:
    dd: collections.defaultdict[str, Any] = collections.defaultdict(int, {"n": [1, Point(2, 3)]})
    tree = {
        "od": collections.OrderedDict(b=(4, Pair((5, 6))), a=collections.UserList([7])),
        "dd": dd,
        "empty": [[], {}, ()],
        "frozen": Frozen(),
    }
    out = map_tree(tree, lambda x: x + 100 if isinstance(x, int) else x)
    assert type(out["od"]) is collections.OrderedDict
    assert list(out["od"]) == ["b", "a"]
    assert out["od"]["b"] == (104, Pair((105, 106)))
    assert type(out["od"]["b"][1]) is Pair
    assert type(out["od"]["a"]) is collections.UserList
    assert out["od"]["a"][0] == 107
    assert out["dd"].default_factory is int
    assert out["dd"]["n"] == [101, Point(102, 103)]
    assert type(out["dd"]["n"][1]) is Point
    assert out["empty"] == [[], {}, ()]
    assert type(out["frozen"]) is dict
    assert out["frozen"]["a"] == 101
    ints = [x for x in iter_leaves(tree) if isinstance(x, int)]
    assert ints == [4, 5, 6, 7, 1, 2, 3, 1]


# -- invariants over any tree -------------------------------------------------------------------


_leaves = st.integers() | st.text(max_size=3) | st.none() | st.binary(max_size=3)
_trees = st.recursive(
    _leaves,
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.builds(Point, kids, kids),
        st.dictionaries(st.text(max_size=2), kids, max_size=3),
        st.dictionaries(st.text(max_size=2), kids, max_size=3).map(collections.OrderedDict),
        st.dictionaries(st.text(max_size=2), kids, max_size=3).map(
            lambda d: collections.defaultdict(list, d)
        ),
        st.lists(kids, max_size=3).map(collections.UserList),
        st.lists(kids, max_size=3).map(Tagged),
    ),
    max_leaves=12,
)


def _shape(tree: Any) -> Any:
    """The tree with types made explicit, so equal shapes mean equal types and leaves."""
    if isinstance(tree, Mapping):
        return (type(tree), [(k, _shape(v)) for k, v in tree.items()])
    if isinstance(tree, list | tuple | collections.UserList):
        return (type(tree), [_shape(v) for v in tree])
    return (type(tree), tree)


@settings(max_examples=150, deadline=None)
@given(tree=_trees)
def test_map_tree_visits_the_leaves_of_iter_leaves_in_the_same_order(tree: Any) -> None:
    seen: list[Any] = []

    def number(leaf: Any) -> int:
        seen.append(leaf)
        return len(seen) - 1

    out = map_tree(tree, number)
    leaves = list(iter_leaves(tree))
    assert len(seen) == len(leaves)
    assert all(a is b for a, b in zip(seen, leaves, strict=True))
    # The rebuilt tree holds each leaf's position, in visiting order.
    assert list(iter_leaves(out)) == list(range(len(leaves)))


@settings(max_examples=150, deadline=None)
@given(tree=_trees)
def test_identity_map_rebuilds_the_same_tree_and_never_changes_its_input(tree: Any) -> None:
    before = copy.deepcopy(tree)
    out = map_tree(tree, lambda leaf: leaf)
    assert _shape(out) == _shape(tree)
    assert _shape(tree) == _shape(before)
    if isinstance(tree, collections.defaultdict):
        assert out.default_factory is tree.default_factory


@settings(max_examples=60, deadline=None)
@given(tree=_trees)
def test_visiting_order_is_stable_across_walks(tree: Any) -> None:
    first = list(iter_leaves(tree))
    again = list(iter_leaves(map_tree(tree, lambda leaf: leaf)))
    assert all(a is b for a, b in zip(first, again, strict=True))
    assert len(first) == len(again)


# -- every walk of the package is this one ------------------------------------------------------


def test_shared_memory_walks_with_tree() -> None:
    from aioloader._shm import _descriptors as _shm_tree

    assert vars(_shm_tree)["map_tree"] is map_tree
    assert vars(_shm_tree)["iter_leaves"] is iter_leaves
    assert not hasattr(_shm_tree, "_map_tree")


def test_the_device_stage_walks_with_tree_and_maps_only_arrays_and_tensors() -> None:
    import torch

    from aioloader._device import _leaves

    assert not hasattr(_leaves, "_map_tree")
    tree = collections.UserList([np.arange(2), torch.ones(2), 3, "s", Point(np.zeros(1), None)])
    seen: list[Any] = []

    def move(leaf: Any) -> str:
        seen.append(leaf)
        return "moved"

    out = _leaves.map_arrays(tree, move)
    assert type(out) is collections.UserList
    assert list(out) == ["moved", "moved", 3, "s", Point("moved", None)]
    assert [type(x).__name__ for x in seen] == ["ndarray", "Tensor", "ndarray"]
