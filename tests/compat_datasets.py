"""Datasets, collate functions and worker_init_fns written the way torch users write them, for
``test_torch_compat``: each mirrors a behaviour that torch's own DataLoader tests check.

Defined at module level so that worker processes can unpickle them by reference (workers import
this module by name). Several subclass ``torch.utils.data.Dataset`` or ``IterableDataset`` on
purpose: the loader must take torch's classes as they are.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

import aioloader

# How long a read that should be interrupted sleeps at most: it only turns a hang into a failure.
HANG_S = 30.0


class Indexed(tud.Dataset[int]):
    """``dataset[i] == i``, as a torch ``Dataset`` subclass (torch's ``CountingDataset``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return index


class NoGetItem(tud.Dataset[int]):
    """A torch ``Dataset`` with a length and no ``__getitem__``: every read raises torch's
    ``NotImplementedError`` (torch's ``ErrorDataset``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class Counting(tud.IterableDataset[int]):
    """``0 .. n-1`` as a torch ``IterableDataset`` that also knows its length; it does not shard
    itself (torch's ``CountingIterableDataset``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class NoLength(tud.IterableDataset[int]):
    """A stream with no ``__len__``."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


class PerWorker(tud.IterableDataset[int]):
    """Worker ``k`` yields ``range(sizes[k])``: sharded by the worker info, as torch's
    ``WorkerSpecificIterableDataset``. ``torch_info`` asks torch's ``get_worker_info`` (what
    code written for torch does); otherwise aioloader's."""

    def __init__(self, sizes: list[int], *, torch_info: bool = False) -> None:
        self.sizes = sizes
        self.torch_info = torch_info

    def __iter__(self) -> Iterator[int]:
        info = tud.get_worker_info() if self.torch_info else aioloader.get_worker_info()
        if info is None:
            raise RuntimeError("PerWorker runs in worker processes only")
        yield from range(self.sizes[info.id])

    def __len__(self) -> int:
        return sum(self.sizes)


class WorkerIds(tud.IterableDataset[int]):
    """Each worker yields its id ``length // num_workers`` times (torch's
    ``TestMultiEpochDataset``)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self) -> Iterator[int]:
        info = aioloader.get_worker_info()
        if info is None:
            raise RuntimeError("WorkerIds runs in worker processes only")
        for _ in range(self.length // info.num_workers):
            yield info.id


class BrokenIter(tud.IterableDataset[int]):
    """``iter()`` raises at once (torch's ``ErrorIterableDataset``)."""

    def __iter__(self) -> Iterator[int]:
        raise RuntimeError("Error in __iter__")


class Segfault(Indexed):
    """Reads address 0: the worker process dies of SIGSEGV (torch's ``SegfaultDataset``)."""

    def __getitem__(self, index: int) -> int:
        return len(ctypes.string_at(0))


class HangsAt(Indexed):
    """Reading index ``bad`` sleeps far past any deadline; only a kill ends it."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, index: int) -> int:
        if index == self.bad:
            time.sleep(HANG_S)
        return super().__getitem__(index)


class Seeds(Indexed):
    """Returns ``torch.initial_seed()``: the seed torch's generator had when the read ran, as
    text (a seed may not fit int64) or as the int itself (torch's ``SeedDataset``)."""

    def __init__(self, n: int, *, as_text: bool = True) -> None:
        super().__init__(n)
        self.as_text = as_text

    def __getitem__(self, index: int) -> Any:
        seed = torch.initial_seed()
        return str(seed) if self.as_text else seed


class WhereAmI(Indexed):
    """Returns what a worker knows of itself: (worker id, num_workers, pid, the id a
    ``worker_init_fn`` stored on this copy of the dataset, whether torch's get_worker_info
    answers)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.init_id = -1

    def worker_init_fn(self, worker_id: int) -> None:  # a bound method, as torch's test uses
        self.init_id = worker_id

    def __getitem__(self, index: int) -> Any:
        info = aioloader.get_worker_info()
        if info is None:
            return (-1, 0, os.getpid(), self.init_id, False)
        return (info.id, info.num_workers, os.getpid(), self.init_id, info.dataset is self)


class StartedAt(Indexed):
    """Returns its ``start`` attribute: shows which copy of the dataset a read saw."""

    start = 0

    def __getitem__(self, index: int) -> int:
        return self.start


class Sets(Indexed):
    """``{i}``: a type collation does not support."""

    def __getitem__(self, index: int) -> Any:
        return {index}


class Arrays(Indexed):
    """``np.ones((2, 3, 4)) * i`` (torch's ``test_numpy``)."""

    def __getitem__(self, index: int) -> Any:
        return np.ones((2, 3, 4)) * index


class Scalars(Indexed):
    """A numpy scalar of ``dtype`` (torch's ``ScalarDataset``)."""

    def __init__(self, n: int, dtype: type[np.generic]) -> None:
        super().__init__(n)
        self.dtype = dtype

    def __getitem__(self, index: int) -> Any:
        return self.dtype(index)


class Dicts(Indexed):
    """Nested dicts (torch's ``DictDataset``)."""

    def __getitem__(self, index: int) -> Any:
        return {"a_tensor": torch.full((4, 2), float(index)), "another_dict": {"a_number": index}}


class Strings(Indexed):
    """``(character, index)`` pairs (torch's ``StringDataset``)."""

    def __getitem__(self, index: int) -> Any:
        return ("12345"[index], index)


Batch = namedtuple("Batch", ["data", "label", "random_tensor"])
Data = namedtuple("Data", ["positive", "negative"])


class NamedTuples(Indexed):
    """Nested namedtuples (torch's ``NamedTupleDataset``)."""

    def __getitem__(self, index: int) -> Any:
        return Batch(Data(index, -index), str(index), torch.full((3,), float(index)))


class Rows(Indexed):
    """Row ``i`` of a ``(n, length)`` float tensor whose rows hold their index."""

    def __init__(self, n: int, length: int) -> None:
        super().__init__(n)
        self.length = length

    def __getitem__(self, index: int) -> Any:
        return (torch.full((self.length,), float(index)), index)


class BulkIndexed(Indexed):
    """``dataset[list_of_indices]`` returns them as one tensor (torch's ``BulkLoadingDataset``):
    for a sampler that yields whole batches of indices, with no collation."""

    def __getitem__(self, indices: Any) -> Any:
        if not isinstance(indices, list | tuple):
            raise TypeError(f"expected a list of indices, got {indices!r}")
        return torch.as_tensor(indices)


def lengths_of(batch_size: int, steps: int) -> torch.Tensor:
    """Deterministic sequence lengths in ``1 .. steps`` for a batch (torch's test draws them)."""
    return torch.tensor([steps - (i * 7) % steps for i in range(batch_size)], dtype=torch.int64)


def collate_into_packed_sequence(samples: list[Any]) -> PackedSequence:
    """``Rows`` samples packed into a ``PackedSequence``, time first (torch's collate of the
    same name)."""
    data = torch.stack([row for row, _ in samples], 1)
    steps, batch = data.shape
    return pack_padded_sequence(data, lengths_of(batch, steps), enforce_sorted=False)


def collate_into_packed_sequence_batch_first(samples: list[Any]) -> PackedSequence:
    """As :func:`collate_into_packed_sequence`, batch first."""
    data = torch.stack([row for row, _ in samples], 0)
    batch, steps = data.shape
    lengths = lengths_of(batch, steps)
    return pack_padded_sequence(data, lengths, batch_first=True, enforce_sorted=False)


class CustomBatch:
    """A batch type of the user's own (torch's ``SimpleCustomBatch``): not a container."""

    def __init__(self, samples: list[Any]) -> None:
        self.inp = torch.stack([row for row, _ in samples])
        self.tgt = torch.tensor([index for _, index in samples])


def collate_into_custom_batch(samples: list[Any]) -> CustomBatch:
    return CustomBatch(samples)


def seed_12345(worker_id: int) -> None:
    """A worker_init_fn that seeds torch (torch's ``init_fn``)."""
    torch.manual_seed(12345)


def failing_init(worker_id: int) -> None:
    raise RuntimeError("Error in worker_init_fn")


class CustomDict(dict[str, Any]):
    pass


class CustomList(list[Any]):
    pass
