"""The resume state checked whole where it is loaded (_epoch._resume): a state that does not fit
the loader is refused naming the field and both values, never resumed into a wrong epoch
(RELIABILITY.md row 43).

A mid-epoch state counts the batches taken by id; an id is the same samples only under the same
settings. The matrix: each setting that changes the order or the batches, changed between the
saving loader and the loading one; each field of a state tampered with; a state of the older
format (no ``version``). Every loader here makes its batches in the caller's thread
(``num_workers=0``), so the whole file runs in about a second.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from datasets import Range, Resumable
from helpers import as_lists, flat

from aioloader import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

N, SIZE, TAKEN = 40, 4, 3
BASE: dict[str, Any] = {"batch_size": SIZE, "shuffle": True, "seed": 1}


def make(**settings: Any) -> DataLoader:
    settings = {**BASE, **settings}
    return DataLoader(settings.pop("dataset", Range(N)), **settings)


def taken_and_state(**settings: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """The first :data:`TAKEN` batches of epoch 0 of ``make(**settings)``, and its state then."""
    with make(**settings) as loader:
        it = iter(loader)
        taken = as_lists([next(it) for _ in range(TAKEN)])
        state = loader.state_dict()
        del it
    return taken, state


def resumed(state: dict[str, Any], **settings: Any) -> list[list[int]]:
    """What ``make(**settings)`` yields after loading ``state``: the rest of its epoch."""
    with make(**settings) as loader:
        loader.load_state_dict(state)
        return as_lists(list(loader))


def refused(state: dict[str, Any], **settings: Any) -> str:
    """The message with which ``make(**settings)`` refuses ``state``; the loader is left as it
    was: its next epoch is a whole one."""
    with make(**settings) as loader:
        with pytest.raises(ValueError) as info:  # noqa: PT011  # the message is asserted after
            loader.load_state_dict(state)
        rest = list(loader)
        if not isinstance(loader.dataset, Resumable):  # (a stream has no length to compare)
            assert len(rest) == len(loader)  # not resumed: a whole epoch
    return str(info.value)


def test_a_state_loaded_into_a_loader_built_the_same_way_resumes_exactly() -> None:
    # The control for the matrix below: the same settings resume exactly, and are accepted.
    with make() as reference:
        epoch = as_lists(list(reference))
    taken, state = taken_and_state()
    assert state["version"] == 1
    assert taken + resumed(state) == epoch


# -- each setting that changes the order or the batches --------------------------------------


def _distributed(replicas: int) -> dict[str, Any]:
    return {"shuffle": None, "sampler": DistributedSampler(N, replicas, 0, seed=1)}


def _pairs() -> dict[str, Any]:
    pairs = [[i, i + 1] for i in range(0, N, 2)]
    return {"shuffle": None, "batch_size": None, "batch_sampler": pairs}


def _setting(**settings: Any) -> Any:
    """Makes ``settings`` afresh for each test: samplers and generators hold state."""
    return lambda: {k: v() if callable(v) else v for k, v in settings.items()}


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1)


# (saved with, loaded into, the setting as the message names it, its two values as shown).
SETTINGS: list[tuple[Any, Any, str, tuple[str, str]]] = [
    (_setting(shuffle=False), _setting(), "shuffle", ("False", "True")),
    (_setting(), _setting(shuffle=False), "shuffle", ("True", "False")),
    (_setting(), _setting(batch_size=8), "batch_size", ("4", "8")),
    (
        _setting(dataset=lambda: Range(42)),
        _setting(dataset=lambda: Range(42), drop_last=True),
        "last_batch",
        ("'keep'", "'discard'"),
    ),
    (_setting(), _setting(dataset=lambda: Range(44)), "samples", ("40", "44")),
    (
        _setting(shuffle=False),
        _setting(shuffle=None, sampler=lambda: list(range(N))[::-1]),
        "sampler",
        ("SequentialSampler", "list"),
    ),
    (
        _setting(),
        _setting(shuffle=None, sampler=lambda: RandomSampler(N, num_samples=20, seed=1)),
        "len(sampler)",
        ("40", "20"),
    ),
    (
        _setting(),
        _setting(seed=None, generator=_generator),
        "sampler generator",
        ("False", "True"),
    ),
    (_pairs, _setting(shuffle=False, batch_size=2), "batch_sampler", ("list", "BatchSampler")),
]


@pytest.mark.parametrize(
    ("saved_with", "loaded_into", "name", "values"),
    SETTINGS,
    ids=[f"{case[2]}-{i}" for i, case in enumerate(SETTINGS)],
)
def test_a_mid_epoch_state_is_refused_by_a_loader_with_another_setting(
    saved_with: Any, loaded_into: Any, name: str, values: tuple[str, str]
) -> None:
    # shuffle=False into shuffle=True resumed silently: 10 of 40 samples twice, 10 never.
    _, state = taken_and_state(**saved_with())
    message = refused(state, **loaded_into())
    saved, mine = values
    label = "over" if name == "samples" else name  # the length is shown with the batch size
    if name == "samples":
        assert f"over {saved} samples" in message
        assert f"over {mine} samples" in message
    else:
        assert f"{label}={saved}" in message
        assert f"{label}={mine}" in message
    assert "saved mid-epoch (epoch 0, 3 batches taken)" in message
    assert "built the same way" in message  # the fix


def test_a_state_of_other_ranks_without_the_positions_read_is_refused() -> None:
    # Saved on 2 ranks by an aioloader that did not record which positions of the epoch's
    # order the ranks read: nothing tells what the rest is on 4 (with them, the rest of the
    # epoch is shared out: tests/test_distributed_elastic.py).
    _, state = taken_and_state(**_distributed(2))
    assert state["consumed"] == [[0, 2 * TAKEN * SIZE]]  # every rank's first 3 batches
    message = refused({k: v for k, v in state.items() if k != "consumed"}, **_distributed(4))
    assert "num_replicas=2" in message
    assert "num_replicas=4" in message
    assert "built the same way" in message


def test_settings_that_keep_the_batches_may_change() -> None:
    # Workers and hand-over order do not change what a batch id is; neither does an explicit
    # sampler that is the one shuffle=False makes, nor (between epochs) any setting at all.
    with make() as reference:
        epoch = as_lists(list(reference))
    taken, state = taken_and_state()
    assert taken + resumed(state, num_workers=2, thread_pool=True, in_order=True) == epoch
    with make(shuffle=False) as reference:
        plain = as_lists(list(reference))
    taken, state = taken_and_state(shuffle=False)
    assert taken + resumed(state, shuffle=None, sampler=SequentialSampler(N)) == plain
    with make(shuffle=False) as loader:
        between = loader.state_dict()
    with make(batch_size=8, dataset=Range(44)) as other:
        other.load_state_dict(between)  # nothing was taken: nothing to count
        assert sorted(flat(list(other))) == list(range(44))


def test_a_sampler_state_this_loaders_samplers_cannot_take_is_refused_where_it_is_loaded() -> None:
    # Between epochs too: it was refused at the next iter(), after the state had been taken.
    with make() as loader:
        between = loader.state_dict()
    message = refused(between, shuffle=False)
    assert "'sampler' holds the keys" in message
    assert "'sampler': None" in message  # the way on: this loader's own order


# -- each field tampered with -----------------------------------------------------------------


def _with(state: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A deep copy of ``state`` with the field at ``path`` set to ``value`` (or removed, for
    :data:`GONE`)."""
    tampered = copy.deepcopy(state)
    *outer, last = path
    holder = tampered
    for key in outer:
        holder = holder[key]
    if value is GONE:
        del holder[last]
    else:
        holder[last] = value
    return tampered


GONE = object()

# (field, value, words the refusal must hold: the field and the value it got).
TAMPERED: list[tuple[tuple[str, ...], Any, list[str]]] = [
    (("done",), ["a"], ["'done'", "'a'"]),
    (("done",), [1.5], ["'done'", "1.5"]),
    (("done",), ["1"], ["'done'", "'1'"]),
    (("done",), [True], ["'done'", "True"]),
    (("done",), [-1], ["'done'", "-1"]),
    (("done",), [0, 10], ["'done'", "[10]", "10 batches"]),
    (("done",), [0, 1, 1], ["'done'", "[1]", "more than once"]),
    (("done",), "012", ["'done'", "'012'"]),
    (("epoch",), -1, ["'epoch'", "-1"]),
    (("epoch",), 0.0, ["'epoch'", "0.0"]),
    (("seed",), "1", ["'seed'", "'1'"]),
    (("version",), 2, ["version is 2", "versions 0 to 1"]),
    (("version",), "1", ["version is '1'"]),
    (("layout",), GONE, ["'layout'", "None"]),
    (("layout", "shuffle"), False, ["shuffle=False", "shuffle=True"]),
    (("layout", "batches"), 2, ["len(loader)=2", "len(loader)=10"]),
    (("sampler", "sampler", "seed"), 2, ["sampler seed is 2", "'seed' is 1"]),
    (("sampler", "sampler"), GONE, ["'sampler'", "'carry'"]),
    (("set_epoch",), "yes", ["'set_epoch'", "'yes'"]),
    (("sampler",), [1], ["'sampler'", "[1]"]),
    (("generators",), "g", ["'generators'", "'g'"]),
]


@pytest.mark.parametrize(
    ("path", "value", "words"),
    TAMPERED,
    ids=[".".join(p) + ("-gone" if v is GONE else f"={v!r}") for p, v, _ in TAMPERED],
)
def test_a_tampered_field_is_refused_naming_it_and_its_value(
    path: tuple[str, ...], value: Any, words: list[str]
) -> None:
    # ['a'] failed at the epoch's start with a bare int() error; floats, strings, negative and
    # out-of-range ids were taken; a sampler seed other than the state's was taken.
    _, state = taken_and_state()
    message = refused(_with(state, path, value))
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("readers", 0, ["'readers'", "0"]),
        ("last", 5, ["'last'", "reader 5", "1 readers"]),
        ("states", {7: {"next": 3}}, ["reader 7", "1 readers"]),
        ("states", [1], ["'states'", "[1]"]),
    ],
)
def test_tampered_stream_positions_are_refused(field: str, value: Any, words: list[str]) -> None:
    _, state = taken_and_state(dataset=Resumable(N), shuffle=None, seed=None)
    message = refused(_with(state, ("streams", field), value), dataset=Resumable(N), shuffle=None)
    for word in words:
        assert word in message, (word, message)


# -- the older format (no version) ------------------------------------------------------------


def _old_format(state: dict[str, Any], shape: bool) -> dict[str, Any]:
    """``state`` as an older aioloader saved it: no version and no layout; with ``shape``,
    the batch size and length the newest of those states recorded."""
    old = {k: v for k, v in state.items() if k not in ("version", "layout")}
    if shape and old["done"]:
        old["shape"] = {"batch_size": SIZE, "samples": N}
    return old


@pytest.mark.parametrize("shape", [False, True], ids=["without-shape", "with-shape"])
def test_an_old_mid_epoch_state_is_refused_with_both_ways_on(shape: bool) -> None:
    # Without the shape record it went into a loader of another batch size and skipped samples.
    taken, state = taken_and_state()
    old = _old_format(state, shape)
    for settings in ({}, {"batch_size": 8}, {"shuffle": False}):
        message = refused(old, **settings)
        assert "no 'version'" in message
        assert "'layout': loader.state_dict()['layout']" in message  # migrate, vouching
        assert "{**state, 'done': [], 'streams': None}" in message  # or replay the epoch
    with make() as reference:
        epoch = as_lists(list(reference))
    with make() as loader:  # vouched for: migrated explicitly, and exact
        loader.load_state_dict({**old, "version": 1, "layout": loader.state_dict()["layout"]})
        assert taken + as_lists(list(loader)) == epoch
    wrong = make(shuffle=False)  # a wrong vouch is still caught by the sampler state
    with wrong, pytest.raises(ValueError, match="'sampler' holds the keys"):
        wrong.load_state_dict({**old, "version": 1, "layout": wrong.state_dict()["layout"]})


def test_an_old_state_saved_between_epochs_is_migrated() -> None:
    with make() as reference:
        epochs = [as_lists(list(reference)) for _ in range(2)]
    with make() as first:
        list(first)
        old = _old_format(first.state_dict(), shape=False)
    assert "version" not in old
    with make() as second:
        second.load_state_dict(old)
        assert second.state_dict()["version"] == 1  # saved again: in the current format
        assert as_lists(list(second)) == epochs[1]
