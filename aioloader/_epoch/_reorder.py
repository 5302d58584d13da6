"""ReorderBuffer: batches arrive in any order, leave in sampler order (or as completed).

A pure, synchronous state machine (no event loop, no clock of its own), in the manner of
httpcore's connection pool: the loader does the waiting and the IO, this module only decides
what is ready. That keeps every rule testable without a loop::

    producer tasks ──put_nowait(batch_id, outcome)──▶ ReorderBuffer ──pop_ready()──▶ consumer
                     expect(batch_id) at schedule       (dict by id)    next in order, or
                                                                         any, if not in_order

An *outcome* is either a value or an exception; the buffer does not look inside. Memory is
bounded by the caller: at most ``prefetch`` batches are ever expected-but-not-popped, because a
batch is expected only after its permit was taken, and the permit is returned only once the batch
is popped.

Invariant: every expected batch id is either pending (scheduled, no outcome yet), done (outcome
stored, not yet popped), or popped; the three sets are disjoint and ids are popped at most once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

__all__ = ["Outcome", "ReorderBuffer"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """The result of one batch: ``value`` on success, else ``error``."""

    batch_id: int
    value: Any = None
    error: BaseException | None = None


class ReorderBuffer:
    """Holds finished batches until their turn.

    Args:
        in_order: yield strictly in the order of :meth:`expect` calls (sampler order); when
            False, yield whichever finished batch arrived first.
    """

    def __init__(self, *, in_order: bool = True) -> None:
        self._in_order = in_order
        self._order: deque[int] = deque()  # expected ids, in schedule order, not yet popped
        self._pending: set[int] = set()
        self._done: dict[int, Outcome] = {}  # insertion order = completion order

    def expect(self, batch_id: int) -> None:
        """Register that ``batch_id`` has been scheduled; its place in the order is now fixed."""
        if batch_id in self._pending or batch_id in self._done:
            raise ValueError(f"batch {batch_id} is already expected")
        self._order.append(batch_id)
        self._pending.add(batch_id)

    def put_nowait(self, outcome: Outcome) -> None:
        """Store the outcome of a scheduled batch.

        Raises:
            KeyError: the batch was never expected, or already has an outcome.
        """
        batch_id = outcome.batch_id
        if batch_id not in self._pending:
            raise KeyError(f"batch {batch_id} was not expected or already has an outcome")
        self._pending.remove(batch_id)
        self._done[batch_id] = outcome

    def head(self) -> int | None:
        """The batch id the consumer waits for next (in order), or None if nothing is expected."""
        return self._order[0] if self._order else None

    def pop_ready(self) -> Outcome | None:
        """The next outcome whose turn it is, or None if it has not arrived yet."""
        if not self._order:
            return None
        if self._in_order:
            head = self._order[0]
            outcome = self._done.pop(head, None)
            if outcome is not None:
                self._order.popleft()
            return outcome
        if not self._done:
            return None
        batch_id = next(iter(self._done))
        outcome = self._done.pop(batch_id)
        self._order.remove(batch_id)
        return outcome

    def peek_ready(self) -> Outcome | None:
        """What :meth:`pop_ready` would return, without removing it."""
        if not self._order:
            return None
        if self._in_order:
            return self._done.get(self._order[0])
        return next(iter(self._done.values()), None)

    def ready_run(self) -> list[Outcome]:
        """What :meth:`pop_ready` would return one after the other if nothing more arrived:
        the stored outcomes from the head on, up to the first still pending (in order), or
        all of them (as completed)."""
        if not self._in_order:
            return list(self._done.values())
        run = []
        for batch_id in self._order:
            outcome = self._done.get(batch_id)
            if outcome is None:
                break
            run.append(outcome)
        return run

    def is_ready(self) -> bool:
        """Whether :meth:`pop_ready` would return an outcome now."""
        if self._in_order:
            return bool(self._order) and self._order[0] in self._done
        return bool(self._done)

    def drain(self) -> list[Outcome]:
        """Remove and return every stored outcome (used on close, so slots can be released)."""
        done = list(self._done.values())
        self._done.clear()
        self._pending.clear()
        self._order.clear()
        return done

    def holds_only(self, value: Any) -> bool:
        """Whether every expected outcome has arrived and each is ``value`` (or none is left)."""
        return not self._pending and all(o.value is value for o in self._done.values())

    @property
    def pending(self) -> int:
        """Batches scheduled whose outcome has not arrived."""
        return len(self._pending)

    @property
    def waiting(self) -> int:
        """Batches finished but not yet taken (waiting for their turn or for the consumer)."""
        return len(self._done)

    def __len__(self) -> int:
        return len(self._order)

    def __repr__(self) -> str:
        return (
            f"<ReorderBuffer in_order={self._in_order} head={self.head()} "
            f"pending={self.pending} waiting={self.waiting}>"
        )
