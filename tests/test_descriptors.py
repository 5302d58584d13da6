"""A live batch holds no file descriptor (RELIABILITY.md row 22).

A segment's descriptor is closed as soon as it is mapped, in the main process (the pool) and in
the workers (their attach cache), so ``list(loader)`` may hold far more batches than
``ulimit -n`` allows files. Where descriptors do run out anyway (a dataset that leaks open
files, worker start-up under a tiny limit, a worker that cannot open a slot), the batch is not
lost: it travels inline, or the error names the batch and the ``ulimit -n`` fix.

Limits are set in a child process (or, for one worker, by the dataset inside that worker), so
the test process keeps its own.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
from datasets import FdReport
from helpers import notes_of
from procs import no_worker_left_behind

from aioloader import DataLoader, _shm

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TESTS_DIR)
BOUND_S = 30.0

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@needs_proc
@no_worker_left_behind()
def test_workers_and_the_main_process_hold_no_descriptor_per_batch() -> None:
    # Every batch is held, so each needs a new segment: created and mapped by the main
    # process, attached by a worker. Neither keeps a descriptor for it.
    count = 40
    with DataLoader(FdReport(2), num_workers=2) as warm:  # the forkserver stays, once
        list(warm)
    before = _open_fds()
    with DataLoader(FdReport(count), batch_size=1, num_workers=2, timeout=BOUND_S) as loader:
        for _ in loader:  # an epoch first: the workers, their pipes and the loop are open now
            pass
        started = _open_fds()
        batches = list(loader)
        held = loader.statistics().held_shm_slots
        assert _open_fds() == started  # the main side: 40 live batches, no descriptor more
        rows = np.stack([b[0, :3].numpy() for b in batches])
        assert rows[:, 0].tolist() == list(range(count))  # each sample once, in order
        assert held >= count - 8  # all but the first few (sent inline) live in slots
        del batches
    assert _open_fds() == before
    per_worker: dict[int, list[int]] = defaultdict(list)
    for _, fds, pid in rows.tolist():
        per_worker[pid].append(fds)
    assert len(per_worker) == 2
    for pid, fds in per_worker.items():
        # Read after each attach: a descriptor kept per segment would grow by one a batch.
        assert max(fds[2:]) == min(fds[2:]), (pid, fds)


# Run in a child: the limit holds for the whole process and its workers. Samples are 64 KiB
# arrays of int32 filled with their index, one per batch, so every batch travels in a slot
# (after the first few, sent inline while the loader learns the batch size).
_HELD_BATCHES_CHILD = """
import gc, os, resource, sys, time
import numpy as np
limit, count = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
from aioloader import DataLoader

class Filled:  # sample i: 16,384 int32, every one i (pickled by value to the workers)
    def __len__(self):
        return count

    def __getitem__(self, i):
        return np.full(16384, i, dtype=np.int32)

def fds():
    return len(os.listdir("/proc/self/fd"))

if __name__ == "__main__":
    # numpy batches (np.stack) and seeds per worker: no process of the run imports torch
    loader = DataLoader(
        Filled(), batch_size=1, num_workers=2, collate_fn=np.stack, worker_seeding="worker"
    )
    with loader:
        start = time.monotonic()
        batches = list(loader)
        took = time.monotonic() - start
        held_fds, held_slots = fds(), loader.statistics().held_shm_slots
        assert [(b.shape, int(b.min()), int(b.max())) for b in batches] == [
            ((1, 16384), i, i) for i in range(count)
        ]
        assert "torch" not in sys.modules
        del batches
        gc.collect()
        print(held_fds, fds(), held_slots, loader.statistics().held_shm_slots, took)
"""


def _hold_all_batches(limit: int, count: int) -> tuple[int, int, int, int, float]:
    proc = subprocess.run(
        [sys.executable, "-c", _HELD_BATCHES_CHILD, str(limit), str(count)],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    held_fds, released_fds, held, left, took = proc.stdout.split()
    return int(held_fds), int(released_fds), int(held), int(left), float(took)


@needs_proc
def test_more_batches_held_than_the_descriptor_limit_allows_files() -> None:
    held_fds, released_fds, held, left, _ = _hold_all_batches(limit=64, count=80)
    assert held >= 80 - 8  # all but the first few, sent inline, live in shared memory
    assert left == 0
    assert held_fds == released_fds  # holding 70-odd batches costs no descriptor


@needs_proc
@pytest.mark.slow
def test_1500_batches_held_under_ulimit_1024() -> None:
    held_fds, released_fds, held, left, took = _hold_all_batches(limit=1024, count=1500)
    assert held >= 1500 - 8
    assert left == 0
    assert held_fds == released_fds
    assert took < 30


# In a child: open descriptors until none is left (``filler`` holds them).
_USE_UP_DESCRIPTORS = """
filler = []
try:
    while True:
        filler.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
"""

_OUT_OF_FDS_CHILD = (
    """
import os, resource
from aioloader import _shm
from aioloader._errors import SharedMemoryError

resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
pool = _shm.SlotPool(1 << 24)
slot = pool.lease(1000)
"""
    + _USE_UP_DESCRIPTORS
    + """for call in (lambda: pool.lease(3 << 20), lambda: _shm.attach(slot)):
    try:
        call()
    except SharedMemoryError as exc:
        print(exc.__cause__.errno, exc, sep="|")
    else:
        print("no error")
for handle in filler:
    os.close(handle)
pool.release(slot)
print(pool.stats().slots, pool.stats().free)
pool.close()
"""
)


def _child_out_of_descriptors(code: str) -> str:
    """The output of ``code`` run in a fresh interpreter, which must succeed."""
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_DIR, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@needs_proc
def test_out_of_descriptors_names_the_slot_and_the_fix() -> None:
    lease_line, attach_line, stats_line = _child_out_of_descriptors(_OUT_OF_FDS_CHILD).splitlines()
    wanted = _shm.page_round(math.ceil((3 << 20) * _shm.GROWTH))
    for line, size in ((lease_line, wanted), (attach_line, _shm.MIN_SLOT_BYTES)):
        cause, message = line.split("|", 1)
        assert int(cause) == errno.EMFILE
        assert f"{size} bytes" in message
        assert "ulimit -n" in message
        assert "limit is 64" in message
    assert stats_line == "1 1"  # the failed lease created nothing and left the pool intact


_NO_FD_FOR_THE_LOOP_CHILD = (
    """
import os, resource
import numpy  # imported while descriptors are left (the loader's collation imports it)
from aioloader import DataLoader

resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
"""
    + _USE_UP_DESCRIPTORS
    + """try:
    # A timeout keeps batches off the caller's thread: the epoch runs on the loop.
    next(iter(DataLoader(list(range(8)), batch_size=4, timeout=5, collate_fn=numpy.stack)))
except OSError as exc:
    print(exc.errno, " ".join(getattr(exc, "__notes__", [])), sep="|")
else:
    print("no error")
"""
)


@needs_proc
def test_no_descriptor_for_the_sync_loop_names_the_fix() -> None:
    # Many loaders left open, each with its loop thread (and workers), can use the limit up:
    # the loop a `for` needs then fails where it is made, saying what holds descriptors.
    cause, note = _child_out_of_descriptors(_NO_FD_FOR_THE_LOOP_CHILD).strip().split("|", 1)
    assert int(cause) == errno.EMFILE
    assert "event loop of a loader iterated with `for`" in note
    assert "limit is 64" in note
    assert "ulimit -n" in note


@needs_proc
@no_worker_left_behind()
def test_a_worker_out_of_descriptors_names_the_batch_and_the_fix() -> None:
    # The dataset leaks files until none is left in its worker: an OSError (EMFILE) in the
    # dataset's own code, which must say which batch and what to do.
    dataset = FdReport(12, starve_at=5)
    delivered: list[int] = []
    with DataLoader(dataset, batch_size=2, num_workers=1, timeout=BOUND_S) as loader:
        it = iter(loader)
        delivered += [int(v) for b in [next(it), next(it)] for v in b[:, 0]]
        with pytest.raises(OSError, match="Too many open files") as info:
            next(it)
        delivered += [int(v) for b in it for v in b[:, 0]]  # the loader stays usable
    assert info.value.errno == errno.EMFILE
    notes = notes_of(info.value)
    assert "batch 2: this process has no file descriptor left (the limit is" in notes
    assert "ulimit -n" in notes
    assert "index 5" in notes  # the sample, named as for any dataset error
    assert sorted([*delivered, 4, 5]) == list(range(12))


@needs_proc
@no_worker_left_behind()
def test_a_worker_that_cannot_open_a_slot_sends_its_batches_inline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # From sample 10 on, the worker has no descriptor left for new segments (every batch is
    # held, so each needs one): those batches travel inline, logged once and counted.
    caplog.set_level(logging.WARNING, logger="aioloader.shm")
    dataset = FdReport(30, starve_at=10, starve_for_good=True)
    with DataLoader(dataset, batch_size=1, num_workers=1, timeout=BOUND_S) as loader:
        batches = list(loader)
        stats = loader.statistics()
    assert [int(b[0, 0]) for b in batches] == list(range(30))
    assert stats.shm_fallbacks >= 15
    warnings = [r.getMessage() for r in caplog.records if "travel inline" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "no file descriptor left" in warnings[0]
    assert "ulimit -n" in warnings[0]


_START_UP_CHILD = """
import os, resource
import numpy as np
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from aioloader import DataLoader

if __name__ == "__main__":
    filler = []
    while True:  # leave 20 descriptors: too few to start four workers (about ten each)
        try:
            filler.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            break
    for handle in filler[len(filler) - 20 :]:
        os.close(handle)
    try:
        # The workers start as the loader is made (in the background); failing there, they are
        # started again, and the error raised, where they are first used.
        loader = DataLoader(list(range(8)), batch_size=1, num_workers=4, collate_fn=np.stack)
        with loader:
            list(loader)
    except OSError as exc:
        print(exc.errno, *getattr(exc, "__notes__", ()), sep="|")
"""


@needs_proc
def test_too_few_descriptors_to_start_the_workers_says_so() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _START_UP_CHILD],
        cwd=REPO_DIR,
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cause, note = proc.stdout.strip().split("|", 1)
    assert int(cause) == errno.EMFILE
    assert note.startswith("starting 4 worker processes: this process has no file descriptor")
    assert "the limit is 64" in note
    assert "ulimit -n" in note
