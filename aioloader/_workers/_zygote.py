"""A forkserver forked from this process, rather than started as a fresh interpreter.

The standard ``forkserver`` start method starts its server by executing a new Python, which
imports the main module, aioloader, numpy and torch before it forks the first worker: about a
second here, paid by every program's first batch. A server *forked* from the main process has
all of that already, copy-on-write, at the cost of one ``fork()`` (milliseconds). Workers are
then forked from it as from any forkserver: from a single-threaded process, so they inherit no
lock held by another thread, which is what makes ``fork`` from a running loader unsafe.

The fork itself is only safe where no other thread may hold something the copy would need
(:func:`fork_is_safe`): :func:`zygote_context` forks the server only then (typically when the
first loader with worker processes is made, in the main thread, before any loader thread
exists) and returns ``None`` otherwise, for the caller to use a standard start method. One
server serves every loader of the process; if it dies it is forked again when that is safe.

It lives no longer than the pools that use it: each context given out holds it until a pool
claims that hold, each pool until it is closed (:func:`hold_server`), and the last to let go
ends it. A later loader forks a new one (one ``fork()``: the first batch of a second loader
made after the first was closed measured no slower). A server kept for the program's life
would keep a copy-on-write image of the program as it was at the first loader (a large
in-memory dataset freed since included) and show in ``ps`` after every loader is closed.

Because the server is a copy of the main process, the main module is already there; workers are
not told to run the main script again either (:func:`._cpython.preparation_data`): an unguarded
script works, as with torch's ``fork``. What the loader sends them from ``__main__`` still
travels by value (``_payload``): a class defined or redefined after the server was forked (a
notebook cell run again) would otherwise resolve to the server's old copy, or to nothing. What
the server must not keep from the main process, it drops at once: every socket and pipe (a peer
would otherwise never see them close: a TCP connection, a torch.distributed store, a
subprocess's pipe), signal handlers other than the default, the signal wake-up descriptor.

The server names itself ``aiol-forkserver`` (``/proc/PID/comm``, what ``ps`` and ``top`` show).

Under ``'fork'`` the workers skip the server: forked from the main process itself as an epoch
begins, under the same test made stricter (:func:`fork_unsafe_reason` with ``runs_user_code``:
a daemon thread counts too, since the worker runs user code that may want its lock), each sheds
what the server sheds (:func:`shed_parent_state`; see ``_pool.WorkerPool.fork_here``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import signal
import socket
import stat
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable
from multiprocessing import connection, resource_tracker, util
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

from ._cpython import (
    FORKED_SERVER,
    ForkServerPopen,
    caller_frame,
    connect_to_forkserver,
    flush_std_streams,
    module_locks,
    read_signed,
    run_forkserver,
    starts_through,
)

# multiprocessing's helpers, typed loosely (their stubs are not complete).
_util: Any = util
_connection: Any = connection

__all__ = [
    "PRELOAD",
    "SERVER_NAME",
    "SHED_SIGNALS",
    "Held",
    "fork_is_safe",
    "fork_unsafe_reason",
    "hold_server",
    "is_zygote",
    "name_process",
    "shed_parent_state",
    "sockets_and_pipes",
    "zygote_context",
    "zygote_pid",
]

# What every worker imports as it starts that the main process may not have imported yet.
# Not numpy.random: a worker seeds it only once something imports it (``_info``).
PRELOAD = ("aioloader._workers._worker", "concurrent.futures.process")

# How often a thread waiting for a child's pid checks whether another thread read it.
_PID_RECHECK_S = 0.05

SERVER_NAME = b"aiol-forkserver"  # at most 15 bytes: the kernel's limit for a process name

_PR_SET_NAME = 15


class _ForkedServer:
    """A forkserver whose server process is forked from this one (see the module doc): the
    stdlib's server loop (:func:`._cpython.run_forkserver`) in a process of our making."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = os.getpid()
        self._pid: int | None = None
        self._alive_fd: int | None = None
        self._address: Any = None
        self._users = 0  # contexts not yet claimed by a pool, and pools not closed yet

    def hold(self) -> None:
        """One more user (a context given out, or a pool): the server stays while any holds it."""
        with self._lock:
            self._users += 1

    def let_go(self) -> None:
        """One user fewer; the last one ends the server (see :func:`_end_server`). In a forked
        child, nothing: the server is its parent's."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            self._users -= 1
            if self._users > 0 or self._pid is None:
                return
            pid, alive = self._pid, self._alive_fd
            self._pid = self._alive_fd = self._address = None
        _end_server(pid, alive)

    def ensure_running(self) -> None:
        with self._lock:
            resource_tracker.ensure_running()
            if self._pid is not None:
                pid, _ = os.waitpid(self._pid, os.WNOHANG)
                if not pid:
                    return  # alive
                if self._alive_fd is not None:
                    os.close(self._alive_fd)
                self._address = None
                self._alive_fd = None
                self._pid = None
            if not fork_is_safe():
                raise RuntimeError(
                    "the worker server died and cannot be forked again while other threads "
                    "run; close this loader and make a new one"
                )
            self._fork_server()

    def connect(self, fds: list[int]) -> tuple[int, int]:
        """Ask the server (started again if it died: :meth:`ensure_running`) for a child that
        inherits ``fds``: its sentinel and the write end of its data pipe."""
        self.ensure_running()
        with self._lock:
            address, alive = self._address, self._alive_fd
        if alive is None:  # let go of meanwhile (a pool closed under this launch)
            raise EOFError("the worker server was ended before it forked the process")
        return connect_to_forkserver(address, alive, fds)

    def _fork_server(self) -> None:
        with socket.socket(socket.AF_UNIX) as listener:
            address = _connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            if not _util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()  # the server ends when every writer has gone
            flush_std_streams()  # else the child writes them out again
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the server process (its coverage is not seen)
                _serve(listener.fileno(), alive_r, alive_w)
            os.close(alive_r)
        self._address = address
        self._alive_fd = alive_w
        self._pid = pid


# How long the last user waits for the server to end once told (it exits at once: the stdlib
# server loop ends at the end-of-file of its alive pipe); past it the server is killed.
_END_WAIT_S = 2.0


def _end_server(pid: int, alive_fd: int | None) -> None:
    """End the server ``pid`` and reap it: closing ``alive_fd`` (the last writer of its alive
    pipe) ends its loop. Its workers are the pools' to stop, which did so first."""
    if alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(alive_fd)
    deadline = time.monotonic() + _END_WAIT_S
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped already (a SIGCHLD handler set to ignore)
            return
        if done:
            return
        if time.monotonic() >= deadline:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        time.sleep(0.001)


def _serve(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The server process: shed what it must not hold, then run the stdlib server loop."""
    code = 1
    try:
        os.close(alive_w)
        name_process(SERVER_NAME)
        shed_parent_state(sockets_and_pipes(keep={listener_fd, alive_r}))
        gc.freeze()  # the server lives long: its collections would copy the heap it shares
        for module in PRELOAD:  # once here, rather than once in every worker
            with contextlib.suppress(ImportError):
                importlib.import_module(module)
        run_forkserver(listener_fd, alive_r)
    except SystemExit:
        code = 0  # every client has gone: the normal end
    except BaseException:
        with contextlib.suppress(Exception):
            sys.excepthook(*sys.exc_info())
    finally:
        os._exit(code)  # never the main program's atexit hooks or buffered output


#: What a forked child must let go of: the descriptor, and what it was when listed (device
#: and inode), so that a number closed and reused meanwhile is left alone.
Held = tuple[int, int, int]

# The signals whose handlers a child forked from the main process resets to the default.
SHED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def shed_parent_state(release: Iterable[Held]) -> None:
    """In a process just forked from the main process: drop what it must not keep of it (see
    the module docstring): the signal wake-up descriptor, signal handlers other than the
    default, and the sockets and pipes in ``release`` (see :func:`sockets_and_pipes`), each
    only if it is still the one listed. From the process's only thread (the one that forked
    becomes its main thread).

    Each is pointed at /dev/null rather than closed: objects copied from the main process still
    own those numbers and close them when collected; a number closed now could be reused
    meanwhile by a descriptor this process needs, which that late close would then take away.
    """
    with contextlib.suppress(ValueError):  # where the signal module refuses: nothing to undo
        signal.set_wakeup_fd(-1)
    for sig in SHED_SIGNALS:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd, device, inode in release:
            if fd != null and _identity(fd) == (device, inode):
                os.dup2(null, fd)
    finally:
        os.close(null)


def sockets_and_pipes(keep: Iterable[int] = ()) -> list[Held]:
    """The sockets and pipes open in this process now, but the standard streams and ``keep``:
    what a process forked from it sheds. Taken in the child (the forked server), or in the
    parent just before the fork (``multiprocessing``'s fork makes the pipe that tells the
    child's death after it: the child keeps it)."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no procfs: nothing to walk
        return []
    skip = {0, 1, 2, *keep}
    held = []
    for fd in fds:
        if fd in skip:
            continue
        with contextlib.suppress(OSError):  # closed meanwhile (listdir's own, among others)
            info = os.fstat(fd)
            if stat.S_ISSOCK(info.st_mode) or stat.S_ISFIFO(info.st_mode):
                held.append((fd, info.st_dev, info.st_ino))
    return held


def _identity(fd: int) -> tuple[int, int] | None:
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def name_process(name: bytes) -> None:
    """Set this process's name as ``ps`` and ``top`` show it (``/proc/PID/comm``; at most 15
    bytes are kept). Best effort."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)  # the loaded C library (find_library forks)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)


class _Popen(ForkServerPopen):
    """Start a process through the forked server instead of the stdlib's global one: the
    stdlib's launch (:class:`._cpython.ForkServerPopen`), with the server it connects to
    swapped, that returns once the request is sent. The server writes the child's pid, then
    its exit status, to the sentinel; the pid is read when first asked for (:attr:`pid`), so
    that one thread can ask for several workers before waiting for any: the server forks them
    back to back, in the order asked."""

    returncode: int | None

    def start(self, data: bytes, fds: list[int]) -> None:
        self._pid: int | None = None
        self._pid_lock = threading.Lock()
        self.sentinel, w = _server().connect(fds)
        # The data pipe's write end, kept open: the child reads its end's closing as this
        # process's death.
        parent_w = os.dup(w)
        self.finalizer = _util.Finalize(self, _util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(data)

    @property
    def pid(self) -> int:
        """The child's pid (blocking until the server has forked it).

        Raises:
            EOFError: the server died before it forked the child.
        """
        while self._pid is None:
            # The server writes the pid once it forked. Bounded: another thread's poll() (the
            # one multiprocessing makes of every child from each Process.start()) may read it
            # between this loop's check and this wait, after which nothing comes down the pipe
            # until the child exits.
            _connection.wait([self.sentinel], _PID_RECHECK_S)
            if self.poll() is not None and self._pid is None:
                raise EOFError("the worker server died before it forked the process")
        return self._pid

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        # The sentinel carries the pid, then the exit status. One reader at a time (a status
        # read twice is lost: the second reader gets end-of-file and would record 255), and a
        # status once read is kept: multiprocessing polls every child from Process.start()
        # and active_children(), beside the pool's own reads. Blocking waits hold no lock.
        while True:
            with self._pid_lock:
                if self.returncode is not None:
                    return self.returncode
                if _connection.wait([self.sentinel], 0):
                    try:
                        message = read_signed(self.sentinel)
                    except (OSError, EOFError):  # the server died: as the stdlib records it
                        self.returncode = 255
                        return self.returncode
                    if self._pid is None:
                        self._pid = message
                        continue  # its exit status may have come too
                    self.returncode = message
                    return self.returncode
                if flag == os.WNOHANG:
                    return None
            _connection.wait([self.sentinel])

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            _connection.wait([self.sentinel], left)
        return code


@starts_through(_Popen)
class _Process(ForkServerProcess):
    pass


class _Context(ForkServerContext):
    """A forkserver context whose server is forked from this process. It holds the server
    (:meth:`_ForkedServer.hold`) from when it is given out until a pool claims that hold
    (:func:`hold_server`) or, claimed by none, it is collected."""

    Process = _Process

    def __init__(self, server: _ForkedServer) -> None:
        super().__init__()
        server.hold()
        self._claim: list[_ForkedServer] = [server]  # the hold not yet claimed by a pool
        weakref.finalize(self, _unclaimed, self._claim)


def _unclaimed(claim: list[_ForkedServer]) -> None:
    while claim:
        claim.pop().let_go()


def hold_server(context: object) -> Callable[[], None] | None:
    """For a pool whose workers start from ``context``: hold the forked server while the pool
    is open. Returns what the pool calls once closed, its workers stopped (the last such call
    ends the server: nothing of the loader outlives the last pool, and the program's memory
    is not kept in a copy); None for other contexts. The first pool on a context takes over
    the context's own hold, so a server that already runs is never ended in between."""
    if not isinstance(context, _Context):
        return None
    try:
        server = context._claim.pop()
    except IndexError:  # claimed already: a second pool on the same context
        server = _server()
        server.ensure_running()  # RuntimeError where it cannot be forked again now
        server.hold()
    return _once(server.let_go)


def _once(call: Callable[[], None]) -> Callable[[], None]:
    box = [call]

    def once() -> None:
        while box:
            box.pop()()

    return once


_SERVER_LOCK = threading.Lock()
_SERVER_BOX: list[_ForkedServer] = []


def _new_server_lock() -> None:
    # A parent's thread may have held it as the process forked (starting the server): the
    # child starts with its own, and _server() sees the inherited server is not its own.
    global _SERVER_LOCK
    _SERVER_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_server_lock)


def _server() -> _ForkedServer:
    with _SERVER_LOCK:
        if not _SERVER_BOX or _SERVER_BOX[0]._owner != os.getpid():
            _SERVER_BOX[:] = [_ForkedServer()]
        return _SERVER_BOX[0]


def fork_is_safe() -> bool:
    """Whether this process may fork now (the server, or a worker: see
    :func:`fork_unsafe_reason`)."""
    return fork_unsafe_reason() is None


def fork_unsafe_reason(*, runs_user_code: bool = False) -> str | None:
    """Why this process may not fork now, or None if it may: from the main thread, with every
    other thread a daemon of someone else's (a notebook kernel's heartbeat and output threads
    are), or, where the child ``runs_user_code``, with no other thread at all.

    The server itself only runs the stdlib's server loop, and CPython re-initialises the import
    lock and the GIL in a forked child; what a thread might hold at the fork that a worker would
    then wait on forever is program state. A non-daemon thread (an executor's, a program's
    own) may be in the middle of anything, and a loader's own threads hold its locks: with
    either running, or while a module is being imported (see :func:`_importing`), the caller
    uses a standard start method instead.

    A worker forked from the program (``runs_user_code``: under ``'fork'``) runs the user's
    dataset, transforms and collate function, which may take any lock a daemon thread of the
    program holds (a logging handler's, an allocator's, a client library's): there a daemon
    thread counts as any other.
    """
    me = threading.current_thread()
    if me is not threading.main_thread():
        return f"the loader starts it from a thread ({me.name!r}), not the main thread"
    if _importing():
        return "a module is being imported (a loader iterated at a module's top level)"
    others = [
        t.name
        for t in threading.enumerate()
        if t is not me and (runs_user_code or not t.daemon or t.name.startswith("aioloader"))
    ]
    if others:
        return f"other threads run ({', '.join(map(repr, sorted(others)))}) and may hold locks"
    return None


def _importing() -> bool:
    """Whether a module is being imported now (a loader made at a module's top level). The
    server would keep that module half-made forever: names it defines further down would be
    missing in every worker, which unpickles by reference from the server's copy.

    Read from the module locks of imports in progress, in any thread, and from this thread's
    stack (a module's body runs in a frame of its own), not from every module in
    ``sys.modules``: right after a fork each object touched there costs a copied page, and
    with torch loaded that walk took milliseconds.

    Only this thread's frames are walked, from ``sys._getframe``: walking the ``f_back``
    chains of ``sys._current_frames()`` crashed CPython 3.11.7 with a segmentation fault at a
    loader's construction, in 3 of 5 runs of ``tests/test_torch_api.py`` on a loaded machine
    (none in 10 with this walk). Another thread's import holds its module lock for as long as
    its body runs, so the locks cover it.
    """
    # An import in progress holds its module lock from finding the module to the end of its
    # body, whichever thread imports it.
    locks = module_locks() or {}
    if any(ref() is not None for ref in list(locks.values())):
        return True
    frame: types.FrameType | None = caller_frame(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            spec = frame.f_globals.get("__spec__")
            if getattr(spec, "_initializing", False):
                return True
        frame = frame.f_back
    return False


def zygote_context() -> ForkServerContext | None:
    """A context whose workers fork from a server forked from this process, with the server
    running; ``None`` where it cannot be started safely now (threads run) and is not running
    yet, or where ``fork`` does not exist."""
    if not hasattr(os, "fork") or sys.platform != "linux" or not FORKED_SERVER:
        return None
    server = _server()
    try:
        with server._lock:
            running = server._pid is not None
        if not running and not fork_is_safe():
            return None
        server.ensure_running()
    except (OSError, RuntimeError):
        return None
    return _Context(server)


def is_zygote(context: object) -> bool:
    """Whether ``context`` starts workers from the forked server (:func:`zygote_context`)."""
    return isinstance(context, _Context)


def zygote_pid() -> int | None:
    """The server's pid, if it was started (for diagnostics and tests)."""
    if not _SERVER_BOX:
        return None
    return _SERVER_BOX[0]._pid
