"""Start-up against the dataset object's size: a dataset copy whose pickle stream is large (a
dataset holding many ``bytes`` objects, which pickle in the stream, never out of band) goes into
shared memory with the copy's buffers instead of through every worker's pipe, the job a worker
gets stays a few hundred bytes, the worker unmaps the stream once it is loaded, and the workers
that unpickle it take turns, at most as many at once as there are CPUs (``_shm.turn``), a dead
holder's turn freed by its death.
"""

from __future__ import annotations

import errno
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import BOUND_S

from aioloader import DataLoader, _shm
from aioloader._shm import _segment as _shm_segment
from aioloader._workers import _copy, _payload, _records, _worker
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
    mine = f"{_shm.SHM_PREFIX}{os.getpid()}_"
    before = {n for n in os.listdir(_shm.SHM_DIR) if n.startswith(mine)}
    with DataLoader(dataset, batch_size=4, num_workers=2) as loader:
        for _ in range(2):  # the second epoch loads a fresh copy
            values: list[int] = []
            for batch in loader:
                if not values:  # batches of ints travel inline: a segment now is the copy's
                    now = {n for n in os.listdir(_shm.SHM_DIR) if n.startswith(mine)}
                    assert now - before
                values.extend(int(v) for v in batch)
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


class FakeTime:
    """A clock that a sleep moves on, with something to do at each sleep (no real waiting)."""

    def __init__(self, on_sleep: Callable[[int], None] = lambda n: None) -> None:
        self.now = 0.0
        self.sleeps = 0
        self.on_sleep = on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        self.on_sleep(self.sleeps)


def test_one_turn_is_held_by_one_process_at_a_time_and_a_waiter_goes_on_past_the_limit(
    segment: str,
) -> None:
    taken = holder(segment, 1)
    try:
        assert said_in(taken, BOUND_S)
        fake = FakeTime()
        told: list[bool] = []
        with _shm.turn(
            segment, 1, wait_s=5.0, waiting=told.append, clock=fake.clock, sleep=fake.sleep
        ) as held:
            assert not held  # the holder kept it: past the limit, in without a turn
        assert fake.now >= 5.0
        assert fake.sleeps >= 5.0 / _shm_segment.TURN_POLL_S
        assert told == [True, False]
    finally:
        finish(taken)
    with _shm.turn(segment, 1, clock=fake.clock, sleep=fake.sleep) as held:
        assert held  # the turn came free with the holder's end, at once
    assert fake.now >= 5.0


def test_a_waiter_takes_whichever_turn_comes_free(segment: str) -> None:
    first, second = holder(segment, 2), holder(segment, 2)
    try:
        assert said_in(first, BOUND_S)
        assert said_in(second, BOUND_S)

        def free_one(sleeps: int) -> None:
            if sleeps == 1:
                finish(second)  # whichever byte it held; the first holder keeps the other

        fake = FakeTime(free_one)
        with _shm.turn(segment, 2, wait_s=BOUND_S, clock=fake.clock, sleep=fake.sleep) as held:
            assert held
        assert fake.sleeps == 1
    finally:
        finish(first)
        finish(second)


def test_an_error_in_the_block_is_not_chained_to_a_missing_segment() -> None:
    def in_the_block() -> None:
        with _shm.turn("aiol_0_gone", 1) as held:
            assert not held
            raise ValueError("in the block")

    with pytest.raises(ValueError, match="in the block") as caught:
        in_the_block()
    assert caught.value.__context__ is None


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


# -- a worker's load waits for a turn, its start clock stopped --------------------------------


def test_loads_waits_for_a_turn_another_process_holds_with_the_start_clock_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_payload, "_turns", lambda: 1)  # one CPU's worth: a single turn
    dataset = Chunks(COUNT)
    payload = dumps_copy(dataset, main_by_value=False)
    assert payload.segment is not None
    assert payload.stream is not None
    loading = [123.0]  # the worker's start clock: when its load began
    state = _worker._WorkerState(0, 2, 0, False, None, loading, None, None)  # type: ignore[arg-type]
    waited, loaded = threading.Event(), threading.Event()
    result: list[Chunks] = []

    def waiting(wait: bool) -> None:
        state.waiting_for_turn(wait)
        if wait:
            waited.set()

    def load() -> None:
        result.append(loads(payload, waiting=waiting))
        loaded.set()

    taken = holder(payload.segment, 1)
    try:
        assert said_in(taken, BOUND_S)
        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        assert waited.wait(BOUND_S)
        # Waiting behind the holder is not this worker's load: its start clock is stopped.
        assert loading == [0.0]
        assert not loaded.is_set()
    finally:
        finish(taken)
    try:
        thread.join(BOUND_S)
        assert loaded.is_set()
        assert result[0].chunks == dataset.chunks
        assert loading[0] > 0.0  # it began once the turn was held
    finally:
        payload.release()


# -- where the copy goes when shared memory is short --------------------------------------------


class ChunksAndArray(Chunks):
    """Bytes objects (in the stream) beside an array (out of band)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.array = np.arange(ARRAY_BYTES // 8, dtype=np.int64)


ARRAY_BYTES = 2 * _payload.OUT_OF_BAND_MIN_BYTES


def test_with_room_for_the_buffers_only_they_stay_in_shared_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # /dev/shm as tight as a container's: room (OUT_OF_BAND_SHARE of it) for the array's
    # segment, not for the array and the stream together.
    room = ARRAY_BYTES + _shm.page_round(1)
    monkeypatch.setattr(_shm, "free_bytes", lambda *_: int(room / _payload.OUT_OF_BAND_SHARE))
    dataset = ChunksAndArray(COUNT)
    payload = dumps_copy(dataset, main_by_value=False)
    try:
        assert payload.segment is not None  # the array, mapped by each worker, not copied
        assert payload.stream is None
        assert COUNT * CHUNK < len(payload.data) < COUNT * CHUNK + ARRAY_BYTES
        copy = loads(payload)
        assert copy.chunks == dataset.chunks
        assert np.array_equal(copy.array, dataset.array)
    finally:
        payload.release()


def test_a_stream_whose_segment_finds_no_room_goes_through_the_pipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_room(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    before = set(os.listdir(_shm.SHM_DIR))
    monkeypatch.setattr(os, "posix_fallocate", no_room)
    dataset = Chunks(COUNT)
    payload = dumps_copy(dataset, main_by_value=False)
    assert payload.segment is None
    assert len(payload.data) > COUNT * CHUNK
    assert loads(payload).chunks == dataset.chunks
    assert set(os.listdir(_shm.SHM_DIR)) <= before  # the segment that had no room is gone


# -- what a worker keeps of the segment after the load ----------------------------------------


def rss_of(name: str) -> int | None:
    """Resident bytes of this process's mapping of segment ``name`` (None if not mapped)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or (line[:1] in "abcdef" and "-" in line.split(" ", 1)[0]):
            inside = name in line
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) * 1024
    return None


def test_the_streams_pages_leave_memory_once_loaded_while_the_buffers_stay_mapped() -> None:
    dataset = ChunksAndArray(COUNT)
    payload = dumps_copy(dataset, main_by_value=False)
    try:
        assert payload.segment is not None
        assert payload.stream is not None
        copy = loads(payload)
        rss = rss_of(payload.segment)
        assert rss is not None  # the array lives on the mapping
        assert rss < payload.stream[1] // 4  # the stream (3 MiB), read once, is not resident
        assert copy.chunks == dataset.chunks
        assert np.array_equal(copy.array, dataset.array)
        del copy
        assert not mapped(payload.segment)
    finally:
        payload.release()


class Failing(ChunksAndArray):
    def __setstate__(self, state: dict[str, object]) -> None:
        raise RuntimeError("cannot load this copy")


def test_a_failed_load_keeps_no_mapping_in_its_traceback() -> None:
    payload = dumps_copy(Failing(COUNT), main_by_value=False)
    try:
        assert payload.segment is not None
        with pytest.raises(RuntimeError) as caught:
            loads(payload)
        kept = caught.value  # as a worker keeps it, to report at its next jobs
        assert "__setstate__" in "".join(traceback.format_tb(kept.__traceback__))  # lines kept
        assert not mapped(payload.segment)
    finally:
        payload.release()


# -- a copy whose segment vanished ----------------------------------------------------------------


async def test_a_copy_whose_segment_vanished_is_pickled_again_for_the_next_job() -> None:
    dataset = Chunks(COUNT)
    copy = _copy.DatasetCopy(lambda: dumps_copy(dataset, main_by_value=False), 0)
    try:
        job = await copy.job()
        gone = job.payload.segment
        assert gone is not None
        os.unlink(os.path.join(_shm.SHM_DIR, gone))  # ours: as a cleanup of /dev/shm would
        again = await copy.job()
        assert again.payload.segment not in (None, gone)
        assert loads(again.payload).chunks == dataset.chunks
        assert (await copy.job()).payload is again.payload  # pickled once, not per job
    finally:
        copy.release()
    assert again.payload.segment not in os.listdir(_shm.SHM_DIR)


class KillsItsWorkerOnce(Chunks):
    """Kills the worker that reads ``index`` the first time (a marker file says it did)."""

    def __init__(self, n: int, index: int, marker: Path) -> None:
        super().__init__(n)
        self.index, self.marker = index, str(marker)

    def __getitem__(self, index: int) -> int:
        if index == self.index:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


def test_a_replacement_worker_starts_after_the_copys_segment_was_removed(tmp_path: Path) -> None:
    dataset = KillsItsWorkerOnce(COUNT, COUNT - 8, tmp_path / "killed")
    mine = f"{_shm.SHM_PREFIX}{os.getpid()}_"
    before = {n for n in os.listdir(_shm.SHM_DIR) if n.startswith(mine)}
    with DataLoader(dataset, batch_size=4, num_workers=1, prefetch=2, max_retries=1) as loader:
        values: list[int] = []
        for batch in loader:
            if not values:  # the worker has loaded the copy: /dev/shm is emptied of it
                copies = {n for n in os.listdir(_shm.SHM_DIR) if n.startswith(mine)} - before
                assert copies  # the copy's stream is in a segment of this process
                for name in copies:  # as a cleanup script would: the loader unregisters it
                    os.unlink(os.path.join(_shm.SHM_DIR, name))
            values.extend(int(v) for v in batch)
    assert (tmp_path / "killed").exists()  # the worker was killed, and replaced
    assert values == [i % 251 for i in range(COUNT)]
