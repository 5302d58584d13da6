"""``python -m aioloader doctor``: what on this machine will hurt a data loader, and what to change.

Containers and cluster jobs break data loaders in a few well-known ways: Docker and Kubernetes
give ``/dev/shm`` 64 MiB, so shared-memory batches do not fit; a low ``ulimit -n`` runs out of
descriptors once workers, pipes, slots and sockets add up; a CPU quota or affinity mask means
``os.cpu_count()`` overstates the cores a job may use; a torch build may not match the GPU.

Each check is a pure function of what was observed, returning one :class:`Check` record (OK,
WARN or FAIL, what was seen, and a one-line fix), so tests feed it any machine they like.
:func:`observe` is the only part that reads the machine; :func:`render` the only one that
formats. torch is imported only when it is installed, and a broken torch is reported, not
raised.

Sharp edge: ``python -m aioloader`` imports the package first, and the package imports torch,
so today a missing or broken torch stops the command with its ImportError before these checks
run; the guard here keeps this module from adding a second hard dependency on it.
"""

from __future__ import annotations

import enum
import importlib.metadata
import importlib.util
import multiprocessing as mp
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from . import _shm
from ._shm import BUDGET_FRACTION, BUDGET_MAX
from ._workers import resolve_context

__all__ = [
    "Check",
    "Facts",
    "Status",
    "TorchFacts",
    "check_cpus",
    "check_open_files",
    "check_python",
    "check_shm",
    "check_start_methods",
    "check_torch",
    "check_uvloop",
    "diagnose",
    "exit_code",
    "observe",
    "render",
    "shm_budget",
]

SHM_PATH = "/dev/shm"
# Warn when the loader's default budget (a quarter of free /dev/shm) is below this. One
# 64 x 3 x 224 x 224 uint8 batch is 9.6 MB and each worker keeps `prefetch` of them in flight;
# under 256 MiB a few such batches fill the budget and the rest travel pickled, a copy slower.
SHM_BUDGET_LOW = 256 << 20
# The /dev/shm size at which the default budget reaches its cap: what to ask the container for.
SHM_FULL_SIZE = int(BUDGET_MAX / BUDGET_FRACTION)
# Warn below this many open files. Each worker holds two pipes, each live shared-memory slot a
# descriptor, each remote read in flight a socket (io_concurrency=256 alone needs 256); distros
# still default the soft limit to 1024, which a busy loader crosses. Raising it costs nothing.
NOFILE_MIN = 4096
# What to suggest raising it to when the hard limit allows.
NOFILE_SUGGESTED = 65536
MIN_PYTHON = (3, 11)
MIN_TORCH = (2, 1)


class Status(enum.Enum):
    """How bad a finding is. Only FAIL makes ``doctor`` exit non-zero."""

    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True, slots=True)
class Check:
    """One finding: its section, its status, what was seen, and what to change (or "")."""

    section: str
    status: Status
    detail: str
    fix: str = ""


@dataclass(frozen=True, slots=True)
class TorchFacts:
    """What torch says about itself. ``version`` is None when torch is not installed;
    ``error`` holds the exception text when importing it failed."""

    version: str | None
    cuda_build: str | None = None
    hip_build: str | None = None
    cuda_available: bool = False
    device_count: int = 0
    device_name: str | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Facts:
    """Everything the checks read, observed once by :func:`observe`."""

    python: tuple[int, int, int]
    implementation: str
    system: str
    machine: str
    shm_total: int | None
    shm_free: int | None
    nofile_soft: int
    nofile_hard: int
    start_methods: tuple[str, ...]
    python_default_method: str
    loader_method: str
    uvloop_version: str | None
    cpu_count: int | None
    cpu_affinity: int | None
    cpu_quota: float | None
    torch: TorchFacts


# -- the checks: pure functions of what was observed --------------------------------------------


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _docker_size(n: int) -> str:
    """A size as ``docker run --shm-size`` spells it (``16g``, ``512m``)."""
    return f"{n >> 30}g" if n % (1 << 30) == 0 else f"{n >> 20}m"


def shm_budget(free: int) -> int:
    """The loader's default shared-memory budget for ``free`` bytes of free /dev/shm."""
    return _shm.budget(None, free)


def check_shm(total: int | None, free: int | None, *, path: str = SHM_PATH) -> Check:
    """/dev/shm's size and free space against the loader's default budget.

    Args:
        total: the file system's size in bytes, or None when ``path`` does not exist.
        free: bytes available to this user, or None when ``path`` does not exist.
        path: where POSIX shared memory lives (only named in the messages).
    """
    section = "shared memory"
    if total is None or free is None:
        return Check(
            section,
            Status.FAIL,
            f"{path} does not exist: the loader's default shared-memory budget cannot be read",
            f"mount a tmpfs at {path} (docker run --shm-size={_docker_size(SHM_FULL_SIZE)}; "
            "Kubernetes: an emptyDir with medium: Memory), or pass shm_max_bytes=0",
        )
    budget = shm_budget(free)
    detail = (
        f"{path} {_size(total)}, {_size(free)} free; default loader budget {_size(budget)} "
        f"({BUDGET_FRACTION:g} of free, at most {_size(BUDGET_MAX)})"
    )
    if budget >= SHM_BUDGET_LOW:
        return Check(section, Status.OK, detail)
    if total * BUDGET_FRACTION < SHM_BUDGET_LOW:
        fix = (
            f"{path} is small (Docker and Kubernetes give 64 MiB): docker run "
            f"--shm-size={_docker_size(SHM_FULL_SIZE)} (the full budget; at least 1g), or on "
            f"Kubernetes mount an emptyDir with medium: Memory at {path}"
        )
    else:
        fix = (
            f"{_size(total - free)} of {path} is in use: look for stale segments "
            f"(ls -la {path}) or other jobs on this machine"
        )
    return Check(section, Status.WARN, detail + "; large batches will travel pickled", fix)


def _limit(n: int) -> str:
    return "unlimited" if n < 0 or n >= sys.maxsize else str(n)


def check_open_files(soft: int, hard: int) -> Check:
    """``ulimit -n``: the soft and hard limits on open file descriptors (negative: unlimited)."""
    section = "open files"
    detail = f"ulimit -n: soft {_limit(soft)}, hard {_limit(hard)}"
    unlimited_soft = soft < 0 or soft >= sys.maxsize
    if unlimited_soft or soft >= NOFILE_MIN:
        return Check(section, Status.OK, detail)
    hard_is_enough = hard < 0 or hard >= NOFILE_MIN
    if hard_is_enough:
        target = NOFILE_SUGGESTED if hard < 0 else min(hard, NOFILE_SUGGESTED)
        fix = (
            f"raise the soft limit: ulimit -n {target} before starting Python, or "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard)) at start-up"
        )
    else:
        fix = (
            f"the hard limit is {hard}: raise both, e.g. docker run "
            f"--ulimit nofile={NOFILE_SUGGESTED}:{NOFILE_SUGGESTED}, or LimitNOFILE= in the "
            "systemd unit / nofile in /etc/security/limits.conf"
        )
    return Check(section, Status.WARN, detail + f" (below {NOFILE_MIN})", fix)


def check_start_methods(available: Sequence[str], python_default: str, loader_method: str) -> Check:
    """The multiprocessing start methods here, Python's default and the one workers use."""
    section = "start methods"
    detail = (
        f"available: {', '.join(available)}; Python's default: {python_default}; "
        f"workers use: {loader_method}"
    )
    if loader_method == "forkserver":
        return Check(section, Status.OK, detail)
    if loader_method == "spawn":
        return Check(
            section,
            Status.WARN,
            detail + " (no forkserver: each worker re-imports torch and your main module)",
            "keep the training entry point under `if __name__ == '__main__':`, keep datasets "
            "picklable, and reuse one loader across epochs (its workers start once)",
        )
    return Check(
        section,
        Status.WARN,
        detail + " (fork: a forked worker can inherit locks held by other threads)",
        "pass mp_context='forkserver' (or 'spawn') to DataLoader",
    )


def check_uvloop(version: str | None, *, system: str) -> Check:
    """Whether uvloop, the loop :func:`aioloader.run` prefers, is installed."""
    section = "uvloop"
    if version is not None:
        return Check(section, Status.OK, f"uvloop {version}: aioloader.run uses it")
    if system == "Windows":
        return Check(section, Status.OK, "not installed (not available on Windows)")
    return Check(
        section,
        Status.WARN,
        "not installed: aioloader.run falls back to the stock asyncio loop (slower per batch)",
        "pip install uvloop",
    )


def check_cpus(count: int | None, affinity: int | None, quota: float | None) -> Check:
    """CPUs on the machine against those this process may use (affinity mask, cgroup quota).

    Args:
        count: ``os.cpu_count()``.
        affinity: ``len(os.sched_getaffinity(0))``, or None where the platform lacks it.
        quota: the cgroup CPU quota in CPUs (``cpu.max``), or None when unlimited or unknown.
    """
    section = "cpus"
    usable: float | None = count
    parts = [f"os.cpu_count() {count if count is not None else 'unknown'}"]
    if affinity is not None:
        parts.append(f"affinity {affinity}")
        usable = affinity if usable is None else min(usable, affinity)
    if quota is not None:
        parts.append(f"cgroup quota {quota:g}")
        usable = quota if usable is None else min(usable, quota)
    detail = ", ".join(parts)
    if count is None or usable is None or usable >= count:
        return Check(section, Status.OK, detail)
    allowed = max(1, int(usable))
    return Check(
        section,
        Status.WARN,
        detail + f": this process may use {usable:g} of {count}",
        f"size num_workers from {allowed} usable CPUs (len(os.sched_getaffinity(0)), the "
        "cgroup quota), not os.cpu_count(): too many workers only contend",
    )


def _version_tuple(version: str) -> tuple[int, ...]:
    numbers = []
    for part in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        numbers.append(int(digits) if digits else 0)
    return tuple(numbers)


def check_torch(facts: TorchFacts) -> Check:
    """torch's version, its build (CUDA, ROCm or CPU) and whether a GPU is visible."""
    section = "torch"
    if facts.error is not None:
        return Check(
            section,
            Status.FAIL,
            f"installed but importing it failed: {facts.error}",
            "reinstall torch for this machine (pip install --force-reinstall torch)",
        )
    if facts.version is None:
        return Check(section, Status.FAIL, "not installed", "pip install torch")
    if _version_tuple(facts.version) < MIN_TORCH:
        return Check(
            section,
            Status.FAIL,
            f"torch {facts.version} is older than {'.'.join(map(str, MIN_TORCH))}",
            "pip install --upgrade torch",
        )
    if facts.cuda_build is not None:
        build = f"CUDA {facts.cuda_build} build"
    elif facts.hip_build is not None:
        build = f"ROCm {facts.hip_build} build"
    else:
        build = "CPU build"
    detail = f"torch {facts.version}, {build}"
    if facts.cuda_available:
        name = f" ({facts.device_name})" if facts.device_name else ""
        return Check(section, Status.OK, f"{detail}, {facts.device_count} GPU(s) visible{name}")
    if build == "CPU build":
        return Check(section, Status.OK, f"{detail}: no GPU support (device= stays on the CPU)")
    return Check(
        section,
        Status.WARN,
        f"{detail}, but no GPU is visible",
        "check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES, and that the container was "
        "started with GPUs (docker run --gpus all)",
    )


def check_python(
    version: tuple[int, int, int], implementation: str, system: str, machine: str
) -> Check:
    """The interpreter running the loader."""
    detail = f"{implementation} {'.'.join(map(str, version))} on {system} {machine}"
    if version[:2] < MIN_PYTHON:
        return Check(
            "python",
            Status.FAIL,
            detail,
            f"use Python {'.'.join(map(str, MIN_PYTHON))} or newer",
        )
    return Check("python", Status.OK, detail)


def diagnose(facts: Facts) -> list[Check]:
    """Every check, in the order they are printed."""
    return [
        check_python(facts.python, facts.implementation, facts.system, facts.machine),
        check_shm(facts.shm_total, facts.shm_free),
        check_open_files(facts.nofile_soft, facts.nofile_hard),
        check_start_methods(facts.start_methods, facts.python_default_method, facts.loader_method),
        check_uvloop(facts.uvloop_version, system=facts.system),
        check_cpus(facts.cpu_count, facts.cpu_affinity, facts.cpu_quota),
        check_torch(facts.torch),
    ]


def exit_code(checks: Sequence[Check]) -> int:
    """1 when any check failed, else 0 (warnings do not fail)."""
    return 1 if any(c.status is Status.FAIL for c in checks) else 0


def render(checks: Sequence[Check], *, version: str) -> str:
    """The report as printed: one line per check, its fix indented below it."""
    width = max(len(c.section) for c in checks)
    lines = [f"aioloader {version} doctor"]
    for c in checks:
        lines.append(f"  {c.status.value:<4}  {c.section:<{width}}  {c.detail}")
        if c.fix:
            lines.append(f"  {'':<4}  {'':<{width}}  fix: {c.fix}")
    counts = {s: sum(c.status is s for c in checks) for s in Status}
    lines.append(
        f"{counts[Status.OK]} ok, {counts[Status.WARN]} warning(s), "
        f"{counts[Status.FAIL]} failure(s)"
    )
    return "\n".join(lines)


# -- observing the machine ------------------------------------------------------------------------


def _observe_shm(path: str) -> tuple[int | None, int | None]:
    try:
        stat = os.statvfs(path)
    except OSError:
        return None, None
    return stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize


def _observe_nofile() -> tuple[int, int]:
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return -1, -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinity = resource.RLIM_INFINITY
    return (-1 if soft == infinity else soft), (-1 if hard == infinity else hard)


def _observe_cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """The cgroup v2 CPU quota in CPUs, or None when there is none (or no cgroup v2)."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _observe_torch() -> TorchFacts:
    if importlib.util.find_spec("torch") is None:
        return TorchFacts(version=None)
    try:
        import torch
    except Exception as exc:  # a broken install: report it, the other checks still run
        return TorchFacts(version=None, error=f"{type(exc).__name__}: {exc}")
    cuda_available = bool(torch.cuda.is_available())
    count = torch.cuda.device_count() if cuda_available else 0
    return TorchFacts(
        version=str(torch.__version__),
        cuda_build=torch.version.cuda,
        hip_build=torch.version.hip,
        cuda_available=cuda_available,
        device_count=count,
        device_name=torch.cuda.get_device_name(0) if count else None,
    )


def observe() -> Facts:
    """Read this machine and process: the only function here with side effects (none lasting)."""
    total, free = _observe_shm(SHM_PATH)
    soft, hard = _observe_nofile()
    methods = tuple(mp.get_all_start_methods())
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    v = sys.version_info
    return Facts(
        python=(v.major, v.minor, v.micro),
        implementation=platform.python_implementation(),
        system=platform.system(),
        machine=platform.machine(),
        shm_total=total,
        shm_free=free,
        nofile_soft=soft,
        nofile_hard=hard,
        start_methods=methods,
        # Python's default is the first listed, unless this process already chose one.
        python_default_method=mp.get_start_method(allow_none=True) or methods[0],
        loader_method=resolve_context(None, allow_fork=False).get_start_method(),
        uvloop_version=_distribution_version("uvloop"),
        cpu_count=os.cpu_count(),
        cpu_affinity=affinity,
        cpu_quota=_observe_cpu_quota(),
        torch=_observe_torch(),
    )
