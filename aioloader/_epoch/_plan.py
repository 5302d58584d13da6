"""The plan of a map-style epoch: its ``(batch_id, indices)`` pairs, read lazily from the
batch sampler as the producer schedules them (:mod:`._produce`), without the batches a resumed
epoch already took. Its own module: the consumer side (:mod:`._consume`) holds it, the loader
makes it (:mod:`.._loader._dataloader`)."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Collection, Iterator
from typing import Any

from .._config import Sampling

__all__ = ["Plan", "plan_for"]


class Plan:
    """The ``(batch_id, indices)`` pairs of a map-style epoch still to schedule.

    Read lazily from the batch sampler, so an epoch of millions of samples starts at once.
    The batch sampler is the loader's, shared by its epochs: when a second epoch starts while
    this one is still being iterated (``zip(loader, loader)``, an evaluation pass in another
    task), :meth:`freeze` first reads the rest of this epoch's plan, so the new epoch's
    ``set_epoch`` cannot change it. A lock makes that safe from the thread of a sync iterator
    while the producer reads on the loop's thread.
    """

    def __init__(self, pairs: Iterator[tuple[int, Any]], samples: int | None = None) -> None:
        self._source = pairs
        self.samples = samples  # the whole epoch's length in samples, None where unknown
        self._rest: deque[tuple[int, Any]] | None = None
        self._lock = threading.Lock()

    def __iter__(self) -> Plan:
        return self

    def __next__(self) -> tuple[int, Any]:
        with self._lock:
            if self._rest is None:
                return next(self._source)
            if not self._rest:
                raise StopIteration
            return self._rest.popleft()

    def put_back(self, pair: tuple[int, Any]) -> None:
        """Make ``pair`` (read ahead, not produced) the next one read."""
        with self._lock:
            if self._rest is None:
                self._source = itertools.chain([pair], self._source)
            else:
                self._rest.appendleft(pair)

    def freeze(self) -> None:
        """Read the rest of the plan now (the batch sampler is about to move on)."""
        with self._lock:
            if self._rest is None:
                self._rest = deque(self._source)


def plan_for(sampling: Sampling, done: Collection[int]) -> Plan | None:
    """The plan of a map-style epoch (None for an iterable dataset), without the batches in
    ``done`` (resume). Each batch of a user's sampler is made plain ints as the producer reads
    it, so a bad one fails at its turn. Its length in samples is the index sampler's, where the
    sampler has one (the skip budget's fractions are of it)."""
    batches, check = sampling.batches, sampling.check
    if batches is None:
        return None
    pairs = enumerate(batches)
    return Plan(
        ((i, check(i, b) if check is not None else b) for i, b in pairs if i not in done),
        samples=_length(sampling.sampler),
    )


def _length(sampler: Any) -> int | None:
    try:
        return len(sampler)
    except Exception:  # no __len__, or one that refuses (a sampler of unknown length)
        return None
