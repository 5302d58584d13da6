"""Tests of aioloader._epoch._reorder: the pure reorder state machine, without an event loop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader._epoch._reorder import Outcome, ReorderBuffer

relaxed = settings(deadline=None, max_examples=60)


def _drain_ready(buffer: ReorderBuffer) -> list[Outcome]:
    out = []
    while (outcome := buffer.pop_ready()) is not None:
        out.append(outcome)
    return out


@relaxed
@given(data=st.data(), n=st.integers(0, 40))
def test_any_completion_order_leaves_in_expect_order(data: st.DataObject, n: int) -> None:
    # The ids are expected in a shuffled order too: the buffer must follow expect(), not sort.
    expected = data.draw(st.permutations(range(n)), label="expect order")
    completion = data.draw(st.permutations(expected), label="completion order")
    buffer = ReorderBuffer(in_order=True)
    for batch_id in expected:
        buffer.expect(batch_id)
    popped: list[int] = []
    for batch_id in completion:
        buffer.put_nowait(Outcome(batch_id, value=f"v{batch_id}"))
        for outcome in _drain_ready(buffer):
            assert outcome.value == f"v{outcome.batch_id}"
            popped.append(outcome.batch_id)
        # Everything before the first missing id has left; nothing after it has.
        done = set(completion[: completion.index(batch_id) + 1])
        prefix = 0
        while prefix < n and expected[prefix] in done:
            prefix += 1
        assert popped == expected[:prefix]
        assert buffer.waiting == len(done) - prefix
        assert buffer.pending == n - len(done)
    assert popped == expected
    assert len(buffer) == 0
    assert buffer.pop_ready() is None


@relaxed
@given(data=st.data(), n=st.integers(0, 40))
def test_not_in_order_leaves_in_completion_order(data: st.DataObject, n: int) -> None:
    completion = data.draw(st.permutations(range(n)))
    buffer = ReorderBuffer(in_order=False)
    for batch_id in range(n):
        buffer.expect(batch_id)
    popped: list[int] = []
    for batch_id in completion:
        assert buffer.pop_ready() is None  # nothing finished that was not taken yet
        buffer.put_nowait(Outcome(batch_id, value=batch_id))
        assert buffer.is_ready()
        popped.extend(o.batch_id for o in _drain_ready(buffer))
    assert popped == completion


@relaxed
@given(data=st.data(), n=st.integers(1, 30))
def test_not_in_order_with_several_waiting_pops_oldest_first(data: st.DataObject, n: int) -> None:
    completion = data.draw(st.permutations(range(n)))
    buffer = ReorderBuffer(in_order=False)
    for batch_id in range(n):
        buffer.expect(batch_id)
    for batch_id in completion:
        buffer.put_nowait(Outcome(batch_id))
    assert [o.batch_id for o in _drain_ready(buffer)] == completion


@relaxed
@given(data=st.data(), n=st.integers(1, 30), in_order=st.booleans())
def test_errors_pass_through_in_their_turn(data: st.DataObject, n: int, in_order: bool) -> None:
    failing = set(data.draw(st.sets(st.integers(0, n - 1))))
    completion = data.draw(st.permutations(range(n)))
    buffer = ReorderBuffer(in_order=in_order)
    errors = {i: KeyError(i) for i in failing}
    for batch_id in range(n):
        buffer.expect(batch_id)
    popped = []
    for batch_id in completion:
        if batch_id in failing:
            buffer.put_nowait(Outcome(batch_id, error=errors[batch_id]))
        else:
            buffer.put_nowait(Outcome(batch_id, value=batch_id))
        popped.extend(_drain_ready(buffer))
    assert [o.batch_id for o in popped] == (list(range(n)) if in_order else completion)
    for outcome in popped:
        if outcome.batch_id in failing:
            assert outcome.error is errors[outcome.batch_id]  # the very object, untouched
            assert outcome.value is None
        else:
            assert outcome.error is None
            assert outcome.value == outcome.batch_id


@pytest.mark.parametrize("in_order", [True, False])
def test_peek_does_not_remove(in_order: bool) -> None:
    buffer = ReorderBuffer(in_order=in_order)
    assert buffer.peek_ready() is None
    for batch_id in range(3):
        buffer.expect(batch_id)
    buffer.put_nowait(Outcome(1, value="one"))
    if in_order:
        assert buffer.peek_ready() is None  # 0 is the head and has not arrived
        assert not buffer.is_ready()
        assert buffer.head() == 0
    else:
        assert buffer.peek_ready() == Outcome(1, value="one")
    buffer.put_nowait(Outcome(0, value="zero"))
    first = buffer.peek_ready()
    assert first is not None
    assert buffer.peek_ready() is first  # peeking twice sees the same outcome
    assert buffer.pop_ready() is first
    assert buffer.waiting == 1


def test_pop_on_empty_and_head() -> None:
    buffer = ReorderBuffer()
    assert buffer.pop_ready() is None
    assert buffer.head() is None
    assert not buffer.is_ready()
    buffer.expect(7)
    buffer.expect(3)
    assert buffer.head() == 7
    assert buffer.pending == 2
    assert buffer.waiting == 0
    buffer.put_nowait(Outcome(3))
    assert buffer.head() == 7
    assert (buffer.pending, buffer.waiting, len(buffer)) == (1, 1, 2)
    assert buffer.pop_ready() is None


def test_drain_returns_stored_outcomes_and_forgets_everything() -> None:
    buffer = ReorderBuffer()
    for batch_id in range(4):
        buffer.expect(batch_id)
    buffer.put_nowait(Outcome(2, value="two"))
    buffer.put_nowait(Outcome(3, error=ValueError("three")))
    drained = buffer.drain()
    assert sorted(o.batch_id for o in drained) == [2, 3]
    assert (len(buffer), buffer.pending, buffer.waiting) == (0, 0, 0)
    assert buffer.pop_ready() is None
    # The ids are free again: a new epoch may reuse them.
    buffer.expect(0)
    buffer.put_nowait(Outcome(0, value="again"))
    assert buffer.pop_ready() == Outcome(0, value="again")


def test_protocol_violations_are_refused() -> None:
    buffer = ReorderBuffer()
    with pytest.raises(KeyError, match="batch 5"):
        buffer.put_nowait(Outcome(5))  # never expected
    buffer.expect(5)
    with pytest.raises(ValueError, match="batch 5"):
        buffer.expect(5)  # expected twice
    buffer.put_nowait(Outcome(5))
    with pytest.raises(KeyError, match="batch 5"):
        buffer.put_nowait(Outcome(5))  # a second outcome
    with pytest.raises(ValueError, match="batch 5"):
        buffer.expect(5)  # stored, not yet popped: still in use
    assert buffer.pop_ready() == Outcome(5)
    with pytest.raises(KeyError):
        buffer.put_nowait(Outcome(5))  # popped: over


def test_repr_shows_state() -> None:
    buffer = ReorderBuffer(in_order=False)
    buffer.expect(4)
    buffer.expect(5)
    buffer.put_nowait(Outcome(5))
    text = repr(buffer)
    assert "in_order=False" in text
    assert "head=4" in text
    assert "pending=1" in text
    assert "waiting=1" in text
