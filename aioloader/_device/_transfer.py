"""One batch on its way to the device, and how the event loop waits for it.

A :class:`Transfer` is what :meth:`DeviceStage.start` returns: a handle on the stage's record of
one copy, which it sees only through the small :class:`Copy` protocol. ``await wait()`` awaits
the copy (:func:`until_copied`), then asks it to hand the device batch over to the consumer's
stream.

The dependency goes one way: ``_stage`` drives the copies and imports this module; this module
knows nothing of the stage, only the protocol it implements::

    DeviceStage.start(batch) ──▶ its record of the copy (implements Copy) ──▶ Transfer(record)
    Transfer.wait() ──▶ until_copied(record) ──▶ record.hand_over(stream) ──▶ device batch
        until_copied: the host job that stages and enqueues it (a thread's future), then
        the completion future the stage's completion thread sets (no timer), or, where
        there is none, a poll of record.done() with a back-off (until_done)

Sharp edges:

- The loop never blocks on the device: the completion thread waits on the copy's event and
  wakes the task through ``call_soon_threadsafe``; only the stage's cleanup paths
  (``close()``, unregistering memory) synchronize on the loop's thread.
- Polling (:func:`until_done`) is the fallback for a backend whose events cannot be waited
  on from a thread, and for a ``wait()`` on another event loop than the one that started the
  copy (its completion future belongs to that loop).
- Cancelling ``wait()`` loses nothing: the copy carries on and a later ``wait()`` returns the
  batch.
- The hand-over uses the *calling thread's* current stream unless ``wait(stream=...)`` names the
  consumer's stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

__all__ = [
    "POLL_FIRST_DELAY_S",
    "POLL_GROWTH",
    "POLL_MAX_DELAY_S",
    "Copy",
    "CopyState",
    "Transfer",
    "until_copied",
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

    def completion(self) -> asyncio.Future[None] | None:
        """A future of the running loop set once the copy completed or failed; None where
        the copy's completion is not reported (then :meth:`done` is polled)."""
        ...

    def waited(self, seconds: float, *, woken: bool) -> None:
        """Told how long a ``wait()`` was suspended for this copy, and whether the completion
        future woke it (then, right now is when the task resumed): statistics."""
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


async def until_copied(copy: Copy, *, counted: bool = True) -> None:
    """Return once ``copy`` has completed or failed, without blocking the loop and, where the
    copy reports its completion, without any timer. Cancelling it leaves the copy alone.

    ``counted``: tell the copy how long this wait was suspended (:meth:`Copy.waited`); False
    for waits that are not a consumer's (the stage's ``drain()``).
    """
    work = copy.host_work()
    if work is None and copy.done():
        return
    started = time.perf_counter()
    woken = False
    try:
        if work is not None:
            # Woken by the thread when it finishes, not by polling. asyncio.wait neither
            # cancels the job when this wait is cancelled nor raises its error: done() turns
            # that into a TransferError at the hand-over.
            hosted = asyncio.wrap_future(work)
            hosted.add_done_callback(_retrieve)
            await asyncio.wait([hosted])
            if copy.done():
                return
        completed = copy.completion()
        if completed is not None:
            # Set by the loop on the completion thread's word; asyncio.wait leaves the future
            # alone when this wait is cancelled, so a later wait() finds it again.
            await asyncio.wait([completed])
            woken = True
            copy.done()  # takes in the outcome, should the future have been set another way
        else:
            await until_done(copy.done)
    finally:
        if counted:
            copy.waited(time.perf_counter() - started, woken=woken)


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
        await until_copied(self._copy)
        return self._copy.hand_over(stream)

    def __repr__(self) -> str:
        return f"<Transfer batch_id={self.batch_id} {self._copy.state}>"
