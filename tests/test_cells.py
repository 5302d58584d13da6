"""The numbers a worker pool shares with its workers (``_workers._cells``): written in a child,
read in the parent, whatever the start method; a closed pool's cells hold no descriptor."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
from typing import Any

import pytest

from aioloader._workers._cells import Cells


def _publish(cells: Cells, i: int) -> None:
    cells.started[i] = os.getpid()
    cells.current[i] = 1 << 40
    cells.loading[i] = 2.5


def _descriptors() -> set[tuple[str, str]]:
    """This process's open descriptors: (number, what it points to)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # listdir's own, closed since
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    return found


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_what_a_child_writes_the_parent_reads(method: str) -> None:
    if method not in mp.get_all_start_methods():
        pytest.skip(f"no {method} here")
    cells = Cells(3)
    try:
        context: Any = mp.get_context(method)
        process = context.Process(target=_publish, args=(cells, 1))
        process.start()
        process.join(60)
        assert process.exitcode == 0
        assert (cells.started[1], cells.current[1], cells.loading[1]) == (process.pid, 1 << 40, 2.5)
        assert (cells.started[0], cells.current[2], cells.loading[0]) == (0, 0, 0.0)  # untouched
    finally:
        cells.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_closed_cells_hold_no_descriptor_and_keep_their_last_values() -> None:
    before = _descriptors()
    cells = Cells(2)
    assert _descriptors() - before != set()  # the file, and the mapping's own copy of it
    cells.current[0], cells.loading[1] = 7, 0.5
    cells.close()
    assert _descriptors() - before == set()
    assert (cells.current[0], cells.loading[1], cells.started[0]) == (7, 0.5, 0)
    cells.current[0] = 8  # a late write, after the pool closed: kept, not lost in a crash
    assert cells.current[0] == 8
    cells.close()  # idempotent
    with pytest.raises(RuntimeError, match="cannot be sent on"):
        pickle.dumps(cells)


def test_bad_sizes_and_indices_are_refused() -> None:
    with pytest.raises(ValueError, match="n must be positive, got 0"):
        Cells(0)
    cells = Cells(2)
    try:
        with pytest.raises(IndexError, match="cell 2 out of range for 2 cells"):
            cells.started[2] = 1
        with pytest.raises(IndexError, match="cell -1 out of range"):
            _ = cells.current[-1]
    finally:
        cells.close()


def _memfds() -> set[str]:
    return {fd for fd, target in _descriptors() if "aioloader-cells" in target}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_pool_leaves_no_cells_open_closed_dropped_or_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aioloader import _workers
    from aioloader._workers import _pool

    before = _memfds()
    pool = _workers.WorkerPool(2, _workers.resolve_context(None, allow_fork=False), 0)
    try:
        pool.start()
        assert _memfds() - before != set()
    finally:
        pool.close()
    assert _memfds() - before == set()

    def out_of_descriptors() -> Any:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(_pool, "open_channel", out_of_descriptors)
    with pytest.raises(OSError, match="Too many open files"):
        _workers.WorkerPool(2, _workers.resolve_context(None, allow_fork=False), 0)
    assert _memfds() - before == set()

    dropped = Cells(1)
    assert _memfds() - before != set()
    del dropped
    gc.collect()
    assert _memfds() - before == set()
