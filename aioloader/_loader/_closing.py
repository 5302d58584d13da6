"""Closing what the garbage collector found dead, from a thread where that cannot deadlock.

The collector runs a finalizer on whichever thread happens to allocate when it finds an object
dead in a reference cycle: the main thread, a loader's starter thread inside a method that holds
the object's lock, the private loop thread that closing would join. A close that takes a lock
the collecting thread already holds (``threading.Lock`` is not reentrant), or joins that very
thread, never returns, and the program's exit then waits on it too. :func:`close_soon` closes
at once only where neither can happen, and otherwise from a daemon thread of its own.

A process forked from one that holds a loader (Lightning's ``ddp_fork``, ``multiprocessing``
under ``fork``) holds copies of its parent's resources: worker processes that are not its
children, pipes and an event loop's wake-up socket that the parent reads, segments the parent
unlinks. Closing them there would harm the parent (kill its workers, write on its pipes, take
its pipes out of its epoll instance, which the copy shares), and so would letting them be
collected: an epoch's finalizer wakes the loop it ran on. :func:`keep_inherited` keeps them,
untouched, for the child's life, which then makes resources of its own; :func:`forked_lock`
serialises that change within the child.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import TypeVar

C = TypeVar("C", bound=Callable[[], object])

__all__ = ["close_soon", "closer_if_last", "forked_lock", "hold", "keep_inherited", "release"]

# Open users of objects that the last of them closes, by ``id`` (each user holds the object).
_users: dict[int, int] = {}
_users_lock = threading.Lock()


def _new_users_lock() -> None:
    # A parent's thread may have held it as the process forked: the child starts with its own.
    global _users_lock
    _users_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_users_lock)


def hold(obj: object) -> None:
    """One more open user of ``obj`` (a dataset with ``aclose()`` that a loader reads)."""
    with _users_lock:
        _users[id(obj)] = _users.get(id(obj), 0) + 1


def release(obj: object) -> bool:
    """One user of ``obj`` fewer; whether it was the last, which then closes ``obj``: two
    loaders over one dataset (training and evaluation) share its connection sessions, and the
    first to close must not close them under the other's requests."""
    with _users_lock:
        left = _users.pop(id(obj), 1) - 1
        if left > 0:
            _users[id(obj)] = left
        return left <= 0


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


def closer_if_last(aclose: C | None) -> C | None:
    """``aclose`` (a bound method) if the caller was the last open user of its object (see
    :func:`release`), else None."""
    if aclose is None or release(getattr(aclose, "__self__", None)):
        return aclose
    return None


# What this process inherited through fork() and must neither close nor let be collected (see
# the module docstring); a grandchild inherits its parent's list too, and keeps it alike.
_inherited: list[object] = []
_fork_lock = threading.Lock()


def keep_inherited(*objs: object) -> None:
    """Keep ``objs``, a forked parent's resources, alive and untouched for this process's life
    (None entries are skipped)."""
    _inherited.extend(obj for obj in objs if obj is not None)


def forked_lock() -> threading.Lock:
    """The lock under which a forked child lets go of its parent's resources: new in each
    child (a thread of the parent may have held the parent's as the process forked)."""
    return _fork_lock


def _new_fork_lock() -> None:
    global _fork_lock
    _fork_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_fork_lock)
