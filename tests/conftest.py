"""Test harness: plain ``async def test_*`` functions, tiers, the event loops, leak checks.

- Tiers: every test module is in one tier, a marker of the same name (``pytest -m unit``):
  ``unit`` (pure state machines, checks and collation: no loader running), ``loader`` (the
  loader in this process, with threads or worker processes), ``system`` (subprocesses, gloo
  ranks, frameworks, examples, benchmarks, the soak). :data:`TIERS` names the unit and system
  modules; every other module is a loader module. The system tier is collected first: its
  tests are the longest, and run in parallel (``-n``) they should start early, not end last.
- Event loops: an ``async def`` test runs on the stock asyncio loop, the one ``asyncio.run``
  gives an application; one of a module where the loop's own machinery is under test (pipes
  watched by the loop, cancellation, signals, timers, threads handing results back, aiohttp's
  transport: :data:`BOTH_LOOPS`) runs on uvloop too. Synchronous ``for`` epochs run on the
  package's own choice, uvloop. ``AIOLOADER_TEST_LOOPS=both`` runs every ``async def`` test on
  both loops, ``AIOLOADER_TEST_SYNC_LOOP=asyncio`` every ``for`` epoch on the stock loop: with
  both, the whole suite proves both loops (RELIABILITY.md row 28).
- After every test, an autouse fixture checks that nothing of ours is left: no shared-memory
  segment with our prefix, no child process (workers are grandchildren through the forkserver,
  so children are listed recursively), no thread. Each check polls briefly, because a process
  that was told to exit needs a moment to be reaped; a leak that persists fails the test.
- Before every test, an autouse fixture forgets which warnings were said (the package says
  each once per process), so that no test depends on the order tests run in.
- The ``baseline`` fixture is the stricter check of RELIABILITY.md (descriptors and asyncio
  tasks too); the fault tests use it. ``sync_loop`` runs a test's ``for`` epochs on each loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
from helpers import Baseline
from ray_cluster import ray_cluster as ray_cluster  # one session fixture for test_ray*.py

from aioloader._log import reset_once
from aioloader._threads import _loop as _sync

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
    uvloop = None  # type: ignore[assignment]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "aiol_"
LEAK_GRACE_S = 5.0

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
if uvloop is not None:
    LOOPS["uvloop"] = uvloop.new_event_loop

# Modules whose ``async def`` tests run on both loops: there the loop's own machinery is what is
# tested (see the module docstring). Elsewhere the loop only runs the test.
BOTH_LOOPS = frozenset(
    {
        "test_channel",  # worker pipes watched by the loop (add_reader)
        "test_deadline",  # timers
        "test_epoch",  # cancellation edges of the consumer
        "test_faults",  # crashes, signals, cancellation
        "test_fetch",  # io_concurrency, cancellation of fetches
        "test_fetch_deadline_queue",  # timers across io slots
        "test_launch_off_loop",  # the loop never stalls on a launch
        "test_loop_responsive",  # the loop's latency itself
        "test_offloop",  # threads handing results back to the loop
        "test_produce",  # the producer's tasks and their cancellation
        "test_reliability",  # the failure contract
        "test_shared_pool",  # one loop watching several loaders' workers
        "test_sources_http",  # aiohttp's transport on each loop
        "test_start_hang",  # start deadlines on the loop
        "test_threads",  # call_soon_threadsafe from the helper threads
        "test_workers",  # worker processes' pipes and deaths
    }
)
ALL_LOOPS = os.environ.get("AIOLOADER_TEST_LOOPS") == "both"

# The tier of each test module (see the module docstring).
TIERS: dict[str, str] = {
    **dict.fromkeys(
        [
            "test_batch",
            "test_cells",
            "test_collate",
            "test_config",
            "test_deadline",
            "test_device",
            "test_device_cuda",
            "test_device_packed",
            "test_exports",
            "test_failures",
            "test_layers",
            "test_prestack",
            "test_reorder",
            "test_routes",
            "test_sampler",
            "test_tree",
            "test_validate",
        ],
        "unit",
    ),
    **dict.fromkeys(
        [
            "test_accelerate",
            "test_benchmarks",
            "test_distributed",
            "test_docs",
            "test_doctor",
            "test_examples",
            "test_forked_program",
            "test_framework_settings",
            "test_lifetimes",
            "test_lightning",
            "test_packaging",
            "test_ray",
            "test_ray_bench",
            "test_shm_pressure",
            "test_soak",
            "test_worker_compat",
            "test_zygote",
        ],
        "system",
    ),
}
TIER_ORDER = {"system": 0, "loader": 1, "unit": 2}


def tier_of(module: str) -> str:
    """A test module's tier: named in :data:`TIERS`, else ``loader``."""
    return TIERS.get(module, "loader")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if inspect.iscoroutinefunction(metafunc.function):
        module = metafunc.module.__name__.rpartition(".")[2]
        kinds = list(LOOPS) if ALL_LOOPS or module in BOTH_LOOPS else ["asyncio"]
        metafunc.fixturenames.append("_loop_kind")
        metafunc.parametrize("_loop_kind", kinds, ids=kinds)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    kind = pyfuncitem.callspec.params["_loop_kind"]
    assert isinstance(kind, str)
    names = pyfuncitem._fixtureinfo.argnames
    kwargs = {name: pyfuncitem.funcargs[name] for name in names}
    baseline = pyfuncitem.funcargs.get("baseline")
    with asyncio.Runner(loop_factory=LOOPS[kind]) as runner:
        if isinstance(baseline, Baseline):
            runner.run(_watched(baseline))
        runner.run(pyfuncitem.obj(**kwargs))
        if isinstance(baseline, Baseline):  # the tasks while the loop still runs
            runner.run(baseline.check_tasks())
    return True


async def _watched(baseline: Baseline) -> None:
    baseline.watch_loop()


@pytest.fixture
def baseline(request: pytest.FixtureRequest) -> Iterator[Baseline]:
    """The leak check of RELIABILITY.md (common assertion iii), stricter than ``_no_leaks``: a
    baseline of descriptors, threads, processes and segments recorded before the test (after
    one warm-up epoch of the test's start method, its ``mp_context`` parameter if it has one),
    checked after it; an ``async def`` test's loop must also end with no task but its own, and
    nothing may have reached the loop's exception handler while the test ran."""
    params = getattr(request.node, "callspec", None)
    method = params.params.get("mp_context") if params is not None else None
    recorded = Baseline.record(method)
    yield recorded
    recorded.check()


def _sync_loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    made = LOOPS[kind]

    def factory() -> asyncio.AbstractEventLoop:
        loop = made()
        SYNC_LOOPS_MADE.append(type(loop).__module__)
        return loop

    return factory


# The modules of the loops made for ``for batch in loader`` under ``sync_loop``, for a test to
# check that its epochs really ran on the loop it asked for.
SYNC_LOOPS_MADE: list[str] = []


@pytest.fixture(params=list(LOOPS))
def sync_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test's synchronous epochs (``for batch in loader``: a private loop on a helper
    thread, uvloop where installed) on each event loop in turn: the stock asyncio loop too."""
    kind = request.param
    assert isinstance(kind, str)
    monkeypatch.setattr(_sync, "new_event_loop", _sync_loop_factory(kind))
    SYNC_LOOPS_MADE.clear()
    return kind


@pytest.fixture(autouse=True)
def _warnings_said_again() -> None:
    """Each test starts with no warning said yet: the package says each warning once per
    process (``aioloader._log.first_time``), which would make tests depend on their order."""
    reset_once()


@pytest.fixture(autouse=True)
def _sync_loop_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``AIOLOADER_TEST_SYNC_LOOP=asyncio`` runs every synchronous epoch of the suite on the
    stock asyncio loop (the package's own choice is uvloop where installed)."""
    kind = os.environ.get("AIOLOADER_TEST_SYNC_LOOP")
    if kind:
        monkeypatch.setattr(_sync, "new_event_loop", LOOPS[kind])


def our_segments() -> set[str]:
    """Segments of this process and its descendants (the pid is in the name). Other processes
    on the machine (another test run, another user's loader) share /dev/shm: theirs are not
    ours to count or remove."""
    pids = {os.getpid()}
    with contextlib.suppress(psutil.NoSuchProcess):
        pids.update(p.pid for p in psutil.Process().children(recursive=True))
    prefixes = tuple(f"{SHM_PREFIX}{pid}_" for pid in pids)
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(prefixes)}
    except FileNotFoundError:  # pragma: no cover - non-Linux
        return set()


def _helper_process(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
        name = p.name()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return True
    # The forkservers (the stdlib's, and the one forked from this process, which names itself)
    # and the resource tracker live as long as the test session, by design. Open MPI's
    # singleton daemon is not ours: where mpi4py is installed, Lightning's probe for an MPI
    # environment starts it, and it lives until this interpreter exits.
    return "forkserver" in cmd or "resource_tracker" in cmd or name in ("aiol-forkserver", "orted")


def child_pids() -> set[int]:
    """Our descendants, minus the session-long helpers themselves (not their children).

    Workers are forked by the forkserver, so they carry its command line: only the *direct*
    children of this process are recognised as the forkserver or the resource tracker; every
    process below them (a worker) counts.
    """
    pids: set[int] = set()
    for child in psutil.Process().children():
        if not _helper_process(child):
            pids.add(child.pid)
        with contextlib.suppress(psutil.NoSuchProcess):
            pids.update(p.pid for p in child.children(recursive=True))
    return pids


def thread_names() -> set[str]:
    return {f"{t.name}:{t.ident}" for t in threading.enumerate()}


def _wait_until_clean(check: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + LEAK_GRACE_S
    left = check()
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = check()
    return left


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a segment, a process or a thread behind."""
    if request.node.get_closest_marker("allow_leaks"):
        yield
        return
    segments, pids, threads = our_segments(), child_pids(), thread_names()
    yield
    import gc

    gc.collect()
    left_segments = _wait_until_clean(lambda: our_segments() - segments)
    left_pids = _wait_until_clean(lambda: child_pids() - pids)
    left_threads = _wait_until_clean(lambda: thread_names() - threads)
    problems = []
    if left_segments:
        problems.append(f"shared-memory segments left: {sorted(left_segments)}")
    if left_pids:
        problems.append(f"processes left: {sorted(left_pids)}")
    if left_threads:
        problems.append(f"threads left: {sorted(left_threads)}")
    assert not problems, "; ".join(problems)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "allow_leaks: skip the after-test leak check")
    for tier in TIER_ORDER:
        config.addinivalue_line("markers", f"{tier}: the {tier} tier (see tests/conftest.py)")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move everything imported so far (torch, Lightning, the test modules) out of the garbage
    collector's reach: the leak checks collect after every test, and with all of that in the
    heap one ``gc.collect()`` took ~160 ms, minutes over the suite. Objects made by the tests
    themselves are collected as before."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item.path.stem)
        item.add_marker(getattr(pytest.mark, tier))
    # Stable: within a tier, the order of collection.
    items.sort(key=lambda item: TIER_ORDER[tier_of(item.path.stem)])
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
