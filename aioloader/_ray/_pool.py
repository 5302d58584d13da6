"""RayWorkers: Ray actors as a loader's workers, given where a :class:`~aioloader.WorkerPool`
is given (``DataLoader(..., workers=RayWorkers(...))``).

::

    RayWorkers ── connection to a Ray cluster (the one already joined, ``address=``, or a
      │           local one it starts and stops)
      ├── Fleet (_fleet): num_actors actors, each with num_cpus / num_gpus / resources
      ├── one private event loop for every loader's `for` (LoopThread)
      ├── one SlotPool (shm_max_bytes): the batches of actors on this machine come back in
      │   this process's shared memory, as local workers' do (see _wire); others' through Ray
      ├─ loader A ── RayRunner(copy_id=1): its own copy, seeds, prefetch, deadlines
      └─ loader B ── RayRunner(copy_id=2): likewise

It is a :class:`~aioloader.WorkerPool` to the loader: the loader attaches to it as to a pool
of worker processes (``attach``, ``loop``, ``closed``), gets a runner over it, and does all the
rest (order, deadlines, retries, skips, resume, statistics) above the runner as for local
workers. Nothing else of the process pool's (processes, a forkserver) is made.

Sharp edges:
- Every kind of dataset: map-style ones (an async one is fetched inside the actors), an
  iterable one (each actor reads its share of the stream, as a worker process does; a dead
  actor's reader ends for the epoch, and ``state_dict()`` resumes it exactly), and an async
  iterable one (read on the training process's loop, its samples sent to the actors to
  decode and collate).
- The pool decides ``num_workers`` (its ``num_actors``), and ``multiprocessing_context``,
  ``shm_max_bytes`` and ``start_timeout`` of its loaders: leave them out (``shm_max_bytes``
  is the pool's own argument, as a shared :class:`~aioloader.WorkerPool`'s).
- Closing the pool kills its actors; closing a loader only makes them forget its copy. A
  Ray connection the pool opened itself (no cluster joined before) is shut down with it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import os
import socket
import sys
import threading
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _shm
from .. import _validate as check
from .._batch import BatchMaker
from .._config import LoaderConfig
from .._errors import unpicklable_error
from .._loader import WorkerPool, WorkerPoolStatistics
from .._log import workers_log
from .._threads import LoopThread
from .._types import Runner
from .._workers import DEFAULT_START_TIMEOUT_S, dumps_payload
from ._actor import ActorCopy
from ._fleet import Fleet
from ._runner import RayRunner

if TYPE_CHECKING:
    from .._device import DeviceStage

__all__ = ["ActorStatistics", "RayWorkers", "RayWorkersStatistics"]


@dataclass(frozen=True, slots=True)
class ActorStatistics:
    """What one actor slot did (every incarnation of its actor together).

    Attributes:
        id: the worker id (:func:`aioloader.get_worker_info` ``.id`` in the actor).
        pid: the current actor's pid (None before it started).
        node_id: the Ray node it runs on.
        host: that node's host name.
        batches: batches it made.
        busy_s: seconds it spent reading, fetching and collating them.
        in_flight: batches it holds now (running or queued).
        restarts: times its actor was replaced (a death, or a kill at a deadline).
    """

    id: int
    pid: int | None
    node_id: str | None
    host: str | None
    batches: int
    busy_s: float
    in_flight: int
    restarts: int


@dataclass(frozen=True, slots=True)
class RayWorkersStatistics(WorkerPoolStatistics):
    """A :class:`~aioloader.WorkerPoolStatistics` of actors (no shared memory: Ray's object
    store carries the batches), with each actor's figures in ``actors``."""

    actors: tuple[ActorStatistics, ...] = ()


class RayWorkers(WorkerPool):
    """Ray actors that make a loader's batches, on this machine or across a Ray cluster.

    Give it as ``DataLoader(dataset, ..., workers=RayWorkers(num_actors=8))``: every loader
    guarantee of local workers holds (order, ``timeout`` with the hung actor killed and
    replaced, ``max_retries`` after an actor's death, ``on_error='skip'``, exact
    ``state_dict()`` including resuming into local workers, ``get_worker_info()`` and
    ``worker_init_fn`` inside the actors, per-batch seeding). Several loaders may share it.
    Use it as a context manager (or call :meth:`close`).

    Args:
        num_actors: actors (workers) to run (at least 1).
        num_cpus: CPUs Ray reserves for each actor (default 1; 0 is allowed).
        num_gpus: GPUs Ray reserves for each actor (default 0).
        resources: custom Ray resources per actor, ``{"preprocess": 1}``: actors go only to
            nodes that offer them (a CPU-only preprocessing node group, say).
        address: the Ray cluster to join when this process has not joined one
            (``ray.init(address=...)``): ``"auto"``, ``"ray://host:10001"``,
            ``"host:6379"``; None: the cluster ``RAY_ADDRESS`` names, else a local one,
            started here and stopped at :meth:`close`.
        start_timeout: seconds an actor may take to be placed and started (and to load each
            dataset copy); past it :class:`~aioloader.WorkerInitError` names what it asked
            for and what the cluster has free. None: 120 s.
        runtime_env: Ray's ``runtime_env`` for the actors (the packages and files they need
            where nodes differ from this one), or None.
        scheduling_strategy: Ray's ``scheduling_strategy`` for the actors: ``"SPREAD"`` (one
            per node, as far as they go), a ``NodeAffinitySchedulingStrategy`` (with
            ``soft=True`` a replacement goes elsewhere once that node is lost), a placement
            group's; None: Ray's default.
        shm_max_bytes: the shared-memory budget (bytes, all loaders together) for the
            batches of actors on this machine, which come back through this process's shared
            memory as local workers' do, not through Ray's object store; None: a share of
            ``/dev/shm`` (as a :class:`~aioloader.WorkerPool`'s); 0: every batch through the
            object store.

    Raises:
        TypeError: an argument of the wrong type (named).
        ValueError: a bad value (named).
    """

    def __init__(
        self,
        num_actors: int,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        resources: Mapping[str, float] | None = None,
        address: str | None = None,
        start_timeout: float | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        scheduling_strategy: Any = None,
        shm_max_bytes: int | None = None,
    ) -> None:
        self.num_workers = self.num_actors = check.positive_int("num_actors", num_actors)
        self.num_cpus = check.finite_number("num_cpus", num_cpus, minimum=0)
        self.num_gpus = check.finite_number("num_gpus", num_gpus, minimum=0)
        self.resources = _resources(resources)
        if address is not None and not isinstance(address, str):
            raise TypeError(f"address must be a str or None, got {address!r}")
        self.address = address
        if runtime_env is not None and not isinstance(runtime_env, Mapping):
            raise TypeError(f"runtime_env must be a mapping or None, got {runtime_env!r}")
        self.runtime_env = None if runtime_env is None else dict(runtime_env)
        self.start_timeout = check.seconds("start_timeout", start_timeout, positive=True)
        # What a WorkerPool's loaders read of it: no processes are started from a context; a
        # loader may only leave these out (or give the same).
        self.allow_fork = False
        if shm_max_bytes is not None:
            shm_max_bytes = check.non_negative_int("shm_max_bytes", shm_max_bytes)
        self.shm_max_bytes = shm_max_bytes
        self._context = multiprocessing.get_context("spawn")
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        if self.runtime_env is not None:
            options["runtime_env"] = self.runtime_env
        if isinstance(scheduling_strategy, str) and scheduling_strategy not in _STRATEGIES:
            raise ValueError(
                f"scheduling_strategy must be one of {sorted(_STRATEGIES)}, a Ray scheduling "
                f"strategy object, or None, got {scheduling_strategy!r}"
            )
        self.scheduling_strategy = scheduling_strategy
        if scheduling_strategy is not None:
            options["scheduling_strategy"] = scheduling_strategy
        timeout = DEFAULT_START_TIMEOUT_S if self.start_timeout is None else self.start_timeout
        self._state = _State(Fleet(self.num_actors, options, timeout), self.shm_max_bytes)
        self._ids = itertools.count(1)
        self._closer = weakref.finalize(self, _finalize, self._state)

    # -- the pool's surface --------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the pool was closed (its actors killed), or the program is ending."""
        return self._state.closed

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """Pids of the actors started so far (on their nodes; empty once closed)."""
        return () if self._state.closed else self._state.fleet.pids()

    def start(self) -> None:
        """Join the cluster, make every actor and wait until each runs (blocking).

        Raises:
            RuntimeError: closed.
            ImportError: Ray is not installed.
            ConnectionError: the cluster at ``address`` could not be joined.
            WorkerInitError: an actor was not placed and started within ``start_timeout``.
        """
        self._check_open()
        self._connect()
        self._state.fleet.wait_ready()

    def __enter__(self) -> RayWorkers:
        super().__enter__()
        return self

    async def __aenter__(self) -> RayWorkers:
        await super().__aenter__()
        return self

    def close(self) -> None:
        """Kill the actors, stop the loop thread, and leave a Ray runtime this pool started.
        Loaders that use the pool raise at their next epoch. Idempotent."""
        self._state.close()
        self._closer.detach()

    def statistics(self) -> RayWorkersStatistics:
        """A snapshot: actors, attached loaders, restarts, and each actor's figures."""
        fleet = self._state.fleet
        with fleet.lock:
            records = list(fleet.records)
        slots = self._state.slots
        shm = slots.stats() if slots is not None else None
        actors = tuple(
            ActorStatistics(
                id=slot,
                pid=None if record is None else record.pid,
                node_id=None if record is None else record.node,
                host=None if record is None else record.host,
                batches=figures.batches,
                busy_s=figures.busy_s,
                in_flight=0 if record is None else len(record.jobs),
                restarts=figures.restarts,
            )
            for slot, (record, figures) in enumerate(zip(records, fleet.figures, strict=True))
        )
        return RayWorkersStatistics(
            num_workers=self.num_actors,
            worker_pids=self.worker_pids,
            loaders=len(self._state.attached),
            worker_restarts=fleet.restarts,
            live_shm_slots=shm.slots if shm is not None else 0,
            leased_shm_slots=shm.leased if shm is not None else 0,
            held_shm_slots=shm.held if shm is not None else 0,
            shm_bytes=shm.bytes_total if shm is not None else 0,
            shm_max_bytes=shm.max_bytes if shm is not None else 0,
            actors=actors,
        )

    def __repr__(self) -> str:
        state = " closed" if self._state.closed else ""
        extra = f" resources={self.resources}" if self.resources else ""
        return (
            f"<RayWorkers num_actors={self.num_actors} num_cpus={self.num_cpus:g}{extra} "
            f"loaders={len(self._state.attached)}{state}>"
        )

    # -- what loaders use (through ``aioloader._loader``) ------------------------------------

    def _check_open(self) -> None:
        if self._state.closed:
            raise RuntimeError(
                f"the RayWorkers this loader uses (workers={self!r}) are closed: their actors "
                "are gone. Make new RayWorkers and new loaders, or close the workers last"
            )

    def attach(
        self, config: LoaderConfig, current: Runner | None, device: DeviceStage | None = None
    ) -> Runner:
        """The runner of a loader with ``config`` (``current`` if it has one).

        Raises:
            RuntimeError: closed.
        """
        with self._state.lock:
            self._check_open()
            if current is not None:
                return current
            self._connect()
            self._state.fleet.start_all()
            copy_id = next(self._ids)
            self._state.attached.add(copy_id)
            return RayRunner(
                self._state.fleet,
                copy_id,
                lambda: self._state.detach(copy_id),
                slots=self._state.slot_pool(),
                prefetch=config.prefetch,
            )

    def loop(self) -> LoopThread:
        """The private event loop every ``for`` over the pool's loaders runs on."""
        state = self._state
        with state.lock:
            self._check_open()
            if state.loop_thread is None:
                state.loop_thread = LoopThread()
            return state.loop_thread

    def payload(self, maker: BatchMaker, config: LoaderConfig, dataset: Any) -> bytes:
        """The dataset copy the actors load (called off the loop, once per copy): the batch
        maker, ``worker_init_fn``, and for an async dataset the dataset itself (its items are
        fetched in the actors). ``__main__``'s classes travel by value.

        Raises:
            TypeError: something cannot be pickled (named).
        """
        copy = ActorCopy(
            maker,
            config.worker_init_fn,
            dataset if config.kind == "async_map" else None,
            config.io_concurrency,
            config.worker_seeding == "batch",
            ("torch",) if "torch" in sys.modules else (),
            config.kind == "iterable",
        )
        try:
            return dumps_payload(copy, main_by_value=True)
        except Exception as exc:
            for name, part in (
                ("dataset", dataset),
                ("collate_fn", config.collate_fn),
                ("transform", config.transform),
                ("worker_init_fn", config.worker_init_fn),
            ):
                try:
                    dumps_payload(part, main_by_value=True)
                except Exception as part_exc:
                    raise unpicklable_error(name, part, part_exc) from part_exc
            raise unpicklable_error("dataset", dataset, exc) from exc

    def _connect(self) -> None:
        """Join a Ray cluster if this process has not (see ``address``)."""
        try:
            import ray
        except ImportError as exc:
            raise ImportError(
                "RayWorkers need Ray: pip install 'aioloader[ray]' (or 'ray[default]')"
            ) from exc
        state = self._state
        if ray.is_initialized():
            return
        _probe(self.address if self.address is not None else os.environ.get("RAY_ADDRESS"))
        try:
            ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=False)
        except Exception as exc:
            raise ConnectionError(
                f"could not join the Ray cluster at address={self.address!r}: "
                f"{type(exc).__name__}: {exc}. Start one (ray start --head), pass its "
                "address, or address=None for a local one"
            ) from exc
        state.own_runtime = True


@dataclass(slots=True, eq=False)
class _State:
    """What RayWorkers hold, apart from the object (so a finalizer can release it)."""

    fleet: Fleet
    shm_max_bytes: int | None = None
    slots: _shm.SlotPool | None = None
    slots_made: bool = False
    attached: set[int] = dataclasses.field(default_factory=set)
    loop_thread: LoopThread | None = None
    own_runtime: bool = False  # this pool called ray.init: it shuts Ray down at close
    closed: bool = False  # nothing new is started from now on
    released: bool = False  # every step of close() done
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def slot_pool(self) -> _shm.SlotPool | None:
        """The one slot pool, made at the first loader's attach (under the lock, Ray joined);
        None with ``shm_max_bytes=0`` or no room in ``/dev/shm``. No segment is made before a
        batch of an actor on this machine needs one. The default budget is the usual share
        (``_shm.budget``) of what ``/dev/shm`` has free beside this node's object store."""
        if not self.slots_made:
            self.slots_made = True
            cap = 0
            if _shm.shm_available() and self.shm_max_bytes is not None:
                cap = self.shm_max_bytes
            elif _shm.shm_available():
                free, store = _free_beside_object_store()
                cap = _shm.budget(None, free)
                if cap <= 0:
                    beside = f" beside this node's object store ({store} bytes)" if store else ""
                    workers_log.info(
                        "no shared memory for the batches of Ray actors on this machine: %s has "
                        "%d bytes free%s; they travel through the object store. "
                        "RayWorkers(shm_max_bytes=...) sets a budget",
                        _shm.SHM_DIR,
                        free,
                        beside,
                    )
            if cap > 0:
                self.slots = _shm.SlotPool(cap, min_slot_bytes=min(cap, _shm.MIN_SLOT_BYTES))
        return self.slots

    def detach(self, copy_id: int) -> None:
        with self.lock:
            self.attached.discard(copy_id)
            if self.closed:
                return
        self.fleet.drop(copy_id)

    def close(self) -> None:
        """Stop the loop thread, kill the actors, close the slots, leave a Ray this pool
        started. Idempotent; each step can be done again, so a close interrupted (a second
        Ctrl-C) or failed half-way is finished by the next call."""
        with self.lock:
            if self.released:
                return
            self.closed = True
            self.attached.clear()
        if self.loop_thread is not None:
            self.loop_thread.close()
            self.loop_thread = None
        self.fleet.close()
        if self.slots is not None:
            self.slots.close()  # the actors are killed: their mappings go with them
            self.slots = None
        if self.own_runtime:
            import ray

            ray.shutdown()
            self.own_runtime = False
        self.released = True


#: The scheduling strategies Ray names by a string.
_STRATEGIES = frozenset({"DEFAULT", "SPREAD"})

#: Seconds to wait for a cluster's address to accept a connection before joining it. Ray's own
#: join retries an unreachable address for minutes; this fails in seconds, naming it. Longer:
#: more patience with a head node that is still starting.
CONNECT_TIMEOUT_S = 10.0


def _probe(address: str | None) -> None:
    """Refuse at once a cluster address (``host:port`` or ``ray://host:port``) that accepts no
    connection; ``auto``, none, and other forms are left to Ray.

    Raises:
        ConnectionError: names the address, the error and the fix.
    """
    if not address or address == "auto" or address == "local":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ConnectionError(
            f"could not join the Ray cluster at address={address!r}: nothing accepts a "
            f"connection there ({type(exc).__name__}: {exc}, within {CONNECT_TIMEOUT_S} s). "
            "Start one (ray start --head), pass its address, or address=None for a local one"
        ) from exc


def _free_beside_object_store() -> tuple[int, int]:
    """What ``/dev/shm`` has free, less the capacity of this node's Ray object store when it
    lives there, and that capacity (0: elsewhere, or not known). Ray puts the store in
    ``/dev/shm`` when that has room for it (else in ``/tmp``), and fills its pages only as
    objects come, so ``/dev/shm``'s free bytes still count them. A store larger than the whole
    of ``/dev/shm`` is elsewhere; one that fits is taken to be there (where it was put when
    Ray started is not told), which errs on the side of leaving it room."""
    free = _shm.free_bytes()
    try:
        import ray

        here = ray.get_runtime_context().get_node_id()
        store = next(
            float(node["Resources"].get("object_store_memory", 0))
            for node in ray.nodes()  # type: ignore[no-untyped-call]
            if node.get("NodeID") == here
        )
        st = os.statvfs(_shm.SHM_DIR)
    except Exception:  # not told (no such node yet): the free bytes as they are
        return free, 0
    if store > st.f_blocks * st.f_frsize:
        return free, 0  # larger than /dev/shm: Ray put it elsewhere
    return max(0, free - int(store)), int(store)


def _resources(resources: object) -> dict[str, float]:
    if resources is None:
        return {}
    if not isinstance(resources, Mapping):
        raise TypeError(f"resources must be a mapping of names to amounts, got {resources!r}")
    out: dict[str, float] = {}
    for name, amount in resources.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"resources: a name must be a non-empty str, got {name!r}")
        if name in ("CPU", "GPU", "memory"):
            raise ValueError(
                f"resources={dict(resources)!r}: give {name!r} as num_cpus / num_gpus, not "
                "as a custom resource"
            )
        out[name] = check.finite_number(f"resources[{name!r}]", amount, minimum=0)
    return out


def _finalize(state: _State) -> None:
    if state.released:
        return
    warnings.warn(
        "RayWorkers were not closed; use `with` / `async with`, or call close() / aclose()",
        ResourceWarning,
        stacklevel=2,
    )
    state.close()
