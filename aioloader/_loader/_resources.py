"""What a loader holds between epochs, and how it is made and released.

A :class:`DataLoader` owns, once first needed and until it is closed: a runner (threads, or
worker processes with the shared-memory slot pool they write into), the device stage, the
private event-loop thread behind ``for batch in loader``, the epoch being iterated, and the
dataset's own ``aclose``. :class:`Resources` keeps them apart from the loader object, so that
a ``weakref.finalize`` on the loader can release them without keeping the loader alive
(:func:`finalize` warns ``ResourceWarning`` first, as an unclosed file does).

Worker processes and their shared-memory slots always live in a :class:`~aioloader.WorkerPool`
(``_shared_pool``), the one holder of processes, slots and budget: a loader attaches to the pool
it was given (``workers=``) or to one it made for itself (:func:`private_pool`) in the same way,
and holds only its runner over the pool's workers. A pool it was given is the user's to close,
its loop thread included; a pool of its own closes with the loader.

At interpreter exit, loaders that were never closed (a module-level ``loader = DataLoader(...)``,
an exception from the training step that was not caught, Ctrl-C without ``with``) are closed
by :func:`close_all_at_exit` *before* Python joins its threads: a worker's serve loop only ends
when the pool closes its pipes, and a thread of the program's own (an executor's) may wait on
a batch. The hook is registered with ``threading._register_atexit``, the CPython hook
``concurrent.futures`` itself uses (called in reverse order of registration, so ours runs
before that of an executor made earlier); ``atexit`` would run too late, after the threads are
joined. A SIGTERM,
which skips both, releases them too (:mod:`.._signals`) before it ends the process.

What goes to worker processes is decided here too. :func:`worker_payload` pickles the batch
maker (dataset, collate_fn, transform) and ``worker_init_fn`` when an epoch needs a dataset copy
(:meth:`Resources.renew`): at the first epoch, and at every epoch with
``persistent_workers=False`` (torch's default), so a change made to the dataset between epochs
reaches the workers, and one made after the loader was built reaches the first epoch. An
unpicklable part is reported then, at the first batch, naming what could not be pickled; a
plain function is cheap to check and is reported at construction already
(:func:`check_callables`), as the dataset cannot be without pickling it twice.

A program may fork while a loader holds all this (Lightning's ``ddp_fork``, ``multiprocessing``
under 'fork', joblib-style forks, ``os.fork()``). The child's copies are its parent's: worker
processes it cannot wait on, pipes and a loop the parent reads, segments the parent unlinks.
At the child's first use (an epoch, ``with``, ``load_state_dict``) :meth:`Resources._leave_parent`
lets go of them without closing any (``_closing.keep_inherited``) and the child makes its own,
as a loader made there would, torch-like (its workers fork at ``iter()``); a shared pool given
as ``workers=`` renews itself likewise. The parent's workers keep serving the parent, mid-epoch
included; an iterator the child inherited mid-epoch refuses to go on there (``_threads``). A
child that never uses the loader, or only collects or closes its copy, touches nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import pickle
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any

from .._batch import BatchMaker
from .._config import LoaderConfig
from .._epoch import Epoch
from .._errors import unpicklable_error as _unpicklable
from .._sampling import rank_seed
from .._signals import release_before_sigterm
from .._threads import LoopThread, ThreadRunner, off_loop, skips_thread
from .._types import AsyncCloseable, DecodingStream, NamedItems, Runner, SourceDataset
from .._workers import (
    Payload,
    ProcessRunner,
    dumps_copy,
    dumps_payload,
    pickles_main_by_value,
    starts_early,
)
from ._closing import close_soon, closer_if_last, forked_lock, hold, keep_inherited
from ._shared_pool import (
    WorkerPool,
    close_pools,
    forked_server_note,
    private_pool,
    refuse_parents_forkserver,
)

if TYPE_CHECKING:
    from .._device import DeviceStage, DeviceStats

__all__ = [
    "Resources",
    "batch_maker",
    "check_callables",
    "close_all_at_exit",
    "finalize",
    "worker_payload",
]

# How long closing the loader waits for the dataset's own aclose() on the private loop.
DATASET_CLOSE_TIMEOUT_S = 10.0


def batch_maker(config: LoaderConfig, dataset: Any) -> BatchMaker:
    """The :class:`BatchMaker` for ``dataset``: for async datasets the items arrive fetched by
    the loop, so the maker gets no dataset (only a :class:`SourceDataset`'s ``decode``)."""
    decode = None
    item_name = None
    if config.kind == "async_map":
        if isinstance(dataset, SourceDataset):
            decode = dataset.decode
        if isinstance(dataset, NamedItems):
            item_name = dataset.item_name  # the loop's dataset is not there to ask later
        dataset = None  # items arrive fetched; the dataset stays on the loop
    elif config.kind == "async_iterable" and isinstance(dataset, DecodingStream):
        decode = dataset.decode  # raw items arrive pulled by the loop
        dataset = None
    return BatchMaker(
        dataset,
        config.collate_fn,
        transform=config.transform,
        decode=decode,
        skip_errors=config.skip_errors,
        shard=config.shard,
        item_name=item_name,
        stream_seed=config.stream_seed,
        batched=config.batched,
    )


def worker_payload(config: LoaderConfig, dataset: Any, context: BaseContext) -> Payload:
    """The dataset copy workers of ``context`` get: the pickled batch maker and
    ``worker_init_fn`` (what lives in ``__main__`` by value, see ``_workers._payload``).

    Raises:
        TypeError: something cannot be pickled; names it and what to do.
    """
    by_value = pickles_main_by_value(context)
    maker = batch_maker(config, dataset)
    try:
        return dumps_copy((maker, config.worker_init_fn), main_by_value=by_value)
    except Exception as exc:
        # Only now, on the way to an error: pickle each part alone to name the culprit. An
        # async dataset stays here; only its decode (a method of it) would travel.
        sent = maker.dataset if maker.dataset is not None else maker.decode
        for name, obj in _parts(config, sent):
            try:
                dumps_payload(obj, main_by_value=by_value, map_files=True)  # no file copied
            except Exception as part_exc:
                raise _unpicklable(name, obj, part_exc) from part_exc
        raise _unpicklable("dataset", dataset, exc) from exc


def check_callables(config: LoaderConfig) -> None:
    """Report an unpicklable callable now, where that is cheap: a plain function of an
    importable module pickles by reference, so pickling it costs nothing. A lambda or a local
    function travels by value (``_workers._payload``): only then is it pickled so (with what
    its closure holds), and refused if even that fails (a lock, an open file in the closure).
    A function of ``__main__`` travels by value and anything else (a bound method, a callable
    object) may hold the dataset: those are checked with the dataset, when the first epoch
    needs a copy.

    Raises:
        TypeError: names the callable and what to do.
    """
    for name, fn in _parts(config, None)[1:]:
        if isinstance(fn, types.FunctionType) and fn.__module__ != "__main__":
            try:
                pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:
                try:
                    dumps_payload(fn, main_by_value=False)  # by value
                except Exception as exc:
                    raise _unpicklable(name, fn, exc) from exc


def _parts(config: LoaderConfig, dataset: Any) -> list[tuple[str, Any]]:
    return [
        ("dataset", dataset),
        ("collate_fn", config.collate_fn),
        ("transform", config.transform),
        ("worker_init_fn", config.worker_init_fn),
    ]


@dataclass(slots=True, eq=False, weakref_slot=True)  # identity: kept in a WeakSet
class Resources:
    """Everything a loader must release (see the module docstring)."""

    # The workers' pool: the one given (``workers=``), else the loader's own once it needs
    # workers (``own_pool``). Given: the user's to close, its loop thread too.
    pool: WorkerPool | None = None
    own_pool: bool = False
    runner: Runner | None = None
    device: DeviceStage | None = None
    loop_thread: LoopThread | None = None
    epoch: Epoch | None = None  # the newest epoch: its progress is the resume state
    others: weakref.WeakSet[Epoch] = field(default_factory=weakref.WeakSet)  # older, still live
    dataset_aclose: Callable[[], Any] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    starter: threading.Thread | None = None  # starts the workers at construction (start_early)
    used: bool = False  # made or started for the user (not only by start_early)
    closed: bool = False
    pid: int = field(default_factory=os.getpid)  # the process they belong to (see close)
    forked_from: int | None = None  # the process they were left to (see _leave_parent)

    def ensure(
        self,
        config: LoaderConfig,
        dataset: Any,
        *,
        device_spec: Any,
        context: BaseContext | None,
        early: bool = False,
    ) -> Runner:
        """Make what is missing (device stage, the loader's own pool, runner); returns the
        runner. Worker processes get their dataset copy from :meth:`renew`. ``early``: for
        :meth:`start_early`, not for the user (the loader does not count as used).

        Raises:
            RuntimeError: closed (:meth:`start_early`'s thread, outrun by the loader's close).
        """
        self._leave_parent()
        with self.lock:
            if self.closed:
                raise RuntimeError("this DataLoader is closed")
            if not early and threading.current_thread() is not self.starter:
                self.used = True
            if self.device is None and (device_spec is not None or config.pin_memory):
                from .._device import DeviceStage  # imports torch: only for a device stage

                self.device = DeviceStage(device_spec, pin_memory=config.pin_memory)
            if config.uses_processes:
                if self.pool is None:
                    assert context is not None
                    self.pool, self.own_pool = self._private_pool(config, context), True
                # The pool's runner for this loader, made once; raises if the pool is closed.
                self.runner = self.pool.attach(config, self.runner, self.device)
                release_before_sigterm(close_all_at_exit)
            elif self.runner is None:
                device = self.device
                # Collated straight into pinned memory: no staging memcpy on the way.
                pins = device is not None and device.pins_collation
                self.runner = ThreadRunner(
                    batch_maker(config, dataset),
                    config.threads,
                    inline=skips_thread(config),
                    prefetch=config.prefetch,
                    pinned=device.host_alloc if pins and device is not None else None,
                )
            if isinstance(dataset, AsyncCloseable) and self.dataset_aclose is None:
                self.dataset_aclose = dataset.aclose
                hold(dataset)  # closed by the last open loader that reads it
            _LIVE.add(self)
            return self.runner

    def _private_pool(self, config: LoaderConfig, context: BaseContext) -> WorkerPool:
        """The loader's own pool; in a forked child, with what to do where it cannot start."""
        if self.forked_from is None:
            return private_pool(config, context)
        refuse_parents_forkserver(context, self.forked_from)
        try:
            return private_pool(config, context)
        except RuntimeError as exc:
            exc.add_note(forked_server_note(self.forked_from))
            raise

    def start_early(
        self, config: LoaderConfig, dataset: Any, *, device_spec: Any, context: BaseContext | None
    ) -> None:
        """Start the worker processes now, in the background (at the loader's construction):
        they start while the program builds its model, and are ready, or nearly, when the
        first batch is asked for. Only the processes: their dataset copy still comes with the
        first epoch, so a change made to the dataset before it reaches them. They start in a
        thread, from the worker server. Whatever fails here fails again, and is reported, where
        the workers are first used.

        Only where a start is cheap and safe from a thread: workers forked from a server (the
        forked one, the default, or the standard forkserver, whose one-time start then overlaps
        the program's own; not ``spawn``, whose workers each import the program, nor ``fork``
        from a thread: ``_workers.starts_early``), and no device stage (made on first use). A
        pool the loader was given is the user's to start.
        """
        if (
            not config.uses_processes
            or (self.pool is not None and not self.own_pool)
            or not starts_early(context)
            or device_spec is not None
            or config.pin_memory
        ):
            return
        release_before_sigterm(close_all_at_exit)  # from this thread: off it, it cannot
        with contextlib.suppress(Exception):  # reported where the workers are first used
            self.ensure(config, dataset, device_spec=None, context=context, early=True)

        def launch() -> None:
            with contextlib.suppress(Exception):
                runner = self.ensure(config, dataset, device_spec=None, context=context)
                if isinstance(runner, ProcessRunner):
                    runner.launch()

        self.starter = threading.Thread(target=launch, name="aioloader-start", daemon=True)
        self.starter.start()

    def drop_workers_for_seed(self, config: LoaderConfig, seed: int) -> None:
        """The workers' dataset copy carries the seed: let this loader's copy go, so the next
        epoch attaches anew and loads a copy with ``seed`` (the processes stay); threads never
        had it.

        Raises:
            ValueError: an epoch is being iterated on worker processes (they use the seed).
        """
        if not config.uses_processes:
            return
        self._leave_parent()  # a forked child's epochs and workers are its parent's
        if any(e is not None and not e.finished for e in (self.epoch, *self.others)):
            raise ValueError(
                f"cannot adopt the state's seed={seed} while an epoch is being iterated "
                "(its workers use the current seed); load the state before iterating"
            )
        with self.lock:
            runner, self.runner = self.runner, None
        if runner is not None:
            runner.close()

    def renew(self, config: LoaderConfig, dataset: Any, epoch: int, *, alone: bool) -> None:
        """Give the worker processes the dataset copy for ``epoch``, if it needs a new one: the
        first epoch does; with ``persistent_workers=False`` every epoch does, unless another
        epoch of the loader still runs on the current copy (``alone`` is False): two
        iterators at once share it, as they share the processes. Pickled from now on, in a
        thread (see ``_workers._copy``); threads take the consumer's torch grad mode."""
        runner, pool = self.runner, self.pool
        if runner is None:
            return
        runner.begin_epoch()  # from the consumer's thread: its epoch begins
        if pool is None or (runner.has_copy and (config.persistent_workers or not alone)):
            return  # no pool: threads, which read the loader's own dataset
        payload = getattr(pool, "payload", None)  # RayWorkers (aioloader._ray) pack their own
        if payload is not None:
            make = functools.partial(payload, batch_maker(config, dataset), config, dataset)
        else:
            context = pool.multiprocessing_context
            make = functools.partial(worker_payload, config, dataset, context)
        runner.load(make, epoch, seed=rank_seed(config.seed, config.shard))

    def loop(self) -> LoopThread:
        """The private event-loop thread for sync iteration, started on first use."""
        self._leave_parent()
        with self.lock:
            if self.loop_thread is None:  # the loaders of a pool they were given share its own
                given = self.pool if self.pool is not None and not self.own_pool else None
                self.loop_thread = LoopThread() if given is None else given.loop()
            _LIVE.add(self)
            return self.loop_thread

    def _leave_parent(self) -> None:
        """In a process forked from the one these resources belong to (a loader used before
        ``fork()``: Lightning's ``ddp_fork``, a ``multiprocessing`` child under 'fork', a
        joblib-style fork), let go of the parent's, so that what is made from now on is this
        process's own, as for a loader made here: its own workers, slots, loop thread and
        device stage, at its first epoch.

        The parent's are kept, untouched, for this process's life (``_closing.keep_inherited``):
        closing them here would kill the parent's workers and write on its pipes, and an epoch
        of theirs collected here would wake the parent's loop. The parent's epochs are
        forgotten with them (one forked mid-epoch is the parent's, which goes on); a pool the
        loader was given renews its own the same way at its next use
        (``WorkerPool._leave_parent``). Not under :attr:`lock`: a thread of the parent may
        have held it as the process forked; the lock is replaced with the rest.
        """
        if os.getpid() == self.pid:
            return
        with forked_lock():
            if os.getpid() == self.pid:  # another thread of this process did it meanwhile
                return
            keep_inherited(
                self.runner,
                self.pool if self.own_pool else None,
                self.loop_thread,
                self.device,
                self.starter,
                self.epoch,
                *self.others,
            )
            self.runner = self.loop_thread = self.device = self.starter = self.epoch = None
            if self.own_pool:
                self.pool, self.own_pool = None, False
            self.others = weakref.WeakSet()
            self.lock = threading.Lock()
            self.forked_from, self.pid = self.pid, os.getpid()

    def take_epochs(self) -> list[Epoch]:
        """Every epoch still held, newest first, forgotten here: the loader closes them. None
        in a forked child that did not use the loader: they are its parent's (see
        :meth:`_leave_parent`)."""
        if os.getpid() != self.pid:
            return []
        epochs = [e for e in (self.epoch, *self.others) if e is not None]
        for epoch in epochs:
            epoch.interrupt()  # one not over tells its consumer so
        self.epoch = None
        self.others = weakref.WeakSet()
        return epochs

    async def run_close(self, close: Callable[[], None], *, may_block: bool) -> None:
        """Run ``close`` (which calls :meth:`close`) without the loop waiting on anything.

        In place where nothing it would wait for exists, as with an idle ``num_workers=0``
        loader: no pool of worker processes, loop thread, device stage or start-up thread, and
        no batch queued or made on a helper thread (that saves a thread's hand-off, ~0.5 ms).
        Else on a thread of its own. ``may_block``: the caller may block."""
        with self.lock:
            runner, starter = self.runner, self.starter
            at_once = (
                not may_block
                and self.pool is None
                and self.loop_thread is None
                and self.device is None
                and (starter is None or not starter.is_alive())
                # Last: once it says yes, the threads take no more batches.
                and (runner is None or runner.stop_if_idle())
            )
        if at_once:
            close()
        else:
            await off_loop(close)

    def close(self) -> None:
        """Release everything (blocking). Idempotent in effect: each part stays held here until
        it is closed, so a close interrupted (a second Ctrl-C while it joins busy workers) is
        finished by the next call, never left half done. In a forked child (torch's workers
        under 'fork', a fork-started pool) that collects its copy of an unclosed loader, or
        closes it, nothing: the workers, pipes, threads and segments are the parent's."""
        if os.getpid() != self.pid:
            self.closed = True
            return
        epochs = self.take_epochs()
        for epoch in epochs:
            epoch.close_nowait()
        with self.lock:
            self.closed = True  # nothing new is made from now on
            runner, pool, own = self.runner, self.pool, self.own_pool
            device, loop_thread = self.device, self.loop_thread
            if own and pool is not None:
                self.runner = None  # its own pool holds (and closes) the processes
        given = pool if not own else None
        # Another open loader may read the dataset: then this one's loop closes only its own.
        aclose, self.dataset_aclose = closer_if_last(self.dataset_aclose), None
        if loop_thread is not None:
            if aclose is not None:  # sessions the dataset opened on the private loop
                with contextlib.suppress(Exception):
                    loop_thread.run(aclose(), timeout=DATASET_CLOSE_TIMEOUT_S)
            if given is None:  # the loop of a pool it was given is that pool's to close
                loop_thread.close()
            self.loop_thread = None
        elif aclose is not None:
            _close_dataset_without_loop(aclose, epochs[0].loop if epochs else None)
        if own and pool is not None:
            pool.close()  # its processes and slots: nothing to release one copy from first
            self.pool = None
        elif runner is not None:
            runner.close()  # threads; or this loader's copy in a pool it was given
        self.runner = None
        starter = self.starter
        if starter is not None and starter is not threading.current_thread():
            starter.join(STARTER_JOIN_S)  # it launches nothing more once the pool is closed
        if device is not None:
            device.close()
            self.device = None

    def worker_pids(self) -> tuple[int, ...]:
        """Pids of the worker processes started so far (none with threads, nor in a forked
        child before it used the loader: those are its parent's)."""
        runner = self.runner if os.getpid() == self.pid else None
        return runner.worker_pids() if runner is not None else ()

    def live(self, prefetch: int) -> dict[str, Any]:
        """The statistics only these resources know: batches in flight and waiting, shared
        memory, restarts and fallbacks, and each worker's figures where the runner reports
        them (Ray actors' ``worker_figures``; see :class:`aioloader.LoaderStatistics`)."""
        epoch = self.epoch
        runner = self.runner
        slots = runner.shm_stats() if runner is not None else None
        device = self.device.stats() if self.device is not None else None
        return {
            "in_flight": epoch.reorder.pending if epoch is not None else 0,
            "waiting": epoch.reorder.waiting if epoch is not None else 0,
            "prefetch": prefetch,
            "live_shm_slots": slots.slots if slots is not None else 0,
            "leased_shm_slots": slots.leased if slots is not None else 0,
            "held_shm_slots": slots.held if slots is not None else 0,
            "shm_bytes": slots.bytes_total if slots is not None else 0,
            "shm_fallbacks": runner.shm_fallbacks if runner is not None else 0,
            "worker_restarts": runner.restarts if runner is not None else 0,
            **(_device_live(device) if device is not None else {}),
            "workers": getattr(runner, "worker_figures", tuple)(),
        }

    @property
    def held(self) -> bool:
        """Whether anything is still held (a process, a thread, a segment); a loader on a
        closed pool it was given holds nothing."""
        if self.pool is not None and not self.own_pool and self.pool.closed:
            return False
        return self.runner is not None or self.loop_thread is not None or self.pool is not None


def _device_live(s: DeviceStats) -> dict[str, Any]:
    """The device stage's part of :meth:`Resources.live`."""
    return {
        "device_batches": s.batches_copied,
        "device_bytes": s.bytes_copied,
        "device_staged_bytes": s.staged_bytes,
        "device_copies_in_flight": s.in_flight,
        "device_wait_s": s.wait_seconds,
        "device_handoff_p50_us": s.handoff_p50_s * 1e6,
        "device_handoff_p99_us": s.handoff_p99_s * 1e6,
        "device_ring_slots": s.ring_slots,
        "device_ring_bytes": s.ring_bytes,
        "device_ring_fallbacks": s.ring_fallbacks,
        "device_pinned_fallbacks": s.pinned_fallbacks,
    }


# How long closing waits for the thread that starts the workers early (it is at most amid one
# process start, which the pool's close waits for anyway).
STARTER_JOIN_S = 10.0


def _close_dataset_without_loop(
    aclose: Callable[[], Any], loop: asyncio.AbstractEventLoop | None
) -> None:
    """The dataset's ``aclose()`` when the loader has no loop of its own: it iterated on the
    user's ``loop``, which may be gone by now (``asyncio.run(main())``, then ``close()``).

    On that loop while it is open (run here if idle, asked for if it runs in another thread),
    else on a private one that is not made this thread's current loop: a source drops the
    sessions of closed loops without awaiting anything. On a loop running in this thread
    (sync ``close()`` in async code) it is scheduled there: waiting would block that loop.
    Best effort, as on the private loop: a failing ``aclose()`` does not stop the release.
    """
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    with contextlib.suppress(Exception):
        if running is not None:
            task = running.create_task(_awaited(aclose))
            _CLOSING.add(task)
            task.add_done_callback(_CLOSING.discard)
            task.add_done_callback(_retrieve)
        elif loop is not None and not loop.is_closed() and loop.is_running():
            future = asyncio.run_coroutine_threadsafe(_awaited(aclose), loop)
            future.result(DATASET_CLOSE_TIMEOUT_S)
        elif loop is not None and not loop.is_closed():
            loop.run_until_complete(_awaited(aclose))
        else:
            private = asyncio.new_event_loop()
            try:
                private.run_until_complete(_awaited(aclose))
            finally:
                private.close()


async def _awaited(aclose: Callable[[], Any]) -> None:
    """``aclose()`` within :data:`DATASET_CLOSE_TIMEOUT_S`, awaited if it returns an awaitable
    (the protocol only asks for the attribute: a plain function passes it too)."""
    async with asyncio.timeout(DATASET_CLOSE_TIMEOUT_S):
        result = aclose()
        if inspect.isawaitable(result):
            await result


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # best effort, as on the private loop: not "never retrieved"


_CLOSING: set[asyncio.Task[Any]] = set()  # the tasks above, held until done
# Resources that may hold something: closed at interpreter exit if their loader never was.
_LIVE: weakref.WeakSet[Resources] = weakref.WeakSet()


def close_all_at_exit() -> None:
    """Close every loader's resources still held (see the module docstring). Silent: the end
    of the program is a normal end of life for a module-level loader, as in torch."""
    for resources in list(_LIVE):
        with contextlib.suppress(Exception):
            resources.close()
    close_pools()  # shared worker pools, after the loaders that use them


threading._register_atexit(close_all_at_exit)  # type: ignore[attr-defined]
# A forked child (a worker under mp_context='fork') inherits the set: the resources are its
# parent's, never its own to close. Closing them at the child's exit would wait on the parent's
# worker processes.
os.register_at_fork(after_in_child=_LIVE.clear)


def finalize(resources: Resources, name: str) -> None:
    """The loader was garbage collected unclosed: warn, then release everything. A loader
    that was never used (its workers only started early) is released without a word."""
    if resources.closed or (not resources.held and resources.starter is None):
        return
    if os.getpid() != resources.pid:  # a forked child's copy: its parent's to close and warn
        resources.closed = True
        return
    if resources.used:
        warnings.warn(
            f"{name} was not closed; use `async with` / `with`, or call aclose() / close()",
            ResourceWarning,
            stacklevel=2,
        )
    close_soon(resources.close, resources.lock)  # the collector may run this inside ensure()
