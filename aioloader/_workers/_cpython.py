"""CPython's private multiprocessing and import internals, each behind one function here.

Starting workers well needs a few things the standard library does not offer as API: a
forkserver of our own (``_zygote``), workers that do not run ``__main__`` again
(``_context``), a fork that keeps the resource tracker's pipe (``_launch``), and telling
whether a module is being imported (``_zygote``, ``_payload``). Each need is one function (or,
where the standard library calls back into a subclass, one base class) here, and nothing else
in the package reads a private name of ``multiprocessing``, ``importlib`` or ``sys``: a
Python release that changes one breaks this module only, and each function says what
happens then. None of them lets an ``AttributeError`` reach a user: a missing attribute
gives a fallback, named in each docstring and summed up here::

    need                            reads                               when it is missing
    preparation_data()              spawn.get_preparation_data, its     the main module stays:
                                    init_main_from_* keys               workers run it again
    popen_with_spawn()              Popen._launch, its global spawn     None: stock Popen, workers
                                                                        run __main__ again
    starts_through()                Process._Popen (the start hook)     (set, never read)
    ForkServerPopen                 popen_forkserver.Popen._launch,     FORKED_SERVER is False:
                                    ._fds, set_spawning_popen           the standard forkserver
    connect_to_forkserver()         ForkServer._forkserver_address,     FORKED_SERVER is False
                                    ._forkserver_alive_fd,
                                    .connect_to_new_process
    run_forkserver(), read_signed() forkserver.main, read_signed        FORKED_SERVER is False
    forkserver_pid()                forkserver._forkserver               None: a probe each launch
                                    ._forkserver_pid
    resource_tracker_fd()           resource_tracker._resource_tracker  None: a forked worker
                                    ._fd                                sheds the pipe (its
                                                                        segments untracked)
    flush_std_streams()             util._flush_std_streams             flushed here instead
    forget_parents_children()       process._children, Process          nothing dropped: a forked
                                    ._parent_pid                        child's normal exit
                                                                        SIGTERMs its parent's
                                                                        daemon workers
    module_locks()                  importlib._bootstrap._module_locks  None: _payload looks at
                                                                        every module, _zygote at
                                                                        this thread's frames
    caller_frame()                  sys._getframe                       None: no frame walked

Checked against CPython 3.11.7 (run: the whole test suite) and, read only, against later
sources of ``multiprocessing/forkserver.py``, ``popen_forkserver.py`` and ``resource_tracker.py``
(3.14's, whose forkserver added an authentication key: a server run by :func:`run_forkserver`
is given none, and :func:`connect_to_forkserver`'s client has none, so neither side asks for
one); ``spawn.py``, ``util.py`` and ``importlib/_bootstrap.py`` as 3.11.7 has them. Where a
later release differs, the fallbacks above apply. :data:`FORKED_SERVER` is computed once, at
import, from the attributes present.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import types
from collections.abc import Callable
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, resource_tracker, spawn, util
from multiprocessing import process as mp_process
from typing import Any

__all__ = [
    "FORKED_SERVER",
    "ForkServerPopen",
    "caller_frame",
    "connect_to_forkserver",
    "flush_std_streams",
    "forget_parents_children",
    "forkserver_pid",
    "module_locks",
    "popen_with_spawn",
    "preparation_data",
    "read_signed",
    "resource_tracker_fd",
    "run_forkserver",
    "starts_through",
]

# The stdlib's forkserver classes and context module, typed loosely (their stubs are not
# complete).
_ForkServer: Any = forkserver.ForkServer
_ForkServerPopenBase: Any = popen_forkserver.Popen
_mp_context: Any = mp_context

# The keys of multiprocessing's preparation data that make a child run the main module again.
_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")


# -- starting a child without the main module -----------------------------------------------


def preparation_data(name: str) -> dict[str, Any]:
    """multiprocessing's preparation data for a new child named ``name``, without the main
    module: the child never runs the main script again. Missing keys (renamed in a later
    Python): the data as multiprocessing makes it, and the child runs the main script, as any
    multiprocessing child does."""
    data: dict[str, Any] = spawn.get_preparation_data(name)
    for key in _MAIN_KEYS:
        data.pop(key, None)
    return data


def popen_with_spawn(base: type, stand_in: object) -> type | None:
    """A subclass of the stdlib Popen class ``base`` whose launch reads the ``spawn`` module
    (the preparation data, the executable, the command line) through ``stand_in``: CPython's
    own ``_launch``, copied with that one global rebound, rather than its code copied or the
    ``multiprocessing`` module patched for every user of it. None where ``base`` has no
    ``_launch`` function, or one that does not read ``spawn`` by that name: the caller uses
    ``base`` itself, whose children run the main module again."""
    launch = getattr(base, "_launch", None)
    code = getattr(launch, "__code__", None)
    if not isinstance(launch, types.FunctionType) or code is None or "spawn" not in code.co_names:
        return None
    namespace = dict(launch.__globals__)
    namespace["spawn"] = stand_in
    copy = types.FunctionType(code, namespace, launch.__name__, launch.__defaults__)
    copy.__qualname__ = launch.__qualname__
    return type(f"{base.__name__}WithSpawn", (base,), {"_launch": copy})


def starts_through(popen: Callable[[Any], Any]) -> Callable[[type], type]:
    """A class decorator: processes of the decorated subclass of a stdlib Process class start
    through ``popen(process_obj)``. multiprocessing asks a Process class for its Popen through
    the static ``_Popen``, which this sets (a name multiprocessing reads; nothing here reads
    it). The class stays where it is defined: a child unpickles its process object by the
    class's module and name."""

    def decorate(cls: type) -> type:
        cls._Popen = staticmethod(popen)  # type: ignore[attr-defined]
        return cls

    return decorate


# -- a forkserver of one's own ------------------------------------------------------------


class ForkServerPopen(_ForkServerPopenBase):  # type: ignore[misc]
    """The stdlib forkserver Popen, for a server of one's own: its launch (the ``_launch`` the
    stdlib calls as the Popen is made) pickles :meth:`preparation` and the process object for
    the child, with the descriptors they hand over, and gives both to :meth:`start`, which a
    subclass implements (connect to its server: :func:`connect_to_forkserver`). The subclass
    also keeps what the stdlib reads of a Popen: ``sentinel``, ``finalizer``, ``pid``,
    ``returncode``, ``poll`` and ``wait``."""

    def _launch(self, process_obj: Any) -> None:
        buf = io.BytesIO()
        _mp_context.set_spawning_popen(self)
        try:
            _mp_context.reduction.dump(self.preparation(process_obj.name), buf)
            _mp_context.reduction.dump(process_obj, buf)
        finally:
            _mp_context.set_spawning_popen(None)
        self.start(buf.getvalue(), list(self._fds))

    def preparation(self, name: str) -> dict[str, Any]:
        """The child's preparation data (default: :func:`preparation_data`, without main)."""
        return preparation_data(name)

    def start(self, data: bytes, fds: list[int]) -> None:
        """Ask the server for the child: ``data`` to write to it, ``fds`` to hand over."""
        raise NotImplementedError


class _Client(_ForkServer):  # type: ignore[misc]
    """The stdlib's forkserver client, pointed at a server it did not start."""

    def ensure_running(self) -> None:
        pass  # the server is the caller's: never start the stdlib's own in its place


def connect_to_forkserver(address: Any, alive_fd: int, fds: list[int]) -> tuple[int, int]:
    """Ask the forkserver listening at ``address`` (run by :func:`run_forkserver`, whose alive
    pipe's write end is ``alive_fd``) for a new child that inherits ``fds``: the stdlib's own
    request (``ForkServer.connect_to_new_process``, so the protocol stays the one its server
    loop speaks). Returns ``(sentinel, data_w)``: the child's pid, then its exit status, come
    on ``sentinel`` (:func:`read_signed`); its pickled data goes to ``data_w``.

    Raises:
        OSError: the server is gone or refused.
        ValueError: too many descriptors.
    """
    client = _Client()
    client._forkserver_address = address
    client._forkserver_alive_fd = alive_fd
    sentinel, data_w = client.connect_to_new_process(fds)
    return int(sentinel), int(data_w)


def run_forkserver(listener_fd: int, alive_r: int) -> None:
    """Run the stdlib's server loop on ``listener_fd`` until every writer of ``alive_r`` has
    gone (it then raises ``SystemExit``): no preloads, no authentication key."""
    forkserver.main(listener_fd, alive_r, [])


def read_signed(fd: int) -> int:
    """One signed number from a forkserver's sentinel (a pid, then an exit status).

    Raises:
        EOFError, OSError: the server closed it first.
    """
    return int(forkserver.read_signed(fd))


def _forked_server_works() -> bool:
    try:
        client = _Client()
    except Exception:  # an __init__ of another shape
        return False
    return (
        all(hasattr(client, name) for name in ("_forkserver_address", "_forkserver_alive_fd"))
        and callable(getattr(client, "connect_to_new_process", None))
        and callable(getattr(forkserver, "main", None))
        and callable(getattr(forkserver, "read_signed", None))
        and callable(getattr(_ForkServerPopenBase, "_launch", None))
        and callable(getattr(_mp_context, "set_spawning_popen", None))
    )


#: Whether a forkserver of one's own can be run on this Python (:class:`ForkServerPopen`,
#: :func:`connect_to_forkserver`, :func:`run_forkserver`); False: the standard one is used.
FORKED_SERVER = _forked_server_works()


# -- the standard forkserver, the resource tracker, output -----------------------------------


def forkserver_pid() -> int | None:
    """The pid of the standard forkserver of this process, if it runs; None also where its
    record is missing (the caller then checks the server each time rather than once)."""
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None


def resource_tracker_fd() -> int | None:
    """The descriptor of this process's pipe to the resource tracker, if it has one, without
    starting a tracker (``resource_tracker.getfd()`` would start one). None where the record
    is missing: a child forked from here then sheds the pipe with the rest, and the segments
    it makes are not tracked."""
    fd = getattr(getattr(resource_tracker, "_resource_tracker", None), "_fd", None)
    return fd if isinstance(fd, int) else None


def flush_std_streams() -> None:
    """Flush ``sys.stdout`` and ``sys.stderr`` before a fork (else the child writes what was
    buffered again), as multiprocessing does before its own forks; flushed here where its
    helper is missing."""
    flush = getattr(util, "_flush_std_streams", None)
    if callable(flush):
        flush()
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.flush()


def forget_parents_children() -> None:
    """Drop from multiprocessing's record of this process's children every process that
    another process started: run in a child made by ``os.fork()`` (an after-in-child fork
    hook). The child inherits the record, and multiprocessing's exit handler, which runs when
    the child ends normally (``sys.exit``, the end of its script), terminates every daemon
    process in it and joins the others: the parent's workers, killed by its child. A process
    multiprocessing starts does the same for itself (``Process._bootstrap`` empties the
    record). Missing record or ``_parent_pid``: nothing is dropped."""
    children = getattr(mp_process, "_children", None)
    if not isinstance(children, set):
        return
    me = os.getpid()
    for child in list(children):
        if getattr(child, "_parent_pid", me) != me:
            children.discard(child)


# -- imports in progress ---------------------------------------------------------------------


def module_locks() -> dict[str, Any] | None:
    """The import system's module locks by module name (weak references, alive while an import
    of that module runs, in any thread); None where the table is missing."""
    bootstrap = getattr(sys.modules.get("importlib"), "_bootstrap", None)
    locks = getattr(bootstrap, "_module_locks", None)
    return locks if isinstance(locks, dict) else None


def caller_frame(depth: int = 1) -> types.FrameType | None:
    """The frame ``depth`` calls above the caller of this function, or None (no such frame,
    or no ``sys._getframe`` in this Python)."""
    getframe = getattr(sys, "_getframe", None)
    if getframe is None:
        return None
    try:
        frame: types.FrameType = getframe(depth + 1)
    except ValueError:  # the stack is not that deep
        return None
    return frame
