"""The rest of an epoch of a stream read in units, dealt again over another number of ranks.

A stream read in units (tar shards, Parquet row groups: :mod:`._readers`) saves, per rank,
where its epoch stands: the epoch, the records it yielded, and how many records each unit that
ended had. That is enough to recompute which records the rank consumed (:func:`consumed`
replays its :class:`~._mixing.Mixer` without IO), but only for that rank, whose share of the
units depends on the number of ranks. So, to resume on another number of ranks (elastic
resume), every rank's state is merged into one (:func:`merge_stream_states`), which says
*which records of which units were consumed*, whoever read them::

    rank states (R of them)         merged state ("rest")            rank r' of R' resumes
      (epoch, yielded, ended, r) ─▶ consumed: unit -> [[a, b], ...] ─▶ the epoch's unit order,
      replayed: what r consumed     lengths:  unit -> its records      less units used up,
                                                                       every R'-th from r' on
                                                                       ─▶ each unit's records,
                                                                       less those consumed

The rest is dealt deterministically (:func:`plan`): the epoch's unit order (a pure function
of ``(seed, epoch)``), less the units whose every record was consumed, unit ``k`` of it to new
rank ``k mod R'``; a new rank mixes its units as any epoch does (slots, a shuffle buffer seeded
by ``(seed, epoch, rank, world)``), reading each unit from its start and leaving out the records
consumed (:func:`skipping`). So across the new ranks every record of the epoch not consumed
comes out exactly once, and none consumed comes again. Positions in such a rest are positions
among the records a unit keeps (a unit's ``ended`` count is of those), so the rest itself
resumes exactly on the same ranks, and its states merge again for yet other ranks
(:func:`consumed` maps its positions back to the unit's own). The next epoch is an
uninterrupted epoch of the new ranks: the rest applies to the epoch it was saved in.

**Shares evened up front.** Where every unit's length is known (Parquet footers, a tar index),
:func:`plan` may instead cut the records left, in the epoch's unit order, into one run per
rank, as long as each other but for the remainder: the first ``T mod R`` ranks get one record
more, so the ranks' batch counts differ by at most one (where a run's length is a multiple of
``batch_size`` plus one record, that record is a batch of its own on those ranks only; under
equal steps it is the leftover). A unit split between two ranks is read by both, each leaving
out the other's part; to the mixer and to a state that is one more kind of record left out,
so resume and merging are the same. A tar index may be stale: a unit may have more records
than it says (the rank with the unit's last part reads them, to the unit's real end) or fewer.
So a length said is only a plan: a merged state knows a unit's length only from the rank that
read it to its end, plans with that (or else with the length said, or the last record
consumed, whichever is further), and never refuses records consumed past a length said.

Costs, each deliberate: a unit consumed in part is read again from its start (its first bytes
are read and left out: a tar shard cannot be entered in the middle); a merged state holds two
small ranges per unit touched (whole units consumed are one range each), no record data.

Everything here is pure: no IO, no loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._validate import check_state_keys, is_int, non_negative_int, positive_int
from ._mixing import Mixer, buffer_rng, replay, shard_order

__all__ = [
    "Plan",
    "Ranges",
    "Rest",
    "consumed",
    "merge_stream_states",
    "plan",
    "skipping",
]

Ranges = list[tuple[int, int]]  # sorted, disjoint, non-adjacent [start, stop) ranges


# -- ranges of positions ------------------------------------------------------------------------


def _union(a: Ranges, b: Ranges) -> Ranges:
    out: Ranges = []
    for start, stop in sorted([*a, *b]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _count(ranges: Ranges) -> int:
    return sum(stop - start for start, stop in ranges)


def _without(n: int, points: Iterable[int]) -> Ranges:
    """The positions ``0 .. n-1`` less ``points``, as ranges."""
    out: Ranges = []
    start = 0
    for p in sorted(set(points)):
        if p >= n:
            break
        if p > start:
            out.append((start, p))
        start = p + 1
    if n > start:
        out.append((start, n))
    return out


def _own_ranges(gone: Ranges, virtual: Ranges) -> Ranges:
    """A unit's own positions of the ``virtual`` ones, positions among its records left once
    those at ``gone`` are left out: the ``v``-th record left lies in the ``k``-th gap between
    the ranges of ``gone``, counted from the gap's start."""
    gaps: list[tuple[int, int, int]] = []  # (own start, virtual start, virtual stop)
    own, counted = 0, 0
    for start, stop in gone:
        if start > own:
            gaps.append((own, counted, counted + start - own))
            counted += start - own
        own = stop
    gaps.append((own, counted, -1))  # the last gap has no end
    out: Ranges = []
    for a, b in virtual:
        for own_start, v_start, v_stop in gaps:
            lo, hi = max(a, v_start), b if v_stop < 0 else min(b, v_stop)
            if lo < hi:
                out.append((own_start + lo - v_start, own_start + hi - v_start))
    return _union(out, [])


# -- the rest of an epoch ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rest:
    """What of an epoch was consumed, by every rank together: the state's ``"rest"``.

    Attributes:
        units: how many units the data has (all ranks').
        consumed: unit -> the ranges of its positions consumed (its own positions).
        lengths: unit -> its number of records, for the units a rank read to their end
            (or a bound above it: a unit that ended inside a part another rank left out may
            have had fewer; never one below it, which would lose records).
    """

    units: int
    consumed: Mapping[int, Ranges]
    lengths: Mapping[int, int]

    def used_up(self, unit: int) -> bool:
        """Whether every record of ``unit`` was consumed (it is not read again)."""
        length = self.lengths.get(unit)
        return length is not None and _count(list(self.consumed.get(unit, ()))) >= length

    def deal(self, order: Sequence[int], rank: int, world: int) -> list[int]:
        """Rank ``rank`` of ``world``'s units of the rest, from the epoch's whole ``order``."""
        left = [unit for unit in order if not self.used_up(unit)]
        return left[rank::world]

    def state(self) -> dict[str, Any]:
        return {
            "units": self.units,
            "consumed": [[u, [list(r) for r in rs]] for u, rs in sorted(self.consumed.items())],
            "lengths": [[u, n] for u, n in sorted(self.lengths.items())],
        }

    @classmethod
    def from_state(cls, owner: str, state: object) -> Rest:
        """A state's ``"rest"``, checked (each field named with its value)."""
        if not isinstance(state, Mapping):
            raise TypeError(f"{owner}: the state's 'rest' must be a dict, got {state!r}")
        state = check_state_keys(f"{owner} (the state's 'rest')", dict(state), _REST_KEYS)
        units = positive_int("the state's rest 'units'", state["units"])
        consumed: dict[int, Ranges] = {}
        for item in _pairs(owner, "consumed", state["consumed"]):
            unit, ranges = _unit(owner, item[0], units), item[1]
            checked: Ranges = []
            if not isinstance(ranges, list | tuple):
                raise ValueError(f"{owner}: the state's rest ranges of unit {unit}: {ranges!r}")
            for r in ranges:
                if (
                    not isinstance(r, list | tuple)
                    or len(r) != 2
                    or not all(map(is_int, r))
                    or not 0 <= int(r[0]) < int(r[1])
                ):
                    raise ValueError(
                        f"{owner}: the state's rest 'consumed' of unit {unit} must hold [start, "
                        f"stop] ranges with 0 <= start < stop, got {r!r}"
                    )
                checked.append((int(r[0]), int(r[1])))
            consumed[unit] = _union(checked, [])
        lengths = {
            _unit(owner, item[0], units): non_negative_int(
                f"the state's rest length of unit {item[0]}", item[1]
            )
            for item in _pairs(owner, "lengths", state["lengths"])
        }
        for unit, length in lengths.items():
            ranges = consumed.get(unit, [])
            if ranges and ranges[-1][1] > length:
                raise ValueError(
                    f"{owner}: the state's rest says unit {unit} has {length} records and that "
                    f"its record {ranges[-1][1] - 1} was consumed"
                )
        return cls(units, consumed, lengths)


_REST_KEYS = ("units", "consumed", "lengths")


def _pairs(owner: str, key: str, value: object) -> list[Any]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(item, list | tuple) and len(item) == 2 for item in value
    ):
        raise TypeError(f"{owner}: the state's rest {key!r} must be a list of pairs, got {value!r}")
    return list(value)


def _unit(owner: str, unit: object, units: int) -> int:
    if not is_int(unit) or not 0 <= int(unit) < units:
        raise ValueError(f"{owner}: the state's rest names unit {unit!r}, not one of {units}")
    return int(unit)


def rest_of(owner: str, state: Mapping[str, Any] | None) -> Rest | None:
    """The :class:`Rest` a dataset state resumes (None: an uninterrupted epoch)."""
    rest = None if state is None else state.get("rest")
    return None if rest is None else Rest.from_state(owner, rest)


@dataclass(frozen=True, slots=True)
class Plan:
    """One rank's epoch: the mixer over its units, and per unit the unit's own positions it
    leaves out (consumed before a resume, or another rank's part of a unit split between
    ranks); a unit's positions in the mixer count among the records it keeps."""

    mixer: Mixer
    gone: Mapping[int, Ranges]


def plan(
    units: int,
    rest: Rest | None,
    lengths: Sequence[int] | None,
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    rank: int,
    world: int,
    slots: int,
    buffer: int,
) -> Plan:
    """Rank ``rank`` of ``world``'s part of ``epoch``: of the whole epoch, or (``rest``) of what
    the ranks that saved ``rest`` left of it.

    Without ``lengths`` a rank reads whole units: every ``world``-th unit of the epoch's order
    (of those with records left). With ``lengths`` (every unit's number of records: Parquet
    footers, a tar index) the shares are evened up front: the records left, in the epoch's
    unit order, are cut into ``world`` runs as long as each other (the first ``T mod world``
    one record longer), so a unit may be split between two ranks, each keeping its part; a
    unit's records past its length said go to the rank with its last part (see :func:`_even`).
    """
    whole = shard_order(units, shuffle=shuffle, seed=seed, epoch=epoch, reader=0, readers=1)
    consumed: Mapping[int, Ranges] = rest.consumed if rest is not None else {}
    if lengths is not None:
        ended: Mapping[int, int] = rest.lengths if rest is not None else {}
        order, gone = _even(whole, consumed, ended, lengths, rank, world)
    elif rest is None:
        order, gone = whole[rank::world], {}
    else:
        order = rest.deal(whole, rank, world)
        gone = {unit: list(consumed[unit]) for unit in order if unit in consumed}
    return Plan(Mixer(order, slots, buffer, buffer_rng(seed, epoch, rank, world)), gone)


def _even(
    whole: Sequence[int],
    consumed: Mapping[int, Ranges],
    ended: Mapping[int, int],
    lengths: Sequence[int],
    rank: int,
    world: int,
) -> tuple[list[int], dict[int, Ranges]]:
    """Rank ``rank``'s run of the records left, and per unit the positions it leaves out.

    A unit is planned as long as the rest knows it to be (``ended``: a rank read it to its
    end), else as its length said (``lengths``, an index that may be stale) or its last record
    consumed, whichever is further. Past a length not known to be the end, a unit may have
    more records: they go to the rank whose run holds the unit's last record left (or the
    point where the unit stands, if it has none left), which reads the unit to its real end.
    """
    planned = {unit: _planned(unit, consumed, ended, lengths) for unit in whole}
    left = [(unit, planned[unit] - _count(list(consumed.get(unit, ())))) for unit in whole]
    total = sum(n for _, n in left)
    size, longer = divmod(total, world)
    start = rank * size + min(rank, longer)
    stop = start + size + (rank < longer)
    order: list[int] = []
    gone: dict[int, Ranges] = {}
    offset = 0  # where the unit's records left begin among all the records left
    for unit, n in left:
        lo, hi = max(start, offset), min(stop, offset + n)
        end = offset + n  # records past the planned length go to the run that reaches here
        tail = unit not in ended and (start < end <= stop if end else rank == 0)
        if lo < hi or tail:
            before = list(consumed.get(unit, ()))
            kept = _own_ranges(before, [(lo - offset, hi - offset)]) if lo < hi else []
            if tail:  # records past the length planned are this rank's too
                kept.append((planned[unit], _NO_END))
            order.append(unit)
            gone[unit] = _without_ranges(_NO_END, kept)
        offset += n
    return order, {unit: ranges for unit, ranges in gone.items() if ranges}


def _planned(
    unit: int, consumed: Mapping[int, Ranges], ended: Mapping[int, int], lengths: Sequence[int]
) -> int:
    """The records of ``unit`` an even plan counts (see :func:`_even`)."""
    if unit in ended:
        return ended[unit]
    ranges = consumed.get(unit, ())
    return max(lengths[unit], ranges[-1][1] if ranges else 0)


#: A position past any unit's end: "to the end" for a range of positions left out.
_NO_END = 1 << 62


def _without_ranges(n: int, kept: Ranges) -> Ranges:
    """The positions ``0 .. n-1`` outside ``kept``."""
    out: Ranges = []
    start = 0
    for a, b in kept:
        if a > start:
            out.append((start, a))
        start = b
    if n > start:
        out.append((start, n))
    return out


async def skipping(records: AsyncGenerator[Any, None], gone: Ranges) -> AsyncGenerator[Any, None]:
    """``records`` less those at the positions ``gone`` (a unit's records in a rest, or
    another rank's part of it); once all that is left is gone, the unit is not read further."""
    ranges = iter(gone)
    current = next(ranges, None)
    position = 0
    async with contextlib.aclosing(records):
        async for record in records:
            while current is not None and position >= current[1]:
                current = next(ranges, None)
            if current is None or position < current[0]:
                yield record
            elif current[1] >= _NO_END:
                return  # the rest of the unit is another rank's
            position += 1


# -- what a rank consumed, and the merge -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settings:
    """What orders a stream's records, read from one of its states (tar or Parquet)."""

    kind: str  # the dataset's class name, for messages
    units: int | None
    slots: int
    buffer: int
    shuffle: bool
    seed: int


def settings(state: Mapping[str, Any]) -> Settings:
    """The settings a (TarDataset or ParquetDataset) state was saved with."""
    if "shards" in state:
        kind, units, slots = "TarDataset", state["shards"], state.get("shards_in_flight")
    elif "row_groups_in_flight" in state:
        kind, units = "ParquetDataset", state.get("row_groups")
        slots = state["row_groups_in_flight"]
    else:
        raise ValueError(
            "merge_states: a stream state that is neither a TarDataset's nor a "
            f"ParquetDataset's (keys {sorted(state)}): only those resume on other ranks"
        )
    return Settings(
        kind,
        None if units is None else non_negative_int(f"{kind} state's units", units),
        positive_int(f"{kind} state's units in flight", slots),
        non_negative_int(f"{kind} state's shuffle_buffer", state.get("shuffle_buffer", 0)),
        bool(state.get("shuffle")),
        non_negative_int(f"{kind} state's seed", state.get("seed")),
    )


def consumed(state: Mapping[str, Any]) -> tuple[dict[int, Ranges], dict[int, int]]:
    """What one rank consumed, by its state: unit -> ranges of its own positions, and the
    lengths of the units that ended (replayed without IO, see :func:`~._mixing.replay`)."""
    config = settings(state)
    rest = rest_of(config.kind, state)
    yielded = non_negative_int(f"{config.kind} state's 'yielded'", state["yielded"])
    if yielded == 0 or config.units is None:
        return {}, {}
    rank, world = _rank(config.kind, state)
    lengths = _lengths(config.kind, state)
    planned = plan(
        config.units,
        rest,
        lengths,
        shuffle=config.shuffle,
        seed=config.seed,
        epoch=non_negative_int(f"{config.kind} state's 'epoch'", state["epoch"]),
        rank=rank,
        world=world,
        slots=config.slots,
        buffer=config.buffer,
    )
    mixer = planned.mixer
    counts = {int(unit): int(n) for unit, n in state["ended"]}
    tail = replay(mixer, counts, yielded)
    pending: dict[int, set[int]] = {}
    for unit, position in [*mixer.buffer, *tail]:
        pending.setdefault(unit, set()).add(position)
    read = dict(mixer.ended)
    read.update((unit, position) for unit, position in mixer.slots)
    taken: dict[int, Ranges] = {}
    ended: dict[int, int] = {}
    for unit, n in read.items():
        gone = list(planned.gone.get(unit, ()))
        mine = _own_ranges(gone, _without(n, pending.get(unit, ())))
        if mine:
            taken[unit] = mine
        # A unit's length is known only where this rank read it to its real end: the unit
        # ended here, and no part of it past this rank's is another's (an even share's
        # length said is an index's, which may be stale). Its records are then the positions
        # read and those left out, or fewer (it may have ended inside a part left out: a
        # length too long costs a read, one too short would lose records).
        if unit in mixer.ended and not (gone and gone[-1][1] >= _NO_END):
            ended[unit] = n + _count(gone)
    return taken, ended


def _lengths(owner: str, state: Mapping[str, Any]) -> list[int] | None:
    """The units' lengths an even state's shares were cut by (None: whole units)."""
    lengths = state.get("lengths")
    if lengths is None:
        return None
    if not isinstance(lengths, list | tuple) or not all(map(is_int, lengths)):
        raise ValueError(f"{owner}: the state's 'lengths' must be a list of ints, got {lengths!r}")
    return [int(n) for n in lengths]


def _rank(owner: str, state: Mapping[str, Any]) -> tuple[int, int]:
    rank = state.get("rank")
    if not isinstance(rank, list | tuple) or len(rank) != 2:
        raise ValueError(
            f"merge_states: a {owner} state's 'rank' must be [rank, world], got {rank!r}"
        )
    return int(rank[0]), int(rank[1])


#: The keys of a stream state that say where it is, rather than how the stream is made.
_WHERE = frozenset({"yielded", "ended", "rank", "rest", "lengths"})
#: Keys a ParquetDataset's state holds once its first iteration read the footers (None before).
_LEARNT = ("row_groups", "rows", "catalog")


def _check_same_data(kind: str, states: Sequence[Mapping[str, Any]]) -> None:
    """Refuse states of ranks that planned their shares from different data: each Parquet
    rank lists the files and reads the footers itself (``"catalog"``: a digest of what it
    found), and an even share is cut by the lengths the rank was given (``"lengths"``).
    Their shares may then overlap or leave records out, which no merge can tell apart."""
    for key, what, why in (
        (
            "catalog",
            "files, row groups and rows",
            "a footer that failed on some ranks only, where it counts as one record, or a "
            "listing that differed",
        ),
        ("lengths", "lengths", "the index the lengths came from differed"),
    ):
        seen: dict[str, list[int]] = {}
        for state in states:
            if state.get(key) is not None:
                seen.setdefault(_seen(key, state), []).append(_rank(kind, state)[0])
        if len(seen) > 1:
            groups = "; ".join(
                f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(set(ranks))))}: "
                f"{value}"
                for value, ranks in sorted(seen.items(), key=lambda item: min(item[1]))
            )
            raise ValueError(
                f"merge_states: the {kind} ranks planned their shares from different {what} "
                f"({groups}): their shares may overlap or leave records out, so no merged "
                f"state can say what was consumed. Likely {why}: make every rank see the same "
                "data, and resume from a checkpoint saved before the difference"
            )


def _seen(key: str, state: Mapping[str, Any]) -> str:
    """What a rank planned with, as a message shows it (see :func:`_check_same_data`)."""
    if key == "catalog":
        return (
            f"{state.get('row_groups')} row groups, {state.get('rows')} rows, digest {state[key]}"
        )
    text = repr(state[key])
    return text if len(text) <= 60 else f"{text[:57]}..."


def merge_stream_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One state of every rank's (TarDataset or ParquetDataset) states, saved at one step:
    the records all of them consumed (``"rest"``), resumable on any number of ranks.

    Raises:
        ValueError: the states are not one of each rank of one job, at one epoch, of one
            dataset (naming what differs), or one of them is malformed.
    """
    if not states:
        raise ValueError("merge_states needs the state of every rank, got none")
    first = states[0]
    same = {key: value for key, value in first.items() if key not in _WHERE}
    for key in _LEARNT:  # a rank that read nothing yet may not know them
        same[key] = next((s[key] for s in states if s.get(key) is not None), same.get(key))
    config = settings(same)
    _check_same_data(config.kind, states)
    for k, state in enumerate(states):
        for key, value in same.items():
            if key in _LEARNT and state.get(key) is None:
                continue
            if state.get(key) != value:
                raise ValueError(
                    f"merge_states: the states differ in {key!r} ({value!r} in the first, "
                    f"{state.get(key)!r} in state {k}): they are not of one dataset at one epoch"
                )
        if state.get("rest") != first.get("rest"):
            raise ValueError(
                f"merge_states: state {k} resumes another rest of the epoch than the first: "
                "merge the states of one job, saved at one step"
            )
    # Ranks of one model-parallel group read one share (shard=dp_group): their states are one.
    by_rank: dict[tuple[int, int], Mapping[str, Any]] = {}
    for k, state in enumerate(states):
        rank = _rank(config.kind, state)
        if by_rank.setdefault(rank, state) != state:
            raise ValueError(
                f"merge_states: state {k} is of rank {list(rank)}, as an earlier one is, and "
                "the two say different things: they are not of one job at one step"
            )
    ranks = sorted(by_rank)
    world = ranks[0][1] if ranks else 0
    if ranks != [(r, world) for r in range(world)]:
        raise ValueError(
            f"merge_states: the states are of ranks {[list(r) for r in ranks]}; they must be "
            f"of every rank of one job ([0, R] to [R - 1, R])"
        )
    states = list(by_rank.values())
    rest = rest_of(config.kind, first)
    taken: dict[int, Ranges] = {u: list(r) for u, r in rest.consumed.items()} if rest else {}
    lengths: dict[int, int] = dict(rest.lengths) if rest else {}
    for state in states:
        mine, ended = consumed(state)
        for unit, ranges in mine.items():
            before = taken.get(unit, [])
            if _count(_union(before, ranges)) != _count(before) + _count(ranges):
                raise ValueError(
                    f"merge_states: two states consumed the same records of unit {unit}: they "
                    "are not of one job at one step"
                )
            taken[unit] = _union(before, ranges)
        for unit, n in ended.items():
            lengths[unit] = min(n, lengths.get(unit, n))
    merged = {**same, "yielded": 0, "ended": [], "rank": None, "rest": None}
    if taken:
        units = config.units if config.units is not None else rest.units if rest else None
        assert units is not None  # a state that consumed records knows the units
        merged["rest"] = Rest(units, taken, lengths).state()
    return merged
