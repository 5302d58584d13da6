"""Equal steps on every rank: the ranks agree, step by step, on where a stream's epoch ends.

A stream's share has no length until it ends, so ranks of one job may have different numbers
of batches; the rank that runs out stops calling the training step's collectives and the
others wait for it forever. Under ``equal_steps`` the ranks agree on the epoch's end instead::

    consumer (Epoch, event loop)            agreement thread (one per loader)
      a batch ready, or the stream ended ──▶ job(step, have) ── all_reduce(MIN) over a gloo
      (offered as soon as it is known,        (in step order,       group of the sharing
       a few batches ahead of the consumer)    one at a time)       ranks, made at the first job
      before handing batch ``step`` over ◀── verdict: every rank has a batch ``step``?

Each rank offers step ``s`` as soon as it knows whether it has an ``s``-th batch (the batch
arrived in the reorder buffer, or its stream ended before it), and the thread runs the
all-reduces one after the other, ahead of the consumer as far as prefetching allows: the
consumer waits for a verdict only when the thread has not got there yet. The first step whose
minimum is 0 ends the epoch on every rank; jobs queued behind it skip their collective. So
every rank runs the same collectives, ``0 .. n``, and ends at the same step ``n``, the
shortest share; an epoch closed early (a ``break``) offers 0 at its next step, which ends the
others' epoch there too.

Why a thread and a group of its own: a blocking collective must not run on the event loop,
and the training step's collectives (DDP's all-reduce) run on the default group from the
training thread: ops of two threads on one group would be matched in whatever order each rank
issued them. The group (gloo, so any default backend works) is made by the thread at the
first job, with ``use_local_synchronization`` over the sharing ranks: a collective of theirs,
never at construction, and only for a loader that shards by the group (every rank builds it:
a loader made on some ranks only passes ``shard=False`` or ``equal_steps=False``). torch names
a group by the order in which each rank makes its groups, so groups the user makes from another
thread while the first epoch starts could pair wrongly: they are made before, in a setup.

No wait is unbounded: the group's creation (torch's store-based barrier and gloo's connection
to each peer, both bounded by ``new_group``'s ``timeout`` in torch 2.x) and each step's
all-reduce give up after :data:`AGREEMENT_TIMEOUT_S`, and the epoch fails with a
``RuntimeError`` naming the epoch, the step and the way out (``equal_steps=False`` or
``shard=False``), its cause torch's error. A loader iterated on rank 0 only (an evaluation
loader built without ``shard=False``) so fails within a minute instead of hanging.

What each rank read past the agreed end (its ``leftover``) is counted and logged; with
``leftover='carry'`` it is handed first in the next epoch (a step of that epoch; at most
``prefetch`` batches are carried, the rest counted as dropped), with
``'drop'`` it is released. What the rank had not read yet of its share is not read in this
epoch: the log says so.

The one thread is a daemon: a collective waiting for a rank that died must not hold the
interpreter at its exit (the bound ends the wait anyway). Closing (the loader's ``close()``,
or its finalizer when it is collected unclosed, which does not wait) gives up the open epoch,
releases the carried batches, destroys the group after the last job, and ends the thread; the
thread forgets each job once it ran, so an idle thread holds no epoch or batch.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import queue
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .._validate import boolean

__all__ = [
    "AGREEMENT_TIMEOUT_S",
    "LEFTOVER_POLICIES",
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
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((job, future))
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

    def close(self, wait_s: float) -> None:
        """Stop after the jobs already queued; wait up to ``wait_s`` for that."""
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(wait_s)


class Lockstep:
    """The agreement of one loader's ranks, across its epochs (see the module docstring).

    Args:
        members: the global ranks that share the data (the default group's, or the
            data-parallel group's); the agreement runs over them.
        leftover: ``'carry'`` or ``'drop'``.
        timeout_s: how long a rank waits for the others in one agreement.
        all_have: the collective, run on the thread: the minimum of its argument over the
            members (default: an all-reduce over a gloo group of theirs, made at the first
            call). A seam for tests of the sequencing.
    """

    def __init__(
        self,
        members: tuple[int, ...],
        leftover: str,
        timeout_s: float | None = None,
        all_have: Callable[[int], int] | None = None,
    ) -> None:
        self.members = members
        self._collective = all_have if all_have is not None else self._all_have
        self.leftover = leftover
        self._timeout_s = AGREEMENT_TIMEOUT_S if timeout_s is None else timeout_s
        self._thread: _AgreementThread | None = None
        self._group: Any = None
        self._lock = threading.Lock()
        #: Batches read past the agreed end of the last epoch, to be handed first in the next
        #: (``leftover='carry'``): each ``(batch, samples, nbytes)``.
        self.carried: list[tuple[Any, int, int]] = []
        self._current: EpochAgreement | None = None

    def begin(self, epoch: int) -> EpochAgreement:
        """The agreement of epoch ``epoch``. An epoch still open gives up first (one epoch's
        steps at a time: two interleaved would pair steps differently on each rank); the
        loader refuses to begin one while another is open, so this is a backstop."""
        with self._lock:
            if self._thread is None:
                self._thread = _AgreementThread(f"aioloader-equal-steps-{epoch}")
            previous, self._current = self._current, None
        if previous is not None:
            previous.give_up()
        agreement = EpochAgreement(self._thread, self._collective, epoch, self._timeout_s)
        self._current = agreement
        return agreement

    def _all_have(self, have: int) -> int:
        """On the thread: the minimum of ``have`` over the members (the group made first)."""
        dist: Any = sys.modules["torch.distributed"]
        torch: Any = sys.modules["torch"]
        if self._group is None:
            self._group = dist.new_group(
                ranks=list(self.members),
                backend="gloo",
                timeout=timedelta(seconds=self._timeout_s),
                use_local_synchronization=True,
            )
        flag = torch.tensor([have], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return int(flag.item())

    def close(self, wait_s: float | None = None) -> None:
        """Give up the open epoch (the others end at its next step), release the carried
        batches, and stop the thread once its queued jobs ran, destroying the group last.
        Waits up to ``wait_s`` for the thread (a job may wait for the other ranks): a loader's
        ``close()`` waits briefly, its finalizer (the garbage collector's thread) not at all.
        Idempotent."""
        current, self._current = self._current, None
        if current is not None:
            current.give_up()
        self.carried.clear()
        thread, self._thread = self._thread, None
        if thread is not None:
            if self._group is not None:
                group, self._group = self._group, None
                thread.submit(functools.partial(_destroy_group, group))
            thread.close(wait_s=_CLOSE_WAIT_S if wait_s is None else wait_s)

    def finalizer(self) -> Callable[[], None]:
        """What closes this lockstep without waiting and without holding its owner (a
        loader's finalizer calls it)."""
        return functools.partial(self.close, 0.0)


# How long closing a loader waits for its agreement thread to finish the jobs it has: the
# other ranks close too and answer in milliseconds; a rank that does not is left to the daemon.
_CLOSE_WAIT_S = 5.0


def _destroy_group(group: Any) -> None:
    """On the thread, after the epoch's last collective: the group's sockets are released.
    A job that is already gone (the default group destroyed first) has nothing to release."""
    dist: Any = sys.modules["torch.distributed"]
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)


class EpochAgreement:
    """One epoch's steps: offered in order from the event loop, agreed on the thread.

    Invariant: steps are submitted in order, each once; after a 0 is submitted (the stream
    ended, or the epoch gave up) nothing more is; a job after the first 0 result skips its
    collective, so every rank runs collectives ``0 .. n`` for the same ``n``. Offers come from
    the event loop; a give-up may come from another thread (a new epoch started from the
    consumer's), hence the lock around submitting.
    """

    def __init__(
        self,
        thread: _AgreementThread,
        all_have: Callable[[int], int],
        epoch: int,
        timeout_s: float = AGREEMENT_TIMEOUT_S,
    ) -> None:
        self.epoch = epoch
        self._timeout_s = timeout_s
        self._thread = thread
        self._all_have = all_have
        self._lock = threading.Lock()
        self._submitted = 0
        self._open = True  # no 0 submitted yet
        self._ended = False  # on the thread: a step's minimum was 0
        self._verdicts: dict[int, concurrent.futures.Future[bool]] = {}
        #: The step whose minimum was 0 (known once its job ran): the agreed end.
        self.end: int | None = None

    def offer(self, have: int, complete: bool) -> None:
        """This rank has ``have`` batches in this epoch so far (handed or known ready);
        ``complete``: its stream ended, no more will come."""
        with self._lock:
            while self._open and self._submitted < have:
                self._submit(1)
            if complete and self._open:
                self._submit(0)

    def give_up(self) -> None:
        """The epoch ends here on this rank (closed early): offer 0 at the next step."""
        with self._lock:
            if self._open:
                self._submit(0)

    def verdict(self, step: int) -> concurrent.futures.Future[bool] | None:
        """Whether every rank has a batch ``step`` (None: the step was not offered yet).
        Forgotten once asked: the caller keeps it."""
        with self._lock:
            return self._verdicts.pop(step, None)

    def _submit(self, have: int) -> None:
        step = self._submitted
        self._submitted += 1
        if not have:
            self._open = False
        self._verdicts[step] = self._thread.submit(lambda: self._agree(step, have))

    def _agree(self, step: int, have: int) -> bool:
        if self._ended:
            return False
        try:
            agreed = self._all_have(have) > 0
        except Exception as exc:
            self._ended = True  # the group is broken: no later step of it waits in vain
            raise RuntimeError(
                f"equal steps: epoch {self.epoch}, step {step}: the other ranks did not join "
                f"this rank's agreement within {self._timeout_s:g} s (a loader iterated on "
                "some ranks only, a rank that died or is far behind); a loader that is not "
                "iterated on every rank of its group takes equal_steps=False (its rank's share, "
                "no agreement) or shard=False (the whole stream)"
            ) from exc
        except BaseException:
            self._ended = True
            raise
        if not agreed:
            self._ended = True
            self.end = step
        return agreed
