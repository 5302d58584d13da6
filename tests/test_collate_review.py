"""Collation and conversion at their edges: one sample handed to collation, 0-d object arrays
among numbers, tensors that cannot stack, overflowing floats, and what ``default_convert``
leaves alone (masked arrays) or copies (negative strides)."""

from __future__ import annotations

import collections
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import aioloader
from aioloader._batch._collate import default_collate, default_convert, numpy_collate
from aioloader._errors import CollateError, CollateShapeError, CollateTypeError


def _alloc(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    return np.empty(shape, dtype)


# -- one sample is not a batch ------------------------------------------------------------------


@pytest.mark.parametrize("collate", [default_collate, numpy_collate])
@pytest.mark.parametrize(
    ("sample", "named"),
    [
        ({"img": np.ones(2), "label": 1}, "dict"),
        ({1, 2}, "set"),
        (frozenset({1}), "frozenset"),
        (collections.OrderedDict(a=1), "collections.OrderedDict"),
        (np.array(3), "numpy.ndarray"),
        (torch.tensor(3), "torch.Tensor"),
    ],
)
def test_one_sample_is_refused_naming_its_type(collate: Any, sample: Any, named: str) -> None:
    with pytest.raises(CollateTypeError, match=f"cannot collate a {named}:") as info:
        collate(sample)
    assert "default_convert" in str(info.value)  # the fix for batch_size=None
    assert isinstance(info.value, TypeError)


def test_sequences_of_samples_still_collate() -> None:
    class Samples(collections.abc.Sequence[int]):
        def __getitem__(self, i: Any) -> Any:
            return [1, 2, 3][i]

        def __len__(self) -> int:
            return 3

    assert default_collate(Samples()).tolist() == [1, 2, 3]
    assert default_collate((1, 2)).tolist() == [1, 2]
    assert default_collate(collections.deque([1.5, 2.5])).tolist() == [1.5, 2.5]
    assert default_collate(x for x in (1, 2)).tolist() == [1, 2]  # type: ignore[arg-type]
    # What a __getitems__ may return: an array or tensor of rows, stacked as torch does.
    assert default_collate(np.ones((2, 3))).shape == (2, 3)  # type: ignore[arg-type]
    assert default_collate(torch.ones(2, 3)).shape == (2, 3)  # type: ignore[arg-type]


def test_loader_without_batching_refuses_default_collate_per_sample() -> None:
    class Dicts:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"img": np.ones(2), "label": i}

    loader = aioloader.DataLoader(Dicts(), batch_size=None, collate_fn=aioloader.default_collate)
    with loader, pytest.raises(CollateTypeError, match=r"cannot collate a dict: .*default_convert"):
        next(iter(loader))
    with aioloader.DataLoader(Dicts(), batch_size=None) as plain:  # default_convert
        sample = next(iter(plain))
    assert set(sample) == {"img", "label"}
    assert isinstance(sample["img"], torch.Tensor)


# -- 0-d object arrays beside numbers -----------------------------------------------------------


@pytest.mark.parametrize("collate", [default_collate, numpy_collate])
@pytest.mark.parametrize(
    "zero_d",
    [np.array("a", dtype=object), np.array(None, dtype=object), np.array(1.5, dtype=object)],
)
def test_zero_d_object_arrays_beside_numbers_are_refused(collate: Any, zero_d: Any) -> None:
    with pytest.raises(CollateTypeError, match=r"batch\['x'\]: numpy dtype object .*position 1"):
        collate([{"x": 1}, {"x": zero_d}])


def test_zero_d_numeric_arrays_still_mix_with_numbers() -> None:
    batch = default_collate([np.array(1.5, dtype=np.float32), 2])
    assert batch.dtype == torch.float32
    assert batch.tolist() == [1.5, 2.0]


# -- tensors that cannot stack: CollateError with the key path ----------------------------------


def test_uint64_beside_int64_tensors_names_the_dtypes() -> None:
    samples = [{"t": torch.ones(2, dtype=torch.uint64)}, {"t": torch.ones(2, dtype=torch.int64)}]
    for collate in (default_collate, lambda s: default_collate(s, alloc=_alloc)):
        with pytest.raises(CollateTypeError, match=r"batch\['t'\]: dtypes that do not combine"):
            collate(samples)


@pytest.mark.parametrize("alloc", [None, _alloc])
def test_sparse_beside_dense_names_the_layouts(alloc: Any) -> None:
    samples = [(torch.eye(2).to_sparse(),), (torch.eye(2),)]
    with pytest.raises(CollateShapeError, match=r"batch\[0\]: tensors have different layouts"):
        default_collate(samples, alloc=alloc)


def test_nested_tensors_are_refused_with_the_key_path() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "prototype stage"
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    for collate in (default_collate, numpy_collate):
        with pytest.raises(CollateShapeError, match=r"batch\['n'\]: nested tensors at positions"):
            collate([{"n": nested}, {"n": nested}])


@pytest.mark.parametrize("alloc", [None, _alloc])
def test_numpy_collate_of_sparse_tensors_is_a_collate_error(alloc: Any) -> None:
    with pytest.raises(CollateTypeError, match=r"batch\['s'\]: .*sparse_coo.*to_dense"):
        numpy_collate([{"s": torch.eye(2).to_sparse()}] * 2, alloc=alloc)


def test_a_stack_failure_nothing_explains_keeps_the_path_and_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> torch.Tensor:  # a fault torch.stack might raise
        raise RuntimeError("refused by the test")

    monkeypatch.setattr(torch, "stack", refuse)
    with pytest.raises(CollateShapeError, match=r"batch\['r'\]: torch.stack failed") as info:
        default_collate([{"r": torch.ones(2)}] * 2)
    assert "refused by the test" in str(info.value.__cause__)


# -- numbers that overflow ----------------------------------------------------------------------


@pytest.mark.parametrize("alloc", [None, _alloc])
def test_an_int_too_large_for_float64_names_float64(alloc: Any) -> None:
    with pytest.raises(CollateError, match=r"batch: ints do not fit in float64 at position 0"):
        default_collate([10**400, 0.5], alloc=alloc)
    with pytest.raises(CollateError, match=r"batch: ints do not fit in int64 at position 1"):
        default_collate([1, 2**63], alloc=alloc)


# -- default_convert ----------------------------------------------------------------------------


def test_default_convert_keeps_masked_arrays_and_other_subclasses() -> None:
    masked = np.ma.masked_array([1, 2], mask=[False, True])
    out = default_convert({"m": masked, "plain": np.ones(2)})
    assert out["m"] is masked
    assert out["m"].mask.tolist() == [False, True]
    assert isinstance(out["plain"], torch.Tensor)

    class Sub(np.ndarray):
        pass

    sub = np.ones(2).view(Sub)
    assert default_convert(sub) is sub


def test_default_convert_converts_memmaps_and_scalars(tmp_path: Any) -> None:
    mm = np.memmap(tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(3,))
    mm[:] = [1, 2, 3]
    assert default_convert(mm).tolist() == [1.0, 2.0, 3.0]
    assert default_convert(np.float32(2.5)).dtype == torch.float32


def test_default_convert_copies_arrays_with_negative_strides() -> None:
    img = np.arange(12).reshape(3, 4)
    out = default_convert(img[:, ::-1])
    assert isinstance(out, torch.Tensor)
    assert out.tolist() == img[:, ::-1].tolist()
    view = np.arange(4)
    assert default_convert(view).data_ptr() == view.ctypes.data  # a plain array is shared


# -- requires_grad from worker processes --------------------------------------------------------


class _GradSamples:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.n,), float(i), requires_grad=True)


def test_requires_grad_from_workers_does_not_depend_on_the_batch_size() -> None:
    # 2 samples of 4 floats travel pickled (32 bytes); of 2**18 floats in shared memory (2 MB).
    for n in (4, 1 << 18):
        with aioloader.DataLoader(_GradSamples(n), batch_size=2, num_workers=1) as loader:
            batch = next(iter(loader))
        assert batch.requires_grad, f"{8 * n} bytes"
        assert batch.is_leaf  # the graph stayed in the worker
        assert batch[1, 0].item() == 1.0
