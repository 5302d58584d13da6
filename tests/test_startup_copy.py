"""Start-up against the dataset object's size: a dataset copy whose pickle stream is large (a
dataset holding many ``bytes`` objects, which pickle in the stream, never out of band) goes into
shared memory with the copy's buffers instead of through every worker's pipe, the job a worker
gets stays a few hundred bytes, the worker unmaps the stream once it is loaded, and the workers
that unpickle it take turns, at most as many at once as there are CPUs (``_shm.turn``), a dead
holder's turn freed by its death.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import BOUND_S

from aioloader import DataLoader, _shm
from aioloader._workers import _payload, _records
from aioloader._workers._payload import STREAM_IN_SEGMENT_MIN_BYTES, dumps_copy, loads

CHUNK = 64 * 1024
COUNT = STREAM_IN_SEGMENT_MIN_BYTES // CHUNK * 3  # 3 MiB of bytes objects


class Chunks:
    """A dataset holding its samples as ``bytes`` objects of 64 KiB (the start-up benchmark's)."""

    def __init__(self, n: int) -> None:
        self.chunks = [bytes([i % 251]) * CHUNK for i in range(n)]

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, index: int) -> int:
        return self.chunks[index][0]


def mapped(name: str) -> bool:
    return name in Path("/proc/self/maps").read_text()


def test_a_large_stream_travels_in_the_segment_and_the_job_stays_small() -> None:
    dataset = Chunks(COUNT)
    payload = dumps_copy(dataset, main_by_value=False)
    try:
        assert payload.segment is not None
        assert payload.stream is not None
        assert payload.data == b""
        assert payload.stream[1] > COUNT * CHUNK  # every chunk is in the segment's stream
        job = pickle.dumps(_records.LoadJob(payload, 0))
        assert len(job) < 4096  # what goes through a worker's pipe
        copy = loads(pickle.loads(job).payload)
        assert copy.chunks == dataset.chunks
        assert not mapped(payload.segment)  # read, then unmapped: nothing of it is kept
    finally:
        payload.release()
    assert payload.segment not in os.listdir(_shm.SHM_DIR)


def test_without_room_in_shared_memory_a_large_stream_goes_through_the_pipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_payload, "OUT_OF_BAND_SHARE", 0.0)
    dataset = Chunks(COUNT)
    payload = dumps_copy(dataset, main_by_value=False)
    assert payload.segment is None
    assert payload.stream is None
    assert len(payload.data) > COUNT * CHUNK
    assert loads(payload).chunks == dataset.chunks


def test_workers_load_a_large_stream_from_shared_memory_and_every_sample_is_right() -> None:
    dataset = Chunks(COUNT)
    with DataLoader(dataset, batch_size=4, num_workers=2) as loader:
        for _ in range(2):  # the second epoch loads a fresh copy
            values = [int(v) for batch in loader for v in batch]
            assert values == [i % 251 for i in range(COUNT)]


# -- turns -------------------------------------------------------------------------------------

HOLDER = """
import sys
from aioloader import _shm
with _shm.turn(sys.argv[1], int(sys.argv[2])):
    print("in", flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def segment() -> Iterator[str]:
    name, mapping = _shm.create_segment(_shm.page_round(1), _shm.SHM_DIR)
    del mapping
    try:
        yield name
    finally:
        _shm.unlink(name)


def holder(name: str, turns: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, name, str(turns)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def said_in(process: subprocess.Popen[str], within: float) -> bool:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], within)
    return bool(ready) and process.stdout.readline().strip() == "in"


def finish(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.close()
    process.wait(BOUND_S)
    if process.stdout is not None:
        process.stdout.close()


def test_one_turn_is_held_by_one_process_at_a_time(segment: str) -> None:
    with _shm.turn(segment, 1):
        waiting = holder(segment, 1)
        try:
            # Its interpreter starts in well under this; it must still be waiting for the turn.
            assert not said_in(waiting, 3.0)
        except BaseException:
            waiting.kill()
            finish(waiting)
            raise
    try:
        assert said_in(waiting, BOUND_S)  # the turn came free with the block's end
    finally:
        finish(waiting)


def test_a_second_turn_lets_a_second_process_in_at_once(segment: str) -> None:
    with _shm.turn(segment, 2):
        second = holder(segment, 2)
        try:
            assert said_in(second, BOUND_S)
        finally:
            finish(second)


def test_a_turn_held_by_a_process_that_died_is_free(segment: str) -> None:
    killed = holder(segment, 1)
    try:
        assert said_in(killed, BOUND_S)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(BOUND_S)
    finally:
        finish(killed)
    entered = threading.Event()

    def take() -> None:
        with _shm.turn(segment, 1):
            entered.set()

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert entered.is_set()
