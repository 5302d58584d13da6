"""One batch (_batch), through the loader: reading (``dataset[i]`` or ``__getitems__``), the
transform, collation (``collate_fn``, ``batchify_fn``), and errors that keep their type and name
the batch and the sample.
"""

from __future__ import annotations

import pytest
import torch
from datasets import FailAt, Nested, Point, Range, fail_collate_on_7
from helpers import as_lists, drain, notes_of, take
from procs import no_worker_left_behind

from aioloader import DataLoader


def times_ten(sample: int) -> int:
    return sample * 10


# -- collation, collate_fn, batchify_fn, transform --------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
@no_worker_left_behind()
def test_nested_samples_collate_through_the_loader(num_workers: int) -> None:
    with DataLoader(Nested(7), batch_size=3, num_workers=num_workers) as loader:
        batches = list(loader)
    assert len(batches) == 3
    start = 0
    for batch in batches:
        count = len(batch["name"])
        ids = list(range(start, start + count))
        assert set(batch) == {"image", "label", "name", "pair", "point"}
        assert isinstance(batch["image"], torch.Tensor)
        assert batch["image"].shape == (count, 2, 3)
        assert batch["image"].dtype == torch.float32
        assert batch["image"][:, 0, 0].tolist() == ids
        assert batch["label"].tolist() == ids
        assert batch["label"].dtype == torch.int64
        assert batch["name"] == [f"item-{i}" for i in ids]
        assert isinstance(batch["pair"], list)  # tuples come back as lists, as in torch
        assert batch["pair"][0].tolist() == ids
        assert batch["pair"][1].tolist() == [i / 2 for i in ids]
        assert isinstance(batch["point"], Point)
        assert batch["point"].x.tolist() == ids
        assert batch["point"].y.tolist() == [-i for i in ids]
        start += count
    assert start == 7


def test_collate_fn_batchify_fn_and_transform() -> None:
    def tag(samples: list[int]) -> tuple[str, list[int]]:
        return ("custom", list(samples))

    tagged = [("custom", [0, 1]), ("custom", [2, 3]), ("custom", [4])]
    with DataLoader(Range(5), batch_size=2, collate_fn=tag) as loader:
        assert list(loader) == tagged
    with DataLoader(Range(5), batch_size=2, batchify_fn=tag) as loader:
        assert list(loader) == tagged
    with DataLoader(Range(5), batch_size=2, transform=times_ten) as loader:
        assert as_lists(list(loader)) == [[0, 10], [20, 30], [40]]
    with DataLoader(Range(5), batch_size=2, transform=times_ten, collate_fn=tag) as loader:
        # The transform runs on each sample, before collation.
        assert list(loader) == [("custom", [0, 10]), ("custom", [20, 30]), ("custom", [40])]
    with pytest.raises(ValueError, match="collate_fn or batchify_fn"):
        DataLoader(Range(5), collate_fn=tag, batchify_fn=list)


# -- reading a batch at once ------------------------------------------------------------------


class GetItems(Range):
    """Reads a whole batch at once, as torch's ``__getitems__`` convention allows."""

    def __getitems__(self, indices: list[int]) -> list[int]:
        return [i * 100 for i in indices]


class ShortGetItems(Range):
    def __getitems__(self, indices: list[int]) -> list[int]:
        return [0]  # one sample, whatever was asked


def test_getitems_reads_a_batch_at_once_and_a_wrong_count_is_an_error() -> None:
    with DataLoader(GetItems(6), batch_size=4) as loader:
        assert as_lists(list(loader)) == [[0, 100, 200, 300], [400, 500]]
    loader = DataLoader(ShortGetItems(6), batch_size=4)
    with loader, pytest.raises(ValueError, match="__getitems__ returned 1 samples for 4 indices"):
        list(loader)
    # Without automatic batching each sample is read alone, by dataset[i], as torch reads it
    # (a bulk path may decode or augment otherwise).
    for workers in (0, 2):
        with DataLoader(GetItems(3), batch_size=None, num_workers=workers) as loader:
            assert [int(sample) for sample in loader] == [0, 1, 2]


# -- errors keep their type and name the batch ------------------------------------------------


async def test_getitem_error_keeps_its_type_at_its_turn() -> None:
    loader = DataLoader(FailAt(12, {5}), batch_size=2, num_workers=3, thread_pool=True)
    got: list[list[int]] = []
    async with loader:
        it = aiter(loader)
        with pytest.raises(KeyError) as info:
            await drain(it, got)
        assert got == [[0, 1], [2, 3]]  # everything before the failing batch was delivered
        notes = notes_of(info.value)
        assert "sample index 5" in notes
        assert "batch 2" in notes
        assert "sample 5 is broken" in str(info.value)
        # The same iterator goes on with the batches after the failing one.
        assert as_lists(await take(it, 3)) == [[6, 7], [8, 9], [10, 11]]
        with pytest.raises(StopAsyncIteration):
            await anext(it)


async def test_collate_fn_error_keeps_its_type_and_names_the_batch() -> None:
    async with DataLoader(Range(10), batch_size=3, collate_fn=fail_collate_on_7) as loader:
        it = aiter(loader)
        assert await take(it, 2) == [[0, 1, 2], [3, 4, 5]]
        with pytest.raises(ValueError, match="cannot collate 7") as info:
            await anext(it)
        notes = notes_of(info.value)
        assert "batch 2" in notes
        assert "[6, 7, 8]" in notes
        assert await take(it, 1) == [[9]]
        assert await take(aiter(loader), 2) == [[0, 1, 2], [3, 4, 5]]  # a new epoch
