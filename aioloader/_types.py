"""The protocols users plug in through.

Nothing here needs subclassing: a torch ``Dataset``, a list, a numpy array, or any object with
the right methods fits. The loader tells the kinds of dataset apart at construction with
:func:`dataset_kind`:

- map-style: ``__getitem__`` and ``__len__``; ``__getitem__`` may be ``async def``
  (an :class:`AsyncDataset`), and an optional ``__getitems__`` (sync or async) reads a whole
  batch at once;
- iterable: ``__iter__`` (an :class:`IterableDataset`) or ``__aiter__`` (an
  :class:`AsyncIterableDataset`) and no usable ``__getitem__``.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

__all__ = [
    "AsyncDataset",
    "AsyncIterableDataset",
    "CollateFn",
    "Dataset",
    "DatasetKind",
    "IterableDataset",
    "Sampler",
    "Stateful",
    "dataset_kind",
]

T_co = TypeVar("T_co", covariant=True)

DatasetKind = Literal["map", "async_map", "iterable", "async_iterable"]


@runtime_checkable
class Dataset(Protocol[T_co]):
    """A map-style dataset: ``dataset[i]`` for ``0 <= i < len(dataset)``."""

    def __getitem__(self, index: int, /) -> T_co: ...

    def __len__(self) -> int: ...


@runtime_checkable
class AsyncDataset(Protocol[T_co]):
    """A map-style dataset whose items are awaited: ``await dataset[i]``."""

    def __getitem__(self, index: int, /) -> Awaitable[T_co]: ...

    def __len__(self) -> int: ...


@runtime_checkable
class IterableDataset(Protocol[T_co]):
    """A stream of samples. In a worker, shard with :func:`aioloader.get_worker_info`."""

    def __iter__(self) -> Iterator[T_co]: ...


@runtime_checkable
class AsyncIterableDataset(Protocol[T_co]):
    """An asynchronous stream of samples, pulled on the event loop."""

    def __aiter__(self) -> AsyncIterator[T_co]: ...


@runtime_checkable
class Sampler(Protocol):
    """Yields dataset indices (a sampler) or lists of them (a batch sampler)."""

    def __iter__(self) -> Iterator[Any]: ...


class CollateFn(Protocol):
    """Turns a list of samples into one batch."""

    def __call__(self, samples: Sequence[Any], /) -> Any: ...


@runtime_checkable
class Stateful(Protocol):
    """Something whose position can be saved and restored exactly."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> None: ...


def _is_async_callable(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's async __call__
    )


def dataset_kind(dataset: Any) -> DatasetKind:
    """Classify ``dataset`` as map, async map, iterable or async iterable.

    A torch ``IterableDataset`` inherits a ``__getitem__`` that raises ``NotImplementedError``;
    it counts as iterable because it defines ``__iter__`` and no ``__len__``-backed indexing
    of its own.

    Raises:
        TypeError: if ``dataset`` is none of the four kinds.
    """
    cls = type(dataset)
    if hasattr(cls, "__aiter__"):
        return "async_iterable"
    torch_iterable = _is_torch_iterable(dataset)
    if hasattr(cls, "__getitem__") and hasattr(cls, "__len__") and not torch_iterable:
        if _is_async_callable(cls.__getitem__):
            return "async_map"
        return "map"
    if hasattr(cls, "__iter__"):
        return "iterable"
    raise TypeError(
        f"dataset={dataset!r} is not a dataset: it needs __getitem__ and __len__ (map-style), "
        "__iter__ (iterable) or __aiter__ (async iterable)"
    )


def _is_torch_iterable(dataset: Any) -> bool:
    try:
        from torch.utils.data import IterableDataset as TorchIterable
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(dataset, TorchIterable)
