"""The sampler chain as a resume state sees it: the samplers a batch sampler wraps, the one
whose state is the chain's, who is told ``set_epoch``, the torch generators of samplers
without a state, and the layout (the settings that decide which samples a batch id is).

A chain is the loader's batch sampler and what it wraps (``.sampler`` / ``.batch_sampler``),
outermost first, looked through :data:`DEPTH` deep: aioloader's samplers, torch's, or the
user's own, read by duck typing (a sampler says ``batch_size``, ``drop_last`` or
``last_batch``, ``num_replicas``, ``generator``, ``replacement`` where it has them).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

from .._types import Stateful
from .._validate import is_int

# The settings a state's "layout" records, and how a message names each. They decide which
# samples batch id i of an epoch is, and in which order the ids come (the rank does not: under
# DDP rank 0's state resumes every rank, unless the state is that rank's own, see
# EpochBook._own_rank; neither do num_workers and in_order: the ids stay).
LAYOUT: dict[str, str] = {
    "shuffle": "shuffle",
    "sampler": "sampler",
    "generator": "sampler generator",
    "batch_sampler": "batch_sampler",
    "batch_size": "batch_size",
    "last_batch": "last_batch",
    "samples": "len(dataset)",
    "indices": "len(sampler)",
    "replicas": "num_replicas",
    "batches": "len(loader)",
    "replacement": "sampler replacement",
}


def length(sized: object) -> int | None:
    try:
        return len(sized)  # type: ignore[arg-type]
    except Exception:  # no __len__, or one that refuses (a sampler of unknown length)
        return None


def first_int(chain: list[Any], name: str) -> int | None:
    return next((int(v) for s in chain if is_int(v := getattr(s, name, None))), None)


def last_batch(chain: list[Any]) -> str | None:
    """The policy for the short last batch: aioloader's ``last_batch``, torch's ``drop_last``."""
    for sampler in chain:
        policy = getattr(sampler, "last_batch", None)
        if isinstance(policy, str):
            return policy
        drop = getattr(sampler, "drop_last", None)
        if isinstance(drop, bool):
            return "discard" if drop else "keep"
    return None


def shuffled(sampler: object) -> bool | None:
    """Whether ``sampler`` shuffles: by its kind, or its ``shuffle`` (a distributed one's);
    None where it does not say (a sampler of your own)."""
    name = type(sampler).__name__
    if name in GLOBAL_RANDOM:
        return True
    if name == "SequentialSampler":
        return False
    flag = getattr(sampler, "shuffle", None)
    return flag if isinstance(flag, bool) else None


def state_holder(batches: object) -> Stateful | None:
    """The outermost of ``batches`` and the samplers it wraps that has a state: its state is
    the samplers' (a stateful one saves those it wraps). A batch sampler without a state
    (torch's ``BatchSampler``) around one of ours (``RandomSampler(seed=)``) is looked
    through: the sampler inside it holds the order."""
    return next((s for s in samplers(batches) if isinstance(s, Stateful)), None)


def state_of(batches: object) -> dict[str, Any] | None:
    holder = state_holder(batches)
    return holder.state_dict() if holder is not None else None


def epoch_setter(batches: object) -> Callable[[int], object] | None:
    """``set_epoch`` of the outermost of ``batches`` and the samplers it wraps that has one
    (torch's ``BatchSampler`` has none: its sampler is told)."""
    for sampler in samplers(batches):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            return set_epoch  # type: ignore[no-any-return]
    return None


def layout_of(batches: object, index: object, dataset: object) -> dict[str, Any]:
    """The layout (see :data:`LAYOUT`) of ``batches`` over index sampler ``index``."""
    if batches is None:  # a stream: only its length, where it has one
        return {**dict.fromkeys(LAYOUT), "samples": length(dataset)}
    chain = samplers(batches)
    replacement = next(
        (r for s in chain if isinstance(r := getattr(s, "replacement", None), bool)), None
    )
    return {
        "shuffle": shuffled(index),
        "sampler": type(index).__name__,
        "generator": any(getattr(s, "generator", None) is not None for s in chain),
        "batch_sampler": type(batches).__name__,
        "batch_size": first_int(chain, "batch_size"),
        "last_batch": last_batch(chain),
        "samples": length(dataset),
        "indices": length(index),
        "replicas": first_int(chain, "num_replicas"),
        "batches": length(batches),
        "replacement": replacement,
    }


def layout_in_copy(
    batches: object, index: object, dataset: object, state: dict[str, Any], text: str
) -> tuple[dict[str, Any] | None, Exception | None]:
    """The layout of a copy of ``batches`` (the dataset and each sampler's ``dataset`` /
    ``data_source`` shared, never copied) with sampler state ``state`` loaded into the copy's
    holder, or the error of that load. The user's samplers are never loaded: a sampler's
    earlier state_dict() loaded back does not undo a load for many samplers.

    Raises:
        ValueError: the chain (``text``) cannot be copied (the live samplers left untouched).
    """
    shared = [dataset] + [
        getattr(s, name, None) for s in samplers(batches) for name in ("data_source", "dataset")
    ]
    memo: dict[int, Any] = {id(obj): obj for obj in shared if obj is not None}
    try:
        copied = copy.deepcopy(batches, memo)
    except Exception as exc:
        raise ValueError(
            "the state holds the rest of an epoch saved on other ranks, whose layout is checked "
            f"in a copy of this loader's samplers ({text}), and they cannot be copied "
            f"({type(exc).__name__}: {exc}); the live samplers are left untouched. Make the "
            "sampler copyable (copy.deepcopy), or resume on as many ranks as saved"
        ) from exc
    holder = state_holder(copied)
    assert holder is not None  # (a copy of a chain that has one)
    try:
        holder.load_state_dict(copy.deepcopy(state))
    except Exception as exc:  # raised by the caller, as a ValueError
        return None, exc
    return layout_of(copied, memo.get(id(index), index), dataset), None


def load_accepted(holder: Any, state: dict[str, Any], text: str) -> dict[str, Any]:
    """Load an accepted ``state`` into ``holder`` (of the chain ``text``) once; its state
    before, which it is given back (where it takes it) if the load raises.

    Raises:
        ValueError: the holder's ``load_state_dict`` raised (the sampler named, the error).
    """
    before: dict[str, Any] = holder.state_dict()
    try:
        holder.load_state_dict(state)
    except Exception as exc:  # the sampler's own fault: the state is refused
        with contextlib.suppress(Exception):
            holder.load_state_dict(before)
        raise ValueError(
            f"the state's 'sampler' cannot be loaded into the samplers of this loader ({text}): "
            f"{type(holder).__name__}.load_state_dict raised {type(exc).__name__}: {exc}"
        ) from exc
    return before


# torch's samplers that draw from their ``generator``, or torch's global one without it.
GLOBAL_RANDOM = frozenset({"RandomSampler", "SubsetRandomSampler", "WeightedRandomSampler"})
DEPTH = 4  # wrappers looked through: a sharded batch sampler around a batch sampler around...


def samplers(batches: object) -> list[Any]:
    """``batches`` and the samplers it wraps (``.sampler`` / ``.batch_sampler``), outermost
    first."""
    found: list[Any] = []
    current: Any = batches
    for _ in range(DEPTH):
        if current is None:
            break
        found.append(current)
        inner = getattr(current, "sampler", None)
        current = inner if inner is not None else getattr(current, "batch_sampler", None)
    return found


def generators(batches: object) -> list[Any]:
    """The torch generators of the samplers without a state of their own (torch's
    ``RandomSampler(generator=g)``, ``WeightedRandomSampler``, ...): their state before an
    epoch's ``iter()`` is its order."""
    return [
        g
        for sampler in samplers(batches)
        if not isinstance(sampler, Stateful)
        and callable(getattr(g := getattr(sampler, "generator", None), "get_state", None))
        and callable(getattr(g, "set_state", None))
    ]


def generator_states(batches: object) -> list[Any] | None:
    found = generators(batches)
    return [g.get_state() for g in found] if found else None


def matching_generators(batches: object, states: list[Any]) -> list[Any]:
    """The generators of ``batches`` that ``states`` (a state's) are of; raises if they differ."""
    found = generators(batches)
    if len(found) != len(states):
        raise ValueError(
            f"the state holds {len(states)} sampler generator states, but the samplers of "
            f"this loader have {len(found)} generators: load it into a loader built "
            "the same way"
        )
    return found


def set_generators(batches: object, states: list[Any]) -> None:
    for generator, state in zip(matching_generators(batches, states), states, strict=True):
        generator.set_state(state)


def sampler_keys(state: object) -> object:
    """The shape of a sampler state: its keys, nested; None for anything else. A
    DistributedSampler's ``consumed`` (the rest of an epoch resumed on other ranks) is left
    out: present or not, the same samplers read it."""
    if isinstance(state, dict):
        return {key: sampler_keys(value) for key, value in state.items() if key != "consumed"}
    return None


def index_state(state: object) -> dict[str, Any] | None:
    """The index sampler's state inside a (batch) sampler state: the first level with a
    ``seed`` and an ``epoch``."""
    for _ in range(DEPTH):
        if not isinstance(state, dict):
            return None
        if "seed" in state and "epoch" in state:
            return state
        state = state.get("sampler", state.get("batch_sampler"))
    return None


def keys_within(saved: object, mine: object) -> bool:
    """Whether sampler state keys ``saved`` are all read by samplers that save ``mine``."""
    if saved is None:
        return True
    if not isinstance(saved, dict) or not isinstance(mine, dict):
        return saved == mine
    return all(key in mine and keys_within(value, mine[key]) for key, value in saved.items())


def nested(state: object, key: str) -> Any:
    """``key`` of the first level of a (batch) sampler state that has it, looking through the
    states of the samplers it wraps (``"sampler"`` / ``"batch_sampler"``)."""
    for _ in range(DEPTH):
        if not isinstance(state, dict):
            return None
        if key in state:
            return state[key]
        state = state.get("sampler", state.get("batch_sampler"))
    return None


def check_unsaved_order(batches: object, state: dict[str, Any]) -> None:
    """Refuse a mid-epoch ``state`` holding no state of a sampler whose order it needs (the
    previous release saved none inside a stateless batch sampler, torch's): a sampler drawing
    from its ``generator`` past epoch 0 (this one's generator is where it is now, not where the
    epoch began), or one whose own ``epoch`` is not the state's where the loader does not set
    it (the state's ``"set_epoch"`` is false). Either would resume another order, silently.

    Raises:
        ValueError: naming the sampler, the epochs, and the way on.
    """
    epoch, taken = int(state["epoch"]), len(state["done"])
    where = f"mid-epoch (epoch {epoch}, {taken} batch{'es' if taken != 1 else ''} taken)"
    for sampler in samplers(batches):
        name = type(sampler).__name__
        saved = state.get("sampler" if isinstance(sampler, Stateful) else "generators")
        if getattr(sampler, "generator", None) is not None and saved is None and epoch > 0:
            raise ValueError(
                f"the state was saved {where} and holds no state of {name}'s generator (the "
                "previous release saved none inside a stateless batch sampler): this loader "
                f"would draw the order of the generator as it is now (epoch 0's, for one seeded "
                f"as the saving run's), not epoch {epoch}'s. Replay the epoch from its start on "
                "purpose: load {**state, 'done': []}; a state saved now holds the generator's"
            )
        own = getattr(sampler, "epoch", None)
        unset = state.get("sampler") is None and not state.get("set_epoch")
        if isinstance(sampler, Stateful) and is_int(own) and own != epoch and unset:
            raise ValueError(
                f"the state was saved {where} and holds no sampler state (the previous "
                f"release saved none inside a stateless batch sampler), so {name}'s own "
                f"epoch orders it, and that is epoch {own}, not the state's epoch {epoch} "
                "(the loader did not drive it, so it does not set it): call "
                f"sampler.set_epoch({epoch}) before load_state_dict"
            )
