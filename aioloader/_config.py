"""The loader's settings: every argument checked once, derived values computed once.

:class:`LoaderConfig` is built by :func:`LoaderConfig.build` from ``DataLoader``'s arguments and
never changes afterwards; the epoch, the producers and the runners read it. The checks
themselves live in :mod:`aioloader._validate`; this module knows which argument gets which
check, which arguments exclude each other, and the defaults that depend on others (the default
``prefetch``, the shared-memory cap). :func:`batch_sampler_for` turns ``batch_size`` /
``shuffle`` / ``sampler`` / ``batch_sampler`` / ``drop_last`` / ``last_batch`` into the one batch
sampler the loader iterates (or ``None`` for an iterable dataset).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _validate as check
from ._batch_sampler import BatchSampler, LastBatch
from ._sampler import RandomSampler, SequentialSampler
from ._types import DatasetKind

__all__ = ["SHM_FRACTION", "SHM_MAX_DEFAULT", "LoaderConfig", "batch_sampler_for"]

# Default cap on shared memory: a quarter of /dev/shm's free space, at most 4 GiB. Larger: more
# batches the consumer keeps (a `list(loader)`) stay zero-copy; smaller: more room left for other
# loaders and ranks on the node. Above the cap, batches travel pickled rather than failing.
SHM_FRACTION = 0.25
SHM_MAX_DEFAULT = 4 << 30

ON_ERROR = ("raise", "skip")


@dataclass(frozen=True, slots=True)
class LoaderConfig:
    """The checked settings of one loader (see :class:`aioloader.DataLoader` for each)."""

    kind: DatasetKind
    batch_size: int | None
    num_workers: int
    thread_pool: bool
    in_order: bool
    prefetch: int
    timeout: float | None
    io_concurrency: int
    max_retries: int
    device_prefetch: int
    on_error: str
    max_failures: float
    collate_fn: Callable[[list[Any]], Any]
    worker_init_fn: Callable[[int], Any] | None
    transform: Callable[[Any], Any] | None
    seed: int
    pin_memory: bool
    shm_max_bytes: int | None
    last_batch: LastBatch

    @property
    def skip_errors(self) -> bool:
        return self.on_error == "skip"

    @property
    def drop_last(self) -> bool:
        return self.last_batch == "discard"

    @property
    def uses_processes(self) -> bool:
        """Whether batches are made in worker processes (else on threads of this process)."""
        return self.num_workers > 0 and not self.thread_pool

    @property
    def threads(self) -> int:
        """Threads that make batches when no processes do."""
        return self.num_workers if self.thread_pool and self.num_workers else 1

    @classmethod
    def build(
        cls,
        *,
        kind: DatasetKind,
        batch_size: object,
        num_workers: object,
        thread_pool: object,
        in_order: object,
        prefetch: object,
        timeout: object,
        io_concurrency: object,
        max_retries: object,
        device_prefetch: object,
        on_error: str,
        max_failures: object,
        collate_fn: Any,
        worker_init_fn: Any,
        transform: Any,
        seed: int,
        pin_memory: object,
        shm_max_bytes: object,
        last_batch: LastBatch,
        default_collate: Callable[[list[Any]], Any],
    ) -> LoaderConfig:
        """Check every argument and derive the defaults that depend on others."""
        workers = check.non_negative_int("num_workers", num_workers)
        size = None if batch_size is None else check.positive_int("batch_size", batch_size)
        io = check.positive_int("io_concurrency", io_concurrency)
        if prefetch is None:
            depth = 2 * max(1, workers)
            if kind == "async_map" and size is not None:
                # Enough batches in flight to keep io_concurrency requests going: a batch waits
                # for its slowest item, and the next batches' items fill the gap meanwhile.
                depth = max(depth, -(-io // size) + 2)
        else:
            depth = check.positive_int("prefetch", prefetch)
        return cls(
            kind=kind,
            batch_size=size,
            num_workers=workers,
            thread_pool=check.boolean("thread_pool", thread_pool),
            in_order=check.boolean("in_order", in_order),
            prefetch=depth,
            timeout=check.seconds("timeout", timeout, zero_is_none=True),
            io_concurrency=io,
            max_retries=check.non_negative_int("max_retries", max_retries),
            device_prefetch=check.positive_int("device_prefetch", device_prefetch),
            on_error=check.one_of("on_error", on_error, ON_ERROR),
            max_failures=check.fraction_or_count("max_failures", max_failures),
            collate_fn=check.callable_or_none("collate_fn", collate_fn) or default_collate,
            worker_init_fn=check.callable_or_none("worker_init_fn", worker_init_fn),
            transform=check.callable_or_none("transform", transform),
            seed=seed,
            pin_memory=check.boolean("pin_memory", pin_memory),
            shm_max_bytes=(
                None
                if shm_max_bytes is None
                else check.non_negative_int("shm_max_bytes", shm_max_bytes)
            ),
            last_batch=last_batch,
        )

    def shm_cap(self) -> int:
        """Bytes of shared memory this loader may use for batches (see :data:`SHM_FRACTION`)."""
        if self.shm_max_bytes is not None:
            return self.shm_max_bytes
        stat = os.statvfs("/dev/shm")
        return int(min(SHM_MAX_DEFAULT, stat.f_bavail * stat.f_frsize * SHM_FRACTION))


def batch_sampler_for(
    dataset: Any,
    kind: DatasetKind,
    *,
    batch_size: int | None,
    shuffle: object,
    sampler: Any,
    batch_sampler: Any,
    drop_last: bool,
    last_batch: str | None,
    policy: LastBatch,
    seed: int,
    generator: Any,
) -> Any:
    """The batch sampler the loader iterates, or ``None`` for an iterable dataset.

    Raises:
        ValueError: arguments that exclude each other (``sampler`` with ``shuffle``,
            ``batch_sampler`` with ``batch_size``/``shuffle``/``sampler``/``drop_last``, a
            sampler or shuffle with an iterable dataset, ...), each named with its value.
    """
    shuffle = check.boolean("shuffle", shuffle)
    if kind in ("iterable", "async_iterable"):
        if shuffle or sampler is not None or batch_sampler is not None:
            raise ValueError(
                "shuffle, sampler and batch_sampler do not apply to an iterable dataset "
                f"({type(dataset).__name__}); shuffle inside the stream instead"
            )
        if policy == "rollover":
            raise ValueError("last_batch='rollover' needs a map-style dataset")
        if batch_size is None:
            raise ValueError("batch_size=None needs a batch_sampler (map-style datasets)")
        return None
    if batch_sampler is not None:
        if batch_size not in (None, 1) or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler excludes batch_size, shuffle, sampler and drop_last "
                f"(got batch_size={batch_size!r}, shuffle={shuffle!r}, "
                f"sampler={sampler!r}, drop_last={drop_last!r})"
            )
        if last_batch is not None:
            raise ValueError(f"batch_sampler excludes last_batch (got {last_batch!r})")
        return batch_sampler
    if sampler is not None and shuffle:
        raise ValueError(f"sampler={sampler!r} excludes shuffle=True; shuffle in the sampler")
    if batch_size is None:
        raise ValueError("batch_size=None needs a batch_sampler")
    if sampler is None:
        sampler = (
            RandomSampler(
                dataset,
                generator=generator,
                seed=None if generator is not None else seed,
            )
            if shuffle
            else SequentialSampler(dataset)
        )
    return BatchSampler(sampler, batch_size, policy)
