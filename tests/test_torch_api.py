"""torch's DataLoader API, as a torch user meets it: the signature, the attributes and which of
them may be reassigned, ``batch_size=None`` (no automatic batching) and ``default_convert``,
samplers that yield numpy arrays or tensors, who calls ``set_epoch``, and where the seed comes
from (``torch.manual_seed``, a ``generator``, a saved state).

Where torch's behaviour is the reference, the test compares against torch itself (its live
signature, its attributes, its ``default_convert``), so a torch upgrade that moves the target
fails here. Tests that involve workers use real worker processes (``num_workers=2``).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import multiprocessing as mp
import sys
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from datasets import AsyncRange, NumpySamples, Range, Stream, TorchDraws, one_sample_tagged
from helpers import BOUND_S, as_lists, build_config, collect, flat

import aioloader
from aioloader import (
    BatchSampler,
    DataLoader,
    DeviceUnavailableWarning,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    ShardedBatchSampler,
    default_collate,
    default_convert,
)
from aioloader._config import resolve_seed
from aioloader._epoch._produce import Producer
from aioloader._epoch._reorder import Outcome, ReorderBuffer
from aioloader._stats._counters import Counters
from aioloader._types import BatchRequest, Made

# aioloader's own and MXNet Gluon's parameters: keyword-only, after torch's.
OWN_PARAMETERS = {
    "last_batch",
    "prefetch",
    "seed",
    "thread_pool",
    "batchify_fn",
    "pin_device_id",
    "transform",
    "io_concurrency",
    "mp_context",
    "allow_fork",
    "max_retries",
    "on_error",
    "max_failures",
    "device",
    "device_prefetch",
    "shm_max_bytes",
    "progress",
    "shard",
    "equal_steps",
    "leftover",
    "worker_seeding",
    "start_timeout",
    "workers",
}


def _torch_loader(dataset: object, *args: Any, **kwargs: Any) -> Any:
    """torch's DataLoader over one of the shared test datasets (duck-typed, as torch allows)."""
    return tud.DataLoader(cast(Any, dataset), *args, **kwargs)


torch_default_convert: Any = tud.default_convert


def _batches(loader: DataLoader) -> list[Any]:
    with loader:
        return list(loader)


# -- the signature --------------------------------------------------------------------------------


def test_parameters_begin_with_torchs_in_order_kind_and_default() -> None:
    torchs = list(inspect.signature(tud.DataLoader).parameters.values())
    ours = list(inspect.signature(DataLoader).parameters.values())
    head = [(p.name, p.kind, p.default) for p in ours[: len(torchs)]]
    assert head == [(p.name, p.kind, p.default) for p in torchs]
    rest = ours[len(torchs) :]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in rest)
    assert {p.name for p in rest} == OWN_PARAMETERS


def test_torchs_positional_call_works_and_nothing_more_is_positional() -> None:
    args = (2, False, None, None, 0, None, False, True, 0, None, None, None)  # as torch's order
    assert as_lists(_batches(DataLoader(Range(5), *args))) == [[0, 1], [2, 3]]  # drop_last
    with pytest.raises(TypeError, match="positional"):
        DataLoader(Range(5), *args, 4)  # type: ignore[call-arg]


# -- attributes -----------------------------------------------------------------------------------


def _public_attributes(loader: object) -> set[str]:
    names = {name for name in vars(loader) if not name.startswith("_")}
    for klass in type(loader).__mro__:
        names |= {n for n, v in vars(klass).items() if isinstance(v, property)}
    return {name for name in names if not name.startswith("_")}


def test_every_attribute_of_torchs_loader_is_here_with_torchs_value() -> None:
    def worker_init(worker_id: int) -> None:
        pass

    generator = torch.Generator().manual_seed(1)
    kwargs: dict[str, Any] = {
        "batch_size": 3,
        "shuffle": True,
        "num_workers": 2,
        "thread_pool": True,  # threads: the local worker_init_fn need not pickle
        "drop_last": True,
        "timeout": 0,
        "worker_init_fn": worker_init,
        "generator": generator,
        "persistent_workers": True,
        "in_order": False,
    }
    torch_kwargs = {k: v for k, v in kwargs.items() if k != "thread_pool"}
    dataset = Range(10)
    theirs = _torch_loader(dataset, **torch_kwargs)
    with DataLoader(dataset, **kwargs) as ours:
        missing = _public_attributes(theirs) - set(dir(ours))
        assert missing == set()
        for name in (
            "batch_size",
            "num_workers",
            "pin_memory",
            "drop_last",
            "timeout",
            "prefetch_factor",
            "persistent_workers",
            "pin_memory_device",
            "in_order",
        ):
            assert getattr(ours, name) == getattr(theirs, name), name
        assert ours.dataset is dataset
        assert ours.worker_init_fn is worker_init
        assert ours.generator is generator
        assert ours.collate_fn is default_collate
        assert isinstance(ours.sampler, RandomSampler)
        assert isinstance(ours.batch_sampler, BatchSampler)
        assert ours.batch_sampler.sampler is ours.sampler
        assert len(ours) == len(theirs) == 3


def test_attributes_follow_torch_for_a_batch_sampler_and_without_batching() -> None:
    user = BatchSampler(RandomSampler(10, seed=1), 4)
    loader = DataLoader(Range(10), batch_sampler=user)
    assert (loader.batch_size, loader.drop_last, loader.batch_sampler) == (None, False, user)
    assert loader.sampler is user.sampler  # the index sampler inside the batch sampler
    plain = DataLoader(Range(10), batch_sampler=[[0, 1], [2]])
    assert isinstance(plain.sampler, SequentialSampler)  # as torch shows for its own
    unbatched = DataLoader(Range(10), batch_size=None, shuffle=True)
    assert (unbatched.batch_size, unbatched.batch_sampler) == (None, None)
    assert isinstance(unbatched.sampler, RandomSampler)
    assert unbatched.collate_fn is default_convert
    assert len(unbatched) == 10
    assert DataLoader(Stream(4)).sampler is None  # torch's infinite placeholder has no use here
    assert DataLoader(Range(4), num_workers=2).prefetch_factor == 2
    assert DataLoader(Range(4)).prefetch_factor is None
    assert DataLoader(Range(4), num_workers=2, prefetch=7).prefetch_factor == 3
    context = DataLoader(Range(4), num_workers=1, multiprocessing_context="spawn")
    assert isinstance(context.multiprocessing_context, mp.context.BaseContext)
    assert context.multiprocessing_context.get_start_method() == "spawn"
    assert context.mp_context is context.multiprocessing_context
    assert (context.timeout, DataLoader(Range(4), timeout=2.5).timeout) == (0, 2.5)
    for made in (loader, plain, unbatched, context):
        made.close()


TORCH_REFUSES = ["dataset", "batch_size", "batch_sampler", "sampler", "drop_last"]


@pytest.mark.parametrize("name", [*TORCH_REFUSES, "persistent_workers"])
def test_what_torch_refuses_to_reassign_is_refused_with_its_words(name: str) -> None:
    loader = DataLoader(Range(4), batch_size=2, num_workers=1, thread_pool=True)
    if name in TORCH_REFUSES:  # persistent_workers needs workers in torch: checked above
        theirs = _torch_loader(Range(4), batch_size=2)
        with pytest.raises(ValueError, match=f"{name} attribute should not be set") as torch_error:
            setattr(theirs, name, getattr(theirs, name))
    expected = f"{name} attribute should not be set after DataLoader is initialized"
    with pytest.raises(ValueError, match=f"^{expected}$"):
        setattr(loader, name, getattr(loader, name))
    if name in TORCH_REFUSES:
        assert str(torch_error.value) == expected  # the same words


def test_every_other_setting_is_fixed_too_and_private_or_new_attributes_are_not() -> None:
    loader = DataLoader(Range(4), batch_size=2)
    for name in (
        "num_workers",
        "collate_fn",
        "pin_memory",
        "timeout",
        "multiprocessing_context",
        "generator",
        "prefetch_factor",
        "pin_memory_device",
        "in_order",
        "seed",
        "prefetch",
        "mp_context",
        "last_batch",
    ):
        with pytest.raises(ValueError, match=f"^{name} attribute should not be set") as info:
            setattr(loader, name, getattr(loader, name))
        assert "checked once" in str(info.value)
    setattr(loader, "tag", "mine")  # noqa: B010 - an attribute a user adds
    setattr(loader, "_private", 1)  # noqa: B010
    assert (getattr(loader, "tag"), getattr(loader, "_private")) == ("mine", 1)  # noqa: B009
    assert as_lists(_batches(loader)) == [[0, 1], [2, 3]]  # and the loader still works


# -- arguments torch has and aioloader maps -------------------------------------------------------


def test_multiprocessing_context_takes_a_name_or_a_context_and_mp_context_is_its_alias() -> None:
    spawn = mp.get_context("spawn")
    for kwargs in (
        {"multiprocessing_context": "spawn"},
        {"multiprocessing_context": spawn},
        {"mp_context": "spawn"},
        {"multiprocessing_context": "spawn", "mp_context": "spawn"},
        {"multiprocessing_context": spawn, "mp_context": spawn},
    ):
        loader = DataLoader(Range(4), num_workers=1, **kwargs)
        assert loader.multiprocessing_context is not None
        assert loader.multiprocessing_context.get_start_method() == "spawn"
        loader.close()
    with pytest.raises(ValueError, match=r"multiprocessing_context.*mp_context") as info:
        DataLoader(Range(4), num_workers=1, multiprocessing_context="spawn", mp_context="fork")
    assert "multiprocessing_context='spawn', mp_context='fork'" in str(info.value)
    with pytest.raises(ValueError, match="multiprocessing_context='telepathy'"):
        DataLoader(Range(4), num_workers=1, multiprocessing_context="telepathy")
    with pytest.raises(TypeError, match="multiprocessing_context must be"):
        DataLoader(Range(4), num_workers=1, multiprocessing_context=3)  # type: ignore[arg-type]


def test_prefetch_factor_is_batches_per_worker_by_torchs_rules() -> None:
    assert DataLoader(Range(4), num_workers=2, prefetch_factor=3).prefetch == 6
    threads = DataLoader(Range(4), num_workers=3, thread_pool=True, prefetch_factor=1)
    assert (threads.prefetch, threads.prefetch_factor) == (3, 1)
    with pytest.raises(ValueError, match="prefetch_factor=2 needs num_workers > 0"):
        DataLoader(Range(4), prefetch_factor=2)  # torch refuses it without workers too
    with pytest.raises(ValueError, match="prefetch_factor"):
        _torch_loader(Range(4), prefetch_factor=2)
    with pytest.raises(ValueError, match="prefetch=4, prefetch_factor=2"):
        DataLoader(Range(4), num_workers=2, prefetch=4, prefetch_factor=2)
    with pytest.raises(ValueError, match="prefetch_factor must be a positive int, got 0"):
        DataLoader(Range(4), num_workers=2, prefetch_factor=0)
    with pytest.raises(TypeError, match="prefetch_factor"):
        DataLoader(Range(4), num_workers=2, prefetch_factor=1.5)  # type: ignore[arg-type]


def test_persistent_workers_is_checked_as_torch_does_and_kept() -> None:
    with pytest.raises(ValueError, match="persistent_workers=True needs num_workers > 0"):
        DataLoader(Range(4), persistent_workers=True)
    with pytest.raises(ValueError, match="persistent_workers"):
        _torch_loader(Range(4), persistent_workers=True)
    with pytest.raises(TypeError, match="persistent_workers must be a bool, got 2"):
        DataLoader(Range(4), num_workers=1, persistent_workers=2)  # type: ignore[arg-type]
    loader = DataLoader(Range(4), num_workers=1, persistent_workers=True)
    assert loader.persistent_workers is True
    assert loader._config.persistent_workers is True  # the field the workers read
    loader.close()


def test_pin_memory_device_is_a_string_naming_a_cuda_device() -> None:
    assert DataLoader(Range(4), pin_memory_device="cuda:1").pin_memory_device == "cuda:1"
    assert DataLoader(Range(4)).pin_memory_device == ""
    # torch (which deprecated the argument) accepts "cpu" and pins for the current accelerator
    assert DataLoader(Range(4), pin_memory_device="cpu").pin_memory_device == ""
    with pytest.raises(ValueError, match="pin_memory_device='xpu'"):
        DataLoader(Range(4), pin_memory_device="xpu")
    with pytest.raises(TypeError, match="pin_memory_device must be a str, got 0"):
        DataLoader(Range(4), pin_memory_device=0)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour")
def test_pin_memory_without_cuda_warns_once_and_yields_the_batches() -> None:
    loader = DataLoader(Range(5), batch_size=2, pin_memory=True, pin_memory_device="cuda")
    with pytest.warns(DeviceUnavailableWarning, match="pin_memory=True") as caught:
        batches = as_lists(_batches(loader))
    assert batches == [[0, 1], [2, 3], [4]]
    assert len(caught) == 1


@pytest.mark.cuda
def test_pin_memory_device_pins_for_that_cuda_device() -> None:
    loader = DataLoader(Range(5), batch_size=2, pin_memory=True, pin_memory_device="cuda:0")
    batches = _batches(loader)
    assert as_lists(batches) == [[0, 1], [2, 3], [4]]
    assert all(b.is_pinned() for b in batches)


def test_timeout_zero_is_no_limit_and_a_negative_one_is_named() -> None:
    assert DataLoader(Range(4)).timeout == 0
    assert DataLoader(Range(4), timeout=None).timeout == 0  # aioloader's spelling
    with pytest.raises(ValueError, match="timeout must be finite and >= 0, got -1"):
        DataLoader(Range(4), timeout=-1)


def test_shuffle_none_is_the_default_and_an_iterable_takes_none_or_false() -> None:
    assert as_lists(_batches(DataLoader(Range(4), batch_size=2, shuffle=None))) == [[0, 1], [2, 3]]
    for shuffle in (None, False):
        assert flat(_batches(DataLoader(Stream(4), batch_size=2, shuffle=shuffle))) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="shuffle"):
        DataLoader(Stream(4), shuffle=True)


# -- batch_size=None: no automatic batching -------------------------------------------------------


def _check_converted(sample: Any, index: int) -> None:
    assert set(sample) == {"x", "name", "scalar", "index"}
    assert isinstance(sample["x"], torch.Tensor)
    assert sample["x"].tolist() == [index] * 3
    assert isinstance(sample["name"], np.ndarray)  # a string array is left as it is
    assert sample["name"].tolist() == [f"s{index}"]
    assert isinstance(sample["scalar"], torch.Tensor)
    assert (sample["scalar"].dim(), sample["scalar"].dtype) == (0, torch.float32)
    assert type(sample["index"]) is int
    assert sample["index"] == index


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"num_workers": 2}, {"num_workers": 2, "thread_pool": True}],
    ids=["thread", "processes", "thread_pool"],
)
def test_batch_size_none_yields_each_sample_converted_in_the_samplers_order(
    kwargs: dict[str, Any],
) -> None:
    n = 7
    loader = DataLoader(NumpySamples(n), batch_size=None, shuffle=True, seed=3, **kwargs)
    samples = _batches(loader)
    order = list(RandomSampler(n, seed=3))  # epoch 0 of the loader's own sampler
    assert len(samples) == n
    for sample, index in zip(samples, order, strict=True):
        _check_converted(sample, index)
    theirs = list(_torch_loader(NumpySamples(n), batch_size=None))
    assert [s["x"].tolist() for s in theirs] == [[i] * 3 for i in range(n)]


@pytest.mark.parametrize("kwargs", [{}, {"num_workers": 2}], ids=["thread", "processes"])
def test_batch_size_none_hands_a_user_collate_fn_one_sample(kwargs: dict[str, Any]) -> None:
    loader = DataLoader(
        Range(4), batch_size=None, sampler=[3, 1], collate_fn=one_sample_tagged, **kwargs
    )
    assert loader.collate_fn is one_sample_tagged
    assert _batches(loader) == [("one", 3), ("one", 1)]
    theirs = _torch_loader(Range(4), batch_size=None, sampler=[3, 1], collate_fn=one_sample_tagged)
    assert list(theirs) == [("one", 3), ("one", 1)]


def test_batch_size_none_streams_an_iterable_one_item_at_a_time() -> None:
    assert _batches(DataLoader(Stream(5), batch_size=None)) == [0, 1, 2, 3, 4]
    got = _batches(DataLoader(Stream(6), batch_size=None, num_workers=2))
    assert sorted(got) == list(range(6))  # each worker streams its own share


async def test_batch_size_none_reads_an_async_dataset_one_sample_at_a_time() -> None:
    async with DataLoader(AsyncRange(6), batch_size=None, sampler=[5, 0, 3]) as loader:
        assert await collect(loader) == [5, 0, 3]


def test_batch_size_none_excludes_drop_last_as_in_torch() -> None:
    with pytest.raises(ValueError, match=r"batch_size=None.*drop_last=True"):
        DataLoader(Range(4), batch_size=None, drop_last=True)
    with pytest.raises(ValueError, match="drop_last"):
        _torch_loader(Range(4), batch_size=None, drop_last=True)


# -- default_convert ------------------------------------------------------------------------------

Point = collections.namedtuple("Point", ["x", "y"])


def _same(ours: Any, theirs: Any) -> bool:
    """Equal values of equal types, all the way down (tensors: dtype and values)."""
    if type(ours) is not type(theirs):
        return False
    if isinstance(ours, torch.Tensor):
        return ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    if isinstance(ours, np.ndarray):
        return ours.dtype == theirs.dtype and bool((ours == theirs).all())
    if isinstance(ours, dict):
        return ours.keys() == theirs.keys() and all(_same(ours[k], theirs[k]) for k in ours)
    if isinstance(ours, list | tuple):
        return len(ours) == len(theirs) and all(map(_same, ours, theirs))
    return bool(ours == theirs)


CONVERT_CASES: list[Any] = [
    0,
    1.5,
    "text",
    b"bytes",
    None,
    np.arange(4),
    np.float32(2.5),
    np.int16(3),
    np.bool_(True),
    np.array(7),
    np.array(["a", "b"]),
    np.array([b"a"]),
    np.array([1, "x"], dtype=object),
    torch.arange(3),
    [np.arange(2), np.arange(2, 4)],
    (np.arange(2), "t"),
    Point(np.array(0), np.array(1.0)),
    {"a": np.ones((2, 2)), "b": {"c": [np.int64(1), "s"]}},
    collections.OrderedDict(a=np.zeros(1)),
    range(3),
]


@pytest.mark.parametrize("data", CONVERT_CASES, ids=[type(c).__name__ for c in CONVERT_CASES])
def test_default_convert_matches_torchs(data: Any) -> None:
    ours, theirs = default_convert(data), torch_default_convert(data)
    assert _same(ours, theirs), (ours, theirs)


def test_default_convert_keeps_mapping_types_and_refuses_nothing() -> None:
    factory: collections.defaultdict[str, Any] = collections.defaultdict(list, a=np.arange(2))
    out = default_convert(factory)
    assert isinstance(out, collections.defaultdict)
    assert out.default_factory is list
    assert isinstance(out["a"], torch.Tensor)
    frozen = np.arange(3)
    frozen.flags.writeable = False  # torch.as_tensor would warn; a copy is made instead
    assert default_convert(frozen).tolist() == [0, 1, 2]
    swapped = np.arange(3, dtype=">i4")  # non-native byte order: torch cannot share it
    assert default_convert(swapped).tolist() == [0, 1, 2]
    dates = np.array(["2024-01-01"], dtype="datetime64[D]")
    assert default_convert(dates) is dates  # torch has no tensor of dates: left as it is
    shared = np.arange(3)
    assert default_convert(shared).data_ptr() == shared.ctypes.data  # no copy, as torch


# -- samplers that yield numpy arrays, tensors, numpy or torch integers ---------------------------

BATCHES: dict[str, list[Any]] = {
    "numpy arrays": [np.array([0, 1]), np.array([2, 3]), np.array([4])],
    "torch tensors": [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4])],
    "numpy int lists": [[np.int64(0), np.int32(1)], [np.uint8(2), np.int64(3)], [np.int16(4)]],
    "torch scalars": [
        [torch.tensor(0), torch.tensor(1)],
        [torch.tensor(2), torch.tensor(3)],
        [torch.tensor(4)],
    ],
    "0-d arrays": [(np.array(0), np.array(1)), (np.array(2), np.array(3)), (np.array(4),)],
}


@pytest.mark.parametrize(
    ("kind", "kwargs"),
    [(kind, {}) for kind in BATCHES] + [("numpy arrays", {"num_workers": 2})],
    ids=[*BATCHES, "numpy arrays, processes"],
)
def test_a_batch_sampler_of_arrays_or_tensors_works_and_does_not_hang(
    kind: str, kwargs: dict[str, Any]
) -> None:
    loader = DataLoader(Range(5), batch_sampler=BATCHES[kind], timeout=5, **kwargs)
    assert as_lists(_batches(loader)) == [[0, 1], [2, 3], [4]]


def test_samplers_yielding_numpy_or_torch_integers_work() -> None:
    samplers: list[Any] = [
        [np.int64(3), np.int8(0)],
        [torch.tensor(3), torch.tensor(0)],
        np.array([3, 0]),
    ]
    for sampler in samplers:
        assert as_lists(_batches(DataLoader(Range(4), batch_size=2, sampler=sampler))) == [[3, 0]]
    batches: list[Any] = [np.array([0, 1, 2]), torch.tensor([3, 4])]
    sharded = ShardedBatchSampler(batches, 2)
    loader = DataLoader(Range(5), batch_sampler=sharded)
    assert [as_lists(b) for b in _batches(loader)] == [[[0, 1], [2]], [[3], [4]]]
    grid = [np.array([[0, 1], [2, 3]])]  # a 2-d array: a batch of two shards
    assert [as_lists(b) for b in _batches(DataLoader(Range(4), batch_sampler=grid))] == [
        [[0, 1], [2, 3]]
    ]


@pytest.mark.parametrize("kwargs", [{}, {"num_workers": 2}], ids=["thread", "processes"])
def test_a_sampler_yielding_a_non_index_is_named_at_its_turn(kwargs: dict[str, Any]) -> None:
    sampler = [0, 1, 2, 3, 2.5, 4]
    loader = DataLoader(Range(6), batch_size=2, sampler=sampler, timeout=5, **kwargs)
    with loader:
        it = iter(loader)
        got = [next(it).tolist(), next(it).tolist()]
        with pytest.raises(TypeError) as info:
            next(it)
    assert got == [[0, 1], [2, 3]]  # what came before, in order, then the error
    message = str(info.value)
    assert f"sampler={sampler!r} yielded 2.5 (for batch 2)" in message
    assert "not an index" in message


def test_a_batch_sampler_yielding_a_non_batch_is_named() -> None:
    cases: list[tuple[list[Any], str]] = [
        ([[0, 1], 2], "yielded 2 as batch 1"),
        ([[0], np.array([0.5, 1.0])], "yielded array([0.5, 1. ]) as batch 1"),
        ([["a", 1]], "yielded ['a', 1] as batch 0"),  # all strings would be keys
        ([[0], torch.tensor([True])], "yielded tensor([True]) as batch 1"),
        ([{"x": 1}], "yielded {'x': 1} as batch 0"),
    ]
    for plan, needle in cases:
        loader = DataLoader(Range(4), batch_sampler=plan)
        with pytest.raises(TypeError) as info:
            _batches(loader)
        assert f"batch_sampler={plan!r}" in str(info.value)
        assert needle in str(info.value)


class _FailingRunner:
    """Fails synchronously when asked to start batch 1 (a fault at the moment a batch id is
    already expected but no task owns it yet); makes the others at once."""

    streams = 1
    restarts = 0
    shm_fallbacks = 0
    inline = None

    def start_make(self, request: BatchRequest) -> asyncio.Future[Made]:
        if request.batch_id == 1:
            raise RuntimeError("cannot start batch 1")
        future: asyncio.Future[Made] = asyncio.get_running_loop().create_future()
        future.set_result(Made(batch=list(request.indices), samples=len(request.indices)))
        return future


async def test_a_scheduling_failure_after_its_batch_was_expected_arrives_at_its_turn() -> None:
    # The cause of the old hang: the scheduler failed after the reorder buffer expected batch
    # 1, delivered the error as batch 2, and an in-order consumer waited for batch 1 forever.
    reorder = ReorderBuffer(in_order=True)
    woken = asyncio.Event()
    producer = Producer(
        build_config(prefetch=4),
        0,
        _FailingRunner(),  # type: ignore[arg-type]
        Counters(),
        plan=iter([(0, [0]), (1, [1]), (2, [2])]),
        dataset=None,
        reorder=reorder,
        permits=asyncio.Semaphore(4),
        wake=woken.set,
    )
    producer.start()
    outcomes: list[Outcome] = []
    async with asyncio.timeout(BOUND_S):
        while len(outcomes) < 2:
            outcome = reorder.pop_ready()
            if outcome is None:
                woken.clear()
                await woken.wait()
                continue
            outcomes.append(outcome)
    assert outcomes[0].value == [0]
    assert (outcomes[1].batch_id, str(outcomes[1].error)) == (1, "cannot start batch 1")
    assert producer.done
    assert len(reorder) == 0
    await asyncio.gather(*producer.cancel(), return_exceptions=True)


# -- set_epoch: the loader's samplers, and yours --------------------------------------------------


class EpochRecorder(SequentialSampler):
    """A sequential sampler that records every ``set_epoch`` call."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.calls: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.calls.append(epoch)


def test_a_users_set_epoch_on_their_sampler_is_not_overridden() -> None:
    makers: list[Callable[[], Any]] = [
        lambda: DistributedSampler(12, num_replicas=2, rank=1, seed=4),
        lambda: tud.DistributedSampler(cast(Any, Range(12)), num_replicas=2, rank=1, seed=4),
    ]
    for make in makers:
        sampler, reference = make(), make()
        reference.set_epoch(5)
        loader = DataLoader(Range(12), batch_size=3, sampler=sampler)
        sampler.set_epoch(5)  # the torch idiom: the training loop sets the sampler's epoch
        assert flat(_batches(loader)) == list(reference)  # epoch 5, not the loader's 0


def test_the_loader_calls_set_epoch_on_your_sampler_only_for_an_epoch_you_name() -> None:
    recorder = EpochRecorder(4)
    loader = DataLoader(Range(4), batch_size=2, sampler=recorder)
    with loader:
        list(loader)
        assert recorder.calls == []
        loader.set_epoch(7)
        list(loader)
        assert recorder.calls == [7]
        list(loader)  # epoch 8, not named: the sampler is left alone
        assert recorder.calls == [7]
        assert loader.statistics().epoch == 8
    batch_recorder = BatchSampler(EpochRecorder(4), 2)
    with DataLoader(Range(4), batch_sampler=batch_recorder) as loader:
        loader.set_epoch(2)
        list(loader)
    assert batch_recorder.sampler.calls == [2]  # type: ignore[attr-defined]


def test_resume_tells_your_sampler_the_epoch_it_was_told() -> None:
    def make() -> tuple[DataLoader, Any]:
        sampler: Any = tud.DistributedSampler(cast(Any, Range(16)), num_replicas=2, rank=0, seed=1)
        return DataLoader(Range(16), batch_size=2, sampler=sampler), sampler

    first, _ = make()
    with first:
        first.set_epoch(4)
        it = iter(first)
        taken = [next(it).tolist() for _ in range(2)]
        state = first.state_dict()
        rest = [b.tolist() for b in it]
    assert state["set_epoch"] is True
    second, sampler = make()
    with second:
        second.load_state_dict(state)
        assert as_lists(list(second)) == rest
    assert sampler.epoch == 4
    assert len(taken + rest) == 4


# -- the seed: torch.manual_seed, a generator, a saved state --------------------------------------


def test_torch_manual_seed_repeats_shuffling_and_worker_seeds() -> None:
    def run() -> tuple[int, list[Any]]:
        loader = DataLoader(TorchDraws(8), batch_size=2, shuffle=True, num_workers=2)
        return loader.seed, _batches(loader)

    torch.manual_seed(0)
    seed_a, a = run()
    torch.manual_seed(0)
    seed_b, b = run()
    assert seed_a == seed_b
    assert [x[0].tolist() for x in a] == [x[0].tolist() for x in b]  # the same order
    assert [x[1].tolist() for x in a] == [x[1].tolist() for x in b]  # the same draws
    assert flat([x[0] for x in a]) != list(range(8))
    seed_c, _ = run()  # the global generator moved on: another seed
    assert seed_c != seed_a


def test_a_generator_gives_the_seed_and_leaves_the_global_generator_alone() -> None:
    before = torch.get_rng_state()
    one = DataLoader(Range(4), generator=torch.Generator().manual_seed(5))
    two = DataLoader(Range(4), generator=torch.Generator().manual_seed(5))
    assert one.seed == two.seed
    assert torch.equal(torch.get_rng_state(), before)
    assert DataLoader(Range(4), seed=11, generator=torch.Generator()).seed == 11
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator"):
        DataLoader(Range(4), generator=3)


def test_without_torch_imported_the_seed_is_fresh_and_torch_stays_unimported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # as if nobody imported torch
    seeds = {resolve_seed(None, None) for _ in range(3)}
    assert len(seeds) == 3
    assert all(0 <= s < 2**63 for s in seeds)
    assert sys.modules["torch"] is None  # not imported for it
    assert resolve_seed(7, None) == 7


@pytest.mark.parametrize("kwargs", [{}, {"num_workers": 2}], ids=["thread", "processes"])
def test_a_loader_without_seed_adopts_the_saved_seed_and_resumes_exactly(
    kwargs: dict[str, Any],
) -> None:
    def make() -> DataLoader:
        return DataLoader(TorchDraws(10), batch_size=2, shuffle=True, **kwargs)

    first = make()
    with first:
        it = iter(first)
        next(it)
        state = first.state_dict()
        rest = [(b[0].tolist(), b[1].tolist()) for b in it]
    assert state["seed"] == first.seed
    second = make()
    with second:  # workers already started with another seed: they are replaced
        assert second.seed != state["seed"]
        second.load_state_dict(state)
        assert second.seed == state["seed"]
        resumed = [(b[0].tolist(), b[1].tolist()) for b in second]
    if kwargs:
        assert resumed == rest  # the same indices, and the same per-batch worker seeds
    else:
        assert [r[0] for r in resumed] == [r[0] for r in rest]  # threads are not reseeded
    explicit = DataLoader(TorchDraws(10), batch_size=2, shuffle=True, seed=state["seed"] + 1)
    with pytest.raises(ValueError, match=f"state was saved with seed={state['seed']}"):
        explicit.load_state_dict(state)


def test_shuffle_with_a_generator_resumes_exactly_mid_epoch_and_after() -> None:
    def make() -> DataLoader:
        return DataLoader(Range(11), batch_size=3, shuffle=True, generator=torch.Generator())

    reference = make()
    reference.generator.manual_seed(9)
    with reference:
        it = iter(reference)
        taken = next(it).tolist()
        state = reference.state_dict()
        rest = as_lists(list(it))
        following = as_lists(list(reference))
    resumed = make()  # its generator is seeded differently; the state carries the order
    with resumed:
        resumed.load_state_dict(state)
        assert as_lists(list(resumed)) == rest
        assert as_lists(list(resumed)) == following
    assert sorted(taken + flat(rest)) == list(range(11))
    assert sorted(flat(following)) == list(range(11))
    assert following != [taken, *rest]  # a new epoch, a new order


def test_the_seed_cannot_change_under_a_running_epoch_of_worker_processes() -> None:
    state = DataLoader(Range(8), batch_size=2, seed=1).state_dict()
    loader = DataLoader(Range(8), batch_size=2, num_workers=2)
    with loader:
        it = iter(loader)
        next(it)
        with pytest.raises(ValueError, match="while an epoch is being iterated"):
            loader.load_state_dict(state)
        assert flat(list(it)) == list(range(2, 8))  # the epoch goes on, untouched


def test_exports() -> None:
    assert aioloader.default_convert is default_convert
    assert default_convert.__module__ == "aioloader"


class _EchoKey:
    """A map-style dataset that returns the key it is given."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, key: Any) -> Any:
        return key


@pytest.mark.parametrize("workers", [0, 2])
def test_tuple_and_string_keys_reach_the_dataset_as_in_torch_never_as_shards(
    workers: int,
) -> None:
    # (index, size) pairs of a multi-scale batch sampler: torch passes each pair to
    # dataset[key]. Read as two shards of indices, they would load samples 0, 224, 1 and 224
    # without a word.
    for plan in ([[(0, 224), (1, 224)], [(2, 320), (3, 320)]], [["cat", "dog"], ["eel"]]):
        theirs = list(tud.DataLoader(_EchoKey(), batch_sampler=plan))  # type: ignore[arg-type]
        ours = _batches(DataLoader(_EchoKey(), batch_sampler=plan, num_workers=workers))
        assert repr(ours) == repr(theirs)  # default collate of the keys: tensors, or strings
        keys = _batches(
            DataLoader(_EchoKey(), batch_sampler=plan, collate_fn=list, num_workers=workers)
        )
        assert keys == plan  # the keys themselves, tuples still tuples


@pytest.mark.parametrize("batch", [[1, "a"], [{"i": 1}], [(0, 1), "a"], [None]])
def test_a_batch_of_neither_indices_nor_keys_is_refused(batch: list[Any]) -> None:
    with pytest.raises(TypeError, match=r"batch_sampler=.* yielded .* as batch 0"):
        _batches(DataLoader(_EchoKey(), batch_sampler=[batch]))


@pytest.mark.parametrize("context", ["spawn", mp.get_context("spawn")])
def test_a_start_method_without_workers_is_refused_as_in_torch(context: Any) -> None:
    with pytest.raises(ValueError, match=r"multiprocessing_context=.* needs worker processes"):
        DataLoader(Range(4), multiprocessing_context=context)
    with pytest.raises(ValueError, match=r"mp_context=.* needs worker processes"):
        DataLoader(Range(4), num_workers=2, thread_pool=True, mp_context=context)
    with pytest.raises(ValueError, match="multiprocessing_context"):
        tud.DataLoader(cast(Any, range(4)), multiprocessing_context=context)  # torch's rule
