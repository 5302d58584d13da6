"""Worker processes are launched off the event loop, and the forkserver's own start is not a
worker's start.

Under the standard forkserver (taken whenever a non-daemon thread runs as the loader is made:
the loop's default executor after one ``asyncio.to_thread``, a loader made off the main thread,
or ``mp_context='forkserver'``), ``Process.start()`` blocks until the server has forked the
process, and the first one waits for the server's own start (a fresh interpreter importing
aioloader, numpy and torch, about a second). Started from a job on the event loop, that
stalled the loop and was charged to ``start_timeout``.

The checks here are structural where they can be: every ``Process.start()`` is recorded with
whether its thread runs an event loop. The cold-server checks run in a fresh interpreter (this
one's forkserver is warm) whose server takes at least :data:`SERVER_SLEEP_S` to start, far over
the start deadline they set, so they fail without the fix on any machine.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from datasets import Range

import aioloader
from aioloader import _workers
from aioloader._workers import _launch

pytestmark = pytest.mark.usefixtures("baseline")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
BOUND_S = 60.0


@pytest.fixture
def starts(baseline: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every ``Process.start()`` from now on: its thread's name, and whether that thread runs
    an event loop (recorded after the baseline's warm-up epoch)."""
    seen: list[tuple[str, bool]] = []
    real = multiprocessing.process.BaseProcess.start

    def start(self: multiprocessing.process.BaseProcess) -> None:
        on_loop = asyncio._get_running_loop() is not None
        seen.append((threading.current_thread().name, on_loop))
        real(self)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    return seen


def _on_a_loop(starts: list[tuple[str, bool]]) -> list[str]:
    return [name for name, on_loop in starts if on_loop]


@pytest.mark.parametrize("mp_context", ["forkserver", None], ids=["forkserver", "default"])
async def test_no_worker_process_starts_on_the_event_loop_thread(
    mp_context: str | None, starts: list[tuple[str, bool]]
) -> None:
    await asyncio.to_thread(time.sleep, 0)  # the default executor: a non-daemon thread runs
    loader = aioloader.DataLoader(Range(16), batch_size=4, num_workers=2, mp_context=mp_context)
    try:
        async with asyncio.timeout(BOUND_S):
            items = [i for batch in [b async for b in loader] for i in batch.tolist()]
    finally:
        await loader.aclose()
    assert sorted(items) == list(range(16))
    assert starts, "no worker process was started"
    assert not _on_a_loop(starts), f"started on an event loop's thread: {starts}"


@pytest.mark.parametrize("mp_context", ["forkserver", None], ids=["forkserver", "default"])
def test_sync_iteration_starts_no_worker_process_on_its_loop_thread(
    mp_context: str | None, starts: list[tuple[str, bool]]
) -> None:
    release = threading.Event()
    other = threading.Thread(target=release.wait, args=(BOUND_S,), name="a-program-thread")
    other.start()  # not a daemon: the loader cannot fork its own server
    try:
        loader = aioloader.DataLoader(Range(16), batch_size=4, num_workers=2, mp_context=mp_context)
        try:
            items = [i for batch in loader for i in batch.tolist()]
        finally:
            loader.close()
    finally:
        release.set()
        other.join(BOUND_S)
    assert sorted(items) == list(range(16))
    assert starts, "no worker process was started"
    assert not _on_a_loop(starts), f"started on an event loop's thread: {starts}"


def _echo(x: Any) -> Any:
    return x


@pytest.mark.parametrize("mp_context", ["forkserver", None], ids=["forkserver", "default"])
async def test_jobs_launch_their_workers_off_the_loop(
    mp_context: str | None, starts: list[tuple[str, bool]]
) -> None:
    # No start at construction here: the first jobs launch the workers (as a replacement
    # worker's first job does).
    context = _workers.resolve_context(mp_context, allow_fork=False)
    pool = _workers.WorkerPool(2, context, 0)
    try:
        jobs = (pool.submit(_echo, i, batch_id=i) for i in range(6))
        results = await asyncio.wait_for(asyncio.gather(*jobs), BOUND_S)
        assert results == list(range(6))
        assert len(set(pool.pids())) == 2
    finally:
        await asyncio.to_thread(pool.close)
    assert len(starts) >= 2
    assert not _on_a_loop(starts), f"started on an event loop's thread: {starts}"


async def test_forkserver_workers_start_as_the_loader_is_made() -> None:
    loader = aioloader.DataLoader(Range(8), batch_size=4, num_workers=2, mp_context="forkserver")
    try:
        async with asyncio.timeout(BOUND_S):  # nothing iterates: the loader started them
            while len(loader.worker_pids) < 2:  # noqa: ASYNC110 - no event to await
                await asyncio.sleep(0.01)
            assert [b.tolist() async for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    finally:
        await loader.aclose()


# How long a launch of StuckLaunchContext blocks before it fails; the launch deadline the test
# sets is far shorter.
STUCK_S = 4.0
LAUNCH_DEADLINE_S = 0.5


class _StuckLaunchProcess(multiprocessing.context.SpawnProcess):
    def start(self) -> None:
        time.sleep(STUCK_S)  # a start method that never gives the worker a process
        raise OSError("the launch gave up")


class StuckLaunchContext(multiprocessing.context.SpawnContext):
    """A start method whose launches block, then fail: as a server that never forks."""

    Process = _StuckLaunchProcess


async def test_a_launch_past_its_deadline_fails_the_batch_with_worker_init_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_launch, "LAUNCH_TIMEOUT_S", LAUNCH_DEADLINE_S)
    loader = aioloader.DataLoader(
        Range(8), batch_size=4, num_workers=1, mp_context=StuckLaunchContext(), start_timeout=0.2
    )
    try:
        async with asyncio.timeout(BOUND_S):
            with pytest.raises(aioloader.WorkerInitError, match="was not launched") as info:
                await anext(aiter(loader))
    finally:
        await loader.aclose()
    text = str(info.value)
    assert "worker 0 (no pid yet) was not launched within 0.5 s" in text, text
    assert "start_timeout=0.2, but at least 0.5 s for a launch" in text, text
    assert "batch 0 was not run" in text, text


# At least how long the fresh interpreter's forkserver takes to start (it imports a module that
# sleeps), over and above its imports of aioloader and torch; the start deadline is far shorter.
SERVER_SLEEP_S = 1.5
START_TIMEOUT_S = 0.5
# The exit test's server sleeps longer: the program's own end (torch imported, its threads and
# modules torn down) takes 0.6-0.7 s here alone and more beside other tests, so a bound of half
# of 1.5 s told a slow exit from one that waited for the server only by a hair; with 3.0 s, a
# full suite on two busy cores still took 1.56 s to end once. A program that waits for the
# server takes the whole sleep, so half of it still tells the two apart.
EXIT_SERVER_SLEEP_S = 6.0

_COLD = """
import asyncio, contextlib, json, sys, time
import multiprocessing.process

import psutil

import aioloader
from aioloader._workers import _context

_context.WORKER_MODULE = "slow_server_start"  # what the forkserver imports before it forks
on_loop = []
probes = []  # the pids of the processes that tell the forkserver is up: not workers
_real_start = multiprocessing.process.BaseProcess.start


def start(self):
    on_loop.append(asyncio._get_running_loop() is not None)
    _real_start(self)
    if self.name == "aioloader-probe":
        probes.append(self.pid)


multiprocessing.process.BaseProcess.start = start


class Items:
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return i


def workers():
    # Descendants but the session's helpers (the forkserver, the resource tracker) themselves
    # and the probe that told the forkserver was up (which may outlive its join, on busy cores).
    found = []
    for child in psutil.Process().children():
        if "forkserver" not in " ".join(child.cmdline()) and "resource_tracker" not in " ".join(
            child.cmdline()
        ):
            found.append(child.pid)
        found += [p.pid for p in child.children(recursive=True)]
    return [pid for pid in found if pid not in probes]


async def main(mode):
    await asyncio.to_thread(time.sleep, 0)  # the default executor: a non-daemon thread runs
    lags = []

    async def tick():
        while True:
            began = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - began - 0.005)

    ticker = asyncio.create_task(tick())
    made = time.perf_counter()
    loader = aioloader.DataLoader(Items(), batch_size=4, num_workers=2, start_timeout=START)
    out = {}
    if mode in ("iterate", "enter"):
        items = []
        try:
            async with contextlib.AsyncExitStack() as stack:
                if mode == "enter":  # the workers start in `async with`, under start_timeout
                    await stack.enter_async_context(loader)
                async for batch in loader:
                    out.setdefault("first_batch_s", time.perf_counter() - made)
                    items += batch.tolist()
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            await loader.aclose()
        out["items"] = sorted(items)
    else:
        began = time.perf_counter()
        try:
            async with asyncio.timeout(0.05):
                async with loader:
                    await asyncio.sleep(60)
        except TimeoutError:
            out["cancelled_s"] = time.perf_counter() - began
        if mode == "exit":  # asyncio.run waits for the start's thread, then the program ends
            ticker.cancel()
            print(json.dumps({"cancelled_at": time.monotonic()}), flush=True)
            return
        # The server is up (on busy cores its start can take seconds past SLEEP): a launch
        # after the close shows by then.
        up_by = time.monotonic() + SLEEP + 10.0
        await asyncio.sleep(SLEEP)
        while not probes and time.monotonic() < up_by:
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)
        out["left"] = workers()
    ticker.cancel()
    out["max_lag_s"] = max(lags)
    out["on_loop"] = on_loop
    print(json.dumps(out))


START = float(sys.argv[2])
SLEEP = float(sys.argv[3])
asyncio.run(main(sys.argv[1]))
"""


def _cold(tmp_path: Path, mode: str, server_sleep_s: float = SERVER_SLEEP_S) -> dict[str, Any]:
    (tmp_path / "slow_server_start.py").write_text(
        "import time\nimport aioloader._workers._worker  # noqa: F401\n"
        f"time.sleep({server_sleep_s})\n"
    )
    script = tmp_path / "cold.py"
    script.write_text(textwrap.dedent(_COLD))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), str(tmp_path)]))
    argv = [sys.executable, str(script), mode, str(START_TIMEOUT_S), str(server_sleep_s)]
    if mode == "exit":  # the process's own end: the server it started may outlive it a while
        with (tmp_path / "out").open("w+") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
            assert proc.wait(BOUND_S) == 0
            ended = time.monotonic()
            out.seek(0)
            result: dict[str, Any] = json.loads(out.read().strip().splitlines()[-1])
        result["exited_s"] = ended - result["cancelled_at"]
        return result
    ran = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=BOUND_S)
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    return result


def test_a_cold_forkserver_does_not_stall_the_loop(tmp_path: Path) -> None:
    out = _cold(tmp_path, "iterate")
    assert "error" not in out, out["error"]
    assert out["items"] == list(range(16))
    assert out["on_loop"], "no process was started"
    assert not any(out["on_loop"]), out
    # The first batch waited for the server's start; the loop ran meanwhile.
    assert out["first_batch_s"] > SERVER_SLEEP_S
    assert out["max_lag_s"] < SERVER_SLEEP_S / 2, out


def test_a_cold_forkservers_start_does_not_count_against_start_timeout(tmp_path: Path) -> None:
    out = _cold(tmp_path, "enter")
    assert "error" not in out, out["error"]
    assert out["items"] == list(range(16))
    assert out["first_batch_s"] > SERVER_SLEEP_S > START_TIMEOUT_S


def test_a_cancelled_start_does_not_wait_for_the_forkservers_start(tmp_path: Path) -> None:
    out = _cold(tmp_path, "cancel")
    assert "cancelled_s" in out, out
    # The loader closed without waiting for the server (which took SERVER_SLEEP_S at least)...
    assert out["cancelled_s"] < SERVER_SLEEP_S / 2, out
    # ...and no worker was launched once the server was up.
    assert out["left"] == [], out
    assert not any(out["on_loop"]), out


def test_a_program_ends_promptly_after_a_cancelled_start(tmp_path: Path) -> None:
    # The start's thread (asyncio.to_thread) waited for the workers' launch, and the server's
    # start with it: asyncio.run, and the program, waited for that thread. Closing the pool
    # tells what waits for a launch at once.
    out = _cold(tmp_path, "exit", EXIT_SERVER_SLEEP_S)
    assert out["exited_s"] < EXIT_SERVER_SLEEP_S / 2, out
