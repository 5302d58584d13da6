"""What training frameworks read and write on a loader, outside the training loop.

accelerate's ``skip_first_batches`` builds a torch DataLoader from a loader's settings read
by torch's names, over its ``batch_sampler`` after ``loader.set_epoch(epoch)``: that torch
loader must yield the loader's batches. Lightning assigns ``worker_init_fn`` (after
``seed_everything(workers=True)``), the one setting that stays assignable.
"""

from __future__ import annotations

import threading

import pytest
import torch
from datasets import Range
from framework_data import WorkerMarks, mark_worker
from helpers import as_lists

import aioloader


def test_a_torch_dataloader_built_from_its_settings_yields_its_batches() -> None:
    # What accelerate's skip_first_batches does, minus the skipping.
    with aioloader.DataLoader(Range(23), batch_size=4, shuffle=True, seed=5) as loader:
        loader.set_epoch(2)  # the batch sampler moves to epoch 2 at once
        rebuilt = torch.utils.data.DataLoader(
            loader.dataset,
            batch_sampler=loader.batch_sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            prefetch_factor=loader.prefetch_factor,
            in_order=loader.in_order,
        )
        torch_batches = as_lists(list(rebuilt))
        loader.set_epoch(2)
        assert as_lists(list(loader)) == torch_batches


def test_worker_init_fn_set_before_the_workers_start_reaches_them() -> None:
    loader = aioloader.DataLoader(WorkerMarks(), batch_size=2, num_workers=2)
    try:
        assert loader.worker_init_fn is None
        loader.worker_init_fn = mark_worker  # as Lightning does after seed_everything(...)
        assert loader.worker_init_fn is mark_worker
        marks = {int(mark) for batch in loader for mark in batch}
    finally:
        loader.close()
    assert marks <= {0, 1}


@pytest.mark.parametrize("persistent", [False, True])
def test_a_new_worker_init_fn_runs_with_the_next_dataset_copy(persistent: bool) -> None:
    # As torch's: without persistent workers, the next epoch's workers run it; with them, the
    # workers (here: their dataset copy, loaded once) keep the function they started with.
    with aioloader.DataLoader(
        WorkerMarks(), batch_size=2, num_workers=2, persistent_workers=persistent
    ) as loader:
        first = {int(mark) for batch in loader for mark in batch}
        loader.worker_init_fn = mark_worker
        second = {int(mark) for batch in loader for mark in batch}
    assert first == {-1}
    assert second == ({-1} if persistent else {0, 1})


# A lambda travels to the workers by value; one holding a lock cannot travel at all.
_LOCK = threading.Lock()


@pytest.mark.parametrize(
    ("value", "message"),
    [(5, "worker_init_fn must be callable"), (lambda i: _LOCK, "cannot be sent to worker")],
)
def test_worker_init_fn_setter_checks_the_value(value: object, message: str) -> None:
    loader = aioloader.DataLoader(Range(4), num_workers=1)
    try:
        with pytest.raises(TypeError, match=message):
            loader.worker_init_fn = value  # type: ignore[assignment]
        assert loader.worker_init_fn is None  # unchanged
    finally:
        loader.close()
