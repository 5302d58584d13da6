"""Which start method worker processes get, and what a forkserver loads before it forks.

``forkserver`` is the default (``spawn`` where it is missing). Both start a fresh interpreter
that imports :data:`WORKER_MODULE` (the module whose functions a worker runs), so the forkserver
preloads it once, and with it ``aioloader``, numpy and torch: every later worker forks from a
process that has already paid for those imports.

``fork`` is refused unless the caller insists: workers are started while the loader runs, from
the event loop's thread or a helper thread, with the loop's executor and the executors' manager
threads alive, and a forked child inherits locks those threads may hold (and can deadlock on
them). Counting threads when the loader is made would not tell what runs at fork time.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
from multiprocessing.context import BaseContext

from ._zygote import zygote_context

__all__ = ["WORKER_MODULE", "resolve_context"]

# What a worker process imports to run its jobs (initializer, serve loop, map and stream jobs).
WORKER_MODULE = "aioloader._workers._worker"


def resolve_context(mp_context: str | BaseContext | None, *, allow_fork: bool) -> BaseContext:
    """The multiprocessing context to start workers with (``forkserver`` unless told).

    Args:
        mp_context: a start method name, a context, or None for the default.
        allow_fork: accept ``fork`` although threads run (the caller takes the risk).

    Raises:
        ValueError: unknown start method, or ``fork`` while other threads run (unless
            ``allow_fork``).
        TypeError: ``mp_context`` is neither a name nor a context.
    """
    if mp_context is None:
        zygote = zygote_context()
        if zygote is not None:
            return zygote
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        ctx: BaseContext = mp.get_context(method)
    elif isinstance(mp_context, str):
        if mp_context not in mp.get_all_start_methods():
            raise ValueError(
                f"mp_context={mp_context!r} is not a start method here; "
                f"use one of {mp.get_all_start_methods()}"
            )
        ctx = mp.get_context(mp_context)
    elif isinstance(mp_context, BaseContext):
        ctx = mp_context
    else:
        raise TypeError(f"mp_context must be a start method name or a context, got {mp_context!r}")
    if ctx.get_start_method() == "fork" and not allow_fork:
        raise ValueError(
            "mp_context='fork' is refused while other threads run: workers are started from "
            f"the event loop or a helper thread ({threading.active_count()} thread(s) now), "
            "and a forked worker inherits their locks and can deadlock. Use 'forkserver' or "
            "'spawn', or pass allow_fork=True."
        )
    if ctx.get_start_method() == "forkserver":
        with contextlib.suppress(Exception):  # only effective before the server starts
            ctx.set_forkserver_preload([WORKER_MODULE])
    return ctx
