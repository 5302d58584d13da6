"""The actors of a :class:`~aioloader.RayWorkers`: made, placed, watched, killed, replaced.

::

    slot k ── ActorRecord (one incarnation: handle, pid, node, the jobs it holds in order)
       │  died (Ray: RayActorError on a job)  or  killed (a batch passed its deadline)
       ▼
    the record is marked dead once, naming its culprit: the job it was running (the oldest it
    holds), or the one killed for its deadline; a new actor takes slot k (same worker id) and
    loads each loader's copy before its first job

The jobs of a dead record that were not its culprit were only queued behind it (or fetching
beside it): the runner sends them to another actor, untouched; the culprit's batch fails with
:class:`~aioloader.WorkerCrashedError`, re-run under ``max_retries`` by the epoch.

Sharp edges:
- Ray does not restart these actors (``max_restarts=0``): a restarted actor would come back
  without its dataset copy, and Ray would re-run the culprit's batch itself, outside the
  loader's retry budget. The fleet replaces them instead.
- "Running" is the oldest job an actor holds: its batches' CPU work runs one at a time, in
  the order they reach it. With an async dataset several batches fetch at once; the oldest is
  the one whose deadline runs.
- Actors are owned by the process that made them (not detached): if it dies, Ray ends them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._errors import WorkerInitError
from ._actor import LoaderActor

__all__ = [
    "ActorRecord",
    "Fleet",
    "Job",
    "SlotFigures",
    "actor_died",
    "result_lost",
    "succeeded",
]


#: Rounds of :meth:`Fleet.wait_ready` in which actors died while starting (a node lost
#: under them) before it gives up: each round replaces the dead and waits again.
MAX_START_ROUNDS = 3


@dataclass(slots=True, eq=False)
class Job:
    """One attempt at a batch on one actor."""

    record: ActorRecord
    reply: concurrent.futures.Future[Any] | None = None  # its result's, once sent


@dataclass(slots=True, eq=False)
class ActorRecord:
    """One incarnation of the actor of slot ``slot``."""

    slot: int
    handle: Any
    ready_ref: Any
    pid: int | None = None
    node: str | None = None
    host: str | None = None
    # Its /dev/shm's key (``_wire.shm_key``): the same as this process's, its batches may come
    # back in this process's shared memory. Cleared if it could not map a slot after all.
    shm_key: str | None = None
    jobs: list[Job] = field(default_factory=list)  # oldest first; a done job leaves
    loaded: dict[tuple[int, int], asyncio.Future[None]] = field(default_factory=dict)
    dead: bool = False
    culprit: Job | None = None
    ready_task: asyncio.Future[None] | None = None

    def describe(self) -> str:
        pid = "?" if self.pid is None else self.pid
        node = "?" if self.node is None else self.node[:12]
        return f"Ray actor {self.slot} (pid {pid}, node {node}, host {self.host or '?'})"


def actor_died(exc: BaseException) -> bool:
    """Whether ``exc`` (from a job's reference) says its actor is gone, or took the job's
    result with it (:func:`result_lost`)."""
    from ray import exceptions

    return result_lost(exc) or isinstance(
        exc, exceptions.RayActorError | exceptions.WorkerCrashedError
    )


def result_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says a finished job's result is gone (``ObjectLostError`` and its kinds:
    ``OwnerDiedError``, ``ObjectReconstructionFailedError``...): the object store that held it
    went with its node. An actor's result cannot be made again by Ray (its actor is not
    restarted), so the job is the actor's death's, re-run under ``max_retries``."""
    from ray import exceptions

    return isinstance(exc, exceptions.ObjectLostError)


@dataclass(slots=True)
class SlotFigures:
    """What one slot's actors did, all incarnations together (for all loaders, or for one).

    ``busy_s`` never exceeds the wall time: over each stretch of time in which the slot had a
    job in progress (:meth:`started` to the last :meth:`ended`), it counts the actor's reading
    and collating time of the stretch's batches, but no more than the stretch lasted. The
    batches of an async dataset fetch together on one actor, and their times summed counted
    the same seconds several times (a busy share over 100%); batches made one after another
    count in full, however late their results reach the training process."""

    batches: int = 0
    busy_s: float = 0.0
    restarts: int = 0
    bytes: int = 0
    in_progress: int = 0  # jobs sent and not over
    busy_since: float = 0.0  # when the current stretch began (in_progress went from 0 to 1)
    stretch_work: float = 0.0  # the actor time of the current stretch's batches
    before_s: float = 0.0  # busy_s of the stretches before the current one

    def started(self, now: float) -> None:
        """A job was sent to the slot's actor at ``now``."""
        if self.in_progress == 0:
            self.before_s, self.busy_since, self.stretch_work = self.busy_s, now, 0.0
        self.in_progress += 1

    def ended(self, now: float) -> float:
        """A job of the slot's is over at ``now``: how long its stretch has lasted, which
        bounds what the stretch's batches count (:meth:`add_batch`)."""
        self.in_progress = max(0, self.in_progress - 1)
        return max(0.0, now - self.busy_since)

    def add_batch(self, busy: float, lasted: float) -> None:
        """Count a made batch that took ``busy`` seconds of actor time; ``lasted`` from
        :meth:`ended`."""
        self.batches += 1
        self.stretch_work += busy
        self.busy_s = self.before_s + min(self.stretch_work, lasted)


class Fleet:
    """``num_actors`` actor slots with the options each actor is made with.

    Args:
        num_actors: how many actors (worker ids ``0 .. num_actors - 1``).
        options: Ray's actor options (``num_cpus``, ``resources``, ...).
        start_timeout: seconds an actor may take to be placed and started.
    """

    def __init__(self, num_actors: int, options: Mapping[str, Any], start_timeout: float) -> None:
        self.num_actors = num_actors
        self.options = dict(options)
        self.start_timeout = start_timeout
        self.records: list[ActorRecord | None] = [None] * num_actors
        self.figures = [SlotFigures() for _ in range(num_actors)]
        self.restarts = 0
        self.closed = False
        self.lock = threading.Lock()
        self._cls: Any = None

    # -- making and watching actors --------------------------------------------------------

    def _new(self, slot: int) -> ActorRecord:
        import ray

        if self._cls is None:
            self._cls = ray.remote(LoaderActor)
        handle = self._cls.options(max_restarts=0, max_task_retries=0, **self.options).remote(
            slot, self.num_actors
        )
        return ActorRecord(slot, handle, handle.ready.remote())

    def start_all(self) -> None:
        """Ask Ray for every actor not made yet (returns at once: placement runs in Ray)."""
        with self.lock:
            if self.closed:
                raise RuntimeError("these RayWorkers are closed")
            for slot, record in enumerate(self.records):
                if record is None:
                    self.records[slot] = self._new(slot)

    def wait_ready(self) -> None:
        """Block until every actor runs (placed, started, imported), or the start deadline.
        One that died on the way (its node lost) is replaced and waited for in turn: it
        returns after a round without deaths, and gives up after :data:`MAX_START_ROUNDS`
        rounds with deaths.

        Raises:
            WorkerInitError: an actor not up by the deadline, or dying round after round.
        """
        import ray

        deadline = time.monotonic() + self.start_timeout
        rounds_with_deaths = 0
        while rounds_with_deaths < MAX_START_ROUNDS:
            self.start_all()
            with self.lock:
                records = [r for r in self.records if r is not None and r.pid is None]
            if not records:
                return
            refs = [r.ready_ref for r in records]
            left = max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=left)
            deaths = 0
            for record in records:
                if record.ready_ref not in done:
                    raise self._not_started(record)
                try:
                    record.pid, record.node, record.host, record.shm_key = ray.get(record.ready_ref)
                except Exception as exc:
                    if not actor_died(exc):
                        raise
                    self.died(record)  # its replacement is waited for in the next round
                    deaths += 1
            if not deaths:
                return  # every actor of this round is up, and none before it was missing
            rounds_with_deaths += 1
        raise WorkerInitError(
            f"the actors of these RayWorkers died while starting, {MAX_START_ROUNDS} rounds "
            f"in a row; they ask for {self.options}"
        )

    async def ready(self, record: ActorRecord) -> None:
        """Wait (on the loop) until ``record``'s actor runs; its pid and node are known then.

        Raises:
            WorkerInitError: it was not placed and started within the start deadline.
            RayActorError: it died while starting.
        """
        if record.pid is not None:
            return
        task = record.ready_task
        if task is None or task.get_loop() is not asyncio.get_running_loop():
            task = record.ready_task = asyncio.ensure_future(self._ready(record))
            task.add_done_callback(_retrieve)
        await asyncio.shield(task)

    async def _ready(self, record: ActorRecord) -> None:
        try:
            async with asyncio.timeout(self.start_timeout):
                record.pid, record.node, record.host, record.shm_key = await record.ready_ref
        except TimeoutError:
            # Not kept: the next job waits for it again, with a start deadline of its own (a
            # node with room may have come meanwhile); a kept failure failed every later job
            # of this slot at once, for ever.
            if record.ready_task is asyncio.current_task():
                record.ready_task = None
            raise self._not_started(record) from None

    def _not_started(self, record: ActorRecord) -> WorkerInitError:
        free = _free()
        return WorkerInitError(
            f"Ray actor {record.slot} was not placed and started within start_timeout="
            f"{self.start_timeout} s; it asks for {self.options}, and the cluster has "
            f"{free} free. Add nodes with those resources, or ask for fewer actors or less "
            "per actor"
        )

    def pick(self) -> ActorRecord:
        """The live actor holding the fewest jobs (the lowest slot among equals), among those
        that run if any does: a batch does not wait for a replacement to be placed and
        started while another actor is up."""
        with self.lock:
            if self.closed:
                raise RuntimeError("these RayWorkers are closed: their actors are gone")
            live = [r for r in self.records if r is not None and not r.dead]
            if len(live) < self.num_actors:
                for slot, record in enumerate(self.records):
                    if record is None:
                        self.records[slot] = self._new(slot)
                live = [r for r in self.records if r is not None and not r.dead]
            up = [r for r in live if r.pid is not None] or live
            return min(up, key=lambda r: (len(r.jobs), r.slot))

    async def first_up(self, record: ActorRecord) -> ActorRecord:
        """For a map batch that :meth:`pick` gave ``record`` while no actor was up: wait until
        whichever live actor comes up first, then pick again (it prefers actors that are up),
        so the batch never waits on one unplaced replacement while another comes up. One that
        fails to come up ends the wait: the caller waits on its pick, and meets the failure
        there. ``record`` as it is when it is the only one on its way up."""
        while record.pid is None and not record.dead:
            waiting = [r for r in self.live() if r.pid is None]
            if record not in waiting or len(waiting) < 2:
                return record
            tasks = [asyncio.ensure_future(self.ready(r)) for r in waiting]
            for task in tasks:
                task.add_done_callback(_retrieve)
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()  # (each actor's own wait goes on, shielded in ready())
            if not any(succeeded(task) for task in done):
                return record
            record = self.pick()
        return record

    def slot(self, slot: int) -> ActorRecord:
        """The actor of ``slot`` now (made if it was not): a stream's reader is one slot."""
        with self.lock:
            if self.closed:
                raise RuntimeError("these RayWorkers are closed: their actors are gone")
            record = self.records[slot]
            if record is None:
                record = self.records[slot] = self._new(slot)
            return record

    def unplaced(self, record: ActorRecord) -> str:
        """Why ``record``'s actor is not up yet, for a batch that waited for it past its
        deadline: what it asks for against what the cluster's nodes have free (an actor
        needs it all on one node)."""
        asked = {"CPU": float(self.options.get("num_cpus", 1)), **self.options.get("resources", {})}
        if self.options.get("num_gpus"):
            asked["GPU"] = float(self.options["num_gpus"])
        wanted = {name: amount for name, amount in asked.items() if amount > 0}
        nodes = _free_per_node()
        free = _free()
        which = "the replacement actor" if self.figures[record.slot].restarts else "the actor"
        fits = nodes is None or any(
            all(node.get(name, 0.0) >= amount for name, amount in wanted.items())
            for node in nodes.values()
        )
        if fits:
            return (
                f"{which} {record.slot} is not up yet: it asks for {asked}, and a node "
                f"reports that free ({free} in all): its process is still starting, or a "
                "node just lost is still counted (Ray notices a lost node only after its "
                "health checks fail). Give the batch a larger timeout"
            )
        assert nodes is not None
        short = [
            name
            for name, amount in wanted.items()
            if all(node.get(name, 0.0) < amount for node in nodes.values())
        ]
        if short == ["CPU"]:
            what = "no CPU"
        elif short:
            what = f"not enough {' and '.join(short)}"
        else:
            what = "no node with all it asks for"
        return (
            f"{what} free to place {which} {record.slot}: it asks for {asked} on one node, "
            f"and the cluster has {free} free in all (the actors of other jobs hold the "
            "rest, or the node that had it was lost). Add nodes with those resources, ask "
            "for less per actor (num_cpus=0 places it beside others), or give the batch a "
            "larger timeout"
        )

    def live(self) -> list[ActorRecord]:
        """The actors made and not dead."""
        with self.lock:
            return [r for r in self.records if r is not None and not r.dead]

    def finished(self, job: Job) -> None:
        """``job``'s result arrived (not an actor's death): it leaves its actor's queue."""
        with self.lock:
            if job in job.record.jobs:
                job.record.jobs.remove(job)

    def died(self, record: ActorRecord) -> None:
        """``record``'s actor is gone (Ray said so): blame the job it was running, replace it."""
        with self.lock:
            if record.dead:
                return
            record.dead = True
            record.culprit = record.jobs[0] if record.jobs else None
            self._replace(record)

    def kill(self, record: ActorRecord, culprit: Job) -> int | None:
        """Kill ``record``'s actor (it hung on ``culprit``) and replace it; returns its pid."""
        with self.lock:
            if record.dead:
                return None
            record.dead = True
            record.culprit = culprit
            self._replace(record)
        return record.pid

    def _replace(self, record: ActorRecord) -> None:
        import ray

        ray.kill(record.handle, no_restart=True)  # a hung one, or one half gone
        if self.closed or self.records[record.slot] is not record:
            return
        self.restarts += 1
        self.figures[record.slot].restarts += 1
        self.records[record.slot] = self._new(record.slot)

    def pids(self) -> tuple[int, ...]:
        return tuple(r.pid for r in self.records if r is not None and r.pid is not None)

    def drop(self, copy_id: int) -> None:
        """Every live actor forgets ``copy_id`` (a loader was closed); nothing waited for."""
        with self.lock:
            records = [r for r in self.records if r is not None and not r.dead]
        for record in records:
            record.handle.drop.remote(copy_id)
            for key in [k for k in record.loaded if k[0] == copy_id]:
                del record.loaded[key]

    def close(self) -> None:
        """Kill every actor. Idempotent."""
        import ray

        with self.lock:
            self.closed = True
            records = list(self.records)
        for slot, record in enumerate(records):
            if record is not None and ray.is_initialized():
                ray.kill(record.handle, no_restart=True)
            with self.lock:  # forgotten once killed: a close interrupted here kills the rest
                if self.records[slot] is record:
                    self.records[slot] = None


def _free() -> dict[str, float] | str:
    """What the cluster has free now (``ray.available_resources()``), or ``"unknown"``."""
    import ray

    try:
        return dict(ray.available_resources())  # type: ignore[no-untyped-call]
    except Exception:  # pragma: no cover - the cluster went away
        return "unknown"


def _free_per_node() -> dict[str, dict[str, float]] | None:
    """What each live node has free, or None where Ray does not say (a private function of
    Ray's, read here only: its public ``available_resources`` sums the nodes, and an actor
    needs what it asks for on one node)."""
    try:
        from ray._private import state

        per_node = state.available_resources_per_node()  # type: ignore[no-untyped-call]
        return {str(node): dict(free) for node, free in per_node.items()}
    except Exception:  # another Ray release, or the cluster went away
        return None


def succeeded(future: asyncio.Future[Any]) -> bool:
    """Whether ``future`` is done with a result (not cancelled, no exception)."""
    return future.done() and not future.cancelled() and future.exception() is None


def _retrieve(future: asyncio.Future[None]) -> None:
    """Mark ``future``'s exception as seen (it is shielded: its awaiting task may be gone)."""
    if not future.cancelled():
        future.exception()


_ids = itertools.count(1)


def next_copy_id() -> int:
    """A copy id no loader of this process used (each loader's copy in the actors)."""
    return next(_ids)
