"""The forkserver forked from the main process: fast, no second run of the main script, and it
keeps nothing of the main process's that others wait on.

Most checks run a script in a fresh interpreter: the server is forked once per process, and this
test process forked its own long ago (or could not, with threads running).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import psutil
import pytest

from aioloader._workers._zygote import SERVER_NAME, fork_is_safe

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
BOUND_S = 60.0


def _run(code: str, tmp_path: Path, *, as_file: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    env["PYTHONWARNINGS"] = "default"
    source = textwrap.dedent(code)
    if as_file:
        path = tmp_path / "script.py"
        path.write_text(source)
        argv = [sys.executable, str(path)]
    else:
        argv = [sys.executable, "-c", source]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=BOUND_S)


def test_a_script_without_a_main_guard_runs_once_with_workers(tmp_path: Path) -> None:
    """As with torch's fork on Linux: the workers do not run the script again."""
    proc = _run(
        """
        import os
        from aioloader import DataLoader

        class Squares:
            def __len__(self):
                return 40
            def __getitem__(self, i):
                return i * i

        print("script body ran in", os.getpid(), flush=True)
        loader = DataLoader(Squares(), batch_size=8, num_workers=2)
        print("total", sum(int(x) for batch in loader for x in batch))
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("script body ran in") == 1, proc.stdout
    assert f"total {sum(i * i for i in range(40))}" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "was not closed" not in proc.stderr, proc.stderr


def test_a_dataset_class_defined_in_python_c_works_with_workers(tmp_path: Path) -> None:
    proc = _run(
        """
        from aioloader import DataLoader
        class Doubles:
            def __len__(self): return 10
            def __getitem__(self, i): return 2 * i
        with DataLoader(Doubles(), batch_size=5, num_workers=2) as loader:
            print([[int(x) for x in b] for b in loader])
        """,
        tmp_path,
        as_file=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[[0, 2, 4, 6, 8], [10, 12, 14, 16, 18]]"


@pytest.mark.parametrize("method", [None, "fork"])
def test_the_server_holds_no_socket_or_pipe_of_the_main_process(
    tmp_path: Path, method: str | None
) -> None:
    """A connection the program closes is closed for its peer, though the server (or, under
    'fork', each worker, forked from the program itself) was forked while it was open (a TCP
    connection, a torch.distributed store, a subprocess pipe)."""
    proc = _run(
        f"""
        import os, socket
        from aioloader import DataLoader
        from datasets import Range

        mine, peer = socket.socketpair()
        read_end, write_end = os.pipe()
        with DataLoader(Range(8), batch_size=4, num_workers=2, mp_context={method!r}) as loader:
            assert [len(b) for b in loader] == [4, 4]
            mine.close()
            os.close(write_end)
            peer.settimeout(10)
            print("socket peer sees", peer.recv(1))  # b'' once every holder has closed it
            print("pipe reader sees", os.read(read_end, 1))
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "socket peer sees b''" in proc.stdout, proc.stdout
    assert "pipe reader sees b''" in proc.stdout, proc.stdout


def test_workers_fork_from_the_server_and_name_themselves(tmp_path: Path) -> None:
    """Every worker is forked from the server (none from the program as the loader is made: on
    the cold-start benchmark that bought nothing measurable); each names itself for ps."""
    proc = _run(
        """
        import os, psutil
        from aioloader import DataLoader
        from datasets import Range

        with DataLoader(Range(8), batch_size=4, num_workers=2) as loader:
            assert [len(b) for b in loader] == [4, 4]
            for pid in loader.worker_pids:
                worker = psutil.Process(pid)
                parent = worker.parent()
                origin = "program" if parent.pid == os.getpid() else parent.name()
                print("worker", worker.name(), "from", origin)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("worker"))
    assert lines == [
        f"worker aiol-worker-0 from {SERVER_NAME.decode()}",
        f"worker aiol-worker-1 from {SERVER_NAME.decode()}",
    ], proc.stdout


def test_fork_workers_that_cannot_be_forked_start_from_the_server(tmp_path: Path) -> None:
    """Under 'fork', the forks from the program as the epoch begins fail (EAGAIN: no process
    left to the user): nothing is lost, no error, the workers start from the server."""
    proc = _run(
        """
        import multiprocessing, os, psutil
        from aioloader import DataLoader
        from aioloader._workers import _pool
        from datasets import Range

        class Refused:  # the fork context, whose processes cannot start
            def __getattr__(self, name):
                return getattr(multiprocessing.get_context("fork"), name)
            def Process(self, *args, **kwargs):
                raise BlockingIOError(11, "Resource temporarily unavailable")

        _pool._FORK = Refused()
        with DataLoader(Range(8), batch_size=4, num_workers=2, mp_context="fork") as loader:
            assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
            parents = {psutil.Process(pid).parent().pid for pid in loader.worker_pids}
            print("workers", len(loader.worker_pids), "from program", os.getpid() in parents)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "workers 2 from program False" in proc.stdout, proc.stdout


def test_output_buffered_before_the_fork_is_written_once(tmp_path: Path) -> None:
    proc = _run(
        """
        from aioloader import DataLoader
        from datasets import Range
        print("buffered, not flushed")  # stdout is a pipe: block-buffered
        with DataLoader(Range(8), batch_size=4, num_workers=2) as loader:
            list(loader)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("buffered, not flushed") == 1, proc.stdout


def test_the_server_names_itself_and_ends_with_the_program(tmp_path: Path) -> None:
    proc = _run(
        """
        from aioloader import DataLoader
        from aioloader._workers._zygote import zygote_pid
        from datasets import Range
        loader = DataLoader(Range(8), batch_size=4, num_workers=2)
        print(sum(len(b) for b in loader), zygote_pid())
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    total, pid = (int(x) for x in proc.stdout.split())
    assert total == 8
    try:
        process = psutil.Process(pid)
        process.wait(timeout=5)  # not ours to reap: it was the script's child
    except psutil.NoSuchProcess:
        pass
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


THREAD_SCRIPT = """
import threading
from aioloader import DataLoader
from aioloader._workers._zygote import zygote_pid
from datasets import Range

if __name__ == "__main__":  # the standard forkserver imports the main module in its server
    release = threading.Event()
    {setup}
    with DataLoader(Range(8), batch_size=4, num_workers=2) as loader:
        method = loader.mp_context.get_start_method()
        print([len(b) for b in loader], zygote_pid() is not None, method)
    release.set()
"""


def test_a_daemon_thread_of_someone_else_does_not_stop_the_fork(tmp_path: Path) -> None:
    """A notebook kernel runs daemon threads (heartbeat, output) all the time."""
    setup = "threading.Thread(target=release.wait, args=(30,), daemon=True).start()"
    proc = _run(THREAD_SCRIPT.format(setup=setup), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[4,", "4]", "True", "forkserver"], proc.stdout


def test_a_non_daemon_thread_makes_the_loader_use_the_standard_forkserver(tmp_path: Path) -> None:
    setup = "threading.Thread(target=release.wait, args=(30,)).start()"
    proc = _run(THREAD_SCRIPT.format(setup=setup), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[4,", "4]", "False", "forkserver"], proc.stdout


PRELOAD_SCRIPT = """
import sys, threading
{imports}
from aioloader import DataLoader


class WhatWorkersHave:
    def __len__(self):
        return 4

    def __getitem__(self, index):
        return "torch" in sys.modules  # read before anything here could import it


if __name__ == "__main__":
    release = threading.Event()
    threading.Thread(target=release.wait, args=(30,)).start()  # no forked server now
    with DataLoader(WhatWorkersHave(), batch_size=2, num_workers=2, collate_fn=list) as loader:
        print(loader.mp_context.get_start_method(), [b for b in loader])
    release.set()
"""


@pytest.mark.parametrize("uses_torch", [True, False])
def test_the_standard_forkserver_preloads_torch_where_the_program_uses_it(
    tmp_path: Path, uses_torch: bool
) -> None:
    # Else every worker it forks imports torch (about 1 s) at its first batch: the first batch
    # of every loader of such a process took seconds. A program without torch does not pay.
    imports = "import torch" if uses_torch else ""
    proc = _run(PRELOAD_SCRIPT.format(imports=imports), tmp_path)
    assert proc.returncode == 0, proc.stderr
    method, batches = proc.stdout.split(maxsplit=1)
    assert method == "forkserver"
    assert batches.strip() == str([[uses_torch] * 2] * 2)


def test_off_the_main_thread_the_loader_uses_the_standard_forkserver(tmp_path: Path) -> None:
    proc = _run(
        """
        import threading
        from aioloader import DataLoader
        from aioloader._workers._zygote import zygote_pid
        from datasets import Range

        def build():
            with DataLoader(Range(8), batch_size=4, num_workers=2) as loader:
                print([len(b) for b in loader], zygote_pid() is not None)

        if __name__ == "__main__":
            thread = threading.Thread(target=build)
            thread.start()
            thread.join()
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[4,", "4]", "False"], proc.stdout


def test_the_server_is_named_for_ps_and_top(tmp_path: Path) -> None:
    proc = _run(
        """
        import psutil
        from aioloader import DataLoader
        from aioloader._workers._zygote import zygote_pid
        from datasets import Range
        with DataLoader(Range(8), batch_size=4, num_workers=1) as loader:
            list(loader)
            print(psutil.Process(zygote_pid()).name())
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == SERVER_NAME.decode()


def test_a_pid_read_by_another_thread_does_not_leave_its_launch_waiting(tmp_path: Path) -> None:
    # multiprocessing polls every child from each Process.start(): such a poll may read a new
    # worker's pid just as the thread launching it starts to wait for it (a loader's start
    # thread launching its workers while the program starts another loader's). That thread
    # waited for the pipe forever: nothing more comes down it until the child exits.
    proc = _run(
        """
        import threading, time
        from aioloader._workers import _zygote

        context = _zygote.zygote_context()
        assert context is not None
        process = context.Process(target=time.sleep, args=(30,), daemon=True)
        process.start()
        popen = process._popen
        real_wait = _zygote._connection.wait
        stolen = []

        def wait(objects, timeout=None):
            if timeout != 0 and not stolen:
                real_wait(objects, 10)  # the pid has come
                stolen.append(popen.poll())  # and another thread's poll reads it first
            return real_wait(objects, timeout)

        _zygote._connection.wait = wait
        got = []
        waiter = threading.Thread(target=lambda: got.append(popen.pid), daemon=True)
        waiter.start()
        waiter.join(10)
        _zygote._connection.wait = real_wait
        print(stolen, waiter.is_alive(), got == [process.pid], process.is_alive())
        process.kill()
        process.join(10)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[None]", "False", "True", "True"]


def test_fork_is_unsafe_while_a_non_daemon_thread_runs() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait, args=(10,), name="busy")
    thread.start()
    try:
        assert not fork_is_safe()
    finally:
        release.set()
        thread.join()


def test_a_loader_made_while_a_module_imports_does_not_freeze_that_module(tmp_path: Path) -> None:
    """A loader made at a module's top level: names the module defines further down still
    reach the workers (the server is not forked from a half-imported module)."""
    (tmp_path / "made_on_import.py").write_text(
        textwrap.dedent(
            """
            from aioloader import DataLoader
            from datasets import Range

            early = DataLoader(Range(4), batch_size=2, num_workers=1)

            class DefinedLater:
                def __len__(self):
                    return 4
                def __getitem__(self, i):
                    return 10 * i
            """
        )
    )
    proc = _run(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import made_on_import
        from aioloader import DataLoader
        made_on_import.early.close()
        with DataLoader(made_on_import.DefinedLater(), batch_size=2, num_workers=2) as loader:
            print([[int(x) for x in b] for b in loader])
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[[0, 10], [20, 30]]"


@pytest.mark.parametrize("mp_context", [None, "fork"], ids=["forked-server", "fork"])
def test_a_collection_in_a_worker_does_not_copy_the_heap_it_inherited(
    tmp_path: Path, mp_context: str | None
) -> None:
    """A full collection writes to every object it tracks; in a forked worker each write copies
    a page shared with the parent. Workers leave what they inherited out of their collections
    (gc.freeze, in the worker and in the forked server), so a program's large heap (torch, a
    model) stays shared with them instead of becoming a private copy in each one at its first
    full collection. Counted as the worker's page faults since it started (a copy on write is
    one), so that a collection that came on its own before the batch asked for one counts too.
    Under ``fork`` the worker's own freeze is all there is."""
    # In a module of its own: a class of the main script travels to the workers by value, with
    # the globals it reads, which would give the worker a fresh copy of the heap, not its own.
    (tmp_path / "heap.py").write_text(
        textwrap.dedent(
            """
            import gc, os, resource

            HEAP = [[i] for i in range(1_600_000)]  # ~100 MB of lists the collector tracks
            MADE_IN = os.getpid()

            class CollectOnce:
                def __len__(self):
                    return 1
                def __getitem__(self, i):
                    gc.collect()
                    return [resource.getrusage(resource.RUSAGE_SELF).ru_minflt, MADE_IN]
            """
        )
    )
    proc = _run(
        f"""
        import os
        from aioloader import DataLoader
        from heap import CollectOnce

        loader = DataLoader(
            CollectOnce(),
            batch_size=None,
            num_workers=1,
            multiprocessing_context={mp_context!r},
            allow_fork={mp_context == "fork"},
        )
        (faults, made_in), = list(loader)
        print("faults", int(faults), "inherited", int(made_in) == os.getpid())
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    faults = int(words[words.index("faults") + 1])
    assert words[words.index("inherited") + 1] == "True", proc.stdout  # not a heap of its own
    # Unfrozen, the collection copies ~28,000 pages of the heap; frozen, a worker's whole life
    # so far is ~2,000 faults.
    assert faults < 12_000, f"the worker took {faults} page faults: it copied inherited pages"


def test_the_by_value_pickler_is_loaded_before_the_forks_only_for_a_main_dataset(
    tmp_path: Path,
) -> None:
    """A dataset of the script travels to the workers by value (cloudpickle): imported before
    the server and worker 0 fork, they have it instead of importing it to load their copy.
    A dataset from a module travels by reference: nothing more is imported for it."""
    proc = _run(
        """
        import sys
        from aioloader import DataLoader
        from datasets import Range

        class Squares:
            def __len__(self):
                return 8
            def __getitem__(self, i):
                return i * i

        module_loader = DataLoader(Range(8), batch_size=4, num_workers=1)
        print("module dataset:", "cloudpickle" in sys.modules)
        main_loader = DataLoader(Squares(), batch_size=4, num_workers=1)
        print("main dataset:", "cloudpickle" in sys.modules)
        print("batches", [b.tolist() for b in main_loader])
        module_loader.close()
        main_loader.close()
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "module dataset: False" in proc.stdout, proc.stdout
    assert "main dataset: True" in proc.stdout, proc.stdout
    assert "batches [[0, 1, 4, 9], [16, 25, 36, 49]]" in proc.stdout, proc.stdout
