"""The loader: :class:`DataLoader`, which composes the stages and owns their lifetimes, and
:class:`WorkerPool`, worker processes that several loaders share.

::

    DataLoader (_dataloader) ── arguments ──▶ LoaderConfig (aioloader._config)
        │ settings as torch-named, read-only attributes                          (_settings)
        │ once first needed, until closed:
        ▼
    Resources (_resources): the runner (threads, or workers on a WorkerPool with its slot
        │                   pool), the device stage, the loop thread for `for`, the epoch
        │                   being iterated; one finalizer, released once
        ▼
    WorkerPool (_shared_pool): processes, a shared-memory budget and a loop thread that
                               several loaders share, each with its own dataset copy

    a finalizer found in a cycle closes from a thread where that cannot deadlock  (_closing)

This module only re-exports.
"""

from __future__ import annotations

from ._dataloader import DataLoader as DataLoader
from ._shared_pool import WorkerPool as WorkerPool
from ._shared_pool import WorkerPoolStatistics as WorkerPoolStatistics
