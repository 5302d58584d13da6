"""DataLoader: composes the stages, owns their lifetimes, iterates async and sync.

::

    sampler ─(batch_id, indices)─▶ scheduler ── permit (prefetch) ──▶ produce task
      BatchSampler / yours           one task per epoch                 │
                                                                        ▼
    fetch    async datasets: items awaited on this loop, io_concurrency at once (_epoch)
      │      sync datasets: indices go to the worker, which reads dataset[i] itself
      ▼
    collate  thread (num_workers=0, thread_pool=True) or worker process (_runner, _workers);
      │      a worker collates straight into a shared-memory slot and returns descriptors
      ▼
    open     main process maps the slot: numpy / torch views, zero copies (_shm); the slot
      │      goes back to the pool when the last view of the batch is garbage collected
      ▼
    reorder  ReorderBuffer: sampler order (in_order=True) or as completed; deadlines (_reorder)
      ▼
    device   pinned memory → side CUDA stream → awaited event (_device); skipped on CPU
      ▼
    consumer `async for` / `for`; the permit goes back when the consumer takes the batch

Producers and consumers at each arrow: the scheduler produces permits-held batch ids and the
produce tasks consume them; produce tasks produce outcomes into the reorder buffer and the
consumer (``__anext__``) takes them out. One number, ``prefetch``, bounds tasks, worker jobs,
reorder entries and live shared-memory slots together.

Lifetimes: worker processes, the thread pool, the slot pool and the device stage are created on
first use and live until :meth:`DataLoader.aclose` / :meth:`DataLoader.close` (or ``async with``
/ ``with``). One epoch runs at a time: starting a new iteration closes an unfinished one. A
loader that is garbage collected unclosed warns ``ResourceWarning`` and releases everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import pickle
import secrets
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext
from typing import Any

from . import _shm
from ._batch import BatchMaker
from ._collate import default_collate
from ._device import DeviceStage, parse_device
from ._epoch import Epoch, EpochConfig, EpochIterator
from ._runner import ThreadRunner
from ._sampler import BatchSampler, RandomSampler, SequentialSampler, _resolve_last_batch
from ._stats import Counters, LoaderStatistics
from ._sync import LoopThread
from ._types import dataset_kind
from ._workers import ProcessRunner, WorkerPool, resolve_context

__all__ = ["DataLoader"]

# Default cap on shared memory: a quarter of /dev/shm's free space, at most 4 GiB. Above it,
# batches the consumer keeps (a `list(loader)`) travel pickled rather than failing.
SHM_FRACTION = 0.25
SHM_MAX_DEFAULT = 4 << 30

_ON_ERROR = ("raise", "skip")


@dataclass(slots=True)
class _Resources:
    """Everything that must be released: kept apart from the loader so a finalizer can close
    it without keeping the loader alive."""

    runner: ThreadRunner | ProcessRunner | None = None
    slots: _shm.SlotPool | None = None
    device: DeviceStage | None = None
    loop_thread: LoopThread | None = None
    epoch: Epoch | None = None
    dataset_aclose: Callable[[], Any] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        epoch, self.epoch = self.epoch, None
        if epoch is not None:
            epoch.close_nowait()
        with self.lock:
            runner, self.runner = self.runner, None
            slots, self.slots = self.slots, None
            device, self.device = self.device, None
            loop_thread, self.loop_thread = self.loop_thread, None
        if loop_thread is not None:
            aclose, self.dataset_aclose = self.dataset_aclose, None
            if aclose is not None:  # sessions the dataset opened on the private loop
                with contextlib.suppress(Exception):
                    loop_thread.run(aclose(), timeout=10.0)
            loop_thread.close()
        if runner is not None:
            runner.close()
        if device is not None:
            device.close()
        if slots is not None:
            slots.close()


def _finalize(resources: _Resources, name: str) -> None:
    if resources.runner is None and resources.loop_thread is None and resources.slots is None:
        return
    warnings.warn(
        f"{name} was not closed; use `async with` / `with`, or call aclose() / close()",
        ResourceWarning,
        stacklevel=2,
    )
    resources.close()


class DataLoader:
    """Loads batches from a dataset, asynchronously, in order, without blocking the event loop.

    ``async for batch in loader`` (inside ``async with``) and ``for batch in loader`` each run
    one epoch. A torch user changes one import: the dataset, sampler and collate conventions are
    torch's; MXNet Gluon's ``last_batch``, ``batchify_fn``, ``thread_pool``, ``prefetch`` and
    ``timeout`` mean what they mean there.

    Args:
        dataset: map-style (``__getitem__`` + ``__len__``; ``__getitem__`` may be ``async``),
            iterable (``__iter__``, sharded across workers) or async iterable (``__aiter__``).
        batch_size: samples per batch (``None`` only with ``batch_sampler``).
        shuffle: random order, seeded from ``seed`` and the epoch.
        sampler: yields indices; excludes ``shuffle``.
        batch_sampler: yields lists of indices (or lists of such lists: the loader then yields
            a list of batches, one per shard); excludes batch_size/shuffle/sampler/drop_last.
        num_workers: worker processes (or threads with ``thread_pool=True``); 0 runs the CPU
            work on one helper thread.
        collate_fn: turns samples into a batch (default :func:`default_collate`).
        drop_last: ``True`` means ``last_batch='discard'``.
        last_batch: ``'keep'``, ``'discard'`` or ``'rollover'`` (the remainder starts the next
            epoch).
        timeout: seconds of producer time a batch may take (None or 0: no limit); for async
            datasets the fetch of its items counts too. A late batch raises
            :class:`LoaderTimeoutError`; its worker process is killed and replaced. A thread
            (``num_workers=0``, ``thread_pool=True``) cannot be killed: its batch times out,
            but batches queued behind that thread wait for it. Use worker processes for code
            that may hang.
        prefetch: batches in flight or ready at once (default ``2 * max(1, num_workers)``; for
            async datasets at least ``ceil(io_concurrency / batch_size) + 2``, so that
            ``io_concurrency`` item fetches can be in flight).
        in_order: yield in sampler order (default) or as batches complete.
        worker_init_fn: called with the worker id in each worker process at start.
        seed: base seed for shuffling and per-batch worker seeding (random if None). Worker
            processes reseed ``random``, ``numpy.random`` and torch before each batch from
            (seed, epoch, batch id). Threads (``num_workers=0``, ``thread_pool=True``) share the
            process's global generators with your own code, so they are not reseeded (as in
            torch): draw per-sample randomness from a generator seeded by the index there.
        thread_pool: run ``num_workers`` threads instead of processes.
        batchify_fn: another name for ``collate_fn`` (MXNet).
        transform: applied to each sample off the event loop, before collation.
        io_concurrency: item fetches in flight at once for async datasets (all batches).
        mp_context: ``'forkserver'`` (default), ``'spawn'``, ``'fork'`` or a context.
        allow_fork: allow ``'fork'`` even while threads run (unsafe; you insist).
        max_retries: re-run a batch whose worker crashed or hung this many times.
        on_error: ``'raise'`` (default) or ``'skip'`` samples that fail to read or decode.
        max_failures: with ``'skip'``: a count (int >= 0) or fraction (0 < f < 1) of samples
            that may fail before :class:`TooManyFailuresError`.
        device: ``'cuda'``, ``'cuda:1'``, a ``torch.device`` or None; batches arrive there.
        pin_memory: stage host batches in pinned memory (with a CUDA device).
        device_prefetch: batches copied to the device ahead of the consumer.
        shm_max_bytes: cap on shared memory for batches (default: a quarter of free /dev/shm,
            at most 4 GiB); 0 sends every batch pickled.
        generator: a ``torch.Generator`` for the default random sampler (as in torch).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool = False,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        last_batch: str | None = None,
        timeout: float | None = None,
        prefetch: int | None = None,
        in_order: bool = True,
        worker_init_fn: Callable[[int], Any] | None = None,
        seed: int | None = None,
        thread_pool: bool = False,
        *,
        batchify_fn: Callable[[list[Any]], Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
        io_concurrency: int = 64,
        mp_context: str | BaseContext | None = None,
        allow_fork: bool = False,
        max_retries: int = 0,
        on_error: str = "raise",
        max_failures: float = 0,
        device: Any = None,
        pin_memory: bool = False,
        device_prefetch: int = 1,
        shm_max_bytes: int | None = None,
        generator: Any = None,
    ) -> None:
        self.dataset = dataset
        self._kind = dataset_kind(dataset)
        self.num_workers = _non_negative_int("num_workers", num_workers)
        self.thread_pool = _bool("thread_pool", thread_pool)
        self.in_order = _bool("in_order", in_order)
        self.prefetch = (
            2 * max(1, self.num_workers)
            if prefetch is None
            else _positive_int("prefetch", prefetch)
        )
        self.timeout = _timeout(timeout)
        self.io_concurrency = _positive_int("io_concurrency", io_concurrency)
        self.max_retries = _non_negative_int("max_retries", max_retries)
        self.device_prefetch = _positive_int("device_prefetch", device_prefetch)
        if on_error not in _ON_ERROR:
            raise ValueError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
        self.on_error = on_error
        self.max_failures = _max_failures(max_failures)
        if collate_fn is not None and batchify_fn is not None and collate_fn is not batchify_fn:
            raise ValueError("give collate_fn or batchify_fn (the same thing), not both")
        collate = collate_fn if collate_fn is not None else batchify_fn
        if collate is not None and not callable(collate):
            raise TypeError(f"collate_fn must be callable, got {collate!r}")
        self.collate_fn: Callable[[list[Any]], Any] = collate or default_collate
        for name, fn in (("worker_init_fn", worker_init_fn), ("transform", transform)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable, got {fn!r}")
        self.worker_init_fn = worker_init_fn
        self.transform = transform
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self.seed = seed if seed is not None else secrets.randbits(63)
        self._device_spec = parse_device(device)
        self.pin_memory = _bool("pin_memory", pin_memory)
        if shm_max_bytes is not None:
            shm_max_bytes = _non_negative_int("shm_max_bytes", shm_max_bytes)
        self._shm_max_bytes = shm_max_bytes
        self.drop_last = _bool("drop_last", drop_last)
        self._policy = _resolve_last_batch(last_batch, drop_last if drop_last else None)
        self.batch_size = batch_size
        self.batch_sampler = self._make_batch_sampler(
            batch_size, shuffle, sampler, batch_sampler, drop_last, last_batch, generator
        )
        if prefetch is None and self._kind == "async_map" and isinstance(self.batch_size, int):
            # Enough batches in flight to keep io_concurrency requests going: a batch waits
            # for its slowest item, and the next batches' items fill the gap meanwhile.
            self.prefetch = max(self.prefetch, -(-self.io_concurrency // self.batch_size) + 2)
        self._context: BaseContext | None = None
        self._payload: bytes | None = None
        if self.num_workers > 0 and not self.thread_pool:
            self._context = resolve_context(mp_context, allow_fork=allow_fork)
            self._payload = self._pickle_payload()
        elif mp_context is not None:
            resolve_context(mp_context, allow_fork=True)  # still validate the name
        cpus = os.cpu_count() or 1
        # Only processes compete for CPUs: threads (thread_pool=True) mostly wait on IO with the
        # GIL released, where more threads than CPUs is the point.
        if self.num_workers > cpus and self._payload is not None:
            warnings.warn(
                f"num_workers={self.num_workers} is more than the {cpus} CPUs here; "
                "extra workers only compete for them",
                UserWarning,
                stacklevel=2,
            )
        self._counters = Counters()
        self._next_epoch = 0
        self._resume: dict[str, Any] | None = None
        self._done_ids: list[int] = []
        self._epoch_sampler_state: dict[str, Any] | None = None
        self._epoch_open = False  # an epoch started and not run to its end
        self._res = _Resources()
        self._closed = False
        self._finalizer = weakref.finalize(self, _finalize, self._res, type(self).__name__)

    # -- construction helpers ----------------------------------------------------------------

    def _make_batch_sampler(
        self,
        batch_size: int | None,
        shuffle: bool,
        sampler: Any,
        batch_sampler: Any,
        drop_last: bool,
        last_batch: str | None,
        generator: Any,
    ) -> Any:
        shuffle = _bool("shuffle", shuffle)
        iterable = self._kind in ("iterable", "async_iterable")
        if iterable:
            if shuffle or sampler is not None or batch_sampler is not None:
                raise ValueError(
                    "shuffle, sampler and batch_sampler do not apply to an iterable dataset "
                    f"({type(self.dataset).__name__}); shuffle inside the stream instead"
                )
            if self._policy == "rollover":
                raise ValueError("last_batch='rollover' needs a map-style dataset")
            if batch_size is None:
                raise ValueError("batch_size=None needs a batch_sampler (map-style datasets)")
            self.batch_size = _positive_int("batch_size", batch_size)
            return None
        if batch_sampler is not None:
            if batch_size not in (None, 1) or shuffle or sampler is not None or drop_last:
                raise ValueError(
                    "batch_sampler excludes batch_size, shuffle, sampler and drop_last "
                    f"(got batch_size={batch_size!r}, shuffle={shuffle!r}, "
                    f"sampler={sampler!r}, drop_last={drop_last!r})"
                )
            if last_batch is not None:
                raise ValueError(f"batch_sampler excludes last_batch (got {last_batch!r})")
            return batch_sampler
        if sampler is not None and shuffle:
            raise ValueError(f"sampler={sampler!r} excludes shuffle=True; shuffle in the sampler")
        if batch_size is None:
            raise ValueError("batch_size=None needs a batch_sampler")
        size = _positive_int("batch_size", batch_size)
        if sampler is None:
            sampler = (
                RandomSampler(
                    self.dataset,
                    generator=generator,
                    seed=None if generator is not None else self.seed,
                )
                if shuffle
                else SequentialSampler(self.dataset)
            )
        return BatchSampler(sampler, size, self._policy)

    def _pickle_payload(self) -> bytes:
        maker = self._maker()
        for name, obj in (
            ("dataset", self.dataset),
            ("collate_fn", self.collate_fn),
            ("transform", self.transform),
            ("worker_init_fn", self.worker_init_fn),
        ):
            try:
                pickle.dumps(obj)
            except Exception as exc:
                raise TypeError(
                    f"{name}={obj!r} cannot be sent to worker processes: {exc}. Define it at "
                    "module level (no lambdas or local functions), or use thread_pool=True"
                ) from exc
        return pickle.dumps((maker, self.worker_init_fn), protocol=pickle.HIGHEST_PROTOCOL)

    def _maker(self) -> BatchMaker:
        decode = None
        dataset = self.dataset
        if self._kind == "async_map":
            if hasattr(dataset, "fetch") and hasattr(dataset, "decode"):
                decode = dataset.decode
            dataset = None  # items arrive fetched; the dataset stays on the loop
        return BatchMaker(
            dataset,
            self.collate_fn,
            transform=self.transform,
            decode=decode,
            skip_errors=self.on_error == "skip",
        )

    # -- resources ---------------------------------------------------------------------------

    def _ensure_resources(self) -> None:
        if self._closed:
            raise RuntimeError("this DataLoader is closed")
        res = self._res
        with res.lock:
            if res.device is None and (self._device_spec is not None or self.pin_memory):
                res.device = DeviceStage(self._device_spec, pin_memory=self.pin_memory)
            if res.runner is None:
                if self._payload is not None:
                    assert self._context is not None
                    if res.slots is None and _shm.shm_available():
                        res.slots = self._slot_pool(res.device)
                    pool = WorkerPool(self.num_workers, self._context, self._payload, self.seed)
                    res.runner = ProcessRunner(pool, res.slots, self.prefetch)
                else:
                    threads = self.num_workers if self.thread_pool and self.num_workers else 1
                    res.runner = ThreadRunner(self._maker(), threads)
            aclose = getattr(self.dataset, "aclose", None)
            if aclose is not None and callable(aclose):
                res.dataset_aclose = aclose

    def _slot_pool(self, device: DeviceStage | None) -> _shm.SlotPool | None:
        cap = self._shm_cap()
        if cap <= 0:
            return None
        if device is not None and device.enabled:
            # Each slot is page-locked once when created, so device copies read it directly.
            return _shm.SlotPool(
                cap, on_map=device.register_host_memory, on_unmap=device.unregister_host_memory
            )
        return _shm.SlotPool(cap)

    def _shm_cap(self) -> int:
        if self._shm_max_bytes is not None:
            return self._shm_max_bytes
        stat = os.statvfs("/dev/shm")
        return int(min(SHM_MAX_DEFAULT, stat.f_bavail * stat.f_frsize * SHM_FRACTION))

    # -- iteration ---------------------------------------------------------------------------

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        n = len(self.dataset)
        assert self.batch_size is not None
        return n // self.batch_size if self._policy == "discard" else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (shuffling and seeds derive from it)."""
        self._next_epoch = _non_negative_int("epoch", epoch)

    def __aiter__(self) -> AsyncIterator[Any]:
        # The consumer gets a handle, not the epoch: dropping it closes the epoch at once.
        return EpochIterator(self._new_epoch())

    def _new_epoch(self) -> Epoch:
        self._ensure_resources()
        previous = self._res.epoch
        if previous is not None:
            previous.close_nowait()
        resume, self._resume = self._resume, None
        if resume is not None:
            epoch = int(resume["epoch"])
            done = set(resume["done"])
        else:
            epoch = self._next_epoch
            done = set()
        self._next_epoch = epoch + 1
        self._counters.epoch = epoch
        self._counters.epoch_batches_yielded = 0
        self._done_ids = sorted(done)
        plan = None
        if self.batch_sampler is not None:
            if resume is not None and resume.get("sampler") is not None:
                self.batch_sampler.load_state_dict(resume["sampler"])
            if hasattr(self.batch_sampler, "set_epoch"):
                self.batch_sampler.set_epoch(epoch)
            state_dict = getattr(self.batch_sampler, "state_dict", None)
            self._epoch_sampler_state = state_dict() if callable(state_dict) else None
            plan = ((i, b) for i, b in enumerate(self.batch_sampler) if i not in done)
        config = EpochConfig(
            kind=self._kind,
            prefetch=self.prefetch,
            in_order=self.in_order,
            timeout=self.timeout,
            max_retries=self.max_retries,
            io_concurrency=self.io_concurrency,
            batch_size=self.batch_size or 1,
            drop_last=self._policy == "discard",
            skip_errors=self.on_error == "skip",
            max_failures=self.max_failures,
            device_prefetch=self.device_prefetch,
        )
        device = (
            self._res.device if self._res.device is not None and self._res.device.enabled else None
        )
        it = Epoch(
            config,
            epoch,
            self._res.runner,
            self._counters,
            plan=plan,
            dataset=self.dataset,
            device=device,
            on_batch=self._done_ids.append,
            # Weakly: the epoch lives in ``_res``, which the finalizer holds; a strong reference
            # back to the loader would keep an unclosed loader alive forever (no warning, no
            # release).
            on_finish=_weak_call(self._epoch_finished),
        )
        self._epoch_open = True
        self._res.epoch = it
        return it

    def _epoch_finished(self) -> None:
        self._epoch_open = False
        self._done_ids = []

    def __iter__(self) -> Iterator[Any]:
        """Iterate synchronously: the pipeline runs on a private event loop in a thread."""
        self._ensure_resources()
        with self._res.lock:
            if self._res.loop_thread is None:
                self._res.loop_thread = LoopThread()
            loop_thread = self._res.loop_thread
        return loop_thread.iterate(self._new_epoch)

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> DataLoader:
        await self.astart()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> DataLoader:
        """Start the workers now (like ``async with``), so the first epoch is not slowed by it."""
        self._ensure_resources()
        runner = self._res.runner
        if isinstance(runner, ProcessRunner):
            runner.pool.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def astart(self) -> None:
        """Start the workers now (off the loop) rather than at the first batch."""
        self._ensure_resources()
        runner = self._res.runner
        if isinstance(runner, ProcessRunner):
            await asyncio.to_thread(runner.pool.start)

    async def aclose(self) -> None:
        """Stop everything and release every process, thread, task and segment. Idempotent.

        The processes, threads and segments are released even if closing the epoch, the
        dataset or the device stage fails or is cancelled (that error is raised afterwards).
        """
        try:
            epoch, self._res.epoch = self._res.epoch, None
            if epoch is not None:
                if epoch.loop is asyncio.get_running_loop():
                    await epoch.aclose()
                else:
                    epoch.close_nowait()
            aclose, self._res.dataset_aclose = self._res.dataset_aclose, None
            if aclose is not None:
                await aclose()
            device = self._res.device
            if device is not None and device.enabled:
                await device.drain()  # copies still in flight finish without blocking the loop
        finally:
            try:
                await asyncio.to_thread(self._close_now)
            except asyncio.CancelledError:
                self._close_now()  # cancelled while waiting: finish the job here, then go
                raise

    def close(self) -> None:
        """Synchronous :meth:`aclose`, for code without an event loop. Idempotent."""
        self._close_now()

    def _close_now(self) -> None:
        self._closed = True
        self._res.close()
        self._finalizer.detach()

    # -- state -------------------------------------------------------------------------------

    def statistics(self) -> LoaderStatistics:
        """A snapshot of what the loader is doing and where the time went."""
        c = self._counters
        epoch = self._res.epoch
        slots = self._res.slots.stats() if self._res.slots is not None else None
        runner = self._res.runner
        return LoaderStatistics(
            epoch=c.epoch,
            batches_yielded=c.batches_yielded,
            samples_yielded=c.samples_yielded,
            epoch_batches_yielded=c.epoch_batches_yielded,
            in_flight=epoch.reorder.pending if epoch is not None else 0,
            waiting=epoch.reorder.waiting if epoch is not None else 0,
            prefetch=self.prefetch,
            live_shm_slots=slots.slots if slots is not None else 0,
            held_shm_slots=slots.held if slots is not None else 0,
            shm_bytes=slots.bytes_total if slots is not None else 0,
            worker_restarts=runner.pool.rebuilds if isinstance(runner, ProcessRunner) else 0,
            retries=c.retries,
            timeouts=c.timeouts,
            skipped=tuple(c.skipped),
            fetch_s=c.fetch_s,
            read_s=c.read_s,
            collate_s=c.collate_s,
            transfer_s=c.transfer_s,
            consumer_wait_s=c.consumer_wait_s,
        )

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: restoring it with :meth:`load_state_dict` makes the next
        iteration yield exactly the batches of this epoch not yet taken (or, between epochs,
        start the next epoch).

        Exact for map-style datasets whose sampler is deterministic given the epoch (the
        built-in samplers are; ``shuffle=True`` with a ``generator`` is not). Iterable datasets
        restart their stream.
        """
        if self._epoch_open:
            return {
                "epoch": self._counters.epoch,
                "done": list(self._done_ids),
                "sampler": self._epoch_sampler_state,
                "seed": self.seed,
            }
        return {
            "epoch": self._next_epoch,
            "done": [],
            "sampler": self._sampler_state(),
            "seed": self.seed,
        }

    def _sampler_state(self) -> dict[str, Any] | None:
        state_dict = getattr(self.batch_sampler, "state_dict", None)
        return state_dict() if callable(state_dict) else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration continues that epoch."""
        for key in ("epoch", "done", "seed"):
            if key not in state:
                raise ValueError(f"state is missing {key!r}; got keys {sorted(state)}")
        if state["seed"] != self.seed:
            raise ValueError(
                f"state was saved with seed={state['seed']}, this loader has seed={self.seed}; "
                "pass the same seed to resume exactly"
            )
        self._resume = dict(state)

    def __repr__(self) -> str:
        s = self.statistics()
        mode = (
            f"{self.num_workers} threads"
            if self.thread_pool and self.num_workers
            else f"{self.num_workers} processes"
            if self.num_workers
            else "main-process thread"
        )
        return (
            f"<DataLoader {type(self.dataset).__name__} epoch={s.epoch} "
            f"yielded={s.epoch_batches_yielded}/{self._len_or_q()} in_flight={s.in_flight} "
            f"waiting={s.waiting} prefetch={s.prefetch} shm_slots={s.live_shm_slots} "
            f"workers={mode}{' closed' if self._closed else ''}>"
        )

    def _len_or_q(self) -> str:
        try:
            return str(len(self))
        except TypeError:
            return "?"


def _weak_call(method: Callable[[], None]) -> Callable[[], None]:
    """A callable that calls the bound ``method`` while its object is alive, else nothing."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _timeout(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"timeout must be a number of seconds or None, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"timeout must be finite and >= 0, got {value!r}")
    return float(value) if value > 0 else None


def _max_failures(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"max_failures must be a count or a fraction, got {value!r}")
    if (
        not math.isfinite(value)
        or value < 0
        or (isinstance(value, float) and value > 1 and not value.is_integer())
    ):
        raise ValueError(
            f"max_failures must be a count >= 0 or a fraction 0 < f < 1, got {value!r}"
        )
    return float(value)
