"""The CPU a loader's process tree uses, and the CPUs it may use, read from ``/proc``.

:func:`process_tree_cpu` sums the CPU time of this process and every descendant (the worker
server and its workers, a local Ray's processes, a program's own children), with the time
their threads waited in a run queue; :func:`cpus_available` is what this process may run on:
its affinity, lowered by a cgroup quota. The statistics (:mod:`._counters`) read both at each
epoch's start and end and at most every ``CPU_SAMPLE_INTERVAL_S`` in between; where ``/proc``
cannot tell, they say nothing of CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["CpuSample", "cpus_available", "process_tree_cpu"]


@dataclass(frozen=True, slots=True)
class CpuSample:
    """CPU seconds used so far, read at ``at`` (``time.perf_counter()``).

    Attributes:
        at: when it was read.
        main_s: this process (all its threads), children it reaped included.
        tree_s: this process and every live descendant, with the children each reaped.
        wait_s: time the threads of those processes were ready to run but waited for a CPU
            (the run queue's delay, ``/proc/PID/task/TID/schedstat``): CPUs taken by other
            processes, or more runnable threads than cores.
    """

    at: float
    main_s: float
    tree_s: float
    wait_s: float


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


#: The most processes :func:`process_tree_cpu` follows below this one (a loader's tree is the
#: worker server and its workers; a program's own children count too): a bound on the walk.
_MAX_TREE = 4096


def process_tree_cpu() -> tuple[float, float, float] | None:
    """``(main_s, tree_s, wait_s)``: CPU seconds (user + system) of this process, and of it with
    every descendant, each with the children it reaped; and the seconds their live threads
    waited in a run queue (see :class:`CpuSample`). None where ``/proc`` cannot tell.

    Workers are grandchildren (through the worker server). Descendants are found from each
    thread's ``children`` list (``/proc/PID/task/TID/children``): two files per thread, tens
    of microseconds for a loader's tree, ~3 ms for one that holds a local Ray. Where the
    kernel has no such lists, parent links are walked over every process in ``/proc``
    instead: about 30 us per process, milliseconds on a busy host, which an epoch of tiny
    batches would feel at its start and end. Counting the reaped children of
    each keeps the sum steady when a worker exits and is reaped mid-epoch.
    """
    root = os.getpid()
    tree = _descendants(root)
    if tree is None:
        return _process_tree_cpu_by_scan(root)
    seconds: dict[int, float] = {}
    for pid in tree:
        spent = _cpu_seconds(pid)
        if spent is not None:
            seconds[pid] = spent
    if root not in seconds:
        return None
    wait = sum(waited for pid, waited in tree.items() if pid in seconds)
    return seconds[root], sum(seconds.values()), wait


def _descendants(root: int) -> dict[int, float] | None:
    """``root`` and every process below it, from the threads' ``children`` lists, each with the
    seconds its live threads waited in a run queue (:func:`_run_queue_wait`, read in the same
    pass over its threads); None where the kernel keeps no such list (``CONFIG_PROC_CHILDREN``).

    A tree holding a local Ray has some 200 threads: each thread's two files are read with
    raw ``os.read`` (about 4 us each), not ``open()`` (about 25 us: a buffered text reader is
    built for every file), which took the walk from ~12 to ~3 ms at each epoch's start and end.
    """
    if not os.path.exists(f"/proc/{root}/task/{root}/children"):
        return None
    found: dict[int, float] = {}
    stack = [root]
    while stack and len(found) < _MAX_TREE:  # bounded: a pid is a child of one process only
        pid = stack.pop()
        if pid in found:
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # exited meanwhile
            found[pid] = 0.0
            continue
        waited = 0
        for tid in tids:
            children = _read_raw(f"/proc/{pid}/task/{tid}/children")
            if children:
                stack.extend(int(child) for child in children.split())
            waited += _waited_ns(_read_raw(f"/proc/{pid}/task/{tid}/schedstat"))
        found[pid] = waited / 1e9
    return found


def _read_raw(path: str) -> bytes | None:
    """The whole of a small ``/proc`` file, or None if it cannot be read (gone, not ours)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        chunks: list[bytes] = []
        while len(chunks) < 64:  # bounded: /proc files here are a few bytes to a few KiB
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _waited_ns(schedstat: bytes | None) -> int:
    """The run-queue wait of a thread's ``schedstat`` (its second field), 0 if absent."""
    fields_ = schedstat.split() if schedstat else ()
    return int(fields_[1]) if len(fields_) >= 2 and fields_[1].isdigit() else 0


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` and of the children it reaped; None if gone."""
    data = _read_raw(f"/proc/{pid}/stat")
    if data is None:  # exited meanwhile, or not ours to read
        return None
    # Fields after the command (which may hold spaces and parentheses): state, ppid, ...,
    # utime (14th field of the line), stime, cutime, cstime.
    rest = data[data.rfind(b")") + 2 :].split()
    if len(rest) < 15:
        return None
    return sum(int(x) for x in rest[11:15]) / _CLOCK_TICKS


def _process_tree_cpu_by_scan(root: int) -> tuple[float, float, float] | None:
    """:func:`process_tree_cpu` by parent links over every process in ``/proc``."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    children: dict[int, list[int]] = {}
    seconds: dict[int, float] = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        rest = data[data.rfind(b")") + 2 :].split()
        if len(rest) < 15:
            continue
        pid = int(name)
        children.setdefault(int(rest[1]), []).append(pid)
        seconds[pid] = sum(int(x) for x in rest[11:15]) / _CLOCK_TICKS
    if root not in seconds:
        return None
    tree, wait, stack = 0.0, 0.0, [root]
    while stack:  # bounded: every pid is visited once (parent links form a tree)
        pid = stack.pop()
        tree += seconds.get(pid, 0.0)
        wait += _run_queue_wait(pid)
        stack.extend(children.get(pid, ()))
    return seconds[root], tree, wait


def _run_queue_wait(pid: int) -> float:
    """Seconds the live threads of ``pid`` waited for a CPU (0 where the kernel does not say:
    ``schedstat`` needs ``CONFIG_SCHED_INFO``)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    return sum(_waited_ns(_read_raw(f"/proc/{pid}/task/{tid}/schedstat")) for tid in tids) / 1e9


def cpus_available() -> float:
    """CPUs this process may use: its affinity mask (``os.sched_getaffinity``), lowered by a
    cgroup CPU quota if one is set (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``): what a
    container with ``--cpus=1.5`` may use is 1.5, whatever ``os.cpu_count()`` says."""
    try:
        cpus = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpus = float(os.cpu_count() or 1)
    quota = _cgroup_quota()
    return max(0.01, min(cpus, quota)) if quota else cpus


def _cgroup_quota() -> float | None:
    """The cgroup CPU quota of this process in CPUs, or None when there is none."""
    v1 = "/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: its own folder's cpu.max, e.g. "150000 100000"
            for base in (f"/sys/fs/cgroup{path}", "/sys/fs/cgroup"):
                text = _read(f"{base.rstrip('/')}/cpu.max")
                if text is not None:
                    limit, _, every = text.partition(" ")
                    if limit != "max" and every:
                        return float(limit) / float(every)
                    break
    quota, period = _read(v1[0]), _read(v1[1])
    if quota is not None and period is not None and float(quota) > 0 and float(period) > 0:
        return float(quota) / float(period)
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, ValueError):
        return None
