"""The loader's blocking calls run on threads of their own (``_offloop``), never queued on the
event loop's default executor, which the application shares and may fill."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import threading
from collections.abc import AsyncIterator

import pytest
from datasets import Blocks
from helpers import BOUND_S

from aioloader import DataLoader
from aioloader._threads._offloop import off_loop

pytestmark = pytest.mark.usefixtures("baseline")

_tag: contextvars.ContextVar[str] = contextvars.ContextVar("_tag", default="unset")


def _where() -> tuple[str, str]:
    return threading.current_thread().name, _tag.get()


def _fails() -> None:
    raise KeyError("from the thread")


async def test_a_call_runs_on_a_thread_of_its_own_with_the_callers_context() -> None:
    _tag.set("caller's")
    name, tag = await off_loop(_where)
    assert name == "aioloader-_where"  # not the loop's thread, not the default executor's
    assert tag == "caller's"
    with pytest.raises(KeyError, match="from the thread"):
        await off_loop(_fails)


async def test_a_cancelled_await_lets_the_call_finish_and_its_thread_end() -> None:
    started, release, done = threading.Event(), threading.Event(), threading.Event()

    def blocking() -> None:
        started.set()
        release.wait(BOUND_S)
        done.set()

    task = asyncio.ensure_future(off_loop(blocking))
    await asyncio.to_thread(started.wait, BOUND_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    await asyncio.to_thread(done.wait, BOUND_S)
    assert done.is_set()


@contextlib.asynccontextmanager
async def full_default_executor() -> AsyncIterator[None]:
    """The loop's default executor busy with threads that wait, as an orchestrator's may be
    (``asyncio.to_thread(queue.get)`` for queues the training loop feeds)."""
    loop = asyncio.get_running_loop()
    release = threading.Event()
    size = min(32, (os.cpu_count() or 1) + 4)  # the default executor's threads
    waiting = [loop.run_in_executor(None, release.wait, BOUND_S) for _ in range(size)]
    try:
        yield
    finally:
        release.set()
        await asyncio.gather(*waiting)


async def test_the_loader_never_waits_for_the_loops_default_executor() -> None:
    # Its start, new shared-memory slots (1 MiB batches) and close used to queue behind the
    # application's threads: 5 batches, then nothing until they ended.
    loader = DataLoader(Blocks(12), batch_size=1, num_workers=2)
    async with full_default_executor(), asyncio.timeout(BOUND_S / 2), loader:
        got = [int(batch[0, 0]) async for batch in loader]
    assert got == list(range(12))


async def test_a_timeout_around_a_starting_loader_fires_in_time() -> None:
    loop = asyncio.get_running_loop()
    loader = DataLoader(Blocks(4), batch_size=1, num_workers=2)
    async with full_default_executor():
        began = loop.time()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01), loader:
                await asyncio.sleep(BOUND_S)
        # The start and the close the cancel runs queued behind the executor's threads (for
        # as long as they waited); now they take the processes' start and shutdown.
        assert loop.time() - began < BOUND_S / 4
    await loader.aclose()
