"""The loader's settings as attributes: torch's names and aioloader's, read-only.

:class:`SettingsView` is the part of :class:`aioloader.DataLoader` that shows its settings.
They live in the loader's frozen :class:`LoaderConfig` (``_config``), checked once at
construction, and in its :class:`Sampling` (``_sampling``); the attributes read them there.

Assigning a setting after construction raises ``ValueError``: torch refuses the same for
``dataset``, ``batch_size``, ``sampler``, ``batch_sampler``, ``drop_last`` and
``persistent_workers`` (its message is kept for those); aioloader refuses it for every
other setting too, because nothing would read the new value (the checks and everything
derived from them ran once). Private attributes, and attributes a user adds, stay assignable.

One setting is assignable, because frameworks assign it: ``worker_init_fn`` (Lightning sets
it after ``seed_everything(workers=True)``; torch allows it). The loader checks the new value
and re-derives what it feeds (:meth:`SettingsView._reconfigure`); worker processes run it with
their next dataset copy: the next epoch's, or never again once ``persistent_workers=True``
workers have their copy, as torch's workers do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.context import BaseContext
from typing import Any, Generic, TypeVar, overload

from .._config import LoaderConfig, PerSample, Sampling
from .._validate import callable_or_none

__all__ = ["Setting", "SettingsView"]

T = TypeVar("T")

# The settings frameworks assign after construction (see the module docstring).
_ASSIGNABLE = frozenset(("worker_init_fn",))

# The attributes torch itself refuses to reassign after construction.
_TORCH_FIXED = frozenset(
    ("dataset", "batch_size", "batch_sampler", "sampler", "drop_last", "persistent_workers")
)


class Setting(Generic[T]):
    """A read-only attribute, read from the loader's :class:`LoaderConfig` field of its name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, loader: None, owner: type) -> Setting[T]: ...

    @overload
    def __get__(self, loader: SettingsView, owner: type) -> T: ...

    def __get__(self, loader: SettingsView | None, owner: type) -> Setting[T] | T:
        if loader is None:
            return self
        return getattr(loader._config, self.name)  # type: ignore[no-any-return]


_SETTINGS: dict[type, frozenset[str]] = {}


def _settings_of(cls: type) -> frozenset[str]:
    """Every constructor argument of ``cls`` and every attribute that shows a setting."""
    names = _SETTINGS.get(cls)
    if names is not None:
        return names
    shown = {
        name
        for klass in cls.__mro__
        for name, value in vars(klass).items()
        if isinstance(value, property | Setting)
    }
    names = _SETTINGS[cls] = frozenset(inspect.signature(cls).parameters) | shown | _TORCH_FIXED
    return names


class SettingsView:
    """Read-only attributes over a loader's ``_config`` and ``_sampling`` (see the module
    docstring); the loader sets ``_initialized`` once its constructor is done."""

    _config: LoaderConfig
    _sampling: Sampling
    _context: BaseContext | None
    _generator: Any
    _initialized = False

    def __setattr__(self, name: str, value: Any) -> None:
        if self._initialized and name in _settings_of(type(self)) and name not in _ASSIGNABLE:
            owner = type(self).__name__
            if name in _TORCH_FIXED:
                raise ValueError(f"{name} attribute should not be set after {owner} is initialized")
            raise ValueError(
                f"{name} attribute should not be set after {owner} is initialized: settings "
                "are checked once, at construction; make a new loader instead"
            )
        super().__setattr__(name, value)

    batch_size = Setting[int | None]()
    num_workers = Setting[int]()
    thread_pool = Setting[bool]()
    in_order = Setting[bool]()
    prefetch = Setting[int]()
    io_concurrency = Setting[int]()
    max_retries = Setting[int]()
    device_prefetch = Setting[int]()
    on_error = Setting[str]()
    max_failures = Setting[float]()
    transform = Setting[Callable[[Any], Any] | None]()
    seed = Setting[int]()
    pin_memory = Setting[bool]()
    drop_last = Setting[bool]()
    last_batch = Setting[str]()
    persistent_workers = Setting[bool]()
    pin_memory_device = Setting[str]()
    pin_device_id = Setting[int | None]()
    worker_seeding = Setting[str]()
    start_timeout = Setting[float | None]()

    @property
    def worker_init_fn(self) -> Callable[[int], Any] | None:
        """Called with the worker id in each worker process as its dataset copy loads;
        assignable."""
        return self._config.worker_init_fn

    @worker_init_fn.setter
    def worker_init_fn(self, fn: Callable[[int], Any] | None) -> None:
        fn = callable_or_none("worker_init_fn", fn)
        self._reconfigure(replace(self._config, worker_init_fn=fn))

    def _reconfigure(self, config: LoaderConfig) -> None:
        """Adopt ``config`` (one assignable setting changed) and what derives from it."""
        raise NotImplementedError  # the loader's: it knows what derives from its settings

    @property
    def kind(self) -> str:
        """``'map'``, ``'async_map'``, ``'iterable'`` or ``'async_iterable'``."""
        return self._config.kind

    @property
    def timeout(self) -> float:
        """Seconds a batch may take; 0 means no limit (as in torch)."""
        return self._config.timeout or 0.0

    @property
    def collate_fn(self) -> Callable[[Any], Any]:
        """What makes a batch of samples (or, with ``batch_size=None``, converts one)."""
        collate = self._config.collate_fn
        return collate.fn if isinstance(collate, PerSample) else collate

    @property
    def sampler(self) -> Any:
        """The index sampler: yours, the one the loader made (``shuffle``), or the one inside
        your batch sampler (else a sequential one, as torch shows); None for iterable data."""
        return self._sampling.sampler

    @property
    def batch_sampler(self) -> Any:
        """The batch sampler (yours or the loader's); None without batching or for iterables."""
        return self._sampling.batch_sampler

    @property
    def generator(self) -> Any:
        """The ``torch.Generator`` given, or None."""
        return self._generator

    @property
    def prefetch_factor(self) -> int | None:
        """Batches in flight per worker (torch's view of ``prefetch``); None without workers,
        as in torch."""
        if self._config.prefetch_factor is not None:
            return self._config.prefetch_factor
        workers = self._config.num_workers
        return max(1, self._config.prefetch // workers) if workers else None

    @property
    def _makers(self) -> str:
        """What makes the batches, in words (for ``repr``)."""
        workers = self._config.num_workers
        if not workers:
            return "main-process thread"
        return f"{workers} {'threads' if self._config.thread_pool else 'processes'}"

    @property
    def multiprocessing_context(self) -> BaseContext | None:
        """The multiprocessing context worker processes start from (None without them)."""
        return self._context

    mp_context = multiprocessing_context
