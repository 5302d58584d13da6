"""The loggers: one per area under ``aioloader``, silent until the application configures
logging.

The library never configures logging and never prints: ``aioloader`` gets a
:class:`logging.NullHandler` (so Python's last-resort handler does not print our warnings to
stderr when the application set nothing up), and records propagate to the application's
handlers as usual. ``logging.basicConfig(level=logging.INFO)`` shows them all.

- ``aioloader.workers``: WARNING when a worker process is replaced (a crash, a kill at a
  deadline), with the cause; WARNING when a batch is re-run after a crash or a hang
  (``max_retries``).
- ``aioloader.remote``: INFO for each retried remote read, with its cause and the delay before
  the next attempt (INFO: under throttling they come by the hundred, and each is recovered);
  WARNING when a read has received no byte for ``stall_warning`` seconds.
- ``aioloader.shm``: WARNING, once, when batches travel inline instead of through shared memory.
- ``aioloader.distributed``: INFO, once per loader, when it reads its rank's share by itself
  (which rank of which world size, and how).
- ``aioloader.epoch``: WARNING for each skipped sample (``on_error='skip'``), with its index and
  reason; at each epoch's end, its summary and bottleneck verdict at INFO. The verdict is a
  WARNING only where the user should act, and once per process: the consumer waited for more
  than :data:`aioloader._stats.WAIT_SHARE_THRESHOLD` of an epoch that lasted at least
  :data:`aioloader._stats.VERDICT_WARNING_MIN_S` (in a shorter one, the workers' start is
  most of the wait). Later such verdicts stay at INFO.

A warning means "act", so each is said once per process (:func:`first_time`), whether it goes
through :mod:`logging` or :mod:`warnings`; :func:`reset_once` forgets what was said (tests).

Nothing is logged per sample or per batch unless a skip, retry or stall happened; hot paths
check :meth:`logging.Logger.isEnabledFor` before formatting anything costly.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Hashable

__all__ = [
    "distributed_log",
    "epoch_log",
    "first_time",
    "remote_log",
    "reset_once",
    "root_log",
    "shm_log",
    "workers_log",
]

root_log = logging.getLogger("aioloader")
# Silent by default: without a handler anywhere, Python's last-resort handler would print
# WARNING records to stderr. Only the library's root logger gets one, never the root logger.
root_log.addHandler(logging.NullHandler())

workers_log = logging.getLogger("aioloader.workers")
remote_log = logging.getLogger("aioloader.remote")
shm_log = logging.getLogger("aioloader.shm")
epoch_log = logging.getLogger("aioloader.epoch")
distributed_log = logging.getLogger("aioloader.distributed")

# What was said already, by key. Process-wide on purpose: one WorkerPool shared by two loaders,
# or ten loaders made in a loop, must not say the same warning ten times.
_said: set[Hashable] = set()
_said_lock = threading.Lock()


def first_time(key: Hashable) -> bool:
    """``True`` the first time this process asks about ``key``, then ``False``: say a warning
    only where this returns ``True``. Thread-safe (loaders start from any thread)."""
    with _said_lock:
        if key in _said:
            return False
        _said.add(key)
        return True


def _forget_in_child() -> None:
    """In a child made by ``os.fork()``: nothing said yet. It is a process of its own, whose
    user sees its warnings apart (a rank forked by ``ddp_fork``, a job's process), so "once
    per process" is not once per tree of processes. The lock is made anew: a thread of the
    parent may have held it as the process forked."""
    global _said_lock
    _said_lock = threading.Lock()
    _said.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def reset_once() -> None:
    """Forget every key :func:`first_time` has seen, so the next warnings are said again
    (tests call it before each test, so that none depends on the order they run in)."""
    with _said_lock:
        _said.clear()
