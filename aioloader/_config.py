"""The loader's settings: every argument checked once, derived values computed once.

:class:`LoaderConfig` is built by :func:`LoaderConfig.build` from ``DataLoader``'s arguments and
never changes afterwards; the epoch, the producers and the runners read it. The checks
themselves live in :mod:`aioloader._validate`; this module knows which argument gets which
check, which arguments exclude each other, and the defaults that depend on others (the default
``prefetch``, the shared-memory cap). :func:`batch_sampler_for` turns ``batch_size`` /
``shuffle`` / ``sampler`` / ``batch_sampler`` / ``drop_last`` / ``last_batch`` into the one batch
sampler the loader iterates (or ``None`` for an iterable dataset), :func:`resolve_seed` picks the
loader's base seed as torch does, and :func:`context_argument` reconciles torch's
``multiprocessing_context`` with aioloader's ``mp_context``.

Without automatic batching (``batch_size=None``, as in torch) every sample is its own batch:
the loader iterates a batch sampler of size 1 and :class:`PerSample` hands the one sample to
the user's ``collate_fn`` (or :func:`~aioloader.default_convert`), so threads, worker
processes and async datasets need no second code path. A sampler of the user's may then yield
a list of indices as one key (torch's bulk read): it travels as a ``BulkKey`` and is read by
one ``dataset[key]`` call. Under a rank share (:mod:`aioloader._sampling._distributed`) the
default sampler is a :class:`DistributedSampler`.
"""

from __future__ import annotations

import multiprocessing as mp
import re
import secrets
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any

from . import _validate as check
from ._sampling import (
    DEFAULT_SHARE_SEED,
    BatchSampler,
    DistributedSampler,
    IndexCheck,
    LastBatch,
    RandomSampler,
    SequentialSampler,
    Shard,
)
from ._types import DatasetKind

__all__ = [
    "WORKER_SEEDING",
    "LoaderConfig",
    "PerSample",
    "Sampling",
    "batch_sampler_for",
    "context_argument",
    "resolve_seed",
]

ON_ERROR = ("raise", "skip")

# How worker processes are seeded: "batch" reseeds random, numpy and torch before every batch
# from (seed, epoch, batch id), so randomness does not depend on the worker count; "worker"
# seeds each worker once, from its seed (torch's way, for code that seeds in worker_init_fn).
WORKER_SEEDING = ("batch", "worker")

# torch's default prefetch_factor: batches in flight per worker.
DEFAULT_PREFETCH_FACTOR = 2

_SEED_BITS = 63  # a drawn seed fits a signed 64-bit int, as torch's base seed does

_CUDA_DEVICE = re.compile(r"cuda(:\d+)?")


class PerSample:
    """The collate function of a loader without automatic batching (``batch_size=None``): each
    "batch" holds one sample, handed to ``fn`` alone (torch calls ``collate_fn(sample)``)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, samples: list[Any]) -> Any:
        return self.fn(samples[0])

    def __repr__(self) -> str:
        return f"PerSample({self.fn!r})"


def _as_is(sample: Any) -> Any:
    return sample


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
    batched: bool = True  # torch's automatic batching: False with batch_size=None
    prefetch_factor: int | None = None  # as given (torch's argument); ``prefetch`` is the depth
    persistent_workers: bool = False
    pin_memory_device: str = ""
    pin_device_id: int | None = None  # MXNet Gluon's name for pin_memory_device="cuda:<id>"
    shard: Shard | None = None  # the rank share the loader reads itself (None: all of it)
    worker_seeding: str = "batch"
    start_timeout: float | None = None  # as given; None: the batch timeout, else a default
    # What every rank orders its share by: ``seed=`` as given, else DEFAULT_SHARE_SEED (see
    # batch_sampler_for), so that ranks agree without talking to each other.
    share_seed: int = DEFAULT_SHARE_SEED

    @property
    def skip_errors(self) -> bool:
        return self.on_error == "skip"

    @property
    def stream_seed(self) -> int:
        """The seed a stream is read under in worker processes (``_info.StreamRandom``): the
        same in every worker, and on every rank when the stream is split by rank."""
        return self.seed if self.shard is None else self.share_seed

    @property
    def drop_last(self) -> bool:
        return self.last_batch == "discard"

    @property
    def uses_processes(self) -> bool:
        """Whether batches are made in worker processes (else on threads of this process)."""
        return self.num_workers > 0 and not self.thread_pool

    @property
    def stream_readers(self) -> int:
        """The readers of a stream's epoch: a sync stream's worker processes, else one (the
        helper thread, or the loop, which reads an async stream whatever ``num_workers`` is)."""
        return self.num_workers if self.kind == "iterable" and self.uses_processes else 1

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
        default_convert: Callable[[Any], Any] | None = None,
        batch_sampler_given: bool = False,
        prefetch_factor: object = None,
        persistent_workers: object = False,
        pin_memory_device: object = "",
        pin_device_id: object = None,
        shard: Shard | None = None,
        worker_seeding: object = "batch",
        start_timeout: object = None,
        share_seed: int = DEFAULT_SHARE_SEED,
    ) -> LoaderConfig:
        """Check every argument and derive the defaults that depend on others.

        ``batch_size`` is ``None`` in the result when a batch sampler is given (as torch's
        attribute is); ``batched`` says whether samples are collated into batches at all.
        """
        workers = check.non_negative_int("num_workers", num_workers)
        size = batch_size
        if size is not None:
            size = check.as_torch(check.positive_int, "batch_size", batch_size)
        batched = size is not None or batch_sampler_given
        if batch_sampler_given:
            size = None  # the batch sampler decides (its conflicts are checked with it)
        io = check.positive_int("io_concurrency", io_concurrency)
        factor = _prefetch_factor(prefetch_factor, prefetch, workers)
        if factor is not None:
            depth = factor * workers
        elif prefetch is None:
            depth = DEFAULT_PREFETCH_FACTOR * max(1, workers)
            if kind == "async_map":
                # Enough batches in flight to keep io_concurrency requests going: a batch waits
                # for its slowest item, and the next batches' items fill the gap meanwhile. A
                # batch sampler's size is unknown here: assume the smallest.
                depth = max(depth, -(-io // (size or 1)) + 2)
        else:
            depth = check.positive_int("prefetch", prefetch)
        persistent = check.flag("persistent_workers", persistent_workers)
        if persistent and workers == 0:
            raise ValueError(
                "persistent_workers=True needs num_workers > 0 (workers to keep alive between "
                "epochs), got num_workers=0"
            )
        pin_device, pin_id = _pin_device(pin_memory_device, pin_device_id)
        collate = check.callable_or_none("collate_fn", collate_fn)
        if batched:
            collate = collate or default_collate
        else:
            collate = PerSample(collate or default_convert or _as_is)
        return cls(
            kind=kind,
            batch_size=size,
            num_workers=workers,
            thread_pool=check.flag("thread_pool", thread_pool),
            in_order=check.flag("in_order", in_order),
            prefetch=depth,
            timeout=check.seconds("timeout", timeout, zero_is_none=True),
            io_concurrency=io,
            max_retries=check.non_negative_int("max_retries", max_retries),
            device_prefetch=check.positive_int("device_prefetch", device_prefetch),
            on_error=check.one_of("on_error", on_error, ON_ERROR),
            max_failures=check.fraction_or_count("max_failures", max_failures),
            collate_fn=collate,
            worker_init_fn=check.callable_or_none("worker_init_fn", worker_init_fn),
            transform=check.callable_or_none("transform", transform),
            seed=seed,
            pin_memory=check.flag("pin_memory", pin_memory),
            shm_max_bytes=(
                None
                if shm_max_bytes is None
                else check.non_negative_int("shm_max_bytes", shm_max_bytes)
            ),
            last_batch=last_batch,
            batched=batched,
            prefetch_factor=factor,
            persistent_workers=persistent,
            pin_memory_device=pin_device,
            pin_device_id=pin_id,
            shard=shard,
            worker_seeding=_worker_seeding(worker_seeding),
            start_timeout=check.seconds("start_timeout", start_timeout, positive=True),
            share_seed=share_seed,
        )


def _prefetch_factor(factor: object, prefetch: object, workers: int) -> int | None:
    """torch's ``prefetch_factor`` (batches per worker), checked by torch's rule: only with
    workers, and not beside aioloader's own ``prefetch`` (the total)."""
    if factor is None:
        return None
    if workers == 0:
        raise ValueError(
            f"prefetch_factor={factor!r} needs num_workers > 0 (it counts batches per worker), "
            "got num_workers=0; leave it None, or set prefetch= for the total depth"
        )
    if prefetch is not None:
        raise ValueError(
            f"give prefetch (batches in flight in all) or prefetch_factor (per worker), not "
            f"both: got prefetch={prefetch!r}, prefetch_factor={factor!r}"
        )
    return check.positive_int("prefetch_factor", factor)


def _worker_seeding(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"worker_seeding must be one of {WORKER_SEEDING}, got {value!r}")
    return check.one_of("worker_seeding", value, WORKER_SEEDING)


def _pin_memory_device(device: object) -> str:
    """torch's ``pin_memory_device``: ``""`` (the current accelerator) or a CUDA device.
    ``"cpu"`` means ``""``: torch, which deprecated the argument, accepts it and pins for the
    current accelerator."""
    if not isinstance(device, str):
        raise TypeError(f"pin_memory_device must be a str, got {device!r}")
    if device == "cpu":
        return ""
    if device and not _CUDA_DEVICE.fullmatch(device):
        raise ValueError(
            f"pin_memory_device={device!r} is not supported: memory is pinned for CUDA "
            "('cuda' or 'cuda:<index>'), or leave it '' for the current device"
        )
    return device


def _pin_device(device: object, device_id: object) -> tuple[str, int | None]:
    """torch's ``pin_memory_device`` and MXNet Gluon's ``pin_device_id`` (the CUDA device
    whose pinned memory is used), reconciled: ``pin_device_id=N`` means
    ``pin_memory_device='cuda:N'``, and giving both is allowed only when they agree.

    Page-locked memory that CUDA allocates serves every device of the machine (unified
    addressing makes it accessible from all of them, whichever device allocated it), so the
    device is kept, shown and checked, and batches are pinned the same way for any."""
    pin_device = _pin_memory_device(device)
    if device_id is None:
        return pin_device, None
    pin_id = check.non_negative_int("pin_device_id", device_id)
    check.decided_by(
        "pin_device_id", pin_id, "pin_memory_device", pin_device, f"cuda:{pin_id}", unset=""
    )
    return f"cuda:{pin_id}", pin_id


def resolve_seed(seed: object, generator: Any) -> int:
    """The loader's base seed: ``seed`` if given, else drawn as torch draws its base seed.

    From ``generator`` when one is given, else from torch's global generator, so that
    ``torch.manual_seed(s)`` before the loader is made repeats its shuffling and worker seeds.
    If torch was never imported nobody can have seeded it: then a fresh random seed, without
    importing torch (seconds) for it.

    Raises:
        TypeError: ``seed`` is not an int, or ``generator`` is not a ``torch.Generator``.
    """
    if seed is not None:
        return check.to_int("seed", seed)
    torch: Any = sys.modules.get("torch")
    if generator is not None:
        if torch is None or not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {generator!r}")
        return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    if torch is not None:
        return int(torch.empty((), dtype=torch.int64).random_().item())
    return secrets.randbits(_SEED_BITS)


def context_argument(
    multiprocessing_context: object, mp_context: object, *, uses_processes: bool = True
) -> tuple[str, str | BaseContext | None]:
    """torch's ``multiprocessing_context`` or its aioloader alias ``mp_context``, checked.

    Returns ``(the name it was given under, the start method name or context)``.

    Raises:
        ValueError: both given and different; an unknown start method (named); given to a
            loader without worker processes (``uses_processes`` false), as torch refuses it.
        TypeError: neither a start method name nor a context.
    """
    name, value = "multiprocessing_context", multiprocessing_context
    if value is None:
        name, value = "mp_context", mp_context
    elif mp_context is not None and mp_context is not value and mp_context != value:
        raise ValueError(
            "multiprocessing_context and mp_context are the same setting; give one: got "
            f"multiprocessing_context={multiprocessing_context!r}, mp_context={mp_context!r}"
        )
    if isinstance(value, str):
        methods = mp.get_all_start_methods()
        if value not in methods:
            raise ValueError(f"{name}={value!r} is not a start method here; use one of {methods}")
    elif value is not None and not isinstance(value, BaseContext):
        raise TypeError(f"{name} must be a start method name or a context, got {value!r}")
    if value is not None and not uses_processes:
        raise ValueError(
            f"{name}={value!r} needs worker processes (num_workers > 0, thread_pool=False), "
            "as in torch"
        )
    return name, value


@dataclass(frozen=True, slots=True)
class Sampling:
    """Which indices a map-style loader visits, and the samplers it shows as attributes.

    Attributes:
        batches: the batch sampler the loader iterates (``None`` for an iterable dataset).
        sampler: the index sampler (``loader.sampler``): the user's, the one the loader made,
            or the one inside the user's batch sampler.
        batch_sampler: ``loader.batch_sampler``: ``None`` without automatic batching.
        built: whether the loader made the index sampler, and so drives its ``set_epoch``.
        check: turns each batch of ``batches`` into plain int indices (None: they are).
    """

    batches: Iterable[Any] | None
    sampler: Any
    batch_sampler: Any
    built: bool
    check: IndexCheck | None


def _iterable(batches: object) -> bool:
    """Whether ``iter()`` takes ``batches``: ``__iter__``, or the sequence protocol
    (``__getitem__`` from 0 until ``IndexError``), as torch's DataLoader iterates it."""
    return isinstance(batches, Iterable) or callable(getattr(type(batches), "__getitem__", None))


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
    shard: Shard | None = None,
    share_seed: int = 0,
) -> Sampling:
    """The samplers of a loader (see :class:`Sampling`), from torch's and MXNet's arguments.

    ``batch_size=None`` without a batch sampler turns automatic batching off: the loader then
    iterates batches of one key (an index, or what a sampler of the user's yields: a list of
    indices is read by one ``dataset[key]`` call, as torch reads it).

    With a ``shard`` and no sampler given, the default sampler reads that rank's share: a
    :class:`DistributedSampler` that pads by wrapping around (trims with
    ``last_batch='discard'``, as torch's ``drop_last=True``), so every rank gets as many
    batches. Shuffled, it is seeded by ``share_seed``: the loader passes an explicit ``seed=``,
    else :data:`aioloader._sampling.DEFAULT_SHARE_SEED`, so that every rank agrees on the
    order without talking to the others.

    Raises:
        ValueError: arguments that exclude each other (``sampler`` with ``shuffle``,
            ``batch_sampler`` with ``batch_size``/``shuffle``/``sampler``/``drop_last``, a
            sampler or shuffle with an iterable dataset, ``batch_size=None`` with
            ``drop_last``, ...), each named with its value.
    """
    shuffle = False if shuffle is None else check.flag("shuffle", shuffle)
    if batch_size is None and batch_sampler is None and (drop_last or last_batch is not None):
        # Without batching every batch is one sample: no batch is ever incomplete.
        raise ValueError(
            "batch_size=None turns automatic batching off and excludes drop_last and "
            f"last_batch (got drop_last={drop_last!r}, last_batch={last_batch!r})"
        )
    if kind in ("iterable", "async_iterable"):
        if shuffle or sampler is not None or batch_sampler is not None:
            raise ValueError(
                "shuffle, sampler and batch_sampler do not apply to an iterable dataset "
                f"({type(dataset).__name__}); shuffle inside the stream instead"
            )
        if policy == "rollover":
            raise ValueError("last_batch='rollover' needs a map-style dataset")
        return Sampling(None, None, None, built=True, check=None)
    if batch_sampler is not None:
        if batch_size not in (None, 1) or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler excludes batch_size, shuffle, sampler and drop_last "
                f"(got batch_size={batch_size!r}, shuffle={shuffle!r}, "
                f"sampler={sampler!r}, drop_last={drop_last!r})"
            )
        if last_batch is not None:
            raise ValueError(f"batch_sampler excludes last_batch (got {last_batch!r})")
        if not _iterable(batch_sampler):  # (else: at the first epoch, unnamed)
            raise TypeError(
                "batch_sampler must be an iterable of batches (lists of indices), got "
                f"{batch_sampler!r}"
            )
        inner = getattr(batch_sampler, "sampler", None)  # torch's and ours have one
        return Sampling(
            batch_sampler,
            inner if inner is not None else SequentialSampler(dataset),
            batch_sampler,
            built=False,
            check=IndexCheck("batch_sampler", batch_sampler, sharded=True),
        )
    if sampler is not None and shuffle:
        raise ValueError(f"sampler={sampler!r} excludes shuffle=True; shuffle in the sampler")
    built = sampler is None
    if sampler is None and shard is not None:
        sampler = DistributedSampler(
            dataset,
            shard.replicas,
            shard.rank,
            shuffle=shuffle,
            seed=share_seed if shuffle else 0,
            drop_last=policy == "discard",
        )
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
    batches = BatchSampler(sampler, batch_size or 1, policy)
    # Without batching, each thing the sampler yields is one key, a list of indices too: read
    # by one dataset[key] call (torch's bulk read). An async dataset's items are awaited one
    # index at a time, so its sampler yields indices.
    bulk_keys = batch_size is None and kind == "map"
    return Sampling(
        batches,
        sampler,
        batches if batch_size is not None else None,
        built=built,
        # The loader's own samplers yield plain ints: their batches need no check.
        check=None if built else IndexCheck("sampler", sampler, sharded=False, bulk=bulk_keys),
    )
