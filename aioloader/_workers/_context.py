"""Which start method worker processes get, what a forkserver loads before it forks, and why a
worker never runs the user's ``__main__``.

By default workers fork from a server forked from this process where that is safe
(:mod:`._zygote`); otherwise ``forkserver`` (``spawn`` where it is missing). Both start a fresh
interpreter that imports :data:`WORKER_MODULE` (the module whose functions a worker runs), so
the forkserver preloads it once, and with it ``aioloader``, numpy and torch: every later worker
forks from a process that has already paid for those imports.

A worker does not re-run the main script. Python's ``forkserver`` and ``spawn`` tell each child
the main module's path or name, and the child runs it again (as ``__mp_main__``) so that classes
defined there unpickle by reference. A script without an ``if __name__ == "__main__":`` guard
then builds and iterates a loader again inside every worker, and fails there. Workers started
here are told nothing about the main module (the processes of :class:`ForkServerContext` and
:class:`SpawnContext` drop it from the preparation data); whatever the loader sends them that
lives in ``__main__`` is pickled by value instead (:mod:`._payload`). A script behaves as with
torch's default ``fork`` on Linux: its top level runs once. The start methods named here (and
the stock ``forkserver`` / ``spawn`` contexts passed as objects) get this; any other context
object is used as given.

``fork`` means what it means to torch's DataLoader: workers see the program as it is when they
start (a large in-memory dataset, module state set up before the loop), with the safety torch
lacks. A forked child inherits every lock held at the fork by a thread that does not exist in
it, and can wait on it for ever; workers are started while the loader runs, from the event
loop's thread or a helper thread, with the loop's executor and the pool's exit watch alive. So
``'fork'`` resolves to :class:`ForkContext`: its workers are forked from the main thread, all
at once, only where no other thread may hold a lock (``_zygote.fork_unsafe_reason``), when an
epoch begins (torch forks as its iterator is made) or ``with``/``start()`` starts them; a
worker that must start anywhere else (``async with``, whose start runs off the loop; a
replacement for one that died; a program with threads of its own) starts through the safe
start method instead (:attr:`ForkContext.fallback`, the default's), and the first such start
warns once per process, saying why; never a hang, never an error. ``allow_fork=True`` forks
every worker when it starts, threads or not (the caller takes the risk). Counting threads when
the loader is made would not tell what runs at fork time: the test is made at each fork.

Sharp edges:
- Leaving ``__main__`` out means CPython's launch of each start method with one name rebound
  (``spawn``, to :class:`_PreparationWithoutMain`: :func:`._cpython.popen_with_spawn`). Should
  a Python version stop reading the preparation data through that name, the stock ``Popen``
  is used and workers re-run ``__main__`` as before (:data:`WORKERS_SKIP_MAIN` tells which).
- The forkserver is one per program and its preload list is global: it is set before the
  server starts, and has no effect if something else started it first.
- The standard forkserver's start is not over when ``ensure_running`` returns: the server
  imports its preload list (about a second with torch) before it forks anything, and the
  first ``Process.start()`` blocks until it has. :func:`await_server` waits for that once per
  server, with a process that does nothing (a probe), before any worker's launch: a worker's
  start deadline then counts from when its process could begin.
- ``spawn`` starts each worker as a fresh interpreter, and each would draw its own string
  hash secret: a stream that iterates a set of strings (file names) would then be ordered
  differently in each worker, and the loader's split of it (every worker reads the whole stream
  and keeps its share) would lose items without a word. Spawned workers are started through
  ``env`` with one ``PYTHONHASHSEED`` for all of them (:data:`HASH_SEED`), unless the
  program set one itself; workers forked from a server share the server's secret already.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import secrets
import sys
import threading
from collections.abc import Callable
from multiprocessing import context as mp_context_module
from multiprocessing import forkserver, popen_forkserver, popen_spawn_posix, spawn
from multiprocessing.context import BaseContext
from typing import Any

from ._cpython import forkserver_pid, popen_with_spawn, preparation_data, starts_through
from ._zygote import hold_server as hold_forked_server
from ._zygote import is_zygote, zygote_context

__all__ = [
    "HASH_SEED",
    "WORKERS_SKIP_MAIN",
    "WORKER_MODULE",
    "ForkContext",
    "ForkServerContext",
    "SpawnContext",
    "await_server",
    "hold_server",
    "pickles_main_by_value",
    "resolve_context",
    "start_context",
    "starts_early",
]

# What a worker process imports to run its jobs (initializer, serve loop, map and stream jobs).
WORKER_MODULE = "aioloader._workers._worker"


# The string hash secret of every spawned worker of this process (see the module's sharp
# edges); 0 would turn hashing's randomisation off, so it is drawn from 1 .. 2**32 - 1.
HASH_SEED = secrets.randbelow(2**32 - 1) + 1
_ENV = "/usr/bin/env"


def _one_hash_seed() -> bool:
    """Whether spawned workers must be told a hash seed: the program did not set one."""
    return "PYTHONHASHSEED" not in os.environ and os.access(_ENV, os.X_OK)


class _PreparationWithoutMain:
    """``multiprocessing.spawn`` as a ``Popen``'s launch sees it, except that the preparation
    data it returns never names the main module, and the command runs the interpreter through
    ``env`` with :data:`HASH_SEED` where the program set no ``PYTHONHASHSEED``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(spawn, name)

    @staticmethod
    def get_preparation_data(name: str) -> dict[str, Any]:
        return preparation_data(name)

    @staticmethod
    def get_executable() -> Any:  # bytes on POSIX, as the launch passes it on
        return os.fsencode(_ENV) if _one_hash_seed() else spawn.get_executable()

    @staticmethod
    def get_command_line(**kwds: Any) -> list[Any]:
        command: list[Any] = spawn.get_command_line(**kwds)
        if not _one_hash_seed():
            return command
        return [_ENV, f"PYTHONHASHSEED={HASH_SEED}", *command]


_forkserver_popen = popen_with_spawn(popen_forkserver.Popen, _PreparationWithoutMain())
_spawn_popen = popen_with_spawn(popen_spawn_posix.Popen, _PreparationWithoutMain())

# Whether workers of the contexts below skip the main module (see the module's sharp edges).
WORKERS_SKIP_MAIN = _forkserver_popen is not None and _spawn_popen is not None


@starts_through(_forkserver_popen or popen_forkserver.Popen)
class _ForkServerProcess(mp_context_module.ForkServerProcess):
    pass


@starts_through(_spawn_popen or popen_spawn_posix.Popen)
class _SpawnProcess(mp_context_module.SpawnProcess):
    pass


class ForkServerContext(mp_context_module.ForkServerContext):
    """The ``forkserver`` context, whose processes do not run ``__main__`` again."""

    Process = _ForkServerProcess


class SpawnContext(mp_context_module.SpawnContext):
    """The ``spawn`` context, whose processes do not run ``__main__`` again."""

    Process = _SpawnProcess


class ForkContext(mp_context_module.ForkContext):
    """``fork`` made safe (see the module docstring): a worker is forked from the main thread
    where no other thread may hold a lock (``WorkerPool.fork_here``), else started through
    :attr:`fallback`, with one warning per process.

    Args:
        fallback: the context of the workers that cannot be forked safely.
    """

    def __init__(self, fallback: BaseContext) -> None:
        super().__init__()
        self.fallback = fallback


def start_context(context: BaseContext) -> BaseContext:
    """The context the pool launches workers through when it does not fork them itself: a
    :class:`ForkContext`'s fallback, else ``context``."""
    return context.fallback if isinstance(context, ForkContext) else context


def hold_server(context: BaseContext) -> Callable[[], None] | None:
    """:func:`._zygote.hold_server` of the context workers start through
    (:func:`start_context`)."""
    return hold_forked_server(start_context(context))


_OURS: dict[str, Callable[[], BaseContext]] = {
    "forkserver": ForkServerContext,
    "spawn": SpawnContext,
}


def resolve_context(mp_context: str | BaseContext | None, *, allow_fork: bool) -> BaseContext:
    """The multiprocessing context to start workers with (``forkserver`` unless told).

    Args:
        mp_context: a start method name, a context, or None for the default.
        allow_fork: fork every worker when it starts, although threads run (the caller takes
            the risk); else ``fork`` gives a :class:`ForkContext`.

    Raises:
        ValueError: unknown start method.
        TypeError: ``mp_context`` is neither a name nor a context.
    """
    if mp_context is None:
        zygote = zygote_context()
        if zygote is not None:
            return zygote
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        ctx: BaseContext = _ours(method)
    elif isinstance(mp_context, str):
        if mp_context not in mp.get_all_start_methods():
            raise ValueError(
                f"mp_context={mp_context!r} is not a start method here; "
                f"use one of {mp.get_all_start_methods()}"
            )
        ctx = _ours(mp_context)
    elif isinstance(mp_context, BaseContext):
        # The stock contexts (what mp.get_context(name) returns) differ from ours only in
        # re-running __main__; a context of any other class is the caller's own design.
        stock = type(mp_context) in (
            mp_context_module.ForkServerContext,
            mp_context_module.SpawnContext,
        )
        ctx = _ours(mp_context.get_start_method()) if stock else mp_context
    else:
        raise TypeError(f"mp_context must be a start method name or a context, got {mp_context!r}")
    if ctx.get_start_method() == "fork" and not allow_fork and not isinstance(ctx, ForkContext):
        return ForkContext(resolve_context(None, allow_fork=False))
    if ctx.get_start_method() == "forkserver":
        # torch too where this program uses it: else every worker forked from the server
        # imports it (about 1 s) at its first batch, for every loader of the process.
        preload = [WORKER_MODULE, *(["torch"] if "torch" in sys.modules else [])]
        with contextlib.suppress(Exception):  # only effective before the server starts
            ctx.set_forkserver_preload(preload)
    return ctx


def _ours(method: str) -> BaseContext:
    make = _OURS.get(method)
    return make() if make is not None else mp.get_context(method)


def pickles_main_by_value(context: BaseContext) -> bool:
    """Whether what lives in ``__main__`` must travel by value to workers of ``context``: a
    worker forked when it starts has the parent's ``__main__`` (by reference is right, and by
    value would make second copies of its classes); any other worker has no user ``__main__``
    at all, or one it ran again, whose classes are not the ones the parent pickled. A
    :class:`ForkContext`'s workers may be of either kind, and the copy is pickled once for
    all: by value (a forked worker takes ``__main__``'s classes so too, as a pool's first
    worker forked from the program does)."""
    return context.get_start_method() != "fork" or isinstance(context, ForkContext)


def starts_early(context: BaseContext | None) -> bool:
    """Whether workers of ``context`` may be launched as the loader is made, from a thread:
    those forked from a server, the forked one (``_zygote``) or the standard forkserver (its
    one-time start then overlaps the program's own). Not ``spawn``, whose workers each start a
    fresh interpreter and import torch (seconds of CPU each, while the program builds its
    model), nor ``fork``: from a thread it is not safe, and a :class:`ForkContext`'s workers
    are forked as the first epoch begins, seeing the program as it is then (see the module
    docstring)."""
    return context is not None and (
        is_zygote(context) or context.get_start_method() == "forkserver"
    )


# How long the probe of :func:`await_server` may take to end once forked (it does nothing).
_PROBE_JOIN_S = 5.0

_SERVER_LOCK = threading.Lock()  # one probe at a time; the others wait for its answer
_server_up: int | None = None  # the pid of the standard forkserver that answered a probe


def await_server(context: BaseContext, closed: Callable[[], bool] = lambda: False) -> None:
    """Under the standard forkserver, return once its server forks processes: started now if
    it is not running, and waited for once per server (see the module's sharp edges).
    Blocking: call it from a thread, holding no worker. A no-op for other contexts.

    Raises:
        EOFError, OSError: the server died, or could not be started (a note says so).
    """
    global _server_up
    if is_zygote(context) or context.get_start_method() != "forkserver":
        return
    with _SERVER_LOCK:
        if closed():  # the pool closed while another launch had the server started
            return
        try:
            forkserver.ensure_running()  # (re)starts it; returns before its imports are done
            pid = forkserver_pid()
            if pid is not None and pid == _server_up:
                return
            # Ours, whatever the pool's: the server is the program's, and this process must
            # not run __main__ again (an unguarded script would run whole in it).
            probe = _ForkServerProcess(name="aioloader-probe", daemon=True)
            probe.start()  # returns once the server forked it: it is up
        except (EOFError, OSError) as exc:
            exc.add_note("the forkserver, which forks the worker processes, did not start")
            raise
        probe.join(_PROBE_JOIN_S)
        with contextlib.suppress(ValueError):  # still running: left to multiprocessing
            probe.close()
        _server_up = pid
