"""One batch on its way to the device, and how the event loop waits for it.

A :class:`Transfer` is what :meth:`DeviceStage.start` returns: a handle on the stage's record of
one copy, which it sees only through the small :class:`Copy` protocol. ``await wait()`` polls
the copy with an ``asyncio.sleep`` back-off (:func:`until_done`), then asks it to hand the device
batch over to the consumer's stream.

The dependency goes one way: ``_stage`` drives the copies and imports this module; this module
knows nothing of the stage, only the protocol it implements::

    DeviceStage.start(batch) ──▶ its record of the copy (implements Copy) ──▶ Transfer(record)
    Transfer.wait() ──▶ until_done(record.done) ──▶ record.hand_over(stream) ──▶ device batch

Sharp edges:

- The loop never blocks on the device: ``wait()`` polls ``done()``, which queries the copy's
  event; only the stage's cleanup paths (``close()``, unregistering memory) synchronize.
- Cancelling ``wait()`` loses nothing: the copy carries on and a later ``wait()`` returns the
  batch.
- The hand-over uses the *calling thread's* current stream unless ``wait(stream=...)`` names the
  consumer's stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, Literal, Protocol

__all__ = [
    "POLL_FIRST_DELAY_S",
    "POLL_GROWTH",
    "POLL_MAX_DELAY_S",
    "Copy",
    "CopyState",
    "Transfer",
    "until_done",
]

# Event polling. The first check after a miss only yields (sleep(0)), because small copies are
# often done by the next loop iteration; then the delay doubles from POLL_FIRST_DELAY_S up to
# POLL_MAX_DELAY_S. A lower cap hands batches over sooner but wakes the loop more often; at
# 1 ms a pending copy costs at most ~1000 cheap wake-ups a second and adds at most ~1 ms to a
# hand-over, small against the multi-millisecond copies and steps this stage overlaps.
POLL_FIRST_DELAY_S = 50e-6
POLL_MAX_DELAY_S = 1e-3
POLL_GROWTH = 2.0

CopyState = Literal["pending", "copied", "failed"]


class Copy(Protocol):
    """One copy to the device as its :class:`Transfer` sees it (the stage implements it)."""

    @property
    def state(self) -> CopyState:
        """``"pending"`` until the copy has completed (``"copied"``) or failed."""
        ...

    def done(self) -> bool:
        """Whether the copy has completed or failed; may poll the device, never blocks."""
        ...

    def host_work(self) -> concurrent.futures.Future[Any] | None:
        """The host-side job still staging and enqueueing the copy on a thread, if any."""
        ...

    def hand_over(self, stream: Any) -> Any:
        """Order ``stream`` (``None``: the current one) after the copy; return the batch.

        Called only once :meth:`done` is true, and again for every ``wait()``.

        Raises:
            TransferError: the copy failed on the device, or the hand-over did.
        """
        ...


def _next_delay(delay: float) -> float:
    """The poll back-off: 0, then POLL_FIRST_DELAY_S growing by POLL_GROWTH to the cap."""
    return POLL_FIRST_DELAY_S if delay == 0.0 else min(delay * POLL_GROWTH, POLL_MAX_DELAY_S)


async def until_done(done: Callable[[], bool]) -> None:
    """Return once ``done()`` is true, polling with the back-off; never blocks the loop."""
    delay = 0.0
    while not done():
        await asyncio.sleep(delay)
        delay = _next_delay(delay)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark ``future``'s outcome as seen: its copy's record reports it."""
    if not future.cancelled():
        future.exception()


class Transfer:
    """One batch on its way to the device, returned by :meth:`DeviceStage.start`.

    ``await wait()`` returns the device batch. Cancelling ``wait()`` loses nothing: the copy
    carries on and a later ``wait()`` returns the batch.

    Args:
        batch_id: the batch's id, as given to ``start()``.
        copy: the stage's record of the copy.
    """

    __slots__ = ("_copy", "batch_id")

    def __init__(self, batch_id: int, copy: Copy) -> None:
        self.batch_id = batch_id
        self._copy = copy

    def done(self) -> bool:
        """Whether the copy has completed (or failed); never blocks."""
        return self._copy.done()

    async def wait(self, *, stream: Any = None) -> Any:
        """Await the copy without blocking the loop, hand the batch over, and return it.

        Args:
            stream: the CUDA stream that will consume the batch; by default the calling
                thread's current stream for the stage's device.

        Raises:
            TransferError: the copy failed on the device, naming the batch.
        """
        work = self._copy.host_work()
        if work is not None:
            # Woken by the thread when it finishes, not by polling. asyncio.wait neither
            # cancels the job when this wait is cancelled nor raises its error: done() turns
            # that into the TransferError below.
            woken = asyncio.wrap_future(work)
            woken.add_done_callback(_retrieve)
            await asyncio.wait([woken])
        await until_done(self._copy.done)
        return self._copy.hand_over(stream)

    def __repr__(self) -> str:
        return f"<Transfer batch_id={self.batch_id} {self._copy.state}>"
