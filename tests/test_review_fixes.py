"""Regressions found in review: failed device copies, closing that must always release,
deadlines on async fetches, and fork at worker start."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import aioloader
from aioloader import DataLoader, LoaderTimeoutError, TransferError

BOUND_S = 20.0


class Range:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class _Copied:
    def __init__(self, batch: Any) -> None:
        self.batch = batch

    async def wait(self) -> Any:
        await asyncio.sleep(0)
        return self.batch


class FlakyDevice:
    """A device stage whose copy of some batches fails to start."""

    enabled = True

    def __init__(self, failing: set[int]) -> None:
        self.failing = failing

    def start(self, batch: Any, batch_id: int) -> Any:
        if batch_id in self.failing:
            raise TransferError(f"batch {batch_id}: cannot pin")
        return _Copied(batch)

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("device_prefetch", [1, 3])
async def test_a_copy_that_fails_to_start_is_raised_in_turn_and_loses_no_permit(
    device_prefetch: int,
) -> None:
    loader = DataLoader(Range(12), batch_size=2, prefetch=2, device_prefetch=device_prefetch)
    async with loader:
        loader._ensure_resources()
        loader._res.device = FlakyDevice({1, 3})  # type: ignore[assignment]
        it = aiter(loader)
        got: list[Any] = []
        async with asyncio.timeout(BOUND_S):
            for batch_id in range(6):
                if batch_id in (1, 3):
                    with pytest.raises(TransferError, match=f"batch {batch_id}"):
                        await anext(it)
                else:
                    got.append((await anext(it)).tolist())
            with pytest.raises(StopAsyncIteration):
                await anext(it)
        assert got == [[0, 1], [4, 5], [8, 9], [10, 11]]
        assert loader.statistics().in_flight == 0


class ClosesBadly(Range):
    async def aclose(self) -> None:
        raise OSError("session close failed")


async def test_aclose_releases_everything_even_when_the_dataset_close_fails() -> None:
    loader = DataLoader(ClosesBadly(8), batch_size=4)
    async with asyncio.timeout(BOUND_S):
        assert [b.tolist() async for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        with pytest.raises(OSError, match="session close failed"):
            await loader.aclose()
    assert loader._closed
    assert loader._res.runner is None  # the helper thread is gone (the leak check agrees)


class NeverArrives:
    def __init__(self, n: int, stuck: int) -> None:
        self.n, self.stuck = n, stuck

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> int:
        if i == self.stuck:
            await asyncio.sleep(3600)
        return i


async def test_an_async_item_that_never_arrives_misses_its_batch_deadline() -> None:
    loader = DataLoader(NeverArrives(8, stuck=5), batch_size=4, timeout=0.3)
    async with loader, asyncio.timeout(BOUND_S):
        it = aiter(loader)
        assert (await anext(it)).tolist() == [0, 1, 2, 3]
        with pytest.raises(
            LoaderTimeoutError, match=r"batch 1 \(fetching indices \[4, 5, 6, 7\]\)"
        ):
            await anext(it)
        assert loader.statistics().timeouts == 1
        # The loader stays usable: the next epoch delivers, then misses the same deadline.
        again = aiter(loader)
        assert (await anext(again)).tolist() == [0, 1, 2, 3]
        with pytest.raises(TimeoutError):  # LoaderTimeoutError is also a TimeoutError
            await anext(again)


def test_fork_is_refused_unless_insisted_on() -> None:
    with pytest.raises(ValueError, match=r"mp_context='fork' is refused.*allow_fork=True"):
        DataLoader(Range(4), num_workers=1, mp_context="fork")


def test_workers_start_on_enter_for_sync_use() -> None:
    with DataLoader(Range(8), batch_size=4, num_workers=1) as loader:
        runner = loader._res.runner
        assert isinstance(runner, aioloader._workers.ProcessRunner)
        assert len(runner.pool.pids()) == 1  # started before the first batch was asked for
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
