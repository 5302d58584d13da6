"""A real Ray cluster on loopback for the Ray tests: a head and a second node, each with its own
object store, started once per test session (``ray start``) and stopped at its end.

Batches of an actor on the second node really cross between two object stores on their way to
the test process (the driver, on the head). The second node alone offers the custom resource
``preprocess``: actors that ask for it are placed there, as on a CPU-only preprocessing node.
A test that loses a node starts one more of its own (:func:`extra_node`) and kills it.

The nodes run with ``PYTHONPATH`` naming this checkout, the tests and the examples, so actors
import the aioloader under test, the tests' own dataset classes and the example's actor.
Start-up is bounded (:data:`START_TIMEOUT_S` per node), nothing of the dashboard runs, and
every process of the cluster is ended at the end, even when start-up failed half-way. Each
node is a ``ray start --block`` in a session of its own (:func:`_spawn`): its end kills the
processes of those sessions, found by session id, and nothing else. (``ray stop`` is never
used: it finds Ray's processes by name, and would end every Ray cluster on the machine,
other users' and other test runs' included.) Under pytest-xdist the test processes share the
one cluster (see :func:`ray_cluster`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
EXAMPLES = ROOT / "examples"
#: Seconds one ``ray start`` may take (about 8 s each on 2 shared cores).
START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60
#: CPUs each node offers: small, so that the cluster fits beside the rest of the suite.
NODE_CPUS = 2
#: A custom resource the head offers (and a node started by :func:`extra_node`), the second
#: node not: actors that ask for it run on the head once the extra node is lost.
HEAD_RESOURCE = "loaders"
#: CPUs the extra node offers: more than any other node, so an actor that asks for
#: ``EXTRA_NODE_CPUS - 1`` of them fits there alone.
EXTRA_NODE_CPUS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _warm_up() -> None:
    """Start the driver's lazily made threads now (an actor, a put, a reference awaited on a
    loop), before any test records its baseline of threads."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # On this driver's own node: a test in another test process may have joined a node of
    # its own and be killing it (the lost-node test), and an actor placed there died with it,
    # failing this whole process's session (seen under load).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)

    @ray.remote(num_cpus=0, scheduling_strategy=here)  # type: ignore[call-overload]
    class Echo:
        async def echo(self, x: int) -> int:
            return x

    echo = Echo.remote()  # type: ignore[attr-defined]

    async def awaited() -> int:
        return int(await echo.echo.remote(1))

    assert asyncio.run(awaited()) == 1
    assert ray.get(ray.put(2)) == 2
    # A reference's callbacks run on a thread of Ray's own, which Python then lists (as a
    # "Dummy" thread): let it run one now, for a result and for an actor's death.
    seen = threading.Event()
    echo.echo.remote(3).future().add_done_callback(lambda _: seen.set())
    assert seen.wait(START_TIMEOUT_S)
    doomed = Echo.remote()  # type: ignore[attr-defined]
    assert ray.get(doomed.echo.remote(4)) == 4
    died = threading.Event()
    ray.kill(doomed)
    doomed.echo.remote(5).future().add_done_callback(lambda _: died.set())
    assert died.wait(START_TIMEOUT_S)
    ray.kill(echo)


def _spawn(args: list[str], env: dict[str, str], log: Path) -> int:
    """Run ``ray start --block`` with ``args`` in a session of its own, not a child of this
    process (the tests' leak checks list this process's descendants); returns the session id,
    by which :func:`_kill_session` finds every process of that node (its raylet, its object
    store, its actors' workers) and nothing else. Returns once Ray says the node runs (what
    ``ray start`` without ``--block`` waits for too), within :data:`START_TIMEOUT_S`."""
    shell = subprocess.run(
        ["sh", "-c", '"$@" >"$0" 2>&1 </dev/null & echo $$', str(log), _ray_cli(), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        check=True,
        start_new_session=True,  # the shell leads a new session; the node stays in it
    )
    session = int(shell.stdout.strip())
    deadline = time.monotonic() + START_TIMEOUT_S
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if not _session_processes(session) or time.monotonic() > deadline:
            _kill_session(session)
            raise RuntimeError(f"ray {' '.join(args)} did not start:\n{log.read_text()}")
        time.sleep(0.2)
    return session


def _session_processes(session: int) -> list[Any]:
    import psutil

    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(process.pid) == session:
                found.append(process)
    return found


def _kill_session(session: int) -> None:
    """SIGKILL every process of ``session`` (as ``ray stop --force`` did, but only these), a
    few rounds (a raylet may start a worker between the listing and its kill), and wait
    until none is left, within :data:`STOP_TIMEOUT_S`."""
    import psutil

    deadline = time.monotonic() + STOP_TIMEOUT_S
    while processes := _session_processes(session):
        if time.monotonic() > deadline:
            raise RuntimeError(f"Ray processes of the test cluster outlived SIGKILL: {processes}")
        for process in processes:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(processes, timeout=max(0.1, deadline - time.monotonic()))


def _start(env: dict[str, str]) -> tuple[str, str, list[int]]:
    """Start the head and the second node; returns the address, the head's temp dir and the
    nodes' session ids."""
    port = _free_port()
    address = f"127.0.0.1:{port}"
    # Short: Ray's socket paths live under it, and a Unix socket path has 107 bytes at most.
    temp = tempfile.mkdtemp(prefix="aiol-ray-", dir="/tmp")
    common = [
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={NODE_CPUS}",
        "--disable-usage-stats",
        "--block",
    ]
    sessions: list[int] = []
    try:
        head = [
            "start",
            "--head",
            f"--port={port}",
            "--include-dashboard=false",
            f"--temp-dir={temp}",
            f'--resources={{"{HEAD_RESOURCE}": 100}}',
            *common,
        ]
        sessions.append(_spawn(head, env, Path(temp) / "head.log"))
        node = ["start", f"--address={address}", '--resources={"preprocess": 2}', *common]
        sessions.append(_spawn(node, env, Path(temp) / "node.log"))
    except BaseException:
        _stop(temp, sessions)
        raise
    return address, temp, sessions


def _stop(temp: str, sessions: list[int]) -> None:
    """End the cluster's nodes (the second first, then the head), by their session ids only."""
    for session in reversed(sessions):
        _kill_session(session)
    shutil.rmtree(temp, ignore_errors=True)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(TESTS), str(EXAMPLES), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # A local ray.init() elsewhere on this machine (the benchmark's) leaves a token in
    # ~/.ray/auth_token; this cluster's nodes and driver run without token authentication.
    env["RAY_AUTH_MODE"] = "disabled"
    # A lost node is noticed within about a second and a half (Ray's default: 15 s and
    # more), so that a test that loses one sees its resources gone as soon as its actors'
    # deaths. A node that is alive answers each check at once; it would have to stall for
    # three checks in a row, each with Ray's 10 s timeout, to be taken for lost.
    env["RAY_health_check_period_ms"] = "500"
    env["RAY_health_check_failure_threshold"] = "3"
    return env


def _alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def extra_node(address: str) -> Iterator[tuple[str, Callable[[], None]]]:
    """One more node joined to the cluster at ``address`` for one test, to be lost: its node id
    and a ``lose()`` that kills every process of it (the ``ray start --block`` process, its
    raylet, its actors) with SIGKILL, as a machine that goes away. Start-up is bounded
    (:data:`START_TIMEOUT_S`); whatever of it is left is killed at the end, by pid: never
    ``ray stop``, which would stop the shared cluster."""
    import psutil

    before = _alive_nodes()
    node = subprocess.Popen(
        [
            _ray_cli(),
            "start",
            f"--address={address}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={EXTRA_NODE_CPUS}",
            f'--resources={{"{HEAD_RESOURCE}": 100}}',
            "--disable-usage-stats",
            "--block",
        ],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    tree: dict[int, psutil.Process] = {}

    def lose() -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree.update({p.pid: p for p in psutil.Process(node.pid).children(recursive=True)})
        node.kill()
        for process in tree.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        node.wait(STOP_TIMEOUT_S)
        psutil.wait_procs(list(tree.values()), timeout=STOP_TIMEOUT_S)

    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            new = sorted(_alive_nodes() - before)
            if new:
                break
            if node.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the extra Ray node did not start (exit {node.poll()})")
            time.sleep(0.2)
        yield new[0], lose
    finally:
        lose()


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The address of the session's two-node cluster, this process joined to it.

    Under pytest-xdist the test processes share one cluster: the first to need it starts it,
    each one that uses it counts itself in (a file under the run's common temp dir, under a
    lock), and the last one to leave stops it.
    """
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'aioloader[ray]')")
    from filelock import FileLock

    env = _env()
    # The run's own directory: under xdist the parent of each process's basetemp (the same
    # for every process of the run), else the basetemp itself. (Its parent is then the
    # user's pytest directory, shared by every run: a count left behind by a run killed in
    # its teardown sent each later run to join a cluster long stopped.)
    basetemp = tmp_path_factory.getbasetemp()
    shared = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    state_file = shared / "ray-cluster.json"
    with FileLock(str(shared / "ray-cluster.lock")):
        state = json.loads(state_file.read_text()) if state_file.exists() else {"users": 0}
        if state["users"] == 0:
            state["address"], state["temp"], state["sessions"] = _start(env)
        state["users"] += 1
        state_file.write_text(json.dumps(state))
    auth_mode = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # this driver's, until the end of the session
    try:
        ray.init(address=state["address"], logging_level=logging.WARNING, log_to_driver=False)
        _warm_up()
        # Ray's modules and this driver's state live as long as the session: out of the
        # collector's reach, as what collection imported is (conftest's
        # pytest_collection_finish), or each later leak check's gc.collect() walked them
        # (60,000 objects: ~12 ms more a collection, for every test after this one).
        gc.collect()
        gc.freeze()
        yield str(state["address"])
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        if auth_mode is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = auth_mode
        with FileLock(str(shared / "ray-cluster.lock")):
            state = json.loads(state_file.read_text())
            state["users"] -= 1
            if state["users"] == 0:
                _stop(state["temp"], state["sessions"])
            state_file.write_text(json.dumps(state))
