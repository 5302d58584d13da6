"""Batch samplers: how the indices of an epoch are grouped into batches, and batches into shards.

:class:`BatchSampler` turns any iterable of ints into ``list[int]`` batches under a last-batch
policy (MXNet Gluon's ``last_batch``, or torch's ``drop_last``); :class:`ShardedBatchSampler`
splits each batch into ``list[list[int]]``, one part per device. Both are pure and
deterministic, like the index samplers of :mod:`._sampler`, which re-exports them.

Arguments and loaded states are checked by :mod:`aioloader._validate`, as everywhere.

Sharp edges, each deliberate:

- **Rollover is committed when the epoch's end is seen.** With ``last_batch="rollover"`` the
  incomplete last batch is not yielded; its indices start the next iteration. The batch sampler
  reads one batch ahead, so the carry is known (and ``len()`` already describes the next epoch)
  when the final full batch is handed out, even to a consumer that stops after ``len()`` batches.
  An iteration abandoned earlier leaves the previous carry in place, so nothing is lost.
- **torch's positional ``drop_last``.** A bool as the third positional argument is read as
  ``drop_last``, so ``BatchSampler(sampler, 32, False)`` means what it means in torch; giving
  both spellings is allowed only when they agree.
- **The sampler's iteration starts at ``iter()``**, not at the first ``next()``, so a
  ``state_dict()`` taken before ``iter()`` describes the whole iteration.
- **No empty shards.** A batch with fewer indices than shards yields one shard per index.
- **bools are not ints here.** ``batch_size=True`` is a bug, never an intent: the checks refuse
  it, while numpy integers are accepted (:mod:`aioloader._validate`'s rule).
- **Indices are integers, in whatever container.** :class:`IndexCheck` turns what a sampler or
  batch sampler yields (a list, a numpy array or torch tensor of integers, numpy or torch
  integer scalars) into plain ``list[int]`` before a batch is scheduled, and refuses anything
  else with an error naming the sampler, the batch and the value. torch accepts any key a
  dataset takes; integer indices are what every aioloader dataset kind and worker speaks.
- **Without automatic batching a sampler's list of indices is one key** (torch's bulk read):
  with ``batch_size=None`` each thing a sampler yields is passed to ``dataset[key]`` as it is,
  and a list (numpy array, tensor) of indices travels as a :class:`BulkKey`, so that it is never
  taken for the shards of a batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sized
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

from .._types import Stateful
from .._validate import as_torch, boolean, check_state_keys, is_int, one_of, positive_int

__all__ = [
    "BatchSampler",
    "BulkKey",
    "IndexCheck",
    "LastBatch",
    "ShardedBatchSampler",
    "resolve_last_batch",
]

LastBatch = Literal["keep", "discard", "rollover"]
_LAST_BATCH_POLICIES: tuple[str, ...] = get_args(LastBatch)


# -- batches ------------------------------------------------------------------------------------


def resolve_last_batch(last_batch: object, drop_last: object) -> LastBatch:
    # torch's BatchSampler takes drop_last as its third positional argument, so a bool there is
    # read as drop_last: ``BatchSampler(sampler, 32, False)`` means what it means in torch.
    if isinstance(last_batch, bool):
        if drop_last is not None:
            raise ValueError(
                f"drop_last given twice: positionally as {last_batch!r} and as "
                f"drop_last={drop_last!r}"
            )
        last_batch, drop_last = None, last_batch
    if drop_last is not None:
        drop_last = as_torch(boolean, "drop_last", drop_last)
    if last_batch is not None:
        one_of("last_batch", last_batch, _LAST_BATCH_POLICIES)
    implied = None if drop_last is None else ("discard" if drop_last else "keep")
    if last_batch is not None and implied is not None and last_batch != implied:
        raise ValueError(
            f"last_batch={last_batch!r} conflicts with drop_last={drop_last!r} "
            f"(drop_last={drop_last!r} means last_batch={implied!r}); give only one"
        )
    chosen = last_batch if last_batch is not None else implied
    return cast(LastBatch, chosen if chosen is not None else "keep")


class BatchSampler:
    """Groups the indices of a sampler into batches (``list[int]``).

    The incomplete last batch of an epoch is handled by ``last_batch``, with MXNet Gluon's
    meaning: ``"keep"`` yields it, ``"discard"`` drops it, ``"rollover"`` holds its indices back
    and yields them first in the next iteration, so across epochs every index is yielded exactly
    once. torch's ``drop_last`` is accepted too (``True`` is ``"discard"``, ``False`` is
    ``"keep"``), also as the third positional argument as in torch.

    Args:
        sampler: any iterable of ints: one of this module's samplers, a torch ``Sampler``, a
            ``range``, a list. ``len()`` needs it to be Sized.
        batch_size: indices per batch.
        last_batch: ``"keep"`` (default), ``"discard"`` or ``"rollover"``.
        drop_last: torch's spelling; must agree with ``last_batch`` when both are given.

    Raises:
        TypeError: if an argument has the wrong type (for ``batch_size`` and ``drop_last``
            also a ``ValueError``, which torch raises).
        ValueError: if ``batch_size`` is not positive, ``last_batch`` is unknown, or it
            conflicts with ``drop_last``.
    """

    def __init__(
        self,
        sampler: Iterable[int],
        batch_size: int,
        last_batch: LastBatch | bool | None = None,
        *,
        drop_last: bool | None = None,
    ) -> None:
        if not isinstance(sampler, Iterable):
            raise TypeError(f"sampler must be an iterable of ints, got {sampler!r}")
        self.sampler = sampler
        self.batch_size = as_torch(positive_int, "batch_size", batch_size)
        self.last_batch: LastBatch = resolve_last_batch(last_batch, drop_last)
        # Invariant: the carry is empty unless last_batch == "rollover", and always shorter
        # than a batch when produced here (a loaded state may hold more; it is then batched).
        self._carry: list[int] = []

    @property
    def drop_last(self) -> bool:
        """torch's view of the policy: True when the incomplete last batch is discarded."""
        return self.last_batch == "discard"

    @property
    def carry(self) -> tuple[int, ...]:
        """The indices held back by ``"rollover"``, to be yielded first by the next iteration."""
        return tuple(self._carry)

    def set_epoch(self, epoch: int) -> None:
        """Forward ``epoch`` to the sampler if it has ``set_epoch``."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        # The sampler's iteration starts now (not at the first next()), so a state_dict() taken
        # before iter() describes this whole iteration.
        indices = iter(self.sampler)
        carry = list(self._carry)
        return self._batches(itertools.chain(carry, indices) if carry else indices)

    def _batches(self, source: Iterator[int]) -> Iterator[list[int]]:
        size = self.batch_size
        pending = list(itertools.islice(source, size))
        if len(pending) < size:
            tail = pending
            self._end_of_epoch(tail)
        else:
            while True:
                # Read one batch ahead so the end of the epoch is known before the final full
                # batch leaves: the carry is then committed even if the consumer stops there.
                following = list(itertools.islice(source, size))
                last = len(following) < size
                if last:
                    self._end_of_epoch(following)
                yield pending
                if last:
                    tail = following
                    break
                pending = following
        if tail and self.last_batch == "keep":
            yield tail

    def _end_of_epoch(self, tail: list[int]) -> None:
        if self.last_batch == "rollover":
            self._carry = tail

    def __len__(self) -> int:
        """The number of batches the next iteration yields (with rollover, carry included)."""
        if not isinstance(self.sampler, Sized):
            raise TypeError(f"len() needs a Sized sampler, got {self.sampler!r}")
        n = len(self.sampler) + len(self._carry)
        if self.last_batch == "keep":
            return -(-n // self.batch_size)
        return n // self.batch_size

    def state_dict(self) -> dict[str, Any]:
        """The rollover carry, and the sampler's state when it has one."""
        state: dict[str, Any] = {"carry": list(self._carry)}
        if isinstance(self.sampler, Stateful):
            state["sampler"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (and the sampler's part of it)."""
        state = check_state_keys("BatchSampler", state, {"carry"})
        carry = state["carry"]
        if not isinstance(carry, list | tuple) or not all(map(is_int, carry)):
            raise TypeError(f"BatchSampler state 'carry' must be a list of ints, got {carry!r}")
        negative = [i for i in carry if int(i) < 0]
        if negative:  # (a negative index would read a sample from the end, silently)
            raise ValueError(
                f"BatchSampler state 'carry' holds negative indices {negative[:8]}: a carry "
                "holds the indices of the samples held back, each >= 0"
            )
        if carry and self.last_batch != "rollover":
            raise ValueError(
                f"BatchSampler state 'carry' holds {len(carry)} indices but "
                f"last_batch={self.last_batch!r}; only 'rollover' carries indices"
            )
        if "sampler" in state:
            if not isinstance(self.sampler, Stateful):
                raise ValueError(
                    f"BatchSampler state holds a sampler state but the sampler "
                    f"{self.sampler!r} has no load_state_dict"
                )
            self.sampler.load_state_dict(state["sampler"])
        self._carry = [int(i) for i in carry]

    def __repr__(self) -> str:
        return (
            f"BatchSampler({self.sampler!r}, batch_size={self.batch_size}, "
            f"last_batch={self.last_batch!r}, carry={len(self._carry)})"
        )


# -- what samplers yield -------------------------------------------------------------------------

_PLAIN_INT = {int}

_WHAT_AN_INDEX_IS = "an int, a numpy or torch integer, or a 0-d integer array"


def _index(value: object) -> int | None:
    """``value`` as a plain int if it is an index (numpy/torch integers and 0-d integer arrays
    and tensors too; bools never), else None."""
    if is_int(value):
        return int(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "tolist"):
        item = value.tolist()  # a 0-d array or tensor: its Python scalar
        if type(item) is int:
            return item
    return None


def _indices(values: object) -> list[int] | None:
    """``values`` as a list of plain ints if it is a flat collection of indices, else None."""
    if type(values) is list and set(map(type, values)) <= _PLAIN_INT:
        return values  # the common case: a list of ints, checked at C speed
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        return None
    ndim = getattr(values, "ndim", None)
    if ndim is not None and hasattr(values, "tolist"):  # a numpy array or a torch tensor
        if ndim != 1:
            return None
        values = values.tolist()  # its Python scalars
    out = []
    for value in values:  # type: ignore[attr-defined]
        index = _index(value)
        if index is None:
            return None
        out.append(index)
    return out


def _keys(batch: list[Any] | tuple[Any, ...]) -> bool:
    """Whether ``batch`` is a batch of keys that are not indices, which torch passes to
    ``dataset[key]`` as they are: tuples (the ``(index, size)`` pairs of a multi-scale batch
    sampler) or strings (a dataset keyed by name), all of one kind."""
    return bool(batch) and (
        all(isinstance(key, tuple) for key in batch) or all(isinstance(key, str) for key in batch)
    )


@dataclass(frozen=True, slots=True)
class BulkKey:
    """A key of many indices, read by one ``dataset[key]`` call: what a sampler yields as one
    element without automatic batching (``batch_size=None``), as torch passes it (its bulk
    read). The batch of such a loader is ``[BulkKey]``: the wrapper keeps the key from being
    taken for a shard (a list of indices) on its way to the reader, which unwraps it.

    Attributes:
        key: what the sampler yielded (a list, a numpy array or a torch tensor), given to the
            dataset as it is.
        indices: its indices as plain ints, by which keys compare and hash (the skip
            bookkeeping keeps keys in sets; a list is unhashable).
    """

    key: Any = field(compare=False)
    indices: tuple[int, ...]

    def __repr__(self) -> str:
        return _short_repr(self.key)


class IndexCheck:
    """Turns what a batch sampler yields into the ``list[int]`` (or, for sharded batches,
    ``list[list[int]]``) the loader schedules; refuses what is not indices, naming the source.

    Args:
        name: the argument the culprit came from (``"sampler"`` or ``"batch_sampler"``).
        source: the user's object, for the error message.
        sharded: whether a batch may be a list of shards (lists of indices): true for a
            user's batch sampler (a :class:`ShardedBatchSampler`), false when the loader groups
            a sampler's indices itself (then a nested value is a sampler yielding batches).
        bulk: whether each batch holds one key of a sampler without automatic batching
            (``batch_size=None``), where a collection of indices is one key: a
            :class:`BulkKey`, read by one ``dataset[key]`` call.
    """

    __slots__ = ("bulk", "name", "sharded", "source")

    def __init__(self, name: str, source: object, *, sharded: bool, bulk: bool = False) -> None:
        self.name = name
        self.source = source
        self.sharded = sharded
        self.bulk = bulk

    def __call__(self, batch_id: int, batch: object) -> list[int] | list[list[int]] | list[BulkKey]:
        """``batch`` as plain ints (or one :class:`BulkKey`). Raises ``TypeError`` naming the
        source, the batch and the value when it is not a batch of indices."""
        if isinstance(batch, Iterator):
            batch = list(batch)  # read once: it may be looked at twice below
        flat = _indices(batch)
        if flat is not None:
            return flat
        if isinstance(batch, list | tuple) and _keys(batch):
            return list(batch)  # keys: passed to dataset[key] as they are, as torch does
        if self.bulk and isinstance(batch, list) and len(batch) == 1:
            indices = _indices(batch[0])
            if indices is not None:
                return [BulkKey(batch[0], tuple(indices))]
        if self.sharded and isinstance(batch, Iterable) and not isinstance(batch, str | bytes):
            items = list(batch)
            # A tuple of ints is a key (torch's datasets may take any key: (index, size) pairs
            # of a multi-scale sampler), never a shard: read as one, it would load other
            # samples without a word. Shards are lists, arrays or tensors.
            if not any(isinstance(shard, tuple) for shard in items):
                shards = [_indices(shard) for shard in items]
                if shards and all(shard is not None for shard in shards):
                    return shards  # type: ignore[return-value]
        raise TypeError(self._describe(batch_id, batch))

    def _describe(self, batch_id: int, batch: object) -> str:
        if self.name == "sampler":
            values = list(batch) if isinstance(batch, list | tuple) else [batch]
            bad = next((v for v in values if _index(v) is None), batch)
            if self.bulk:
                return (
                    f"sampler={self.source!r} yielded {_short_repr(values[0])} (for batch "
                    f"{batch_id}), which is not a key: with batch_size=None a sampler yields "
                    f"indices ({_WHAT_AN_INDEX_IS}), lists, arrays or tensors of them (read by "
                    "one dataset[key] call), tuples or strings"
                )
            return (
                f"sampler={self.source!r} yielded {bad!r} (for batch {batch_id}), which is not "
                f"an index: a sampler yields indices ({_WHAT_AN_INDEX_IS}); one that yields "
                "batches of indices is a batch_sampler"
            )
        shape = "a batch of indices, or a list of such batches (shards)"
        keys = (
            "; or, as torch passes them to dataset[key], keys: all tuples or all strings"
            if isinstance(batch, list | tuple) and any(_index(v) is None for v in batch)
            else ""
        )
        return (
            f"batch_sampler={self.source!r} yielded {_short_repr(batch)} as batch {batch_id}, "
            f"which is not {shape if self.sharded else 'a batch of indices'}: a batch is a "
            f"list, tuple, numpy array or torch tensor of indices ({_WHAT_AN_INDEX_IS}){keys}"
        )


def _short_repr(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({type(value).__name__})"


def _split(batch: list[int], num_shards: int) -> list[list[int]]:
    """Split ``batch`` into at most ``num_shards`` non-empty runs whose sizes differ by <= 1."""
    count = min(num_shards, len(batch))
    if count == 0:
        return []
    small, extra = divmod(len(batch), count)
    shards = []
    start = 0
    for i in range(count):
        stop = start + small + (1 if i < extra else 0)
        shards.append(batch[start:stop])
        start = stop
    return shards


class ShardedBatchSampler:
    """Splits each batch of a batch sampler into ``num_shards`` parts, one per device.

    For each batch of ``batch_sampler`` it yields a list of index lists, in order, whose sizes
    differ by at most one (the first ones are the longer), as MXNet's ``split_and_load`` does
    for data parallelism. Empty shards are never produced: a batch with fewer indices than
    shards yields one shard per index. The loader turns each shard into its own batch.

    Args:
        batch_sampler: anything that yields lists of ints (ours or torch's ``BatchSampler``).
        num_shards: how many parts to split each batch into (usually the number of devices).

    Raises:
        TypeError: if ``batch_sampler`` is not iterable or ``num_shards`` is not an int.
        ValueError: if ``num_shards`` is not positive.
    """

    def __init__(self, batch_sampler: Iterable[list[int]], num_shards: int) -> None:
        if not isinstance(batch_sampler, Iterable):
            raise TypeError(f"batch_sampler must be an iterable of lists, got {batch_sampler!r}")
        self.batch_sampler = batch_sampler
        self.num_shards = positive_int("num_shards", num_shards)

    def __iter__(self) -> Iterator[list[list[int]]]:
        batches = iter(self.batch_sampler)
        return (_split(list(batch), self.num_shards) for batch in batches)

    def __len__(self) -> int:
        if not isinstance(self.batch_sampler, Sized):
            raise TypeError(f"len() needs a Sized batch_sampler, got {self.batch_sampler!r}")
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int) -> None:
        """Forward ``epoch`` to the batch sampler if it has ``set_epoch``."""
        set_epoch = getattr(self.batch_sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The batch sampler's state, when it has one."""
        if isinstance(self.batch_sampler, Stateful):
            return {"batch_sampler": self.batch_sampler.state_dict()}
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        state = check_state_keys("ShardedBatchSampler", state, set())
        if "batch_sampler" in state:
            if not isinstance(self.batch_sampler, Stateful):
                raise ValueError(
                    f"ShardedBatchSampler state holds a batch sampler state but "
                    f"{self.batch_sampler!r} has no load_state_dict"
                )
            self.batch_sampler.load_state_dict(state["batch_sampler"])

    def __repr__(self) -> str:
        return f"ShardedBatchSampler({self.batch_sampler!r}, num_shards={self.num_shards})"
