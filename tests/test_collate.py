"""Tests of aioloader._batch._collate: torch parity, numpy output, the alloc path, errors."""

from __future__ import annotations

import collections
import copy
import decimal
import functools
import os
import subprocess
import sys
import textwrap
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from torch.utils.data import default_collate as torch_collate

from aioloader._batch._collate import PAD_HINT, default_collate, numpy_collate
from aioloader._errors import (
    AioloaderError,
    CollateError,
    CollateShapeError,
    CollateTypeError,
)

relaxed = settings(deadline=None, max_examples=60)


class Point(NamedTuple):
    x: Any
    y: Any


class Other(NamedTuple):
    x: Any
    y: Any


def assert_same(ours: Any, theirs: Any, path: str = "batch") -> None:
    """Same types all the way down, same dtypes and shapes, equal values."""
    assert type(ours) is type(theirs), f"{path}: {type(ours)} vs {type(theirs)}"
    if isinstance(theirs, torch.Tensor):
        assert ours.dtype == theirs.dtype, f"{path}: {ours.dtype} vs {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{path}: {ours.shape} vs {theirs.shape}"
        assert torch.equal(ours, theirs), f"{path}: {ours} vs {theirs}"
    elif isinstance(theirs, np.ndarray):
        assert ours.dtype == theirs.dtype, f"{path}: {ours.dtype} vs {theirs.dtype}"
        np.testing.assert_array_equal(ours, theirs)
    elif isinstance(theirs, Mapping):
        assert list(ours) == list(theirs), f"{path}: keys {list(ours)} vs {list(theirs)}"
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{path}[{key!r}]")
    elif isinstance(theirs, list | tuple):
        assert len(ours) == len(theirs), f"{path}: length {len(ours)} vs {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert ours == theirs, f"{path}: {ours!r} vs {theirs!r}"


def as_numpy(batch: Any) -> Any:
    """default_collate's output with every tensor turned into a numpy array."""
    if isinstance(batch, torch.Tensor):
        return batch.numpy()
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*map(as_numpy, batch))
    if isinstance(batch, dict):  # a copy keeps the type (and a defaultdict's factory)
        clone = copy.copy(batch)
        clone.update((k, as_numpy(v)) for k, v in batch.items())
        return clone
    if isinstance(batch, list):
        return [as_numpy(v) for v in batch]
    return batch


def leaves(batch: Any) -> list[Any]:
    if isinstance(batch, Mapping):
        return [x for v in batch.values() for x in leaves(v)]
    if isinstance(batch, list | tuple):
        return [x for v in batch for x in leaves(v)]
    return [batch]


# -- parity with torch --------------------------------------------------------------------------


def _array(dtype: Any, shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 100, size=shape)).astype(dtype)


TORCH_CASES: dict[str, Sequence[Any]] = {
    "ints": [1, -2, 3, 2**62],
    "floats": [1.5, -2.25, float("inf")],
    "bools": [True, False, True],
    "strings": ["a", "bc", ""],
    "bytes": [b"a", b"\x00"],
    "numpy float32 scalars": [np.float32(1.5), np.float32(2)],
    "numpy int32 scalars": [np.int32(7), np.int32(-1)],
    "numpy uint8 scalars": [np.uint8(7), np.uint8(255)],
    "numpy bool scalars": [np.bool_(True), np.bool_(False)],
    "numpy float16 scalars": [np.float16(0.5), np.float16(1)],
    "numpy str scalars": [np.str_("x"), np.str_("y")],
    "0-d arrays": [np.array(1.5), np.array(2.5)],
    "float32 arrays": [_array(np.float32, (3, 4), s) for s in range(3)],
    "uint8 images": [_array(np.uint8, (2, 5, 5), s) for s in range(4)],
    "int16 arrays": [_array(np.int16, (7,), s) for s in range(2)],
    "bool arrays": [_array(np.bool_, (3,), s) for s in range(2)],
    "complex arrays": [_array(np.complex64, (2,), s) for s in range(2)],
    "float32 tensors": [torch.from_numpy(_array(np.float32, (2, 3), s)) for s in range(3)],
    "int64 tensors": [torch.arange(4) * s for s in range(3)],
    "bool tensors": [torch.tensor([True, False]), torch.tensor([False, False])],
    "bfloat16 tensors": [torch.ones(3, dtype=torch.bfloat16) * s for s in range(2)],
    "0-d tensors": [torch.tensor(1.0), torch.tensor(2.0)],
    "tuples become lists, their strings tuples": [(1, 2.0, "a"), (3, 4.0, "b")],
    "strings under keys stay lists": [{"path": "a"}, {"path": "b"}],
    "tuple of samples": (1, 2),
    "lists": [[1, 2], [3, 4]],
    "namedtuples": [Point(1, np.zeros(2)), Point(2, np.ones(2))],
    "dict of tuple of arrays": [
        {"image": (_array(np.float32, (2, 2), s), _array(np.uint8, (3,), s)), "label": s}
        for s in range(3)
    ],
    "nested": [
        {"a": {"b": [torch.zeros(2) + s, {"c": float(s)}]}, "name": f"s{s}", "n": np.int64(s)}
        for s in range(3)
    ],
    "ordered dict": [collections.OrderedDict(b=1, a=2.0), collections.OrderedDict(b=3, a=4.0)],
    "defaultdict": [collections.defaultdict(list, x=1), collections.defaultdict(list, x=2)],
}


@pytest.mark.parametrize("samples", TORCH_CASES.values(), ids=TORCH_CASES.keys())
def test_matches_torch_default_collate(samples: Sequence[Any]) -> None:
    # torch's annotation asks for a list; it treats a tuple of samples the same way.
    assert_same(default_collate(samples), torch_collate(list(samples)))


@pytest.mark.parametrize("samples", TORCH_CASES.values(), ids=TORCH_CASES.keys())
def test_numpy_collate_gives_numpy_leaves(samples: Sequence[Any]) -> None:
    if any(isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 for x in leaves(samples)):
        pytest.skip("numpy has no bfloat16: refusal tested separately")
    ours = numpy_collate(samples)
    assert not any(isinstance(x, torch.Tensor) for x in leaves(ours))
    assert_same(ours, as_numpy(default_collate(samples)))


def test_defaultdict_keeps_its_factory() -> None:
    batch = default_collate([collections.defaultdict(list, x=1)] * 2)
    assert batch.default_factory is list


def test_mappings_and_sequences_keep_their_type_where_possible() -> None:
    class Tags(list[Any]):
        pass

    class Frozen(Mapping[str, Any]):
        def __init__(self, *items: tuple[str, Any]) -> None:
            self._data = dict(items)

        def __getitem__(self, key: str) -> Any:
            return self._data[key]

        def __iter__(self) -> Any:
            return iter(self._data)

        def __len__(self) -> int:
            return len(self._data)

    proxy = default_collate([types.MappingProxyType({"k": 1})] * 2)
    assert type(proxy) is types.MappingProxyType
    assert torch.equal(proxy["k"], torch.tensor([1, 1]))
    tags = default_collate([Tags([1, 2]), Tags([3, 4])])
    assert type(tags) is Tags
    # A Mapping that cannot be rebuilt from a dict comes back as a dict, as in torch.
    frozen = default_collate([Frozen(("k", 1.0)), Frozen(("k", 2.0))])
    assert type(frozen) is dict
    assert torch.equal(frozen["k"], torch.tensor([1.0, 2.0], dtype=torch.float64))


def test_none_is_kept_as_a_list() -> None:
    batch = default_collate([{"x": 1, "mask": None}, {"x": 2, "mask": None}])
    assert batch["mask"] == [None, None]
    assert numpy_collate([None, None]) == [None, None]


def test_numpy_collate_dtypes_of_python_numbers() -> None:
    batch = numpy_collate([(1, 2.5, True), (2, 3.5, False)])
    assert [leaf.dtype for leaf in batch] == [np.int64, np.float64, np.bool_]
    assert batch[0].tolist() == [1, 2]


def test_numpy_collate_converts_tensors() -> None:
    batch = numpy_collate([torch.ones(2, dtype=torch.float16), torch.zeros(2, dtype=torch.float16)])
    assert isinstance(batch, np.ndarray)
    assert batch.dtype == np.float16
    assert batch.tolist() == [[1, 1], [0, 0]]
    grads = numpy_collate([torch.ones(2, requires_grad=True)] * 2)
    assert isinstance(grads, np.ndarray)
    assert grads.shape == (2, 2)


def test_numpy_collate_keeps_string_arrays_that_torch_cannot_hold() -> None:
    samples = [np.array(["ab", "c"]), np.array(["d", "ef"])]
    assert numpy_collate(samples).tolist() == [["ab", "c"], ["d", "ef"]]
    with pytest.raises(CollateError, match="no torch equivalent"):
        default_collate(samples)


# -- property: random structures agree with torch ----------------------------------------------

LEAF_KINDS = ["int", "float", "bool", "str", "bytes", "np scalar", "array", "tensor"]
ARRAY_DTYPES = [np.float32, np.float64, np.int64, np.int16, np.uint8, np.bool_]

schemas = st.recursive(
    st.tuples(
        st.just("leaf"),
        st.sampled_from(LEAF_KINDS),
        st.sampled_from(ARRAY_DTYPES),
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4),
    ),
    lambda children: st.one_of(
        st.tuples(
            st.just("dict"),
            st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), children, min_size=1),
        ),
        st.tuples(st.just("tuple"), st.lists(children, min_size=1, max_size=3)),
        st.tuples(st.just("list"), st.lists(children, min_size=1, max_size=3)),
        st.tuples(st.just("point"), st.tuples(children, children)),
    ),
    max_leaves=6,
)


def draw_sample(draw: Callable[[Any], Any], schema: Any) -> Any:
    tag, *rest = schema
    if tag == "dict":
        return {key: draw_sample(draw, child) for key, child in rest[0].items()}
    if tag == "tuple":
        return tuple(draw_sample(draw, child) for child in rest[0])
    if tag == "list":
        return [draw_sample(draw, child) for child in rest[0]]
    if tag == "point":
        return Point(*(draw_sample(draw, child) for child in rest[0]))
    kind, dtype, shape = rest
    if kind == "int":
        return draw(st.integers(-(2**63), 2**63 - 1))
    if kind == "float":
        return draw(st.floats(allow_nan=False))
    if kind == "bool":
        return draw(st.booleans())
    if kind == "str":
        return draw(st.text(max_size=3))
    if kind == "bytes":
        return draw(st.binary(max_size=3))
    array = draw(
        hnp.arrays(
            dtype,
            shape,
            elements={"allow_nan": False} if dtype in (np.float32, np.float64) else None,
        )
    )
    if kind == "np scalar":
        return array.reshape(-1)[0] if array.size else dtype(0)
    if kind == "tensor":
        return torch.from_numpy(array.copy())
    return array


@relaxed
@given(schema=schemas, size=st.integers(1, 5), data=st.data())
def test_random_structures_match_torch(schema: Any, size: int, data: st.DataObject) -> None:
    samples = [draw_sample(data.draw, schema) for _ in range(size)]
    ours = default_collate(samples)
    assert_same(ours, torch_collate(samples))
    assert_same(numpy_collate(samples), as_numpy(ours))


# -- the alloc path -----------------------------------------------------------------------------


class Arena:
    """A stand-in for a shared-memory slot: one buffer, carved into aligned arrays."""

    ALIGN = 64

    def __init__(self, size: int = 1 << 20) -> None:
        self.buffer = np.zeros(size, dtype=np.uint8)
        self.offset = 0
        self.calls: list[tuple[tuple[int, ...], np.dtype[Any], np.ndarray[Any, Any]]] = []

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        assert isinstance(dtype, np.dtype)
        assert all(type(d) is int for d in shape)
        start = -(-self.offset // self.ALIGN) * self.ALIGN
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        array = self.buffer[start : start + nbytes].view(dtype).reshape(shape)
        self.offset = start + nbytes
        self.calls.append((shape, dtype, array))
        return array

    def owns(self, address: int) -> bool:
        base = self.buffer.ctypes.data
        return base <= address < base + self.buffer.size


def test_alloc_result_shares_memory_with_what_alloc_returned() -> None:
    samples = [
        {
            "image": _array(np.uint8, (3, 4, 4), s),
            "label": s,
            "score": s / 2,
            "t": torch.ones(2) * s,
        }
        for s in range(5)
    ]
    arena = Arena()
    batch = default_collate(samples, alloc=arena)
    assert_same(batch, default_collate(samples))
    assert [(shape, str(dtype)) for shape, dtype, _ in arena.calls] == [
        ((5, 3, 4, 4), "uint8"),
        ((5,), "int64"),
        ((5,), "float64"),
        ((5, 2), "float32"),
    ]
    for leaf, (_, _, array) in zip(batch.values(), arena.calls, strict=True):
        assert leaf.data_ptr() == array.ctypes.data
        assert arena.owns(leaf.data_ptr())
        array[...] = 1  # a write through alloc's array is seen by the batch: no copy between
        assert bool((leaf == 1).all())


def test_numpy_collate_alloc_returns_the_allocated_arrays() -> None:
    samples = [(np.full(3, s, dtype=np.float32), s, torch.tensor([s, s])) for s in range(4)]
    arena = Arena()
    batch = numpy_collate(samples, alloc=arena)
    assert len(arena.calls) == 3
    for leaf, (_, _, array) in zip(batch, arena.calls, strict=True):
        assert leaf is array
    assert batch[0][:, 0].tolist() == [0, 1, 2, 3]
    assert batch[1].tolist() == [0, 1, 2, 3]
    assert batch[2].tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]


@relaxed
@given(schema=schemas, size=st.integers(1, 5), data=st.data())
def test_alloc_path_equals_the_plain_path(schema: Any, size: int, data: st.DataObject) -> None:
    samples = [draw_sample(data.draw, schema) for _ in range(size)]
    for collate in (default_collate, numpy_collate):
        arena = Arena()
        with_alloc = collate(samples, alloc=arena)
        assert_same(with_alloc, collate(samples))
        stacked = [x for x in leaves(with_alloc) if isinstance(x, np.ndarray | torch.Tensor)]
        assert len(stacked) == len(arena.calls), "every stacked leaf must come from alloc"
        for leaf in stacked:
            if leaf.size if isinstance(leaf, np.ndarray) else leaf.numel():
                address = leaf.ctypes.data if isinstance(leaf, np.ndarray) else leaf.data_ptr()
                assert arena.owns(address)


def test_alloc_is_bypassed_where_numpy_cannot_hold_the_tensor() -> None:
    arena = Arena()
    bf16 = default_collate([torch.ones(2, dtype=torch.bfloat16)] * 3, alloc=arena)
    grads = default_collate([torch.ones(2, requires_grad=True)] * 3, alloc=arena)
    assert arena.calls == []
    assert bf16.dtype == torch.bfloat16
    assert bf16.shape == (3, 2)
    assert grads.requires_grad


def test_alloc_gets_native_byte_order() -> None:
    arena = Arena()
    samples = [np.arange(3).astype(">i4"), (np.arange(3) + 10).astype(">i4")]
    for alloc in (arena, None):
        batch = default_collate(samples, alloc=alloc)  # torch itself refuses big-endian arrays
        assert batch.dtype == torch.int32
        assert batch.tolist() == [[0, 1, 2], [10, 11, 12]]
    assert arena.calls[0][1] == np.dtype("=i4")
    assert numpy_collate(samples).dtype == np.dtype("=i4")


def test_fortran_ordered_samples_give_a_contiguous_batch_as_in_torch() -> None:
    samples = [np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4) + s) for s in (0, 1)]
    theirs = torch_collate(samples)
    assert theirs.is_contiguous()
    ours = default_collate(samples)
    assert ours.is_contiguous()
    assert torch.equal(ours, theirs)
    assert numpy_collate(samples).flags.c_contiguous
    ours.view(-1)  # what a non-contiguous batch refuses


def _large(dtype: str, seed: int) -> np.ndarray[Any, Any]:
    """A 1 MiB-and-more sample: four of them make a batch above numpy's huge-page threshold."""
    return (np.arange(3 * 640 * 640) % 251 + seed).astype(dtype).reshape(3, 640, 640)


def _read_only(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    array.flags.writeable = False
    return array


LARGE_CASES: dict[str, Callable[[], list[np.ndarray[Any, Any]]]] = {
    "contiguous": lambda: [_large("u1", s) for s in range(4)],
    "negative strides": lambda: [_large("u1", s)[:, :, ::-1] for s in range(4)],
    "read-only": lambda: [_read_only(_large("u1", s)) for s in range(4)],
    "big-endian": lambda: [_large(">i2", s) for s in range(4)],
    "mixed dtypes": lambda: [_large("u1", 0), _large("i2", 1), _large("u1", 2), _large("u1", 3)],
    "fortran order": lambda: [np.asfortranarray(_large("f4", s)) for s in range(4)],
    "field of packed records": lambda: [_packed_field(s) for s in range(4)],
    "broadcast": lambda: [_broadcast(s) for s in range(4)],
}


def _packed_field(seed: int) -> np.ndarray[Any, Any]:
    """A float32 field of records 5 bytes apart: strides torch cannot view."""
    records = np.zeros((3, 640, 640), dtype=[("label", "u1"), ("x", "<f4")])
    records["x"] = _large("f4", seed)
    return records["x"]


def _broadcast(seed: int) -> np.ndarray[Any, Any]:
    """A row repeated by broadcasting (zero strides), which numpy warns about if asked
    whether it is writable."""
    row = (np.arange(640) % 251 + seed).astype("f4")
    return np.broadcast_arrays(row, np.zeros((3, 640, 1)))[0]


@pytest.mark.parametrize("make", LARGE_CASES.values(), ids=LARGE_CASES.keys())
def test_large_batches_equal_the_stacked_samples(make: Callable[[], list[Any]]) -> None:
    # Batches of 4 MiB and more bound for torch take their own route (_stacking.stack_large).
    samples = make()
    dtype = functools.reduce(np.promote_types, (a.dtype for a in samples)).newbyteorder("=")
    expected = np.stack(samples).astype(dtype)
    assert expected.nbytes >= 1 << 22
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it views a read-only array
        batch = default_collate(samples)
    assert isinstance(batch, torch.Tensor)
    np.testing.assert_array_equal(batch.numpy(), expected)
    assert batch.numpy().dtype == expected.dtype
    assert batch.is_contiguous()


@pytest.mark.parametrize("case", ["contiguous", "read-only"])
def test_large_batches_are_made_on_the_cpu_whatever_torchs_default_device(case: str) -> None:
    samples = LARGE_CASES[case]()
    torch.set_default_device("meta")  # a device without data: stands in for "cuda"
    try:
        batch = default_collate(samples)
    finally:
        torch.set_default_device(None)
    assert batch.device == torch.device("cpu")
    np.testing.assert_array_equal(batch.numpy(), np.stack(samples))


def test_large_batches_are_not_advised_onto_huge_pages() -> None:
    """numpy asks the kernel for huge pages on arrays of 4 MiB and more (``MADV_HUGEPAGE``,
    shown as ``hg`` in the mapping's flags). Where the kernel then defragments memory at the
    page fault, a 9.6 MB batch took 24 ms in some processes against 6 in others. Batches for
    torch come from torch's allocator, which gives no such advice, as torch's collate does. A
    fresh process: in this one, a freed numpy array's pages could be handed out again."""
    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("reads the mapping flags of Linux's /proc/self/smaps")
    script = textwrap.dedent(
        """
        import numpy as np
        from aioloader._batch._collate import default_collate

        def flags(address):
            with open("/proc/self/smaps") as smaps:
                inside = False
                for line in smaps:
                    head = line.split()[0]
                    if not head.endswith(":"):
                        low, high = (int(x, 16) for x in head.split("-"))
                        inside = low <= address < high
                    elif inside and head == "VmFlags:":
                        return line.split()[1:]

        samples = [np.full((3, 512, 512), s, dtype=np.uint8) for s in range(8)]  # 6 MiB
        plain = np.stack(samples)
        batch = default_collate(samples)
        print("hg" in flags(plain.ctypes.data + plain.nbytes // 2))
        print("hg" in flags(batch.data_ptr() + batch.nbytes // 2))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    numpy_advised, batch_advised = run.stdout.split()
    if numpy_advised != "True":
        pytest.skip("this numpy does not advise huge pages here: nothing to compare against")
    assert batch_advised == "False"


def test_a_wrong_alloc_result_is_refused() -> None:
    def fortran(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        return np.zeros(shape, dtype=dtype, order="F")

    def too_small(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        return np.zeros(shape[1:], dtype=dtype)

    samples = [np.zeros((2, 3))] * 2
    for bad in (fortran, too_small):
        with pytest.raises(TypeError, match="alloc"):
            default_collate(samples, alloc=bad)


def test_errors_from_alloc_pass_through_unchanged() -> None:
    class Full(MemoryError):
        pass

    def full(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        raise Full(f"no room for {shape}")

    with pytest.raises(Full, match=r"no room for \(2, 3\)"):
        numpy_collate([np.zeros(3)] * 2, alloc=full)


# -- errors -------------------------------------------------------------------------------------


def collate_error(
    samples: Any,
    collate: Callable[..., Any] = default_collate,
    error: type[CollateError] = CollateError,
) -> str:
    with pytest.raises(error) as info:
        collate(samples)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, AioloaderError)
    return str(info.value)


def type_error(samples: Any, collate: Callable[..., Any] = default_collate) -> str:
    """The message of the CollateTypeError, also a TypeError as in torch, that ``samples``
    raise."""
    message = collate_error(samples, collate, CollateTypeError)
    assert issubclass(CollateTypeError, TypeError)
    return message


def shape_error(samples: Any, collate: Callable[..., Any] = default_collate) -> str:
    """The message of the CollateShapeError, also a RuntimeError as in torch, that ``samples``
    raise."""
    message = collate_error(samples, collate, CollateShapeError)
    assert issubclass(CollateShapeError, RuntimeError)
    return message


def test_ragged_shapes_name_path_positions_and_shapes() -> None:
    def sample(side: int) -> dict[str, Any]:
        return {"image": [np.zeros(3), np.zeros((3, side, side), np.float32)], "label": 1}

    message = shape_error([sample(32), sample(32), sample(28), sample(32)])
    assert "batch['image'][1]" in message
    assert "(3, 32, 32) at positions [0, 1, 3]" in message
    assert "(3, 28, 28) at position 2" in message


def test_ragged_tensors_name_shapes() -> None:
    message = shape_error([torch.zeros(2, 3), torch.zeros(2, 4)])
    assert "tensors have different shapes" in message
    assert "(2, 3) at position 0" in message
    assert "(2, 4) at position 1" in message


# Mixed samples whose dtype torch gives in every order (where torch's result depends on which
# sample comes first, the comment says which order ours follows).
PROMOTIONS: dict[str, tuple[list[Any], torch.dtype]] = {
    "int and float (torch: float32 if the int comes first)": ([2.5, 1], torch.float64),
    "bool and int": ([True, 2], torch.int64),
    "bool and float": ([1.5, False], torch.float64),
    "float32 and float64 scalars": ([np.float32(1), np.float64(2)], torch.float64),
    "int32 and float32 scalars": ([np.int32(1), np.float32(2)], torch.float32),
    "numpy int64 and int": ([np.int64(1), 2], torch.int64),
    "numpy float64 and int": ([np.float64(2.5), 1], torch.float64),
    "numpy bool and bool": ([np.bool_(False), True], torch.bool),
    "float32 and float64 arrays": ([np.zeros(2, np.float32), np.ones(2)], torch.float64),
    "uint8 and int8 arrays": ([np.zeros(2, np.uint8), np.ones(2, np.int8)], torch.int16),
    "int64 and float32 arrays": ([np.arange(2), np.ones(2, np.float32)], torch.float32),
    "0-d arrays of int and float": ([np.array(1), np.array(2.5)], torch.float64),
    "float32 and float64 tensors": (
        [torch.zeros(2), torch.ones(2, dtype=torch.float64)],
        torch.float64,
    ),
    "int64 and float32 tensors": ([torch.arange(2), torch.ones(2)], torch.float32),
    "an array and a tensor (torch: TypeError if the tensor comes first)": (
        [np.zeros(2), torch.ones(2)],
        torch.float64,
    ),
    "a 0-d array and an int": ([np.array(2), 1], torch.int64),
    "a numpy scalar and a 0-d array": ([np.float32(1), np.array(2, np.float32)], torch.float32),
}


@pytest.mark.parametrize(("samples", "dtype"), PROMOTIONS.values(), ids=PROMOTIONS.keys())
def test_mixed_samples_promote_as_in_torch_whatever_their_order(
    samples: list[Any], dtype: torch.dtype
) -> None:
    for ordered in (samples, samples[::-1]):
        batch = default_collate(ordered)
        assert batch.dtype == dtype
        reference = torch_collate([torch.as_tensor(x) for x in ordered]).to(dtype)
        assert torch.equal(batch, reference)
    # torch agrees in this order (the first sample decides its rule).
    with warnings.catch_warnings():  # torch: "a tensor from a list of numpy.ndarrays is slow"
        warnings.simplefilter("ignore", UserWarning)
        assert torch_collate(list(samples)).dtype == dtype


def test_mixed_samples_promote_the_same_into_shared_memory() -> None:
    arena = Arena()
    batch = default_collate([np.zeros((2, 2), np.int64), np.ones((2, 2), np.float32)], alloc=arena)
    assert batch.dtype == torch.float32
    assert np.shares_memory(batch.numpy(), arena.calls[0][2])
    assert batch.tolist() == [[[0, 0], [0, 0]], [[1, 1], [1, 1]]]
    mixed = default_collate([{"n": n} for n in (1, 2.5, True)])
    assert mixed["n"].dtype == torch.float64
    assert mixed["n"].tolist() == [1.0, 2.5, 1.0]


def test_numpy_collate_promotes_by_numpys_rule() -> None:
    batch = numpy_collate([np.arange(2), np.ones(2, np.float32)])
    assert batch.dtype == np.float64  # torch's rule would give float32
    assert numpy_collate([1, 2.5]).dtype == np.float64
    assert numpy_collate([np.float32(1), np.float32(2)]).dtype == np.float32


def test_text_and_none_mix_into_one_list() -> None:
    assert default_collate(["a", b"b", None, np.str_("c")]) == ["a", b"b", None, "c"]
    batch = default_collate([("a", 1), (None, 2)])
    assert batch[0] == ("a", None)  # a column of transposed tuples stays a tuple, as in torch


def test_types_that_do_not_mix_name_the_types_and_positions() -> None:
    message = type_error([{"label": 1}, {"label": 2}, {"label": "x"}])
    assert "batch['label']" in message
    assert "int at positions [0, 1]" in message
    assert "str at position 2" in message
    assert "numpy.ndarray" in type_error([np.zeros(2), "a"])
    assert "NoneType at position 2" in type_error([1, "a", None])
    assert "torch.Tensor" in type_error([torch.zeros(()), 1])
    message = type_error([np.uint64(1), 5])  # torch has no promotion for uint64
    assert "dtypes that do not combine" in message
    assert "uint64 at position 0" in message


def test_different_namedtuple_types_are_refused() -> None:
    message = type_error([Point(1, 2), Other(1, 2)])
    assert "Point at position 0" in message
    assert "Other at position 1" in message


def test_missing_and_extra_keys() -> None:
    samples = [{"a": 1, "b": 2}, {"a": 1}, {"a": 1, "b": 2}, {"a": 1, "b": 2, "c": 3}]
    message = collate_error([{"meta": s} for s in samples])
    assert "batch['meta']" in message
    assert "position 0 has keys ['a', 'b']" in message
    assert "position 1 lacks ['b']" in message
    assert "position 3 has extra ['c']" in message
    assert "position 2" not in message


def test_sequences_of_different_lengths() -> None:
    message = shape_error([(1, [1, 2]), (2, [3]), (3, [4, 5])])
    assert "batch[1]" in message
    assert "2 at positions [0, 2]" in message
    assert "1 at position 1" in message
    assert message.endswith(PAD_HINT)  # the fix: a padding collate_fn (issue #42)


def test_ragged_arrays_and_tensors_name_the_padding_fix() -> None:
    assert "pad_sequence" in shape_error([np.zeros(2), np.zeros(3)])
    assert "collate_fn=list" in shape_error([torch.zeros(2), torch.zeros(3)])
    # A variable-length list field, the fix as the message names it:
    samples = [{"tokens": [1, 2, 3]}, {"tokens": [4]}]
    assert "pad_sequence" in shape_error(samples)
    assert list(samples) == samples  # collate_fn=list keeps the samples as they are


@pytest.mark.parametrize("collate", [default_collate, numpy_collate])
def test_an_optional_field_mixed_with_values_is_a_list_keeping_none(
    collate: Callable[..., Any],
) -> None:
    # The README's promise: optional fields pass through (issue #42).
    samples = [{"x": 1, "score": 0.5}, {"x": 2, "score": None}, {"x": 3, "score": 1.5}]
    batch = collate(samples)
    assert batch["score"] == [0.5, None, 1.5]
    assert batch["x"].tolist() == [1, 2, 3]
    tensor = torch.ones(2)
    assert collate([None, tensor])[1] is tensor  # any value beside None: kept as it is
    assert collate([None, "a"]) == [None, "a"]  # text with None, as before


def test_object_arrays_and_unsupported_types_are_refused_by_name() -> None:
    message = type_error([{"x": np.array([object()])}] * 2, numpy_collate)
    assert "batch['x']" in message
    assert "object" in message
    message = type_error([Point(decimal.Decimal(1), 0)] * 3)
    assert "batch.x" in message
    assert "decimal.Decimal" in message
    assert "unsupported type" in message
    assert "complex" in type_error([1j, 2j])  # Python complex numbers: refused, as in torch
    assert "<U1" in type_error([np.array(["a"]), np.array(["b"])])  # string arrays, as in torch


def test_numpy_collate_refuses_bfloat16_by_name() -> None:
    message = type_error([torch.zeros(2, dtype=torch.bfloat16)] * 2, numpy_collate)
    assert "bfloat16" in message


def test_int_overflow_names_the_position() -> None:
    message = collate_error([{"id": 1}, {"id": 2**64}])
    assert "batch['id']" in message
    assert "int64 at position 1" in message


def test_empty_batch_is_refused() -> None:
    assert "empty batch" in collate_error([])


def test_long_position_lists_are_summarised() -> None:
    samples = [np.zeros(2)] * 20 + [np.zeros(3)]
    message = collate_error(samples)
    assert "positions [0, 1, 2, 3, 4, 5, 6, 7, ... 12 more]" in message
    assert "(3,) at position 20" in message


def test_any_sequence_of_samples_is_accepted() -> None:
    batch: Sequence[int] = (1, 2, 3)
    assert default_collate(batch).tolist() == [1, 2, 3]
    assert default_collate(iter([1, 2])).tolist() == [1, 2]  # type: ignore[arg-type]


@pytest.mark.cuda
def test_device_tensors_stay_on_their_device_and_bypass_alloc() -> None:
    arena = Arena()
    samples = [torch.ones(2, device="cuda") * s for s in range(3)]
    batch = default_collate(samples, alloc=arena)
    assert batch.device.type == "cuda"
    assert arena.calls == []
    assert batch.tolist() == [[0, 0], [1, 1], [2, 2]]
    array = numpy_collate(samples, alloc=arena)
    assert array is arena.calls[0][2]
    assert array.tolist() == [[0, 0], [1, 1], [2, 2]]
    message = collate_error([torch.ones(2), torch.ones(2, device="cuda")])
    assert "different devices" in message
    assert "cpu at position 0" in message


def test_alloc_path_resolves_conjugate_and_negative_views() -> None:
    # Lazy views whose values torch computes on read: numpy would see the raw memory.
    base = [torch.randn(3, dtype=torch.complex64) for _ in range(4)]
    conj = [t.conj() for t in base]
    neg = [t.conj().imag for t in base]
    assert all(t.is_conj() for t in conj)
    assert all(t.is_neg() for t in neg)
    for samples in (conj, neg):
        arena = Arena()
        assert torch.equal(default_collate(samples, alloc=arena), torch.stack(samples))
        assert np.array_equal(numpy_collate(samples, alloc=Arena()), torch.stack(samples).numpy())


@pytest.mark.parametrize("collate", [default_collate, numpy_collate])
def test_alloc_path_explains_tensors_of_different_shapes(collate: Callable[..., Any]) -> None:
    # As without alloc: numpy's own stacking error would say neither where nor what.
    samples = [torch.zeros(3, 4), torch.zeros(3, 5), torch.zeros(3, 4)]
    with pytest.raises(CollateShapeError, match=r"\(3, 5\) at position 1"):
        collate(samples, alloc=Arena())


def test_alloc_path_leaves_a_sample_numpy_cannot_read_to_torch() -> None:
    samples = [torch.zeros(2, 2), torch.zeros(2, 2).to_sparse()]
    with pytest.raises(RuntimeError) as plain:
        default_collate(samples)
    with pytest.raises(type(plain.value)):
        default_collate(samples, alloc=Arena())
