"""Races of the worker pool (``_workers._pool``) with its workers and with other threads: a
close from another thread while a dead worker is replaced, a reply pipe that turns corrupt
while a given-up job still runs, and a worker that dies between finishing a job and sending
its reply.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest
from helpers import open_fds

from aioloader import WorkerCrashedError, _workers
from aioloader._workers import _channel, _pool

pytestmark = pytest.mark.usefixtures("baseline")


def echo(x: Any) -> tuple[int, Any]:
    """A job: this worker's pid, and what it was given."""
    return os.getpid(), x


# -- a close from another thread while a worker is replaced ----------------------------------


async def test_a_close_racing_a_workers_replacement_leaves_no_pipe_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A worker dies; as the pool makes its replacement's pipes, another thread closes the pool
    # (the fault: that close is started at that very moment, and given a second to finish).
    # Either the close comes first and no pipes are made, or it closes the new ones: none may
    # stay open for the pool's life.
    pool = _workers.WorkerPool(1, _workers.resolve_context(None, allow_fork=False), 0)
    closing = threading.Thread(target=pool.close, name="test-close")
    real_open = _channel.open_channel

    def open_while_closed(*args: Any) -> Any:
        if not closing.is_alive() and closing.ident is None:
            closing.start()
            closing.join(1.0)  # a close that waits for this replacement cannot end here
        return real_open(*args)

    try:
        async with asyncio.timeout(30.0):
            await pool.submit(echo, 1, batch_id=0, worker=0)  # the worker is up
            before = open_fds()  # the start method's server's pipes among them
            monkeypatch.setattr(_pool, "open_channel", open_while_closed)
            with pytest.raises(WorkerCrashedError):
                await pool.submit(os._exit, 3, batch_id=1, worker=0, resubmit_innocent=False)
            assert closing.ident is not None  # the replacement's pipes were asked for
            await asyncio.to_thread(closing.join, 30.0)
            assert not closing.is_alive()
            assert pool.closed
    finally:
        await asyncio.to_thread(pool.close)
    assert await _new_pipes(before) == []  # the new worker's pipes were closed too


async def _new_pipes(before: dict[int, str], grace_s: float = 5.0) -> list[str]:
    """The pipes this process holds that it did not hold ``before``, once none is left or
    ``grace_s`` passed."""
    deadline = time.monotonic() + grace_s
    while True:
        new = [name for fd, name in open_fds().items() if before.get(fd) != name]
        pipes = [name for name in new if name.startswith("pipe:")]
        if not pipes or time.monotonic() > deadline:
            return pipes
        await asyncio.sleep(0.05)
