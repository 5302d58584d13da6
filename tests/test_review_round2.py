"""What a second review of the statistics and collation changes found: the transfer verdict
named a setting that does nothing, the GIL verdict fired for one thread, an epoch's end showed
its batches without its wall time, collation refused what torch takes, and batches from
worker processes arrived as leaves that require grad.

A race is shown by forcing the interleaving: counters whose attribute writes run a reader at
the exact point the loop thread is between two of them."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import aioloader
from aioloader._batch._collate import default_collate, numpy_collate
from aioloader._errors import CollateTypeError
from aioloader._stats._counters import _SUMS, Capacity, Counters, EpochStatistics

TOKEN = object()


def sums(**values: float) -> list[float]:
    return [float(values.get(name, 0.0)) for name in _SUMS]


# -- the transfer verdict -----------------------------------------------------------------------


class _Stage:
    """What the epoch's capacity reads of a device stage: its target device (None: pin-only)."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device

    def start(self, batch: Any, batch_id: int) -> Any:
        raise AssertionError("not started here")


def test_copies_to_a_device_are_told_device_prefetch_whatever_pin_memory_says() -> None:
    from helpers import build_config

    from aioloader._epoch._consume import _capacity

    copies = sums(batches_yielded=100, consumer_wait_s=10, transfer_s=30)
    to_gpu = _Stage(torch.device("cuda", 0))
    for pin_memory in (False, True):  # False, the default: copies are pinned all the same
        capacity = _capacity(build_config(pin_memory=pin_memory, device_prefetch=2), to_gpu)
        assert capacity.staged
        stats = EpochStatistics.build(0, 100.0, copies, capacity)
        assert (stats.bottleneck, stats.knob) == ("transfer", "device_prefetch")
        assert "pin_memory" not in stats.hint
    # Pin-only mode (no device): pinning is the limit, said so.
    pin_only = _capacity(build_config(pin_memory=True), _Stage(None))
    assert not pin_only.staged
    stats = EpochStatistics.build(0, 100.0, copies, pin_only)
    assert (stats.knob, stats.hint.split(" (")[0]) == ("pin_memory", "pinning batches")
    assert not _capacity(build_config()).staged  # no device stage at all


# -- the GIL verdict ----------------------------------------------------------------------------


def test_one_busy_thread_at_one_cpu_is_not_called_gil_bound() -> None:
    # One thread uses 1 CPU at most, whether it runs Python (GIL) or numpy that releases it.
    busy = sums(batches_yielded=40, samples_yielded=160, consumer_wait_s=8, read_s=10)
    one = Capacity(makers=1, prefetch=8, batch_size=4, thread_pool=True)
    stats = EpochStatistics.build(0, 10.0, busy, one, cpu=(10.0, 10.0, 10.0, 0.0), cpus=8.0)
    assert (stats.bottleneck, stats.knob) == ("workers", "num_workers")
    assert "more threads cannot run at once" not in stats.hint
    assert "processes" in stats.hint
    assert "thread_pool=False" in stats.hint
    # Two threads at one CPU of 8: held by the GIL.
    two = Capacity(makers=2, prefetch=8, batch_size=4, thread_pool=True)
    both = sums(batches_yielded=40, samples_yielded=160, consumer_wait_s=8, read_s=20)
    stats = EpochStatistics.build(0, 10.0, both, two, cpu=(10.0, 10.0, 10.0, 0.0), cpus=8.0)
    assert stats.knob == "thread_pool"
    # Two threads on one CPU: they could use one at most; nothing to tell.
    stats = EpochStatistics.build(0, 10.0, both, two, cpu=(10.0, 1.0, 1.0, 0.0), cpus=1.0)
    assert stats.knob != "thread_pool"


# -- an epoch's end, read from another thread ---------------------------------------------------


class _ReadAsItEnds(Counters):
    """Counters that run ``reader`` right after the loop thread writes ``at``."""

    at = ""
    reader: Callable[[], None] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        reader = type(self).reader
        if name == type(self).at and reader is not None:
            type(self).reader = None
            reader()


@pytest.mark.parametrize("at", ["last_epoch", "wall_s", "running"])
def test_a_reader_during_an_epochs_end_sees_its_wall_time_once(at: str) -> None:
    counters = _ReadAsItEnds(cpu_clock=lambda: None, cpus=2.0)
    counters.begin_epoch(0, Capacity(), TOKEN, now=100.0)
    counters.batches_yielded = counters.samples_yielded = 50
    seen: list[EpochStatistics] = []
    _ReadAsItEnds.at = at
    _ReadAsItEnds.reader = lambda: seen.append(counters.measure_total(now=110.0))
    ended = counters.end_epoch(TOKEN, now=110.0)
    assert ended is not None
    assert ended.wall_s == 10.0
    assert len(seen) == 1
    # The epoch's 50 batches with its 10 s: neither without it (5 batches/s, not infinite)
    # nor twice.
    assert (seen[0].batches, seen[0].wall_s) == (50, 10.0)
    assert counters.measure_total(now=200.0).wall_s == 10.0


# -- collation takes what torch takes -----------------------------------------------------------


class _Indexed:
    """Samples with ``__len__`` and ``__getitem__``, not registered as a Sequence; its
    ``__getitem__`` never raises IndexError (iteration by index would not end)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Any:
        return self.items[i % len(self.items)]


@pytest.mark.parametrize("collate", [default_collate, numpy_collate])
def test_an_object_with_len_and_getitem_collates_as_its_items(collate: Any) -> None:
    assert collate(_Indexed([1, 2, 3])).tolist() == [1, 2, 3]
    pairs = collate(_Indexed([{"x": 1.5}, {"x": 2.5}]))
    assert pairs["x"].tolist() == [1.5, 2.5]


@pytest.mark.parametrize("collate", [default_collate, numpy_collate])
@pytest.mark.parametrize("sample", ["line 0", b"\x00\x01", ""])
def test_a_string_given_alone_comes_back_as_it_is(collate: Any, sample: Any) -> None:
    assert collate(sample) is sample


@pytest.mark.parametrize("collate", [default_collate, numpy_collate])
def test_a_pandas_frame_or_series_given_alone_is_refused_naming_its_type(collate: Any) -> None:
    # Keyed though not a Mapping: taken as a sequence, a DataFrame became its column names
    # and a Series lost its index, silently (torch raises a bare KeyError for both).
    pd = pytest.importorskip("pandas")
    for sample in (pd.DataFrame({"a": [1, 2], "b": [3, 4]}), pd.Series([1, 2], index=["x", "y"])):
        with pytest.raises(
            CollateTypeError, match=f"cannot collate a pandas.{type(sample).__name__}"
        ):
            collate(sample)


def test_a_loader_without_batching_hands_strings_over_with_default_collate() -> None:
    class Lines:
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int) -> str:
            return f"line {i}"

    lines: Any = Lines()
    theirs = list(torch.utils.data.DataLoader(lines, batch_size=None, collate_fn=default_collate))
    with aioloader.DataLoader(Lines(), batch_size=None, collate_fn=aioloader.default_collate) as ld:
        ours = list(ld)
    assert ours == theirs == ["line 0", "line 1", "line 2"]


# -- batches from worker processes keep requires_grad, as leaves ---------------------------------


class _Grads:
    """Samples that require grad: leaves, or made by an operation (with a graph)."""

    def __init__(self, n: int, leaf: bool) -> None:
        self.n, self.leaf = n, leaf

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = torch.full((self.n,), float(i), requires_grad=True)
        return {"x": x if self.leaf else x * 2, "y": torch.tensor(i)}


def test_batches_from_worker_processes_require_grad_as_leaves_at_every_size() -> None:
    # 4 floats travel pickled, 2**18 (1 MiB) in shared memory: the same either way, and no
    # walk of the batch in the worker to find out (torch's workers carry a leaf's flag; the
    # graph of a stacked batch cannot cross processes, so it arrives as a leaf).
    for n in (4, 1 << 18):
        for leaf in (True, False):
            with (
                warnings.catch_warnings(),
                aioloader.DataLoader(_Grads(n, leaf), batch_size=2, num_workers=1) as loader,
            ):
                warnings.simplefilter("error")
                batches = list(loader)
            for batch in batches:
                x = batch["x"]
                assert (x.requires_grad, x.is_leaf, x.grad_fn) == (True, True, None), (n, leaf)
            assert batches[1]["x"][1, 0].item() == float(3 * (1 if leaf else 2)), (n, leaf)
            assert batches[1]["y"].tolist() == [2, 3]


@pytest.mark.parametrize("thread_pool", [False, True])
def test_batches_made_in_this_process_keep_what_collation_made(thread_pool: bool) -> None:
    with (
        warnings.catch_warnings(),
        aioloader.DataLoader(
            _Grads(4, leaf=False),
            batch_size=2,
            num_workers=2 if thread_pool else 0,
            thread_pool=thread_pool,
        ) as loader,
    ):
        warnings.simplefilter("error")
        batch = next(iter(loader))
    assert batch["x"].requires_grad
    assert batch["x"].grad_fn is not None  # torch.stack's graph, back to the samples


def test_the_real_device_stage_tells_copies_to_a_device_from_pinning() -> None:
    from helpers import build_config
    from test_device import FakeBackend

    from aioloader._device import DeviceStage
    from aioloader._epoch._consume import _capacity

    to_gpu = DeviceStage("cuda", pin_memory=False, backend=FakeBackend())
    pin_only = DeviceStage(None, pin_memory=True, backend=FakeBackend())
    try:
        assert _capacity(build_config(), to_gpu).staged
        assert not _capacity(build_config(pin_memory=True), pin_only).staged
    finally:
        to_gpu.close()
        pin_only.close()
