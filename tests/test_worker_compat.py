"""Worker processes as torch users expect them (``_workers``: ``_info``, ``_payload``,
``_context``; the dataset copies of ``_resources``).

- torch's ``get_worker_info()`` works in a worker: datasets that shard themselves with it read
  each shard once; the loader shards only streams that never ask;
- seeds: worker ``k`` gets ``base + k``, which is ``torch.initial_seed()`` in its
  ``worker_init_fn``; ``worker_seeding='worker'`` seeds once, as torch;
- ``persistent_workers``: a fresh dataset copy each epoch (taken when the epoch starts, not when
  the loader is made), or one for good;
- a loader pickles into an unstarted loader;
- ``__main__``: scripts without a main guard, ``python -m`` and ``python -c`` with their classes
  defined inline, in fresh interpreters (subprocesses), each under the default start method and
  ``spawn``, exiting cleanly with nothing left in ``/dev/shm``.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import (
    IntraOpThreads,
    Probe,
    Range,
    Span,
    Stream,
    TorchSharded,
    keep,
    record_init,
    seed_numpy_from_info,
    split_span,
    two_intra_op_threads,
)
from helpers import as_lists, assert_raises_naming

from aioloader import DataLoader, _shm
from aioloader._workers import _context

SCRIPTS = Path(__file__).resolve().parent / "scripts"
SCRIPT_TIMEOUT_S = 50.0  # a fresh interpreter imports torch twice (itself, the forkserver)


def _samples(loader: DataLoader) -> list[Any]:
    """One epoch of a loader whose collate_fn is :func:`keep`: its samples, in order."""
    return [sample for batch in loader for sample in batch]


def _probe_loader(dataset: Any, **kwargs: Any) -> DataLoader:
    kwargs.setdefault("batch_size", 2)
    kwargs.setdefault("num_workers", 2)
    return DataLoader(dataset, collate_fn=keep, **kwargs)


# -- torch's get_worker_info -----------------------------------------------------------------


def test_torchs_get_worker_info_tells_what_ours_does_in_every_worker() -> None:
    assert torch.utils.data.get_worker_info() is None
    with _probe_loader(Probe(12), seed=3) as loader:
        samples = _samples(loader)
    assert {s["id"] for s in samples} == {0, 1}
    for s in samples:
        assert s["torch"] == (s["id"], 2, s["seed"], True)  # the worker's own copy, too
        assert s["ours_is_self"]
    assert torch.utils.data.get_worker_info() is None  # never set in the main process


@pytest.mark.parametrize("workers", [1, 2])
def test_a_stream_sharded_with_torchs_api_reads_each_shard_once(workers: int) -> None:
    # WebDataset and Hugging Face's IterableDataset shard this way; if torch's API said
    # nothing in a worker, every worker would read every shard.
    shards = [list(range(10 * k, 10 * k + 10)) for k in range(5)]
    with DataLoader(
        TorchSharded(shards), batch_size=4, num_workers=workers, collate_fn=keep
    ) as loader:
        for _ in range(2):
            items = _samples(loader)
            assert sorted(item for item, _ in items) == list(range(50))  # each once
            pids_of_shard = defaultdict(set)
            for item, pid in items:
                pids_of_shard[item // 10].add(pid)
            assert all(len(pids) == 1 for pids in pids_of_shard.values())  # one reader each
            assert len({pid for _, pid in items}) == workers  # and every worker read some


def test_a_stream_set_up_by_worker_init_fn_as_torch_documents_reads_each_item_once() -> None:
    with DataLoader(
        Span(3, 17), batch_size=2, num_workers=2, worker_init_fn=split_span, collate_fn=keep
    ) as loader:
        for _ in range(2):  # each epoch's fresh copy is split again, from the whole span
            assert sorted(_samples(loader)) == list(range(3, 17))


def test_a_stream_that_never_reads_which_worker_it_is_in_is_sharded_by_the_loader() -> None:
    # worker_init_fn reads only the seed: the stream does not shard itself.
    with DataLoader(
        Stream(20), batch_size=3, num_workers=2, worker_init_fn=seed_numpy_from_info
    ) as loader:
        assert sorted(i for batch in loader for i in batch.tolist()) == list(range(20))


# -- seeds -------------------------------------------------------------------------------------


def test_each_worker_is_seeded_base_plus_id_and_worker_init_fn_sees_it_in_torch() -> None:
    with _probe_loader(Probe(8), seed=11, worker_init_fn=record_init) as loader:
        epochs = [_samples(loader) for _ in range(2)]
    with _probe_loader(Probe(8), seed=11, worker_init_fn=record_init) as again:
        first_again = _samples(again)
    for samples in epochs:
        seed_of = {s["id"]: s["seed"] for s in samples}
        assert seed_of[1] == seed_of[0] + 1  # base + worker id, as torch
        for s in samples:
            # worker_init_fn (this epoch's, the last) saw torch.initial_seed() == info.seed.
            assert s["inits"][-1] == (s["id"], s["seed"], s["seed"])
            # worker_seeding='batch' (the default) reseeds before each batch.
            assert s["initial_seed"] != s["seed"]
    assert epochs[0][0]["seed"] != epochs[1][0]["seed"]  # a fresh base each epoch, as torch
    assert {s["seed"] for s in first_again} == {s["seed"] for s in epochs[0]}  # from the seed


def test_torch_runs_its_ops_on_one_thread_in_a_worker_as_in_torchs_workers() -> None:
    # Two workers with torch's default threads each (one per core) ran 4 threads on 2 cores.
    threads = torch.get_num_threads()
    if threads == 1:
        pytest.skip("torch runs on one thread here anyway: one could not be told from it")
    with _probe_loader(IntraOpThreads()) as loader:
        assert _samples(loader) == [1, 1, 1, 1]
    with _probe_loader(IntraOpThreads(), worker_init_fn=two_intra_op_threads) as loader:
        assert _samples(loader) == [2, 2, 2, 2]  # worker_init_fn has the last word, as in torch
        # Each dataset copy starts on one thread, as torch's fresh workers each epoch: what
        # the last worker_init_fn set does not outlive it.
        loader.worker_init_fn = None
        assert _samples(loader) == [1, 1, 1, 1]
    assert torch.get_num_threads() == threads  # the program's own are left alone


def _draws_by_worker(epochs: list[list[dict[str, Any]]]) -> dict[tuple[int, int], Any]:
    """Each worker's draws, keyed by (worker id, its read count): what a worker seeded once
    draws does not depend on which batches it happened to get."""
    return {(s["id"], s["reads"]): s["draws"] for samples in epochs for s in samples}


def test_worker_seeding_worker_seeds_each_worker_once_as_torch() -> None:
    def run(seed: int) -> list[list[dict[str, Any]]]:
        with _probe_loader(
            Probe(8), seed=seed, worker_seeding="worker", persistent_workers=True
        ) as loader:
            return [_samples(loader) for _ in range(2)]

    one, same, other = run(5), run(5), run(6)
    for s in one[0] + one[1]:
        assert s["initial_seed"] == s["seed"]  # never reseeded per batch
    draws = _draws_by_worker(one)
    assert len(set(draws.values())) == len(draws)  # one stream per worker, going on
    assert _draws_by_worker(same) == draws  # a function of the seed
    assert set(_draws_by_worker(other).values()).isdisjoint(draws.values())


def test_worker_seeding_and_persistent_workers_are_checked() -> None:
    assert_raises_naming(
        lambda: DataLoader(Range(4), worker_seeding="torch"),
        ValueError,
        ["worker_seeding", "'torch'"],
    )
    assert_raises_naming(
        lambda: DataLoader(Range(4), worker_seeding=1),  # type: ignore[arg-type]
        TypeError,
        ["worker_seeding", "1"],
    )
    assert_raises_naming(
        lambda: DataLoader(Range(4), persistent_workers="yes"),  # type: ignore[arg-type]
        TypeError,
        ["persistent_workers", "'yes'"],
    )


# -- the dataset copy: per epoch, or for good ----------------------------------------------------


def test_the_dataset_is_taken_when_iterated_not_when_the_loader_is_made() -> None:
    dataset = Probe(8)
    loader = _probe_loader(dataset)
    dataset.x = 5
    try:
        assert {s["x"] for s in _samples(loader)} == {5}
    finally:
        loader.close()
    assert dataset.pickled == 1  # once for both workers, and not at construction


def test_without_persistent_workers_each_epoch_gets_a_fresh_copy_in_the_same_processes() -> None:
    dataset = Probe(8, x=1)
    with _probe_loader(dataset, worker_init_fn=record_init) as loader:
        first = _samples(loader)
        pids = loader.worker_pids
        dataset.x = 2
        second = _samples(loader)
        assert loader.worker_pids == pids  # the processes stay warm; only the copy is new
    assert {s["x"] for s in first} == {1}
    assert {s["x"] for s in second} == {2}  # the change reached the workers
    for k in (0, 1):  # each copy counts its reads from scratch
        assert sorted(s["reads"] for s in second if s["id"] == k)[0] == 1
    assert {len(s["inits"]) for s in second} == {2}  # worker_init_fn ran again, same process
    assert dataset.pickled == 2


def test_persistent_workers_keep_one_copy_for_good() -> None:
    dataset = Probe(8, x=1)
    with _probe_loader(dataset, worker_init_fn=record_init, persistent_workers=True) as loader:
        first = _samples(loader)
        dataset.x = 2
        second = _samples(loader)
    assert {s["x"] for s in first + second} == {1}
    for k in (0, 1):  # one copy: its read count goes on across epochs
        reads = sorted(s["reads"] for s in first + second if s["id"] == k)
        assert reads == list(range(1, len(reads) + 1))
    assert {len(s["inits"]) for s in first + second} == {1}
    assert dataset.pickled == 1


def test_two_iterators_at_once_share_the_copy_and_each_run_a_whole_epoch() -> None:
    with DataLoader(Range(7), batch_size=2, num_workers=2) as loader:
        pairs = list(zip(loader, loader, strict=True))
    assert [a.tolist() for a, _ in pairs] == [b.tolist() for _, b in pairs]
    assert sorted(i for a, _ in pairs for i in a.tolist()) == list(range(7))


# -- pickling a loader -------------------------------------------------------------------------


def test_a_loader_pickles_into_an_unstarted_loader_that_works() -> None:
    loader = DataLoader(Range(10), batch_size=3, num_workers=2, shuffle=True, seed=4)
    copy = pickle.loads(pickle.dumps(loader))
    assert copy.worker_pids == ()
    assert not copy.closed
    with loader, copy:
        assert as_lists(list(copy)) == as_lists(list(loader))


def test_pickling_a_running_loader_leaves_its_workers_and_the_copy_resumes_there() -> None:
    with DataLoader(Range(10), batch_size=2, num_workers=2, shuffle=True, seed=4) as loader:
        it = iter(loader)
        head = [next(it), next(it)]
        copy = pickle.loads(pickle.dumps(loader))  # the live iterator and workers stay here
        rest = list(it)
        pids = set(loader.worker_pids)
    assert copy.worker_pids == ()
    with copy:
        assert as_lists(list(copy)) == as_lists(rest)  # the rest of that epoch
        assert pids.isdisjoint(copy.worker_pids)
    assert sorted(i for b in as_lists(head + rest) for i in b) == list(range(10))


# -- __main__: scripts and python -c in fresh interpreters --------------------------------------


def test_workers_of_the_start_methods_named_or_stock_contexts_skip_main() -> None:
    # This Python's Popen classes read the preparation data where _context expects them to.
    assert _context.WORKERS_SKIP_MAIN
    for method, ours in (
        ("forkserver", _context.ForkServerContext),
        ("spawn", _context.SpawnContext),
    ):
        assert type(_context.resolve_context(method, allow_fork=False)) is ours
        stock = multiprocessing.get_context(method)
        assert type(_context.resolve_context(stock, allow_fork=False)) is ours

    class Custom(type(multiprocessing.get_context("spawn"))):  # type: ignore[misc]
        pass

    custom = Custom()
    assert _context.resolve_context(custom, allow_fork=False) is custom  # the caller's design


_INLINE = """
import aioloader

class Doubled:  # defined in python -c: workers have no file to import it from
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return 2 * i + SHIFT

SHIFT = 1000

def init(worker_id):
    global SHIFT
    SHIFT = 0  # runs in the worker: its copy of the global only

loader = aioloader.DataLoader(
    Doubled(),
    batch_size=2,
    num_workers=2,
    collate_fn=lambda b: sorted(b),
    worker_init_fn=init,
    mp_context=METHOD,
)
print("batches", [batch for batch in loader], flush=True)
"""


@dataclass(frozen=True)
class _Ran:
    pid: int
    returncode: int
    stdout: str
    stderr: str


_LAZY_TORCH = """
import sys
import aioloader

class Global:  # uses the global name torch, which this program imports only below
    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return info.id, torch.initial_seed() == info.seed

class Local:  # imports torch itself, at its first sample
    def __len__(self):
        return 8

    def __getitem__(self, i):
        import torch.utils.data
        return torch.utils.data.get_worker_info().id

settings = dict(batch_size=2, num_workers=2, collate_fn=lambda b: b)
first = aioloader.DataLoader(Global(), worker_seeding="worker", **settings)
second = aioloader.DataLoader(Local(), **settings)
print("torch", "torch" in sys.modules)  # not yet: the workers' server has none either
import torch.utils.data
print("global", sorted({sample for batch in first for sample in batch}))
print("local", sorted({sample for batch in second for sample in batch}))
"""


_LAZY_THREADS = """
import sys
import aioloader

class Threads:  # imports torch itself, at its first sample, as _LAZY_TORCH's Local
    def __len__(self):
        return 4

    def __getitem__(self, i):
        imported = "torch" in sys.modules
        import torch
        return imported, torch.get_num_threads()

loader = aioloader.DataLoader(Threads(), batch_size=2, num_workers=2, collate_fn=lambda b: b)
print("threads", sorted({sample for batch in loader for sample in batch}))
"""


_LAZY_GENERATORS = """
import sys
import aioloader

class Plain:  # uses neither numpy.random nor torch: no worker imports them to seed them
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return "numpy.random" in sys.modules, "torch" in sys.modules

class Draws:  # imports each generator at its first sample, and draws from it at once
    def __len__(self):
        return 8

    def __getitem__(self, i):
        import numpy.random
        import torch
        return int(numpy.random.randint(1 << 30)), int(torch.randint(1 << 30, ()))

def draws(workers):
    loader = aioloader.DataLoader(
        Draws(), batch_size=2, num_workers=workers, seed=7, collate_fn=lambda b: b
    )
    return [sample for batch in loader for sample in batch]

plain = aioloader.DataLoader(Plain(), batch_size=2, num_workers=2, collate_fn=lambda b: b)
print("plain", sorted({sample for batch in plain for sample in batch}))
two = draws(2)
print("same", two == draws(2) == draws(1), len(set(two)))
print("main", "numpy.random" in sys.modules, "torch" in sys.modules)
"""


def _run_python(args: list[str], cwd: Path) -> _Ran:
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=os.environ.copy(),  # PYTHONPATH: the workers import this tree's aioloader
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
    finally:
        if proc.returncode is None:  # it hung: a failure, but leave nothing running
            proc.kill()
            proc.communicate()
    return _Ran(proc.pid, proc.returncode, stdout, stderr)


def _assert_clean_exit(ran: _Ran) -> None:
    assert ran.returncode == 0, ran.stderr
    assert "Traceback" not in ran.stderr, ran.stderr
    assert "leaked" not in ran.stderr, ran.stderr  # the resource tracker found nothing
    # The script's segments carry its pid: none is left behind.
    prefix = f"{_shm.SHM_PREFIX}{ran.pid}_"
    assert [name for name in os.listdir(_shm.SHM_DIR) if name.startswith(prefix)] == []


def _script_run(method: str | None, how: str) -> _Ran:
    extra = [method] if method else []
    if how == "path":
        return _run_python([str(SCRIPTS / "unguarded_main.py"), *extra], SCRIPTS)
    return _run_python(["-m", "unguarded_main", *extra], SCRIPTS)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["path", "module"])
@pytest.mark.parametrize("method", [None, "spawn"])
def test_a_script_without_a_main_guard_runs_its_top_level_once(
    method: str | None, how: str
) -> None:
    proc = _script_run(method, how)
    _assert_clean_exit(proc)
    lines = proc.stdout.splitlines()
    assert len([line for line in lines if line.startswith("top level ran")]) == 1, lines
    squares = [[100, 101, 104, 109], [116, 125, 136, 149], [164, 181, 200, 221]]
    assert lines[1:] == [f"epoch 0: {squares}", f"epoch 1: {squares}", "done"]


@pytest.mark.slow
@pytest.mark.parametrize("method", [None, "spawn"])
def test_a_guarded_script_still_works(method: str | None) -> None:
    proc = _run_python([str(SCRIPTS / "guarded_main.py"), *([method] if method else [])], SCRIPTS)
    _assert_clean_exit(proc)
    lines = proc.stdout.splitlines()
    cubes = [[0, 1, 8, 27], [64, 125, 216, 343], [512, 729, 1000, 1331]]
    assert lines[1:] == [f"epoch 0: {cubes}", f"epoch 1: {cubes}", "done"], lines


@pytest.mark.slow
@pytest.mark.parametrize("method", [None, "spawn"])
def test_a_class_and_a_lambda_defined_in_python_c_reach_the_workers(
    method: str | None, tmp_path: Path
) -> None:
    proc = _run_python(["-c", f"METHOD = {method!r}\n{_INLINE}"], tmp_path)
    _assert_clean_exit(proc)
    # Each worker's init set its own SHIFT to 0: the function went by value, with its globals.
    assert proc.stdout.splitlines() == ["batches [[0, 2], [4, 6], [8, 10]]"], proc.stdout


@pytest.mark.slow
def test_torch_imported_by_the_worker_after_it_started_still_tells_the_worker_info(
    tmp_path: Path,
) -> None:
    # aioloader does not import torch: a worker may get it only when the dataset copy arrives
    # (its class refers to torch), or at a sample. torch's get_worker_info() and the seed
    # follow it there.
    ran = _run_python(["-c", _LAZY_TORCH], tmp_path)
    _assert_clean_exit(ran)
    assert ran.stdout.splitlines() == [
        "torch False",
        "global [(0, True), (1, True)]",
        "local [0, 1]",
    ], ran.stdout
    ran = _run_python(["-c", _LAZY_THREADS], tmp_path)  # and one intra-op thread from then
    _assert_clean_exit(ran)
    # Each worker's first sample imported torch; both samples ran on one thread.
    assert ran.stdout.splitlines() == ["threads [(False, 1), (True, 1)]"], ran.stdout


@pytest.mark.slow
def test_generators_a_worker_imports_mid_batch_are_seeded_from_that_batch(
    tmp_path: Path,
) -> None:
    # A worker seeds numpy.random and torch only once something imports them: a dataset that
    # never uses them does not pay for their import (torch: a second), and one that imports
    # them inside a sample draws as if they had been seeded before its batch began, so the
    # draws depend on the seed and the batch alone, not on the worker count.
    ran = _run_python(["-c", _LAZY_GENERATORS], tmp_path)
    _assert_clean_exit(ran)
    assert ran.stdout.splitlines() == [
        "plain [(False, False)]",
        "same True 8",
        "main False False",
    ], ran.stdout


_FOUND_BEFORE_IMPORTED = """
import importlib.util
import sys

import numpy
from aioloader._workers import _info

_info.seed_on_import()  # as a worker does at start
_info.seed_worker(1234, every_device=False)
assert "numpy.random" not in sys.modules
importlib.util.find_spec("numpy.random")  # a library asking whether it is there
import numpy.random

first = numpy.random.randint(1 << 30)
numpy.random.seed(_info._numpy_seed)
print("seeded", first == numpy.random.randint(1 << 30))
"""


def test_a_generator_looked_up_before_its_import_is_still_seeded_as_it_arrives(
    tmp_path: Path,
) -> None:
    # Libraries look torch up (importlib.util.find_spec) before anything imports it: the hook
    # must still seed it when the import comes.
    ran = _run_python(["-c", _FOUND_BEFORE_IMPORTED], tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["seeded True"], ran.stdout


_FAILING_SCRIPT = """
import aioloader

def parse(x):
    return int("not a number" if x == 5 else x)  # the failing line

class Parsed:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return parse(i)

try:
    for batch in aioloader.DataLoader(Parsed(), batch_size=2, num_workers=2):
        pass
except ValueError:
    import traceback
    traceback.print_exc()
"""


@pytest.mark.parametrize("method", [None, "spawn"])
def test_a_workers_traceback_names_the_scripts_file_and_line(
    method: str | None, tmp_path: Path
) -> None:
    # __main__'s functions reach the workers by value; the traceback printed from a worker's
    # error must still point at the user's file and show the failing line, as torch's does.
    script = tmp_path / "train.py"
    script.write_text(
        _FAILING_SCRIPT.replace(
            "num_workers=2", f"num_workers=2, multiprocessing_context={method!r}"
        )
    )
    ran = _run_python([str(script)], tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert f'File "{script}", line 5, in parse' in ran.stderr, ran.stderr
    assert 'return int("not a number" if x == 5 else x)  # the failing line' in ran.stderr
    assert "<dynamic-code>" not in ran.stderr
