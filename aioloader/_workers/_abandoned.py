"""Jobs given up while a worker runs them: watched until the worker is done with them, and
its process killed if one runs past the batch deadline.

A batch's deadline (``aioloader._epoch._deadline``) is watched by the task that awaits the batch.
When its epoch is left (a ``break``, the iterator dropped), those tasks are cancelled: the
jobs still queued are withdrawn (``Channel.abandon``), but a job a worker already runs goes on,
since only killing the process could stop it. If such a job hangs, no deadline watches it any
more, and the jobs queued behind it on that worker (the next epoch's, another loader's on a
shared pool) wait for ever: their own deadlines count from when their batch starts running,
which it never does. So it is watched here instead: seen running at one look and still
running at the next, a deadline later, its worker is killed as a hung batch's is; the jobs
queued behind it are not to blame, and go to the replacement. The kill counts in the
``timeouts`` of the loader that gave the batch up, at the time of the kill: in the figures of
the epoch running then (the given-up one has ended). The restart is the pool's, as any.
"""

from __future__ import annotations

import asyncio

from .._log import workers_log
from .._stats import current_counters
from ._cells import Column
from ._channel import Channel
from ._launch import Worker

__all__ = ["watch_abandoned"]


def watch_abandoned(w: Worker, job_id: int, tag: int, after: float, current: Column[int]) -> None:
    """Watch job ``job_id`` of worker ``w``'s current process, given up: once it has run
    ``after`` seconds (at least), kill the process. On the event loop of the job's pipes.

    Args:
        w: the worker the job was sent to.
        job_id: the job (its channel's id).
        tag: what the worker publishes in ``current`` while it runs the job.
        after: the batch deadline, seconds.
        current: the pool's cells of running tags (see ``_cells``).
    """
    loop = asyncio.get_running_loop()
    generation, channel, process = w.generation, w.channel, w.process
    counters = current_counters.get()  # the giving-up loader's: this runs in its task
    seen_running = False

    def look() -> None:
        nonlocal seen_running
        if w.process is not process or not _pending(w, generation, channel, job_id):
            return  # the worker is done with it, or gone (closing the pool fails every job)
        # The tag is this job's own: each attempt has one (see _wire.running_tag).
        running = int(current[w.id]) == tag
        if running and seen_running:
            pid = w.kill()
            if pid is not None:
                if counters is not None:
                    counters.timeouts += 1  # a missed deadline, as a watched batch's
                workers_log.warning(
                    "worker process pid %d killed: a batch given up by its epoch ran past the "
                    "%s s deadline, holding up the jobs queued behind it",
                    pid,
                    after,
                )
            return
        seen_running = running
        loop.call_later(after, look)

    loop.call_later(after, look)


def _pending(w: Worker, generation: int, channel: Channel, job_id: int) -> bool:
    return w.generation == generation and w.channel is channel and not channel.answered(job_id)
