"""One ``for`` iterator shared by threads (_threads._loop.SyncIterator): each batch goes to
exactly one caller, never lost, never an internal error (RELIABILITY.md row 40).

A producer thread beside the training loop, or two threads pulling from one epoch, call
``next()`` on one iterator at once. The iterator serves them one at a time; a ``next()`` from
inside ``next()`` in the same thread is refused, as a generator refuses it. Every wait here is
bounded.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest
from datasets import Range, Slow
from helpers import BOUND_S

from aioloader import DataLoader

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

N, SIZE, EPOCHS = 40, 2, 3


def pull_from(it: Any, threads: int) -> tuple[list[int], list[BaseException]]:
    """Every sample ``threads`` threads take from ``it`` until it ends, and their errors."""
    samples: list[int] = []  # list.extend of a list is atomic under the GIL
    errors: list[BaseException] = []

    def pull() -> None:
        try:
            for batch in it:
                samples.extend(int(i) for i in batch)
        except BaseException as exc:  # an internal error must fail the test, not the thread
            errors.append(exc)

    workers = [threading.Thread(target=pull, name=f"consumer-{k}") for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(BOUND_S)
    assert not any(w.is_alive() for w in workers), "a consumer thread still waits"
    return samples, errors


@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_threads_on_one_iterator_share_the_epoch_and_lose_no_batch(num_workers: int) -> None:
    # num_workers=0 lost one whole batch with no error (the epoch made in both threads at
    # once); with workers the second thread got an internal AttributeError ('NoneType' object
    # has no attribute 'raised_last') as the first ended the epoch.
    with DataLoader(Slow(N, 0.001), batch_size=SIZE, num_workers=num_workers) as loader:
        for _ in range(EPOCHS):
            samples, errors = pull_from(iter(loader), threads=2)
            assert errors == []
            assert Counter(samples) == Counter(range(N))  # each batch once, to one thread


def test_next_from_inside_next_in_the_same_thread_is_refused() -> None:
    # It would wait for itself; refused as a generator refuses it, as that batch's error.
    class Reentrant(Range):
        it: Any = None

        def __getitem__(self, index: int) -> int:
            if index == 2:
                next(self.it)
            return index

    dataset = Reentrant(6)
    with DataLoader(dataset, batch_size=SIZE) as loader:
        dataset.it = it = iter(loader)
        assert next(it).tolist() == [0, 1]
        with pytest.raises(ValueError, match="already executing next"):
            next(it)
        assert [b.tolist() for b in it] == [[4, 5]]  # the epoch goes on after that batch
