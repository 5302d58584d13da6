"""Progress bars (_progress): ``DataLoader(progress=...)`` shows a tqdm bar per epoch, for
``async for`` and ``for``, closed at the epoch's end (or when it is left) and on close.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import numpy as np
import pytest
import tqdm
from datasets import Range
from helpers import collect

from aioloader import DataLoader


@pytest.fixture(autouse=True)
def _no_tqdm_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    # tqdm starts a monitor thread with its first bar and keeps it for the process: the leak
    # check would take it for ours. tqdm's documented switch turns it off.
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)


class Arrays:
    """Sample ``i``: 250 float32 (1000 bytes)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(250, index, dtype=np.float32)


class Bars:
    """A factory that makes quiet tqdm bars (into a buffer) and keeps them."""

    def __init__(self) -> None:
        self.made: list[tuple[Any, io.StringIO, dict[str, Any]]] = []

    def __call__(self, **kwargs: Any) -> Any:
        out = io.StringIO()
        bar: Any = tqdm.tqdm(file=out, mininterval=0, **kwargs)
        self.made.append((bar, out, kwargs))
        return bar


def closed(bar: Any) -> bool:
    return bool(bar.disable)  # tqdm disables a bar when it closes


async def test_a_bar_per_epoch_counts_batches_and_closes_at_the_end() -> None:
    bars = Bars()
    async with DataLoader(Arrays(20), batch_size=4, progress=bars) as loader:
        for _ in range(2):
            await collect(loader)
            bar = bars.made[-1][0]
            assert closed(bar)
            assert bar.n == bar.total == 5
    assert [kw for _, _, kw in bars.made] == [
        {"total": 5, "desc": "epoch 0", "unit": "batch"},
        {"total": 5, "desc": "epoch 1", "unit": "batch"},
    ]
    text = bars.made[-1][1].getvalue()
    assert "epoch 1" in text
    assert "5/5" in text
    assert "batch/s" in text  # tqdm's rate, in batches
    for part in ("samples/s", "MB/s", "wait"):  # the postfix
        assert part in text


async def test_the_postfix_shows_samples_bytes_and_wait_share() -> None:
    bars = Bars()
    async with DataLoader(Arrays(8), batch_size=4, progress=bars) as loader:
        await collect(loader)
        stats = loader.statistics().epoch_stats
    bar, _, _ = bars.made[0]
    assert bar.postfix == (
        f"{stats.samples_per_s:.1f} samples/s, {stats.bytes_per_s / 1e6:.1f} MB/s, "
        f"wait {stats.wait_share:.0%}"
    )


def test_sync_iteration_gets_a_bar_too() -> None:
    bars = Bars()
    with DataLoader(Range(10), batch_size=3, progress=bars) as loader:
        assert len(list(loader)) == 4
        [(bar, _, _)] = bars.made
        assert (bar.n, bar.total) == (4, 4)
        assert closed(bar)


async def test_a_bar_closes_when_its_epoch_is_left_early() -> None:
    bars = Bars()
    async with DataLoader(Range(40), batch_size=4, progress=bars) as loader:
        iterator = aiter(loader)
        await anext(iterator)
        await iterator.aclose()
        [(bar, _, _)] = bars.made
        assert closed(bar)
        assert bar.n == 1


async def test_closing_the_loader_mid_epoch_closes_the_bar() -> None:
    bars = Bars()
    loader = DataLoader(Range(40), batch_size=4, progress=bars)
    iterator = aiter(loader)
    await anext(iterator)
    await loader.aclose()
    [(bar, _, _)] = bars.made
    assert closed(bar)


async def test_a_given_bar_is_reset_each_epoch_and_closed_with_the_loader() -> None:
    out = io.StringIO()
    bar: Any = tqdm.tqdm(file=out, mininterval=0)
    async with DataLoader(Range(12), batch_size=4, progress=bar) as loader:
        await collect(loader)
        assert (bar.n, bar.total) == (3, 3)
        assert not closed(bar)  # the caller's bar lives across epochs
        await collect(loader)
        assert (bar.n, bar.total) == (3, 3)
    assert closed(bar)


async def test_progress_true_draws_a_tqdm_bar_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    async with DataLoader(Range(8), batch_size=4, progress=True) as loader:
        await collect(loader)
    err = capsys.readouterr().err
    assert "epoch 0" in err
    assert "2/2" in err


async def test_an_iterable_dataset_gets_a_bar_without_a_total() -> None:
    from datasets import Stream

    bars = Bars()
    async with DataLoader(Stream(10), batch_size=4, progress=bars) as loader:
        await collect(loader)
    [(bar, _, kwargs)] = bars.made
    assert kwargs["total"] is None
    assert bar.n == 3


def test_progress_true_without_tqdm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # what an absent package looks like
    with pytest.raises(ImportError, match=r"aioloader\[progress\]"):
        DataLoader(Range(4), progress=True)


@pytest.mark.parametrize("value", [1, "yes", object()])
def test_a_bad_progress_value_is_refused_naming_it(value: object) -> None:
    with pytest.raises(TypeError, match="progress") as info:
        DataLoader(Range(4), progress=value)
    assert repr(value) in str(info.value)


async def test_a_factory_must_make_a_bar() -> None:
    async with DataLoader(Range(4), progress=lambda **kw: 42) as loader:
        with pytest.raises(TypeError, match="not a progress bar"):
            await collect(loader)


async def test_no_bar_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    for value in (False, None):
        async with DataLoader(Range(8), batch_size=4, progress=value) as loader:
            await collect(loader)
    assert capsys.readouterr() == ("", "")
