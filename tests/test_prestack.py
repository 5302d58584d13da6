"""Tests of aioloader._batch._prestack: large arrays stacked as the samples are read.

The contract: the batch is exactly what the default collate functions make from the samples
(values, dtypes, container types, errors), its large leaves lie in the memory ``alloc`` gave,
and no sample the dataset handed over is changed.
"""

from __future__ import annotations

import collections
import copy
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from aioloader import DataLoader
from aioloader._batch import _make as _batch
from aioloader._batch._collate import collate_prestacked, default_collate, numpy_collate
from aioloader._batch._make import BatchMaker
from aioloader._batch._prestack import MIN_BATCH_BYTES, Prestack, paths
from aioloader._errors import CollateShapeError
from aioloader._shm._descriptors import SlotWriter
from aioloader._types import BatchRequest

BIG = (4, 64, 64)  # 16 KiB of uint8 a sample: a batch of 64 holds MIN_BATCH_BYTES
N = 64


class Pair(NamedTuple):
    image: Any
    label: Any


class Recorder:
    """An ``alloc`` that hands out plain arrays and remembers them."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray[Any, Any]] = []

    def __call__(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        array = np.empty(shape, dtype)
        self.arrays.append(array)
        return array


def image(i: int, dtype: Any = np.uint8, shape: tuple[int, ...] = BIG) -> np.ndarray[Any, Any]:
    return (np.arange(int(np.prod(shape))).reshape(shape) + i).astype(dtype)


def feed_all(stack: Prestack, samples: list[Any]) -> list[Any]:
    return [stack.feed(position, sample) for position, sample in enumerate(samples)]


def same(a: Any, b: Any) -> None:
    """``a`` and ``b`` are the same batch: types, dtypes and values, all the way down."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert a == b


def stacked_as_read(make: Any, path: str, collate: Any) -> tuple[Any, ...]:
    """N samples of ``make`` fed to a Prestack and collated: checks that the one leaf at
    ``path`` was stacked as read and that the batch is what ``collate`` makes of copies of the
    samples; returns the samples, those copies, the alloc, the samples fed, the stacked array
    and the batch."""
    samples = [make(i) for i in range(N)]
    kept = copy.deepcopy(samples)
    alloc = Recorder()
    stack = Prestack(alloc, N)
    fed = feed_all(stack, samples)
    assert list(stack.stacked) == [path]
    [stacked] = alloc.arrays
    batch = collate_prestacked(fed, collate is default_collate, alloc, stack.stacked)
    same(batch, collate(kept))
    return samples, kept, alloc, fed, stacked, batch


def test_the_threshold_is_the_whole_batch_of_one_leaf() -> None:
    assert image(0).nbytes * N == MIN_BATCH_BYTES
    small = [image(i, shape=(BIG[0], BIG[1], BIG[2] - 1)) for i in range(N)]
    stack = Prestack(Recorder(), N)
    feed_all(stack, small)
    assert stack.stacked == {}


@pytest.mark.parametrize(
    ("make", "path"),
    [
        (lambda i: image(i), "batch"),
        (lambda i: {"image": image(i), "label": i}, "batch['image']"),
        (lambda i: (image(i), i), "batch[0]"),
        (lambda i: [i, image(i)], "batch[1]"),
        (lambda i: Pair(image(i), i), "batch.image"),
    ],
    ids=["array", "dict", "tuple", "list", "namedtuple"],
)
@pytest.mark.parametrize("collate", [default_collate, numpy_collate], ids=["torch", "numpy"])
def test_the_batch_is_what_collation_makes_and_lies_in_the_allocated_memory(
    make: Any, path: str, collate: Any
) -> None:
    samples, kept, _alloc, fed, stacked, batch = stacked_as_read(make, path, collate)
    leaves = (
        [batch] if path == "batch" else list(batch.values() if isinstance(batch, dict) else batch)
    )
    big = [leaf for leaf in leaves if getattr(leaf, "ndim", 0) == 4]
    assert len(big) == 1
    assert np.shares_memory(np.asarray(big[0]), stacked)  # the stacked array itself, no copy
    # What the dataset handed over is unchanged, and each kept sample is a view of its copy.
    for given, original in zip(samples, kept, strict=True):
        same(given, original)
    for position, sample in enumerate(fed):
        assert type(sample) is type(samples[position])
        leaf = (
            sample if path == "batch" else next(v for v in paths_values(sample) if np.ndim(v) == 3)
        )
        assert np.shares_memory(leaf, stacked)


def paths_values(sample: Any) -> list[Any]:
    if isinstance(sample, dict):
        return list(sample.values())
    return list(sample)


def test_paths_name_leaves_as_collation_names_them() -> None:
    assert [p for p, _ in paths(image(0))] == ["batch"]
    assert [p for p, _ in paths({"a": 1, 2: 3})] == ["batch['a']", "batch[2]"]
    assert [p for p, _ in paths(Pair(1, 2))] == ["batch.image", "batch.label"]
    assert [p for p, _ in paths([1, 2])] == ["batch[0]", "batch[1]"]
    # Other containers are left to the collate function as they are.
    assert paths(collections.OrderedDict(a=1)) == []
    assert paths(7) == []


def test_a_sample_of_another_dtype_leaves_the_leaf_to_collation_which_promotes() -> None:
    samples = [image(i, np.float32) for i in range(N)]
    samples[40] = image(40, np.float64)
    alloc = Recorder()
    stack = Prestack(alloc, N)
    fed = feed_all(stack, samples)
    assert stack.stacked == {}
    batch = collate_prestacked(fed, True, alloc, stack.stacked)
    same(batch, default_collate(samples))
    assert batch.dtype == torch.float64


def test_a_sample_of_another_shape_fails_as_collation_fails() -> None:
    samples = [image(i) for i in range(N)]
    samples[7] = image(7, shape=(BIG[0], BIG[1] + 1, BIG[2]))
    stack = Prestack(Recorder(), N)
    fed = feed_all(stack, samples)
    with pytest.raises(CollateShapeError) as got:
        collate_prestacked(fed, True, Recorder(), stack.stacked)
    with pytest.raises(CollateShapeError) as expected:
        default_collate(samples)
    assert str(got.value) == str(expected.value)


def test_a_sample_of_another_structure_leaves_every_leaf_to_collation() -> None:
    renamed: list[Any] = [{"image": image(i), "label": i} for i in range(N)]
    renamed[5] = {"picture": image(5), "label": 5}
    retyped: list[Any] = [{"image": image(i), "label": i} for i in range(N)]
    retyped[9] = (image(9), 9)
    for samples, odd in ((renamed, 5), (retyped, 9)):
        stack = Prestack(Recorder(), N)
        fed = feed_all(stack, samples)
        assert stack.stacked == {}
        assert stack.broke
        assert fed[odd] is samples[odd]
        with pytest.raises(Exception) as got:  # noqa: PT011 - compared with collation's own
            collate_prestacked(fed, True, Recorder(), stack.stacked)
        with pytest.raises(type(got.value)) as expected:
            default_collate(samples)
        assert str(got.value) == str(expected.value)


@pytest.mark.parametrize(
    "dtype", [np.dtype(">u4"), np.dtype("U4"), np.dtype(object)], ids=["big-endian", "str", "obj"]
)
def test_arrays_collation_converts_or_refuses_are_left_to_it(dtype: np.dtype[Any]) -> None:
    sample = np.zeros(BIG, dtype=dtype)
    stack = Prestack(Recorder(), N)
    assert stack.feed(0, sample) is sample
    assert stack.stacked == {}


def test_an_alloc_that_refuses_the_dtype_leaves_it_to_collation() -> None:
    def refuse(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        raise ValueError(f"dtype={dtype} cannot be placed here")

    stack = Prestack(refuse, N)
    sample = image(0)
    assert stack.feed(0, sample) is sample
    assert stack.stacked == {}


def test_keys_that_print_alike_are_left_to_collation() -> None:
    class Key:
        def __init__(self, side: str) -> None:
            self.side = side

        def __repr__(self) -> str:
            return "Cam"

    left, right = Key("L"), Key("R")
    samples = [{left: np.ones(BIG, np.uint8), right: np.full(BIG, 2, np.uint8)} for _ in range(N)]
    stack = Prestack(Recorder(), N)
    fed = feed_all(stack, samples)
    assert stack.stacked == {}
    batch = collate_prestacked(fed, False, Recorder(), stack.stacked)
    assert (batch[left] == 1).all()
    assert (batch[right] == 2).all()


def test_zero_dimensional_leaves_are_left_to_collation() -> None:
    samples = [{"x": np.array(float(i))} for i in range(MIN_BATCH_BYTES // 8)]
    stack = Prestack(Recorder(), len(samples))
    fed = feed_all(stack, samples)
    assert stack.stacked == {}
    assert fed[3] is samples[3]


def test_memmap_slices_are_stacked_beside_plain_arrays(tmp_path: Any) -> None:
    stored = np.lib.format.open_memmap(tmp_path / "x.npy", "w+", np.float32, (N, *BIG))
    stored[...] = np.arange(N, dtype=np.float32)[:, None, None, None]
    stored.flush()
    loaded = np.load(tmp_path / "x.npy", mmap_mode="r")
    samples = [loaded[i] if i % 2 else np.array(loaded[i]) for i in range(N)]
    assert isinstance(samples[1], np.memmap)
    alloc = Recorder()
    stack = Prestack(alloc, N)
    fed = feed_all(stack, samples)
    assert list(stack.stacked) == ["batch"]
    same(collate_prestacked(fed, True, alloc, stack.stacked), default_collate(samples))


def test_masked_arrays_are_left_to_collation() -> None:
    sample = np.ma.masked_array(image(0), mask=image(0) % 2 == 0)
    stack = Prestack(Recorder(), N)
    assert stack.feed(0, sample) is sample
    assert not stack.active


class Cached:
    """A dataset that hands out the same sample objects every time (a cache)."""

    def __init__(self) -> None:
        self.items = [{"image": image(i), "label": i} for i in range(N)]
        self.kept = copy.deepcopy(self.items)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


@pytest.mark.parametrize("transform", [None, lambda s: s], ids=["plain", "transform"])
def test_batch_maker_stacks_through_alloc_and_leaves_a_cached_dataset_alone(
    transform: Any,
) -> None:
    dataset = Cached()
    maker = BatchMaker(dataset, default_collate, transform=transform)
    alloc = Recorder()
    request = BatchRequest(0, 0, list(range(N)))
    made = maker.make(request, alloc)
    same(made.batch, default_collate(dataset.kept))
    assert np.shares_memory(made.batch["image"].numpy(), alloc.arrays[0])
    for item, kept in zip(dataset.items, dataset.kept, strict=True):
        same(item, kept)
    # Twice: the second batch reads the same cached samples, unchanged by the first.
    same(maker.make(request, Recorder()).batch, default_collate(dataset.kept))


def test_batch_maker_with_skipping_or_another_collate_does_not_prestack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[Prestack] = []

    class Recorded(Prestack):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(_batch, "Prestack", Recorded)
    request = BatchRequest(0, 0, list(range(N)))
    BatchMaker(Cached(), default_collate).make(request, Recorder())
    assert len(made) == 1  # the recorder sees the default case
    for maker in (
        BatchMaker(Cached(), default_collate, skip_errors=True),  # positions would shift
        BatchMaker(Cached(), lambda s: default_collate(s)),  # collate_fn is the user's
    ):
        same(maker.make(request, Recorder()).batch, default_collate(Cached().kept))
    BatchMaker(Cached(), default_collate).make(request, None)  # nowhere to stack into
    assert len(made) == 1


class Mixed:
    """float32 images, but sample ``odd`` float64: its batch promotes."""

    def __init__(self, odd: int) -> None:
        self.odd = odd

    def __len__(self) -> int:
        return 4 * N

    def __getitem__(self, i: int) -> np.ndarray[Any, Any]:
        return image(i, np.float64 if i == self.odd else np.float32)


def test_a_batch_that_breaks_stacking_is_right_and_the_next_ones_are_not_stacked() -> None:
    dataset = Mixed(odd=N + 5)
    maker = BatchMaker(dataset, default_collate)
    nbytes = N * image(0, np.float32).nbytes
    needed = []
    for k in range(3):
        writer = SlotWriter(np.zeros(3 * nbytes, np.uint8))
        batch = maker.make(BatchRequest(0, k, list(range(k * N, (k + 1) * N))), writer.alloc).batch
        same(batch, default_collate([dataset[i] for i in range(k * N, (k + 1) * N)]))
        needed.append(writer.needed_bytes)
    # Batch 0 stacked as read; batch 1 began so, then promoted: its float32 array goes unused
    # beside the float64 batch; batch 2 is collated at the end, as before prestacking existed.
    assert needed == [nbytes, nbytes + 2 * nbytes, nbytes]


class Images:
    """Large images, one of them of another dtype when ``odd`` is set."""

    def __init__(self, odd: int | None = None) -> None:
        self.odd = odd

    def __len__(self) -> int:
        return 12 * N

    def __getitem__(self, i: int) -> tuple[np.ndarray[Any, Any], int]:
        return image(i, np.float64 if i == self.odd else np.float32), i


@pytest.mark.parametrize("workers", [2, 0])
@pytest.mark.parametrize("odd", [None, 9 * N + 3], ids=["uniform", "one-promoted"])
def test_loader_batches_equal_the_collated_samples(odd: int | None, workers: int) -> None:
    dataset = Images(odd)
    loader = DataLoader(dataset, batch_size=N, num_workers=workers)
    try:
        batches = list(loader)
    finally:
        loader.close()
    # Twelve batches: the first ones go to segments made for them before any size is known,
    # the later ones to leased slots, through their writer's alloc.
    assert len(batches) == 12
    for k, (images, labels) in enumerate(batches):
        expected = default_collate([dataset[i] for i in range(k * N, (k + 1) * N)])
        same([images, labels], expected)


def chw(i: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An image as ``ToTensor`` hands it over: HWC memory seen as CHW, a strided view."""
    hwc = torch.from_numpy(image(i, shape=(BIG[1], BIG[2], BIG[0])))
    return hwc.permute(2, 0, 1).to(dtype)


@pytest.mark.parametrize(
    ("make", "path"),
    [
        (lambda i: chw(i), "batch"),
        (lambda i: {"image": chw(i), "label": i}, "batch['image']"),
        (lambda i: (chw(i, torch.float32), i), "batch[0]"),
    ],
    ids=["tensor", "dict", "tuple-float"],
)
@pytest.mark.parametrize("collate", [default_collate, numpy_collate], ids=["torch", "numpy"])
def test_plain_tensors_are_stacked_as_read_into_the_allocated_memory(
    make: Any, path: str, collate: Any
) -> None:
    samples, kept, alloc, fed, stacked, batch = stacked_as_read(make, path, collate)
    big = batch if path == "batch" else batch["image"] if isinstance(batch, dict) else batch[0]
    assert np.shares_memory(np.asarray(big), stacked)  # the stacked array itself, no copy
    assert [a for a in alloc.arrays if a.ndim == 4] == [stacked]  # nothing else made for it
    for given, original in zip(samples, kept, strict=True):
        same(given, original)  # what the dataset handed over is unchanged
    for position, sample in enumerate(fed):
        leaf = sample if path == "batch" else sample["image"] if path != "batch[0]" else sample[0]
        assert type(leaf) is torch.Tensor  # a tensor in the tensor's place: a view of its copy
        assert np.shares_memory(leaf.numpy(), stacked[position])


class Sub(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "make",
    [
        lambda i: chw(i, torch.float32).requires_grad_(),
        lambda i: chw(i).as_subclass(Sub),
        lambda i: chw(i, torch.complex64).conj(),
        lambda i: chw(i, torch.bfloat16),
        lambda i: chw(i).to_sparse(),
    ],
    ids=["requires-grad", "subclass", "conj", "bfloat16", "sparse"],
)
def test_tensors_collation_treats_apart_are_left_to_it(make: Any) -> None:
    samples = [make(i) for i in range(N)]
    alloc = Recorder()
    stack = Prestack(alloc, N)
    fed = feed_all(stack, samples)
    assert stack.stacked == {}
    assert alloc.arrays == []
    assert all(f is s for f, s in zip(fed, samples, strict=True))


def test_a_tensor_of_another_dtype_or_an_array_leaves_the_leaf_to_collation() -> None:
    promoted: list[Any] = [chw(i, torch.float32) for i in range(N)]
    promoted[20] = chw(20, torch.float64)
    mixed: list[Any] = [chw(i) for i in range(N)]
    mixed[30] = mixed[30].numpy()
    for samples in (promoted, mixed):
        kept = copy.deepcopy(samples)
        alloc = Recorder()
        stack = Prestack(alloc, N)
        fed = feed_all(stack, samples)
        assert stack.stacked == {}
        assert stack.broke
        same(collate_prestacked(fed, True, alloc, stack.stacked), default_collate(kept))


class Tensors:
    """Strided CHW tensors and their labels, as a torchvision pipeline makes them."""

    def __len__(self) -> int:
        return 6 * N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"image": chw(i), "label": i}


@pytest.mark.parametrize("workers", [2, 0])
def test_loader_batches_of_tensors_equal_the_collated_samples(workers: int) -> None:
    dataset = Tensors()
    with DataLoader(dataset, batch_size=N, num_workers=workers) as loader:
        batches = list(loader)
        if workers:
            assert loader.statistics().shm_fallbacks == 0
    assert len(batches) == 6
    for k, batch in enumerate(batches):
        same(batch, default_collate([dataset[i] for i in range(k * N, (k + 1) * N)]))
