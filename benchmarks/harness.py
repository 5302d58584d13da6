"""What the benchmarks share: the memory of a process tree, and each case in a fresh interpreter.

- :func:`tree_pss_mb`: the PSS of this process and every descendant, read once (what a table
  reports "at the first batch" or "after the epoch");
- :class:`PeakPss`: the largest such sum, sampled by a thread every :data:`PSS_INTERVAL_S` to
  :data:`PSS_MAX_INTERVAL_S`, spaced so that sampling takes about :data:`PSS_CPU_SHARE` of a
  CPU from the loader being measured (what a table reports as "peak"); call
  :meth:`PeakPss.sample` before closing a loader, so that its workers count at least once;
- :func:`run_child`: one case run by the benchmark's own script in a fresh interpreter (so one
  loader's workers and memory do not colour the next), its result the JSON document on the
  last line of its stdout.

Not a benchmark itself: ``run_all.py`` does not run it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Literal, overload

# Sampling PSS reads /proc/PID/smaps_rollup of every process, which walks the page tables of
# all its mappings: 12-15 ms a process once torch is imported (~560 mappings). Sampled every
# 100 ms regardless, twice over (with and without files), it took 77 ms of CPU per 100 ms: 0.4
# of a core, from the loaders being measured on 2 cores. Now one read per process a sample,
# and the interval grows so the sampler takes about PSS_CPU_SHARE of a CPU, up to
# PSS_MAX_INTERVAL_S (so that a run of a few seconds is still sampled several times).
PSS_INTERVAL_S = 0.1
PSS_MAX_INTERVAL_S = 0.5
PSS_CPU_SHARE = 0.1


def tree_pss_bytes(*, without_files: bool = False) -> int:
    """The PSS of this process and every descendant, now, in bytes; ``without_files``: only
    anonymous memory and shared memory (``Pss_Anon + Pss_Shmem``), without file-backed pages
    (shared libraries above all: the same code for every loader, whose share of the pages
    depends on what else runs on the machine, which moved the totals by 200 MB here)."""
    whole, own, _ = tree_pss_both(with_anon=True)
    return own if without_files else whole


@overload
def tree_pss_both() -> tuple[int, int]: ...
@overload
def tree_pss_both(*, with_anon: Literal[True]) -> tuple[int, int, int]: ...


def tree_pss_both(*, with_anon: bool = False) -> tuple[int, ...]:
    """``(PSS, PSS without file-backed pages)`` of this process and every descendant, in
    bytes, from one read of each process's ``smaps_rollup``; ``with_anon``: and the
    anonymous part alone (``Pss_Anon``, without shared memory) third."""
    import psutil

    me = psutil.Process()
    whole = own = anon = 0
    for p in [me, *me.children(recursive=True)]:
        with contextlib.suppress(OSError, psutil.Error):
            rollup = _rollup(p.pid)
            whole += rollup.get("Pss", 0)
            anon += rollup.get("Pss_Anon", 0)
            own += rollup.get("Pss_Anon", 0) + rollup.get("Pss_Shmem", 0)
    return (whole, own, anon) if with_anon else (whole, own)


def _rollup(pid: int) -> dict[str, int]:
    """``/proc/PID/smaps_rollup`` as bytes by field."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            value = rest.split()
            if len(value) == 2 and value[1] == "kB":
                fields[key] = int(value[0]) * 1024
    return fields


def tree_pss_mb(*, without_files: bool = False) -> float:
    """:func:`tree_pss_bytes` in MiB."""
    return tree_pss_bytes(without_files=without_files) / 2**20


def shm_used_bytes() -> int:
    """Bytes in use in ``/dev/shm`` now, by every process of the machine (0 where it is
    missing): with the value at the start of a run, what a run's shared memory holds,
    including segments no process maps at the moment (see :attr:`PeakPss.peak_held`)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class PeakPss:
    """Samples the PSS of this process and its children until stopped: the largest sum
    (:attr:`peak`, bytes), the largest without file-backed pages (:attr:`peak_own`), and
    the largest anonymous memory plus what ``/dev/shm`` holds beyond its use at the start
    (:attr:`peak_held`).

    PSS counts a shared-memory segment only while a process maps it: torch's worker maps
    a batch's segment, sends its descriptor and unmaps it, and until the training process
    unpickles the batch the segment is in no process's PSS, though its pages are held. Where
    batches wait in a queue, :attr:`peak_own` misses them; :attr:`peak_held` counts every
    segment once, mapped or not (and whatever else on the machine writes to ``/dev/shm``
    meanwhile: read it on a quiet machine).
    """

    enabled = True  # --no-memory turns sampling off, for the least disturbed throughput

    def __init__(self) -> None:
        self.peak = 0
        self.peak_own = 0
        self.peak_held = 0
        self._shm_at_start = shm_used_bytes()
        self.samples = 0
        self.cpu_s = 0.0  # CPU the sampling took (its thread's)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> float:
        """Take a sample now (before closing a loader: its workers and slots count); returns
        the CPU seconds it took."""
        started = time.thread_time()
        whole, own, anon = tree_pss_both(with_anon=True)
        held = anon + max(0, shm_used_bytes() - self._shm_at_start)
        self.peak = max(self.peak, whole)
        self.peak_own = max(self.peak_own, own)
        self.peak_held = max(self.peak_held, held)
        self.samples += 1
        spent = time.thread_time() - started
        self.cpu_s += spent
        return spent

    def _run(self) -> None:
        while not self._stop.is_set():
            spent = self.sample()
            self._stop.wait(min(PSS_MAX_INTERVAL_S, max(PSS_INTERVAL_S, spent / PSS_CPU_SHARE)))

    def __enter__(self) -> PeakPss:
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join()
            # A run shorter than the thread's first turn (torch's inline tiny epochs hold the
            # GIL throughout) would otherwise report no memory at all.
            self.sample()


def run_child(script: str, argv: list[str], what: str, timeout: float = 600) -> Any:
    """Run ``python script *argv`` in a fresh interpreter and return the JSON document on the
    last line of its stdout (its stderr passes through, for progress and errors).

    Raises:
        SystemExit: naming ``what`` and the exit status, if the child failed.
    """
    result = subprocess.run(
        [sys.executable, script, *argv],
        stdout=subprocess.PIPE,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"{what} failed ({result.returncode})")
    return json.loads(result.stdout.strip().splitlines()[-1])
