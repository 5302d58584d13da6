"""Threads of this process: where batches are made without workers, where the pipeline runs
for synchronous code, and where the loader's blocking calls wait.

::

    num_workers=0 / thread_pool=True:
        producer ── start_make(request) ──▶ ThreadRunner (_runner) ──▶ helper thread(s)
                 ◀── call_soon_threadsafe(settle the future) ◀── BatchMaker.make
        which route a batch takes (the loop, the caller's thread of `for`, the helper
        thread): RoutePolicy (_routes) alone decides, from the times InlineMaker measures
        large leaves of batches made on the thread land in memory it reuses (_reuse)

    for batch in loader:
        caller thread ── run_coroutine_threadsafe(anext) ──▶ LoopThread (_loop) ──▶ the epoch

    start, close, a new slot, a dead worker's reaping ── off_loop ──▶ a thread of its own
                                                                       (_offloop)

- ``_routes``: where a ``num_workers=0`` batch is made, a pure policy (``RoutePolicy``) and
  the settings that allow each route.
- ``_runner``: :class:`ThreadRunner` (implements ``aioloader._types.Runner``), and the maker
  that makes batches on the route the policy chose.
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
from ._loop import forked_mid_epoch as forked_mid_epoch
from ._offloop import off_loop as off_loop
from ._routes import RoutePolicy as RoutePolicy
from ._routes import epoch_makes as epoch_makes
from ._routes import skips_thread as skips_thread
from ._run import run as run
from ._runner import ThreadRunner as ThreadRunner
