"""One batch on its way to the device, and how the event loop waits for it.

A :class:`Transfer` is what :meth:`DeviceStage.start` returns. ``await wait()`` polls the
copy's CUDA event with an ``asyncio.sleep`` back-off (:func:`_next_delay`), then hands the
device batch over to the consumer's stream.

Sharp edges:

- The loop never blocks on the device: ``wait()`` polls ``event.query()``; only the stage's
  cleanup paths (``close()``, unregistering memory) synchronize.
- Cancelling ``wait()`` loses nothing: the copy carries on and a later ``wait()`` returns the
  batch.
- A transfer keeps the host tensors it copies from *directly* alive until its event has
  completed; leaves copied through staging were already read inside ``start()``.
- The hand-over uses the *calling thread's* current stream unless ``wait(stream=...)`` names the
  consumer's stream.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Literal

import torch

from .._errors import TransferError

if TYPE_CHECKING:
    from ._stage import DeviceStage

__all__ = ["POLL_FIRST_DELAY_S", "POLL_GROWTH", "POLL_MAX_DELAY_S", "Transfer"]

# Event polling. The first check after a miss only yields (sleep(0)), because small copies are
# often done by the next loop iteration; then the delay doubles from POLL_FIRST_DELAY_S up to
# POLL_MAX_DELAY_S. A lower cap hands batches over sooner but wakes the loop more often; at
# 1 ms a pending copy costs at most ~1000 cheap wake-ups a second and adds at most ~1 ms to a
# hand-over, small against the multi-millisecond copies and steps this stage overlaps.
POLL_FIRST_DELAY_S = 50e-6
POLL_MAX_DELAY_S = 1e-3
POLL_GROWTH = 2.0


def _next_delay(delay: float) -> float:
    """The poll back-off: 0, then POLL_FIRST_DELAY_S growing by POLL_GROWTH to the cap."""
    return POLL_FIRST_DELAY_S if delay == 0.0 else min(delay * POLL_GROWTH, POLL_MAX_DELAY_S)


_State = Literal["pending", "copied", "failed"]


class Transfer:
    """One batch on its way to the device, returned by :meth:`DeviceStage.start`.

    ``await wait()`` returns the device batch. Cancelling ``wait()`` loses nothing: the copy
    carries on and a later ``wait()`` returns the batch.
    """

    __slots__ = (
        "_device_tensors",
        "_end_event",
        "_error",
        "_lease",
        "_nbytes",
        "_ranges",
        "_result",
        "_sources",
        "_stage",
        "_start_event",
        "_started_at",
        "_state",
        "batch_id",
    )

    def __init__(self, stage: DeviceStage, batch_id: int) -> None:
        self.batch_id = batch_id
        self._stage = stage
        self._state: _State = "pending"
        self._result: Any = None
        self._error: TransferError | None = None
        # Device tensors of the result: each gets record_stream(consumer) at hand-over.
        self._device_tensors: list[torch.Tensor] = []
        # Host tensors copied from directly: kept alive until the copy has completed.
        self._sources: list[torch.Tensor] = []
        # Bases of registered ranges this copy reads from.
        self._ranges: set[int] = set()
        self._lease: torch.Tensor | None = None
        self._start_event: Any = None
        self._end_event: Any = None
        self._nbytes = 0
        self._started_at = time.perf_counter()

    def done(self) -> bool:
        """Whether the copy has completed (or failed); never blocks."""
        if self._state == "pending":
            self._stage._poll(self)
        return self._state != "pending"

    async def wait(self, *, stream: Any = None) -> Any:
        """Await the copy without blocking the loop, hand the batch over, and return it.

        Args:
            stream: the CUDA stream that will consume the batch; by default the calling
                thread's current stream for the stage's device.

        Raises:
            TransferError: the copy failed on the device, naming the batch.
        """
        delay = 0.0
        while not self.done():
            await asyncio.sleep(delay)
            delay = _next_delay(delay)
        if self._error is not None:
            raise self._error
        self._stage._hand_over(self, stream)
        return self._result

    def __repr__(self) -> str:
        return f"<Transfer batch_id={self.batch_id} {self._state}>"
