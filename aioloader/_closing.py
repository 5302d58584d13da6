"""Closing what the garbage collector found dead, from a thread where that cannot deadlock.

The collector runs a finalizer on whichever thread happens to allocate when it finds an object
dead in a reference cycle: the main thread, a loader's starter thread inside a method that holds
the object's lock, the private loop thread that closing would join. A close that takes a lock
the collecting thread already holds (``threading.Lock`` is not reentrant), or joins that very
thread, never returns, and the program's exit then waits on it too. :func:`close_soon` closes
at once only where neither can happen, and otherwise from a daemon thread of its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

__all__ = ["close_soon"]


def close_soon(close: Callable[[], None], lock: threading.Lock) -> None:
    """Call ``close`` now if this is the main thread and ``lock`` (the one ``close`` takes) is
    free; else from a new daemon thread, which runs it once the lock is free. At interpreter
    shutdown, where no thread can start, nothing: the exit hooks close what is still open."""
    if threading.current_thread() is threading.main_thread() and lock.acquire(blocking=False):
        lock.release()
        close()
        return
    with contextlib.suppress(RuntimeError):  # "can't create new thread at interpreter shutdown"
        threading.Thread(target=close, name="aioloader-close", daemon=True).start()
