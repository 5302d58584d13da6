"""RayRunner: the epoch's :class:`~aioloader._types.Runner` over Ray actors.

::

    epoch ── BatchRequest ──▶ start_make ──▶ _run:
        pick the least-loaded live actor (Fleet.pick)
        its copy loaded? else: the payload, put once per copy (ray.put), ──▶ actor.load
        an actor on this machine, a batch's size known: a slot of the pool (Receiver.lease)
        actor.make.remote(copy_id, request, slot) ──▶ ObjectRef, awaited on this loop
            Made ──▶ opened (tensors back, or views of the slot, see _wire) ──▶ epoch
            Failed(exc) ──▶ raise exc (the user's own type, annotated)
            the actor died ──▶ the batch it was running: WorkerCrashedError (the epoch re-runs
                               it under max_retries); one only queued there: sent to another
                               actor at once, as it was never made
            its result lost with its node (ObjectLostError) ──▶ the actor's death for that
                               batch too: WorkerCrashedError, re-run under max_retries

    epoch ── StreamRequest(stream k) ──▶ pull: always actor k, the one whose copy holds the
        stream; sent in the order asked, each with its turn (LoaderActor.pull keeps it); k's
        actor dead: this pull and those after it fail (WorkerCrashedError), never sent to
        the replacement, which would read the stream afresh (samples twice)

Ordering, deadlines, retries, the skip budget, resume state and statistics stay above, in the
epoch, as for local workers; this module only routes. A batch waiting for its actor to be
placed and started (a replacement, when no other actor is up) counts as running: ``timeout``
bounds that wait too, and the error says what the actor asks for and what is free. The
deadline asks :meth:`is_running` (the oldest job an actor holds, see ``_fleet``) and
:meth:`on_deadline` kills that actor.

The dataset copy travels once per copy: pickled off the loop at the first job after
:meth:`load`, put into the object store once, and loaded by each actor from there before its
first job of that copy (a replacement actor loads it too). A batch never carries it.

Cancellation edges: cancelling the task that awaits a job leaves the job on its actor (its
result is dropped when it comes; Ray frees it); the job stays the actor's oldest until then,
so a deadline still sees what the actor is busy with. Its slot goes back when the reply comes
(on Ray's thread). A slot whose actor is reported dead is never leased again (``_forget``):
Ray says so before the process is gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _shm
from .._batch import MAX_OPEN_STREAMS
from .._epoch import nbytes_of
from .._errors import WorkerCrashedError, WorkerInitError
from .._log import workers_log
from .._stats import WorkerFigures
from .._threads import off_loop
from .._types import BatchRequest, InlineMaking, Made, StreamRequest
from .._workers import Parcel, Receiver, batch_nbytes
from ._actor import Failed
from ._fleet import ActorRecord, Fleet, Job, SlotFigures, actor_died, result_lost, succeeded
from ._wire import opened, read_only, shm_key

__all__ = ["MAX_START_DEATHS", "RayRunner"]

#: Deaths of a slot's actor while it loads a copy, one after another, before the batch fails
#: with WorkerInitError (an actor that cannot even load its copy would die for ever).
MAX_START_DEATHS = 3


class RayRunner:
    """One loader's jobs on a :class:`Fleet` of actors.

    Args:
        fleet: the actors (a :class:`~aioloader.RayWorkers`'s).
        copy_id: this loader's dataset copy in the actors.
        on_close: called once when the runner is closed (the workers forget the loader).
        slots: the pool's shared memory, for the batches of actors on this machine (None:
            every batch through the object store).
        prefetch: the loader's batches in flight (the share of ``slots`` each may take).
    """

    inline: InlineMaking | None = None  # every batch is an actor's
    #: An async dataset's items are fetched by the actors, not by the training process's
    #: loop (``aioloader._epoch``'s producer reads this).
    fetches = True

    def __init__(
        self,
        fleet: Fleet,
        copy_id: int,
        on_close: Callable[[], None],
        *,
        slots: _shm.SlotPool | None = None,
        prefetch: int = 1,
    ) -> None:
        self._fleet = fleet
        self._slots = slots
        self._receiver = (
            None if slots is None else Receiver(slots, prefetch, route="Ray's object store")
        )
        self._shm_key = shm_key()
        self.copy_id = copy_id
        self._on_close: Callable[[], None] | None = on_close
        self._make_payload: Callable[[], bytes] | None = None
        self._version = 0  # of the copy: each load() makes a new one
        self._epoch = 0
        self._seed = 0
        self._put: asyncio.Future[Any] | None = None  # the copy's ObjectRef, once put
        self._attempts: dict[int, Job] = {}  # id(request) -> its attempt under way
        # id(request) -> the actor its attempt waits for (placed, started, loading the copy)
        self._placing: dict[int, ActorRecord] = {}
        self._causes: dict[int, str] = {}  # id(request) -> why its deadline passed (unplaced)
        # (stream, StreamRequest.key) -> that reading of actor ``stream``'s stream; oldest first
        self._readings: dict[tuple[int, tuple[int, int]], _Reading] = {}
        self._figures = [SlotFigures() for _ in range(fleet.num_actors)]  # this loader's

    @property
    def streams(self) -> int:
        return self._fleet.num_actors

    @property
    def restarts(self) -> int:
        """Actors replaced after a death or a kill."""
        return self._fleet.restarts

    @property
    def shm_fallbacks(self) -> int:
        """Batches of actors on this machine that came inline for want of a slot."""
        return 0 if self._receiver is None else self._receiver.fallbacks

    def start(self) -> None:
        """Make every actor and wait until each runs (blocking)."""
        self._fleet.wait_ready()

    def worker_pids(self) -> tuple[int, ...]:
        return self._fleet.pids()

    def shm_stats(self) -> _shm.ShmStats | None:
        return None if self._slots is None else self._slots.stats()

    @property
    def has_copy(self) -> bool:
        return self._make_payload is not None

    def load(self, make: Callable[[], Any], epoch: int, seed: int) -> None:
        """A new dataset copy for ``epoch``: pickled and put at the first job that needs it."""
        self._make_payload = make
        self._version += 1
        self._epoch, self._seed = epoch, seed
        self._put = None

    def begin_epoch(self) -> None:
        """Nothing: the actors' state travels with their dataset copy (:meth:`load`)."""

    def start_make(self, request: BatchRequest) -> asyncio.Future[Made]:
        return asyncio.ensure_future(self._run(request))

    def is_running(self, request: BatchRequest | StreamRequest) -> bool:
        """Whether an actor works on the batch of ``request`` now, or the batch waits for its
        own actor to be placed and started (a replacement; no other actor was up): that wait
        is the batch's time too, so ``timeout`` bounds it."""
        placing = self._placing.get(id(request))
        if placing is not None:
            return placing.pid is None and not placing.dead
        job = self._attempts.get(id(request))
        if job is None or job.record.dead:
            return False
        jobs = job.record.jobs
        return bool(jobs) and jobs[0] is job

    def on_deadline(self, request: BatchRequest | StreamRequest) -> int | None:
        """Kill the actor running the batch of ``request`` (it hung); returns its pid. An actor
        not placed yet is left to come up (killing it would not place another sooner): the
        cause is kept for :meth:`deadline_cause`."""
        placing = self._placing.get(id(request))
        if placing is not None and placing.pid is None:
            self._causes[id(request)] = self._fleet.unplaced(placing)
            return None
        job = self._attempts.get(id(request))
        if job is None or not self.is_running(request):
            return None
        record = job.record
        pid = self._fleet.kill(record, job)
        workers_log.warning(
            "%s killed and replaced: batch %d passed its deadline",
            record.describe(),
            request.batch_id,
        )
        return pid

    def deadline_cause(self, request: BatchRequest | StreamRequest) -> str | None:
        """Why the batch of ``request`` passed its deadline, where the runner knows better than
        "its worker hung" (its actor could not be placed); asked once, after
        :meth:`on_deadline`."""
        return self._causes.pop(id(request), None)

    def stop_if_idle(self) -> bool:
        return False  # the actors are closed off the loop

    def close(self) -> None:
        """The loader is closed: the actors forget its copy; they stay for other loaders."""
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    # -- one job ---------------------------------------------------------------------------

    async def _run(self, request: BatchRequest) -> Made:
        while True:
            record = await self._placed(self._fleet.pick, request, reopen=True)
            slot = await self._lease(record)
            job, awaited = self._submit(record, request, slot, "make", request)
            try:
                return await self._result(record, job, awaited, request, slot)
            except _Innocent:
                continue  # only queued on a dead actor: never made, so made elsewhere now

    async def pull(self, request: StreamRequest, stream: int) -> Made:
        """Make the next batch of actor ``stream``'s stream (``Made.batch is END`` at its end).

        A stream's batch is never sent to another actor, nor to the replacement of a dead one:
        only the actor that opened the stream knows where it stands (as with worker
        processes, the epoch ends that reader; a resumed epoch continues it exactly)."""
        reading = self._reading(request, stream)
        previous, sent = reading.sent, asyncio.get_running_loop().create_future()
        reading.sent = sent
        try:
            if previous is not None:
                await asyncio.shield(previous)  # sent in the order the epoch asked
            if reading.record is None:  # the opening pull: the slot's actor, as it is now
                record = await self._placed(lambda: self._fleet.slot(stream), request, True)
                reading.record = record
            else:
                record = reading.record
                if record.dead:
                    raise self._lost_stream(record, request)
                await self._placed(lambda: record, request, reopen=False)
            slot = await self._lease(record)
            job, awaited = self._submit(record, request, slot, "pull", request, reading.turns)
            reading.turns += 1
        finally:
            if not sent.done():
                sent.set_result(None)
        try:
            return await self._result(record, job, awaited, request, slot)
        except _Innocent:
            raise self._lost_stream(record, request) from None

    def _reading(self, request: StreamRequest, stream: int) -> _Reading:
        key = (stream, request.key)
        reading = self._readings.get(key)
        if reading is None or request.opens:
            self._readings.pop(key, None)
            while len(self._readings) >= MAX_OPEN_STREAMS * self._fleet.num_actors:
                del self._readings[next(iter(self._readings))]
            reading = self._readings[key] = _Reading()
        return reading

    def _lost_stream(self, record: ActorRecord, request: StreamRequest) -> WorkerCrashedError:
        return WorkerCrashedError(
            f"{record.describe()} died, and with it where its stream stood: batch "
            f"{request.batch_id}, queued behind its batch, is lost (a stream's batch is never "
            "read again: its reader ends for this epoch; a state_dict() taken now resumes it)",
            pid=record.pid,
        )

    async def _placed(
        self, choose: Callable[[], ActorRecord], request: Any, reopen: bool
    ) -> ActorRecord:
        """An actor from ``choose``, placed, started and holding this loader's copy. The wait
        for a replacement's placement is the batch's own time (see :meth:`is_running`); an
        actor that dies meanwhile is replaced and, if ``reopen``, ``choose`` asked again.

        With ``reopen`` (a map batch, which any actor makes), a batch whose chosen actor is not
        up waits for whichever live actor comes up first and chooses again: it never waits on
        one unplaced replacement while another comes up. (A stream's pull stays on its slot.)"""
        self._causes.pop(id(request), None)  # an earlier attempt's, which was re-run
        start_deaths = 0
        while True:
            record = choose()
            self._placing[id(request)] = record
            try:
                if reopen and record.pid is None:
                    record = await self._fleet.first_up(record)
                    self._placing[id(request)] = record
                await self._loaded(record)
            except Exception as exc:
                if not actor_died(exc):
                    raise
                self._fleet.died(record)
                start_deaths += 1
                if not reopen or start_deaths >= MAX_START_DEATHS:
                    raise WorkerInitError(
                        f"{record.describe()} died {start_deaths} time(s) while loading the "
                        f"dataset copy: {exc}"
                    ) from exc
                continue
            finally:
                if self._placing.get(id(request)) is record:
                    del self._placing[id(request)]
            return record

    async def _lease(self, record: ActorRecord) -> _shm.Slot | None:
        """A slot of this process's shared memory for ``record``'s next batch, or None (the
        object store): the actor maps this machine's ``/dev/shm``, and a batch came back
        already (its size known; the first batches travel through the object store)."""
        receiver = self._receiver
        if receiver is None or not receiver.sized or record.shm_key is None:
            return None
        if record.shm_key != self._shm_key:
            return None
        slot = await receiver.lease()
        return slot if isinstance(slot, _shm.Slot) else None  # sized: never an OwnSlot

    def _release(self, slot: _shm.Slot | None) -> None:
        """``slot`` back to the pool: its actor answered (writes no more)."""
        if slot is not None and self._slots is not None:
            self._slots.release(slot)

    def _forget(self, slot: _shm.Slot | None) -> None:
        """``slot`` out of the pool for good (unlinked, never leased again): its actor may
        write into it still, though nothing will say when it is done: reported dead, which Ray
        does before the process is gone (a killed actor's collating thread may write on for
        milliseconds), or sent a call whose reply cannot be followed. Its pages go with the
        last mapping."""
        if slot is not None and self._slots is not None:
            self._slots.forget(slot)

    def _let_go(self, slot: _shm.Slot | None, error: BaseException | None) -> None:
        """``slot`` after its job's reply: released, or forgotten if the reply says its actor
        died (see :meth:`_forget`)."""
        if error is not None and actor_died(error):
            self._forget(slot)
        else:
            self._release(slot)

    def _release_when_done(self, job: Job, slot: _shm.Slot) -> None:
        """``slot`` back to the pool once ``job``'s actor answered or died, whichever comes
        (its task gave up waiting): on Ray's thread, so also once the loop that sent it is
        gone (the pool is thread-safe)."""

        def done(reply: concurrent.futures.Future[Any]) -> None:
            if not reply.cancelled():  # (a cancelled reply says nothing of the actor)
                self._let_go(slot, reply.exception())

        reply = job.reply
        if reply is None:  # answered already, its actor alive (_done)
            self._release(slot)
        else:
            reply.add_done_callback(done)  # at once if it is done by now

    def _submit(
        self, record: ActorRecord, request: Any, slot: _shm.Slot | None, method: str, *args: Any
    ) -> tuple[Job, asyncio.Future[Any]]:
        """Send the job to ``record``'s actor (synchronously: the call order is the order
        Ray delivers them in), with ``slot`` for its batch; the future of its result. If this
        raises, the slot is back in the pool (or out of it for good, if the call went out)."""
        job = Job(record)
        now = time.perf_counter()
        with self._fleet.lock:
            record.jobs.append(job)
            self._fleet.figures[record.slot].started(now)
            self._figures[record.slot].started(now)
        self._attempts[id(request)] = job

        def undo(let_go: Callable[[_shm.Slot | None], None]) -> None:
            let_go(slot)
            self._fleet.finished(job)  # not running
            with self._fleet.lock:
                self._fleet.figures[record.slot].ended(now)
                self._figures[record.slot].ended(now)
            if self._attempts.get(id(request)) is job:
                del self._attempts[id(request)]

        try:
            ref = getattr(record.handle, method).remote(self.copy_id, *args, slot)
        except BaseException:
            undo(self._release)  # never sent
            raise
        try:
            future = job.reply = ref.future()
        except BaseException:  # (an interrupt): sent, so its actor may write into the slot
            # Out of the actor's queue all the same: left there, it would stay its oldest job
            # for ever and no later job's deadline would fire; if the actor dies running it,
            # the next job is taken for the culprit.
            undo(self._forget)
            raise
        future.add_done_callback(functools.partial(self._done, job))
        awaited = asyncio.wrap_future(future)
        awaited.add_done_callback(_retrieve)  # also once its awaiting task is gone
        return job, awaited

    async def _result(
        self,
        record: ActorRecord,
        job: Job,
        awaited: asyncio.Future[Any],
        request: Any,
        slot: _shm.Slot | None,
    ) -> Made:
        """The job's :class:`Made`, opened and counted; the user's error raised as it is; a dead
        actor's culprit job as ``WorkerCrashedError``, one only queued there as
        :class:`_Innocent`. ``slot`` goes back to the pool but with the batch it holds."""
        try:
            result = await asyncio.shield(awaited)
        except asyncio.CancelledError:
            if slot is not None:
                self._release_when_done(job, slot)
            raise
        except Exception as exc:
            self._let_go(slot, exc)  # Ray's failure (answered), or its actor's death
            if not actor_died(exc):
                self._fleet.finished(job)  # Ray failed it: not running
                raise
            self._fleet.died(record)
            if result_lost(exc):  # made, then lost with its node's object store
                raise WorkerCrashedError(
                    f"batch {request.batch_id}, made by {record.describe()}, was lost with "
                    f"the object store that held it (its node is gone): "
                    f"{type(exc).__name__}: {exc}",
                    pid=record.pid,
                ) from exc
            if record.culprit is not job:
                raise _Innocent from exc
            raise WorkerCrashedError(
                f"{record.describe()} died while making batch {request.batch_id}: "
                f"{type(exc).__name__}: {exc}",
                pid=record.pid,
            ) from exc
        finally:
            if self._attempts.get(id(request)) is job:
                del self._attempts[id(request)]
            now = time.perf_counter()
            with self._fleet.lock:
                fresh = self._fleet.figures[record.slot].ended(now)
                mine_fresh = self._figures[record.slot].ended(now)
        if isinstance(result, Failed):
            self._release(slot)
            raise result.error
        return self._opened(record, result, fresh, mine_fresh, slot)

    def _opened(
        self,
        record: ActorRecord,
        result: Made,
        fresh: float,
        mine_fresh: float,
        slot: _shm.Slot | None,
    ) -> Made:
        busy = result.read_s + result.collate_s
        mine = self._figures[record.slot]
        with self._fleet.lock:
            self._fleet.figures[record.slot].add_batch(busy, fresh)
            mine.add_batch(busy, mine_fresh)
        parcel = result.batch
        if not isinstance(parcel, Parcel):  # through the object store (or the END marker)
            self._release(slot)
            result.batch = opened(parcel)
            if self._receiver is not None:  # the next batches of actors here come in slots
                self._receiver.saw(batch_nbytes(result.batch))
            mine.bytes += nbytes_of(result.batch)
            return result
        assert self._receiver is not None  # a parcel answers a slot, which needs the pool
        cannot_map = parcel.slot_vanished or parcel.fallback == "denied"
        if cannot_map and slot is not None and _shm.segment_exists(slot.name):
            # The slot is there, but not for the actor: its /dev/shm is another one after all
            # (another mount namespace with the same key), or it may not open it. Its batches
            # use the object store from now on. (Out of descriptors, it is a fallback of the
            # pool's, counted, and slots go on.)
            record.shm_key = None
            workers_log.warning(
                "%s cannot map this process's shared memory (%s): its batches travel through "
                "Ray's object store",
                record.describe(),
                parcel.slot_error,
            )
            result.batch = dataclasses.replace(parcel, slot_error="", slot_vanished=False)
        result = self._receiver.open(result, slot)  # if this raises, the slot is free
        result.batch = read_only(result.batch) if parcel.in_slot else opened(result.batch)
        mine.bytes += nbytes_of(result.batch)
        return result

    def worker_figures(self) -> tuple[WorkerFigures, ...]:
        """Each actor's figures for this loader (``LoaderStatistics.workers``): its batches,
        bytes and busy time for this loader, where it runs now and its restarts (the pool's:
        a replacement serves every loader)."""
        with self._fleet.lock:
            records = list(self._fleet.records)
        return tuple(
            WorkerFigures(
                id=slot,
                node=None if record is None else record.node,
                host=None if record is None else record.host,
                pid=None if record is None else record.pid,
                batches=mine.batches,
                bytes=mine.bytes,
                busy_s=mine.busy_s,
                restarts=self._fleet.figures[slot].restarts,
            )
            for slot, (record, mine) in enumerate(zip(records, self._figures, strict=True))
        )

    def _done(self, job: Job, future: Any) -> None:
        """A job's reference resolved (on Ray's thread): it leaves its actor's queue, unless
        the actor died (the fleet then needs the queue to name the culprit)."""
        if future.cancelled():
            return
        error = future.exception()
        if error is None or not actor_died(error):
            job.reply = None  # answered (its callbacks hold the job: no cycle keeps the batch)
            self._fleet.finished(job)

    async def _loaded(self, record: ActorRecord) -> None:
        """Wait until ``record``'s actor runs and holds this loader's current copy. The first
        job of a copy starts loading it into every live actor at once: an actor first picked
        later in the epoch would otherwise load it (imports included) inside a batch's time."""
        for other in self._fleet.live():
            self._loading(other)
        loading = self._loading(record)
        if succeeded(loading):
            return  # (perhaps on another loop, whose future is not to be awaited here)
        try:
            await asyncio.shield(loading)
        except BaseException:
            if loading.done():  # failed: the next job tries again
                for key in [k for k, v in record.loaded.items() if v is loading]:
                    del record.loaded[key]
            raise

    def _loading(self, record: ActorRecord) -> asyncio.Future[None]:
        """The load of this loader's current copy into ``record``'s actor, started if need be."""
        key = (self.copy_id, self._version)
        loading = record.loaded.get(key)
        # A loader iterated with `for` (the pool's loop) and then with `async for` (the
        # caller's): a load still under way on the other loop is started again on this one.
        if loading is None or (
            loading.get_loop() is not asyncio.get_running_loop() and not succeeded(loading)
        ):
            loading = record.loaded[key] = asyncio.ensure_future(self._load_into(record))
            loading.add_done_callback(_retrieve)
        return loading

    async def _load_into(self, record: ActorRecord) -> None:
        await self._fleet.ready(record)
        ref = await self._payload_ref()
        await record.handle.load.remote(self.copy_id, ref, self._epoch, self._seed)

    async def _payload_ref(self) -> Any:
        """The copy's ObjectRef: pickled off the loop and put into the object store once."""
        put = self._put
        if put is not None and put.get_loop() is not asyncio.get_running_loop():
            if succeeded(put):
                return put.result()
            put = None  # under way on another loop: again here
        if put is None:
            make = self._make_payload
            if make is None:
                raise RuntimeError("no dataset copy was given to the actors (load() first)")
            put = self._put = asyncio.ensure_future(off_loop(lambda: _put(make())))
            put.add_done_callback(_retrieve)
        return await asyncio.shield(put)


class _Innocent(Exception):
    """A job only queued on an actor that died: it was never made."""


@dataclass(slots=True, eq=False)
class _Reading:
    """One reading of one actor's stream: the actor that opened it, the pulls sent to it (each
    pull's turn, see ``LoaderActor.pull``), and the last pull's sending."""

    record: ActorRecord | None = None
    turns: int = 0
    sent: asyncio.Future[None] | None = None


def _put(data: bytes) -> Any:
    import ray

    return ray.put(data)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark ``future``'s exception as seen: a shielded future whose awaiting task was cancelled
    (a deadline, a closed epoch) still fails when its actor dies, with nobody left to see it;
    asyncio would log "Future exception was never retrieved"."""
    if not future.cancelled():
        future.exception()
