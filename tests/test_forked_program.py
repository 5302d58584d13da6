"""A program that forks while a loader exists (RELIABILITY.md row 39; issue #43, item 1).

A child forked from a program that used a loader (``os.fork()``, ``multiprocessing`` under
'fork', Lightning's ``ddp_fork``) holds copies of its parent's workers, pipes, loop thread and
segments. Its first epoch must get workers, slots and threads of its own, as a loader made in
the child would, and leave the parent's alone: the parent's epoch in flight goes on exactly,
its workers keep serving it, none of its segments is removed. An iterator the child inherited
mid-epoch cannot go on there: it refuses at once, never waits.

Every child runs under an alarm of its own and every wait here is bounded: a hang ends the
child with SIGALRM, which the parent reports, rather than the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fault_datasets as fd
import psutil
import pytest
from framework_data import child_pythonpath, gloo_environment
from helpers import BOUND_S

import aioloader

SAMPLES = 64
BATCH = 4
SHAPE = (64, 1024)  # 64 KiB a sample: batches travel in shared-memory slots
CHILD_LIMIT_S = 40  # the child's alarm: far past an epoch, well inside the test's timeout
GONE_WITHIN_S = 10.0  # the child's workers and server, once it has exited


def _loader(pool: aioloader.WorkerPool | None) -> aioloader.DataLoader:
    dataset = fd.Faulty(SAMPLES, shape=SHAPE)
    if pool is not None:
        return aioloader.DataLoader(dataset, batch_size=BATCH, seed=0, workers=pool, timeout=20)
    return fd.make_loader(dataset, batch_size=BATCH, num_workers=2, timeout=20)


def _indices(batches: Iterator[Any]) -> list[int]:
    return [i for batch in batches for i in fd.batch_indices(batch)]


def _parents_segments() -> set[str]:
    """The segments this process made (its pid is in their names)."""
    prefix = f"aiol_{os.getpid()}_"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


def _descendants() -> list[int]:
    out = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process.status() != psutil.STATUS_ZOMBIE:
                out.append(process.pid)
    return out


def _in_child(
    loader: aioloader.DataLoader, inherited: Iterator[Any] | None, close: Callable[[], None]
) -> dict[str, Any]:
    """What the child does and sees: the inherited iterator's next() (refused at once), a
    whole epoch of its own, its workers, and what of it is left after ``close``."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not the test runner's handler
    # A hang kills the child, its threads' stacks written to stderr first (the test's
    # captured output shows them); the parent says so.
    assert sys.__stderr__ is not None
    faulthandler.register(signal.SIGALRM, file=sys.__stderr__, all_threads=True, chain=True)
    signal.alarm(CHILD_LIMIT_S)
    report: dict[str, Any] = {"pid": os.getpid()}
    if inherited is not None:
        started = time.monotonic()
        try:
            next(inherited)
            report["inherited"] = "no error"
        except RuntimeError as exc:
            report["inherited"] = str(exc)
        report["inherited_s"] = time.monotonic() - started
    started = time.monotonic()
    report["indices"] = _indices(iter(loader))
    report["epoch_s"] = time.monotonic() - started
    report["workers"] = list(loader.worker_pids)
    report["descendants"] = _descendants()  # its workers and their server, while they run
    close()
    report["left_after_close"] = _descendants()
    return report


def _by_os_fork(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``run`` in a child made by ``os.fork()``; its report, once it has exited."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child (its coverage is not collected)
        code = 1
        try:
            os.close(read_fd)
            try:
                payload = json.dumps(run())
            except BaseException as exc:
                payload = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
            with os.fdopen(write_fd, "w") as out:
                out.write(payload)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    text = _read_bounded(read_fd, pid)
    status = _reap_bounded(pid)
    assert status == 0, f"the child ended with {status} (-14: SIGALRM, it hung): {text}"
    report: dict[str, Any] = json.loads(text)
    return report


def _by_multiprocessing(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``run`` in a ``multiprocessing`` child under 'fork' (Python 3.11's default start
    method on Linux); it leaves the loader open, as a program's child that simply ends does."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def target() -> None:
        try:
            send.send(json.dumps(run()))
        except BaseException as exc:
            send.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))

    process = context.Process(target=target)
    process.start()
    try:
        assert receive.poll(CHILD_LIMIT_S + 5), "no report from the child"
        report: dict[str, Any] = json.loads(receive.recv())
        process.join(CHILD_LIMIT_S)
        assert process.exitcode == 0, f"the child ended with {process.exitcode}: {report}"
    finally:
        if process.is_alive():
            process.kill()
            process.join(5)
        receive.close()
        send.close()
    return report


def _read_bounded(fd_: int, pid: int) -> str:
    chunks: list[bytes] = []
    deadline = time.monotonic() + CHILD_LIMIT_S + 5
    with os.fdopen(fd_, "rb") as pipe:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([pipe], [], [], 0.5)
            if ready:
                chunk = os.read(pipe.fileno(), 1 << 16)
                if not chunk:
                    return b"".join(chunks).decode()
                chunks.append(chunk)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("the child sent no report in time")


def _reap_bounded(pid: int) -> int:
    deadline = time.monotonic() + CHILD_LIMIT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the child did not exit in time")


def _gone(pids: list[int]) -> list[int]:
    """``pids`` still alive after :data:`GONE_WITHIN_S` (a zombie has exited)."""
    deadline = time.monotonic() + GONE_WITHIN_S
    while True:
        alive = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


@pytest.mark.parametrize("mid_epoch", [False, True], ids=["between_epochs", "mid_epoch"])
@pytest.mark.parametrize("shared", [False, True], ids=["own_workers", "shared_pool"])
@pytest.mark.parametrize("fork", ["os_fork", "multiprocessing"])
def test_a_forked_child_iterates_with_workers_of_its_own_and_the_parent_goes_on(
    fork: str, shared: bool, mid_epoch: bool
) -> None:
    pool = aioloader.WorkerPool(2) if shared else None
    loader = _loader(pool)
    try:
        assert sorted(_indices(iter(loader))) == list(range(SAMPLES))  # the parent iterated
        parent_workers = loader.worker_pids
        assert len(parent_workers) == 2
        assert loader.statistics().live_shm_slots > 0  # segments the child must leave alone
        epoch = iter(loader)
        first = fd.batch_indices(next(epoch)) if mid_epoch else []
        segments = _parents_segments()

        def close() -> None:
            if fork == "os_fork":  # the multiprocessing child just ends: its exit closes it
                loader.close()
                if pool is not None:
                    pool.close()

        def run() -> dict[str, Any]:
            return _in_child(loader, epoch if mid_epoch else None, close)

        report = (_by_os_fork if fork == "os_fork" else _by_multiprocessing)(run)
        assert "error" not in report, report["error"]
        # A whole epoch, every sample exactly once, from workers of the child's own.
        assert sorted(report["indices"]) == list(range(SAMPLES)), report["indices"]
        child_workers = report["workers"]
        assert len(child_workers) == 2, report
        assert not set(child_workers) & set(parent_workers), (child_workers, parent_workers)
        assert set(child_workers) <= set(report["descendants"]), report
        if mid_epoch:  # the iterator it inherited refuses at once, naming both processes
            assert report["inherited_s"] < 1.0, report
            assert "forked from it mid-epoch" in report["inherited"], report["inherited"]
            assert f"began in process {os.getpid()}" in report["inherited"], report
        if fork == "os_fork":  # closed: nothing of the child's runs any more
            assert report["left_after_close"] == [], report
        # Once the child has exited, nothing it started is left (its workers, its server).
        assert _gone(report["descendants"]) == []
        # None of the parent's segments was removed, its workers are the same, and its epoch
        # in flight, then the next one, are whole.
        assert segments <= _parents_segments(), sorted(segments - _parents_segments())
        rest = _indices(epoch)
        assert first + rest == list(range(SAMPLES))
        assert sorted(_indices(iter(loader))) == list(range(SAMPLES))
        assert loader.worker_pids == parent_workers
    finally:
        loader.close()
        if pool is not None:
            pool.close()


@pytest.mark.parametrize(
    "settings",
    [
        {"num_workers": 0},
        {"num_workers": 2, "thread_pool": True},
        {"num_workers": 2, "persistent_workers": True},
    ],
    ids=["one_thread", "thread_pool", "persistent_workers"],
)
def test_a_forked_child_runs_sync_and_async_epochs_of_its_own(settings: dict[str, Any]) -> None:
    # Threads of the parent do not exist in the child, whatever runs on them: the child's
    # epochs, `for` and `async for`, run on threads (and workers) of its own.
    loader = fd.make_loader(fd.Faulty(SAMPLES, shape=SHAPE), timeout=20, **settings)

    async def async_epoch() -> list[int]:
        return [i async for batch in loader for i in fd.batch_indices(batch)]

    try:
        assert sorted(_indices(iter(loader))) == list(range(SAMPLES))
        epoch = iter(loader)
        first = fd.batch_indices(next(epoch))

        def run() -> dict[str, Any]:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(CHILD_LIMIT_S)
            try:  # the parent's epoch, made in its threads or workers, cannot go on here
                next(epoch)
                inherited = "no error"
            except RuntimeError as exc:
                inherited = str(exc)
            sync = _indices(iter(loader))
            in_async = asyncio.run(async_epoch())
            workers = list(loader.worker_pids)
            loader.close()
            return {"sync": sync, "async": in_async, "workers": workers, "inherited": inherited}

        report = _by_os_fork(run)
        assert "error" not in report, report["error"]
        assert "forked from it mid-epoch" in report["inherited"], report
        assert sorted(report["sync"]) == list(range(SAMPLES)), report
        assert sorted(report["async"]) == list(range(SAMPLES)), report
        assert len(report["workers"]) == (
            0 if settings.get("thread_pool") else settings["num_workers"]
        ), report
        assert not set(report["workers"]) & set(loader.worker_pids), report
        assert first + _indices(epoch) == list(range(SAMPLES))
        assert sorted(_indices(iter(loader))) == list(range(SAMPLES))
    finally:
        loader.close()


def test_an_async_iterator_inherited_mid_epoch_refuses_at_once_in_the_child() -> None:
    # As the sync iterator: the epoch's tasks, loop and workers are the parent's. The child's
    # `await it.__anext__()` (under an asyncio.run of its own) refuses at once, naming both
    # processes; its own `async for` gets a whole epoch; the parent's epoch goes on whole.
    loader = _loader(None)
    loop = asyncio.new_event_loop()
    it = loader.__aiter__()

    async def rest() -> list[int]:
        return [i async for batch in it for i in fd.batch_indices(batch)]

    try:
        first = fd.batch_indices(loop.run_until_complete(it.__anext__()))

        def run() -> dict[str, Any]:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(CHILD_LIMIT_S)

            async def child() -> dict[str, Any]:
                started = time.monotonic()
                try:
                    await it.__anext__()
                    inherited = "no error"
                except RuntimeError as exc:
                    inherited = str(exc)
                elapsed = time.monotonic() - started
                mine = [i async for batch in loader for i in fd.batch_indices(batch)]
                return {"inherited": inherited, "inherited_s": elapsed, "indices": mine}

            report = asyncio.run(child())
            report["workers"] = list(loader.worker_pids)
            loader.close()
            return report

        report = _by_os_fork(run)
        assert "error" not in report, report["error"]
        assert report["inherited_s"] < 1.0, report
        assert "forked from it mid-epoch" in report["inherited"], report["inherited"]
        assert f"began in process {os.getpid()}" in report["inherited"], report
        assert "async for batch in loader" in report["inherited"], report
        assert sorted(report["indices"]) == list(range(SAMPLES)), report
        assert not set(report["workers"]) & set(loader.worker_pids), report
        assert first + loop.run_until_complete(rest()) == list(range(SAMPLES))
    finally:
        loop.run_until_complete(it.aclose())
        loader.close()
        loop.close()


def verdict(agreement: Any, step: int) -> bool:
    """Whether every rank has a batch ``step`` in ``agreement``, once its thread agreed (a
    bounded wait: a step no thread runs raises ``TimeoutError``)."""
    future = agreement.verdict(step)
    assert future is not None, f"step {step} was not offered"
    return bool(future.result(timeout=10))


def test_a_forked_childs_equal_steps_agreement_starts_fresh_on_a_thread_of_its_own() -> None:
    # The parent's agreement has a thread, an epoch open with steps offered, and a batch
    # carried: in the child none of them is its own. Its next epoch agrees on a thread of its
    # own (here over a stand-in for the collective: a process group needs other ranks, which
    # tests/test_distributed_lockstep.py has), and starts with nothing carried; the parent's
    # open epoch goes on on its thread.
    from aioloader._sampling import Lockstep

    lockstep = Lockstep((0, 1), "carry", all_min=lambda values: values)  # the others: the same
    open_epoch = lockstep.begin(0)
    open_epoch.offer(2, complete=False)
    assert [verdict(open_epoch, step) for step in (0, 1)] == [True, True]
    lockstep.carried = [("a batch of the parent's", 4, 16)]

    def run() -> dict[str, Any]:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(CHILD_LIMIT_S)
        carried = len(lockstep.carried)
        started = time.monotonic()
        agreement = lockstep.begin(1)
        agreement.offer(3, complete=True)
        verdicts = [verdict(agreement, step) for step in range(4)]  # none: TimeoutError
        threads = [t.name for t in threading.enumerate() if "equal-steps" in t.name]
        lockstep.close()
        return {
            "carried": carried,
            "verdicts": verdicts,
            "elapsed": time.monotonic() - started,
            "threads": threads,
        }

    try:
        report = _by_os_fork(run)
        assert "error" not in report, report["error"]
        assert report["carried"] == 0, report  # the parent's batch is the parent's
        assert report["verdicts"] == [True, True, True, False], report
        assert report["elapsed"] < 5, report
        assert len(report["threads"]) == 1, report  # its own, not the parent's copy
        open_epoch.offer(3, complete=True)  # the parent's epoch goes on on its thread
        assert [verdict(open_epoch, step) for step in (2, 3)] == [True, False]
        assert lockstep.carried == [("a batch of the parent's", 4, 16)]
    finally:
        lockstep.close()


def test_a_child_of_a_child_gets_workers_of_its_own_too() -> None:
    # The child's resources are its own, so its own fork passes them on likewise.
    with _loader(None) as loader:
        assert sorted(_indices(iter(loader))) == list(range(SAMPLES))

        def grandchild() -> dict[str, Any]:
            return _in_child(loader, None, loader.close)

        def child() -> dict[str, Any]:
            mine = sorted(_indices(iter(loader)))
            report = _by_os_fork(grandchild)
            report["child_indices"] = mine
            report["child_workers"] = list(loader.worker_pids)
            loader.close()
            return report

        report = _by_os_fork(child)
        assert "error" not in report, report["error"]
        assert report["child_indices"] == list(range(SAMPLES))
        assert sorted(report["indices"]) == list(range(SAMPLES))
        assert not set(report["workers"]) & set(report["child_workers"]), report
        assert not set(report["workers"]) & set(loader.worker_pids), report
        assert report["left_after_close"] == []
        assert sorted(_indices(iter(loader))) == list(range(SAMPLES))


@pytest.mark.parametrize("shared", [False, True], ids=["own_workers", "shared_pool"])
def test_pythons_forkserver_is_refused_in_a_forked_child_at_once(shared: bool) -> None:
    # The standard forkserver is the parent's child: multiprocessing cannot start workers
    # through it from the child. Refused at once, naming the start methods that work there.
    pool = aioloader.WorkerPool(2, "forkserver") if shared else None
    if pool is not None:
        loader = aioloader.DataLoader(fd.Faulty(SAMPLES), batch_size=BATCH, workers=pool)
    else:
        loader = fd.make_loader(fd.Faulty(SAMPLES), multiprocessing_context="forkserver")
    try:
        epoch = iter(loader)
        first = fd.batch_indices(next(epoch))

        def run() -> dict[str, Any]:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(CHILD_LIMIT_S)
            said = []
            for _ in range(2):  # and again: never a half-made pool that waits
                started = time.monotonic()
                try:
                    next(iter(loader))
                    said.append(("no error", 0.0))
                except RuntimeError as exc:
                    said.append((str(exc), time.monotonic() - started))
            return {"said": said, "left": _descendants()}

        report = _by_os_fork(run)
        for message, took in report["said"]:
            assert "Python's 'forkserver'" in message, message
            assert f"forked from process {os.getpid()}" in message, message
            assert "'spawn'" in message, message
            assert took < 1.0, report
        assert report["left"] == [], report  # it started nothing
        assert first + _indices(epoch) == list(range(SAMPLES))
    finally:
        loader.close()
        if pool is not None:
            pool.close()


def test_a_child_that_cannot_fork_its_worker_server_says_so_at_once() -> None:
    # Its workers start from a server forked from the child, which a thread of the child's own
    # makes unsafe (it may hold a lock the server would need): an error at once, never a wait.
    with _loader(None) as loader:
        assert sorted(_indices(iter(loader))) == list(range(SAMPLES))

        def run() -> dict[str, Any]:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(CHILD_LIMIT_S)
            stop = threading.Event()
            thread = threading.Thread(target=stop.wait)  # not a daemon: the program's own
            thread.start()
            started = time.monotonic()
            try:
                next(iter(loader))
                said = "no error"
            except RuntimeError as exc:
                said = "\n".join([str(exc), *getattr(exc, "__notes__", ())])
            took = time.monotonic() - started
            stop.set()
            thread.join(5)
            return {"said": said, "took": took, "left": _descendants()}

        report = _by_os_fork(run)
        assert f"forked from process {os.getpid()}" in report["said"], report
        assert "no other thread of its own runs" in report["said"], report
        assert report["took"] < 1.0, report
        assert report["left"] == [], report
        assert sorted(_indices(iter(loader))) == list(range(SAMPLES))


def test_a_pool_closed_before_the_fork_stays_closed_in_the_child() -> None:
    # Nothing to renew: the child's loader says the pool is closed, at once.
    pool = aioloader.WorkerPool(1)
    loader = _loader(pool)
    try:
        assert sorted(_indices(iter(loader))) == list(range(SAMPLES))
        pool.close()

        def run() -> dict[str, Any]:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(CHILD_LIMIT_S)
            started = time.monotonic()
            try:
                next(iter(loader))
                return {"said": "no error"}
            except RuntimeError as exc:
                return {"said": str(exc), "took": time.monotonic() - started}

        report = _by_os_fork(run)
        assert "WorkerPool this loader uses" in report["said"], report
        assert "is closed" in report["said"], report
        assert report["took"] < 1.0, report
    finally:
        loader.close()
        pool.close()


def test_module_locks_a_parent_thread_held_at_the_fork_are_free_in_the_child() -> None:
    # A thread of the parent holds every module-level lock of the loader as the process forks
    # (the fork copies them held, and that thread does not exist in the child): the child's
    # loader must still start its worker server, pickle its dataset copy, map slots and count
    # dataset users, none of which may wait on a lock nobody will ever release.
    from aioloader._loader import _closing
    from aioloader._shm import _attach
    from aioloader._workers import _payload, _zygote

    def locks() -> dict[str, Any]:
        return {
            "closing": _closing._users_lock,
            "zygote": _zygote._SERVER_LOCK,
            "payload": _payload._registry_lock,
            "attach": _attach._attach_lock,
        }

    holding, release = threading.Event(), threading.Event()

    def hold_them() -> None:
        with contextlib.ExitStack() as stack:
            for lock in locks().values():
                stack.enter_context(lock)
            holding.set()
            release.wait(CHILD_LIMIT_S)

    holder = threading.Thread(target=hold_them, daemon=True)
    holder.start()
    assert holding.wait(10)
    try:

        def run() -> dict[str, Any]:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(CHILD_LIMIT_S)
            free = {}
            for name, lock in locks().items():
                free[name] = lock.acquire(timeout=2)
                if free[name]:
                    lock.release()
            loader = _loader(None)
            try:
                indices = _indices(iter(loader))
            finally:
                loader.close()
            return {"free": free, "indices": sorted(indices)}

        report = _by_os_fork(run)
    finally:
        release.set()
        holder.join(10)
    assert report.get("free") == dict.fromkeys(locks(), True), report
    assert report["indices"] == list(range(SAMPLES)), report


# -- a child that ends normally ------------------------------------------------------------

# A child made by os.fork() that ends as programs do (sys.exit, the end of its script) runs
# the exit handlers it inherited, multiprocessing's among them, which terminates every daemon
# process in the record of children the child inherited: the parent's workers were there.
_EXITING_CHILD = """
import json, os, sys

import fault_datasets as fd

import aioloader

child_iterates = sys.argv[1] == "iterates"
loader = fd.make_loader(fd.Faulty(64), batch_size=4, num_workers=2, timeout=20, max_retries=0)
assert sorted(i for b in loader for i in fd.batch_indices(b)) == list(range(64))
workers = list(loader.worker_pids)
epoch = iter(loader)
first = fd.batch_indices(next(epoch))
pid = os.fork()
if pid == 0:
    if child_iterates:  # an epoch of its own, left open: its exit closes it
        assert sorted(i for b in loader for i in fd.batch_indices(b)) == list(range(64))
    sys.exit(0)
_, status = os.waitpid(pid, 0)
rest = [i for b in epoch for i in fd.batch_indices(b)]
again = sorted(i for b in loader for i in fd.batch_indices(b))
print(json.dumps({
    "child": os.waitstatus_to_exitcode(status), "epoch": first + rest, "again": again,
    "workers": workers, "after": list(loader.worker_pids),
}))
loader.close()
"""


def _run_program(script: Path, source: str, *argv: str) -> tuple[dict[str, Any], str]:
    """Run ``source`` as a program of its own (its own session, killed whole past
    CHILD_LIMIT_S); the JSON report on its last line of output, once it exited with 0, and
    what it wrote to stderr."""
    script.write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(
        [sys.executable, str(script), *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    ) as program:
        try:
            out, err = program.communicate(timeout=CHILD_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(program.pid, signal.SIGKILL)
            out, err = program.communicate()
            pytest.fail(f"the program overran {CHILD_LIMIT_S} s:\n{err.decode()[-3000:]}")
    assert program.returncode == 0, err.decode()[-3000:]
    report: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return report, err.decode()


@pytest.mark.parametrize("child", ["iterates", "idle"])
def test_a_child_that_exits_normally_leaves_the_parents_workers_alone(
    tmp_path: Path, child: str
) -> None:
    report, err = _run_program(tmp_path / "exiting_child.py", _EXITING_CHILD, child)
    assert report["child"] == 0, report
    # The epoch in flight at the fork, and the next, whole and in order, from the same workers.
    assert report["epoch"] == list(range(SAMPLES)), report
    assert report["again"] == list(range(SAMPLES)), report
    assert report["after"] == report["workers"], report
    assert len(report["workers"]) == 2, report
    assert "WorkerCrashedError" not in err, err[-3000:]


# -- 'fork' whose fallback is Python's forkserver ------------------------------------------

# A thread of the program runs as the loader is made: under 'fork' its fallback is then
# Python's forkserver, the parent's child. A child forked later that cannot fork its workers
# itself (a thread of its own runs) would start them through that server: refused at once,
# never multiprocessing's bare ChildProcessError. One that can fork them does so.
_FORK_FALLBACK = """
import json, os, sys, threading, time, warnings

import fault_datasets as fd

import aioloader

warnings.simplefilter("ignore")  # the fallback's own warning
stop = threading.Event()
busy = threading.Thread(target=stop.wait)
busy.start()
try:
    loader = fd.make_loader(fd.Faulty(16), multiprocessing_context="fork", timeout=20)
    parent = sorted(i for b in loader for i in fd.batch_indices(b))
finally:
    stop.set()
    busy.join()


def child(with_thread):
    signal_stop = threading.Event()
    thread = threading.Thread(target=signal_stop.wait)
    if with_thread:
        thread.start()
    started = time.monotonic()
    try:
        said = sorted(i for b in loader for i in fd.batch_indices(b))
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - started
    signal_stop.set()
    if with_thread:
        thread.join()
    loader.close()
    return {"said": said, "took": took}


reports = {}
for with_thread in (True, False):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 1
        try:
            os.write(w, json.dumps(child(with_thread)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as pipe:
        reports[str(with_thread)] = json.loads(pipe.read() or "{}")
    os.waitpid(pid, 0)
again = sorted(i for b in loader for i in fd.batch_indices(b))
print(json.dumps({"pid": os.getpid(), "parent": parent, "again": again, **reports}))
loader.close()
"""


def test_fork_falling_back_to_pythons_forkserver_is_refused_in_a_forked_child(
    tmp_path: Path,
) -> None:
    report, _ = _run_program(tmp_path / "fork_fallback.py", _FORK_FALLBACK)
    assert report["parent"] == report["again"] == list(range(16)), report
    refused = report["True"]  # a thread of the child's own runs: the fallback would be used
    assert refused["said"].startswith("RuntimeError: "), refused
    assert "Python's 'forkserver'" in refused["said"], refused
    assert f"forked from process {report['pid']}" in refused["said"], refused
    assert refused["took"] < 1.0, refused
    assert report["False"]["said"] == list(range(16)), report  # forked from the child itself


# -- Lightning's ddp_fork -----------------------------------------------------------------------

# Lightning forks its ranks from the program (``strategy="ddp_fork"``, what ``ddp_notebook``
# uses in Jupyter): here after the program iterated the loader it passes to ``fit()``.
_DDP_FORK = """
import json, os, sys, time
import warnings

from framework_data import Indexed
from lightning_model import Recorder, dump, trainer

import aioloader

outdir = sys.argv[1]


class RankRecorder(Recorder):
    def on_train_end(self):
        loader = self.trainer.train_dataloader
        dump(os.path.join(outdir, f"rank{self.global_rank}.json"), {
            "pid": os.getpid(),
            "indices": [i for indices, _, _ in self.train_records for i in indices],
            "workers": list(loader.worker_pids),
        })


if __name__ == "__main__":
    warnings.simplefilter("ignore")  # Lightning's own, and the loader's "built before the group"
    loader = aioloader.DataLoader(
        Indexed(), batch_size=4, shuffle=True, seed=1, num_workers=2, timeout=30
    )
    n = len(Indexed())
    assert sorted(i for b in loader for i in b["index"].tolist()) == list(range(n))
    workers = loader.worker_pids
    trainer(devices=2, strategy="ddp_fork", max_epochs=1).fit(
        RankRecorder(), train_dataloaders=loader
    )
    assert sorted(i for b in loader for i in b["index"].tolist()) == list(range(n))
    assert loader.worker_pids == workers, (loader.worker_pids, workers)
    dump(os.path.join(outdir, "parent.json"), {"pid": os.getpid(), "workers": list(workers)})
    loader.close()
"""

DDP_FORK_LIMIT_S = 150.0  # a hang guard (Lightning's import and two ranks on 2 busy cores)


@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning")
def test_lightning_ddp_fork_with_workers_finishes(tmp_path: Path) -> None:
    script = tmp_path / "ddp_fork.py"
    script.write_text(textwrap.dedent(_DDP_FORK))
    env = {
        **os.environ,
        **gloo_environment(),
        "PYTHONPATH": child_pythonpath(),
        "PYTHONFAULTHANDLER": "1",
    }
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, str(script), str(tmp_path)]
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    ) as child:
        try:
            output, _ = child.communicate(timeout=DDP_FORK_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the script and the ranks it forked
            output, _ = child.communicate()
            pytest.fail(f"ddp_fork overran {DDP_FORK_LIMIT_S} s:\n{output.decode()[-3000:]}")
    assert child.returncode == 0, output.decode()[-3000:]
    parent = json.loads((tmp_path / "parent.json").read_text())
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    seen: set[int] = set()
    for rank in ranks:
        # Built before the process group, the loader reads all of the data on each rank.
        assert sorted(rank["indices"]) == list(range(40)), rank["indices"]
        assert len(rank["workers"]) == 2, rank
        assert not set(rank["workers"]) & set(parent["workers"]), (rank, parent)
        assert not set(rank["workers"]) & seen, ranks
        seen |= set(rank["workers"])
    assert _gone([*seen, *parent["workers"]]) == []


def test_a_child_forked_while_a_thread_registers_a_segment_can_make_segments() -> None:
    # The resource tracker's lock held by a parent's thread (as the loader's leasing thread
    # holds it while it registers a new slot) as the process forks: the child made a segment
    # of its own and waited on that lock forever.
    from multiprocessing import resource_tracker

    from aioloader import _shm

    resource_tracker.ensure_running()
    tracker_lock = resource_tracker._resource_tracker._lock  # type: ignore[attr-defined]
    held, forked = threading.Event(), threading.Event()

    def hold() -> None:
        with tracker_lock:
            held.set()
            forked.wait(BOUND_S)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(BOUND_S)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(int(BOUND_S))  # a hang kills the child: the parent says so
                name, _ = _shm.create_segment(1 << 16, _shm.SHM_DIR)
                _shm.unlink(name)
                code = 0
            finally:
                os._exit(code)
    finally:
        forked.set()
        holder.join(BOUND_S)
    assert _reap_bounded(pid) == 0  # -14: SIGALRM, the child hung on the lock
