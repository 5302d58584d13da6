"""Samplers: which dataset indices an epoch visits, in which order, and how they form batches.

Everything here is pure and deterministic: no event loop, no threads, no processes, no global
random state after construction. A sampler yields ``int`` indices; a batch sampler yields
``list[int]``; a sharded batch sampler yields ``list[list[int]]`` (one index list per device).
torch's samplers follow the same conventions and may be used wherever these are::

    SequentialSampler / RandomSampler / DistributedSampler   (or any iterable of ints)
        │ indices
        ▼
    BatchSampler(last_batch="keep" | "discard" | "rollover")  (or torch's BatchSampler)
        │ list[int]
        ▼
    ShardedBatchSampler(num_shards)                            (optional)
        │ list[list[int]]
        ▼
    the loader

This module holds the index samplers. The batch samplers and their last-batch policy live in
:mod:`._batch_sampler`; this module re-exports them, so callers import every sampler
from ``_sampler``. Arguments and loaded states are checked by :mod:`aioloader._validate`.

Sharp edges, each deliberate:

- **Each ``__iter__`` consumes one epoch.** :class:`RandomSampler` (without a ``generator``) and
  :class:`DistributedSampler` order an epoch as a pure function of ``(seed, epoch)``. Calling
  ``iter()`` uses the current epoch and moves on to the next one, so a training loop that never
  calls ``set_epoch`` still gets a new order every epoch (torch's DistributedSampler repeats the
  same order in that case). ``set_epoch(e)`` sets the epoch of the next ``iter()`` only, which
  then moves on to ``e + 1``: torch's sampler keeps ``e`` until told another, so two ``iter()``
  after one ``set_epoch(e)`` give epoch ``e``'s order twice there and epochs ``e`` and ``e + 1``
  here (a loop that calls ``set_epoch`` before every epoch, as torch asks, sees no difference).
  ``iter()`` does its work at once (it draws the whole order), so ``state_dict()`` taken right
  before ``iter()`` describes that iteration completely: restoring it and skipping the batches
  already delivered resumes an epoch exactly.
- **An unseeded RandomSampler takes its seed once, as it is made**, from torch's global
  generator when torch is imported (else Python's ``random``): ``torch.manual_seed(s)`` before
  it repeats its orders, as it repeats torch's, and the seed is then fixed, so epochs replay and
  resume. torch's draws from the global generator at every ``iter()``.
- **The order survives library upgrades.** numpy documents that ``Generator.permutation`` may
  change between versions (NEP 19), while the raw output of ``PCG64`` seeded through
  ``SeedSequence`` is fixed. The permutation is therefore built by sorting raw 64-bit keys, so a
  checkpoint taken under one numpy resumes with the same order under another.
- **Every rank gets the same number of samples.** :class:`DistributedSampler` pads by wrapping
  around the epoch's order (or drops the tail with ``drop_last``), because a rank with one batch
  fewer than the others would leave a collective op waiting forever.
- **The rest of an epoch, on another number of ranks.** A DistributedSampler's state may hold
  ``consumed``: positions of the epoch's order (ranges) already read, by every rank together
  (:func:`consumed_positions` computes them from the batches taken). Its next ``iter()`` then
  shares out the rest of that order, padded or trimmed alike, over its own ``num_replicas``:
  the elastic resume (``aioloader._epoch._resume``). It applies to that one iteration.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

from .._validate import (
    as_torch,
    boolean,
    check_state_keys,
    is_int,
    non_negative_int,
    positive_int,
    to_int,
)
from ._batch_sampler import BatchSampler, LastBatch, ShardedBatchSampler
from ._distributed import process_group

# The checks under the names this module has always exported.
validate_positive_int = positive_int
validate_non_negative_int = non_negative_int

__all__ = [
    "BatchSampler",
    "DistributedSampler",
    "LastBatch",
    "RandomSampler",
    "SequentialSampler",
    "ShardedBatchSampler",
    "consumed_positions",
    "validate_non_negative_int",
    "validate_positive_int",
]


# torch's RandomSampler draws with replacement in chunks of this many indices; drawing the same
# chunks from the same generator is what makes our stream equal to torch's for a given generator.
_TORCH_REPLACEMENT_CHUNK = 32

_SEED_BITS = 63  # a fresh seed fits a signed 64-bit int, so it survives any serializer


# -- argument checks ----------------------------------------------------------------------------


def _length_of(name: str, data_source: object) -> int:
    """The number of samples of a Sized data source, or the int length given instead."""
    if is_int(data_source):
        return non_negative_int(name, data_source)
    if isinstance(data_source, Sized):
        return len(data_source)
    raise TypeError(f"{name} must be a Sized (with __len__) or an int length, got {data_source!r}")


# -- deterministic randomness -------------------------------------------------------------------


def _bit_generator(seed: int, epoch: int) -> np.random.PCG64:
    # SeedSequence mixes both numbers into the full PCG64 state, so neighbouring seeds and
    # neighbouring epochs give unrelated streams. Seeds equal modulo 2**64 are the same seed.
    return np.random.PCG64(np.random.SeedSequence([seed % 2**64, epoch]))


def _permutation(bits: np.random.PCG64, n: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    """A uniformly random permutation of ``range(n)`` drawn from ``bits``.

    Each position gets a raw 64-bit key whose low ``b`` bits (``b`` = bit length of ``n - 1``)
    are replaced by the position itself, so all keys are distinct and any sort algorithm gives
    the same order; after sorting, the low bits are the permutation. Two positions tie on the
    remaining random bits with odds of about ``n**2 / 2**(65 - b)``, and a tie is broken by
    position: a bias far below anything measurable for ``n < 2**32``.
    """
    if n <= 1:
        return np.arange(n, dtype=np.int64)
    low = (n - 1).bit_length()
    mask = np.uint64((1 << low) - 1)
    keys = (bits.random_raw(n) & ~mask) | np.arange(n, dtype=np.uint64)
    keys.sort()
    return (keys & mask).astype(np.int64)


def _draw(
    seed: int, epoch: int, n: int, num_samples: int, replacement: bool
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The indices of one epoch: a pure function of its arguments."""
    if num_samples == 0:
        return np.empty(0, dtype=np.int64)
    bits = _bit_generator(seed, epoch)
    if replacement:
        # Modulo bias is at most n / 2**64: invisible for any real data set.
        return (bits.random_raw(num_samples) % np.uint64(n)).astype(np.int64)
    whole, rest = divmod(num_samples, n)
    parts = [_permutation(bits, n) for _ in range(whole)]
    if rest:
        parts.append(_permutation(bits, n)[:rest])
    return np.concatenate(parts)


def _fresh_seed() -> int:
    """The seed of a :class:`RandomSampler` given neither ``seed`` nor ``generator``.

    Drawn as torch's RandomSampler draws its own: from torch's global generator, so that
    ``torch.manual_seed(s)`` before the sampler is made repeats its order (torch's
    ``test_sampler_reproducibility``). If torch was never imported nobody can have seeded it:
    then from Python's ``random``, so that ``random.seed(s)`` repeats a torch-free program, and
    without importing torch (seconds) for it. Unseeded, both start from fresh entropy.
    """
    torch: Any = sys.modules.get("torch")
    if torch is not None:
        return int(torch.empty((), dtype=torch.int64).random_().item())  # below 2**63
    return random.getrandbits(_SEED_BITS)


# -- samplers -----------------------------------------------------------------------------------


class SequentialSampler:
    """Yields ``0, 1, ..., n-1``: the dataset in its own order.

    Args:
        data_source: the dataset (anything with ``__len__``) or its length as an int. A Sized
            source is measured at every ``iter()``, so a dataset that grows is followed.

    Raises:
        TypeError: if ``data_source`` is neither Sized nor an int.
        ValueError: if ``data_source`` is a negative int.
    """

    def __init__(self, data_source: Sized | int) -> None:
        _length_of("data_source", data_source)
        self.data_source = data_source

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self)))

    def __len__(self) -> int:
        return _length_of("data_source", self.data_source)

    def __repr__(self) -> str:
        return f"SequentialSampler(n={len(self)})"


class RandomSampler:
    """Yields the dataset's indices in a random order that is reproducible from a seed.

    Without a ``generator``, epoch ``e`` is ordered by a pure function of ``(seed, e)``; each
    ``iter()`` uses the current epoch and advances to the next; :meth:`set_epoch` sets the
    epoch of the next ``iter()`` only (see the module docstring).
    With a ``torch.Generator``, indices are drawn from it exactly as torch's ``RandomSampler``
    draws them, so both yield the same indices from identically seeded generators; the epoch is
    then recorded but does not affect the order.

    Args:
        data_source: the dataset (anything with ``__len__``) or its length as an int.
        replacement: draw ``num_samples`` indices independently (with repeats).
        num_samples: how many indices an epoch yields; defaults to the dataset's length. Without
            replacement it may exceed the length: whole permutations are repeated, then a part
            of one, as torch does.
        generator: a ``torch.Generator`` to draw from instead of ``(seed, epoch)``.
        seed: the seed of the ``(seed, epoch)`` order. ``None`` draws one at construction
            from torch's global generator (so ``torch.manual_seed`` makes it reproducible, as
            it makes torch's RandomSampler), or from Python's ``random`` module when torch was
            never imported (``random.seed`` then does); it is kept as :attr:`seed` and saved
            by :meth:`state_dict`. torch's sampler draws a new seed at every ``iter()``
            instead, so an epoch of it cannot be replayed or resumed.

    Raises:
        TypeError: if an argument has the wrong type (for ``num_samples`` also a
            ``ValueError``, which torch raises).
        ValueError: if ``num_samples`` is not positive, if both ``generator`` and ``seed`` are
            given, or if samples are asked of an empty dataset.
    """

    def __init__(
        self,
        data_source: Sized | int,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        n = _length_of("data_source", data_source)
        replacement = boolean("replacement", replacement)
        if num_samples is not None:
            # Positive, as torch's: an epoch of no samples asked for is a mistake. (An empty
            # data_source with num_samples left out gives an empty epoch; torch refuses it.)
            num_samples = as_torch(positive_int, "num_samples", num_samples)
            if n == 0:
                raise ValueError(
                    f"num_samples={num_samples} cannot be drawn from an empty data_source"
                )
        if generator is not None:
            _require_torch_generator(generator)
            if seed is not None:
                raise ValueError(
                    f"give generator or seed, not both: got generator={generator!r}, seed={seed!r}"
                )
        self.data_source = data_source
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator
        self.seed: int | None = None
        if generator is None:
            self.seed = _fresh_seed() if seed is None else to_int("seed", seed)
        self._epoch = 0
        self.set_epoch_asked: int | None = None  # the last set_epoch's, until a loader reads it

    @property
    def num_samples(self) -> int:
        """How many indices one epoch yields."""
        if self._num_samples is None:
            return _length_of("data_source", self.data_source)
        return self._num_samples

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` will use."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` use epoch ``epoch`` (a non-negative int). On the sampler
        a loader made (``loader.sampler``), as ``loader.set_epoch(epoch)``."""
        self._epoch = self.set_epoch_asked = non_negative_int("epoch", epoch)

    def __iter__(self) -> Iterator[int]:
        n = _length_of("data_source", self.data_source)
        count = self.num_samples
        if count and not n:
            raise ValueError(f"num_samples={count} cannot be drawn from an empty data_source")
        epoch, self._epoch = self._epoch, self._epoch + 1
        if count == 0:
            return iter(())
        if self.generator is not None:
            return iter(self._from_generator(self.generator, n, count))
        assert self.seed is not None  # set whenever there is no generator
        return iter(_draw(self.seed, epoch, n, count, self.replacement).tolist())

    def _from_generator(self, generator: torch.Generator, n: int, count: int) -> list[int]:
        # The same calls, in the same order and sizes, as torch's RandomSampler makes.
        import torch

        out: list[int] = []
        if self.replacement:
            whole, rest = divmod(count, _TORCH_REPLACEMENT_CHUNK)
            for size in [_TORCH_REPLACEMENT_CHUNK] * whole + [rest]:
                draws = torch.randint(n, (size,), dtype=torch.int64, generator=generator)
                out.extend(draws.tolist())
            return out
        whole, rest = divmod(count, n)
        for _ in range(whole):
            out.extend(torch.randperm(n, generator=generator).tolist())
        out.extend(torch.randperm(n, generator=generator).tolist()[:rest])
        return out

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, Any]:
        """Where the next ``iter()`` starts: the seed and epoch, or the generator's state."""
        if self.generator is not None:
            return {"epoch": self._epoch, "generator_state": self.generator.get_state()}
        return {"seed": self.seed, "epoch": self._epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next ``iter()`` repeats the one it described."""
        if self.generator is not None:
            state = check_state_keys("RandomSampler", state, {"epoch", "generator_state"})
            epoch = non_negative_int("epoch", state["epoch"])
            self.generator.set_state(state["generator_state"])
        else:
            state = check_state_keys("RandomSampler", state, {"seed", "epoch"})
            epoch = non_negative_int("epoch", state["epoch"])
            self.seed = to_int("seed", state["seed"])
        self._epoch = epoch

    def __repr__(self) -> str:
        source = "generator" if self.generator is not None else f"seed={self.seed}"
        return (
            f"RandomSampler(n={_length_of('data_source', self.data_source)}, "
            f"num_samples={self.num_samples}, replacement={self.replacement}, {source}, "
            f"epoch={self._epoch})"
        )


def _require_torch_generator(generator: object) -> None:
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {generator!r}")


def _from_environment(variable: str, default: int) -> int:
    raw = os.environ.get(variable)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {variable} must be an int, got {raw!r}") from None


class DistributedSampler:
    """Gives each rank of a distributed job its own, equally long share of every epoch.

    The epoch's order (shuffled from ``(seed, epoch)``, or sequential) is padded by wrapping
    around to a multiple of ``num_replicas`` (or cut to one with ``drop_last``), and rank ``r``
    takes every ``num_replicas``-th index starting at ``r``, as torch's DistributedSampler does.
    All ranks must use the same ``seed``; each ``iter()`` uses the current epoch and advances
    to the next, and :meth:`set_epoch` sets the epoch of the next ``iter()`` only (torch's
    keeps it: see the module docstring). Shuffled, the order is this module's permutation of
    ``(seed, epoch)``, not the one torch's ``DistributedSampler`` draws for the same seed and
    epoch; unshuffled, the shares and the padding are torch's.

    Args:
        dataset: the dataset (anything with ``__len__``) or its length as an int.
        num_replicas: the number of ranks. Defaults to the world size of the initialised
            ``torch.distributed`` process group, else the ``WORLD_SIZE`` environment variable,
            else 1.
        rank: this process's rank, in ``[0, num_replicas)``. Defaults likewise to the process
            group's rank, else ``RANK``, else 0.
        shuffle: shuffle each epoch; with False every epoch is ``0, 1, ..., n-1`` (sharded).
        seed: the seed shared by all ranks.
        drop_last: drop the tail that does not divide evenly instead of padding with repeats.

    Raises:
        TypeError: if an argument has the wrong type.
        ValueError: if ``num_replicas`` is not positive or ``rank`` is out of range (including
            values read from the environment).
    """

    def __init__(
        self,
        dataset: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        _length_of("dataset", dataset)
        group = process_group()
        if num_replicas is None:
            num_replicas = group[1] if group is not None else _from_environment("WORLD_SIZE", 1)
        if rank is None:
            rank = group[0] if group is not None else _from_environment("RANK", 0)
        self.num_replicas = positive_int("num_replicas", num_replicas)
        rank = to_int("rank", rank)
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={self.num_replicas}), got {rank}")
        self.dataset = dataset
        self.rank = rank
        self.shuffle = boolean("shuffle", shuffle)
        self.seed = to_int("seed", seed)
        self.drop_last = boolean("drop_last", drop_last)
        self._epoch = 0
        self.set_epoch_asked: int | None = None  # the last set_epoch's, until a loader reads it
        # Ranges of positions of the next iteration's order already read (an elastic resume):
        # the next iter() shares out the rest. Emptied by that iter().
        self._consumed: list[list[int]] = []

    @property
    def num_samples(self) -> int:
        """How many indices each rank gets per epoch (of the rest, after a resume)."""
        n = len(_rest(_length_of("dataset", self.dataset), self._consumed))
        if self.drop_last:
            return n // self.num_replicas
        return -(-n // self.num_replicas)

    @property
    def total_size(self) -> int:
        """The number of indices of an epoch over all ranks, padding included."""
        return self.num_samples * self.num_replicas

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` will use."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` use epoch ``epoch``; give every rank the same value. On
        the sampler a loader made (``loader.sampler``, torch's idiom), as
        ``loader.set_epoch(epoch)``."""
        self._epoch = self.set_epoch_asked = non_negative_int("epoch", epoch)

    def __iter__(self) -> Iterator[int]:
        n = _length_of("dataset", self.dataset)
        total = self.total_size
        epoch, self._epoch = self._epoch, self._epoch + 1
        positions = _rest(n, self._consumed)
        self._consumed = []
        if self.shuffle and n:
            order = _draw(self.seed, epoch, n, n, replacement=False)[positions]
        else:
            order = positions
        if total > len(order) and len(order):
            # Wrap around as many times as needed (more than once only when n < num_replicas).
            order = np.resize(order, total)
        mine = order[self.rank : total : self.num_replicas]
        return iter(mine.tolist())

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, Any]:
        """Where the next ``iter()`` starts: the seed and the epoch (and, resumed on another
        number of ranks, the positions of its order already read)."""
        state: dict[str, Any] = {"seed": self.seed, "epoch": self._epoch}
        if self._consumed:
            state["consumed"] = [list(r) for r in self._consumed]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next ``iter()`` repeats the one it described."""
        state = check_state_keys("DistributedSampler", state, {"seed", "epoch"})
        epoch = non_negative_int("epoch", state["epoch"])
        consumed = check_ranges(
            "DistributedSampler state 'consumed'",
            state.get("consumed", []),
            _length_of("dataset", self.dataset),
        )
        self.seed = to_int("seed", state["seed"])
        self._epoch = epoch
        self._consumed = consumed

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(n={_length_of('dataset', self.dataset)}, "
            f"rank={self.rank}, num_replicas={self.num_replicas}, shuffle={self.shuffle}, "
            f"seed={self.seed}, drop_last={self.drop_last}, epoch={self._epoch})"
        )


# -- the rest of an epoch (elastic resume) --------------------------------------------------------


def _rest(n: int, consumed: list[list[int]]) -> np.ndarray[Any, np.dtype[np.int64]]:
    """The positions ``0 .. n-1`` of an epoch's order not in the ranges ``consumed``."""
    keep = np.ones(n, dtype=bool)
    for start, stop in consumed:
        keep[start:stop] = False
    return np.flatnonzero(keep).astype(np.int64)


def _as_ranges(positions: np.ndarray[Any, Any]) -> list[list[int]]:
    """Sorted distinct positions as ``[start, stop)`` ranges (a prefix is one range)."""
    if not len(positions):
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(positions)]))
    return [
        [int(positions[a]), int(positions[b - 1]) + 1] for a, b in zip(starts, stops, strict=True)
    ]


def check_ranges(name: str, ranges: object, n: int) -> list[list[int]]:
    """``ranges`` as ``[[start, stop], ...]`` within ``0 .. n``, or a clear error naming it."""
    if not isinstance(ranges, list | tuple):
        raise TypeError(f"{name} must be a list of [start, stop] ranges, got {ranges!r}")
    out = []
    for item in ranges:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or not all(map(is_int, item))
            or not 0 <= int(item[0]) < int(item[1]) <= n
        ):
            raise ValueError(
                f"{name} must hold [start, stop] ranges with 0 <= start < stop <= {n} (the "
                f"dataset's length), got {item!r}"
            )
        out.append([int(item[0]), int(item[1])])
    return out


def consumed_positions(
    sampler: DistributedSampler,
    state: dict[str, Any],
    done: list[int],
    batch_size: int,
) -> list[list[int]]:
    """The positions of an epoch's order read once every rank of ``sampler.num_replicas``
    took the batches ``done`` of it, as ranges (with those read before the epoch began, in
    ``state``: the sampler's state before its ``iter()``).

    Rank ``r`` reads position ``r + R * j`` of the epoch's (padded) rest for its ``j``-th
    index, batch ``b`` being its indices ``b * batch_size`` up to the next batch's; a padded
    position repeats an earlier one, whose sample was then read.
    """
    n = _length_of("dataset", sampler.dataset)
    replicas = sampler.num_replicas
    rest = _rest(n, check_ranges("consumed", state.get("consumed", []), n))
    m = len(rest)
    per_rank = m // replicas if sampler.drop_last else -(-m // replicas)
    total = per_rank * replicas
    padded = np.resize(rest, total) if total > m and m else rest[:total]
    read = [
        np.arange(b * batch_size, min((b + 1) * batch_size, per_rank), dtype=np.int64) for b in done
    ]
    js = np.concatenate(read) if read else np.empty(0, dtype=np.int64)
    taken = (np.arange(replicas, dtype=np.int64)[:, None] + replicas * js[None, :]).ravel()
    before = np.setdiff1d(np.arange(n, dtype=np.int64), rest, assume_unique=True)
    return _as_ranges(np.union1d(before, padded[taken]))
