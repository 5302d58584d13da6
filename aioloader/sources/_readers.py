"""One epoch of a stream read in units (tar shards, Parquet row groups), many units at once, in
the :class:`~._mixing.Mixer`'s order, exactly resumable.

A dataset that reads whole units describes them through :class:`Units`: how an epoch starts
(its :class:`~._mixing.Mixer`) and the records of one unit (an async generator). This module
does the rest, the same for every such dataset::

    unit readers (one task per open unit)          the epoch (one async generator)
      units.records(u) ─▶ bounded queue ─────────▶ Mixer.want() ─▶ (unit, position)
                                                   await that unit's queue ─▶ Mixer.put()
                                                   ─▶ shuffle buffer ─▶ record ─▶ the loader

The order of records is the mixer's, a pure function of (seed, epoch, rank share) and of where
units end; the storage decides only when records arrive. Units that come next are opened
ahead, so their first bytes are on the way before a slot frees.

**Resume.** A dataset's state is the epoch, how many records it yielded, and how many records
each unit that ended had (:meth:`Epoch.position`). A resumed :class:`Epoch` replays the mixer to
that point without IO (:func:`~._mixing.replay`), then reads again only what the buffer held
and the open units from their positions on: it yields exactly the records, in exactly the
order, that the uninterrupted epoch would still have yielded.

**Other ranks.** An epoch may be a rank's part of the rest of an epoch saved on other ranks,
or of an epoch whose shares were evened up front (:mod:`._elastic`): its plan then leaves out,
per unit, the records consumed before or given to another rank, and positions count among the
records a unit keeps, so all of the above holds as it is.

**Connections.** A tar shard's reader holds one of its source's pooled connections from its
first byte to its last, also while its queue is full and it waits for the mixer: a pool
smaller than the readers would leave the reader the epoch awaits waiting behind readers
that wait for the epoch, for ever. So readers take a permit of a :class:`_Gate` as large as
the pool (the epoch's ``connections``; None: not bounded, as for Parquet, whose row groups are
read whole) before they open their unit, and give it back when the unit's stream is closed.
The gate serves first the readers the epoch may await (re-reads of what the buffer held,
then the open units) and lets units opened ahead take only what the open ones can never
need, so a pool of ``in_flight`` connections is enough (the units ahead then open only as
slots free) and more of them, up to ``2 x in_flight + 1``, buy read-ahead.

Epochs open at once over one pool (``zip`` of two iterations, an evaluation pass beside
training, two datasets over one source) share one gate per source and event loop: each
keeps connections for its open units, so each goes on whichever consumer waits for the
other; units ahead get what no open unit of any of them can need (an epoch that starts
stops the newest readers ahead past that, which open again in their turn). An epoch whose
open units do not fit beside the others' waits for those that are closing (one dropped
unclosed is closed by a task the loop runs next), and is refused at its start where none
is, naming the pool's setting and what the epochs need, rather than left waiting for ever.

**Failures.** A unit that fails yields one record saying so (the dataset's own type, whose
``decode`` raises) and ends; that is the generator's job. A generator that raises anyway (a
bug) fails the epoch at that unit's turn, never a silent wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from .._errors import ShardError
from .._validate import non_negative_int, positive_int
from ._elastic import Plan, Ranges, Rest, rest_of, skipping
from ._mixing import Mixer, SampleId, replay
from ._redact import redact

__all__ = ["READAHEAD", "Epoch", "UnitStream", "Units", "check_fits"]

#: Records read ahead per open unit: the queue that lets a unit keep streaming while the mixer
#: waits for another one. Memory: ``units in flight x READAHEAD x`` record size.
READAHEAD = 32


class Units(Protocol):
    """What an :class:`Epoch` reads: units numbered from 0, each a stream of records."""

    #: Names the reader tasks: ``aioloader-{kind}-{url}``.
    kind: str

    async def start(self, epoch: int, resume: Mapping[str, Any] | None) -> Plan | Mixer:
        """The plan of ``epoch``: its mixer, and what of each unit this rank leaves out (a
        mixer alone: nothing), after any IO the dataset needs first, and checking that a state
        being resumed fits the data."""
        ...

    def records(self, unit: int) -> AsyncGenerator[Any, None]:
        """The records of ``unit`` in order; a failure is yielded as a last record."""
        ...

    def where(self, unit: int) -> tuple[str, str]:
        """``(description, url)`` of ``unit``, for errors (``"tar shard URL"``, ``URL``); the
        description shows the URL masked."""
        ...


def check_fits(owner: str, state: Mapping[str, Any], fingerprint: Mapping[str, Any]) -> None:
    """Refuse a state saved by a dataset that orders its records differently.

    Raises:
        ValueError: naming ``owner``'s ``load_state_dict``, the setting and both values.
    """
    for key, value in fingerprint.items():
        if state.get(key) != value:
            raise ValueError(
                f"{owner}.load_state_dict: the state was saved with {key}="
                f"{state.get(key)!r}, this dataset has {key}={value!r}; the order of samples "
                "would differ"
            )


@dataclass(frozen=True, slots=True)
class _Raised:
    """In a reader's queue: its records generator raised (a bug); the epoch raises it."""

    error: BaseException


# -- the connections the readers share ------------------------------------------------------

#: A reader's claim on the gate, most urgent first: it re-reads records the buffer held (the
#: epoch awaits them; it never waits for the mixer, so it always ends), it reads an open unit
#: (the mixer takes from each in turn), or it reads a unit that comes next (nobody awaits it
#: until a slot frees).
REREAD, SLOT, AHEAD = 0, 1, 2


class _Ticket:
    """One reader's place at the gate: its claim, and whether it waits, holds or is done;
    ``drop`` stops its reader (one reading ahead, whose permit another epoch needs)."""

    __slots__ = ("claim", "done", "drop", "dropped", "future", "held")

    def __init__(self, claim: int) -> None:
        self.claim = claim
        self.future: asyncio.Future[None] | None = None  # while it waits
        self.held = False
        self.done = False
        self.drop: Callable[[], None] | None = None
        self.dropped = False


class _Gate:
    """The permits of ``connections`` (None: no bound) among the unit readers of the epochs
    open at once over one pool (one source, one event loop: :func:`_gate_for`).

    A sync state machine (the readers await :meth:`acquire`); each epoch :meth:`join` s it
    with its ``slots`` (its open units) and :meth:`leave` s it when it closes. It grants so
    that a reader an epoch awaits is never left behind readers that wait for an epoch:

    - a re-read takes any free permit;
    - an open unit's reader takes one, except the last while re-reads wait and none reads,
      which is theirs;
    - a reader of a unit ahead takes one only while no open unit's reader waits and the
      readers ahead hold fewer than ``connections - slots`` (``slots``: of every epoch
      joined; less one while re-reads are left).

    Invariant: open units' readers (at most ``slots``), readers ahead (at most
    ``connections - slots - 1`` while re-reads are left, else ``connections - slots``) and
    re-reads hold at most ``connections`` permits; with ``connections >= slots`` an open
    unit's reader then finds a permit free, or one held by a re-read, which ends without
    waiting for anyone. So no epoch waits for ever, whatever order their consumers take
    records in (``zip`` of two epochs). An epoch that joins while readers ahead hold more
    than the new quota drops the newest of them (their units are opened again when their
    turn comes: nothing of them was taken yet); one whose slots do not fit beside the other
    epochs' is refused (:meth:`join`).
    """

    def __init__(self, connections: int | None, slots: int = 0) -> None:
        self.connections = connections
        self.slots = slots
        self._epochs: dict[int, int] = {}  # id(epoch) -> its slots
        self._held = [0, 0, 0]  # per claim
        self._rereads = 0  # re-reads not done
        self._waiting: list[_Ticket] = []
        self._ahead: list[_Ticket] = []  # readers ahead holding a permit, oldest first
        self._closing: set[int] = set()  # epochs closing
        self._entering = 0  # epochs waiting to join
        self._changed = asyncio.Event()  # an epoch left

    async def join(self, epoch: object, slots: int, owner: str, setting: str) -> None:
        """Count ``epoch``'s ``slots`` among the open units; where they do not fit beside
        the other epochs', first wait for those that are closing (and for a few turns of the
        loop: an epoch whose iteration was dropped unclosed, ``break`` out of ``async for``,
        is closed by a task the loop has yet to run).

        Raises:
            RuntimeError: the other epochs open over this pool, none of them closing, leave
                fewer than ``slots`` connections, naming the pool's setting, its value and
                what it needs.
        """
        self._entering += 1
        try:
            turns = 0
            while not self._fits(slots):
                if self._closing:
                    self._changed.clear()
                    try:  # a closing epoch ends: its readers stop (bounded: a hung close)
                        async with asyncio.timeout(CLOSING_WAIT_S):
                            await self._changed.wait()
                    except TimeoutError:
                        self._refuse(slots, owner, setting, closing=True)
                elif turns < JOIN_TURNS:
                    turns += 1
                    await asyncio.sleep(0)
                else:
                    self._refuse(slots, owner, setting)
        finally:
            self._entering -= 1
        self._epochs[id(epoch)] = slots
        self.slots += slots
        self._drop_ahead()

    def _fits(self, slots: int) -> bool:
        return self.connections is None or self.slots + slots <= self.connections

    def _refuse(self, slots: int, owner: str, setting: str, closing: bool = False) -> NoReturn:
        others = len(self._epochs)
        if closing:
            owner = (
                f"{owner}: {len(self._closing)} epoch(s) over this source began to close "
                f"{CLOSING_WAIT_S:g} s ago and have not ended (a shard stream whose close "
                "hangs)"
            )
        raise RuntimeError(
            f"{owner}: {others} other epoch(s) over this source are open on this event "
            f"loop and keep {self.slots} of its {setting}={self.connections} connections "
            f"for their open units; this epoch needs {slots} more (an open unit holds its "
            "connection while its records wait for their turn), so it would wait for "
            f"ever. Give the source {setting}>={self.slots + slots} to read "
            f"{others + 1} epochs at once, or close the other epoch first"
        )

    def closing(self, epoch: object) -> None:
        """``epoch`` began to close: an epoch waiting to join waits for it."""
        if id(epoch) in self._epochs:
            self._closing.add(id(epoch))

    def leave(self, epoch: object) -> None:
        """``epoch`` closed (its readers are done): its slots are free."""
        self.slots -= self._epochs.pop(id(epoch), 0)
        self._closing.discard(id(epoch))
        self._changed.set()
        self._grant()

    @property
    def idle(self) -> bool:
        return not self._epochs and not self._entering

    def ticket(self, claim: int) -> _Ticket:
        if claim == REREAD:
            self._rereads += 1
            self._drop_ahead()  # the quota keeps a permit for the re-reads now
        return _Ticket(claim)

    def promote(self, ticket: _Ticket) -> None:
        """The unit of ``ticket``, read ahead, took a slot: its reader is now awaited."""
        if ticket.claim != AHEAD or ticket.done or ticket.dropped:
            return
        ticket.claim = SLOT
        if ticket.held:
            self._held[AHEAD] -= 1
            self._held[SLOT] += 1
            self._ahead.remove(ticket)
        self._grant()

    async def acquire(self, ticket: _Ticket) -> None:
        """Wait for a permit (in the order of the claims, then of arrival)."""
        ticket.future = asyncio.get_running_loop().create_future()
        self._waiting.append(ticket)
        self._grant()
        if not ticket.held:
            await ticket.future  # cancelled: the reader's release() takes it out

    def release(self, ticket: _Ticket) -> None:
        """The reader closed its unit (or never opened it): its permit is free."""
        if ticket.done:
            return
        ticket.done = True
        if ticket in self._waiting:
            self._waiting.remove(ticket)
        if ticket.held:
            ticket.held = False
            self._held[ticket.claim] -= 1
            if ticket.claim == AHEAD:
                self._ahead.remove(ticket)
        if ticket.claim == REREAD:
            self._rereads -= 1
        self._grant()

    def _quota(self) -> int:
        """The most permits readers ahead may hold now."""
        assert self.connections is not None
        return self.connections - self.slots - (1 if self._rereads else 0)

    def _drop_ahead(self) -> None:
        """Stop the newest readers ahead past the quota (another epoch joined): the permits
        they hold are the new epoch's, and they would keep them while they wait for their
        own epoch, which may wait for the new one."""
        if self.connections is None:
            return
        kept = [t for t in self._ahead if not t.dropped]
        for ticket in reversed(kept[max(self._quota(), 0) :]):
            ticket.dropped = True
            if ticket.drop is not None:
                ticket.drop()  # its release() frees the permit once its reader stopped

    def _may(self, claim: int) -> bool:
        if self.connections is None:
            return True
        free = self.connections - sum(self._held)
        if free <= 0:
            return False
        if claim == REREAD:
            return True
        # The last permit is kept for the re-reads while none of them holds one.
        reserve = 1 if self._rereads > self._held[REREAD] and not self._held[REREAD] else 0
        if claim == SLOT:
            return free > reserve
        slot_waits = any(t.claim == SLOT for t in self._waiting)
        return free > reserve and not slot_waits and self._held[AHEAD] < self._quota()

    def _take(self, ticket: _Ticket) -> None:
        ticket.held = True
        self._held[ticket.claim] += 1
        if ticket.claim == AHEAD:
            self._ahead.append(ticket)

    def _grant(self) -> None:
        for ticket in sorted(self._waiting, key=lambda t: t.claim):  # stable: first come first
            if ticket.future is not None and ticket.future.done():
                self._waiting.remove(ticket)  # cancelled; its release() ends it
                continue
            if self._may(ticket.claim):
                self._waiting.remove(ticket)
                self._take(ticket)
                assert ticket.future is not None
                ticket.future.set_result(None)


#: Seconds an epoch that does not fit waits for one closing (and an epoch's close for its
#: readers' cancellation) before it is refused: bounds a shard stream whose close hangs;
#: longer than any close that is only slow.
CLOSING_WAIT_S = 30.0

#: Turns of the event loop an epoch that does not fit beside the others open waits for one
#: of them to begin closing (an iteration dropped unclosed is closed by a task the loop runs
#: next; a loader's, through its own close) before it is refused.
JOIN_TURNS = 200

#: The gates of the pools epochs are open over, per (event loop, pool) by their ids. Held
#: weakly: each open epoch holds its gate, so an entry lives while an epoch over it is open
#: (which keeps the loop and the pool alive: their ids stay theirs). Never the loop as a weak
#: key: a waiting ticket's future holds its loop, so a gate left with a loop closed unclosed
#: (no shutdown_asyncgens) would keep its own key, the loop, the epoch and the source alive.
_GATES: weakref.WeakValueDictionary[tuple[int, int], _Gate] = weakref.WeakValueDictionary()


def _gate_for(pool: object | None, connections: int | None) -> _Gate:
    """The gate the epochs over ``pool`` share on this loop (a new one where ``pool`` or
    ``connections`` is None: nothing to share, or no bound)."""
    if pool is None or connections is None:
        return _Gate(connections)
    key = (id(asyncio.get_running_loop()), id(pool))
    gate = _GATES.get(key)
    if gate is None:
        gate = _GATES[key] = _Gate(connections)
    return gate


def _left(pool: object | None, gate: _Gate) -> None:
    """Forget ``gate`` once no epoch is open over it."""
    if pool is None or not gate.idle:
        return
    with contextlib.suppress(RuntimeError):  # no running loop: nothing registered
        key = (id(asyncio.get_running_loop()), id(pool))
        if _GATES.get(key) is gate:
            del _GATES[key]


class Epoch:
    """One iteration: the mixer, the unit readers, and the records they hold.

    Args:
        units: the dataset.
        epoch: the epoch number.
        resume: a state saved by the dataset (with ``yielded`` and ``ended``), or None.
        in_flight: units read at once (as many more are opened ahead).
        connections: the most readers that may have their unit open at once (the source's
            pool, where a reader holds a connection while it waits for the mixer; at least
            ``in_flight``), or None: no bound (see :class:`_Gate`).
        pool: what owns that pool (the source): the epochs open over it on one event loop
            share its connections (None: this epoch's alone).
        owner: the dataset's name, and ``setting`` the pool's, for the error of an epoch
            that does not fit beside the others open (see :meth:`_Gate.join`).
    """

    def __init__(
        self,
        units: Units,
        epoch: int,
        resume: Mapping[str, Any] | None,
        in_flight: int,
        connections: int | None = None,
        pool: object | None = None,
        owner: str = "the dataset",
        setting: str = "connections",
    ) -> None:
        self.units = units
        self.epoch = epoch
        self.resume = resume
        # The rest of an epoch saved on other ranks (:mod:`._elastic`): its units' records
        # less those consumed; positions count among the records left.
        self.rest: Rest | None = rest_of(type(units).__name__, resume)
        self._gone: Mapping[int, Ranges] = {}  # per unit, its records this rank leaves out
        self.in_flight = in_flight
        self.mixer: Mixer | None = None  # made when the iteration starts
        self.yielded = int(resume["yielded"]) if resume is not None else 0
        self.finished = False
        self._readers: dict[int, _Reader] = {}  # units whose records the mixer takes
        self._others: set[_Reader] = set()  # units read again only for the buffer
        self._held: dict[SampleId, Any] = {}  # read, in the buffer; futures while re-read
        self._connections = connections
        self._pool = pool
        self._names = (owner, setting)
        self._gate = _Gate(connections)  # the pool's shared one once the epoch starts
        self._dropped: set[_Reader] = set()  # readers ahead stopped for another epoch

    def position(self) -> tuple[int, int, list[list[int]]]:
        """``(epoch, records yielded, [[unit, records], ...] of the units that ended)``."""
        ended = [] if self.mixer is None else [[u, n] for u, n in self.mixer.ended.items()]
        return self.epoch, self.yielded, ended

    async def samples(self) -> AsyncIterator[Any]:
        gate = self._gate = _gate_for(self._pool, self._connections)
        try:
            await gate.join(self, self.in_flight, *self._names)
        except BaseException:
            _left(self._pool, gate)
            raise
        try:
            planned = await self.units.start(self.epoch, self.resume)
            if isinstance(planned, Mixer):
                planned = Plan(planned, {})
            mixer = self.mixer = planned.mixer
            self._gone = planned.gone
            tail = self._restore(mixer) if self.resume is not None else []
            self._prefetch(mixer)
            while (want := mixer.want()) is not None:
                unit = want[0]
                record = await self._reader(unit).next()
                out = mixer.put(record is not None)
                if record is None:
                    self._readers.pop(unit, None)
                    self._prefetch(mixer)  # a slot took the next unit: open the one after
                else:
                    self._held[want] = record
                if out is not None:
                    item = await self._take(out)
                    self.yielded += 1
                    yield item
            for out in tail or mixer.drain():
                item = await self._take(out)
                self.yielded += 1
                yield item
            self.finished = True
        finally:
            gate.closing(self)
            try:
                await self._close()
            finally:
                gate.leave(self)
                _left(self._pool, gate)

    def _restore(self, mixer: Mixer) -> list[SampleId]:
        """Replay the mixer to the saved position; start the readers that read again what
        the buffer held and the open units from their positions. Returns the drain's rest."""
        assert self.resume is not None
        counts = {int(unit): int(count) for unit, count in self.resume["ended"]}
        tail = replay(mixer, counts, self.yielded)
        needed: dict[int, set[int]] = {}
        for unit, position in [*mixer.buffer, *tail]:
            needed.setdefault(unit, set()).add(position)
        live = {unit: position for unit, position in mixer.slots}
        for unit in needed.keys() | live.keys():
            claim = SLOT if unit in live else REREAD
            reader = self._start(unit, live.get(unit), needed.get(unit, set()), claim)
            for position in needed.get(unit, ()):
                self._held[(unit, position)] = reader.captured[position]
        return tail

    def _start(
        self, unit: int, live_from: int | None, wanted: set[int], claim: int = SLOT
    ) -> _Reader:
        description, url = self.units.where(unit)
        name = f"aioloader-{self.units.kind}-{redact(url)}"  # tasks' reprs show it
        records = self.units.records(unit)
        gone = self._gone.get(unit)
        if gone:
            records = skipping(records, list(gone))
        ticket = self._gate.ticket(claim)
        reader = _Reader(records, description, url, name, live_from, wanted, self._gate, ticket)
        ticket.drop = lambda: self._drop(unit, reader)
        if live_from is not None:
            self._readers[unit] = reader
        else:
            self._others.add(reader)
        return reader

    def _drop(self, unit: int, reader: _Reader) -> None:
        """Stop ``reader``, of a unit ahead whose permit another epoch needs: the unit is
        opened again when its turn comes (nothing of it was taken)."""
        if self._readers.get(unit) is reader:
            del self._readers[unit]
        reader.task.cancel()
        self._dropped.add(reader)

    def _reader(self, unit: int) -> _Reader:
        reader = self._readers.get(unit)
        return reader if reader is not None else self._start(unit, 0, set())

    def _prefetch(self, mixer: Mixer) -> None:
        """Stream every open unit, and open the units that come next, so their first bytes
        are on the way before a slot frees (a unit's time to first byte is hidden behind the
        others' transfer)."""
        # As many as are open: units of one size opened together end together, and the whole
        # next round must be on its way by then, or the loop waits a time to first byte.
        for unit, _ in mixer.slots:
            reader = self._readers.get(unit)
            if reader is None:
                self._start(unit, 0, set(), SLOT)
            else:
                self._gate.promote(reader.ticket)  # opened ahead, now awaited
        for unit in mixer.upcoming(self.in_flight):
            if unit not in self._readers:
                self._start(unit, 0, set(), AHEAD)

    async def _take(self, sample: SampleId) -> Any:
        held = self._held.pop(sample)
        if isinstance(held, asyncio.Future):
            return await held
        return held

    async def _close(self) -> None:
        readers = [*self._readers.values(), *self._others, *self._dropped]
        self._readers.clear()
        self._others.clear()
        self._dropped.clear()
        for reader in readers:
            reader.task.cancel()
        if readers:
            await asyncio.wait([reader.task for reader in readers], timeout=CLOSING_WAIT_S)
        for reader in readers:
            reader.forget()
        self._held.clear()


class _Reader:
    """Reads one unit's records into a queue (from ``live_from`` on; None: none), and
    resolves the futures of the positions in ``wanted`` (records the buffer held at resume)."""

    def __init__(
        self,
        records: AsyncGenerator[Any, None],
        description: str,
        url: str,
        name: str,
        live_from: int | None,
        wanted: set[int],
        gate: _Gate,
        ticket: _Ticket,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.gate = gate
        self.ticket = ticket
        self.description = description
        self.url = url
        self.queue: asyncio.Queue[Any] = asyncio.Queue(READAHEAD)
        self.captured: dict[int, asyncio.Future[Any]] = {p: loop.create_future() for p in wanted}
        self._live_from = live_from
        self._last = max(wanted, default=-1)
        self._position = 0
        self.task = asyncio.create_task(self._run(records), name=name)

    async def next(self) -> Any:
        """The next record, or None at the unit's end."""
        record = await self.queue.get()
        if isinstance(record, _Raised):
            raise record.error
        return record

    async def _emit(self, record: Any) -> bool:
        """Pass on the record at the current position; False once nothing more is needed."""
        position = self._position
        self._position += 1
        future = self.captured.get(position)
        if future is not None and not future.done():
            future.set_result(record)
        if self._live_from is not None:
            if position >= self._live_from:
                await self.queue.put(record)
            return True
        return self._position <= self._last

    async def _run(self, records: AsyncGenerator[Any, None]) -> None:
        try:
            try:
                async with contextlib.aclosing(records):
                    await self.gate.acquire(self.ticket)  # before the unit's first byte
                    async for record in records:
                        if not await self._emit(record):
                            return self._end(None)
            finally:
                self.gate.release(self.ticket)  # the unit is closed, its connection free
        except Exception as exc:
            # A records generator yields its failures as records; one that raises has a bug.
            # Its unit's turn raises it (the epoch fails there, with everything before it
            # delivered), rather than leaving the mixer waiting for a record forever.
            if self._live_from is not None:
                await self.queue.put(_Raised(exc))
            return self._end(exc)
        if self._live_from is not None:
            await self.queue.put(None)
        self._end(None)

    def _end(self, error: BaseException | None) -> None:
        for position, future in self.captured.items():
            if future.done():
                continue
            if error is not None:
                future.set_exception(error)
                continue
            future.set_exception(
                ShardError(
                    f"{self.description} has only {self._position} samples now, but the state "
                    f"being resumed holds its sample {position}: it changed since the state "
                    "was saved",
                    url=self.url,
                )
            )

    def forget(self) -> None:
        """Mark failures nobody will await as seen (no 'exception never retrieved')."""
        for future in self.captured.values():
            if future.done() and not future.cancelled():
                future.exception()
            else:
                future.cancel()


class UnitStream:
    """What a stream read unit by unit (tar shards, Parquet row groups) does the same way: the
    epoch and the rank the loader sets, where its iteration stands (``state_dict``), picking
    that up again, and starting an epoch. A subclass sets ``_epoch`` (0), ``_rank`` ((0, 1)),
    ``_resume`` and ``_current`` (None)."""

    _epoch: int
    _rank: tuple[int, int]
    _resume: dict[str, Any] | None
    _current: Epoch | None

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (its unit order and shuffle). Each
        iteration moves the epoch on by one by itself; the loader sets it before each."""
        self._epoch = non_negative_int("epoch", epoch)
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None  # another epoch was asked for: the saved position is moot

    def set_rank(self, rank: int, world_size: int) -> None:
        """Read rank ``rank``'s share of the units (of ``world_size``) from the next iteration
        on; the loader calls it when it shards by rank."""
        world_size = positive_int("world_size", world_size)
        rank = non_negative_int("rank", rank)
        if rank >= world_size:
            raise ValueError(f"rank must be below world_size={world_size}, got {rank}")
        self._rank = (rank, world_size)

    def _position(self, version: int) -> dict[str, Any]:
        """The common part of ``state_dict``: after what the current (or last) iteration
        yielded; between iterations, or after one ran to its end, the next epoch's start; a
        state loaded and not yet begun, that state's position."""
        run, resume = self._current, self._resume
        if resume is not None:  # loaded, not begun: saving again keeps it
            epoch, yielded, ended, rest = (
                resume["epoch"],
                resume["yielded"],
                resume["ended"],
                resume.get("rest"),
            )
        elif run is not None and not run.finished:
            epoch, yielded, ended = run.position()
            rest = None if run.rest is None else run.rest.state()
        else:
            epoch, yielded, ended, rest = self._epoch, 0, [], None
        return {
            "version": version,
            "epoch": epoch,
            "yielded": yielded,
            "ended": ended,
            "rest": rest,
        }

    def _resume_from(self, state: Mapping[str, Any]) -> None:
        """The common end of ``load_state_dict``, once the state was checked against this
        dataset: the next iteration continues from it."""
        self._epoch = non_negative_int("state 'epoch'", state["epoch"])
        yielded = non_negative_int("state 'yielded'", state["yielded"])
        owner = type(self).__name__
        rest_of(owner, state)  # checked here, not at the next iteration
        if state.get("rank") is None and (yielded or state["ended"]):
            raise ValueError(
                f"{owner}.load_state_dict: the state says {yielded} records were yielded but "
                "names no rank: a rank's own state names its rank, a merged one (of every "
                "rank's, aioloader.distributed.merge_states) yields nothing yet"
            )
        self._resume = dict(state)

    def _start(
        self,
        owner: str,
        units: Units,
        in_flight: int,
        connections: int | None = None,
        pool: object | None = None,
        setting: str = "connections",
    ) -> AsyncIterator[Any]:
        """The next epoch's samples (``__aiter__``): from the saved state if one was loaded,
        checked against the rank the loader has told by now; ``connections``, ``pool`` and
        ``setting`` as :class:`Epoch`'s."""
        epoch = self._epoch
        resume, self._resume = self._resume, None
        if resume is not None and resume.get("rank") is not None:
            # A rank's own state resumes that rank; every rank's, merged, resumes any ranks.
            saved = list(resume["rank"])
            if saved != list(self._rank):
                raise ValueError(
                    f"{owner}.load_state_dict: the state was saved with rank={saved!r}, this "
                    f"dataset has rank={list(self._rank)!r}: a rank's own state resumes only "
                    "that rank's share. To resume on another number of ranks, merge every "
                    "rank's state into one (aioloader.distributed.merge_states) and load that "
                    "on every new rank"
                )
        self._epoch = epoch + 1
        run = Epoch(units, epoch, resume, in_flight, connections, pool, owner, setting)
        self._current = run
        return run.samples()
