"""Blocking calls the loader makes from the event loop, each on a thread of its own.

Not ``asyncio.to_thread``: that runs on the loop's default executor, which the application
shares, and which has few threads (``min(32, CPUs + 4)``: 6 on 2 cores). An orchestrator that
fills it with threads waiting for something (a queue the training loop feeds) would stall the
loader's start, its close, a new shared-memory slot and a dead worker's reaping behind them, or
deadlock with them; a cancelled ``async with`` waited for its close in that queue. A thread of
its own starts in ~0.1 ms, against calls that take milliseconds to seconds, and ends with the
call. The data path of the sources (file reads, Parquet) still uses the default executor: it
makes many small calls, for which a bounded pool is right.

Sharp edges:

- Cancelling the await does not stop the call (no thread can be stopped): it runs to its end,
  and its result or error is dropped, as with ``asyncio.to_thread``.
- The thread is not a daemon: the interpreter's exit waits for a call still running, as it
  waits for the default executor's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["off_loop"]

# How long an awaited call waits for its thread to end once the result is in (it ends at once,
# unless the machine is loaded), and how often it looks.
THREAD_END_WAIT_S = 1.0
THREAD_END_POLL_S = 0.001
THREAD_END_QUICK_TURNS = 8

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], /, *args: Any) -> T:
    """``fn(*args)`` on a new thread (with this context's variables), awaited on the loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            result = context.run(fn, *args)
        except BaseException as exc:
            _on_loop(loop, _fail, future, exc)
        else:
            _on_loop(loop, _succeed, future, result)

    name = f"aioloader-{getattr(fn, '__name__', 'call')}"
    thread = threading.Thread(target=run, name=name)
    thread.start()
    result = await future
    await _ended(thread)
    return result


async def _ended(thread: threading.Thread) -> None:
    """Wait, without blocking the loop, until ``thread`` has ended: it handed its result over
    as its last act, so this is a turn or two of the loop, and an ``await`` of a close then
    leaves no thread of the loader behind (bounded by :data:`THREAD_END_WAIT_S`)."""
    for turn in range(round(THREAD_END_WAIT_S / THREAD_END_POLL_S)):
        if not thread.is_alive():
            return
        # No event: a thread's end has no callback. A turn of the loop first (the thread
        # is ending as the loop runs the callback it posted), then a millisecond at a time.
        await asyncio.sleep(0 if turn < THREAD_END_QUICK_TURNS else THREAD_END_POLL_S)


def _on_loop(loop: asyncio.AbstractEventLoop, call: Callable[..., None], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
        loop.call_soon_threadsafe(call, *args)


def _succeed(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():  # not cancelled meanwhile
        future.set_result(result)


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
