"""DataLoader: composes the stages, owns their lifetimes, iterates async and sync.

::

    sampler ─(batch_id, indices)─▶ scheduler ── permit (prefetch) ──▶ produce task   (_produce)
      BatchSampler / yours           one task per epoch                 │
                                                                        ▼
    fetch    async datasets: items awaited on this loop, io_concurrency at once (_fetch)
      │      sync datasets: indices go to the worker, which reads dataset[i] itself
      ▼
    collate  a thread (_threads) or a worker process (_workers), under the batch deadline
      │      (_deadline); a worker collates straight into a shared-memory slot (_shm) and
      │      returns descriptors
      ▼
    open     main process maps the slot: numpy / torch views, zero copies (_shm); the slot
      │      goes back to the pool when the last view of the batch is garbage collected
      ▼
    reorder  ReorderBuffer: sampler order (in_order=True) or as completed (_reorder)
      ▼
    device   pinned memory → side CUDA stream → awaited event (_device); skipped on CPU
      ▼
    consumer `async for` / `for` (_epoch); the permit goes back when the consumer takes the batch

Producers and consumers at each arrow: the scheduler produces permit-holding batch ids and the
produce tasks consume them; produce tasks produce outcomes into the reorder buffer and the
consumer (``__anext__``) takes them out. One number, ``prefetch``, bounds scheduled tasks,
worker jobs and reorder entries together. Shared memory has a cap of its own
(``shm_max_bytes``): batches the consumer keeps (``list(loader)``) keep their slots after their
permits went back; past the cap, batches travel pickled.

This module holds the arguments (checked once into a :class:`LoaderConfig`, ``_config``), the
epochs' bookkeeping for resume, and the public lifecycle; what it holds between epochs lives in
:class:`Resources` (``_resources``).

Lifetimes: worker processes, the thread pool, the slot pool and the device stage are created on
first use and live until :meth:`DataLoader.aclose` / :meth:`DataLoader.close` (or ``async with``
/ ``with``). One epoch runs at a time: starting a new iteration closes an unfinished one. A
loader that is garbage collected unclosed warns ``ResourceWarning`` and releases everything.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import warnings
import weakref
from collections.abc import Callable, Generator
from multiprocessing.context import BaseContext
from typing import Any

from ._batch_sampler import resolve_last_batch
from ._collate import default_collate
from ._config import LoaderConfig, batch_sampler_for
from ._device import parse_device
from ._epoch import Epoch, EpochIterator, Plan
from ._resources import Resources, finalize, worker_payload
from ._stats import Counters, LoaderStatistics
from ._types import Runner, dataset_kind
from ._validate import boolean, is_int, non_negative_int
from ._workers import resolve_context

__all__ = ["DataLoader"]


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
        kind = dataset_kind(dataset)
        if collate_fn is not None and batchify_fn is not None and collate_fn is not batchify_fn:
            raise ValueError("give collate_fn or batchify_fn (the same thing), not both")
        if seed is not None and not is_int(seed):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        policy = resolve_last_batch(last_batch, drop_last if drop_last else None)
        self._config = config = LoaderConfig.build(
            kind=kind,
            batch_size=batch_size,
            num_workers=num_workers,
            thread_pool=thread_pool,
            in_order=in_order,
            prefetch=prefetch,
            timeout=timeout,
            io_concurrency=io_concurrency,
            max_retries=max_retries,
            device_prefetch=device_prefetch,
            on_error=on_error,
            max_failures=max_failures,
            collate_fn=collate_fn if collate_fn is not None else batchify_fn,
            worker_init_fn=worker_init_fn,
            transform=transform,
            seed=int(seed) if seed is not None else secrets.randbits(63),
            pin_memory=pin_memory,
            shm_max_bytes=shm_max_bytes,
            last_batch=policy,
            default_collate=default_collate,
        )
        self._device_spec = parse_device(device)
        self.batch_sampler = batch_sampler_for(
            dataset,
            kind,
            batch_size=config.batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            drop_last=boolean("drop_last", drop_last),
            last_batch=last_batch,
            policy=policy,
            seed=config.seed,
            generator=generator,
        )
        self._context: BaseContext | None = None
        self._payload: bytes | None = None
        if config.uses_processes:
            self._context = resolve_context(mp_context, allow_fork=allow_fork)
            self._payload = worker_payload(config, dataset)
        elif mp_context is not None:
            resolve_context(mp_context, allow_fork=True)  # still validate the name
        cpus = os.cpu_count() or 1
        # Only processes compete for CPUs: threads (thread_pool=True) mostly wait on IO with the
        # GIL released, where more threads than CPUs is the point.
        if config.num_workers > cpus and config.uses_processes:
            warnings.warn(
                f"num_workers={config.num_workers} is more than the {cpus} CPUs here; "
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
        self._res = Resources()
        self._closed = False
        self._finalizer = weakref.finalize(self, finalize, self._res, type(self).__name__)

    # -- settings, as attributes (read-only: the config is built once) --------------------------

    @property
    def kind(self) -> str:
        """``'map'``, ``'async_map'``, ``'iterable'`` or ``'async_iterable'``."""
        return self._config.kind

    @property
    def batch_size(self) -> int | None:
        return self._config.batch_size

    @property
    def num_workers(self) -> int:
        return self._config.num_workers

    @property
    def thread_pool(self) -> bool:
        return self._config.thread_pool

    @property
    def in_order(self) -> bool:
        return self._config.in_order

    @property
    def prefetch(self) -> int:
        return self._config.prefetch

    @property
    def timeout(self) -> float | None:
        return self._config.timeout

    @property
    def io_concurrency(self) -> int:
        return self._config.io_concurrency

    @property
    def max_retries(self) -> int:
        return self._config.max_retries

    @property
    def device_prefetch(self) -> int:
        return self._config.device_prefetch

    @property
    def on_error(self) -> str:
        return self._config.on_error

    @property
    def max_failures(self) -> float:
        return self._config.max_failures

    @property
    def collate_fn(self) -> Callable[[list[Any]], Any]:
        return self._config.collate_fn

    @property
    def worker_init_fn(self) -> Callable[[int], Any] | None:
        return self._config.worker_init_fn

    @property
    def transform(self) -> Callable[[Any], Any] | None:
        return self._config.transform

    @property
    def seed(self) -> int:
        return self._config.seed

    @property
    def pin_memory(self) -> bool:
        return self._config.pin_memory

    @property
    def drop_last(self) -> bool:
        return self._config.drop_last

    @property
    def last_batch(self) -> str:
        return self._config.last_batch

    @property
    def mp_context(self) -> BaseContext | None:
        """The multiprocessing context worker processes start from (None without them)."""
        return self._context

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this DataLoader is closed")

    def _ensure_resources(self) -> Runner:
        self._check_open()
        return self._res.ensure(
            self._config,
            self.dataset,
            device_spec=self._device_spec,
            context=self._context,
            payload=self._payload,
        )

    # -- iteration ---------------------------------------------------------------------------

    def __len__(self) -> int:
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        n = len(self.dataset)
        assert self.batch_size is not None
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (shuffling and seeds derive from it)."""
        self._next_epoch = non_negative_int("epoch", epoch)

    def __aiter__(self) -> EpochIterator:
        # The consumer gets a handle, not the epoch: dropping it closes the epoch at once. The
        # epoch starts at the first batch asked for, not here.
        self._check_open()
        return EpochIterator(self._new_epoch)

    def _new_epoch(self) -> Epoch:
        runner = self._ensure_resources()
        previous = self._res.epoch
        if previous is not None and not previous.finished:
            # Another iterator is mid-epoch: both run a full epoch, as torch's do. The older
            # one's plan is read out first, before set_epoch moves the shared sampler on; a
            # stream is read afresh for each epoch (see _batch.StreamCursor).
            if previous.plan is not None:
                previous.plan.freeze()
            self._res.others.add(previous)
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
            plan = Plan((i, b) for i, b in enumerate(self.batch_sampler) if i not in done)
        device = (
            self._res.device if self._res.device is not None and self._res.device.enabled else None
        )
        it = Epoch(
            self._config,
            epoch,
            runner,
            self._counters,
            plan=plan,
            dataset=self.dataset,
            device=device,
            on_batch=self._done_ids.append,
            # Weakly: the epoch lives in ``_res``, which the finalizer holds; a strong reference
            # back to the loader would keep an unclosed loader alive forever (no warning, no
            # release).
            on_finish=_weak_call(self._epoch_finished, epoch),
        )
        self._epoch_open = True
        self._res.epoch = it
        return it

    def _epoch_finished(self, epoch: int) -> None:
        # Only the newest epoch's end counts for resume: an older one running beside it (two
        # iterators at once) finishes without touching the newest's bookkeeping.
        current = self._res.epoch
        if current is not None and current.epoch != epoch:
            return
        self._epoch_open = False
        self._done_ids = []

    def __iter__(self) -> Generator[Any, None, None]:
        """Iterate synchronously: the pipeline runs on a private event loop in a thread.

        Lazy, like ``aiter``: nothing starts until the first ``next()``; the iterator keeps
        this loader alive (``for batch in DataLoader(...)`` works).
        """
        self._check_open()
        return self._iterate()

    def _iterate(self) -> Generator[Any, None, None]:
        self._ensure_resources()
        yield from self._res.loop().iterate(self._new_epoch)

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> DataLoader:
        await self.astart()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> DataLoader:
        """Start the workers now (like ``async with``), so the first epoch is not slowed by it."""
        self._ensure_resources().start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def astart(self) -> None:
        """Start the workers now (off the loop) rather than at the first batch."""
        await asyncio.to_thread(self._ensure_resources().start)

    async def aclose(self) -> None:
        """Stop everything and release every process, thread, task and segment. Idempotent.

        The processes, threads and segments are released even if closing the epoch, the
        dataset or the device stage fails or is cancelled (that error is raised afterwards).
        """
        try:
            for epoch in self._res.take_epochs():
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

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` or :meth:`close` was called: a closed loader cannot iterate."""
        return self._closed

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
            leased_shm_slots=slots.leased if slots is not None else 0,
            held_shm_slots=slots.held if slots is not None else 0,
            shm_bytes=slots.bytes_total if slots is not None else 0,
            shm_fallbacks=runner.shm_fallbacks if runner is not None else 0,
            worker_restarts=runner.restarts if runner is not None else 0,
            retries=c.retries,
            timeouts=c.timeouts,
            skipped=tuple(c.skipped),
            fetch_s=c.fetch_s,
            read_s=c.read_s,
            collate_s=c.collate_s,
            transfer_s=c.transfer_s,
            consumer_wait_s=c.consumer_wait_s,
        )

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """Pids of the worker processes, for diagnostics (a profiler, memory per worker).

        Empty with threads, before the workers start and once the loader is closed; a worker
        that died is listed until it is replaced (``statistics().worker_restarts`` counts those).
        """
        return self._res.worker_pids()

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


def _weak_call(method: Callable[[int], None], arg: int) -> Callable[[], None]:
    """A callable that calls the bound ``method(arg)`` while its object is alive, else
    nothing."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound(arg)

    return call
