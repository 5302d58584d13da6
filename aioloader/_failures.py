"""The skip budget of one epoch (``on_error='skip'`` with ``max_failures``).

Samples that fail to read, fetch, decode or transform are skipped and recorded here; once more
have failed than ``max_failures`` allows (a count, or a fraction of the samples seen so far),
:meth:`FailureBudget.over` returns the :class:`TooManyFailuresError` to deliver in place of the
batch that crossed it. A pure state machine: no IO, no loop, testable alone.
"""

from __future__ import annotations

import logging

from ._errors import TooManyFailuresError
from ._log import epoch_log
from ._stats import Counters

__all__ = ["FailureBudget"]


class FailureBudget:
    """Counts samples seen and skipped in one epoch against ``max_failures``.

    Args:
        max_failures: a count (``>= 1``, or 0 for none) or a fraction (``0 < f < 1``) of the
            samples seen.
        counters: the loader's live statistics (skips are reported there too).
    """

    def __init__(self, max_failures: float, counters: Counters) -> None:
        self.max_failures = max_failures
        self._counters = counters
        self.failures = 0
        self.seen = 0

    def record(self, delivered: int, skipped: list[tuple[int, str]]) -> None:
        """Count a batch's ``delivered`` samples and its ``skipped`` ``(index, reason)``."""
        self.seen += delivered + len(skipped)
        if skipped:
            self.failures += len(skipped)
            self._counters.skip(skipped)
            if epoch_log.isEnabledFor(logging.WARNING):
                for index, reason in skipped:
                    epoch_log.warning("skipped sample index %d: %s", index, reason)

    def over(self) -> TooManyFailuresError | None:
        """The error to raise if more samples failed than allowed, else ``None``."""
        limit = self.max_failures
        allowed = limit if limit >= 1 else limit * max(self.seen, 1)
        if self.failures <= allowed:
            return None
        return TooManyFailuresError(
            f"{self.failures} samples failed out of {self.seen} seen, more than "
            f"max_failures={limit}; the last ones: {self._counters.skipped[-3:]}"
        )
