"""The Ray backend's own logic without a Ray cluster: the actor (``LoaderActor`` is a plain
class that Ray makes an actor), the order of a stream's pulls and how the readings of several
loaders on one actor keep their turns; the fleet's and the runner's bookkeeping (start waits,
the first actor up, busy time, a result lost with its node).

Ray's own behaviour (placement, deaths, the object store) is tested on a real cluster in
``tests/test_ray.py``. Here a plain event loop stands in for an actor's, and where Ray must
fail in a way a cluster cannot be made to on cue (an actor dying while it starts, a result lost
with its node), a stand-in for the ``ray`` module injects that fault.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aioloader import WorkerCrashedError, WorkerError, WorkerInitError, numpy_collate
from aioloader._batch import BatchMaker
from aioloader._errors import SharedMemoryError
from aioloader._ray._actor import ActorCopy, Failed, LoaderActor, TurnTable
from aioloader._ray._fleet import MAX_START_ROUNDS, ActorRecord, Fleet, SlotFigures
from aioloader._ray._runner import RayRunner
from aioloader._ray._wire import in_parcel, shm_key
from aioloader._shm import Slot, SlotPool, segment_exists
from aioloader._types import END, BatchRequest, Made, StreamRequest
from aioloader._workers import Packer, Parcel, Receiver, dumps_payload
from aioloader._workers._wire import inline

BATCH = 2
#: Seconds a pull may take at most here (a bound against a hang; they take milliseconds).
PULL_S = 10


class Counting:
    """An iterable dataset: 0, 1, ... n - 1."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[np.ndarray[Any, Any]]:
        return (np.array([i]) for i in range(self.n))


def stream_payload(n: int = 100) -> bytes:
    copy = ActorCopy(BatchMaker(Counting(n), numpy_collate), None, stream=True)
    return dumps_payload(copy, main_by_value=True)


def request(epoch: int, batch_id: int, *, opens: bool = False) -> StreamRequest:
    return StreamRequest(epoch, batch_id, BATCH, False, opens=opens)


async def pull(actor: LoaderActor, copy_id: int, req: StreamRequest, turn: int) -> Any:
    made = await asyncio.wait_for(actor.pull(copy_id, req, turn), PULL_S)
    if isinstance(made, Failed):
        raise made.error
    assert isinstance(made, Made)
    return made.batch if made.batch is END else np.asarray(made.batch).ravel().tolist()


async def test_pulls_run_in_their_turns_whatever_order_they_arrive_in() -> None:
    actor = LoaderActor(0, 1)
    await actor.load(1, stream_payload(), 0, 0)
    # Sent 2, 1, 0: each waits for the one before (a stream's next samples are the next turn's).
    tasks = [
        asyncio.ensure_future(pull(actor, 1, request(0, turn, opens=turn == 0), turn))
        for turn in (2, 1, 0)
    ]
    got = await asyncio.gather(*tasks)
    assert got == [[4, 5], [2, 3], [0, 1]]


async def test_other_loaders_readings_never_push_out_a_live_one() -> None:
    """A training and a validation loader share one actor: after many validation epochs, the
    training epoch's next pull still runs (its turn entry was evicted, and it waited for
    ever)."""
    actor = LoaderActor(0, 1)
    await actor.load(1, stream_payload(), 0, 0)  # training
    await actor.load(2, stream_payload(), 0, 0)  # validation
    assert await pull(actor, 1, request(0, 0, opens=True), 0) == [0, 1]
    for epoch in range(6):
        assert await pull(actor, 2, request(epoch, 0, opens=True), 0) == [0, 1]
    assert await pull(actor, 1, request(0, 1), 1) == [2, 3]


async def test_a_pull_whose_turn_can_never_come_fails_at_once() -> None:
    actor = LoaderActor(0, 1)
    await actor.load(1, stream_payload(), 0, 0)
    assert await pull(actor, 1, request(0, 0, opens=True), 0) == [0, 1]
    with pytest.raises(WorkerError, match="the same pull sent twice"):
        await pull(actor, 1, request(0, 0), 0)
    # More readings of one loader at once than are kept: the oldest is dropped, and its late
    # pull says so instead of waiting.
    for epoch in range(1, 5):
        await pull(actor, 1, request(epoch, 0, opens=True), 0)
    with pytest.raises(WorkerError, match="was dropped to keep at most 4 open"):
        await pull(actor, 1, request(0, 1), 1)
    # A pull waiting for its turn when its loader's copy is dropped fails then.
    waiting = asyncio.ensure_future(pull(actor, 1, request(4, 2), 2))
    for _ in range(10):  # it reaches its wait
        await asyncio.sleep(0)
    assert not waiting.done()
    await actor.drop(1)
    with pytest.raises(WorkerError, match="dropped dataset copy 1"):
        await waiting


def test_the_turn_table_evicts_ended_readings_first_then_the_least_recently_pulled() -> None:
    table = TurnTable(keep=2)
    table.open((0, 0))
    table.open((0, 1))
    table.done((0, 0), 0, ended=False)  # (0, 0) pulled last: (0, 1) is the least recent
    table.open((0, 2))
    assert table.ready((0, 0), 1)
    with pytest.raises(WorkerError, match="dropped"):
        table.ready((0, 1), 1)
    table.done((0, 2), 0, ended=True)  # its stream is over: it goes first
    table.open((0, 3))
    assert table.ready((0, 0), 1)
    assert table.ready((0, 3), 0)
    with pytest.raises(WorkerError, match="dropped"):
        table.ready((0, 2), 1)
    assert not table.ready((0, 3), 1)  # turn 0 has not run yet: it waits


# -- the fleet's bookkeeping, without Ray --------------------------------------------------------


class ReadyRef:
    """Stands for an actor's ``ready`` reference: awaitable again and again (each await is a
    fresh wait, as with a Ray ObjectRef), resolved when the actor comes up."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.up: asyncio.Future[tuple[int, str, str, str | None]] = loop.create_future()

    def __await__(self) -> Any:
        return asyncio.shield(self.up).__await__()


async def test_an_actor_not_up_by_the_start_deadline_is_waited_for_again_by_the_next_job() -> None:
    """A failed start wait is not kept: once the actor comes up (a node with room joined), the
    slot's next job finds it (it failed at once, for ever)."""
    fleet = Fleet(1, {}, start_timeout=0.01)
    ref = ReadyRef()
    record = ActorRecord(0, handle=None, ready_ref=ref)
    with pytest.raises(WorkerInitError, match="not placed and started within start_timeout"):
        await fleet.ready(record)
    ref.up.set_result((1234, "node", "host", None))
    await fleet.ready(record)
    assert (record.pid, record.node, record.host) == (1234, "node", "host")


async def test_a_batch_takes_whichever_actor_comes_up_first() -> None:
    """No actor is up (replacements being placed): a map batch waits for the first of them to
    come up, not for the one it was first given (which may never be placed)."""
    fleet = Fleet(2, {}, start_timeout=60)
    refs = [ReadyRef(), ReadyRef()]
    fleet.records = [ActorRecord(slot, None, refs[slot]) for slot in range(2)]
    first = fleet.pick()
    assert first.slot == 0
    picked = asyncio.ensure_future(fleet.first_up(first))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not picked.done()
    refs[1].up.set_result((2, "node", "host", None))  # slot 1 comes up; slot 0 never does
    record = await asyncio.wait_for(picked, PULL_S)
    assert (record.slot, record.pid) == (1, 2)
    refs[0].up.cancel()  # (its wait, left running in the fleet, ends)


def test_an_actors_busy_time_never_exceeds_the_wall_time() -> None:
    """Batches of an async dataset fetch together on one actor: each took 3 s of the same 4 s,
    and the slot was busy 4 s, not 9 (a busy share over 100%). One batch alone keeps its own
    time (its actor's reading and collating, less than its time in flight)."""
    figures = SlotFigures()
    for now in (0.0, 0.5, 1.0):
        figures.started(now)
    for now in (3.0, 3.5, 4.0):
        figures.add_batch(3.0, figures.ended(now))
    assert figures.busy_s == pytest.approx(4.0)
    figures.started(10.0)
    figures.add_batch(0.2, figures.ended(10.5))
    assert figures.busy_s == pytest.approx(4.2)
    assert figures.batches == 4


def test_batches_made_one_after_another_count_in_full_however_late_their_results_arrive() -> None:
    # Two batches queued on one actor, made one after the other (0.2 s each): the first's
    # result reached the training process late (a busy loop), 0.06 s before the second's.
    # Both count their 0.2 s: the actor was busy 0.4 s of the 0.41 s.
    figures = SlotFigures()
    figures.started(0.0)
    figures.started(0.0)
    figures.add_batch(0.2, figures.ended(0.35))
    figures.add_batch(0.2, figures.ended(0.41))
    assert figures.busy_s == pytest.approx(0.4)


class StartingRay:
    """Stands for the ``ray`` module in :meth:`Fleet.wait_ready`, to inject deaths: the actors
    made for the first ``deaths`` times die while starting (a node lost under them), the next
    comes up. Every reference is ready at once."""

    def __init__(self, deaths: int) -> None:
        from ray import exceptions

        self.exceptions = exceptions
        self.deaths = deaths
        self.made = 0
        self.killed = 0

    def remote(self, cls: type) -> Any:
        ray = self

        class Handle:
            def __init__(self) -> None:
                ray.made += 1
                self.dies = ray.made <= ray.deaths
                self.ready = self

            def remote(self, *args: Any) -> Any:
                return self  # (ready.remote(): the reference is the handle itself)

        class Made:
            @staticmethod
            def options(**options: Any) -> Any:
                return Made

            @staticmethod
            def remote(*args: Any) -> Handle:
                return Handle()

        return Made

    def wait(
        self, refs: list[Any], num_returns: int, timeout: float
    ) -> tuple[list[Any], list[Any]]:
        return list(refs), []

    def get(self, ref: Any) -> tuple[int, str, str, str | None]:
        if ref.dies:
            raise self.exceptions.RayActorError()
        return 42, "node", "host", None

    def kill(self, handle: Any, no_restart: bool = True) -> None:
        self.killed += 1


@pytest.mark.parametrize("deaths", [1, 2])
def test_wait_ready_returns_once_a_round_has_no_deaths(
    deaths: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Actors that die while starting are replaced and waited for again: a round without deaths
    is a start, also after two rounds with them (it raised then, although every actor was up)."""
    ray = StartingRay(deaths)
    monkeypatch.setitem(sys.modules, "ray", ray)
    fleet = Fleet(1, {}, start_timeout=60)
    fleet.wait_ready()
    assert fleet.pids() == (42,)
    assert (ray.made, ray.killed, fleet.restarts) == (deaths + 1, deaths, deaths)


def test_wait_ready_gives_up_after_rounds_of_deaths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", StartingRay(MAX_START_ROUNDS))
    with pytest.raises(WorkerInitError, match=f"died while starting, {MAX_START_ROUNDS} rounds"):
        Fleet(1, {}, start_timeout=60).wait_ready()


class FakeRay:
    """Stands for the ``ray`` module under :class:`RayRunner`, to inject faults a cluster
    cannot be made to show on cue: actors on this machine (``ready`` gives pid ``100 + n`` for
    the n-th actor made, and this process's ``/dev/shm`` key) whose ``make`` hands each call's
    future to ``answer(n, request, slot, future)`` to complete; ``slots`` records the slot of
    each call, ``killed`` the kills."""

    def __init__(
        self, answer: Callable[[int, BatchRequest, Any, concurrent.futures.Future[Any]], None]
    ) -> None:
        from ray import exceptions

        self.exceptions = exceptions
        self.answer = answer
        self.slots: list[Any] = []
        self.made = 0
        self.killed = 0

    def remote(self, cls: type) -> Any:
        ray = self

        class Call:
            def __init__(self, future: concurrent.futures.Future[Any]) -> None:
                self._future = future

            def __await__(self) -> Any:
                return asyncio.wrap_future(self._future).__await__()

            def future(self) -> concurrent.futures.Future[Any]:
                return self._future

        def done(value: Any) -> Call:
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            future.set_result(value)
            return Call(future)

        class Method:
            def __init__(self, call: Callable[..., Call]) -> None:
                self.remote = call

        class Handle:
            def __init__(self) -> None:
                ray.made += 1
                self.number = ray.made
                self.ready = Method(lambda: done((100 + self.number, "node", "host", shm_key())))
                self.load = Method(lambda *args: done(None))
                self.make = Method(self._make)

            def _make(self, copy_id: int, request: BatchRequest, slot: Any) -> Call:
                ray.slots.append(slot)
                future: concurrent.futures.Future[Any] = concurrent.futures.Future()
                ray.answer(self.number, request, slot, future)
                return Call(future)

        class Made_:
            @staticmethod
            def options(**options: Any) -> Any:
                return Made_

            @staticmethod
            def remote(*args: Any) -> Handle:
                return Handle()

        return Made_

    def put(self, data: bytes) -> bytes:
        return data

    def kill(self, handle: Any, no_restart: bool = True) -> None:
        self.killed += 1


async def test_a_batch_lost_with_its_node_is_its_actors_death_and_runs_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch made, then lost with its node's object store, fails as its actor's death
    (``WorkerCrashedError``, which the epoch re-runs under ``max_retries``), and the actor is
    replaced: the batch is made again by the replacement (it was a bare Ray error, not
    retried)."""

    def answer(n: int, request: BatchRequest, slot: Any, future: Any) -> None:
        if n == 1:  # made, then lost with its node's object store
            future.set_exception(ray.exceptions.ObjectLostError("ab" * 14, None, "make"))
        else:
            future.set_result(Made(batch=np.array(request.indices), samples=2))

    ray = FakeRay(answer)
    monkeypatch.setitem(sys.modules, "ray", ray)
    fleet = Fleet(1, {}, start_timeout=60)
    runner = RayRunner(fleet, 1, lambda: None)
    runner.load(lambda: b"copy", 0, 0)
    request = BatchRequest(0, 0, [0, 1])
    with pytest.raises(WorkerCrashedError, match="lost with the object store") as lost:
        await asyncio.wait_for(runner.start_make(request), PULL_S)
    assert isinstance(lost.value.__cause__, ray.exceptions.ObjectLostError)
    assert (ray.killed, fleet.restarts) == (1, 1)
    made = await asyncio.wait_for(runner.start_make(request), PULL_S)
    assert np.asarray(made.batch).tolist() == [0, 1]
    assert fleet.pids() == (102,)


# -- batches in this machine's shared memory -------------------------------------------------

#: A batch's values: 128 KiB of int64, past what travels inline, so a slot is leased for it.
SLOT_BATCH = 16384


def slot_batch(request: BatchRequest) -> np.ndarray[Any, Any]:
    return np.full(SLOT_BATCH, request.batch_id, dtype=np.int64)


@pytest.fixture
def slot_pool() -> Iterator[SlotPool]:
    pool = SlotPool(64 << 20)
    yield pool
    pool.close()


Pending = list[tuple[BatchRequest, Any, Any]]  # (request, slot, its reply's future)


async def holding_runner(
    monkeypatch: pytest.MonkeyPatch, slot_pool: SlotPool
) -> tuple[RayRunner, FakeRay, Pending]:
    """A runner whose actor answers a call without a slot at once and holds each call with
    one (in the list returned) for the test to answer; its first batch made (so the next
    ones are sent with a slot)."""
    pending: Pending = []

    def answer(n: int, request: BatchRequest, slot: Any, future: Any) -> None:
        if slot is None:
            future.set_result(Made(batch=slot_batch(request)))
        else:
            pending.append((request, slot, future))

    ray = FakeRay(answer)
    monkeypatch.setitem(sys.modules, "ray", ray)
    runner = RayRunner(Fleet(1, {}, start_timeout=60), 1, lambda: None, slots=slot_pool)
    runner.load(lambda: b"copy", 0, 0)
    await asyncio.wait_for(runner.start_make(BatchRequest(0, 0, [0])), PULL_S)
    return runner, ray, pending


async def sent(pending: Pending) -> tuple[BatchRequest, Any, Any]:
    """The next call held (waiting for it, boundedly)."""
    for _ in range(100):
        if pending:
            return pending.pop()
        await asyncio.sleep(0.01)
    raise AssertionError("no call was sent with a slot")


def _refused(slot: Any) -> Any:
    raise PermissionError(13, "Permission denied", slot.name)


def _no_descriptor(slot: Any) -> Any:
    raise SharedMemoryError("no file descriptor left to map the slot")


@pytest.mark.parametrize("why", ["another-dev-shm", "another-user", "out-of-descriptors"])
async def test_an_actor_that_cannot_map_this_machines_slots_sends_its_batches_through_the_store(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    slot_pool: SlotPool,
    why: str,
) -> None:
    """An actor whose ``/dev/shm`` looked like this process's but is another, or which may not
    open a slot that exists here (another user's ``ray start``): that batch comes inline,
    whole; a warning names the actor; its later batches are sent without a slot; the slot
    stays in the pool, free (not forgotten as a vanished segment would be). An actor out of
    file descriptors is a passing fallback instead: counted, and slots go on."""

    def answer(n: int, request: BatchRequest, slot: Any, future: Any) -> None:
        if slot is None:
            future.set_result(Made(batch=slot_batch(request)))
            return
        if why == "another-dev-shm":
            packer = Packer(Slot(f"{slot.name}_elsewhere", slot.size))  # not in its /dev/shm
        else:
            with pytest.MonkeyPatch.context() as patch:
                refuse = _refused if why == "another-user" else _no_descriptor
                patch.setattr("aioloader._shm.attach", refuse)
                packer = Packer(slot)
        future.set_result(Made(batch=in_parcel(packer.pack(slot_batch(request)))))

    ray = FakeRay(answer)
    monkeypatch.setitem(sys.modules, "ray", ray)
    runner = RayRunner(Fleet(1, {}, start_timeout=60), 1, lambda: None, slots=slot_pool)
    runner.load(lambda: b"copy", 0, 0)
    with caplog.at_level(logging.WARNING, logger="aioloader"):
        for batch_id in range(3):
            request = BatchRequest(0, batch_id, [batch_id])
            made = await asyncio.wait_for(runner.start_make(request), PULL_S)
            assert np.array_equal(made.batch, slot_batch(request))
    stats = slot_pool.stats()
    assert (stats.slots, stats.free, stats.leased) == (1, 1, 0)
    if why == "out-of-descriptors":
        assert [slot is None for slot in ray.slots] == [True, False, False]
        assert runner.shm_fallbacks == 2
        assert "no file descriptor left" in caplog.text  # said once, as a WARNING
        return
    assert [slot is None for slot in ray.slots] == [True, False, True]
    assert "cannot map this process's shared memory" in caplog.text
    assert "Ray actor 0 (pid 101" in caplog.text
    assert runner.shm_fallbacks == 0  # the slot was there: not a fallback of the pool's


async def test_a_batch_given_up_after_its_reply_came_gives_its_slot_back_at_once(
    monkeypatch: pytest.MonkeyPatch, slot_pool: SlotPool
) -> None:
    """The reply is in (the actor is done with the slot) but the waiting task is cancelled
    before it runs: the slot goes back then, with the unread batch."""
    runner, _, pending = await holding_runner(monkeypatch, slot_pool)
    given_up = runner.start_make(BatchRequest(0, 1, [1]))
    request, slot, reply = await sent(pending)
    reply.set_result(Made(batch=in_parcel(Packer(slot).pack(slot_batch(request)))))
    given_up.cancel()  # before the loop hands the reply to the task
    with pytest.raises(asyncio.CancelledError):
        await given_up
    stats = slot_pool.stats()
    assert (stats.leased, stats.free, stats.slots) == (0, 1, 1)


def test_a_route_other_than_inline_keeps_the_warnings_that_need_someone(
    caplog: pytest.LogCaptureFixture, slot_pool: SlotPool
) -> None:
    """With Ray's route, a batch that finds no slot under the cap is routine (INFO); a slot
    whose segment someone removed from /dev/shm is still a WARNING after it, naming the
    route."""
    receiver = Receiver(slot_pool, 1, route="Ray's object store")
    receiver.saw(SLOT_BATCH * 8)
    batch = np.zeros(SLOT_BATCH)
    with caplog.at_level(logging.INFO, logger="aioloader"):
        over = inline(batch)  # as a worker answers a batch over its share of the cap
        capped = Parcel(over.tree, False, over.nbytes, slot_error="over the cap", fallback="cap")
        assert np.array_equal(receiver.open(Made(batch=capped), None).batch, batch)
        slot = asyncio.run(receiver.lease())
        assert isinstance(slot, Slot)
        gone = Packer(Slot(f"{slot.name}_removed", slot.size)).pack(batch)
        assert np.array_equal(receiver.open(Made(batch=gone), slot).batch, batch)
    said = [r for r in caplog.records if "through Ray's object store" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO, logging.WARNING]
    assert receiver.fallbacks == 2


async def test_a_given_up_batchs_slot_goes_back_once_its_actor_answered(
    monkeypatch: pytest.MonkeyPatch, slot_pool: SlotPool
) -> None:
    """The task waiting for a batch is cancelled (a deadline, a closed epoch) while its actor
    collates into the slot: the slot stays leased until the actor answers, then goes back;
    the next batch is opened from a slot, zero-copy, read-only numpy."""

    def collate_into(request: BatchRequest, slot: Any, future: Any) -> None:
        packer = Packer(slot)
        future.set_result(Made(batch=in_parcel(packer.pack(slot_batch(request)))))

    runner, _, pending = await holding_runner(monkeypatch, slot_pool)
    given_up = runner.start_make(BatchRequest(0, 1, [1]))
    call = await sent(pending)
    given_up.cancel()
    with pytest.raises(asyncio.CancelledError):
        await given_up
    assert slot_pool.stats().leased == 1  # the actor may still write into it
    collate_into(*call)
    for _ in range(100):
        if slot_pool.stats().leased == 0:
            break
        await asyncio.sleep(0.01)
    assert (slot_pool.stats().leased, slot_pool.stats().free) == (0, 1)
    kept = runner.start_make(BatchRequest(0, 2, [2]))
    collate_into(*await sent(pending))
    made = await asyncio.wait_for(kept, PULL_S)
    assert np.array_equal(made.batch, np.full(SLOT_BATCH, 2))
    assert not made.batch.flags.writeable
    assert slot_pool.stats().held == 1
    del made, kept  # (the task keeps its result)
    assert slot_pool.stats().held == 0


@pytest.mark.parametrize("given_up", [False, True], ids=["awaited", "given-up"])
async def test_a_slot_whose_actor_is_reported_dead_is_never_leased_again(
    monkeypatch: pytest.MonkeyPatch, slot_pool: SlotPool, given_up: bool
) -> None:
    """Ray reports an actor dead before its process is gone (a killed actor's collating thread
    may write on): its slot is unlinked and dropped from the pool, never handed to the next
    batch, also when the batch's task had given up waiting."""
    runner, ray, pending = await holding_runner(monkeypatch, slot_pool)
    dying = runner.start_make(BatchRequest(0, 1, [1]))
    _, slot, reply = await sent(pending)
    if given_up:
        dying.cancel()
    assert slot_pool.stats().leased == 1
    reply.set_exception(ray.exceptions.RayActorError())
    if given_up:
        with pytest.raises(asyncio.CancelledError):
            await dying
    else:
        with pytest.raises(WorkerCrashedError, match="died while making batch 1"):
            await asyncio.wait_for(dying, PULL_S)
    stats = slot_pool.stats()
    assert (stats.slots, stats.leased, stats.free) == (0, 0, 0)
    assert not segment_exists(slot.name)
    assert ray.killed == (0 if given_up else 1)  # (replaced; else found dead by its next job)
    following = runner.start_make(BatchRequest(0, 2, [2]))
    request, fresh, reply = await sent(pending)
    assert fresh.name != slot.name  # a new segment
    reply.set_result(Made(batch=slot_batch(request)))
    await asyncio.wait_for(following, PULL_S)


async def test_batches_that_find_no_slot_under_the_cap_use_the_store_without_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cap too small for a batch (a 64 MB /dev/shm, say): the batches travel through the
    object store, as they would without slots; said once at INFO, naming that route, no
    RuntimeWarning (which an -W error program would raise in the batch), and counted."""

    def answer(n: int, request: BatchRequest, slot: Any, future: Any) -> None:
        assert slot is None
        future.set_result(Made(batch=slot_batch(request)))

    monkeypatch.setitem(sys.modules, "ray", FakeRay(answer))
    small = SlotPool(SLOT_BATCH * 8 // 2, min_slot_bytes=4096)  # half a batch
    runner = RayRunner(Fleet(1, {}, start_timeout=60), 1, lambda: None, slots=small, prefetch=2)
    runner.load(lambda: b"copy", 0, 0)
    try:
        with caplog.at_level(logging.INFO, logger="aioloader"):
            for batch_id in range(3):
                request = BatchRequest(0, batch_id, [batch_id])
                made = await asyncio.wait_for(runner.start_make(request), PULL_S)
                assert np.array_equal(made.batch, slot_batch(request))
    finally:
        small.close()
    said = [r for r in caplog.records if "instead of a slot" in r.getMessage()]
    assert len(said) == 1
    assert said[0].levelno == logging.INFO
    assert "through Ray's object store" in said[0].getMessage()
    assert runner.shm_fallbacks == 2
