"""Worker-process checks shared by the loader tests.

The conftest leak check already fails a test that leaves any process behind; these helpers
name the workers explicitly, so a test can assert that they are gone at a precise point
(right after ``close()``), not only at the test's end.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import psutil


def worker_processes() -> set[int]:
    """Live worker processes of ours: those that named themselves workers as they started, and
    any other child of a forkserver (one still starting). The first worker of a loader may be
    forked from this process itself, not from the server."""
    pids = set()
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            parent = process.parent()
            if process.name().startswith("aiol-worker") or (
                parent is not None
                and (
                    "forkserver" in " ".join(parent.cmdline()) or parent.name() == "aiol-forkserver"
                )
            ):
                pids.add(process.pid)
    return pids


@contextlib.contextmanager
def no_worker_left_behind() -> Iterator[None]:
    """Fail if a worker process started inside the block is alive 5 s after it ends."""
    before = worker_processes()
    yield
    deadline = time.monotonic() + 5.0
    while (left := worker_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"worker processes left: {sorted(left)}"
