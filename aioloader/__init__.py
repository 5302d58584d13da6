"""aioloader: an asyncio-native data loader for deep learning.

This module only re-exports; each name lives in one private module (see the module map in
docs/architecture.md). ``__all__`` is sorted and every export reports ``aioloader`` as its
``__module__``.
"""

from __future__ import annotations

from ._batch import default_collate as default_collate
from ._batch import default_convert as default_convert
from ._batch import numpy_collate as numpy_collate
from ._device import DeviceUnavailableWarning as DeviceUnavailableWarning
from ._errors import AioloaderError as AioloaderError
from ._errors import CollateError as CollateError
from ._errors import CollateShapeError as CollateShapeError
from ._errors import CollateTypeError as CollateTypeError
from ._errors import LoaderTimeoutError as LoaderTimeoutError
from ._errors import RemoteError as RemoteError
from ._errors import RemoteNotFoundError as RemoteNotFoundError
from ._errors import RemotePermissionError as RemotePermissionError
from ._errors import RemoteTimeoutError as RemoteTimeoutError
from ._errors import RetriesExhaustedError as RetriesExhaustedError
from ._errors import ShardError as ShardError
from ._errors import SharedMemoryError as SharedMemoryError
from ._errors import StreamOrderWarning as StreamOrderWarning
from ._errors import TooManyFailuresError as TooManyFailuresError
from ._errors import TransferError as TransferError
from ._errors import WorkerCrashedError as WorkerCrashedError
from ._errors import WorkerError as WorkerError
from ._errors import WorkerInitError as WorkerInitError
from ._loader import DataLoader as DataLoader
from ._loader import WorkerPool as WorkerPool
from ._loader import WorkerPoolStatistics as WorkerPoolStatistics
from ._ray import ActorStatistics as ActorStatistics
from ._ray import RayWorkers as RayWorkers
from ._ray import RayWorkersStatistics as RayWorkersStatistics
from ._sampling import BatchSampler as BatchSampler
from ._sampling import DistributedSampler as DistributedSampler
from ._sampling import RandomSampler as RandomSampler
from ._sampling import SequentialSampler as SequentialSampler
from ._sampling import ShardedBatchSampler as ShardedBatchSampler
from ._stats import LoaderStatistics as LoaderStatistics
from ._stats import WorkerFigures as WorkerFigures
from ._threads import run as run
from ._types import AsyncDataset as AsyncDataset
from ._types import AsyncIterableDataset as AsyncIterableDataset
from ._types import CollateFn as CollateFn
from ._types import Dataset as Dataset
from ._types import IterableDataset as IterableDataset
from ._types import ResumableStream as ResumableStream
from ._types import Sampler as Sampler
from ._types import Stateful as Stateful
from ._workers import WorkerInfo as WorkerInfo
from ._workers import get_worker_info as get_worker_info

__version__ = "0.1.0"

__all__ = [
    "ActorStatistics",
    "AioloaderError",
    "AsyncDataset",
    "AsyncIterableDataset",
    "BatchSampler",
    "CollateError",
    "CollateFn",
    "CollateShapeError",
    "CollateTypeError",
    "DataLoader",
    "Dataset",
    "DeviceUnavailableWarning",
    "DistributedSampler",
    "IterableDataset",
    "LoaderStatistics",
    "LoaderTimeoutError",
    "RandomSampler",
    "RayWorkers",
    "RayWorkersStatistics",
    "RemoteError",
    "RemoteNotFoundError",
    "RemotePermissionError",
    "RemoteTimeoutError",
    "ResumableStream",
    "RetriesExhaustedError",
    "Sampler",
    "SequentialSampler",
    "ShardError",
    "ShardedBatchSampler",
    "SharedMemoryError",
    "Stateful",
    "StreamOrderWarning",
    "TooManyFailuresError",
    "TransferError",
    "WorkerCrashedError",
    "WorkerError",
    "WorkerFigures",
    "WorkerInfo",
    "WorkerInitError",
    "WorkerPool",
    "WorkerPoolStatistics",
    "default_collate",
    "default_convert",
    "get_worker_info",
    "numpy_collate",
    "run",
]

# Every public object reports the facade as its home, so reprs, docs and pickles name
# `aioloader.X`, not a private module (pickling by reference still works: the name is here).
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("aioloader."):
        _obj.__module__ = "aioloader"
del _name, _obj
