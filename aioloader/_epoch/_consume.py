"""One epoch, the consumer side: permits, hand-over, closing, resume bookkeeping.

::

    Producer (_produce) ── reorder.put_nowait(outcome) ──▶ ReorderBuffer ── wake ──▶
    consumer: Epoch.__anext__ ── pop_ready ──▶ device stage (optional) ──▶ the batch
         └─ the permit goes back when the consumer takes the batch (after its device copy)

Who owns what:
- the producer (:class:`aioloader._epoch._produce.Producer`) owns the scheduler and produce tasks;
  they fill the reorder buffer;
- the consumer owns batches once popped; a permit is returned when the consumer takes a
  batch, so ``prefetch`` bounds tasks, worker jobs and reorder entries together (shared
  memory has its own cap: a batch the consumer keeps holds its slot after its permit went back).

Cancellation edges:
- cancelling the consumer's ``__anext__`` (``asyncio.timeout`` around it, a cancelled task)
  loses nothing: a batch popped but not yet handed over is kept and returned by the next call;
- several tasks awaiting ``__anext__`` of one epoch at once are served one at a time, in the
  order they asked (a FIFO lock): each gets the next batch, exactly once; one cancelled while
  served or waiting for its turn leaves its batch to the next caller;
- ``aclose()`` cancels the producer's tasks and waits for them; worker jobs that were already
  running release their shared-memory slots when they finish;
- an iterator dropped without ``aclose()`` (also by a cancelled task a caller keeps) is closed
  by its handle's ``__del__`` (:class:`EpochIterator`: the tasks do not reference the handle);
- closing an epoch wakes a consumer that waits on it: it gets ``StopAsyncIteration``, or a
  ``RuntimeError`` where the loader was closed under an epoch not over (:meth:`Epoch.interrupt`):
  a training loop must not take an epoch cut short for a whole one.

A forked child's copy of an epoch is its parent's (its tasks, loop, permits and workers are
there): its ``__anext__`` refuses at once, naming both processes, as the sync iterator does,
and its closing touches nothing (the parent's epoch goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from .._config import LoaderConfig
from .._log import distributed_log, epoch_log, first_time
from .._sampling import Lockstep, stream_items
from .._stats import Capacity, Counters, EpochStatistics
from .._threads import NOT_INLINE, epoch_makes, forked_mid_epoch
from .._types import EMPTY_BATCH, END, Route, Runner, StreamPosition, StreamResume
from ._plan import Plan
from ._produce import BUSY, Producer
from ._reorder import Outcome, ReorderBuffer

__all__ = ["LOOP_TURN_S", "DeviceStage", "Epoch", "EpochIterator"]

#: While the consumer makes cheap batches on the loop itself (``Epoch._next_on_loop``), the
#: loop's other tasks get a turn at least this often (a costly batch sends the rest of the epoch
#: back to the helper thread: ``_threads.RoutePolicy``).
LOOP_TURN_S = 1e-3


class Transfer(Protocol):
    """A batch on its way to the device."""

    async def wait(self) -> Any: ...


class Progress(Protocol):
    """What an epoch tells a progress display (:mod:`aioloader._stats._progress`)."""

    def advance(self, samples: int, nbytes: int) -> None: ...

    def close(self, final: EpochStatistics | None) -> None: ...


class DeviceStage(Protocol):
    """What an epoch needs of the device stage (:mod:`aioloader._device`)."""

    def start(self, batch: Any, batch_id: int) -> Transfer: ...


class Epoch:
    """An async iterator over one epoch's batches. Made by :class:`aioloader.DataLoader`.

    Args:
        config: the loader's settings.
        epoch: the epoch number (seeds and sampler order derive from it).
        runner: where CPU work runs (threads or worker processes).
        counters: the loader's live statistics.
        plan: for map-style data, ``(batch_id, indices)`` pairs still to produce.
        dataset: the dataset (for async fetches and async streams).
        device: the device stage, or None.
        on_batch: called with the batch id and its stream position (or ``None``) when the
            consumer takes a batch (resume bookkeeping).
        on_finish: called once when the epoch has run to its end: when the consumer takes its
            last batch (or that batch's error), or else at the ``__anext__`` that ends it.
        progress: told of each batch handed over, closed with the epoch.
        stream_resume: for a stream, how a resumed epoch begins.
        lockstep: equal steps on every rank (a sharded stream, ``equal_steps``): each batch is
            handed over once every rank has one at that step (see ``_sampling._lockstep``);
            batches carried from the last epoch come first.
    """

    def __init__(
        self,
        config: LoaderConfig,
        epoch: int,
        runner: Runner,
        counters: Counters,
        *,
        plan: Plan | None,
        dataset: Any,
        device: DeviceStage | None,
        on_batch: Callable[[int, StreamPosition | None], None],
        on_finish: Callable[[], None] = lambda: None,
        progress: Progress | None = None,
        stream_resume: StreamResume | None = None,
        lockstep: Lockstep | None = None,
    ) -> None:
        # Closed until fully made: __del__ of an epoch whose __init__ was interrupted (a
        # Ctrl-C, a producer that could not be made) has nothing to close.
        self._closed = True
        self._pid = os.getpid()  # the process whose epoch this is (a forked child's copy is not)
        self.config = config
        self.epoch = epoch
        self._counters = counters
        self._device = device
        self.plan = plan
        self._on_batch = on_batch
        self._on_finish: Callable[[], None] | None = on_finish  # None once called
        self.reorder = ReorderBuffer(in_order=config.in_order)
        # The semaphore and the event bind to a loop at first use: made here, used on the loop.
        self._permits = asyncio.Semaphore(config.prefetch)
        self._ready = asyncio.Event()
        self._serving = asyncio.Lock()  # one __anext__ at a time (FIFO): see __anext__
        # Equal steps: this epoch's agreement, the batches carried into it, real batches
        # popped from the reorder buffer, carried ones handed over, verdicts by step.
        self._lockstep = lockstep
        self._agreement = lockstep.begin(epoch) if lockstep is not None else None
        self._carried: deque[tuple[Any, int, int]] = deque()
        if lockstep is not None:
            self._carried.extend(lockstep.carried)
            lockstep.carried = []
        self._real_popped = 0
        self._carried_handed = 0
        self._samples_handed = 0  # of this epoch's own batches (carried ones not counted)
        self._verdicts: dict[int, asyncio.Future[bool]] = {}
        self._verdict_asked = 0.0  # when the consumer first asked for the newest verdict
        self._past: _Past | None = None  # taken out at the agreed end (_end_agreed)
        self._share_len = (
            _share_len(config, dataset)
            if lockstep is not None and (stream_resume is None or stream_resume.first_id == 0)
            else None
        )
        self._producer = Producer(
            config,
            epoch,
            runner,
            counters,
            plan=plan,
            epoch_samples=plan.samples if plan is not None else None,
            dataset=dataset,
            reorder=self.reorder,
            permits=self._permits,
            wake=self._woken,
            resume=stream_resume,
        )
        self._handing: list[tuple[int, Transfer]] = []  # popped, not yet handed over (copies)
        self._interrupted = False  # closed with the loader before it was over (interrupt)
        self._interrupt_cause: str | None = None  # why, where not the loader's close
        # The consumer's last step raised a batch's error: if a new epoch starts before the next
        # step, the consumer stopped there (a loop unwound by the error); see _new_epoch.
        self.raised_last = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._began = False  # the epoch's clock started (by __anext__ or next_inline)
        # Made by the epoch itself on the routes that allow it (``_threads._routes``): in the
        # consumer's thread (``for``: next_inline), by the consumer on the loop (_next_on_loop).
        makes = plan is not None and epoch_makes(config, device=device is not None)
        self._inline = runner.inline if makes else None
        self._producer.may_park = self._inline is not None
        self._turn_due = 0.0  # when the consumer making batches on the loop yields to it next
        self._progress = progress
        self._stats_token = object()  # this epoch's claim on the counters' epoch clock
        self._closed = False  # last: made whole

    @property
    def finished(self) -> bool:
        """Whether the epoch was closed or has nothing more to give (its next ``__anext__``
        would end it): e.g. its last batch raised, and a traceback keeps the iterator alive."""
        if self._closed:
            return True
        return (
            self._producer.done
            and len(self.reorder) == 0
            and not self._handing
            and not self._carried
        )

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop this epoch runs on, once started."""
        return self._loop

    def __aiter__(self) -> Epoch:
        return self

    async def __anext__(self) -> Any:
        if self._pid != os.getpid():  # forked from the process it runs in (see the docstring)
            raise forked_mid_epoch(self._pid, "async for batch in loader")
        if self._closed:
            raise self.end_error()
        # Several tasks may pull from one iterator (consumers on one loop): they are served one
        # after another, in the order they asked, as the sync iterator serves its callers.
        # Invariant: of the callers, only the one holding ``_serving`` takes batches (from
        # ``_handing``, ``_carried``, the reorder buffer) and counts steps; every wait of a
        # step (a device copy, a verdict, the reorder buffer) is inside it, so two callers
        # never take one batch. A close may release them under it: it then sees the close.
        # A caller cancelled in its turn leaves its batch where it was, for the next in line.
        # Uncontended (one consumer), the lock costs under a microsecond a batch.
        async with self._serving:
            return await self._next()

    async def _next(self) -> Any:
        """The next batch, for the one caller being served (see :meth:`__anext__`)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._begin()
            if self._inline is not None:
                assert self.plan is not None
                self._producer.leave_inline(self.plan.put_back)
            self._producer.start()
        while True:
            if self._past is not None and not self._closed:
                # A consumer cancelled at the agreed end: finish ending (nothing was lost).
                end = self._agreement.end if self._agreement is not None else None
                await self._end_agreed(end if end is not None else self._step())
            if self._closed:  # closed while we waited (a new epoch, the loader's close)
                raise self.end_error()
            if self._carried:
                if not await self._gate(self._carried_handed):
                    continue  # waited for the verdict: look again
                return await self._hand_carried()
            if self._handing:
                if not await self._gate(self._step()):
                    continue
                return await self._hand_over()
            if self._agreement is not None:
                ahead = self.reorder.peek_ready()
                if ahead is not None and _real(ahead) and not await self._gate(self._step()):
                    continue
            outcome = self.reorder.pop_ready()
            if outcome is not None:
                if _real(outcome):
                    self._real_popped += 1
                if outcome.value is END:
                    self._release_permit()
                    continue
                if outcome.value is EMPTY_BATCH:  # every sample skipped: nothing to hand over
                    self._release_permit()
                    self._producer.taken(outcome.batch_id)
                    self._taken(outcome.batch_id)  # done, for resume
                    continue
                return await self._take(outcome)
            if self._producer.parked and len(self.reorder) == 0:
                batch = await self._next_on_loop()
                if batch is not NOT_INLINE:
                    return batch
                continue  # the scheduler goes on
            if self._producer.done and len(self.reorder) == 0:
                await self._close_over()
                raise StopAsyncIteration
            self._ready.clear()
            started = time.perf_counter()
            try:
                await self._ready.wait()
            finally:
                self._counters.consumer_wait_s += time.perf_counter() - started

    def _begin(self) -> None:
        if not self._began:
            self._began = True
            capacity = _capacity(self.config, self._device)
            self._counters.begin_epoch(self.epoch, capacity, self._stats_token)

    def next_inline(self) -> Any:
        """The next batch, made here in the caller's thread with no event loop: ``for`` over a
        sync map-style dataset with ``num_workers=0``, while the route policy says
        :attr:`Route.CALLER` (see ``_threads._routes``; torch makes every batch that way).
        Returns :data:`NOT_INLINE` where the rest of the epoch is to come from ``__anext__``
        on the loop instead: the epoch is not of that kind, its batches got costly (the loop's
        helper thread then makes the next one while the consumer works), or it runs there
        already. Raises ``StopIteration`` at the end, and a batch's error as ``__anext__`` does.
        """
        inline = self._inline
        if inline is None or self._loop is not None:
            return NOT_INLINE
        producer = self._producer
        if inline.route(on_loop=False) is not Route.CALLER and producer.can_leave_inline:
            return NOT_INLINE
        self._begin()
        while True:
            if self._closed:
                if self._interrupted:
                    raise self.end_error()
                raise StopIteration
            started = time.perf_counter()
            try:
                outcome = producer.make_inline(inline)
            except BaseException:  # Ctrl-C in the dataset's code: the epoch ends, as on the loop
                self.close_nowait()
                raise
            finally:
                self._counters.consumer_wait_s += time.perf_counter() - started
            if outcome is None:
                self.close_nowait()
                self._finish()
                raise StopIteration
            batch_id = outcome.batch_id
            if outcome.value is EMPTY_BATCH:  # every sample skipped: nothing to hand over
                producer.taken(batch_id)
                self._taken(batch_id)
                continue
            if outcome.error is not None:
                self._taken(batch_id)
                raise outcome.error
            self._yielded(batch_id)
            return outcome.value

    async def _next_on_loop(self) -> Any:
        """The next batch, made here on the loop by the consumer, with no task, permit or
        future: the scheduler parked once the route policy said :attr:`Route.LOOP`
        (``Producer.may_park``), as ``next_inline`` makes them with no loop. Returns
        :data:`NOT_INLINE` once it says otherwise (or a thread makes one): the scheduler then
        goes on. Other tasks on the loop get a turn every :data:`LOOP_TURN_S`."""
        inline, producer = self._inline, self._producer
        assert inline is not None
        assert self.plan is not None
        while True:
            if self._closed:
                raise self.end_error()
            if not producer.parked:  # another __anext__ of this epoch handed it back meanwhile
                return NOT_INLINE
            if inline.route(on_loop=True) is not Route.LOOP and producer.can_leave_inline:
                producer.unpark(self.plan.put_back)
                return NOT_INLINE
            if time.perf_counter() >= self._turn_due:
                self._turn_due = time.perf_counter() + LOOP_TURN_S
                await asyncio.sleep(0)
                continue  # the state is looked at again after the turn
            started = time.perf_counter()
            try:
                outcome = producer.make_inline(inline, on_loop=True)
            except BaseException:  # Ctrl-C in the dataset's code: the epoch ends, as in a thread
                self.close_nowait()
                raise
            finally:
                self._counters.consumer_wait_s += time.perf_counter() - started
            if outcome is BUSY:
                producer.unpark(self.plan.put_back)
                return NOT_INLINE
            if outcome is None:
                await self._close_over()
                raise StopAsyncIteration
            if outcome.value is EMPTY_BATCH:  # every sample skipped: nothing to hand over
                producer.taken(outcome.batch_id)
                self._taken(outcome.batch_id)
                continue
            if outcome.error is not None:
                self._taken(outcome.batch_id)
                raise outcome.error
            self._yielded(outcome.batch_id)
            return outcome.value

    async def _take(self, outcome: Outcome) -> Any:
        if outcome.error is not None:
            self._release_permit()
            self._taken(outcome.batch_id)
            raise outcome.error
        if self._device is None:
            self._release_permit()
            self._yielded(outcome.batch_id)
            return outcome.value
        self._handing.append((outcome.batch_id, self._start_copy(outcome)))
        # Start the copies of the batches right behind, so batch i+1 crosses while i is used.
        # An error, a stream end or an empty batch waits its turn in the buffer.
        while len(self._handing) <= self.config.device_prefetch:
            nxt = self.reorder.peek_ready()
            if nxt is None or nxt.error is not None or nxt.value is END or nxt.value is EMPTY_BATCH:
                break
            self.reorder.pop_ready()
            self._real_popped += 1
            self._handing.append((nxt.batch_id, self._start_copy(nxt)))
        return await self._hand_over()

    def _start_copy(self, outcome: Outcome) -> Transfer:
        """Start a batch's device copy; a failure to start waits its turn like the batch would,
        so its permit and its place in the order are kept (and released) like any other."""
        assert self._device is not None
        try:
            return self._device.start(outcome.value, outcome.batch_id)
        except Exception as exc:
            return _FailedCopy(exc)

    async def _hand_over(self) -> Any:
        batch_id, transfer = self._handing[0]
        started = time.perf_counter()
        try:
            batch = await transfer.wait()
        except asyncio.CancelledError:
            raise  # the transfer stays first in line; the next __anext__ returns it
        except BaseException:
            if self._closed:  # closed meanwhile: what was handing over is released already
                raise self.end_error() from None
            self._handing.pop(0)
            self._release_permit()
            self._taken(batch_id)
            raise
        finally:
            self._counters.transfer_s += time.perf_counter() - started
        if self._closed:
            raise self.end_error()
        self._handing.pop(0)
        self._release_permit()
        self._yielded(batch_id)
        return batch

    def _yielded(self, batch_id: int) -> None:
        samples, nbytes = self._producer.taken(batch_id)
        self._samples_handed += samples
        self._count_yield(samples, nbytes)
        self._taken(batch_id)

    def _taken(self, batch_id: int) -> None:
        """The consumer is done with ``batch_id`` (the batch, its error, or an empty batch)."""
        self._on_batch(batch_id, self._producer.position(batch_id))
        if self._complete():
            # That was the last one: the epoch is complete now, not only at the __anext__ that
            # would end it, which a consumer that counts to len(loader) never makes (Lightning,
            # accelerate). A state_dict() taken now must start the next epoch, not resume an
            # empty one. The scheduler is done by now: it reads the end of a map-style plan
            # right after starting the last batch, before that batch can arrive (or before
            # it parks, leaving the rest to the consumer, who reads it as it makes the last).
            self._finish()

    def _complete(self) -> bool:
        """Whether the consumer has taken every batch of an epoch that is over: a map-style
        plan read to its end with nothing left to hand, or a stream whose readers all ended
        with only their ends left (an epoch under equal steps ends where the ranks agree)."""
        if self._closed or self._handing:
            return False
        if self._producer.done and len(self.reorder) == 0:
            return True
        return self._agreement is None and not self._carried and self._over()

    def _finish(self) -> None:
        on_finish, self._on_finish = self._on_finish, None
        if on_finish is not None:
            on_finish()

    async def _close_over(self) -> None:
        """Close the epoch that is over and book it finished, the booking also if the close is
        cancelled (a timeout around the consumer's last ``anext``): the end was reached."""
        try:
            await self.aclose()
        finally:
            self._finish()

    def _release_permit(self) -> None:
        self._permits.release()

    # -- equal steps (a sharded stream) -----------------------------------------------------

    def _woken(self) -> None:
        """An outcome arrived, or scheduling ended: tell the consumer, and offer the steps
        this rank now knows it has (or that its stream ended) to the agreement, ahead of the
        consumer. A stream's last ends arriving after the consumer took its last batch
        complete the epoch then (see :meth:`_taken`)."""
        self._ready.set()
        if self._agreement is not None:
            self._offer()
        elif self._on_finish is not None and self._producer.readers_ended and self._complete():
            self._finish()

    def _offer(self) -> None:
        agreement = self._agreement
        if agreement is None or self._closed:
            return
        ready = sum(1 for outcome in self.reorder.ready_run() if _real(outcome))
        have = self._carried_handed + len(self._carried) + self._real_popped + ready
        agreement.offer(have, complete=self._producer.done and self.reorder.pending == 0)

    def _step(self) -> int:
        """The step of the next real batch to hand over (first of ``_handing``, or the
        reorder buffer's next)."""
        return self._carried_handed + self._real_popped - len(self._handing)

    async def _gate(self, step: int) -> bool:
        """Whether batch ``step`` may be handed over now: True once every rank has one at
        that step; False after waiting for the verdict (the caller looks at the epoch again).
        Where some rank has none, the epoch ends here (:meth:`_end_agreed`)."""
        if self._agreement is None:
            return True
        verdict = self._verdicts.get(step)
        if verdict is None:
            self._offer()
            offered = self._agreement.verdict(step)
            assert offered is not None, f"step {step} handed before it was offered"
            self._verdicts.pop(step - 1, None)
            verdict = self._verdicts[step] = asyncio.wrap_future(offered)
            self._verdict_asked = time.monotonic()  # the deadline of its wait counts from here
        if not verdict.done():
            started = time.perf_counter()
            try:
                # Shielded and bounded (see EpochAgreement.wait): a cancelled consumer does
                # not cancel the step's job; the next __anext__ waits again, same deadline.
                await self._agreement.wait(step, verdict, self._verdict_asked)
            finally:
                self._counters.consumer_wait_s += time.perf_counter() - started
            return False
        if verdict.result():
            return True
        await self._end_agreed(step)

    def carried_unhanded(self) -> list[tuple[Any, int, int]]:
        """The batches carried into this epoch (equal steps) that it has not handed over: a
        state taken mid-epoch holds them, so a resume hands them first (and not those already
        handed, which it would hand again). At the agreed end, before its leftover is settled
        (a consumer cancelled there), what it will carry. None once closed (an epoch left
        early drops them; a settled one gave them back to the lockstep)."""
        if self._closed or self._lockstep is None:
            return []
        past = self._past
        if past is None:
            return list(self._carried)
        if past.settled or self._lockstep.leftover != "carry":
            return []
        return (past.carried + past.ready)[: self.config.prefetch]

    async def _hand_carried(self) -> Any:
        """The next batch carried from the last epoch (its device copy first, if any)."""
        batch, samples, nbytes = self._carried[0]
        if self._device is not None:
            batch = await self._device.start(batch, -1 - self._carried_handed).wait()
        if self._closed:
            raise self.end_error()
        self._carried.popleft()
        self._carried_handed += 1
        self._count_yield(samples, nbytes)
        return batch

    async def _end_agreed(self, step: int) -> NoReturn:
        """Some rank has no batch ``step``: the epoch ends here on every rank. What this rank
        read past it is its leftover: carried into the next epoch, or dropped.

        Cancellation-safe: everything past the end is taken out of the epoch in one
        synchronous step (:meth:`_take_past`), so a cancelled consumer loses none of it; the
        device copies still crossing are awaited one by one, each kept until it is done (a
        cancelled wait leaves it for the next ``__anext__``, which comes back here); the
        leftover is settled (counted, carried, logged) before the epoch's close is awaited.
        """
        past = self._past
        if past is None:
            past = self._past = self._take_past()
        while past.copies:
            batch_id, transfer, size = past.copies[0]
            try:
                past.ready.append((await transfer.wait(), *size))
            except asyncio.CancelledError:
                raise  # the copy stays first in line: the next __anext__ waits for it again
            except Exception as exc:
                past.errors.append((batch_id, exc))
            past.copies.pop(0)
        self._settle_leftover(step, past)
        await self._close_over()
        raise StopAsyncIteration

    def _take_past(self) -> _Past:
        """Everything this rank holds past the agreed end, out of the epoch at once: the batches
        carried into it and not handed, the copies crossing to the device, and what is ready
        in the reorder buffer (a failed batch kept with its error, to be named)."""
        past = _Past(
            cut=not (self._producer.done and self.reorder.pending == 0),
            carried=list(self._carried),
        )
        self._carried.clear()
        # What is still being made is cut (``past.cut``): its outcomes, arriving while the
        # copies below are awaited, are dropped (the buffer expects them no more: storing one
        # raised KeyError in its task), as the epoch's close drops them.
        self._producer.closed = True
        handing, self._handing = self._handing, []
        past.copies = [(i, transfer, self._producer.taken(i)) for i, transfer in handing]
        for outcome in sorted(self.reorder.drain(), key=lambda o: o.batch_id):
            if not _real(outcome):
                continue
            size = self._producer.taken(outcome.batch_id)
            if outcome.error is not None:
                past.errors.append((outcome.batch_id, outcome.error))
            else:
                past.ready.append((outcome.value, *size))
        return past

    def _settle_leftover(self, step: int, past: _Past) -> None:
        """Count, carry or drop, and log what was read past the end; once per epoch."""
        if past.settled:
            return
        past.settled = True
        assert self._lockstep is not None
        counters = self._counters
        leftover = past.ready
        samples = sum(item[1] for item in leftover)
        counters.leftover_batches += len(leftover)
        counters.leftover_samples += samples
        keep = self._lockstep.leftover == "carry"
        everything = past.carried + leftover
        # Invariant: at most ``prefetch`` batches are carried. A rank whose share is always
        # longer reads ahead past every end; carrying all of it would grow without bound.
        kept = everything[: self.config.prefetch] if keep else []
        excess = everything[len(kept) :]
        self._lockstep.carried = kept
        counters.dropped_batches += len(excess)
        counters.dropped_samples += sum(item[1] for item in excess)
        for batch_id, error in past.errors:
            # A batch past the end that failed is no batch to carry, but its error is news.
            distributed_log.warning(
                "epoch %d ends at step %d on every rank; batch %d of this rank, read past it, "
                "failed and is not handed over: %s: %s",
                self.epoch,
                step,
                batch_id,
                type(error).__name__,
                error,
                exc_info=error,
            )
        if self._agreement is not None and self._agreement.left_elsewhere:
            distributed_log.warning(
                "epoch %d ends at step %d on every rank because another rank left it there "
                "(a break, a dropped iterator such as next(iter(loader)) to peek, a close) "
                "while this rank had not: leave every rank's loop at the same step",
                self.epoch,
                step,
            )
        unread = self._unread_samples() if past.cut else None
        if past.cut:
            counters.cut_epochs += 1
            counters.unread_samples += unread or 0
        if leftover or past.carried or past.cut:
            how = (
                f"{len(kept)} carried into the next epoch, read first"
                + (f", {len(excess)} dropped (prefetch={len(kept)} at most)" if excess else "")
                if keep
                else "dropped (leftover='drop')"
            )
            rest = (
                ""
                if not past.cut
                else "; the rest of its share was not read in this epoch"
                + (f" ({unread} samples)" if unread is not None else "")
            )
            distributed_log.info(
                "epoch %d ends at step %d on every rank (the shortest share); this rank read "
                "%d batches (%d samples) past it: %s%s",
                self.epoch,
                step,
                len(everything),
                sum(item[1] for item in everything),
                how,
                rest,
            )

    def _unread_samples(self) -> int | None:
        """How many samples of this rank's share the epoch neither handed over nor read past
        its end, where the stream says its length (``len()``) and the epoch began at the
        stream's start; None where that is not known."""
        if self._share_len is None:
            return None
        read = self._samples_handed + sum(item[1] for item in (self._past or _Past()).ready)
        return max(0, self._share_len - read)

    def _count_yield(self, samples: int, nbytes: int) -> None:
        counters = self._counters
        counters.batches_yielded += 1
        counters.epoch_batches_yielded += 1
        counters.samples_yielded += samples
        counters.bytes_yielded += nbytes
        if self._progress is not None:
            self._progress.advance(samples, nbytes)

    # -- closing -----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Cancel everything in flight, wait for it, release what was produced. Idempotent."""
        if self._closed or self._pid != os.getpid():  # (a forked child's copy: the parent's)
            return
        self._closed = True
        try:
            if self._agreement is not None:
                self._agreement.give_up()
            self._end_stats()
            tasks = self._producer.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            # Also when this close is cancelled (a timeout around the anext that ends the
            # epoch, a cancelled aclose()): a consumer waiting on the epoch is woken, and the
            # batches produced go; the tasks were cancelled and end on their own.
            self._release_all()

    def interrupt(self, cause: str | None = None) -> None:
        """The loader is being closed under this epoch: if it is not over, its consumer gets a
        ``RuntimeError`` from then on, not the end of an epoch that was cut short; ``cause``
        says why, where it is not the loader's close."""
        if not self._over():
            self._interrupted = True
            self._interrupt_cause = cause

    def _over(self) -> bool:
        """Whether nothing more was to come: a stream's epoch whose readers all ended is over,
        though their ends wait for the consumer."""
        return self.finished or (
            self._producer.readers_ended and self.reorder.holds_only(END) and not self._handing
        )

    def end_error(self) -> Exception:
        """What the consumer gets once the epoch is closed, or its loop closed under it (a
        shared pool's close): the end if it was over, else a ``RuntimeError`` saying so."""
        if not self._interrupted and (self._closed or self._over()):
            return StopAsyncIteration()
        if self._interrupt_cause is not None:
            return RuntimeError(
                f"epoch {self.epoch} was closed before it was over: {self._interrupt_cause}; "
                "the rest of it will not come"
            )
        return RuntimeError(
            f"the DataLoader (or its worker pool) was closed during epoch {self.epoch}, before "
            "it was over (from another task or thread, or at the program's end): the rest of "
            "it will not come"
        )

    def close_nowait(self) -> None:
        """Cancel the tasks and release what was produced, without waiting (from ``__del__``, a
        new epoch, another thread's close), on the loop that alone touches tasks and buffer."""
        if self._closed or self._pid != os.getpid():  # (a forked child's copy: the parent's)
            return
        self._closed = True
        loop = self._loop
        if loop is None or loop.is_closed():
            self._release_all()  # never started, or its loop is gone: nothing runs any more
            self._end_stats()
            if self._agreement is not None:
                self._agreement.give_up()
            return

        def stop() -> None:
            if self._agreement is not None:
                self._agreement.give_up()
            self._end_stats()
            self._producer.cancel()
            self._release_all()

        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(stop)

    def _end_stats(self) -> None:
        """Stop the epoch's clock, log its verdict once, close its progress display."""
        stats = self._counters.end_epoch(self._stats_token)
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.close(stats)
        if stats is not None and stats.batches:
            _log_verdict(stats)

    def _release_all(self) -> None:
        """Drop every produced batch and wake a consumer still waiting, who then sees the epoch
        closed. Dropping a batch drops its views; its shared-memory slot returns to the pool
        when the last view is gone (the consumer may still hold some)."""
        past = self._past
        if past is not None and not past.settled:
            # Closed while its end was being settled (a consumer cancelled at the agreed end,
            # then the loader closed): what it held past the end is named as dropped.
            past.settled = True
            held = past.carried + past.ready + [(None, *size) for _, _, size in past.copies]
            self._counters.dropped_batches += len(held)
            self._counters.dropped_samples += sum(item[1] for item in held)
            distributed_log.info(
                "epoch %d closed at its agreed end before what this rank read past it was "
                "settled: %d batches (%d samples) dropped",
                self.epoch,
                len(held),
                sum(item[1] for item in held),
            )
            past.carried, past.ready, past.copies = [], [], []
        if past is None and self._carried and self._lockstep is not None:
            # Left before its end (a break, a close): the batches carried into it and not
            # handed go back to be read first in the next epoch (and into state_dict()),
            # within the same prefetch cap as any carry; what is past it is counted dropped.
            everything = list(self._carried) + self._lockstep.carried
            self._carried.clear()
            self._lockstep.carried = everything[: self.config.prefetch]
            excess = everything[self.config.prefetch :]
            self._counters.dropped_batches += len(excess)
            self._counters.dropped_samples += sum(item[1] for item in excess)
        self.reorder.drain()
        self._handing.clear()
        self._ready.set()

    def __del__(self) -> None:
        self.close_nowait()


class EpochIterator:
    """What ``aiter(loader)`` returns: the consumer's handle on an :class:`Epoch`.

    Lazy: the epoch starts at the first ``__anext__``, so an iterator made and dropped unused
    (a framework probing ``iter(loader)``) consumes no epoch, no resume state and no
    randomness. It holds ``start`` (a bound method of the loader), so the loader lives as long
    as an iterator of it: ``await anext(aiter(DataLoader(...)))`` works.

    The epoch's tasks reference the epoch; only the consumer holds this handle, so its
    collection (``del it``, a ``break``, an error or a cancel that unwinds ``async for``)
    closes the epoch at once: its tasks are cancelled and its batches released.
    """

    __slots__ = ("__weakref__", "_start", "epoch")

    def __init__(self, start: Callable[[], Epoch]) -> None:
        self._start: Callable[[], Epoch] | None = start
        self.epoch: Epoch | None = None

    def __aiter__(self) -> EpochIterator:
        return self

    async def __anext__(self) -> Any:
        # A coroutine of our own (rather than the epoch's) keeps this handle alive while the
        # consumer awaits: ``await anext(aiter(loader))`` must not close the epoch under it.
        if self.epoch is None:
            if self._start is None:  # closed before it started
                raise StopAsyncIteration
            self.epoch = self._start()
        epoch = self.epoch
        try:
            batch = await epoch.__anext__()
        except BaseException as exc:
            if isinstance(exc, Exception):
                epoch.raised_last = not isinstance(exc, StopAsyncIteration)
            del self  # a kept traceback (a cancelled task's) must not keep the epoch open
            raise
        epoch.raised_last = False
        return batch

    async def aclose(self) -> None:
        """Close the epoch now and wait until its tasks are over."""
        self._start = None
        if self.epoch is not None:
            await self.epoch.aclose()

    def __del__(self) -> None:
        if self.epoch is not None:
            self.epoch.close_nowait()


@dataclass(slots=True)
class _Past:
    """What a rank holds past the agreed end of an epoch (equal steps), taken out of the epoch
    at once: ``carried`` (from the last epoch, not handed), ``copies`` still crossing to the
    device ``(batch_id, transfer, (samples, nbytes))``, ``ready`` leftover batches
    ``(batch, samples, nbytes)``, ``errors`` of failed batches ``(batch_id, error)``;
    ``cut``: the share was not read to its end; ``settled``: counted and logged."""

    cut: bool = False
    carried: list[tuple[Any, int, int]] = field(default_factory=list)
    copies: list[tuple[int, Transfer, tuple[int, int]]] = field(default_factory=list)
    ready: list[tuple[Any, int, int]] = field(default_factory=list)
    errors: list[tuple[int, BaseException]] = field(default_factory=list)
    settled: bool = False


def _share_len(config: LoaderConfig, dataset: Any) -> int | None:
    """The samples of this rank's share of a stream that says its length, else None."""
    try:
        n = len(dataset)
    except TypeError:
        return None
    return stream_items(config.shard, n) if isinstance(n, int) else None


def _real(outcome: Outcome) -> bool:
    """Whether ``outcome`` is a step of the consumer's (a batch or its error), not a marker."""
    return outcome.value is not END and outcome.value is not EMPTY_BATCH


def _capacity(config: LoaderConfig, device: DeviceStage | None = None) -> Capacity:
    """How parallel each stage of an epoch may be (for the shares and the verdict)."""
    return Capacity(
        makers=config.num_workers if config.uses_processes else config.threads,
        io_concurrency=config.io_concurrency if config.kind == "async_map" else 0,
        prefetch=config.prefetch,
        # 0: a batch sampler decides (the verdict takes the mean per batch); 1: no batching.
        batch_size=config.batch_size or (0 if config.batched else 1),
        processes=config.uses_processes,
        stream=config.kind == "async_iterable",
        thread_pool=config.thread_pool and config.num_workers > 0,
        pin_memory=config.pin_memory,
        # Copies to a CUDA device go through pinned memory whatever pin_memory says.
        staged=getattr(device, "device", None) is not None,
        device_prefetch=config.device_prefetch,
    )


def _log_verdict(stats: EpochStatistics) -> None:
    """The epoch's summary and verdict: INFO, or a WARNING the first time in this process that
    a verdict needs action (:attr:`EpochStatistics.needs_action`: the loader held back a long
    epoch). A warning means "act"; said at every epoch it would only be noise."""
    warn = stats.needs_action and epoch_log.isEnabledFor(logging.WARNING)
    level = logging.WARNING if warn and first_time("epoch verdict") else logging.INFO
    if not epoch_log.isEnabledFor(level):
        return
    epoch_log.log(
        level,
        "epoch %s: %d batches in %.2f s (%.1f batches/s, %.1f samples/s, %.1f MB/s); "
        "bottleneck: %s: %s",
        stats.epoch,
        stats.batches,
        stats.wall_s,
        stats.batches_per_s,
        stats.samples_per_s,
        stats.bytes_per_s / 1e6,
        stats.bottleneck,
        stats.hint,
    )


class _FailedCopy:
    """Stands in for a transfer that could not start: waiting on it raises its error."""

    def __init__(self, error: BaseException) -> None:
        self.error: BaseException | None = error

    async def wait(self) -> Any:
        error, self.error = self.error, None  # drop the reference: the batch's slot can go
        assert error is not None
        raise error
