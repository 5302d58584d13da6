"""The device stage: copy host batches to a CUDA device without blocking the event loop.

This package is the only code that touches CUDA (streams, events, pinned memory, host
registration); no module outside it imports ``torch.cuda`` or the CUDA runtime. One batch
flows through it like this::

    host batch (views of a shared-memory slot, memory collated into by host_alloc, or any
    │           nested dict/list/tuple of torch tensors and numpy arrays)
    │  start(batch, batch_id)                 [sync, on the loop thread]
    ▼
    per leaf: already page-locked?  ── yes ──▶ copied from directly (zero extra copies)
    │  no                                      (registered shm slot, pinned collation, a
    │                                           pinned tensor)
    ▼
    memcpy into a pinned staging buffer (one per batch, leased from a pool)
    ▼
    copy into a slot of the device ring (leaves of 64 KiB or more; smaller leaves, and every
    leaf when no slot is free, into fresh device tensors), with non_blocking=True on the
    stage's side stream; then an event, pushed to the completion thread
    │  Transfer.wait()                        [async]
    ▼
    the completion thread blocks on the event (cudaEventSynchronize, GIL released), then
    call_soon_threadsafe sets the copy's future: the task resumes, no timer involved
    ▼
    copy complete: staging buffer back to the pool, host references dropped
    ▼
    hand-over: consumer_stream.wait_event(event); record_stream only for fresh tensors (and
    for a slot the ring forgot at close())
    ▼
    device batch returned to the consumer; its ring slot is reused once nobody references it
    and a release event recorded on the consumer's stream after that has completed

Who owns what: :class:`DeviceStage` owns the side stream, the staging pool, the device ring, the
completion thread and the registry of page-locked host ranges; its record of each copy leases
one staging buffer (and a ring slot) and keeps the host tensors it copies from *directly* alive
until its event has completed. Tensors copied through staging are read synchronously inside
``start()`` (or on the stage's staging thread, for large batches and those started behind
them), so their host batch (and its shared-memory slot) can be released as soon as that is
done. The stage's own threads (completion, staging) make its device their current one before
their first CUDA call. A :class:`Transfer` is the
consumer's handle on one such record, which it sees only through the ``Copy`` protocol.

One job per module, each with its sharp edges in its own docstring:

- ``_parse``: :func:`parse_device`, the loader's ``device`` argument (never initialises CUDA).
- ``_backend``: the :class:`CudaBackend` protocol, :class:`TorchCudaBackend` over
  ``torch.cuda``, and the CUDA runtime calls behind host registration.
- ``_leaves``: mapping a batch's array leaves (on :mod:`aioloader._tree`) and viewing numpy
  leaves as tensors.
- ``_staging``: the pool of pinned staging buffers.
- ``_ring``: the device ring, reusable device buffers and the rule for when a slot is free.
- ``_completion``: the completion thread, which waits on copies' events in start order.
- ``_plan``: each leaf's route (kept, copied directly from page-locked memory, or staged) and
  its place in the batch's staging buffer and device buffer; no CUDA call.
- ``_transfer``: :class:`Transfer`, the handle on one batch in flight, the ``Copy`` protocol it
  sees the stage through, how a wait is woken (the completion future; the event-poll back-off
  where there is none). It imports nothing from ``_stage``.
- ``_stage``: :class:`DeviceStage`, which enqueues, completes and hands over copies.

Imports go one way (``_stage`` uses the others; none of them uses ``_stage``) and no module
reads another's ``_private`` names.

This module only re-exports, and imports torch only when something that needs it is asked for:
``parse_device(None)`` and the warning class do not, so ``import aioloader`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .._errors import DeviceUnavailableWarning as DeviceUnavailableWarning
from ._parse import falls_back as falls_back
from ._parse import parse_device as parse_device

if TYPE_CHECKING:
    from ._backend import CudaBackend as CudaBackend
    from ._backend import TorchCudaBackend as TorchCudaBackend
    from ._stage import DeviceStage as DeviceStage
    from ._stage import DeviceStats as DeviceStats
    from ._staging import MAX_POOLED_STAGING_BYTES as MAX_POOLED_STAGING_BYTES
    from ._staging import STAGING_GRANULE as STAGING_GRANULE
    from ._transfer import Transfer as Transfer

__all__ = [
    "CudaBackend",
    "DeviceStage",
    "DeviceStats",
    "DeviceUnavailableWarning",
    "TorchCudaBackend",
    "Transfer",
    "falls_back",
    "parse_device",
]

# Names whose modules import torch: loaded on first access (PEP 562).
_LAZY = {
    "CudaBackend": "._backend",
    "TorchCudaBackend": "._backend",
    "DeviceStage": "._stage",
    "DeviceStats": "._stage",
    "MAX_POOLED_STAGING_BYTES": "._staging",
    "STAGING_GRANULE": "._staging",
    "Transfer": "._transfer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
