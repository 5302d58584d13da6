"""The skip budget of one epoch (``on_error='skip'`` with ``max_failures``).

Samples that fail to read, fetch, decode or transform are skipped and recorded here; once more
have failed than ``max_failures`` allows, :meth:`FailureBudget.over` returns the
:class:`TooManyFailuresError` to deliver in place of the batch that crossed it. A pure state
machine: no IO, no loop, testable alone.

What a fraction is a fraction of: the epoch. With an epoch of known length (map-style data: the
sampler's length), ``max_failures=0.05`` allows 5% of that length to fail, so the error comes as
soon as the count is certain to end over it, and never from a few early failures (1 failure in
the first 17 samples of an epoch of 1,000 is well inside 0.05). An iterable dataset's length is
unknown until it ends: there the fraction is of the samples seen so far, and at least one
failure is always allowed (a single failure in the first few samples says nothing about a rate).

The error names the batch that crossed the budget, every index skipped in the epoch, and the
samples of that batch that were read successfully but are not delivered with it (by index where
the batch's indices are known), so no sample vanishes unnamed.

The budget is of the epoch, whatever interrupts it: a resumed epoch starts from the count of the
batches taken before its state was saved (:class:`~aioloader._types.SkipsTaken`, the state's
``"failures"``), and crosses it at the batch an uninterrupted epoch would. The count follows
what the consumer took, not what was made: batches made ahead and not taken are made again
after the resume, and counted then. Each batch's count is kept by batch id until the consumer
takes it (:meth:`FailureBudget.took`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .._errors import TooManyFailuresError
from .._log import epoch_log
from .._stats import Counters
from .._types import SkipsTaken

__all__ = ["MESSAGE_INDICES", "FailureBudget"]

#: Indices listed in the error's message (all of them are in its ``skipped`` attribute): a
#: message long enough to name every skip of any real budget, short enough to print.
MESSAGE_INDICES = 1000


class FailureBudget:
    """Counts samples seen and skipped in one epoch against ``max_failures``.

    Args:
        max_failures: a count (``>= 1``, or 0 for none) or a fraction (``0 < f < 1``) of the
            epoch (see the module docstring).
        counters: the loader's live statistics (skips are reported there too).
        epoch_samples: the epoch's length in samples, or None where it is unknown (an iterable
            dataset): a fraction is then of the samples seen so far.
        taken: the count of the batches taken so far (a resumed epoch's, from its state): the
            budget starts from it, and adds each batch to it as it is taken (:meth:`took`).
    """

    def __init__(
        self,
        max_failures: float,
        counters: Counters,
        epoch_samples: int | None = None,
        taken: SkipsTaken | None = None,
    ) -> None:
        self.max_failures = max_failures
        self.epoch_samples = epoch_samples
        self._counters = counters
        self._taken = taken if taken is not None else SkipsTaken()
        self.seen = self._taken.seen
        # Every index skipped in this epoch, in the order seen (those before a resume first).
        self.skipped: list[Any] = list(self._taken.skipped)
        self.failures = len(self.skipped)
        self._last_reason = ""
        # batch id -> (samples seen, indices skipped) of the batches counted and not yet taken.
        self._batches: dict[int, tuple[int, list[Any]]] = {}

    def record(
        self, delivered: int, skipped: list[tuple[int, str]], batch_id: int | None = None
    ) -> None:
        """Count a batch's ``delivered`` samples and its ``skipped`` ``(index, reason)``;
        ``batch_id``'s count is kept until the consumer takes it (None: never taken, as in a
        test of the budget alone)."""
        self.seen += delivered + len(skipped)
        if batch_id is not None:
            seen, indices = self._batches.get(batch_id, (0, []))
            indices.extend(index for index, _ in skipped)
            self._batches[batch_id] = (seen + delivered + len(skipped), indices)
        if skipped:
            self.failures += len(skipped)
            self.skipped.extend(index for index, _ in skipped)
            self._last_reason = skipped[-1][1]
            self._counters.skip(skipped)
            if epoch_log.isEnabledFor(logging.WARNING):
                for index, reason in skipped:
                    epoch_log.warning("skipped sample index %s: %s", index, reason)  # a key too

    def took(self, batch_id: int) -> None:
        """The consumer took ``batch_id`` (its batch, its error or an empty batch): its count is
        now part of what a resumed epoch starts from."""
        seen, indices = self._batches.pop(batch_id, (0, []))
        self._taken.seen += seen
        self._taken.skipped.extend(indices)

    @property
    def allowed(self) -> float:
        """How many failures this epoch may have (so far, for an epoch of unknown length)."""
        limit = self.max_failures
        if limit >= 1 or limit == 0:
            return limit
        if self.epoch_samples is not None:
            return limit * self.epoch_samples
        return max(1.0, limit * self.seen)

    def over(
        self,
        batch_id: int | None = None,
        read: Sequence[int] | int = (),
    ) -> TooManyFailuresError | None:
        """The error to raise if more samples failed than allowed, else ``None``.

        Args:
            batch_id: the batch that is being made (named in the error).
            read: that batch's samples read successfully, which the error replaces: their
                indices, or only how many there are where the indices are unknown (streams).
        """
        allowed = self.allowed
        if self.failures <= allowed:
            return None
        limit = self.max_failures
        if limit >= 1 or limit == 0:
            rule = f"max_failures={limit:g} allows {limit:g}"
        elif self.epoch_samples is not None:
            rule = (
                f"max_failures={limit:g} of this epoch's {self.epoch_samples} samples allows "
                f"{allowed:g}"
            )
        else:
            rule = (
                f"max_failures={limit:g} of the {self.seen} samples seen so far (the epoch's "
                f"length is unknown) allows {allowed:g}"
            )
        shown = self.skipped[:MESSAGE_INDICES]
        more = len(self.skipped) - len(shown)
        indices = f"{shown}" + (f" and {more} more (all in .skipped)" if more else "")
        where = f"batch {batch_id}" if batch_id is not None else "a batch"
        if isinstance(read, int):
            lost = f"; its {read} sample(s) read successfully are not delivered" if read else ""
        else:
            lost = (
                f"; its samples read successfully, not delivered: indices {list(read)}"
                if read
                else ""
            )
        return TooManyFailuresError(
            f"{where} crossed the skip budget: {self.failures} samples failed out of "
            f"{self.seen} seen, and {rule}. Skipped indices in this epoch: {indices} (the last "
            f"failure: {self._last_reason}){lost}",
            batch_id=batch_id,
            skipped=list(self.skipped),
            undelivered=read if isinstance(read, int) else list(read),
        )
