"""The wire to a worker (``aioloader._channel``), with a real process on the other end.

Each test starts one process running the worker's serve loop over two real pipes and drives
the main side from the event loop, as the worker pool does.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures.process import BrokenProcessPool
from contextlib import asynccontextmanager
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext, SpawnContext
from pathlib import Path
from typing import Any, cast

import pytest

from aioloader._workers import resolve_context
from aioloader._workers._channel import Channel, open_channel, serve_over
from aioloader._workers._frames import RemoteTraceback, pack_result, reply_header_fault
from aioloader._workers._records import CANCELLED, ERROR, HEADER, MAX_REPLY_BYTES, RESULT

# -- what the worker runs (module level: pickled by reference) ----------------------------------


def echo(x: Any) -> Any:
    return x


def fail(message: str) -> None:
    raise KeyError(message)


def nap_then(arg: tuple[float, Any]) -> Any:
    time.sleep(arg[0])
    return arg[1]


def touch(path: str) -> str:
    Path(path).write_text("ran")
    return path


def nap_then_touch(arg: tuple[float, str]) -> None:
    time.sleep(arg[0])
    touch(arg[1])


def exists(path: str) -> bool:
    return Path(path).exists()


def a_lock(_: Any) -> Any:
    return threading.Lock()  # cannot be pickled back


def my_pid(_: Any) -> int:
    return os.getpid()


# -- harness -------------------------------------------------------------------------------------


EXIT_CODES: dict[int, int | None] = {}  # pid: exit code, recorded as the harness ends a worker


# The loader's own context: the forkserver preloads the worker module. Starting the forkserver
# here without that preload would make every later test's workers import torch afresh.
CONTEXT = cast("ForkServerContext | SpawnContext", resolve_context(None, allow_fork=False))


def open_fds() -> int:
    """Open descriptors of this process, once the forkserver (which keeps two) is running."""
    forkserver.ensure_running()
    return len(os.listdir("/proc/self/fd"))


@asynccontextmanager
async def worker() -> AsyncIterator[tuple[Channel, Any]]:
    """A serving process and the main side's channel to it; both closed at the end."""
    channel, child = open_channel()
    process = CONTEXT.Process(target=serve_over, args=child, daemon=True)
    process.start()
    for end in child:
        end.close()
    try:
        _, up = channel.send(echo, "up")
        assert await asyncio.wait_for(up, 30.0) == "up"  # serving: timings below are its own
        yield channel, process
    finally:
        channel.close()  # end-of-file: the serve loop returns and the process exits
        await asyncio.to_thread(process.join, 5.0)
        if process.exitcode is None:
            process.kill()
            await asyncio.to_thread(process.join, 5.0)
        assert process.pid is not None  # started above
        EXIT_CODES[process.pid] = process.exitcode
        process.close()


# -- tests ---------------------------------------------------------------------------------------


async def test_results_come_back_to_their_own_job_in_any_number() -> None:
    before = open_fds()
    async with worker() as (channel, process):
        futures = [channel.send(echo, i)[1] for i in range(200)]
        assert await asyncio.gather(*futures) == list(range(200))
        assert channel.pending == 0
        await asyncio.to_thread(process.join, 0.2)
        assert process.exitcode is None  # one process served them all and still runs
        pid = process.pid
    assert EXIT_CODES[pid] == 0  # closing the channel ended its serve loop: a clean exit
    assert open_fds() == before  # both pipe ends closed


async def test_a_posted_job_runs_first_and_does_not_tie_the_pipes_to_its_loop(
    tmp_path: Path,
) -> None:
    # The worker pool posts a dataset copy ahead of a batch and awaits nothing of it: a loader
    # iterated next from another event loop (its private one, for `for`) must not be refused
    # while the copy still loads, and its job must run after the copy.
    marker = str(tmp_path / "loaded")
    async with worker() as (channel, _):
        channel.post(nap_then_touch, (0.3, marker))

        async def from_another_loop() -> Any:
            _, future = channel.send(exists, marker)
            return await future

        assert await asyncio.to_thread(asyncio.run, from_another_loop()) is True
        assert channel.pending == 0


async def test_an_error_keeps_its_type_with_the_worker_traceback_as_cause() -> None:
    async with worker() as (channel, _):
        _, future = channel.send(fail, "no such sample")
        with pytest.raises(KeyError, match="no such sample") as info:
            await future
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        assert "in fail" in str(cause)  # the worker's own frame
        assert "test_channel.py" in str(cause)
        _, future = channel.send(echo, "still serving")  # the worker goes on
        assert await future == "still serving"


async def test_a_reply_that_cannot_be_pickled_fails_only_its_job() -> None:
    async with worker() as (channel, _):
        _, bad = channel.send(a_lock, None)
        _, good = channel.send(echo, 7)
        with pytest.raises(TypeError, match="pickle"):
            await bad
        assert await good == 7


async def test_megabytes_each_way_do_not_block_the_loop() -> None:
    # The pipe holds 64 KiB. A 16 MiB request sent while the worker is busy cannot be written
    # at once: the rest must go out as the worker reads, with the loop free meanwhile.
    payload = os.urandom(16 << 20)
    async with worker() as (channel, _):
        _, busy = channel.send(nap_then, (0.5, "busy"))
        started = time.perf_counter()
        _, big = channel.send(echo, payload)
        assert time.perf_counter() - started < 0.1  # send returned; it did not wait
        ticks = 0
        while not big.done():
            await asyncio.sleep(0.01)
            ticks += 1
            assert ticks < 1000
        assert ticks >= 5  # the loop kept running while the worker slept and then read
        assert await busy == "busy"
        assert await big == payload  # and 16 MiB came back intact, in many reads


async def test_a_cancelled_job_still_queued_is_skipped_and_reported_done(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "ran"
    abandoned = asyncio.Event()
    async with worker() as (channel, _):
        _, busy = channel.send(nap_then, (0.3, "busy"))
        job_id, queued = channel.send(touch, str(marker))
        channel.abandon(job_id, abandoned.set)
        assert queued.cancelled()
        assert not abandoned.is_set()  # the worker has not reached it yet
        await asyncio.wait_for(abandoned.wait(), 5.0)
        assert await busy == "busy"
        assert not marker.exists()  # skipped, never run
        assert channel.pending == 0


async def test_abandoning_a_running_job_waits_until_the_worker_is_done() -> None:
    abandoned_at: list[float] = []
    async with worker() as (channel, _):
        job_id, running = channel.send(nap_then, (0.3, "late"))
        await asyncio.sleep(0.1)  # it has started
        started = time.monotonic()
        channel.abandon(job_id, lambda: abandoned_at.append(time.monotonic()))
        _, after = channel.send(echo, "next")
        assert await after == "next"
        assert len(abandoned_at) == 1
        assert abandoned_at[0] - started > 0.1  # only once it finished
        assert running.cancelled()


async def test_abandoning_an_answered_job_reports_done_at_once() -> None:
    calls: list[str] = []
    async with worker() as (channel, _):
        job_id, future = channel.send(echo, 1)
        assert await future == 1
        channel.abandon(job_id, lambda: calls.append("done"))
        assert calls == ["done"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
async def test_a_dead_worker_fails_every_pending_job_at_once(sig: int) -> None:
    async with worker() as (channel, process):
        _, pid_future = channel.send(my_pid, None)
        pid = await pid_future
        assert pid == process.pid
        _, running = channel.send(nap_then, (30.0, "never"))
        _, queued = channel.send(echo, "never either")
        abandoned: list[str] = []
        job_id, dropped = channel.send(echo, "dropped")
        channel.abandon(job_id, lambda: abandoned.append("done"))
        await asyncio.sleep(0.1)
        killed_at = time.monotonic()
        os.kill(pid, sig)
        for future in (running, queued):
            with pytest.raises(BrokenProcessPool, match="closed its pipe"):
                await asyncio.wait_for(future, 5.0)
        assert time.monotonic() - killed_at < 1.0  # end-of-file, not a poll
        assert dropped.cancelled()
        assert abandoned == ["done"]  # a dead worker is done with what it held
        with pytest.raises(BrokenProcessPool):
            channel.send(echo, "after")  # refused at once, not queued forever


async def test_close_from_another_thread_while_the_loop_runs() -> None:
    before = open_fds()
    async with worker() as (channel, _):
        _, future = channel.send(echo, "x")
        assert await future == "x"
        await asyncio.to_thread(channel.close)  # as aclose() does: the loop is free meanwhile
        with pytest.raises(BrokenProcessPool):
            channel.send(echo, "y")
    assert open_fds() == before


def big_array(n: int) -> Any:
    import numpy as np

    return np.arange(n, dtype=np.uint8)


def stop_iteration(_: Any) -> None:
    raise StopIteration("sample 5 missing")


async def test_a_large_array_reply_arrives_in_pieces_as_a_writable_array() -> None:
    import numpy as np

    n = 64 << 20
    async with worker() as (channel, _):
        _, future = channel.send(big_array, n)
        iterations = 0
        while not future.done():  # count loop iterations while the reply streams in
            await asyncio.sleep(0)
            iterations += 1
            assert iterations < 10_000_000
        array = future.result()
    assert iterations > 16  # read over many iterations (4 MiB at a time), not in one stall
    assert isinstance(array, np.ndarray)
    assert array.shape == (n,)
    assert array.flags.writeable  # torch.from_numpy would warn on a read-only array
    assert np.array_equal(array[:1000], np.arange(1000, dtype=np.uint8))
    assert int(array[-1]) == (n - 1) % 256


async def test_stop_iteration_in_a_job_arrives_as_a_runtime_error() -> None:
    async with worker() as (channel, _):
        _, future = channel.send(stop_iteration, None)
        with pytest.raises(RuntimeError, match="raised StopIteration: sample 5 missing") as info:
            await future
        assert isinstance(info.value.__cause__, StopIteration)
        _, future = channel.send(echo, "still serving")
        assert await future == "still serving"


# -- a reply stream that cannot be valid (RELIABILITY.md row 41) ------------------------------


@pytest.mark.parametrize(
    "garbage",
    [
        HEADER.pack(1 << 62, 0, RESULT),  # a length no buffer can hold: it raised MemoryError
        b"Traceback (most recent call last):\n  File ...\n",  # what a stray child prints
        HEADER.pack(0, 7, RESULT),  # a reply to a job never sent
        HEADER.pack(0, 0, 9),  # an unknown kind
    ],
    ids=["huge-length", "text", "unknown-job", "unknown-kind"],
)
async def test_a_frame_that_cannot_be_valid_fails_the_channel_at_once(garbage: bytes) -> None:
    # The worker's side of the pipes is held here: the test writes what a stray process that
    # inherited the reply pipe would write.
    replies_r, replies_w = os.pipe()
    requests_r, requests_w = os.pipe()
    channel = Channel(replies_r, requests_w)
    try:
        _, future = channel.send(echo, "lost")
        os.write(replies_w, garbage)
        async with asyncio.timeout(5.0):  # a wedged stream never fails the future
            with pytest.raises(BrokenProcessPool, match=r"cannot be valid|too large"):
                await future
        assert channel.corrupt is not None
        with pytest.raises(BrokenProcessPool):  # refused at once from now on
            channel.send(echo, "next")
    finally:
        channel.close()
        for fd in (replies_w, requests_r):
            os.close(fd)


def test_reply_headers_are_checked_before_anything_is_allocated() -> None:
    assert reply_header_fault(MAX_REPLY_BYTES, 0, RESULT, {0}) is None
    assert reply_header_fault(0, 2, CANCELLED, {1, 2}) is None
    assert "over the bound" in (reply_header_fault(MAX_REPLY_BYTES + 1, 0, RESULT, {0}) or "")
    assert "awaits none" in (reply_header_fault(10, 1, ERROR, {0}) or "")
    assert "unknown reply kind 3" in (reply_header_fault(10, 0, 3, {0}) or "")


async def test_a_second_reply_to_one_job_fails_the_channel() -> None:
    # Two processes answering from one pipe (a forked child that went on serving): the second
    # answer means the stream can no longer be trusted.
    replies_r, replies_w = os.pipe()
    requests_r, requests_w = os.pipe()
    channel = Channel(replies_r, requests_w)
    try:
        _, first = channel.send(echo, "first")
        _, second = channel.send(echo, "second")
        answer = pack_result("first")
        for _ in range(2):
            os.write(replies_w, HEADER.pack(sum(map(len, answer)), 0, RESULT) + b"".join(answer))
        async with asyncio.timeout(5.0):
            assert await first == "first"
            with pytest.raises(BrokenProcessPool, match="answered already"):
                await second
        assert channel.corrupt is not None
    finally:
        channel.close()
        for fd in (replies_w, requests_r):
            os.close(fd)
