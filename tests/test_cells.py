"""The numbers a worker pool shares with its workers (``_workers._records.Cells``): written in a
child, read in the parent, whatever the start method; pools made and closed one after another
hold no more of multiprocessing's shared-memory arenas than the first (one per process)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from typing import Any

import pytest

from aioloader._workers._records import Cells, new_cells


def _publish(cells: Cells, i: int) -> None:
    cells.started[i] = os.getpid()
    cells.current[i] = 1 << 40
    cells.loading[i] = 2.5


def _arenas() -> set[tuple[str, str]]:
    """This process's descriptors of multiprocessing's shared-memory arenas (its heap's files,
    unlinked: ``/dev/shm/pym-...``): (number, what it points to)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # listdir's own, closed since
            target = os.readlink(f"/proc/self/fd/{fd}")
            if "/pym-" in target:
                found.add((fd, target))
    return found


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_what_a_child_writes_the_parent_reads(method: str) -> None:
    if method not in mp.get_all_start_methods():
        pytest.skip(f"no {method} here")
    cells = new_cells(3)
    context: Any = mp.get_context(method)
    process = context.Process(target=_publish, args=(cells, 1))
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert (cells.started[1], cells.current[1], cells.loading[1]) == (process.pid, 1 << 40, 2.5)
    assert (cells.started[0], cells.current[2], cells.loading[0]) == (0, 0, 0.0)  # untouched


def test_bad_sizes_and_indices_are_refused() -> None:
    with pytest.raises(ValueError, match="n must be positive, got 0"):
        new_cells(0)
    cells = new_cells(2)
    with pytest.raises(IndexError):
        cells.started[2] = 1
    with pytest.raises(IndexError):
        _ = cells.current[2]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_pools_made_and_closed_hold_no_more_arenas_than_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aioloader import _workers
    from aioloader._workers import _pool

    def one_pool() -> None:
        pool = _workers.WorkerPool(2, _workers.resolve_context(None, allow_fork=False), 0)
        try:
            pool.start()
        finally:
            pool.close()

    one_pool()  # the shared arrays' arena: one per process, reused
    before = _arenas()
    assert before
    for _ in range(3):
        one_pool()
    assert _arenas() == before

    def out_of_descriptors(*_: Any) -> Any:  # (the channel's hooks, as open_channel takes)
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(_pool, "open_channel", out_of_descriptors)
    with pytest.raises(OSError, match="Too many open files"):
        _workers.WorkerPool(2, _workers.resolve_context(None, allow_fork=False), 0)
    assert _arenas() == before
