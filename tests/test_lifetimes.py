"""Programs that never close their loader end by themselves, leaving nothing behind.

Each test writes a small script the way torch users write them (a module-level loader, no
``with``, no ``close()``), runs it in a fresh interpreter, and checks what is left once it has
ended: its exit status and time, its stderr (no "was not closed" or leak warnings), the worker
processes it printed (gone), and shared-memory segments named after its pid or its workers'
(none). The script prints its worker pids before it ends; a stuck exit is a failed test within
the subprocess timeout, never a hung suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
EXIT_BOUND_S = 5.0  # the promise: "exits by itself within a couple of seconds"
SUBPROCESS_BOUND_S = 60.0

PROLOGUE = """
import os, sys
from aioloader import DataLoader
from datasets import Range

loader = DataLoader(Range(64), batch_size=4, num_workers=2)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    env["PYTHONWARNINGS"] = "default"  # a leak or unclosed warning would show on stderr
    return env


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    # The loader is made at module level; the loop runs under the usual guard (workers started
    # by the default start method import the main module, as with torch under spawn).
    guarded = 'if __name__ == "__main__":\n' + textwrap.indent(textwrap.dedent(body), "    ")
    path.write_text(PROLOGUE + guarded)
    return path


def _pids(stdout: str) -> tuple[int, list[int]]:
    for line in stdout.splitlines():
        if line.startswith("PIDS "):
            main, *workers = (int(x) for x in line.split()[1:])
            return main, workers
    raise AssertionError(f"the script printed no PIDS line; stdout: {stdout!r}")


def _assert_nothing_left(main_pid: int, workers: list[int]) -> None:
    deadline = time.monotonic() + EXIT_BOUND_S
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [p for p in workers if _running(p)]
        time.sleep(0.05)
    assert not alive, f"worker processes left running: {alive}"
    prefixes = tuple(f"aiol_{pid}_" for pid in (main_pid, *workers))
    left = [n for n in os.listdir("/dev/shm") if n.startswith(prefixes)]
    assert not left, f"shared-memory segments left: {left}"


def _running(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _assert_quiet(stderr: str) -> None:
    for word in ("was not closed", "leaked", "ResourceWarning", "Exception ignored"):
        assert word not in stderr, f"stderr mentions {word!r}:\n{stderr}"


def _run(path: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=SUBPROCESS_BOUND_S,
    )
    return proc, time.monotonic() - start


def _exit_time(stdout: str, ended: float) -> float:
    """Seconds from the script's last line (it prints ``END <monotonic>``) to its exit."""
    for line in stdout.splitlines():
        if line.startswith("END "):
            return ended - float(line.split()[1])
    raise AssertionError(f"the script printed no END line; stdout: {stdout!r}")


@pytest.mark.slow
def test_a_script_with_an_unclosed_module_level_loader_exits_promptly(tmp_path: Path) -> None:
    path = _script(
        tmp_path,
        """
        import time
        seen = [int(x) for batch in loader for x in batch]
        assert seen == list(range(64)), seen
        print("PIDS", os.getpid(), *loader.worker_pids, flush=True)
        print("END", time.monotonic(), flush=True)
        """,
    )
    proc, _ = _run(path)
    ended = time.monotonic()
    assert proc.returncode == 0, proc.stderr
    assert _exit_time(proc.stdout, ended) < EXIT_BOUND_S
    _assert_quiet(proc.stderr)
    _assert_nothing_left(*_pids(proc.stdout))


@pytest.mark.slow
def test_a_script_whose_training_step_raises_exits_with_the_error(tmp_path: Path) -> None:
    path = _script(
        tmp_path,
        """
        import time
        for i, batch in enumerate(loader):
            if i == 3:
                print("PIDS", os.getpid(), *loader.worker_pids, flush=True)
                print("END", time.monotonic(), flush=True)
                raise ValueError("the training step failed")
        """,
    )
    proc, _ = _run(path)
    ended = time.monotonic()
    assert proc.returncode == 1
    assert "ValueError: the training step failed" in proc.stderr
    assert _exit_time(proc.stdout, ended) < EXIT_BOUND_S
    _assert_quiet(proc.stderr.replace("ValueError: the training step failed", ""))
    _assert_nothing_left(*_pids(proc.stdout))


_SYNC_STEPS = """
import time
for i, batch in enumerate(loader):
    if i == 2:
        print("PIDS", os.getpid(), *loader.worker_pids, flush=True)
    time.sleep(0.5)  # a slow step: the signal lands mid-epoch
"""

# The same under ``async for`` on the main thread's loop, which the SIGTERM handler stops:
# releasing must not wait for that loop (it did, for the handler's whole 3 s bound, and left
# the segments to the resource tracker, which warned).
_ASYNC_STEPS = """
import time
import numpy as np
import aioloader

class Images:  # 192 KiB per sample: the batches travel in shared-memory segments
    def __len__(self):
        return 256

    def __getitem__(self, i):
        return np.full((64, 64, 48), i % 251, dtype=np.uint8)

loader = DataLoader(Images(), batch_size=8, num_workers=2)

async def main():
    i = 0
    async for batch in loader:
        if i == 2:
            print("PIDS", os.getpid(), *loader.worker_pids, flush=True)
        i += 1
        time.sleep(0.5)  # a slow training step, on the loop's thread

aioloader.run(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("steps", [_SYNC_STEPS, _ASYNC_STEPS], ids=["for", "async-for"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_epoch_ends_the_script_and_releases_everything(
    tmp_path: Path, sig: signal.Signals, steps: str
) -> None:
    """Ctrl-C (KeyboardInterrupt) or a scheduler's SIGTERM while batches are in flight, with
    no ``with`` anywhere: the script ends, its workers go, its segments are unlinked."""
    path = _script(tmp_path, steps)
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the PIDS line (or EOF if it died)
        main_pid, workers = _pids(line)
        assert workers, line
        proc.send_signal(sig)
        sent = time.monotonic()
        _, stderr = proc.communicate(timeout=SUBPROCESS_BOUND_S - (sent - start))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert time.monotonic() - sent < EXIT_BOUND_S
    # It ends as the signal says (its parent, a scheduler or torchrun, reads that status).
    assert proc.returncode == -sig, (proc.returncode, stderr)
    _assert_quiet(stderr)
    _assert_nothing_left(main_pid, workers)


def test_a_loader_collected_on_a_thread_that_holds_its_lock_is_closed_without_deadlock() -> None:
    """The collector runs a dead loader's finalizer on whichever thread allocates: found
    unreachable in a reference cycle while its own starter thread is making the workers
    (``ensure()``, the resources' lock held), the finalizer must not wait for that lock on
    that thread: it did, and the program's exit then waited on it forever."""
    import threading

    from datasets import Range

    from aioloader import DataLoader
    from aioloader._loader import _resources

    loader = DataLoader(Range(8), batch_size=4, num_workers=1)
    res = loader._res
    returned = threading.Event()

    def collected_while_ensuring() -> None:
        with res.lock:  # as ensure() holds it when an allocation there runs the collector
            _resources.finalize(res, "DataLoader")
            returned.set()

    thread = threading.Thread(target=collected_while_ensuring, daemon=True)
    thread.start()
    thread.join(10.0)
    assert returned.is_set(), "the finalizer waited for a lock its own thread holds"
    deadline = time.monotonic() + 20.0
    while not res.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert res.closed  # closed all the same, once the lock was free
    assert loader.worker_pids == ()
    loader.close()


@pytest.mark.slow
def test_torchs_forked_workers_leave_this_process_loaders_alone(tmp_path: Path) -> None:
    # torch's workers under 'fork' (its default on Linux) inherit this process's loaders. Where
    # one collects its copy of an unclosed loader (here: one an error left in a reference
    # cycle, and a sync iterator dropped mid-epoch in a cycle), that copy must not be closed:
    # its workers, pipes, threads and segments are the parent's. Before, the child raised
    # "can only join a child process" from the finalizer and waited 10 s for the parent's loop.
    path = _script(
        tmp_path,
        """
        import gc, time, warnings
        import torch

        class Collects(torch.utils.data.Dataset):
            def __len__(self):
                return 4

            def __getitem__(self, index):
                gc.collect()  # in torch's forked worker: finds the copies of the cycles below
                return index

        def fails_mid_epoch():
            failing = DataLoader(Range(64), batch_size=4, num_workers=2)
            try:
                for _ in failing:
                    raise ValueError("the training step failed")
            except ValueError:
                pass

        warnings.simplefilter("ignore", ResourceWarning)  # the parent's own collection, below
        gc.disable()  # the cycles stay for the forked children to find
        it = iter(loader)
        first = next(it).tolist()
        fails_mid_epoch()
        dropped = iter(DataLoader(Range(64), batch_size=4, num_workers=2))
        next(dropped)
        cycle = [dropped]
        cycle.append(cycle)
        del dropped, cycle
        waited = time.monotonic() + 10  # worker 1's launch may still be under way (a thread's)
        while len(loader.worker_pids) < 2 and time.monotonic() < waited:
            time.sleep(0.01)
        pids = loader.worker_pids
        assert len(pids) == 2, pids
        start = time.monotonic()
        torch_batches = list(
            torch.utils.data.DataLoader(
                Collects(), batch_size=None, num_workers=2, multiprocessing_context="fork"
            )
        )
        print("TORCH_S", time.monotonic() - start, flush=True)
        assert [int(b) for b in torch_batches] == [0, 1, 2, 3], torch_batches
        rest = [x for batch in it for x in batch.tolist()]
        assert first + rest == list(range(64)), (first, rest)
        assert loader.worker_pids == pids, (pids, loader.worker_pids)
        gc.enable()
        gc.collect()
        loader.close()
        print("PIDS", os.getpid(), *pids, flush=True)
        """,
    )
    proc, _ = _run(path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    _assert_quiet(proc.stderr)
    torch_s = next(float(x.split()[1]) for x in proc.stdout.splitlines() if x.startswith("TORCH_S"))
    assert torch_s < EXIT_BOUND_S, proc.stdout
    _assert_nothing_left(*_pids(proc.stdout))


@pytest.mark.slow
def test_a_loader_built_before_a_fork_and_used_in_the_child_is_closed_by_the_child(
    tmp_path: Path,
) -> None:
    # Its workers and segments are made in the child, so they are the child's to release (the
    # guard against closing a parent's loader from a child must not skip them).
    path = _script(
        tmp_path,
        """
        import multiprocessing as mp
        import psutil

        loader.close()  # the prologue's starts its workers at once: this one starts nothing
        unused = DataLoader(Range(64), batch_size=4, num_workers=2, multiprocessing_context="spawn")

        def child(queue):
            seen = [int(x) for batch in unused for x in batch]
            pids = unused.worker_pids
            unused.close()
            alive = [p for p in pids if psutil.pid_exists(p)
                     and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
            queue.put((seen == list(range(64)), pids, alive))

        context = mp.get_context("fork")
        queue = context.Queue()
        process = context.Process(target=child, args=(queue,))
        process.start()
        complete, pids, alive = queue.get(timeout=50)
        process.join(30)
        assert complete and pids and not alive, (complete, pids, alive)
        print("PIDS", process.pid, *pids, flush=True)
        """,
    )
    proc, _ = _run(path)
    assert proc.returncode == 0, proc.stderr
    _assert_quiet(proc.stderr)
    _assert_nothing_left(*_pids(proc.stdout))


_STATS_MODULE = """
import os
from aioloader import DataLoader

class Halves:  # defined by a module whose import is still running when the loader is used
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i / 2

def total(batch):
    return sum(batch)

loader = DataLoader(Halves(), batch_size=4, num_workers=2, timeout=20, collate_fn=total,
                    multiprocessing_context=os.environ["START_METHOD"])
TOTAL = sum(loader)
PIDS = loader.worker_pids
loader.close()
"""


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_a_loader_iterated_while_its_module_is_imported(tmp_path: Path, start_method: str) -> None:
    # Statistics computed at import time (`import stats` in the training script, or pytest
    # importing a test module): pickling the dataset's class by reference would import its
    # module, which waits for this very import (a deadlock), and a worker importing it would
    # run the loader again. They go by value, as __main__'s do.
    (tmp_path / "stats.py").write_text(_STATS_MODULE)
    (tmp_path / "train.py").write_text(
        "import os, stats\nprint(stats.TOTAL, os.getpid(), *stats.PIDS)\n"
    )
    env = {**_env(), "START_METHOD": start_method}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "train.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=SUBPROCESS_BOUND_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    total, pid, *workers = proc.stdout.split()
    assert float(total) == sum(i / 2 for i in range(8))
    assert len(workers) == 2
    _assert_quiet(proc.stderr)
    _assert_nothing_left(int(pid), [int(w) for w in workers])


# -- nothing of the loader outlives the last loader and pool (issue #35, item 1) ----------------

_NOTHING_LEFT = TESTS / "scripts" / "nothing_left_after_close.py"


@pytest.mark.parametrize("scenario", ["close", "async_with", "dropped", "exception", "two"])
def test_no_process_of_the_loader_remains_once_it_is_closed(scenario: str) -> None:
    """Reliability contract #33: once the last loader is closed (however it ends), the program
    has no descendant but the resource tracker: the forked worker server is gone too, so no
    copy of the program's memory outlives the loaders. Listed while the program still runs
    (once it exits, an orphaned server would be the init process's, not its child)."""
    proc = subprocess.run(
        [sys.executable, str(_NOTHING_LEFT), scenario],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_BOUND_S,
        env=_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "LEFT []" in proc.stdout
    _assert_quiet(proc.stderr)
