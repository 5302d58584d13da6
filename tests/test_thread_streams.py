"""Streams read by the loader's own threads (``num_workers=0``, ``thread_pool=True``) fail as
streams read by worker processes do (RELIABILITY.md rows 5 and 7): the error names its batch,
a stream that cannot be opened fails once per reader, and a stream that hangs ends its epoch
with the timeout error instead of a wait without end.

Every wait here is bounded: a ``next()`` that might hang runs in a thread joined with a bound,
and a hung stream is released before its loader closes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from datasets import BLOCK_BOUND_S, Stream
from helpers import BOUND_S, notes_of

from aioloader import DataLoader, LoaderTimeoutError

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")

THREADS = [{}, {"num_workers": 2, "thread_pool": True}]
THREAD_IDS = ["helper-thread", "thread-pool"]


def outcomes(it: Iterator[Any], limit: int = 20) -> list[Any]:
    """What each ``next(it)`` gives until the end: a batch as a list, or its error."""
    seen: list[Any] = []
    for _ in range(limit):
        try:
            batch = next(it)
            seen.append(batch if isinstance(batch, list) else batch.tolist())
        except StopIteration:
            return seen
        except Exception as exc:
            seen.append(exc)
    raise AssertionError(f"no end after {limit} steps: {seen}")


@pytest.mark.parametrize("kwargs", THREADS, ids=THREAD_IDS)
def test_a_streams_error_names_its_batch_and_thread(kwargs: dict[str, Any]) -> None:
    # With workers the error said "in the stream of worker 0 (pid ...), making batch 2"; on
    # the loader's threads it carried no note at all.
    with DataLoader(Stream(10, fail_at=4), batch_size=3, **kwargs) as loader:
        seen = outcomes(iter(loader))
    assert seen[:2] == [[0, 1, 2], [3]]  # what came before, delivered first
    [error] = seen[2:]
    assert isinstance(error, OSError)  # the stream's own type
    assert "in the stream, read by loader thread aioloader-" in notes_of(error)
    assert "making batch 2" in notes_of(error)


def collate_fails(samples: list[int]) -> list[int]:
    if 4 in samples:
        raise ValueError("cannot collate 4")
    return samples


def test_a_stream_batch_named_by_its_collate_error_is_not_named_twice() -> None:
    with DataLoader(Stream(6), batch_size=3, collate_fn=collate_fails) as loader:
        seen = outcomes(iter(loader))
    assert seen[0] == [0, 1, 2]
    [error] = seen[1:]
    assert isinstance(error, ValueError)
    notes = notes_of(error)
    assert "while collating batch 1" in notes
    assert "read by loader thread" in notes
    assert notes.count("batch 1") == 1


class NotAnIterator:
    """An iterable dataset whose ``__iter__`` returns something that is not an iterator."""

    def __iter__(self) -> Any:
        return 5


@pytest.mark.parametrize("kwargs", THREADS, ids=THREAD_IDS)
def test_a_stream_that_cannot_be_opened_fails_once_per_reader(kwargs: dict[str, Any]) -> None:
    # Its TypeError came twice: each request already on its way opened the stream again.
    with DataLoader(NotAnIterator(), batch_size=3, **kwargs) as loader:
        for _ in range(2):  # and so every epoch
            seen = outcomes(iter(loader))
            assert [type(e) for e in seen] == [TypeError], seen
            assert "non-iterator" in str(seen[0])


class HangsAfter:
    """Yields ``0 .. n-1``, but blocks before item ``at`` until ``release`` is set."""

    def __init__(self, n: int, at: int) -> None:
        self.n, self.at = n, at
        self.release = threading.Event()

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            if i == self.at:
                self.release.wait(BLOCK_BOUND_S)
            yield i


def bounded_next(it: Iterator[Any]) -> Any:
    """``next(it)`` in a thread joined within :data:`BOUND_S`: its batch, or its error."""
    result: list[Any] = []

    def call() -> None:
        try:
            result.append(next(it))
        except BaseException as exc:
            result.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    caller.join(BOUND_S)
    assert not caller.is_alive(), "next() still waits"
    return result[0]


@pytest.mark.parametrize("kwargs", THREADS, ids=THREAD_IDS)
def test_a_hung_stream_ends_its_epoch_with_the_timeout_error(kwargs: dict[str, Any]) -> None:
    # The next() after the LoaderTimeoutError waited for ever: the batches queued behind the
    # hung one on the thread never began, so no deadline of theirs ran.
    dataset = HangsAfter(20, at=2)
    loader = DataLoader(dataset, batch_size=2, timeout=0.05, prefetch=3, **kwargs)
    try:
        it = iter(loader)
        assert bounded_next(it).tolist() == [0, 1]
        error = bounded_next(it)
        assert isinstance(error, LoaderTimeoutError), repr(error)
        assert "batch 1" in str(error)
        assert "ends here" in notes_of(error)  # the stream is not read past it
        rest = []  # then the end of the epoch, not a wait without end
        while not isinstance(outcome := bounded_next(it), StopIteration):
            rest.append(outcome)
            assert len(rest) < 3, rest
        # Threads of a pool waiting for the stuck one's stream were running: their batches
        # may time out too, each named; the helper thread's queued batches just end.
        assert all(isinstance(e, LoaderTimeoutError) for e in rest), rest
        if not kwargs:
            assert rest == []
    finally:
        dataset.release.set()  # the stuck thread finishes its read, and the loader can close
        loader.close()


def test_with_worker_processes_a_stream_that_cannot_be_opened_fails_once_per_worker() -> None:
    # Each worker is a reader of its own copy: one error from each, then the end.
    with DataLoader(NotAnIterator(), batch_size=3, num_workers=2) as loader:
        seen = outcomes(iter(loader))
    assert [type(e) for e in seen] == [TypeError, TypeError], seen
