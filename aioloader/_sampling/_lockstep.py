"""Equal steps on every rank: the ranks agree, step by step, on where a stream's epoch ends.

A stream's share has no length until it ends, so ranks of one job may have different numbers
of batches; the rank that runs out stops calling the training step's collectives and the
others wait for it forever. Under ``equal_steps`` the ranks agree on the epoch's end instead::

    consumer (Epoch, event loop)            agreement thread (one per loader)
      a batch ready, or the stream ended ──▶ job(step, have) ── all_reduce(MIN) over a gloo
      (offered as soon as it is known,        (in step order,       group of the sharing
       a few batches ahead of the consumer)    one at a time)       ranks, made at the first job:
      before handing batch ``step`` over ◀── verdict: every rank    [have, epoch, -epoch,
      (waits at most the bound + a margin)     has a batch ``step``? step, -step]

Each rank offers step ``s`` as soon as it knows whether it has an ``s``-th batch (the batch
arrived in the reorder buffer, or its stream ended before it), and the thread runs the
all-reduces one after the other, ahead of the consumer as far as prefetching allows: the
consumer waits for a verdict only when the thread has not got there yet. The first step whose
minimum is 0 ends the epoch on every rank; jobs queued behind it skip their collective. So
every rank runs the same collectives, ``0 .. n``, and ends at the same step ``n``, the
shortest share; an epoch closed early (a ``break``) offers -1 at its next step, which ends the
others' epoch there too, and tells them why (the least of 1, 0 and -1 is -1): they log it at
WARNING, since a loop left on one rank only is how an extra iteration (a peek) looks.

Each step's all-reduce carries the epoch and the step beside ``have`` (``MIN`` of ``x`` and of
``-x`` gives the least and the greatest), so ranks whose iterations of one loader drifted
apart (an extra iteration on one rank, ``next(iter(loader))`` to peek, then ``set_epoch``; a
failure that hit one rank only) fail at the first step that pairs another epoch or step, on
every rank of it, naming both; never pair silently. After any failure (a mismatch, a timeout,
a peer gone) the agreement is *broken*: every later step, of this epoch or a later one, fails
at once with that first error as its cause; the ranks' steps can no longer be paired, so
nothing is retried (a second rendezvous under the same keys would meet stale ones).

Why a thread and a group of its own: a blocking collective must not run on the event loop,
and the training step's collectives (DDP's all-reduce) run on the default group from the
training thread: ops of two threads on one group would be matched in whatever order each rank
issued them. Each loader has its own gloo group (so any default backend works), made by its
thread at its first job: a rendezvous of the sharing ranks through the default group's store,
never at construction, and only for a loader that shards by the group (every rank builds it:
a loader made on some ranks only passes ``shard=False`` or ``equal_steps=False``).

Which group pairs with which across ranks (the rule): a loader's group is keyed by its
*equal-steps key*: its *scope* (the default group, or the ranks of the data-parallel group it
was given as ``shard``) and the number of stream loaders this process built before it in that
scope (a stream loader that may take equal steps: ``equal_steps`` not False, ``shard`` not
False). Every rank of a scope builds that scope's loaders in the same order, as one training
script does, so loader ``k`` of a scope meets loader ``k`` of the scope on the other ranks,
whatever order their epochs start in, from whatever thread. Counted per scope, because a
subgroup's loader is built on its members only: counted across scopes, ranks 0-2 of a loader
of ``new_group([0, 1, 2])`` built after one of ``new_group([0, 1])`` held different counts
(rank 2 had not built the first) and met nobody. The group is not made with
``torch.distributed.new_group``: torch names those by how many groups each process made so
far, so two loaders whose first epochs start in another order on each rank would pair
crossed, and a group made on one rank only (a job queued behind a close, say) would shift the
names of every later group, the user's included, until each rendezvous times out. Ours touch
no torch-wide count and are never registered with torch; the group is made once per loader
and released by its thread after its last job; a job that would run after that fails instead
of making another. The store keys of the rendezvous (one a
rank, holding its addresses: O(world) bytes each) are deleted by their own rank once the first
step's all-reduce returned (every rank made its group then, so every rank read every key), or
once its rendezvous failed: a job that builds a loader an epoch leaves nothing growing in the
store.

No wait is unbounded: the group's rendezvous (the connection of its own to the store, the
store's wait for the others' addresses, gloo's connection to each peer) and each step's
all-reduce give up after :data:`AGREEMENT_TIMEOUT_S`, and the epoch fails with a
``RuntimeError`` naming the epoch, the step and the way out (``equal_steps=False`` or
``shard=False``), its cause torch's error: "did not join within ..." where the bound ran out,
"failed after ... s" with the cause's type and message where it did not (a peer that closed
its group, a store gone). The consumer waits for a verdict at most the bound plus
:data:`VERDICT_MARGIN_S` (a thread stuck past its own bound, say in torch), then fails naming
the epoch and step it waited for. A loader iterated on rank 0 only (an evaluation loader built
without ``shard=False``) so fails within a minute instead of hanging.

What each rank read past the agreed end (its ``leftover``) is counted and logged; with
``leftover='carry'`` it is handed first in the next epoch (a step of that epoch; at most
``prefetch`` batches are carried, the rest counted as dropped), with
``'drop'`` it is released. What the rank had not read yet of its share is not read in this
epoch: the log says so.

The one thread is a daemon: a collective waiting for a rank that died must not hold the
interpreter at its exit (the bound ends the wait anyway). Closing (the loader's ``close()``,
or its finalizer when it is collected unclosed, which does not wait) gives up the open epoch,
releases the carried batches, and queues the group's release behind the last job, on the
thread: nothing about the group is changed from another thread while jobs may still use it (a
close that cleared it at once let a job queued before it make a second group on that rank
only). Releasing the group is no collective: its sockets close, the others' last collective of
it already returned. The thread forgets each job once it ran, so an idle thread holds no epoch
or batch. At the interpreter's exit an ``atexit`` hook closes the agreements still open and
waits (:data:`_EXIT_WAIT_S` in all) for their threads to release the groups: a gloo group left
to the interpreter's teardown aborted the process (``terminate called without an active
exception``). The hook's wait is one deadline for everything it waits on. What it cannot
help: a step still waiting for ranks that are gone when the wait is over is left to the
daemon thread, and the process may still abort as it ends.

A forked child (``os.fork()``, ``multiprocessing`` under 'fork') has none of the parent's
agreement threads, and the parent's groups are not its own: their connections are the
parent's, and destroying a copy of one in the child waits forever for gloo threads that exist
in the parent only (the child hung where it collected its loader, or at its exit). So at the
fork every lockstep of the child lets go of its parent's thread, open epoch and carried
batches (they are the parent's, read by the parent), and its group is kept alive, untouched,
for the child's life. The child's next epoch starts fresh, on a thread of its own, as the
rest of its loader does: it makes a group of its own if this process has a process group of
its own (``init_process_group`` called in the child); under the process group it inherited
(the parent's connections) it refuses at once, naming both processes and the way out, never
waiting for a verdict that no thread would give.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import ctypes
import functools
import itertools
import os
import queue
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .._errors import LoaderTimeoutError
from .._validate import boolean

__all__ = [
    "AGREEMENT_TIMEOUT_S",
    "LEFTOVER_POLICIES",
    "VERDICT_MARGIN_S",
    "EpochAgreement",
    "Lockstep",
    "resolve_equal_steps",
    "resolve_leftover",
]

#: How long one rank waits for the others in making the group and in a step's agreement
#: before the epoch fails with an error naming the way out. The trade-off: long enough for a
#: rank that is legitimately behind by a slow step (a checkpoint, a short evaluation on rank
#: 0), short enough that a loader iterated on some ranks only (an evaluation loader made
#: without ``shard=False``) fails within a minute instead of hanging for torch's 30 minutes.
#: A job whose ranks drift apart by longer passes ``equal_steps=False`` and keeps in step
#: itself. Read when a loader is built (a test lowers it before building one).
AGREEMENT_TIMEOUT_S = 60.0

#: How much longer than :data:`AGREEMENT_TIMEOUT_S` the consumer waits for a step's verdict
#: before it fails naming the step: the thread gives up on its own within the bound; this
#: covers the steps queued before it (a previous epoch's last one) and a rendezvous whose
#: parts each took most of the bound. A wait past it means the thread is stuck (in torch).
#: Read when a loader is built.
VERDICT_MARGIN_S = 30.0

#: What ``leftover=`` accepts: read first in the next epoch, or released (counted, logged).
LEFTOVER_POLICIES = ("carry", "drop")


def resolve_equal_steps(equal_steps: object) -> bool | None:
    """``equal_steps`` checked: None (automatic), True or False.

    Raises:
        TypeError: anything else, naming the value.
    """
    if equal_steps is None:
        return None
    try:
        return boolean("equal_steps", equal_steps)
    except TypeError:
        raise TypeError(
            f"equal_steps must be None (automatic), True or False, got {equal_steps!r}"
        ) from None


def resolve_leftover(leftover: object) -> str:
    """``leftover`` checked: ``'carry'`` or ``'drop'``.

    Raises:
        ValueError: anything else, naming the value.
    """
    if not isinstance(leftover, str) or leftover not in LEFTOVER_POLICIES:
        raise ValueError(
            f"leftover must be 'carry' (read first in the next epoch) or 'drop', got {leftover!r}"
        )
    return leftover


class _AgreementThread:
    """One daemon thread running jobs in the order they were submitted."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._closing = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Queue ``job``; after :meth:`close` its future fails at once (no job is left queued
        behind the end, whose verdict nobody would ever give)."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if not self._closing:
                self._jobs.put((job, future))
                return future
        future.set_exception(RuntimeError("equal steps: this loader's agreement was closed"))
        return future

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:  # handed to whoever awaits the verdict
                future.set_exception(exc)
            # The last job's closure holds its epoch, the lockstep and its carried batches:
            # dropped here, or an idle thread would keep a collected loader's batches alive.
            del item, job, future

    def join(self, wait_s: float) -> bool:
        """Wait up to ``wait_s`` for the thread to end; whether it did."""
        if threading.current_thread() is not self._thread:
            self._thread.join(wait_s)
        return not self._thread.is_alive()

    def close(self, wait_s: float) -> None:
        """Stop after the jobs already queued; wait up to ``wait_s`` for that."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(wait_s)


class Lockstep:
    """The agreement of one loader's ranks, across its epochs (see the module docstring).

    Args:
        members: the global ranks that share the data (the default group's, or the
            data-parallel group's); the agreement runs over them.
        leftover: ``'carry'`` or ``'drop'``.
        key: the loader's equal-steps key (:meth:`next_key`, taken when it was built): the
            ranks' loaders with the same key and members pair.
        timeout_s: how long a rank waits for the others in one agreement.
        all_min: the collective, run on the thread: the element-wise minimum of its argument
            (``[have, epoch, -epoch, step, -step]``) over the members (default: an all-reduce
            over a gloo group of theirs, made at the first call). A seam for tests of the
            sequencing.
        store: where the group's rendezvous meets (default: the default group's store).
        margin_s: how much longer than ``timeout_s`` the consumer waits for a verdict.
    """

    def __init__(
        self,
        members: tuple[int, ...],
        leftover: str,
        key: str = "world#0",
        timeout_s: float | None = None,
        all_min: Callable[[list[int]], list[int]] | None = None,
        store: Any = None,
        margin_s: float | None = None,
    ) -> None:
        self.members = members
        self.key = key
        self._collective = all_min if all_min is not None else self._all_min
        self._store = store
        self.leftover = leftover
        self.timeout_s = AGREEMENT_TIMEOUT_S if timeout_s is None else timeout_s
        #: How long the consumer waits for one verdict before it fails.
        self.verdict_wait_s = self.timeout_s + (VERDICT_MARGIN_S if margin_s is None else margin_s)
        self._thread: _AgreementThread | None = None
        self._stopping: _AgreementThread | None = None  # closed, perhaps still running jobs
        # Touched on the thread only: None until the first job, then the group, then
        # _RELEASED (after the last job) or _FAILED (its rendezvous failed): never made twice.
        self._group: Any = None
        self._keys: Callable[[], None] | None = None  # deletes this rank's rendezvous keys
        self._lock = threading.Lock()
        #: The first failure of this agreement (a mismatch, a timeout, a peer gone, a consumer
        #: that waited past its bound): every later step fails with it as its cause.
        self.broken: BaseException | None = None
        #: Batches read past the agreed end of the last epoch, to be handed first in the next
        #: (``leftover='carry'``): each ``(batch, samples, nbytes)``.
        self.carried: list[tuple[Any, int, int]] = []
        self._current: EpochAgreement | None = None
        self._pid = os.getpid()  # the process whose thread and group these are
        self._forked_from: int | None = None  # set in a forked child (_forked)
        _ALL.add(self)

    @staticmethod
    def next_key(scope: tuple[int, ...] | None = None) -> str:
        """The next equal-steps key of this process in ``scope``: the default group's (None)
        or the data-parallel group's of these global ranks (a ``shard=group``). Taken by each
        stream loader when it is built: the same on every rank of the scope that builds the
        scope's loaders in the same order (see the module docstring)."""
        name = "world" if scope is None else "group-" + "-".join(map(str, scope))
        counter = _KEYS.setdefault(name, itertools.count())
        return f"{name}#{next(counter)}"

    def check_usable(self) -> None:
        """Refuse at once where the ranks cannot agree in this process: a forked child under
        the process group it inherited (its connections are the parent's; see the module
        docstring). Called before an epoch starts (and by :meth:`begin`).

        Raises:
            RuntimeError: naming this process, the one the group was made in, and the way out.
        """
        if self._collective != self._all_min or not _inherited_group():
            return
        made_in = f"process {self._forked_from}" if self._forked_from else "a parent process"
        raise RuntimeError(
            f"equal steps: this is process {os.getpid()}, forked from {made_in} with its "
            "process group: that group's connections are the parent's, so this loader's "
            "ranks cannot agree on its steps here (its epoch would wait for a verdict that "
            "never comes). Call torch.distributed.init_process_group in this process for a "
            "group of its own, or iterate a loader made with equal_steps=False (this rank's "
            "share, no agreement) or shard=False (the whole stream) here"
        )

    def _forked(self) -> None:
        """In a forked child, right after the fork (one thread runs): let go of the parent's
        thread, open epoch and carried batches, and keep its group alive untouched (see the
        module docstring); the next epoch starts fresh, with a thread and group of its own."""
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork
        self._forked_from, self._pid = self._pid, os.getpid()
        group, self._group = self._group, None
        if group is not None and group is not _RELEASED and group is not _FAILED:
            _keep_forever(group)
        # The parent's rendezvous keys are the parent's to delete; its failure is not this
        # process's (its next group is its own, made afresh).
        self._keys = None
        self.broken = None
        self._thread = self._stopping = None
        self._current = None
        self.carried = []

    def begin(self, epoch: int) -> EpochAgreement:
        """The agreement of epoch ``epoch``. An epoch still open gives up first (one epoch's
        steps at a time: two interleaved would pair steps differently on each rank); the
        loader refuses to begin one while another is open, so this is a backstop.

        Raises:
            RuntimeError: in a forked child under its parent's process group
                (:meth:`check_usable`).
        """
        self.check_usable()
        with self._lock:
            if self._thread is None:
                self._thread = _AgreementThread(f"aioloader-equal-steps-{self.key}")
                _LIVE.add(self)
            previous, self._current = self._current, None
        if previous is not None:
            previous.give_up()
        agreement = EpochAgreement(self._thread, self, epoch)
        self._current = agreement
        return agreement

    def break_with(self, error: BaseException) -> None:
        """The agreement failed: the first failure is kept; every later step raises it."""
        if self.broken is None:
            self.broken = error

    def collective(self, values: list[int]) -> list[int]:
        """On the thread: the element-wise minimum of ``values`` over the members."""
        return self._collective(values)

    def _all_min(self, values: list[int]) -> list[int]:
        """On the thread: the element-wise minimum of ``values`` over the members (the group
        made first; this rank's rendezvous keys deleted after its first all-reduce)."""
        torch: Any = sys.modules["torch"]
        dist: Any = sys.modules["torch.distributed"]
        if self._group is _RELEASED:
            raise RuntimeError("equal steps: this loader's agreement was closed")
        if self._group is _FAILED:
            raise RuntimeError("equal steps: this loader's group could not be made")
        if self._group is None:
            self._group = _FAILED  # never a second rendezvous under the same keys
            store = self._store if self._store is not None else _default_store()
            self._group, self._keys = _gloo_group(self.key, self.members, self.timeout_s, store)
        flags = torch.tensor(values, dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self._group.allreduce([flags], options).wait()
        self._delete_keys()  # every rank made its group: every key was read
        return [int(v) for v in flags.tolist()]

    def _delete_keys(self) -> None:
        keys, self._keys = self._keys, None
        if keys is not None:
            keys()

    def _release_group(self) -> None:
        """On the thread, after the last job: the group's sockets are closed (no collective:
        the others' last collective of it already returned)."""
        group, self._group = self._group, _RELEASED
        with contextlib.suppress(Exception):  # the store may be gone with the default group
            self._delete_keys()
        if group is not None and group is not _RELEASED and group is not _FAILED:
            # A group torch already tore down (the default one destroyed first): nothing more.
            with contextlib.suppress(Exception):
                group.shutdown()

    def close(self, wait_s: float | None = None) -> None:
        """Give up the open epoch (the others end at its next step), release the carried
        batches, and stop the thread once its queued jobs ran, the group released last, on
        the thread. Waits up to ``wait_s`` for the thread (a job may wait for the other
        ranks): a loader's ``close()`` waits briefly, its finalizer (the garbage collector's
        thread) not at all. Idempotent."""
        current, self._current = self._current, None
        if current is not None:
            current.give_up()
        self.carried.clear()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping = thread
            thread.submit(self._release_group)
            thread.close(wait_s=_CLOSE_WAIT_S if wait_s is None else wait_s)

    def finish_at_exit(self, deadline: float) -> bool:
        """At the interpreter's exit: close (if still open) and wait until ``deadline`` (of
        :func:`time.monotonic`) at the latest, all waits together, for the thread to run its
        last jobs and release the group; whether it did."""
        self.close(max(0.0, deadline - time.monotonic()))
        thread = self._stopping
        return thread is None or thread.join(max(0.0, deadline - time.monotonic()))

    def finalizer(self) -> Callable[[], None]:
        """What closes this lockstep without waiting and without holding its owner (a
        loader's finalizer calls it)."""
        return functools.partial(self.close, 0.0)


# How long closing a loader waits for its agreement thread to finish the jobs it has: the
# other ranks close too and answer in milliseconds; a rank that does not is left to the daemon.
_CLOSE_WAIT_S = 5.0

# How long the interpreter's exit waits for the open agreements to end, all together: a
# give-up step is answered by the other ranks' next step (at once while they run; they end at
# that step); ranks that are gone never answer, and the exit goes on without them.
_EXIT_WAIT_S = 5.0

# Locksteps whose thread was started, for the exit hook (weakly: a collected loader's goes).
_LIVE: weakref.WeakSet[Lockstep] = weakref.WeakSet()


# Every lockstep of this process, for the fork hook (weakly).
_ALL: weakref.WeakSet[Lockstep] = weakref.WeakSet()

# The default process group when this process was forked (None: none then, or not forked):
# a group made in another process, whose connections are that process's.
_FORKED_UNDER: Any = None

# Groups of the parent's, kept alive in a forked child (see _keep_forever).
_KEPT: list[Any] = []


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's agreement threads, and the parent's agreements
    are not its to close: its exit hook leaves them alone, and each lockstep lets go of them
    (:meth:`Lockstep._forked`)."""
    global _FORKED_UNDER
    _LIVE.clear()
    for lockstep in list(_ALL):
        lockstep._forked()
    _FORKED_UNDER = _default_group()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _default_group() -> Any:
    """The initialised default process group, or None (torch is not imported for this)."""
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.group.WORLD


def _inherited_group() -> bool:
    """Whether this process runs under a default process group it inherited by a fork."""
    return _FORKED_UNDER is not None and _default_group() is _FORKED_UNDER


def _keep_forever(group: Any) -> None:
    """Keep a parent's gloo group alive in a forked child to its very end: its destructor joins
    the group's threads, which exist in the parent only, and waited forever (where the child
    collected its loader, or at its exit, when the interpreter clears the modules). One
    reference more than the interpreter will ever drop (``Py_IncRef``, public C API)."""
    _KEPT.append(group)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


@atexit.register
def _finish_at_exit() -> None:
    """Close every open agreement before the interpreter tears down: a gloo group still alive
    then (its sockets, its store connection, the thread) was destroyed amid finalization and
    took the process down with ``terminate called without an active exception`` (SIGABRT), on
    a rank that had read its epoch to the end and exited without closing its loader. The
    finalizers of collected loaders do not wait; this does, briefly."""
    deadline = time.monotonic() + _EXIT_WAIT_S  # for all of them together
    for lockstep in list(_LIVE):
        lockstep.finish_at_exit(deadline)


# The equal-steps keys of this process: a count per scope, one per stream loader built in it
# (see Lockstep.next_key).
_KEYS: dict[str, itertools.count[int]] = {}

# What a lockstep's group is once released: a job after it fails, never makes another.
_RELEASED = object()

# What a lockstep's group is once its rendezvous failed: never tried again (the keys of the
# failed one may still be in the store, the other ranks' among them).
_FAILED = object()

# Where the groups meet in the default group's store (under torch's own prefix of it).
_STORE_PREFIX = "aioloader/equal-steps"


def _default_store() -> Any:
    """The default group's store: the one place that reads torch's private
    ``_get_default_store`` (there since torch 1.x, with no public twin).

    Raises:
        RuntimeError: this torch has none, naming its version and the way out.
    """
    torch: Any = sys.modules["torch"]
    dist: Any = sys.modules["torch.distributed"]
    try:
        return dist.distributed_c10d._get_default_store()
    except AttributeError as exc:
        raise RuntimeError(
            "equal steps meet in the default process group's store, which torch "
            f"{torch.__version__} does not give (torch.distributed.distributed_c10d."
            "_get_default_store is missing): pass equal_steps=False (and keep the ranks' "
            "steps equal yourself, e.g. DDP's model.join())"
        ) from exc


def _own_connection(store: Any, timeout_s: float) -> Any:
    """A connection of its own to ``store`` (a clone), made within ``timeout_s``.

    A store client serves one request at a time, and a rendezvous blocks in it until the
    others come: two loaders meeting at once on one connection would each wait behind the
    other's wait (a crossed pair never forms). A clone connects under the store's own timeout
    (the default group's: 30 minutes by default), so the store's server is reached first
    within ``timeout_s`` (a server gone refuses at once, or the probe times out); the clone
    then connects to a server that answers. A store that cannot be cloned (torch < 2.3, a
    FileStore) is shared, as torch's own groups share it; one with no server to reach (a
    FileStore, a HashStore) has no connection to wait for.

    Raises:
        OSError: the store's server cannot be reached within ``timeout_s`` (``TimeoutError``
            where the time ran out).
    """
    base = store
    while hasattr(base, "underlying_store"):  # PrefixStores around the TCPStore
        base = base.underlying_store
    host, port = getattr(base, "host", None), getattr(base, "port", None)
    if isinstance(host, str) and isinstance(port, int):
        with socket.create_connection((host, port), timeout=max(timeout_s, 0.001)):
            pass
    try:
        return store.clone()
    except (AttributeError, NotImplementedError, RuntimeError):
        return store


def _gloo_group(
    key: str, members: tuple[int, ...], timeout_s: float, store: Any
) -> tuple[Any, Callable[[], None]]:
    """A gloo group of ``members``, made by a rendezvous of theirs in ``store`` under a prefix
    of the loader's key and members (see the module docstring: not ``new_group``, whose names
    follow a count of every group the process made), and what deletes this rank's keys of it.
    Raises torch's error if the others do not come within ``timeout_s`` (this rank's keys
    deleted first)."""
    dist: Any = sys.modules["torch.distributed"]
    prefix = f"{_STORE_PREFIX}/{key}/{'-'.join(map(str, members))}/"
    meeting = dist.PrefixStore(prefix, _own_connection(store, timeout_s))
    rank = members.index(dist.get_rank())

    def delete_keys() -> None:
        # Gloo's rendezvous: each rank sets "<device>/<rank>" (its addresses, O(world) bytes)
        # under the prefix, one for each of its devices (0, 1, ...: GLOO_SOCKET_IFNAME may
        # name several interfaces).
        for device in range(_MAX_GLOO_DEVICES):
            if not meeting.delete_key(f"{device}/{rank}"):
                return

    try:
        group = dist.ProcessGroupGloo(meeting, rank, len(members), timedelta(seconds=timeout_s))
    except BaseException:
        with contextlib.suppress(Exception):  # the store itself may be what failed
            delete_keys()
        raise
    return group, delete_keys


# The most gloo devices (network interfaces) whose rendezvous keys a rank deletes.
_MAX_GLOO_DEVICES = 64


class EpochAgreement:
    """One epoch's steps: offered in order from the event loop, agreed on the thread.

    Invariant: steps are submitted in order, each once; after a 0 is submitted (the stream
    ended, or the epoch gave up) nothing more is; a job after the first 0 result skips its
    collective, so every rank runs collectives ``0 .. n`` for the same ``n``; a step that
    pairs another epoch or step of some rank fails on every rank of it. Offers come from the
    event loop; a give-up may come from another thread (a new epoch started from the
    consumer's), hence the lock around submitting.
    """

    def __init__(self, thread: _AgreementThread, lockstep: Lockstep, epoch: int) -> None:
        self.epoch = epoch
        self._thread = thread
        self._lockstep = lockstep
        self._lock = threading.Lock()
        self._submitted = 0
        self._open = True  # no 0 submitted yet
        self._ended = False  # on the thread: a step's minimum was 0
        self._verdicts: dict[int, concurrent.futures.Future[bool]] = {}
        #: The step whose minimum was 0 (known once its job ran): the agreed end.
        self.end: int | None = None
        #: Whether the end came from another rank that left the epoch early (a ``break``, a
        #: dropped iterator, a close) while this one had a batch or its stream's end there.
        self.left_elsewhere = False

    def offer(self, have: int, complete: bool) -> None:
        """This rank has ``have`` batches in this epoch so far (handed or known ready);
        ``complete``: its stream ended, no more will come."""
        with self._lock:
            while self._open and self._submitted < have:
                self._submit(1)
            if complete and self._open:
                self._submit(0)

    def give_up(self) -> None:
        """The epoch ends here on this rank (closed early): offer "no more" at the next step
        (-1, below a stream's end, 0: the others learn that a rank left, see ``left_elsewhere``)."""
        with self._lock:
            if self._open:
                self._submit(_LEFT)

    def verdict(self, step: int) -> concurrent.futures.Future[bool] | None:
        """Whether every rank has a batch ``step`` (None: the step was not offered yet).
        Forgotten once asked: the caller keeps it."""
        with self._lock:
            return self._verdicts.pop(step, None)

    async def wait(self, step: int, verdict: asyncio.Future[bool], since: float) -> None:
        """Wait for ``verdict`` (of ``step``, first awaited at ``since``, of
        :func:`time.monotonic`) until the lockstep's ``verdict_wait_s`` from then. Shielded: a
        cancelled consumer must not cancel the step's job (every rank runs every step's
        collective); its next ``__anext__`` waits again, within the same deadline.

        Raises:
            LoaderTimeoutError: (a ``RuntimeError`` and a ``TimeoutError``) no verdict by the
                deadline, naming the epoch, the step and the bound; the agreement is broken
                from then on.
        """
        bound = self._lockstep.verdict_wait_s
        remaining = since + bound - time.monotonic()
        try:
            async with asyncio.timeout(max(0.0, remaining)):
                await asyncio.shield(verdict)
        except TimeoutError:
            if verdict.done():
                return
            error = LoaderTimeoutError(
                f"equal steps: epoch {self.epoch}, step {step}: no verdict from this loader's "
                f"agreement thread within {bound:g} s (the agreement's bound, "
                f"{self._lockstep.timeout_s:g} s, plus a margin): whether every rank has a "
                "batch at this step is unknown, so none is handed over; the thread is stuck "
                "(in torch's rendezvous or all-reduce). Pass equal_steps=False to iterate "
                "without the agreement"
            )
            self._lockstep.break_with(error)
            raise error from None

    def _submit(self, have: int) -> None:
        step = self._submitted
        self._submitted += 1
        if have <= 0:
            self._open = False
        self._verdicts[step] = self._thread.submit(lambda: self._agree(step, have))

    def _agree(self, step: int, have: int) -> bool:
        lockstep = self._lockstep
        if self._ended and lockstep.broken is None:
            return False
        if lockstep.broken is not None:
            self._ended = True
            raise RuntimeError(
                f"equal steps: epoch {self.epoch}, step {step}: this loader's agreement broke "
                f"earlier ({lockstep.broken}); its ranks' steps can no longer be paired: make "
                "a new DataLoader on every rank, or pass equal_steps=False"
            ) from lockstep.broken
        started = time.monotonic()
        try:
            low = lockstep.collective([have, self.epoch, -self.epoch, step, -step])
        except Exception as exc:
            self._ended = True  # the group is broken: no later step of it waits in vain
            error = self._failure(step, exc, time.monotonic() - started)
            lockstep.break_with(error)
            raise error from exc
        except BaseException as exc:
            self._ended = True
            lockstep.break_with(exc)
            raise
        epochs, steps = (low[1], -low[2]), (low[3], -low[4])
        if epochs != (self.epoch, self.epoch) or steps != (step, step):
            self._ended = True
            error = RuntimeError(
                f"equal steps: this rank's epoch {self.epoch}, step {step} was paired with "
                f"epochs {_span(epochs)}, steps {_span(steps)} of the ranks: their iterations "
                "of this loader drifted apart (an extra iteration on some ranks, such as "
                "next(iter(loader)) to peek, or set_epoch() with other numbers; an earlier "
                "failure on one rank only). Iterate it alike on every rank (the same epochs, "
                "each read to its end or left at the same step), or pass equal_steps=False"
            )
            lockstep.break_with(error)
            raise error
        agreed = low[0] > 0
        if not agreed:
            self._ended = True
            self.end = step
            self.left_elsewhere = low[0] == _LEFT and have != _LEFT
        return agreed

    def _failure(self, step: int, exc: Exception, elapsed: float) -> RuntimeError:
        """The error of a step whose collective (or its group's rendezvous) raised: a timeout
        where the bound ran out, else what broke, with the time it took."""
        timeout_s = self._lockstep.timeout_s
        way_out = (
            "a loader that is not iterated on every rank of its group takes equal_steps=False "
            "(its rank's share, no agreement) or shard=False (the whole stream)"
        )
        where = f"equal steps: epoch {self.epoch}, step {step}"
        if elapsed >= timeout_s * _TIMED_OUT or isinstance(exc, TimeoutError):
            return RuntimeError(
                f"{where}: the other ranks did not join this rank's agreement within "
                f"{timeout_s:g} s (a loader iterated on some ranks only, a rank that died or "
                f"is far behind); {way_out}"
            )
        return RuntimeError(
            f"{where}: the agreement failed after {elapsed:.1f} s, before its {timeout_s:g} s "
            f"bound: {type(exc).__name__}: {exc} (a rank that closed this loader or left its "
            f"process group, a rank that died, the store gone); {way_out}"
        )


# What an epoch closed early offers at its next step: below 0 (its stream ended) and 1.
_LEFT = -1


# A collective that raised after this share of its bound timed out (torch's timeout errors
# have no type of their own across versions and stores: the time tells).
_TIMED_OUT = 0.9


def _span(values: tuple[int, int]) -> str:
    low, high = values
    return str(low) if low == high else f"{low} to {high}"
