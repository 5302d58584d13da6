"""An event loop whose clock moves only by skipping idle waits, for unit tests of deadlines that
take no real time.

Deadlines here run on the loop's clock (``asyncio.timeout``, ``asyncio.wait(timeout=)``,
``call_later``, ``loop.time()``). :class:`SkippingLoop`'s clock stands still while the loop
works, and whenever the loop would wait for its next timer with nothing to do, it jumps to that
timer at once: a test of a 30 s deadline takes microseconds, and the times it reads (elapsed
time in an error, a batch's served time) are exact, whatever the machine's load.

Only for tests whose every actor is on the loop (fakes and futures the test settles, async
datasets that ``await asyncio.sleep``): a thread or process working meanwhile would see the
loop's time race ahead of it. ``grace_s`` bounds that where a helper thread takes part: the
loop first waits that long, really, for a thread's result before it jumps (a thread stalled
longer than ``grace_s`` at each look of a deadline is then late by the loop's clock).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: The ``grace_s`` of a test whose batches a loader's helper thread makes: a thread stalled that
#: long at each of a deadline's looks would be late by the loop's clock (8 looks: 0.4 s).
THREAD_GRACE_S = 0.05

#: How long the loop waits, for real, when it has nothing to do and no timer set (a thread's
#: result may come): a test that waits longer waits for ever.
IDLE_BOUND_S = 10.0


class _SkippingSelector(selectors.DefaultSelector):
    def __init__(self, grace_s: float) -> None:
        super().__init__()
        self.grace_s = grace_s
        self.now = 0.0  # the loop's clock: seconds skipped, in all

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # no timer: only a thread or a descriptor can wake the loop
            events = super().select(IDLE_BOUND_S)
            if not events:
                raise RuntimeError(f"the loop had nothing to do for {IDLE_BOUND_S} s: a hang")
            return events
        events = super().select(min(timeout, self.grace_s))
        if not events:
            self.now += timeout  # idle until the next timer: it is due now
        return events


class SkippingLoop(asyncio.SelectorEventLoop):
    """A stock asyncio loop whose clock moves by skipping idle waits (the module docstring)."""

    def __init__(self, grace_s: float = 0.0) -> None:
        self._skipping = _SkippingSelector(grace_s)
        super().__init__(self._skipping)

    def time(self) -> float:
        return self._skipping.now


def run_skipping(main: Coroutine[Any, Any, T], *, grace_s: float = 0.0) -> T:
    """Run ``main`` on a fresh :class:`SkippingLoop` and close it."""
    with asyncio.Runner(loop_factory=lambda: SkippingLoop(grace_s)) as runner:
        return runner.run(main)
