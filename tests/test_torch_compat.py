"""Compatibility with torch's DataLoader: the behaviours torch's own ``test/test_dataloader.py``
checks, asked of aioloader (written anew here, not copied).

Where torch's behaviour is the reference, the test runs torch's loader beside ours on the same
data (``num_workers=0`` on torch's side: its batches do not depend on the worker count). Where
aioloader differs on purpose, the test asserts aioloader's behaviour and the README's migration
table gives the reason. A behaviour that is torch's but not yet aioloader's is marked
``xfail(strict=True)`` with the exact behaviour and the module that owes it.

Worker processes are real (``num_workers=2`` where torch's tests use workers), and so are the
crashes (SIGSEGV) and hangs. Datasets are in ``compat_datasets`` (workers import them by name).
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import pickle
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import torch.utils.data as tud
from compat_datasets import (
    Arrays,
    BrokenIter,
    BulkIndexed,
    Counting,
    CustomBatch,
    CustomDict,
    CustomList,
    Dicts,
    HangsAt,
    Indexed,
    NamedTuples,
    NoGetItem,
    NoLength,
    PerWorker,
    Rows,
    Scalars,
    Seeds,
    Segfault,
    Sets,
    StartedAt,
    Strings,
    WhereAmI,
    WorkerIds,
    collate_into_custom_batch,
    collate_into_packed_sequence,
    collate_into_packed_sequence_batch_first,
    failing_init,
    lengths_of,
    seed_12345,
)
from datasets import FailAt
from helpers import BOUND_S, as_lists, notes_of
from procs import no_worker_left_behind
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

import aioloader
from aioloader import (
    BatchSampler,
    CollateShapeError,
    CollateTypeError,
    DataLoader,
    DistributedSampler,
    LoaderTimeoutError,
    RandomSampler,
    WorkerCrashedError,
    WorkerInfo,
    default_collate,
)

WORKERS = [0, 2]  # the main process (a helper thread) and real worker processes


def tensor_dataset(n: int = 20) -> tud.TensorDataset:
    """torch's fixture: data (n, 2, 3) and labels with repeats."""
    generator = torch.Generator().manual_seed(0)
    data = torch.randn(n, 2, 3, generator=generator)
    labels = torch.randperm(n // 2, generator=generator).repeat(2)
    return tud.TensorDataset(data, labels)


def assert_batches_equal(ours: list[Any], theirs: list[Any]) -> None:
    """Same structure, types, dtypes and values, batch by batch."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert type(a) is type(b)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype
            assert torch.equal(a, b)
        else:
            assert_batches_equal(list(a), list(b))


def epoch(loader: DataLoader) -> list[Any]:
    """One synchronous epoch, as torch users write it."""
    return list(loader)


def load(dataset: Any, **kwargs: Any) -> list[Any]:
    """One epoch of a loader made for it, closed at the end. (A torch user may leave a loader
    unclosed; aioloader then warns ResourceWarning when it is collected: see the README.)"""
    with DataLoader(dataset, **kwargs) as loader:
        return list(loader)


class _Embedded(tud.Dataset[torch.Tensor]):
    """Runs a module on each sample, as a feature extractor in a dataset does; a sample of
    ``slow`` takes over a millisecond, so that batches without workers move to the helper
    thread (all slow), or to the helper thread and then back to the loop (only the first)."""

    def __init__(self, slow: range) -> None:
        self.layer = torch.nn.Linear(4, 2)
        self.slow = slow

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        if index in self.slow:
            time.sleep(0.002)
        out: torch.Tensor = self.layer(torch.full((4,), float(index)))
        return out


@pytest.mark.parametrize("slow", [range(24), range(1)], ids=["all_slow", "first_slow"])
@pytest.mark.parametrize("thread_pool", [False, True])
def test_batches_made_on_threads_follow_the_consumers_grad_mode(
    thread_pool: bool, slow: range
) -> None:
    # torch's num_workers=0 runs the dataset in the consumer's thread, under its grad mode; the
    # helper threads (and a sync epoch's loop thread) must too, or evaluation under no_grad
    # records a graph per batch.
    dataset = _Embedded(slow)
    for enabled in (False, True, False):
        with torch.set_grad_enabled(enabled):
            theirs = [b.requires_grad for b in tud.DataLoader(dataset, batch_size=2)]
            with DataLoader(
                dataset, batch_size=2, num_workers=2 if thread_pool else 0, thread_pool=thread_pool
            ) as loader:
                ours = [b.requires_grad for b in loader]

                async def consume() -> list[bool]:
                    return [b.requires_grad async for b in loader]

                ours_async = asyncio.run(consume())
        assert theirs == [enabled] * 12
        assert ours == theirs
        assert ours_async == theirs


# -- batches, order, lengths ------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", WORKERS)
def test_sequential_batches_equal_torchs(num_workers: int) -> None:
    dataset = tensor_dataset()
    for batch_size in (1, 3):
        theirs = list(tud.DataLoader(dataset, batch_size=batch_size))
        with DataLoader(dataset, batch_size=batch_size, num_workers=num_workers) as loader:
            assert loader.batch_size == batch_size
            assert_batches_equal(epoch(loader), theirs)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_shuffle_yields_every_sample_once_per_epoch(num_workers: int) -> None:
    dataset = tensor_dataset()
    data, labels = dataset.tensors
    with DataLoader(dataset, batch_size=3, shuffle=True, num_workers=num_workers) as loader:
        orders = []
        for _ in range(2):
            batches = epoch(loader)
            assert [len(x) for x, _ in batches] == [3] * 6 + [2]
            samples = torch.cat([x for x, _ in batches])
            targets = torch.cat([y for _, y in batches])
            # Each sample once, with its own label.
            found = [int((data == s).all(dim=(1, 2)).nonzero()) for s in samples]
            assert sorted(found) == list(range(20))
            assert torch.equal(targets, labels[found])
            orders.append(found)
        assert orders[0] != orders[1]  # a new order each epoch


@pytest.mark.parametrize("drop_last", [False, True])
def test_len_and_batch_count_with_drop_last_equal_torchs(drop_last: bool) -> None:
    dataset = tensor_dataset(20)
    for batch_size in (1, 2, 3, 7, 20, 25):
        theirs = tud.DataLoader(dataset, batch_size=batch_size, drop_last=drop_last)
        with DataLoader(dataset, batch_size=batch_size, drop_last=drop_last) as ours:
            assert len(ours) == len(theirs), batch_size
            assert len(iter(ours)) == len(iter(theirs)), batch_size  # an iterator's too
            assert len(epoch(ours)) == len(list(theirs)), batch_size
            assert ours.drop_last is drop_last


def test_len_of_an_iterable_dataset_with_len_equals_torchs() -> None:
    for batch_size in (1, 2, 3, 4, 11):
        for drop_last in (False, True):
            theirs = tud.DataLoader(Counting(10), batch_size=batch_size, drop_last=drop_last)
            with DataLoader(Counting(10), batch_size=batch_size, drop_last=drop_last) as ours:
                assert len(ours) == len(theirs), (batch_size, drop_last)
                assert as_lists(epoch(ours)) == [b.tolist() for b in theirs]


def test_len_of_a_stream_without_len_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        len(tud.DataLoader(NoLength(), batch_size=2))
    with pytest.raises(TypeError):
        len(DataLoader(NoLength(), batch_size=2))
    with pytest.raises(TypeError):
        len(iter(tud.DataLoader(NoLength(), batch_size=2)))
    with pytest.raises(TypeError):
        len(iter(DataLoader(NoLength(), batch_size=2)))
    # list() asks for a length hint and takes the TypeError as "unknown", as for torch's loader.
    assert as_lists(load(NoLength(), batch_size=2)) == [[0, 1], [2]]


def test_len_follows_a_dataset_that_grows() -> None:
    dataset: Any = [torch.ones(4) for _ in range(4)]
    sequential = DataLoader(dataset, shuffle=False)
    shuffled = DataLoader(dataset, shuffle=True)
    dataset.append(torch.ones(4))
    assert len(tud.DataLoader(dataset)) == 5
    assert len(sequential) == 5
    assert len(shuffled) == 5


@pytest.mark.parametrize("num_workers", WORKERS)
def test_any_iterable_of_indices_is_a_sampler(num_workers: int) -> None:
    dataset = tensor_dataset()
    data = dataset.tensors[0]
    with DataLoader(dataset, sampler=range(2, 12), batch_size=2, num_workers=num_workers) as dl:
        assert len(dl) == 5
        batches = epoch(dl)
    assert [x.tolist() for x, _ in batches] == [data[i : i + 2].tolist() for i in range(2, 12, 2)]


@pytest.mark.parametrize("num_workers", WORKERS)
def test_a_list_of_index_tuples_is_a_batch_sampler(num_workers: int) -> None:
    dataset = tensor_dataset()
    data = dataset.tensors[0]
    batches = []  # (0, 1), (2, 3, 4), (5, 6), (7, 8, 9), ...
    for i in range(0, 20, 5):
        batches += [tuple(range(i, i + 2)), tuple(range(i + 2, i + 5))]
    with DataLoader(dataset, batch_sampler=batches, num_workers=num_workers) as loader:
        assert len(loader) == 8
        got = epoch(loader)
    assert [x.tolist() for x, _ in got] == [data[list(b)].tolist() for b in batches]


def test_batch_size_none_yields_samples_without_collating_them() -> None:
    dataset = tensor_dataset()
    data, labels = dataset.tensors
    got = load(dataset, batch_size=None)
    assert len(got) == 20
    for i, (x, y) in enumerate(got):
        assert torch.equal(x, data[i])
        assert torch.equal(y, labels[i])
    # Python numbers stay numbers, arrays become tensors (torch's default_convert).
    assert load(Indexed(3), batch_size=None) == [0, 1, 2]
    arrays = load(Arrays(2), batch_size=None, num_workers=2)
    assert all(isinstance(a, torch.Tensor) and a.shape == (2, 3, 4) for a in arrays)
    named = load(NamedTuples(2), batch_size=None)
    assert type(named[1].data).__name__ == "Data"
    assert named[1].data.positive == 1


def test_a_sampler_of_index_lists_with_batch_size_none_reads_them_in_bulk() -> None:
    sampler = [list(range(i, min(i + 4, 35))) for i in range(0, 35, 4)]
    batches = load(BulkIndexed(35), batch_size=None, sampler=sampler, num_workers=2)
    assert sorted(torch.cat(batches).tolist()) == list(range(35))


class _BulkRead(tud.Dataset[Any]):
    """``dataset[key]`` for a list, array or tensor key: its rows of a table, as numpy arrays
    (converted by default_convert, never collated), and the key it was given, as it was given."""

    def __init__(self) -> None:
        self.table = np.arange(40).reshape(20, 2)

    def __len__(self) -> int:
        return 20

    def __getitem__(self, key: Any) -> Any:
        return {"rows": self.table[key], "key": type(key).__name__, "size": len(key)}


BULK_SAMPLERS: dict[str, list[Any]] = {
    "lists": [[3, 1, 4], [1, 5], [9, 2, 6, 5], []],
    "arrays": [np.array([3, 1, 4]), np.array([0, 19])],
    "tensors": [torch.tensor([3, 1, 4]), torch.tensor([7, 0])],
    "numpy integers": [[np.int64(3), np.int32(1)]],
}


@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("sampler", BULK_SAMPLERS.values(), ids=BULK_SAMPLERS.keys())
def test_batch_size_none_passes_each_key_of_the_sampler_to_the_dataset_as_torch_does(
    sampler: list[Any], num_workers: int
) -> None:
    # torch's bulk loading: without automatic batching, each element the sampler yields is
    # the key of one dataset[key] call, and the result goes through default_convert.
    theirs = list(tud.DataLoader(_BulkRead(), batch_size=None, sampler=sampler))
    with DataLoader(_BulkRead(), batch_size=None, sampler=sampler, num_workers=num_workers) as dl:
        assert len(dl) == len(sampler)
        assert dl.batch_sampler is None
        ours = epoch(dl)
    assert len(ours) == len(theirs) == len(sampler)
    for a, b, key in zip(ours, theirs, sampler, strict=True):
        assert isinstance(a["rows"], torch.Tensor)  # default_convert: the array as a tensor
        assert torch.equal(a["rows"], b["rows"])
        assert a["rows"].tolist() == np.arange(40).reshape(20, 2)[list(map(int, key))].tolist()
        assert (a["key"], a["size"]) == (b["key"], b["size"]) == (type(key).__name__, len(key))


@pytest.mark.parametrize("num_workers", WORKERS)
def test_a_failed_bulk_read_names_its_key_and_can_be_skipped(num_workers: int) -> None:
    sampler = [[0, 1], [2, 99], [4, 5]]  # 99 is past the table's end
    with pytest.raises(IndexError) as info:
        load(_BulkRead(), batch_size=None, sampler=sampler, num_workers=num_workers)
    assert "[2, 99]" in notes_of(info.value)
    with DataLoader(
        _BulkRead(),
        batch_size=None,
        sampler=sampler,
        num_workers=num_workers,
        on_error="skip",
        max_failures=1,
    ) as loader:
        got = [b["rows"][:, 0].tolist() for b in loader]
        skipped = loader.statistics().skipped
    assert got == [[0, 2], [8, 10]]
    assert [repr(key) for key, _ in skipped] == ["[2, 99]"]


def test_keys_that_are_not_indices_are_still_refused_without_batching() -> None:
    # A dict or None as a key is refused (README: keys), in a message for this mode.
    for bad in ({"i": 1}, None, [[0, 1], [2]], ["a", 1]):
        with pytest.raises(TypeError, match="with batch_size=None a sampler yields"):
            load(_BulkRead(), batch_size=None, sampler=[bad])


class _KeyEcho:
    """A map-style dataset whose samples are the keys it is given."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, key: Any) -> Any:
        return key


def test_a_batch_sampler_of_tuple_keys_passes_them_to_the_dataset() -> None:
    plan = [[(0, 224), (1, 224)], [(2, 320), (3, 320)]]
    batches = load(_KeyEcho(), batch_sampler=plan, collate_fn=list, num_workers=2)
    assert batches == plan


@pytest.mark.parametrize("num_workers", [0, 1])
def test_list_and_tuple_of_a_loader(num_workers: int) -> None:
    expected = [torch.tensor([i, i + 1]) for i in range(0, 20, 2)]
    for dataset in (Indexed(20), Counting(20)):
        with DataLoader(dataset, batch_size=2, num_workers=num_workers) as loader:
            assert_batches_equal(list(loader), expected)
            assert_batches_equal(list(tuple(loader)), expected)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_in_order_false_yields_every_batch_once(num_workers: int) -> None:
    batches = as_lists(load(Indexed(30), batch_size=4, num_workers=num_workers, in_order=False))
    theirs = list(tud.DataLoader(Indexed(30), batch_size=4, in_order=False))
    assert sorted(map(tuple, batches)) == sorted(tuple(b.tolist()) for b in theirs)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_shuffle_with_a_seeded_generator_is_reproducible(num_workers: int) -> None:
    def run() -> list[list[int]]:
        generator = torch.Generator().manual_seed(42)
        return as_lists(
            load(
                Indexed(20),
                batch_size=4,
                shuffle=True,
                generator=generator,
                num_workers=num_workers,
            )
        )

    first = run()
    assert first == run()
    assert sorted(i for b in first for i in b) == list(range(20))


def _orders(loader: Any, epochs: int, stop_first_after: int | None = None) -> list[Any]:
    """The batches of ``epochs`` epochs, the first one left after ``stop_first_after``."""
    out = []
    for epoch in range(epochs):
        batches = []
        for batch in loader:
            batches.append(batch.tolist())
            if epoch == 0 and len(batches) == stop_first_after:
                break
        out.append(batches)
    return out


@pytest.mark.parametrize(
    ("num_workers", "persistent", "stop"),
    [(0, False, None), (2, False, None), (2, True, None), (2, False, 2)],
    ids=["w0", "w2", "w2-persistent", "w2-first-left-early"],
)
def test_a_shared_generator_orders_every_epoch_as_torch_does(
    num_workers: int, persistent: bool, stop: int | None
) -> None:
    # torch draws a base seed from the loader's generator for each iterator (once, with
    # persistent workers), then its RandomSampler draws the permutation from the same
    # generator: the second epoch's order depends on that draw. (Left early without workers,
    # torch's sampler has not drawn its last, empty permutation; ours draws the epoch's
    # permutations at iter(): from there the orders differ. With workers, torch's prefetch
    # has read the sampler to its end.)
    kwargs: dict[str, Any] = {
        "batch_size": 4,
        "shuffle": True,
        "num_workers": num_workers,
        "persistent_workers": persistent,
    }
    data = Indexed(20)
    theirs: tud.DataLoader[Any] = tud.DataLoader(
        data, generator=torch.Generator().manual_seed(7), **kwargs
    )
    with DataLoader(data, generator=torch.Generator().manual_seed(7), **kwargs) as ours:
        assert _orders(ours, 3, stop) == _orders(theirs, 3, stop)


def test_a_shared_generator_resumes_between_and_within_epochs_as_it_ran() -> None:
    def made() -> DataLoader:
        generator = torch.Generator().manual_seed(3)
        return DataLoader(list(range(12)), batch_size=3, shuffle=True, generator=generator)

    with made() as straight:
        whole = _orders(straight, 3)
    with made() as first:
        assert _orders(first, 1) == whole[:1]
        between = first.state_dict()  # after epoch 0: points at epoch 1
        it = iter(first)
        taken = [next(it).tolist()]
        within = first.state_dict()  # one batch into epoch 1
        del it
    assert taken == whole[1][:1]
    with made() as resumed:
        resumed.load_state_dict(between)
        assert _orders(resumed, 2) == whole[1:]
    with made() as resumed:
        resumed.load_state_dict(within)
        assert [b.tolist() for b in resumed] == whole[1][1:]
        assert _orders(resumed, 1) == whole[2:]


def test_torchs_dataset_classes_are_accepted() -> None:
    dataset = tensor_dataset(6)
    cases: list[Any] = [
        tud.Subset(dataset, [4, 0, 2]),
        tud.ConcatDataset([dataset, dataset]),
        tud.StackDataset(dataset, Indexed(6)),
        tud.ChainDataset([Counting(3), Counting(2)]),
    ]
    for ds in cases:
        assert_batches_equal(load(ds, batch_size=2), list(tud.DataLoader(ds, batch_size=2)))


def test_numpy_arrays_and_scalars_become_tensors_of_their_dtype() -> None:
    batch = load(Arrays(24), batch_size=12)[0]
    assert batch.dtype == torch.float64
    assert batch.shape == (12, 2, 3, 4)
    dtypes: dict[type[np.generic], torch.dtype] = {
        np.float64: torch.float64,
        np.float32: torch.float32,
        np.float16: torch.float16,
        np.int64: torch.int64,
        np.int32: torch.int32,
        np.int16: torch.int16,
        np.int8: torch.int8,
        np.uint8: torch.uint8,
    }
    for np_dtype, torch_dtype in dtypes.items():
        assert load(Scalars(4, np_dtype), batch_size=2)[0].dtype == torch_dtype


@no_worker_left_behind()
def test_dicts_strings_and_namedtuples_through_workers() -> None:
    for i, batch in enumerate(load(Dicts(4), batch_size=2, num_workers=2)):
        assert set(batch) == {"a_tensor", "another_dict"}
        assert batch["a_tensor"].shape == (2, 4, 2)
        assert batch["a_tensor"][:, 0, 0].tolist() == [2 * i, 2 * i + 1]
        assert batch["another_dict"]["a_number"].tolist() == [2 * i, 2 * i + 1]
    for text, index in load(Strings(5), batch_size=2, shuffle=True, num_workers=2):
        # Strings stay strings; transposed out of a tuple, they are a tuple (as in torch).
        assert isinstance(text, tuple)
        assert [int(t) - 1 for t in text] == index.tolist()
    assert isinstance(next(iter(tud.DataLoader(Strings(5), batch_size=2)))[0], tuple)
    for batch in load(NamedTuples(4), batch_size=2, num_workers=2):
        assert type(batch).__name__ == "Batch"
        assert type(batch.data).__name__ == "Data"
        assert isinstance(batch.data.positive, torch.Tensor)
        assert batch.data.negative.tolist() == [-x for x in batch.data.positive.tolist()]
        assert batch.label == tuple(str(x) for x in batch.data.positive.tolist())  # as torch


# -- errors -----------------------------------------------------------------------------------


ERROR_SETTINGS = {
    "thread": {"num_workers": 0},
    "thread pool": {"num_workers": 2, "thread_pool": True},
    "processes": {"num_workers": 2},
}


async def _anext_or_error(it: Any, error: type[Exception]) -> Any:
    async with asyncio.timeout(BOUND_S):
        try:
            return await anext(it)
        except error as exc:
            return exc


def _next_or_error(it: Any, error: type[Exception]) -> Any:
    try:
        return next(it)
    except error as exc:
        return exc


def _outcomes(got: list[Any]) -> list[Any]:
    return [g.tolist() if isinstance(g, torch.Tensor) else type(g) for g in got]


def test_loader_errors_are_also_the_types_torch_raises() -> None:
    # torch raises RuntimeError for a dead worker and a timeout, TypeError for a type
    # default_collate cannot handle, RuntimeError for different sizes. The types aioloader
    # had before stay bases too, and the errors keep type and fields across a pickle (workers).
    expected = {
        WorkerCrashedError: (RuntimeError, aioloader.WorkerError),
        aioloader.WorkerInitError: (RuntimeError, aioloader.WorkerError),
        LoaderTimeoutError: (RuntimeError, TimeoutError),
        CollateTypeError: (TypeError, aioloader.CollateError, ValueError),
        CollateShapeError: (RuntimeError, aioloader.CollateError, ValueError),
    }
    for cls, bases in expected.items():
        assert issubclass(cls, aioloader.AioloaderError)
        for base in bases:
            assert issubclass(cls, base), (cls, base)
    crashed = pickle.loads(pickle.dumps(WorkerCrashedError("died", pid=7, exitcode=-11)))
    assert (type(crashed), str(crashed), crashed.pid, crashed.exitcode) == (
        WorkerCrashedError,
        "died",
        7,
        -11,
    )
    late = pickle.loads(pickle.dumps(LoaderTimeoutError("batch 3 took too long")))
    assert (type(late), str(late)) == (LoaderTimeoutError, "batch 3 took too long")


# Arguments torch refuses with ValueError whatever is wrong with them, a wrong type included:
# (the call, on torch.utils.data or aioloader; whether the argument's type is wrong).
REFUSED_AS_TORCH_REFUSES: dict[str, tuple[Callable[[Any], object], bool]] = {
    "DataLoader batch_size='4'": (lambda m: m.DataLoader(range(8), batch_size="4"), True),
    "DataLoader batch_size=2.5": (lambda m: m.DataLoader(range(8), batch_size=2.5), True),
    "DataLoader batch_size=True": (lambda m: m.DataLoader(range(8), batch_size=True), True),
    "DataLoader batch_size=0": (lambda m: m.DataLoader(range(8), batch_size=0), False),
    "DataLoader drop_last='x'": (lambda m: m.DataLoader(range(8), drop_last="x"), True),
    "DataLoader drop_last=1": (lambda m: m.DataLoader(range(8), drop_last=1), True),
    "DataLoader drop_last=0": (lambda m: m.DataLoader(range(8), drop_last=0), True),
    "BatchSampler batch_size='2'": (lambda m: m.BatchSampler(range(8), "2", False), True),
    "BatchSampler drop_last=1": (lambda m: m.BatchSampler(range(8), 2, drop_last=1), True),
    "RandomSampler num_samples='3'": (
        lambda m: m.RandomSampler(range(8), num_samples="3"),
        True,
    ),
    "RandomSampler num_samples=-1": (
        lambda m: m.RandomSampler(range(8), num_samples=-1),
        False,
    ),
}


@pytest.mark.parametrize(
    ("make", "wrong_type"),
    REFUSED_AS_TORCH_REFUSES.values(),
    ids=REFUSED_AS_TORCH_REFUSES.keys(),
)
def test_bad_arguments_raise_what_torch_raises(
    make: Callable[[Any], object], wrong_type: bool
) -> None:
    # Code written against torch catches ValueError; a wrong type is also a TypeError here,
    # as every other wrong type in aioloader is. The message names the argument.
    names = "batch_size|drop_last|num_samples"
    with pytest.raises(ValueError, match=names) as torchs:
        make(tud)
    with pytest.raises(ValueError, match=names) as ours:
        make(aioloader)
    assert type(torchs.value) is ValueError
    assert isinstance(ours.value, TypeError) is wrong_type
    name = next(n for n in names.split("|") if n in str(torchs.value))
    assert name in str(ours.value)


@pytest.mark.parametrize("settings", ERROR_SETTINGS.values(), ids=ERROR_SETTINGS.keys())
async def test_after_a_batch_raises_anext_goes_on_with_the_next_batches(
    settings: dict[str, Any],
) -> None:
    # torch's _test_error: every batch of a dataset without __getitem__ raises
    # NotImplementedError, and each next() after one goes on with the next batch.
    async with DataLoader(NoGetItem(9), batch_size=2, shuffle=True, **settings) as loader:
        it = aiter(loader)
        outcomes = [await _anext_or_error(it, NotImplementedError) for _ in range(5)]
        assert all(isinstance(o, NotImplementedError) for o in outcomes)
        with pytest.raises(StopAsyncIteration):
            await anext(it)
    # Failed and good batches mixed: each comes in its turn.
    async with DataLoader(FailAt(10, {2, 7}), batch_size=2, **settings) as loader:
        it = aiter(loader)
        got = [await _anext_or_error(it, KeyError) for _ in range(5)]
        assert _outcomes(got) == [[0, 1], KeyError, [4, 5], KeyError, [8, 9]]
        with pytest.raises(StopAsyncIteration):
            await anext(it)


@pytest.mark.parametrize("settings", ERROR_SETTINGS.values(), ids=ERROR_SETTINGS.keys())
def test_after_a_batch_raises_next_goes_on_with_the_next_batches(settings: dict[str, Any]) -> None:
    with DataLoader(FailAt(10, {2, 7}), batch_size=2, **settings) as loader:
        it = iter(loader)
        got = [_next_or_error(it, KeyError) for _ in range(5)]
        assert _outcomes(got) == [[0, 1], KeyError, [4, 5], KeyError, [8, 9]]
        with pytest.raises(StopIteration):
            next(it)


@pytest.mark.parametrize("settings", ERROR_SETTINGS.values(), ids=ERROR_SETTINGS.keys())
async def test_stop_iteration_from_getitem_is_an_error_not_the_end_of_the_epoch(
    settings: dict[str, Any],
) -> None:
    # torch ends the epoch there, dropping the rest unseen (a deliberate difference, in the
    # README's migration table); before, this loader ended it at 0 workers under `for`, hung
    # under `async for` (a future cannot hold a StopIteration) and raised with workers.
    dataset = FailAt(10, {2, 7}, error_type=StopIteration)
    expected = [[0, 1], RuntimeError, [4, 5], RuntimeError, [8, 9]]
    with DataLoader(dataset, batch_size=2, **settings) as loader:
        it = iter(loader)
        got = [_next_or_error(it, RuntimeError) for _ in range(5)]
        assert _outcomes(got) == expected
        assert "index 2" in notes_of(got[1])
        assert "StopIteration" in str(got[1])
        with pytest.raises(StopIteration):
            next(it)
    async with DataLoader(dataset, batch_size=2, **settings) as loader:
        ait = aiter(loader)
        got = [await _anext_or_error(ait, RuntimeError) for _ in range(5)]
        assert _outcomes(got) == expected
        assert "index 7" in notes_of(got[3])
        with pytest.raises(StopAsyncIteration):
            await anext(ait)


def test_the_first_error_of_a_sync_epoch_keeps_its_type() -> None:
    with pytest.raises(NotImplementedError):
        load(NoGetItem(4), batch_size=2, num_workers=2)


@no_worker_left_behind()
def test_a_timeout_is_a_runtime_error_as_in_torch() -> None:
    with (
        DataLoader(HangsAt(4, bad=0), batch_size=1, num_workers=2, timeout=0.5) as loader,
        pytest.raises(RuntimeError) as info,
    ):
        next(iter(loader))
    assert isinstance(info.value, LoaderTimeoutError)
    assert isinstance(info.value, TimeoutError)
    assert "batch 0" in str(info.value)


@no_worker_left_behind()
def test_a_worker_killed_by_a_signal_is_a_runtime_error_naming_pid_and_signal() -> None:
    with DataLoader(Segfault(4), batch_size=2, num_workers=2) as loader:
        pids = set(loader.worker_pids)
        with pytest.raises(RuntimeError) as info:
            next(iter(loader))
    error = info.value
    assert isinstance(error, WorkerCrashedError)
    assert error.pid in pids
    assert f"pid {error.pid}" in str(error)
    assert "SIGSEGV" in str(error)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_an_error_in_iter_is_raised_with_its_type(num_workers: int) -> None:
    with pytest.raises(RuntimeError, match="Error in __iter__"):
        load(BrokenIter(), num_workers=num_workers)


def test_an_error_in_worker_init_fn_is_a_runtime_error_with_its_message() -> None:
    with pytest.raises(RuntimeError, match="Error in worker_init_fn"):
        load(Indexed(4), num_workers=2, worker_init_fn=failing_init)


BAD_ARGUMENTS: dict[str, tuple[Callable[[], Any], type[Exception]]] = {
    "num_workers=-1": (lambda: DataLoader(Indexed(4), num_workers=-1), ValueError),
    "timeout=-1": (lambda: DataLoader(Indexed(4), timeout=-1), ValueError),
    "sampler with shuffle": (
        lambda: DataLoader(Indexed(4), sampler=range(4), shuffle=True),
        ValueError,
    ),
    "batch_sampler with batch_size": (
        lambda: DataLoader(Indexed(4), batch_size=11, batch_sampler=[[0]]),
        ValueError,
    ),
    "batch_sampler with shuffle": (
        lambda: DataLoader(Indexed(4), shuffle=True, batch_sampler=[[0]]),
        ValueError,
    ),
    "batch_sampler with drop_last": (
        lambda: DataLoader(Indexed(4), drop_last=True, batch_sampler=[[0]]),
        ValueError,
    ),
    "batch_sampler with sampler": (
        lambda: DataLoader(Indexed(4), sampler=range(4), batch_sampler=[[0]]),
        ValueError,
    ),
    "iterable with shuffle": (lambda: DataLoader(Counting(4), shuffle=True), ValueError),
    "iterable with sampler": (lambda: DataLoader(Counting(4), sampler=range(4)), ValueError),
    "iterable with batch_sampler": (
        lambda: DataLoader(Counting(4), batch_sampler=[[0]]),
        ValueError,
    ),
    "unknown start method": (
        lambda: DataLoader(Indexed(4), num_workers=1, multiprocessing_context="bad"),
        ValueError,
    ),
    "a start method that is neither a name nor a context": (
        lambda: DataLoader(Indexed(4), num_workers=1, multiprocessing_context=object()),  # type: ignore[arg-type]
        TypeError,
    ),
    "batch_size=None with drop_last": (
        lambda: DataLoader(Indexed(4), batch_size=None, drop_last=True),
        ValueError,
    ),
    "prefetch_factor without workers": (
        lambda: DataLoader(Indexed(4), prefetch_factor=2),
        ValueError,
    ),
    "persistent_workers without workers": (
        lambda: DataLoader(Indexed(4), persistent_workers=True),
        ValueError,
    ),
}


@pytest.mark.parametrize(("make", "error"), BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_bad_arguments_raise_the_error_type_torch_raises(
    make: Callable[[], Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        make()


TORCH_ARGUMENTS: dict[str, dict[str, Any]] = {
    "prefetch_factor": {"num_workers": 1, "prefetch_factor": 3},
    "persistent_workers": {"num_workers": 1, "persistent_workers": True},
    "multiprocessing_context": {"num_workers": 1, "multiprocessing_context": "forkserver"},
    "pin_memory_device": {"pin_memory_device": ""},
}


@pytest.mark.parametrize("kwargs", TORCH_ARGUMENTS.values(), ids=TORCH_ARGUMENTS.keys())
def test_torchs_argument_is_accepted(kwargs: dict[str, Any]) -> None:
    assert as_lists(load(Indexed(6), batch_size=2, **kwargs)) == [[0, 1], [2, 3], [4, 5]]


# Flags as YAML (`shuffle: 1`) and argparse (type=int) configs give them: torch reads them by
# their truth, aioloader takes 0 and 1 (drop_last excepted: torch's BatchSampler refuses an int,
# REFUSED_AS_TORCH_REFUSES).
INT_FLAGS: dict[str, Any] = {
    "shuffle=1": {"shuffle": 1},
    "shuffle=0": {"shuffle": 0},
    "in_order=0": {"in_order": 0, "num_workers": 2},
    "persistent_workers=1": {"persistent_workers": 1, "num_workers": 2},
    "pin_memory=1": pytest.param(
        {"pin_memory": 1}, marks=pytest.mark.filterwarnings("ignore::UserWarning")
    ),  # without CUDA both warn and pass batches through
}


@pytest.mark.parametrize("kwargs", INT_FLAGS.values(), ids=INT_FLAGS.keys())
def test_flags_given_as_0_or_1_are_taken_as_torch_takes_them(kwargs: dict[str, Any]) -> None:
    def generator() -> torch.Generator:
        return torch.Generator().manual_seed(7)

    data = Indexed(20)
    theirs: tud.DataLoader[Any] = tud.DataLoader(
        data, batch_size=4, generator=generator(), **kwargs
    )
    with DataLoader(data, batch_size=4, generator=generator(), **kwargs) as ours:
        got = _orders(ours, 2)
        for name, value in kwargs.items():
            if name not in ("shuffle", "num_workers"):
                assert getattr(ours, name) is bool(value), name
    expected = _orders(theirs, 2)
    if kwargs.get("in_order") == 0:  # as completed: the same batches
        got, expected = [sorted(e) for e in got], [sorted(e) for e in expected]
    assert got == expected
    assert (got[0] != sorted(got[0])) is bool(kwargs.get("shuffle"))


def test_flags_of_other_values_are_refused_where_torch_reads_their_truth() -> None:
    # torch shuffles with shuffle="no" and pins with pin_memory="false": a config's typo, not
    # an intent (README, the boolean flags row).
    assert len(list(tud.DataLoader(Indexed(4), shuffle="no"))) == 4  # type: ignore[arg-type]
    refused: list[dict[str, Any]] = [{"shuffle": "no"}, {"pin_memory": "false"}, {"in_order": 2}]
    for kwargs in refused:
        [(name, value)] = kwargs.items()
        with pytest.raises(TypeError, match=f"{name} must be a bool, got {value!r}"):
            DataLoader(Indexed(4), **kwargs)


@pytest.mark.parametrize(
    "name", ["dataset", "batch_size", "batch_sampler", "sampler", "drop_last", "persistent_workers"]
)
def test_settings_cannot_be_reassigned_after_construction(name: str) -> None:
    loader = DataLoader(Indexed(4))
    with pytest.raises(ValueError, match=name):
        setattr(loader, name, {})


def test_more_workers_than_cpus_warns() -> None:
    with pytest.warns(UserWarning, match="num_workers=1000"):
        loader = DataLoader(Indexed(4), num_workers=1000)
    loader.close()


# -- worker processes -------------------------------------------------------------------------


@no_worker_left_behind()
def test_worker_init_fn_runs_in_each_worker_on_its_copy_of_the_dataset() -> None:
    assert aioloader.get_worker_info() is None
    dataset = WhereAmI(12)
    with DataLoader(
        dataset, batch_size=2, num_workers=2, worker_init_fn=dataset.worker_init_fn
    ) as loader:
        columns = [[c.tolist() for c in batch] for batch in epoch(loader)]
        pids = set(loader.worker_pids)
    rows = [row for batch in columns for row in zip(*batch, strict=True)]
    assert len(rows) == 12
    assert {r[0] for r in rows} <= {0, 1}
    for worker_id, num_workers, pid, init_id, own_copy in rows:
        assert num_workers == 2
        assert pid in pids
        assert pid != os.getpid()
        assert init_id == worker_id  # worker_init_fn ran in this worker, on this copy
        assert own_copy  # get_worker_info().dataset is this worker's copy
    assert dataset.init_id == -1  # the main process's dataset was never touched
    assert aioloader.get_worker_info() is None


def test_each_batch_is_seeded_from_the_seed_and_its_place_not_by_worker_init_fn() -> None:
    # torch seeds each worker once (base seed + worker id), so a worker_init_fn that calls
    # torch.manual_seed(12345) fixes every later draw of that worker. aioloader reseeds before
    # every batch from (seed, epoch, batch), so draws do not depend on which worker ran it.
    def seeds(num_workers: int) -> list[list[list[str]]]:
        with DataLoader(
            Seeds(8), batch_size=2, num_workers=num_workers, worker_init_fn=seed_12345, seed=7
        ) as loader:
            return [epoch(loader) for _ in range(2)]

    two_workers = seeds(2)
    first = [b[0] for e in two_workers for b in e]
    assert "12345" not in first
    assert len(set(first)) == len(first)  # distinct per batch and per epoch
    assert all(len(set(b)) == 1 for e in two_workers for b in e)  # one seed per batch
    assert seeds(1) == two_workers  # the same whatever the worker count


def test_torch_initial_seed_of_a_worker_collates() -> None:
    batches = load(Seeds(8, as_text=False), batch_size=2, num_workers=2, seed=7)
    assert all(b.dtype == torch.int64 for b in batches)


def test_worker_info_is_read_only_and_names_its_fields() -> None:
    info = WorkerInfo(id=0, num_workers=2, seed=5, dataset=None)
    with pytest.raises(AttributeError):  # torch raises RuntimeError (see the README)
        info.id = 3  # type: ignore[misc]
    for field in ("id=", "num_workers=", "seed=", "dataset="):
        assert field in repr(info)


@no_worker_left_behind()
def test_torchs_get_worker_info_answers_in_workers() -> None:
    batches = {
        tuple(b)
        for b in as_lists(load(PerWorker([4, 20], torch_info=True), batch_size=7, num_workers=2))
    }
    assert batches == {tuple(range(4)), tuple(range(7)), tuple(range(7, 14)), tuple(range(14, 20))}


@no_worker_left_behind()
def test_a_stream_sharded_by_worker_info_batches_per_worker() -> None:
    expected = {tuple(range(4)), tuple(range(7)), tuple(range(7, 14)), tuple(range(14, 20))}
    with DataLoader(PerWorker([4, 20]), batch_size=7, num_workers=2) as loader:
        for _ in range(2):
            assert {tuple(b) for b in as_lists(epoch(loader))} == expected
    dropped = load(PerWorker([4, 20]), batch_size=7, num_workers=2, drop_last=True)
    assert {tuple(b) for b in as_lists(dropped)} == {tuple(range(7)), tuple(range(7, 14))}


@no_worker_left_behind()
def test_stream_batches_alternate_between_workers_every_epoch() -> None:
    with DataLoader(WorkerIds(20), batch_size=5, num_workers=2) as loader:
        for _ in range(3):
            assert as_lists(epoch(loader)) == [[0] * 5, [1] * 5, [0] * 5, [1] * 5]


@no_worker_left_behind()
def test_an_epoch_left_early_then_a_full_one_then_workers_exit_on_close() -> None:
    with DataLoader(Indexed(40), batch_size=2, num_workers=2) as loader:
        it = iter(loader)
        for i, _ in enumerate(it):
            if i == 3:
                break
        del it
        assert as_lists(epoch(loader)) == [[i, i + 1] for i in range(0, 40, 2)]
        workers = [psutil.Process(pid) for pid in loader.worker_pids]
        assert len(workers) == 2
    _, alive = psutil.wait_procs(workers, timeout=5)
    assert not alive


@no_worker_left_behind()
def test_persistent_workers_keep_the_dataset_they_started_with() -> None:
    # torch's persistent_workers=True: later changes to the main process's dataset are not
    # seen by the workers (without it, each epoch's copy is new: test_worker_compat).
    dataset = StartedAt(4)
    with DataLoader(dataset, batch_size=2, num_workers=2, persistent_workers=True) as loader:
        for start in range(3):
            assert as_lists(epoch(loader)) == [[0, 0], [0, 0]]
            dataset.start = start + 1


@no_worker_left_behind()
def test_iterators_of_two_loaders_advance_in_turn() -> None:
    dataset = tensor_dataset()
    with (
        DataLoader(dataset, num_workers=1) as one,
        DataLoader(dataset, num_workers=2) as two,
    ):
        first, second = iter(one), iter(two)
        got = [next(first), next(first), next(second), next(second), next(first), next(second)]
        del first, second
    data = dataset.tensors[0]
    assert [x.tolist() for x, _ in got] == [data[i : i + 1].tolist() for i in (0, 1, 0, 1, 2, 2)]


def test_pin_memory_without_a_gpu_warns_and_passes_batches_through() -> None:
    if torch.cuda.is_available():
        pytest.skip("with a GPU, pinning happens (tests/test_device_cuda.py)")
    assert issubclass(aioloader.DeviceUnavailableWarning, UserWarning)  # as torch's warning
    with pytest.warns(aioloader.DeviceUnavailableWarning, match="CUDA is not available"):
        batches = load(Dicts(4), batch_size=2, pin_memory=True)
    assert [b["another_dict"]["a_number"].tolist() for b in batches] == [[0, 1], [2, 3]]


# MXNet Gluon's pin_device_id: the CUDA device whose pinned memory pin_memory uses, torch's
# pin_memory_device="cuda:<id>".


def test_pin_device_id_is_gluons_name_for_the_pin_memory_device() -> None:
    loader = DataLoader(Indexed(4), pin_memory=True, pin_device_id=1)  # not run: no GPU here
    assert (loader.pin_device_id, loader.pin_memory_device) == (1, "cuda:1")
    assert loader.pin_memory is True
    loader.close()
    with DataLoader(Indexed(4), pin_device_id=0) as loader:  # Gluon's default, pin_memory off
        assert (loader.pin_device_id, loader.pin_memory_device, loader.pin_memory) == (
            0,
            "cuda:0",
            False,
        )
    with DataLoader(Indexed(4)) as loader:
        assert (loader.pin_device_id, loader.pin_memory_device) == (None, "")
    agreeing: list[dict[str, Any]] = [{"pin_memory_device": "cuda:2"}, {"pin_memory_device": "cpu"}]
    for kwargs in agreeing:
        with DataLoader(Indexed(4), pin_device_id=2, **kwargs) as loader:
            assert loader.pin_memory_device == "cuda:2"
    with pytest.raises(
        ValueError, match=r"pin_memory_device='cuda:0' conflicts with pin_device_id=1"
    ):
        DataLoader(Indexed(4), pin_device_id=1, pin_memory_device="cuda:0")
    with pytest.raises(ValueError, match="pin_device_id must be a non-negative int, got -1"):
        DataLoader(Indexed(4), pin_device_id=-1)
    for bad in (True, "0", 1.0):
        with pytest.raises(
            TypeError, match=f"pin_device_id must be a non-negative int, got {bad!r}"
        ):
            DataLoader(Indexed(4), pin_device_id=bad)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore::UserWarning")  # both warn that no GPU is there to pin for
@pytest.mark.parametrize("num_workers", WORKERS)
def test_pin_device_id_without_a_gpu_passes_batches_through_as_torch_does(num_workers: int) -> None:
    if torch.cuda.is_available():
        pytest.skip("with a GPU, batches are pinned (test_pin_device_id_pins_the_batches)")
    theirs = list(
        tud.DataLoader(Dicts(4), batch_size=2, pin_memory=True, pin_memory_device="cuda:0")
    )
    with pytest.warns(aioloader.DeviceUnavailableWarning, match="CUDA is not available"):
        ours = load(
            Dicts(4), batch_size=2, pin_memory=True, pin_device_id=0, num_workers=num_workers
        )
    assert [b["another_dict"]["a_number"].tolist() for b in ours] == [[0, 1], [2, 3]]
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a["a_tensor"], b["a_tensor"])


@pytest.mark.cuda
def test_pin_device_id_pins_the_batches() -> None:
    theirs = list(
        tud.DataLoader(Dicts(4), batch_size=2, pin_memory=True, pin_memory_device="cuda:0")
    )
    ours = load(Dicts(4), batch_size=2, pin_memory=True, pin_device_id=0, num_workers=2)
    for a, b in zip(ours, theirs, strict=True):
        assert a["a_tensor"].is_pinned()
        assert b["a_tensor"].is_pinned()
        assert torch.equal(a["a_tensor"], b["a_tensor"])


# -- custom batches from a collate_fn ----------------------------------------------------------


def _expected_packed(
    n: int, length: int, batch_size: int, batch_first: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(padded data, lengths) of each batch of ``Rows(n, length)``, made in this process."""
    out = []
    for start in range(0, n, batch_size):
        lengths = lengths_of(batch_size, length)
        padded = torch.zeros(batch_size, length)
        for row, k in enumerate(lengths.tolist()):
            padded[row, :k] = float(start + row)
        out.append((padded if batch_first else padded.T, lengths))
    return out


@pytest.mark.parametrize("batch_first", [False, True], ids=["time first", "batch first"])
@no_worker_left_behind()
def test_a_packed_sequence_from_collate_fn_arrives_intact_through_workers(
    batch_first: bool,
) -> None:
    # Batches of 4 rows of 5000 float32 steps (80 KB): the first ones travel inline (slots are
    # sized from the largest batch seen), the later ones through shared memory.
    n, length, batch_size = 48, 5000, 4
    collate = (
        collate_into_packed_sequence_batch_first if batch_first else collate_into_packed_sequence
    )
    with DataLoader(
        Rows(n, length), batch_size=batch_size, collate_fn=collate, num_workers=2
    ) as loader:
        batches = epoch(loader)
        assert loader.statistics().shm_bytes > 0  # the shared-memory path was taken
    expected = _expected_packed(n, length, batch_size, batch_first)
    for batch, (padded, lengths) in zip(batches, expected, strict=True):
        assert type(batch) is PackedSequence
        assert batch.batch_sizes.device.type == "cpu"
        unpacked, got_lengths = pad_packed_sequence(
            batch, batch_first=batch_first, total_length=length
        )
        assert torch.equal(got_lengths, lengths)
        assert torch.equal(unpacked, padded)


@pytest.mark.cuda
def test_a_packed_sequence_moved_to_the_gpu_keeps_its_type() -> None:
    batches = load(
        Rows(8, 16), batch_size=4, collate_fn=collate_into_packed_sequence, device="cuda"
    )
    for batch in batches:
        assert type(batch) is PackedSequence
        assert batch.data.device.type == "cuda"
        assert batch.batch_sizes.device.type == "cpu"


@no_worker_left_behind()
def test_a_batch_object_of_the_users_own_arrives_through_workers() -> None:
    batches = load(Rows(4, 3), batch_size=2, collate_fn=collate_into_custom_batch, num_workers=2)
    assert all(type(b) is CustomBatch for b in batches)
    assert [b.tgt.tolist() for b in batches] == [[0, 1], [2, 3]]
    assert [b.inp[:, 0].tolist() for b in batches] == [[0.0, 1.0], [2.0, 3.0]]


@no_worker_left_behind()
def test_a_collate_type_error_from_a_worker_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        tud.default_collate([{1}, {2}])
    with pytest.raises(TypeError) as info:
        load(Sets(4), batch_size=2, num_workers=2)
    assert isinstance(info.value, CollateTypeError)
    assert "set" in str(info.value)


# -- default_collate and default_convert -------------------------------------------------------


def test_default_collate_dtypes_of_python_values() -> None:
    assert default_collate([1, 2, -1]).dtype == torch.int64
    floats = default_collate([1.1, 2.3, -0.9])
    assert floats.dtype == torch.float64
    assert torch.equal(floats, torch.tensor([1.1, 2.3, -0.9], dtype=torch.float64))
    assert default_collate([True, False]).dtype == torch.bool
    assert default_collate(["a", "b", "c"]) == ["a", "b", "c"]
    # A mix of ints and floats is float64 whatever comes first (torch: float32 if an int does).
    assert default_collate([1, 2.5]).dtype == torch.float64
    assert default_collate([2.5, 1]).dtype == torch.float64


def test_default_collate_keeps_the_types_of_mappings_and_sequences() -> None:
    mapping = default_collate([CustomDict(a=1, b=2), CustomDict(a=3, b=4)])
    assert type(mapping) is CustomDict
    assert mapping["a"].tolist() == [1, 3]
    sequence = default_collate([CustomList([1, 2, 3]), CustomList([4, 5, 6])])
    assert type(sequence) is CustomList
    assert [t.tolist() for t in sequence] == [[1, 4], [2, 5], [3, 6]]
    ranges = default_collate([range(2), range(2)])  # cannot be rebuilt: a list
    assert type(ranges) is list
    assert [t.tolist() for t in ranges] == [[0, 0], [1, 1]]


def test_default_collate_refuses_numpy_strings_and_objects_with_a_type_error() -> None:
    strings: Any = np.array(["a", "b", "c"])  # torch's test passes arrays as the batch
    assert default_collate(strings) == ["a", "b", "c"]
    bad: Any
    for bad in (
        np.array([[["a", "b", "c"]]]),
        np.array([object(), object(), object()]),
        np.array([[[object(), object(), object()]]]),
    ):
        with pytest.raises(TypeError):
            tud.default_collate(bad)
        with pytest.raises(TypeError):
            default_collate(bad)


def test_default_collate_of_read_only_memmaps() -> None:
    with tempfile.TemporaryFile() as f:
        array = np.array([[0, 1], [2, 3], [4, 5], [6, 7]])
        writer = np.memmap(f, dtype=array.dtype, mode="w+", shape=array.shape)
        writer[:] = array
        writer.flush()
        reader = np.memmap(f, dtype=array.dtype, mode="r", shape=array.shape)
        batch = default_collate(list(reader))
    assert batch.tolist() == array.tolist()


def test_default_collate_sequences_of_different_lengths_raise_runtime_error() -> None:
    for batch in ([["X"], ["X", "X"]], [["X", "X"], ["X"]]):
        with pytest.raises(RuntimeError):
            tud.default_collate(batch)
        with pytest.raises(RuntimeError):
            default_collate(batch)
        with pytest.raises(CollateShapeError):
            default_collate(batch)


def test_default_collate_of_nested_tensors_raises_runtime_error() -> None:
    with warnings.catch_warnings():  # "the PyTorch API of nested tensors is in prototype stage"
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor([torch.randn(5)])
    with pytest.raises(RuntimeError):
        tud.default_collate([nested, nested])
    with pytest.raises(RuntimeError):
        default_collate([nested, nested])


default_convert: Callable[[Any], Any] | None = getattr(aioloader, "default_convert", None)


@pytest.mark.xfail(
    default_convert is None,
    strict=True,
    reason="collate (_collate.py): aioloader.default_convert does not exist yet",
)
def test_default_convert_keeps_types_and_converts_arrays() -> None:
    assert default_convert is not None
    mapping = default_convert(CustomDict(a=1, b=2))
    assert type(mapping) is CustomDict
    assert mapping == {"a": 1, "b": 2}
    sequence = default_convert(CustomList([1, 2, 3]))
    assert type(sequence) is CustomList
    assert sequence == [1, 2, 3]
    assert default_convert(range(2)) == [0, 1]
    converted = default_convert({"x": np.arange(3), "y": np.float32(2), "s": "text"})
    assert isinstance(converted["x"], torch.Tensor)
    assert converted["x"].tolist() == [0, 1, 2]
    assert isinstance(converted["y"], torch.Tensor)
    assert converted["s"] == "text"


# -- samplers ---------------------------------------------------------------------------------


def test_batch_sampler_batches_and_len_equal_torchs() -> None:
    for batch_size in (1, 3, 10, 11):
        for drop_last in (False, True):
            theirs = tud.BatchSampler(range(10), batch_size, drop_last)
            ours = BatchSampler(range(10), batch_size, drop_last)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="batch_size"):
            tud.BatchSampler(range(10), bad, False)
        with pytest.raises(ValueError, match="batch_size"):
            BatchSampler(range(10), bad, False)


def _stats(sampler: Any) -> tuple[int, int, int, int]:
    """(indices drawn more than once, smallest, largest, draws)."""
    counts = collections.Counter(sampler)
    repeated = sum(v > 1 for v in counts.values())
    return repeated, min(counts), max(counts), sum(counts.values())


def test_random_sampler_num_samples_and_replacement_as_in_torch() -> None:
    n = 20
    repeated, low, high, total = _stats(
        RandomSampler(range(n), replacement=True, num_samples=n + 1)
    )
    assert repeated > 0
    assert (low >= 0, high < n, total) == (True, True, n + 1)
    assert _stats(RandomSampler(range(n))) == (0, 0, n - 1, n)
    # Without replacement, num_samples beyond the dataset goes on with another permutation.
    assert _stats(RandomSampler(range(n), num_samples=2 * n)) == (n, 0, n - 1, 2 * n)
    repeated, _, _, total = _stats(RandomSampler(range(n), num_samples=n - 1))
    assert (repeated, total) == (0, n - 1)
    assert _stats(RandomSampler(range(n), num_samples=n + 1))[0] == 1
    for sampler in (
        RandomSampler(range(n), replacement=True, num_samples=n + 5),
        RandomSampler(range(n), replacement=False, num_samples=n + 5),
    ):
        assert len(sampler) == n + 5 == sum(1 for _ in sampler)
        assert len(DataLoader(range(n), sampler=sampler)) == n + 5
        assert len(DataLoader(range(n), batch_size=6, sampler=sampler)) == math.ceil((n + 5) / 6)
    with pytest.raises(TypeError, match="replacement"):
        RandomSampler(range(n), replacement=0)  # type: ignore[arg-type]


SAMPLERS_OF_THE_GLOBAL_GENERATOR: dict[str, Callable[[Any], Any]] = {
    "with replacement": lambda m: m.RandomSampler(range(10), num_samples=5, replacement=True),
    "without replacement": lambda m: m.RandomSampler(range(10), replacement=False),
    "more samples than data": lambda m: m.RandomSampler(range(10), num_samples=25),
}


@pytest.mark.parametrize(
    "make", SAMPLERS_OF_THE_GLOBAL_GENERATOR.values(), ids=SAMPLERS_OF_THE_GLOBAL_GENERATOR.keys()
)
@pytest.mark.parametrize("module", [tud, aioloader], ids=["torch", "aioloader"])
def test_an_unseeded_random_sampler_repeats_after_torch_manual_seed(
    module: Any, make: Callable[[Any], Any]
) -> None:
    # torch's test_sampler_reproducibility: samplers given no generator draw from torch's
    # global one, so the same torch.manual_seed gives the same orders.
    torch.manual_seed(0)
    first = list(make(module)) + list(make(module))
    torch.manual_seed(0)
    assert list(make(module)) + list(make(module)) == first
    torch.manual_seed(0)
    interleaved = [iter(make(module)), iter(make(module))]
    assert [i for it in interleaved for i in it] == first


@pytest.mark.parametrize("num_workers", WORKERS)
def test_shuffle_without_a_seed_repeats_after_torch_manual_seed(num_workers: int) -> None:
    def orders(make: Callable[..., Any]) -> list[Any]:
        torch.manual_seed(3)
        loader = make(Indexed(12), batch_size=4, shuffle=True, num_workers=num_workers)
        try:
            return [[b.tolist() for b in loader] for _ in range(2)]
        finally:
            if isinstance(loader, DataLoader):
                loader.close()

    for make in (tud.DataLoader, DataLoader):
        first = orders(make)
        assert orders(make) == first
        assert first[0] != first[1]  # each epoch its own order


def test_random_sampler_with_a_seeded_generator_is_reproducible() -> None:
    def draw() -> list[int]:
        return list(RandomSampler(range(10), generator=torch.Generator().manual_seed(42)))

    assert draw() == draw()
    assert sorted(draw()) == list(range(10))


def test_distributed_sampler_refuses_a_bad_rank_and_shards_without_duplicates() -> None:
    for rank in (3, -1):
        with pytest.raises(ValueError, match="rank"):
            DistributedSampler(range(10), num_replicas=3, rank=rank)
    seen: list[int] = []
    for rank in range(4):
        sampler = DistributedSampler(range(9), num_replicas=4, rank=rank, drop_last=True)
        for batch in load(range(9), batch_size=2, drop_last=True, sampler=sampler):
            seen += batch.tolist()
    assert len(seen) == len(set(seen)) == 8


# -- lambdas and local functions reach the workers (issue #35, item 2) ---------------------------


class _Applies(tud.Dataset[Any]):
    """Sample ``i`` is ``fn(i)``: ``fn`` may be a lambda held by the dataset."""

    def __init__(self, n: int, fn: Callable[[int], Any]) -> None:
        self.n, self.fn = n, fn

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return self.fn(index)


def _local_callables() -> dict[str, Any]:
    """A collate_fn, worker_init_fn and dataset function written as users write them: lambdas
    and local functions closing over local values."""
    scale = 3
    seen: list[int] = []

    def init(worker_id: int) -> None:  # a local function
        seen.append(worker_id)

    return {
        "collate_fn": lambda batch: [x * scale for x in batch],
        "worker_init_fn": init,
        "fn": lambda i: i + scale,
    }


def test_lambdas_and_local_functions_work_with_workers_as_in_torch() -> None:
    """torch's forked workers inherit them; ours get them by value. Same batches either way."""
    parts = _local_callables()
    fn = parts.pop("fn")
    theirs = list(tud.DataLoader(_Applies(10, fn), batch_size=4, num_workers=2, **parts))
    ours = load(_Applies(10, fn), batch_size=4, num_workers=2, **parts)
    assert ours == theirs == [[9, 12, 15, 18], [21, 24, 27, 30], [33, 36]]


def test_a_lambda_transform_reaches_the_workers() -> None:
    """``transform`` (aioloader's own) is sent the same way as collate_fn."""
    offset = 100
    got = load(Indexed(6), batch_size=3, num_workers=2, transform=lambda x: x + offset)
    assert [b.tolist() for b in got] == [[100, 101, 102], [103, 104, 105]]


def test_a_lambda_closing_over_a_lock_is_refused_naming_it() -> None:
    """What cannot travel at all (a lock, an open file) is still refused, at construction, with
    its type; torch's forked workers would inherit a copy of it (unlocked or not)."""
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"^collate_fn=.* cannot be sent.*'_thread.lock'"):
        DataLoader(Indexed(6), num_workers=2, collate_fn=lambda b: (lock, b)[1])


# -- multiprocessing_context="fork" -----------------------------------------------------------
#
# Each runs a script in a fresh interpreter: whether a fork is safe depends on the threads the
# process runs, which a test process shared with other tests does not control.

_FORK_SCRIPT_S = 120.0

_FORK_PRELUDE = """
import os, sys, threading, warnings
warnings.simplefilter("always")
import psutil
import torch
import torch.utils.data as tud
import aioloader
import fork_program
from fork_program import Program


def parents(pids):
    return {psutil.Process(pid).ppid() for pid in pids}


def fork_warnings(caught):
    return [str(w.message) for w in caught if "multiprocessing_context='fork'" in str(w.message)]
"""


def _fork_script(body: str, tmp_path: Any) -> list[str]:
    """Run ``body`` after :data:`_FORK_PRELUDE` in a fresh interpreter (bounded: a hang fails);
    its printed lines."""
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    path = Path(tmp_path) / "fork_script.py"
    path.write_text(_FORK_PRELUDE + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests)]))
    proc = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=_FORK_SCRIPT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_fork_workers_see_the_program_as_it_is_when_the_epoch_begins(tmp_path: Any) -> None:
    """torch forks its workers as its iterator is made: a dataset changed after the loader was
    made, and the program's state (a module's global, which a worker imports rather than gets
    sent), are seen as they are then. aioloader's 'fork' workers are forked from the program
    itself as the first epoch begins, where no other thread runs: the same batches, no
    warning."""
    lines = _fork_script(
        """
        if __name__ == "__main__":
            got = {}
            for name, make in (("torch", tud.DataLoader), ("aioloader", aioloader.DataLoader)):
                fork_program.STATE = "at construction"
                ds = Program()
                loader = make(ds, batch_size=2, num_workers=2, multiprocessing_context="fork")
                ds.tag, fork_program.STATE = "changed", "set before the epoch"
                with warnings.catch_warnings(record=True) as caught:
                    got[name] = [list(b) for b in loader]
                    if name == "aioloader":
                        pids = loader.worker_pids
                        print("forked from the program", parents(pids) == {os.getpid()})
                        print("fork warnings", len(fork_warnings(caught)))
                        loader.close()
            print("same", got["torch"] == got["aioloader"])
            print(got["aioloader"])
        """,
        tmp_path,
    )
    assert lines[:3] == ["forked from the program True", "fork warnings 0", "same True"], lines
    assert lines[3] == str([["changed/set before the epoch"] * 2] * 2)


def test_fork_while_a_thread_runs_falls_back_with_one_warning_saying_why(tmp_path: Any) -> None:
    """A process forked while another thread holds a lock can hang on it for ever (torch's
    'fork' takes that risk). aioloader's does not: with a thread of the program running, the
    workers start from the safe start method, and one warning per process says why; every
    batch comes, from this loader and the next, and nothing hangs."""
    lines = _fork_script(
        """
        if __name__ == "__main__":
            stop = threading.Event()
            busy = threading.Thread(target=stop.wait, name="program-thread")
            busy.start()
            try:
                with warnings.catch_warnings(record=True) as caught:
                    batches = []
                    for _ in range(2):  # two loaders: still one warning
                        ds = Program()
                        with aioloader.DataLoader(
                            ds, batch_size=2, num_workers=2, multiprocessing_context="fork"
                        ) as loader:
                            batches += [list(b) for b in loader]
                            pids = loader.worker_pids
                            print("forked from the program", parents(pids) == {os.getpid()})
            finally:
                stop.set()
                busy.join()
            said = fork_warnings(caught)
            print("batches", len(batches))
            print("fork warnings", len(said))
            print(said[0])
        """,
        tmp_path,
    )
    assert lines[:4] == [
        "forked from the program False",
        "forked from the program False",
        "batches 4",
        "fork warnings 1",
    ], lines
    assert "other threads run ('program-thread')" in lines[4], lines[4]
    assert "allow_fork=True" in lines[4]


def test_fork_while_a_daemon_thread_of_the_program_runs_falls_back_too(tmp_path: Any) -> None:
    """A daemon thread of the program may hold a lock that the workers' code takes (here the
    dataset's): workers forked from the program then would wait on their copy of it for ever
    (the batch deadline, 15 s, bounds that here). They start from the safe start method
    instead (the server forked as the loader was made, before the thread took the lock), with
    the warning naming the thread; every batch comes."""
    lines = _fork_script(
        """
        if __name__ == "__main__":
            held = threading.Event()

            def hold():
                with fork_program.LOCK:  # held for the rest of the program
                    held.set()
                    threading.Event().wait()

            with warnings.catch_warnings(record=True) as caught:
                loader = aioloader.DataLoader(
                    fork_program.Locked(), batch_size=2, num_workers=2,
                    multiprocessing_context="fork", timeout=15,
                )
                threading.Thread(target=hold, name="program-daemon", daemon=True).start()
                assert held.wait(10)
                try:
                    print("batches", [b.tolist() for b in loader])
                    print("forked from the program", parents(loader.worker_pids) == {os.getpid()})
                except Exception as exc:
                    print("failed", type(exc).__name__)
                finally:
                    loader.close()
            said = fork_warnings(caught)
            print("fork warnings", len(said))
            print(said[0] if said else "")
        """,
        tmp_path,
    )
    assert lines[:3] == [
        "batches [[0, 1], [2, 3]]",
        "forked from the program False",
        "fork warnings 1",
    ], lines
    assert "other threads run ('program-daemon')" in lines[3], lines[3]


def test_fork_under_async_for_forks_and_off_the_loop_falls_back_and_allow_fork_forks(
    tmp_path: Any,
) -> None:
    """``async for`` begins its epoch on the event loop's thread, the main one: the workers are
    forked from the program there. ``async with`` starts them off the loop, on a thread: no
    safe fork there, so they start from the safe start method (warned once).
    ``allow_fork=True`` keeps its meaning: fork even so, at the caller's risk, with no
    warning."""
    lines = _fork_script(
        """
        import asyncio

        async def epoch(start=False, **settings):
            loader = aioloader.DataLoader(
                Program(), batch_size=2, num_workers=2, multiprocessing_context="fork", **settings
            )
            if start:
                await loader.__aenter__()
            try:
                got = [list(b) async for b in loader]
                return got, parents(loader.worker_pids) == {os.getpid()}
            finally:
                await loader.aclose()

        if __name__ == "__main__":
            with warnings.catch_warnings(record=True) as caught:
                got, forked = asyncio.run(epoch())
                print("async for:", len(got), "forked from the program", forked)
                print("fork warnings", len(fork_warnings(caught)))
            with warnings.catch_warnings(record=True) as caught:
                got, forked = asyncio.run(epoch(start=True))
                print("async with:", len(got), "forked from the program", forked)
                print("fork warnings", len(fork_warnings(caught)))
                print("said", "from a thread" in fork_warnings(caught)[0])
            with warnings.catch_warnings(record=True) as caught:
                got, forked = asyncio.run(epoch(start=True, allow_fork=True))
                print("allow_fork:", len(got), "forked from the program", forked)
                print("fork warnings", len(fork_warnings(caught)))
        """,
        tmp_path,
    )
    assert lines == [
        "async for: 2 forked from the program True",
        "fork warnings 0",
        "async with: 2 forked from the program False",
        "fork warnings 1",
        "said True",
        "allow_fork: 2 forked from the program True",
        "fork warnings 0",
    ], lines
