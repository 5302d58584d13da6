"""Threads of this process: where batches are made without workers, where the pipeline runs
for synchronous code, and where the loader's blocking calls wait.

::

    num_workers=0 / thread_pool=True:
        producer ── start_make(request) ──▶ ThreadRunner (_runner) ──▶ helper thread(s)
                 ◀── call_soon_threadsafe(settle the future) ◀── BatchMaker.make
        cheap batches skip the thread: made where they are asked for (InlineMaker)
        large leaves land in memory the threads reuse (_reuse)

    for batch in loader:
        caller thread ── run_coroutine_threadsafe(anext) ──▶ LoopThread (_loop) ──▶ the epoch

    start, close, a new slot, a dead worker's reaping ── off_loop ──▶ a thread of its own
                                                                       (_offloop)

- ``_runner``: :class:`ThreadRunner` (implements ``aioloader._types.Runner``) and the policy
  that makes cheap batches inline.
- ``_reuse``: memory that large batches made on threads are collated into, and reused.
- ``_loop``: the private event-loop thread behind ``for batch in loader``, its iterator.
- ``_offloop``: blocking calls from the loop, each on a thread of its own.
- ``_run``: ``aioloader.run``, ``asyncio.run`` on uvloop where installed.

This module only re-exports.
"""

from __future__ import annotations

from ._loop import NOT_INLINE as NOT_INLINE
from ._loop import LoopThread as LoopThread
from ._loop import SyncIterator as SyncIterator
from ._offloop import off_loop as off_loop
from ._run import run as run
from ._runner import ThreadRunner as ThreadRunner
