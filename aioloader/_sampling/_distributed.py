"""Distributed training: which share of the data this process reads, and who decides it.

The only module that asks ``torch.distributed`` anything (the samplers ask through it). A loader
built while a process group of world size ``R > 1`` is initialised reads rank ``r``'s share:

- map-style data with no sampler of the user's: a :class:`~aioloader.DistributedSampler` over
  the indices (disjoint across ranks, padded by wrapping so every rank gets as many batches;
  ``last_batch='discard'`` trims instead), shuffled from a seed all ranks agree on without
  communicating (see below);
- an iterable stream: rank ``r`` keeps items ``r, r + R, ...``; each of its ``W`` workers
  every ``R * W``-th of the stream (see :func:`stream_share`);
- a sampler of the user's: used as it is; one that is not rank-aware (no ``num_replicas`` and
  ``rank``, as a DistributedSampler has) is warned about, since every rank would read all of it.

``DataLoader(shard=...)`` chooses: ``None`` (automatic, as above), ``True`` (the same, but a
missing process group or a sampler that cannot be sharded is an error) or ``False`` (never;
every rank reads what it is given).

Sharp edges, each deliberate:

- **Decided at construction, or at the first use after the group appears.** The process group
  is looked up when the loader is built: DDP scripts call ``init_process_group`` first (they
  need the rank to pick a device). A loader built before the group exists (a script handing it
  to Lightning's ``fit()`` or to accelerate, which make the group later) looks again at its
  first ``len()`` and epoch, and takes its share once the group is there, if it has not run an
  epoch yet; one that has keeps reading everything and says so with a warning
  (:func:`warn_if_group_appeared`).
- **No collective.** A shuffled share needs the same order on every rank. It is seeded by the
  loader's ``seed=`` when one is given (the same on every rank, as torch's DistributedSampler
  requires its ``seed``), else by :data:`DEFAULT_SHARE_SEED` (torch's DistributedSampler
  default), and varies by epoch. A seed drawn per process (torch's global generator, or at
  random) could differ between ranks and make the shares overlap, and agreeing on one would
  take a collective at construction, which waits forever on a loader built on some ranks
  only (evaluation on rank 0). Such a loader then reads its rank's share: pass ``shard=False``.
  The loader's own ``seed`` still seeds the workers' per-batch randomness on each rank.
- **A data-parallel group.** With tensor or pipeline parallelism, ranks that must see the
  same batch are not data-parallel peers: ``shard=dp_group`` (a ``ProcessGroup``) shares the
  data over that group's ranks, by its rank and size (Mosaic's ``replication``): the ranks of
  one model-parallel group have the same data-parallel rank, so they read the same batches,
  and draw the same per-batch randomness in their workers (:func:`rank_seed`).
- **Streams end together** (:mod:`._lockstep`): an iterable's share cannot be padded (its
  length is unknown until it ends), so under ``equal_steps`` (the default for a stream the
  loader shards) the ranks agree on the epoch's end, a few batches ahead of the consumer.
- **A stream that shards itself by rank is the user's to declare** (``shard=False``): nothing
  shows from outside that a dataset reads ``torch.distributed.get_rank()``. One that shards
  itself by worker (it asks ``get_worker_info()``) is still split by rank here.
- **A split stream must be ordered alike by every reader.** Each reader reads the whole
  stream and keeps its items (:func:`every_nth`), so the copies must yield the same items in
  the same order: workers read it under a random state of the stream's own
  (``_workers._info.StreamRandom``, seeded from the seed the ranks share), and each notes the
  first items it saw (:func:`first_items_noted`); :class:`StreamOrders` compares the workers'
  notes and warns where they differ. Readers take items by ``next()`` alone
  (:func:`one_by_one`): a stream that is its own iterator restarts at every ``iter()``.
"""

from __future__ import annotations

import itertools
import sys
import warnings
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from .._errors import StreamOrderWarning
from .._log import distributed_log
from .._tree import iter_leaves
from .._validate import boolean

__all__ = [
    "DEFAULT_SHARE_SEED",
    "ORDER_CHECK_ITEMS",
    "RankAware",
    "Shard",
    "StreamOrders",
    "every_nth",
    "every_nth_async",
    "first_items_noted",
    "item_digest",
    "one_by_one",
    "orders_agree",
    "process_group",
    "rank_aware",
    "rank_seed",
    "resolve_shard",
    "stream_items",
    "stream_share",
    "warn_if_group_appeared",
]

T = TypeVar("T")

# The order of a shuffled share when the loader is given no seed: the same on every rank and
# every run (torch's DistributedSampler's default seed), varied by the epoch.
DEFAULT_SHARE_SEED = 0

# How many wrappers (a batch sampler around a sampler, a sharded batch sampler around that) are
# looked through to find a rank-aware sampler. Deeper nesting is not built by anyone.
_WRAPPER_DEPTH = 4


@dataclass(frozen=True, slots=True)
class Shard:
    """This process's share of the data: rank ``rank`` of ``replicas``.

    ``members``: the global ranks that share the data, in group rank order (the default
    group's ``0 .. replicas - 1``, or a data-parallel group's); ``given``: the share is a
    group the user passed (``shard=group``), whose rank also seeds the workers."""

    rank: int
    replicas: int
    members: tuple[int, ...] | None = None
    given: bool = False


@runtime_checkable
class RankAware(Protocol):
    """A sampler that reads one rank's share itself (torch's or aioloader's DistributedSampler)."""

    num_replicas: int
    rank: int


def process_group() -> tuple[int, int] | None:
    """``(rank, world size)`` of the initialised default process group, or None."""
    # A process group can only exist if torch.distributed was imported, so there is no need to
    # import torch (seconds) to find out that there is none.
    dist: Any = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return None


def rank_seed(seed: int, shard: Shard | None = None) -> int:
    """The base seed of this rank's worker processes: ``seed`` itself without a process group
    and on rank 0, another 64-bit seed on each other rank.

    Every rank is given the same ``seed=`` (its shares are shuffled by it), and each rank's
    batches are numbered from 0: seeded from (seed, epoch, batch) alone, batch ``b`` of every
    rank would draw the same augmentations. Lightning mixes the rank into worker seeds for the
    same reason. Decided when a dataset copy is made (each epoch's, with
    ``persistent_workers=False``), so a group made after the loader counts from then on.
    A data-parallel group given as ``shard`` counts by its rank instead: the ranks of one
    model-parallel group read the same batches and must draw the same randomness for them."""
    group = process_group()
    rank = shard.rank if shard is not None and shard.given else (group or (0, 1))[0]
    if rank == 0:
        return seed
    return (seed ^ (rank * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF


def rank_aware(sampler: object) -> bool:
    """Whether ``sampler``, or a sampler it wraps, reads one rank's share itself."""
    for _ in range(_WRAPPER_DEPTH):
        if sampler is None:
            return False
        if isinstance(sampler, RankAware):
            return True
        inner = getattr(sampler, "sampler", None)
        sampler = inner if inner is not None else getattr(sampler, "batch_sampler", None)
    return False


def resolve_shard(
    shard: object, kind: str, sampler: object, batch_sampler: object, dataset: object
) -> Shard | None:
    """The share the loader applies itself (None: all of the data, or the user's sampler's).

    Logs the decision once (INFO, ``aioloader.distributed``) and warns about a sampler that is
    not rank-aware (see the module docstring).

    ``shard`` may also be a ``torch.distributed`` process group: the data-parallel group whose
    ranks share the data (see the module docstring).

    Raises:
        TypeError: ``shard`` is not None, True, False or a process group.
        ValueError: ``shard=True`` without an initialised process group, or with a sampler
            that is not rank-aware; a group this process is not a member of.
    """
    given = _group_share(shard)
    if given is not None:
        return _given_share(given, kind, sampler, batch_sampler, dataset)
    if shard is not None:
        try:
            shard = boolean("shard", shard)
        except TypeError:
            message = (
                f"shard must be None (automatic), True, False or a torch.distributed "
                f"process group (the data-parallel group), got {shard!r}"
            )
            raise TypeError(message) from None
    if shard is False:
        return None
    group = process_group()
    if group is None:
        if shard:
            raise ValueError(
                "shard=True needs an initialised torch.distributed process group: call "
                "init_process_group before building the DataLoader"
            )
        return None
    rank, world = group
    if world == 1:
        return None
    name = type(dataset).__name__
    given = ("sampler", sampler) if sampler is not None else ("batch_sampler", batch_sampler)
    map_style = kind in ("map", "async_map")
    if given[1] is not None:
        if not map_style:
            return None  # a sampler with an iterable dataset is refused by the config's checks
        if rank_aware(given[1]):
            return None
        if shard:
            raise ValueError(
                f"shard=True cannot shard {given[0]}={given[1]!r}: it is not rank-aware (it "
                "has no num_replicas and rank); pass a DistributedSampler instead"
            )
        warnings.warn(
            f"{given[0]}={given[1]!r} is not rank-aware (it has no num_replicas and rank, as "
            f"a DistributedSampler has): with torch.distributed at world size {world}, every "
            "rank will read all of it. Pass aioloader.DistributedSampler(dataset) (or "
            "torch's) instead, or shard=False to keep it and silence this warning",
            UserWarning,
            stacklevel=3,
        )
        return None
    if map_style:
        how = "its DistributedSampler share of each epoch"
    else:
        how = f"1 item in {world} of the stream"
    distributed_log.info(
        "DataLoader of %s shards by rank: rank %d of world size %d reads %s "
        "(shard=False turns this off)",
        name,
        rank,
        world,
        how,
    )
    return Shard(rank, world, tuple(range(world)))


def _group_share(shard: object) -> Any:
    """``shard`` if it is a ``torch.distributed`` process group, else None."""
    dist: Any = sys.modules.get("torch.distributed")
    group_type = getattr(dist, "ProcessGroup", None) if dist is not None else None
    if group_type is not None and isinstance(shard, group_type):
        return shard
    return None


def _given_share(
    group: Any, kind: str, sampler: object, batch_sampler: object, dataset: object
) -> Shard:
    """The share of this rank in the data-parallel ``group`` (``shard=group``)."""
    dist: Any = sys.modules["torch.distributed"]
    rank, world = int(dist.get_rank(group)), int(dist.get_world_size(group))
    if rank < 0:
        raise ValueError(
            f"shard={group!r}: this process (global rank {dist.get_rank()}) is not a member "
            "of that group; pass each rank its own data-parallel group"
        )
    members = tuple(int(r) for r in dist.get_process_group_ranks(group))
    given = sampler if sampler is not None else batch_sampler
    if given is not None and kind in ("map", "async_map"):
        raise ValueError(
            f"shard={group!r} cannot shard a sampler of yours ({given!r}): give the loader no "
            "sampler (it then reads the group's share), or pass shard=False with a "
            f"DistributedSampler(dataset, num_replicas={world}, rank={rank})"
        )
    distributed_log.info(
        "DataLoader of %s shards by the given group: group rank %d of %d (global ranks %s) "
        "reads %s",
        type(dataset).__name__,
        rank,
        world,
        list(members),
        "its DistributedSampler share of each epoch"
        if kind in ("map", "async_map")
        else f"1 item in {world} of the stream",
    )
    return Shard(rank, world, members, given=True)


def warn_if_group_appeared(dataset: object) -> None:
    """At a loader's first iteration: warn if a process group of world size > 1 exists now
    although none did when the loader (with ``shard=None``) was built."""
    group = process_group()
    if group is None or group[1] == 1:
        return
    warnings.warn(
        f"this DataLoader of {type(dataset).__name__} was built before "
        "torch.distributed.init_process_group, so it does not shard by rank: each of the "
        f"{group[1]} ranks reads all of it. Build it after init_process_group, or pass "
        "shard=False to keep it so and silence this warning",
        UserWarning,
        stacklevel=2,
    )


def stream_items(shard: Shard | None, n: int) -> int:
    """How many of a stream's ``n`` items the rank of ``shard`` reads (all without one)."""
    if shard is None:
        return n
    return (n - shard.rank + shard.replicas - 1) // shard.replicas


def stream_share(shard: Shard | None, worker: int, workers: int) -> tuple[int, int]:
    """``(start, step)``: the items of a stream one reader keeps.

    Reader ``worker`` of ``workers`` on rank ``r`` of ``R`` keeps items ``start, start + step,
    ...`` with ``start = worker * R + r`` and ``step = R * workers``: every (rank, worker) pair
    gets a disjoint share, together they read each item once, and a rank's share is items
    ``r, r + R, r + 2R, ...`` whatever its number of workers (threads read it whole). A stream
    that shards itself by worker is read with ``worker=0, workers=1`` (the rank split only).
    """
    rank, replicas = (shard.rank, shard.replicas) if shard is not None else (0, 1)
    return worker * replicas + rank, replicas * workers


def every_nth(stream: Iterator[T], start: int, step: int) -> Iterator[T]:
    """The items of ``stream`` at positions ``start, start + step, ...`` (all with step 1)."""
    if step == 1:
        return stream
    return _every_nth(stream, start, step)


def one_by_one(stream: Iterator[T]) -> Iterator[T]:
    """The items of ``stream`` by ``next()`` alone, as torch reads a stream. ``for item in
    stream`` calls ``iter(stream)`` first, and a dataset that is its own iterator restarts
    there where its ``__iter__`` reopens what it reads (a file) and returns ``self``."""
    while True:
        try:
            item = next(stream)
        except StopIteration:
            return
        yield item


def _every_nth(stream: Iterator[T], start: int, step: int) -> Iterator[T]:
    for position, item in enumerate(one_by_one(stream)):
        if position % step == start:
            yield item


def every_nth_async(stream: AsyncIterator[T], start: int, step: int) -> AsyncIterator[T]:
    """:func:`every_nth` of an async stream; closing the result closes ``stream``."""
    if step == 1:
        return stream
    return _every_nth_async(stream, start, step)


async def _every_nth_async(stream: AsyncIterator[T], start: int, step: int) -> AsyncIterator[T]:
    position = 0
    try:
        async for item in stream:
            if position % step == start:
                yield item
            position += 1
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


# Items at the head of a stream each worker notes, when every worker reads the whole stream
# and keeps its share: the workers' notes are compared (:func:`orders_agree`), since the split
# is exact only if every copy yields the same items in the same order. Eight digests make a
# chance agreement of two shuffled orders negligible; the digests cost a few microseconds each.
ORDER_CHECK_ITEMS = 8
# Elements of an array or tensor (bytes of a bytes, characters of a string) a digest reads, and
# the leaves of an item it reads at most: the head is enough to tell samples apart.
_DIGEST_ELEMENTS = 64
_DIGEST_LEAVES = 64


def first_items_noted(stream: Iterator[T], notes: list[int]) -> Iterator[T]:
    """``stream`` as it is, appending the digest of each of its first
    :data:`ORDER_CHECK_ITEMS` items to ``notes`` as it passes."""
    for item in one_by_one(stream):
        if len(notes) < ORDER_CHECK_ITEMS:
            notes.append(item_digest(item))
        yield item


def orders_agree(one: tuple[int, ...], other: tuple[int, ...]) -> bool:
    """Whether two readers saw the same items at the head of a stream, as far as both read."""
    common = min(len(one), len(other))
    return one[:common] == other[:common]


def item_digest(item: Any) -> int:
    """A digest of ``item`` that is the same in every process for equal data: numbers, and the
    head of strings, bytes and numeric arrays or tensors, by value; other objects by type alone
    (their pickles and reprs may hold addresses).

    Bounded whatever the item: at most :data:`_DIGEST_LEAVES` leaves, the first
    :data:`_DIGEST_ELEMENTS` bytes, characters or elements of each (an array's first row,
    never a copy of the whole), and never an error: a leaf that cannot be read counts by type.
    """
    digest = 0
    for leaf in itertools.islice(iter_leaves(item), _DIGEST_LEAVES):
        try:
            data = _leaf_bytes(leaf)
        except Exception:  # a shape that is no shape, a property that raises, ...
            data = type(leaf).__qualname__.encode()
        digest = zlib.crc32(data, digest)
    return digest


def _leaf_bytes(leaf: Any) -> bytes:
    if leaf is None or isinstance(leaf, bool | int | float | complex):
        return repr(leaf).encode()
    if isinstance(leaf, str):
        return b"%d:" % len(leaf) + leaf[:_DIGEST_ELEMENTS].encode()
    if isinstance(leaf, bytes | bytearray):
        return b"%d:" % len(leaf) + bytes(leaf[:_DIGEST_ELEMENTS])
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        return type(leaf).__qualname__.encode()
    described = f"{type(leaf).__qualname__}{tuple(shape)}{dtype}".encode()
    try:
        # The first row: a view, then a copy of at most _DIGEST_ELEMENTS elements.
        head = leaf[(0,) * (len(shape) - 1)][:_DIGEST_ELEMENTS] if len(shape) else leaf
        if hasattr(head, "detach"):  # a tensor (torch is not imported for this)
            head = head.detach().cpu().contiguous().numpy()
        head = np.ascontiguousarray(head)
        if head.dtype.kind not in "biufc":  # objects: their bytes are addresses
            return described
        return described + bytes(head.tobytes())
    except Exception:  # sparse, a dtype numpy lacks (bfloat16), ...: shape and dtype alone
        return described


class StreamOrders:
    """What each worker saw at the head of one epoch's stream (:func:`first_items_noted`),
    checked as the workers' first batches arrive.

    Workers that saw different items split the stream inexactly: warn, at most once an epoch
    (Python's default filter shows it once a process), with
    :class:`~aioloader.StreamOrderWarning` (raised in the batch's turn where warnings are
    errors). Values that differ in the same order (a timestamp, noise drawn from an unseeded
    generator) warn too: from outside the two cannot be told apart, and the message says so.
    """

    __slots__ = ("_seen", "_warned", "_what", "_workers")

    def __init__(self, what: str, workers: int) -> None:
        self._what = what
        self._workers = workers
        self._seen: list[tuple[int, ...]] = []
        self._warned = False

    def note(self, order: tuple[int, ...]) -> None:
        """Check ``order`` against the other workers' (a reader's first batch of the epoch).

        Raises:
            StreamOrderWarning: where the warnings filter turns it into an error.
        """
        disagree = any(not orders_agree(order, theirs) for theirs in self._seen)
        self._seen.append(order)
        if disagree and not self._warned:
            self._warned = True
            warnings.warn(
                StreamOrderWarning(
                    f"the workers read different items at the head of the stream of "
                    f"{self._what}: each of the {self._workers} workers reads the whole stream "
                    "and keeps its share, so items are lost and repeated unless every worker's "
                    "copy yields the same items in the same order. Draw its order from random, "
                    "numpy.random or torch's global generator (seeded alike in every worker "
                    "while the stream is read) or from a generator with a fixed seed, or shard "
                    "it yourself with get_worker_info(). (Items that differ between workers "
                    "in the same order, such as a timestamp, warn too and lose nothing: "
                    "ignore StreamOrderWarning then.)"
                ),
                stacklevel=2,
            )
