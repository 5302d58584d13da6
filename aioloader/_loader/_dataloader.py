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

This module holds the arguments (checked once into ``_config``'s :class:`LoaderConfig`), the
public lifecycle and the bookkeeping for resume; what lives between epochs is in ``_resources``.

Lifetimes: worker processes, the thread pool, the slot pool and the device stage are created on
first use and live until :meth:`DataLoader.aclose` / :meth:`DataLoader.close` (or ``async with``
/ ``with``), which tells the consumer of an epoch not over so. Two iterators at once each run a
whole epoch. A loader garbage collected unclosed warns ``ResourceWarning``, releases everything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import weakref
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

from .._batch import default_collate, default_convert
from .._config import LoaderConfig, batch_sampler_for, context_argument, resolve_seed
from .._device import falls_back, parse_device
from .._epoch import Epoch, EpochBook, EpochIterator, deal_carried, plan_for
from .._log import distributed_log
from .._sampling import (
    DEFAULT_SHARE_SEED,
    Lockstep,
    Shard,
    process_group,
    resolve_equal_steps,
    resolve_last_batch,
    resolve_leftover,
    resolve_shard,
    stream_items,
    warn_if_group_appeared,
)
from .._stats import Counters, EpochProgress, LoaderStatistics, progress_display
from .._threads import LoopThread, SyncIterator, off_loop
from .._types import Runner, StreamPosition, dataset_kind
from .._validate import as_torch, boolean, to_int
from .._workers import warn_more_workers_than_cpus
from ._closing import closer_if_last
from ._resources import Resources, check_callables, finalize
from ._settings import SettingsView
from ._shared_pool import WorkerPool, shared_pool, worker_context

__all__ = ["DataLoader"]

# What a pickled loader leaves behind: what runs (workers, threads, segments) and its statistics.
_LIVE = frozenset({"_res", "_finalizer", "_counters", "_lockstep"})


class DataLoader(SettingsView):
    """Loads batches from a dataset, asynchronously, in order, without blocking the event loop.

    ``async for batch in loader`` (inside ``async with``) and ``for batch in loader`` each run
    one epoch. A torch user changes one import: the parameters begin with torch's, in torch's
    order and with its defaults, and the dataset, sampler and collate conventions are torch's;
    aioloader's own and MXNet Gluon's (``last_batch``, ``batchify_fn``, ``thread_pool``,
    ``prefetch``) follow, keyword-only.

    Args:
        dataset: map-style (``__getitem__`` + ``__len__``; ``__getitem__`` may be ``async``),
            iterable (``__iter__``, sharded across workers) or async iterable (``__aiter__``).
        batch_size: samples per batch. ``None`` turns automatic batching off, as in torch:
            each sample is yielded alone, through ``collate_fn(sample)`` (default
            :func:`default_convert`: numpy arrays become tensors).
        shuffle: random order, seeded from the loader's seed and the epoch (with
            ``generator=``: drawn from the generator at each epoch's start, as torch draws
            it, so ``set_epoch(n)`` does not replay an epoch's order).
        sampler: yields indices; excludes ``shuffle``.
        batch_sampler: yields batches of indices (lists, numpy arrays or torch tensors), or
            lists of such batches (the loader then yields a list of batches, one per shard);
            excludes batch_size/shuffle/sampler/drop_last.
        num_workers: worker processes (or threads with ``thread_pool=True``); 0 runs the CPU
            work on one helper thread, or where it is asked for while batches are cheaper than
            the hand-over (see ``aioloader._threads._runner``).
        collate_fn: turns samples into a batch (default :func:`default_collate`).
        pin_memory: return batches in pinned (page-locked) host memory, for fast copies to
            CUDA. Without CUDA it warns :class:`DeviceUnavailableWarning` at the first
            iteration, once per process, and batches stay as they are (torch warns too).
        drop_last: ``True`` means ``last_batch='discard'``.
        timeout: seconds of producer time a batch may take (0, as in torch, or None: no
            limit); for async datasets the fetch of its items counts too. A late batch raises
            :class:`LoaderTimeoutError`; its worker process is killed and replaced. A thread
            (``num_workers=0``, ``thread_pool=True``) cannot be killed: its batch times out,
            but batches queued behind that thread wait for it. Use worker processes for code
            that may hang.
        worker_init_fn: called with the worker id in each worker process when its dataset copy
            loads: once with ``persistent_workers=True``, else at every epoch (as in torch).
        multiprocessing_context: ``'forkserver'`` (default), ``'spawn'``, ``'fork'`` or a
            context; ``mp_context`` is its other name.
        generator: a ``torch.Generator`` for the default random sampler and the base seed (as
            in torch).
        prefetch_factor: batches in flight per worker (torch's; needs ``num_workers > 0``):
            ``prefetch = prefetch_factor * num_workers``.
        persistent_workers: keep each worker's dataset copy across epochs (needs workers);
            False (default, as torch): a fresh copy each epoch, in the same warm processes.
        pin_memory_device: torch's (deprecated there): ``''`` or a CUDA device to pin for.
        in_order: yield in sampler order (default) or as batches complete.
        last_batch: ``'keep'``, ``'discard'`` or ``'rollover'`` (the remainder starts the next
            epoch).
        prefetch: batches in flight or ready at once, in all (default ``2 * max(1,
            num_workers)``; for async datasets at least ``ceil(io_concurrency / batch_size) +
            2``, so that ``io_concurrency`` item fetches can be in flight).
        seed: base seed for shuffling and per-batch worker seeding. Without it the seed is
            drawn as torch draws its base seed: from ``generator``, else from torch's global
            generator (``torch.manual_seed`` makes runs repeat), or at random when torch was
            never imported. Worker processes are seeded from it (see ``worker_seeding``).
            Threads (``num_workers=0``, ``thread_pool=True``) share the process's global
            generators with your own code, so they are not reseeded (as in torch): draw
            per-sample randomness from a generator seeded by the index there.
        thread_pool: run ``num_workers`` threads instead of processes.
        batchify_fn: another name for ``collate_fn`` (MXNet).
        pin_device_id: MXNet Gluon's: the CUDA device whose pinned memory ``pin_memory`` uses
            (an int >= 0), as ``pin_memory_device=f"cuda:{pin_device_id}"``.
        transform: applied to each sample off the event loop, before collation.
        io_concurrency: item fetches in flight at once for async datasets (all batches).
        mp_context: another name for ``multiprocessing_context``.
        allow_fork: allow ``'fork'`` even while threads run (unsafe; you insist).
        max_retries: re-run a batch whose worker crashed or hung this many times.
        on_error: ``'raise'`` (default) or ``'skip'`` samples that fail to read or decode.
        max_failures: with ``'skip'``: a count (int >= 0) or fraction (0 < f < 1) of samples
            that may fail before :class:`TooManyFailuresError`. A fraction is of the epoch's
            length (the sampler's); for an iterable dataset, whose length is unknown, of the
            samples seen so far, one failure always allowed. The error names the batch, every
            skipped index and the batch's samples that were read but not delivered.
        device: ``'cuda'``, ``'cuda:1'``, a ``torch.device`` or None; batches arrive there.
            Without CUDA the first iteration raises ``RuntimeError`` naming what was asked and
            what is there (as torch's ``.to('cuda')`` does); ``'auto'`` is the explicit
            fallback: CUDA where it is available, else batches stay on the CPU, quietly.
        device_prefetch: batches copied to the device ahead of the consumer.
        shm_max_bytes: cap on shared memory for batches (default: a quarter of free /dev/shm,
            at most 4 GiB); 0 sends every batch pickled.
        progress: a progress bar per epoch: ``True`` (tqdm, the ``progress`` extra), a tqdm
            bar to reuse, or a callable making one from tqdm's arguments (see ``_progress``).
        shard: this rank's share only (torch.distributed): None (default) when a process group
            of world size > 1 exists at construction; True requires one; False never; a
            ``ProcessGroup``: the share of this rank in that data-parallel group, whose
            model-parallel peers read the same batches (docs/distributed.md).
        equal_steps: a stream the loader shards ends its epoch at the same step on every rank
            (the shortest share): the ranks agree on the end a few batches ahead, one small
            collective per step on a thread and a gloo group of the loader's own, made at its
            first epoch. None (default): on for a sharded stream; True: insist (a
            ``ValueError`` for map-style data or ``shard=False`` at construction, for no
            process group at the first epoch); False: off, shares may end unevenly.
        leftover: what a rank read past the agreed end: ``'carry'`` (default; handed first in
            the next epoch, up to ``prefetch`` batches, the rest dropped) or ``'drop'``;
            counted in ``statistics()`` either way, and logged.
        worker_seeding: worker ``k`` gets ``base + k`` (its ``get_worker_info().seed``), the base
            drawn from ``seed`` and the epoch; ``'batch'`` (default) then reseeds before each
            batch from (seed, epoch, batch id); ``'worker'`` does not, as torch.
        start_timeout: seconds a worker process may take to start, and to load each dataset
            copy (unpickling it, ``worker_init_fn``); past it :class:`WorkerInitError` names
            the worker, its pid and its stack, and the worker is killed. None (default): the
            batch ``timeout`` if set (in torch it covers the start too), else 120 s.
        workers: a :class:`WorkerPool` shared with other loaders; it decides ``num_workers``.

    Epochs and ``set_epoch``: each iteration is the next epoch, and shuffling and worker seeds
    derive from its number (a shuffle drawn from a ``generator`` derives from the generator's
    state instead, which a state saves). The loader calls ``set_epoch(epoch)`` on the samplers
    it made itself (``shuffle``) before every epoch. A sampler or batch sampler you pass is yours:
    the loader calls its ``set_epoch`` only for an epoch you name with
    :meth:`DataLoader.set_epoch`, and on resume from a :meth:`state_dict` saved in such an
    epoch; ``sampler.set_epoch(e)`` called by your own loop (the usual torch
    ``DistributedSampler`` idiom) is never overridden.

    Attributes are torch's (``dataset``, ``batch_size``, ``sampler``, ``batch_sampler``,
    ``num_workers``, ``collate_fn``, ``pin_memory``, ``drop_last``, ``timeout``, ...) and
    aioloader's own. Settings are checked once, at construction: assigning any of them
    afterwards raises ``ValueError`` (torch refuses the same for ``dataset``, ``batch_size``,
    ``sampler``, ``batch_sampler``, ``drop_last`` and ``persistent_workers``).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float | None = 0,
        worker_init_fn: Callable[[int], Any] | None = None,
        multiprocessing_context: str | BaseContext | None = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        last_batch: str | None = None,
        prefetch: int | None = None,
        seed: int | None = None,
        thread_pool: bool = False,
        batchify_fn: Callable[[list[Any]], Any] | None = None,
        pin_device_id: int | None = None,
        transform: Callable[[Any], Any] | None = None,
        io_concurrency: int = 64,
        mp_context: str | BaseContext | None = None,
        allow_fork: bool = False,
        max_retries: int = 0,
        on_error: str = "raise",
        max_failures: float = 0,
        device: Any = None,
        device_prefetch: int = 1,
        shm_max_bytes: int | None = None,
        progress: Any = False,
        shard: Any = None,  # None, True, False or a torch.distributed ProcessGroup
        equal_steps: bool | None = None,
        leftover: str = "carry",
        worker_seeding: str = "batch",
        start_timeout: float | None = None,
        workers: WorkerPool | None = None,
    ) -> None:
        self.dataset = dataset
        kind = dataset_kind(dataset)
        if collate_fn is not None and batchify_fn is not None and collate_fn is not batchify_fn:
            raise ValueError("give collate_fn or batchify_fn (the same thing), not both")
        self._seed_given = seed is not None
        self._generator = generator
        policy = resolve_last_batch(last_batch, drop_last if drop_last else None)
        share = resolve_shard(shard, kind, sampler, batch_sampler, dataset)
        self._equal_steps = resolve_equal_steps(equal_steps)
        self._leftover = resolve_leftover(leftover)
        self._lockstep_key = self._equal_steps_key(kind, share is not None or shard is None, share)
        self._lockstep = self._lockstep_for(kind, share, later=shard is None)
        pool = shared_pool(workers, num_workers=num_workers, thread_pool=thread_pool)
        self._config = config = LoaderConfig.build(
            kind=kind,
            batch_size=batch_size,
            num_workers=num_workers if pool is None else pool.num_workers,
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
            seed=resolve_seed(seed, generator),
            pin_memory=pin_memory,
            shm_max_bytes=shm_max_bytes,
            last_batch=policy,
            default_collate=default_collate,
            default_convert=default_convert,
            batch_sampler_given=batch_sampler is not None,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            pin_device_id=pin_device_id,
            shard=share,
            worker_seeding=worker_seeding,
            start_timeout=start_timeout,
            share_seed=int(seed) if seed is not None else DEFAULT_SHARE_SEED,
        )
        parsed = parse_device(device)  # checked now; whether CUDA is there, at the first epoch
        self._device_spec = device if falls_back(device) else parsed
        self._sampling_for = functools.partial(
            batch_sampler_for,
            dataset,
            kind,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            drop_last=as_torch(boolean, "drop_last", drop_last),
            last_batch=last_batch,
            policy=policy,
            seed=config.seed,
            generator=generator,
            share_seed=config.share_seed,
        )
        self._sampling = self._sampling_for(shard=share)
        self._user_samplers = (sampler, batch_sampler)
        _, context = context_argument(
            multiprocessing_context, mp_context, uses_processes=config.uses_processes
        )
        # Built before init_process_group (Lightning and accelerate make the group after the
        # script made the loader): the share is decided later (_shard_if_group_appeared).
        self._group_unseen = shard is None and process_group() is None
        self._own_seed: int | None = None  # before a pending state's was adopted (_seed_back)
        self._context: BaseContext | None = None
        if config.collate_fn in (default_collate, default_convert):
            import torch  # noqa: F401  # tensors ahead: before workers fork, not once in each
        if config.uses_processes:
            self._context = worker_context(pool, config, context, allow_fork, dataset)
            check_callables(config)  # the dataset is pickled when an epoch needs it
        # A pool it is given decided, and warned; ten loaders made in a loop warn once.
        if config.uses_processes and pool is None:
            warn_more_workers_than_cpus(config.num_workers)
        self._counters = Counters()
        drawn = seed is None and generator is not None and not config.persistent_workers
        redraw = functools.partial(resolve_seed, None, generator) if drawn else None
        self._book = EpochBook(self._sampling, dataset, draw_seed=redraw, in_order=config.in_order)
        self._progress = progress_display(progress)
        self._res = Resources(pool=pool)
        self._closed = False
        self._finalizer = self._watch()
        self._initialized = True
        self._res.start_early(config, dataset, device_spec=self._device_spec, context=self._context)

    def _lockstep_for(self, kind: str, share: Shard | None, later: bool = False) -> Lockstep | None:
        """The agreement on equal steps, for a stream read in shares (see ``equal_steps``);
        ``later``: the share may still be decided, when a process group appears."""
        stream = kind in ("iterable", "async_iterable")
        sharded = share is not None and share.replicas > 1
        later = later and process_group() is None
        if self._equal_steps and not stream:
            raise ValueError(
                f"equal_steps=True applies to a stream (an iterable dataset) only: dataset="
                f"{type(self.dataset).__name__} is map-style, whose shares are already equal "
                "(leave equal_steps=None)"
            )
        if self._equal_steps and not sharded and not later:
            raise ValueError(
                f"equal_steps=True needs a stream the loader shards by rank: dataset="
                f"{type(self.dataset).__name__} is not read in shares here (no process group "
                "of world size > 1, or shard=False)"
            )
        if not stream or not sharded or self._equal_steps is False:
            return None
        assert share is not None
        members = share.members if share.members is not None else tuple(range(share.replicas))
        return Lockstep(members, self._leftover, key=self._lockstep_key)

    def _equal_steps_key(self, kind: str, may_shard: bool, share: Shard | None) -> str:
        """This loader's equal-steps key, taken when it is built, with or without a process
        group yet: loader ``k`` of a scope (the default group, or the data-parallel group
        given as ``shard``) on each rank pairs with loader ``k`` of that scope on the others
        (see ``_sampling._lockstep``). Every stream loader that may take equal steps takes
        one; loaders that never will (map-style, ``shard=False``, ``equal_steps=False``) do
        not, so a loader built on rank 0 only in one of those ways shifts nothing."""
        stream = kind in ("iterable", "async_iterable")
        if not stream or not may_shard or self._equal_steps is False:
            return ""
        return Lockstep.next_key(share.members if share is not None and share.given else None)

    def _watch(self) -> weakref.finalize[..., Any]:
        """The finalizer of a loader collected unclosed: its lockstep first (the agreement
        thread, its group, the carried batches), then its resources. Re-made when a lockstep
        comes later (a process group that appeared after construction)."""
        lockstep = self._lockstep.finalizer() if self._lockstep is not None else None
        return weakref.finalize(self, _collected, self._res, type(self).__name__, lockstep)

    def _reconfigure(self, config: LoaderConfig) -> None:
        # Checked first: if it cannot be pickled, nothing changes. Workers take it with a copy.
        if config.uses_processes:
            check_callables(config)
        self._config = config

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "this DataLoader is closed: iterate it inside its `with` (or `async with`) "
                "block, before close(); or make a new DataLoader"
            )

    def _ensure_resources(self) -> Runner:
        self._check_open()
        return self._res.ensure(
            self._config,
            self.dataset,
            device_spec=self._device_spec,
            context=self._context,
        )

    # -- iteration ---------------------------------------------------------------------------

    def _shard_if_group_appeared(self) -> None:
        """A loader built with ``shard=None`` before a process group of world size > 1 existed
        takes its rank's share at its first ``len()`` or epoch after the group appeared, if no
        epoch has started (Lightning calls ``len()`` once the group exists, before iterating);
        after that, changing what it reads would split an epoch: it warns instead."""
        if not self._group_unseen:
            return
        group = process_group()
        if group is None or group[1] == 1:
            return  # still none: look again next time
        self._group_unseen = False
        # Workers started early hold no dataset copy yet: the first epoch's carries the share.
        if self._counters.batches_yielded > 0 or self._res.epoch is not None:
            warn_if_group_appeared(self.dataset)
            return
        share = resolve_shard(None, self._config.kind, *self._user_samplers, self.dataset)
        if share is None:
            return
        self._sampling = self._sampling_for(shard=share)
        self._reconfigure(dataclasses.replace(self._config, shard=share))
        self._lockstep = self._lockstep_for(self._config.kind, share)
        if self._lockstep is not None:
            self._finalizer.detach()
            self._finalizer = self._watch()
        # Last: a state loaded before the group is checked again, and may be refused.
        try:
            self._book.replace_sampling(self._sampling)
        except ValueError:
            self._seed_back()
            raise

    def __len__(self) -> int:
        self._shard_if_group_appeared()
        if self._sampling.batches is not None:
            return len(self._sampling.batches)  # type: ignore[arg-type]
        n = stream_items(self._config.shard, len(self.dataset))  # this rank's share of a stream
        size = self.batch_size or 1
        self._book.stream_len = n // size if self.drop_last else -(-n // size)
        return self._book.stream_len

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (shuffling and seeds derive from it); a
        sampler you passed gets ``set_epoch(epoch)`` at its start (see the class docstring)."""
        self._book.set_epoch(epoch)

    def __aiter__(self) -> EpochIterator:
        # The consumer gets a handle, not the epoch: dropping it closes the epoch at once. The
        # epoch starts at the first batch asked for, not here.
        self._check_open()
        return EpochIterator(self._new_epoch)

    def _new_epoch(self) -> Epoch:
        self._shard_if_group_appeared()  # before the workers start: they get the share's config
        if self._equal_steps and self._lockstep is None:  # deferred at construction: no group
            self._lockstep_for(self._config.kind, self._config.shard)  # raises, naming why
        if self._lockstep is not None:
            self._lockstep.check_usable()  # a forked child under its parent's group: at once
        runner = self._ensure_resources()
        previous = self._res.epoch
        if previous is not None and previous.raised_last and not previous.finished:
            # Its consumer stopped at an error (a traceback keeps it alive): not a 2nd iterator.
            # One that handled the error and goes on is told its epoch was closed, not handed
            # a normal end of an epoch cut short.
            previous.interrupt(
                "a new iterator of this DataLoader began after this one's last batch raised "
                "(a loop left at an error is closed so; to go on past a batch's error, keep "
                "calling next() on the same iterator before starting another)"
            )
            previous.close_nowait()
        alone = previous is None or previous.finished
        if self._lockstep is not None and not alone:
            assert previous is not None
            # Equal steps pair the ranks' steps of one epoch at a time: a second epoch open
            # beside it would cut the first short (zip(loader, loader)). Refused before
            # anything changes; the open one goes on.
            raise RuntimeError(
                f"this DataLoader's epoch {previous.epoch} is still open in another iterator "
                "(zip(loader, loader), another task or thread): under equal steps the ranks "
                "agree on one epoch's steps at a time; finish or drop that iterator first, "
                "make a second DataLoader, or pass equal_steps=False"
            )
        if previous is not None and not previous.finished:
            # Another iterator is mid-epoch: both run a full epoch, as torch's do. The older
            # one's plan is read out first, before set_epoch moves the shared sampler on; a
            # stream is read afresh for each epoch (see _batch.StreamCursor).
            if previous.plan is not None:
                previous.plan.freeze()
            self._res.others.add(previous)
        try:
            epoch, done = self._book.begin(alone)
        except ValueError:
            self._seed_back()  # a state checked only now and refused: dropped whole
            raise
        self._own_seed = None  # the state is the epoch's now
        self._res.renew(self._config, self.dataset, epoch, alone=alone)
        self._counters.epoch = epoch
        self._counters.epoch_batches_yielded = 0
        plan = plan_for(self._sampling, done)  # the batch sampler's iter() runs here, at once
        booking = _Booking(self)
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
            on_batch=booking.took,
            on_finish=booking.finished,
            progress=self._epoch_progress(epoch, len(done)),
            stream_resume=self._book.stream_resume,
            lockstep=self._lockstep,
        )
        self._res.epoch = booking.epoch = it
        return it

    def _epoch_progress(self, epoch: int, done: int) -> EpochProgress | None:
        if self._progress is None:
            return None
        total = self._len_or_q()
        batches = int(total) - done if total.isdigit() else None
        return self._progress.epoch(epoch, batches, self._counters)

    def __iter__(self) -> SyncIterator:
        """Iterate synchronously: the pipeline runs on a private event loop in a thread.

        Lazy, like ``aiter``: nothing starts until the first ``next()``; the iterator keeps
        this loader alive (``for batch in DataLoader(...)`` works). After a batch raises,
        ``next()`` goes on with the following batches, as torch's iterator does.
        """
        self._check_open()
        return SyncIterator(self._new_epoch, self._sync_loop, self.__len__)

    def _sync_loop(self) -> LoopThread:
        self._check_open()
        return self._res.loop()

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> DataLoader:
        try:
            await self.astart()
        except BaseException:  # a worker did not start: nothing outlives the failed `with`
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> DataLoader:
        """Start the workers (like ``async with``) and wait until they are ready."""
        try:
            self._ensure_resources().start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def astart(self) -> None:
        """Start the workers (off the loop) and wait until they are ready, rather than at the
        first batch (where they fork from the forked server, they started with the loader).

        Raises:
            WorkerInitError: a worker did not start within ``start_timeout`` (it was killed).
        """
        await off_loop(self._ensure_resources().start)

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
            aclose, self._res.dataset_aclose = closer_if_last(self._res.dataset_aclose), None
            if aclose is not None:
                await aclose()
            device = self._res.device
            if device is not None and device.enabled:
                await device.drain()  # copies still in flight finish without blocking the loop
        finally:
            try:
                await self._res.run_close(self._close_now, may_block=self._progress is not None)
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
        if self._lockstep is not None:
            self._counters.dropped_batches += len(self._lockstep.carried)
            self._counters.dropped_samples += sum(item[1] for item in self._lockstep.carried)
            self._lockstep.close()
        self._res.close()
        if self._progress is not None:
            self._progress.close()
        self._finalizer.detach()

    def __getstate__(self) -> dict[str, Any]:
        """A framework pickles a loader to start it elsewhere (Lightning's ``ddp_spawn``): the
        copy is an unstarted loader that starts its own workers; these stay with this one."""
        return {name: value for name, value in self.__dict__.items() if name not in _LIVE}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _counters=Counters(), _res=Resources(), _closed=False)
        # A copy is another loader: its own key, taken in the order the copies are made.
        may_shard = self._config.shard is not None or self._group_unseen
        self._lockstep_key = self._equal_steps_key(self._config.kind, may_shard, self._config.shard)
        self._lockstep = self._lockstep_for(self._config.kind, self._config.shard)
        self._finalizer = self._watch()
        if self._book.open:  # pickled mid-epoch: the copy resumes where this one was
            position = self._book.state_dict(self.seed)
            self._book.finished()
            self._book.load(position, check=False)  # a plain stream restarts, as it did

    # -- state -------------------------------------------------------------------------------

    def statistics(self) -> LoaderStatistics:
        """A snapshot of what the loader is doing and where the time went, cheap enough to
        read while it runs: counters of all epochs, ``epoch_stats`` / ``total`` (rates, busy
        shares, the ``bottleneck`` verdict), ``str()`` a table, ``as_dict()`` for dashboards."""
        return LoaderStatistics.build(self._counters, **self._res.live(self.prefetch))

    @property
    def worker_pids(self) -> tuple[int, ...]:
        """Pids of the worker processes started so far, for diagnostics (a profiler, memory
        per worker).

        Workers start in the background from the loader's construction, so right after it this
        may list fewer than ``num_workers`` (``num_workers=2``: often one); once the first
        batch has arrived every worker has started and all are listed. Empty with threads,
        before the workers start and once the loader is closed; a worker that died is listed
        until it is replaced (``statistics().worker_restarts`` counts those).
        """
        return self._res.worker_pids()

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: restoring it with :meth:`load_state_dict` makes the next
        iteration yield exactly the batches of this epoch not yet taken (or, between epochs,
        start the next epoch). Holds the base seed, drawn or given.

        Exact for map-style datasets whose sampler is deterministic given its state (the
        built-in ones are; a ``generator``'s state is saved too), and for streams that are a
        :class:`ResumableStream`; another stream's mid-epoch state is refused when loaded.

        Mid-epoch, the skip budget's count over the batches taken is in it (``"failures"``:
        this rank, the samples seen and the indices skipped), so with ``on_error="skip"`` a
        resumed epoch stops at ``max_failures`` where the uninterrupted one would have.

        Under equal steps, the batches this rank carries into its next epoch (read past the
        last agreed end, ``leftover='carry'``) are in it too (``"equal_steps"``: this rank and
        the batches; mid-epoch, those carried into the open epoch that it has not handed
        yet), so a run resumed from this rank's state hands them first, as it would have;
        loaded on another rank they are not handed there (logged).
        """
        state = self._book.state_dict(self.seed)
        lockstep, shard, epoch = self._lockstep, self._config.shard, self._res.epoch
        if lockstep is None or shard is None:
            return state
        # Mid-epoch, the carried batches are the open epoch's (moved into it when it began):
        # those it has not handed yet; between epochs, the lockstep's.
        carried = (epoch.carried_unhanded() if epoch is not None else []) + lockstep.carried
        if carried:
            state["equal_steps"] = {
                "rank": shard.rank,
                "world": shard.replicas,
                "carried": [list(item) for item in carried],
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration continues that epoch.

        A loader made without ``seed=`` adopts the saved seed (its worker processes, if
        already started with another one, are restarted at the next epoch); one made with
        a different ``seed=`` refuses the state.

        Raises:
            ValueError: the state lacks a key or a field is malformed (named with its value),
                its format is unknown, it was saved mid-epoch by a loader with other settings
                (shuffle, samplers, batch size, lengths: each named with both values), its
                seed differs from an explicit ``seed=`` or must change mid-epoch, it is
                mid-epoch in a stream that cannot resume, its sampler state cannot be loaded
                into this loader's samplers, or it is another rank's own (batches taken out of
                order, a rollover carry: each rank resumes from its own state; loaded before
                the process group, that is checked when the loader takes its share).
        """
        self._shard_if_group_appeared()  # checked against this rank's share, where it has one
        carried = state.get("equal_steps") if isinstance(state, dict) else None
        if carried is not None:
            state = {key: value for key, value in state.items() if key != "equal_steps"}
            carried = self._carried_from(carried)
        seed = self.seed if self._seed_given else None
        if not self._book.pending or self._own_seed is None:
            self._own_seed = self.seed  # given back if the state is dropped (_seed_back)
        # A rank's own state is checked once the group comes, where one may (a launcher's
        # WORLD_SIZE > 1, torch.distributed available); one no group will shard checks it now.
        unseen = self._group_unseen and _group_may_come() and process_group() is None
        checked = self._book.check(
            state, readers=self._config.stream_readers, seed=seed, group_unseen=unseen
        )
        saved = checked["seed"]
        if saved != self.seed:
            self._adopt_seed(to_int("seed", saved))  # (a given seed was compared by check)
        try:
            self._book.load(checked, check=False)  # the sampler takes its state: len() counts it
        except ValueError:
            self._seed_back()
            raise
        if carried is not None and self._lockstep is not None:
            self._lockstep.carried = carried

    def _carried_from(self, saved: object) -> list[tuple[Any, int, int]] | None:
        """The batches a state says this rank carries into its next epoch (see
        :meth:`state_dict`); None, logged, where they are another rank's or this loader takes
        no equal steps.

        Raises:
            ValueError: ``saved`` is malformed (named with its value).
        """
        self._shard_if_group_appeared()
        shard = self._config.shard
        # A merged state's (every rank's, see merge_states): this rank's part of them.
        dealt = deal_carried(saved, 0 if shard is None else shard.rank, _replicas(shard))
        if dealt is not None:
            if self._lockstep is None or shard is None:
                distributed_log.info(
                    "the merged state holds batches the ranks carried into their next epoch "
                    "(equal steps); this loader (%s) takes no equal steps and does not hand them",
                    "no rank" if shard is None else f"rank {shard.rank}",
                )
                return None
            return [(batch, int(samples), int(nbytes)) for batch, samples, nbytes in dealt]
        items = saved.get("carried") if isinstance(saved, dict) else None
        rank = saved.get("rank") if isinstance(saved, dict) else None
        if (
            not isinstance(rank, int)
            or not isinstance(items, list)
            or not all(isinstance(i, list | tuple) and len(i) == 3 for i in items)
        ):
            raise ValueError(
                "state['equal_steps'] must be {'rank': int, 'carried': [[batch, samples, "
                f"bytes], ...]}} (from state_dict()), got {saved!r}"
            )
        if self._lockstep is None or shard is None or shard.rank != rank:
            where = f"rank {shard.rank}" if shard is not None else "no rank"
            distributed_log.info(
                "the state holds %d batches that rank %d carried into its next epoch (equal "
                "steps); this loader (%s%s) does not hand them: load each rank's own state to "
                "keep them",
                len(items),
                rank,
                where,
                "" if self._lockstep is not None else ", no equal steps",
            )
            return None
        return [(batch, int(samples), int(nbytes)) for batch, samples, nbytes in items]

    def _seed_back(self) -> None:
        """A pending state was dropped (refused where it was checked late, or at its load):
        the loader takes back the seed it had before that state's was adopted."""
        own, pending = self._own_seed, self._book.pending
        if own is not None and not pending:
            self._own_seed = None
            if own != self.seed:
                self._adopt_seed(own)

    def _adopt_seed(self, seed: int) -> None:
        """Use ``seed`` from now on (started worker processes go: they have the old one)."""
        self._res.drop_workers_for_seed(self._config, seed)
        self._config = dataclasses.replace(self._config, seed=seed)

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<DataLoader {type(self.dataset).__name__} epoch={s.epoch} "
            f"yielded={s.epoch_batches_yielded}/{self._len_or_q()} in_flight={s.in_flight} "
            f"waiting={s.waiting} prefetch={s.prefetch} shm_slots={s.live_shm_slots} "
            f"workers={self._makers}{' closed' if self._closed else ''}>"
        )

    def _len_or_q(self) -> str:
        try:
            return str(len(self))
        except TypeError:
            return "?"


def _group_may_come() -> bool:
    """Whether a process group may still come: a launcher's WORLD_SIZE > 1 says so, where
    torch.distributed is available (a build without it never makes one)."""
    if os.environ.get("WORLD_SIZE", "1").strip() in ("", "0", "1"):
        return False
    import torch.distributed as dist

    return bool(dist.is_available())


def _collected(resources: Resources, name: str, close_lockstep: Callable[[], None] | None) -> None:
    """The loader was garbage collected unclosed: its lockstep is closed without waiting,
    then its resources are released (warning if it was used)."""
    if close_lockstep is not None:
        close_lockstep()
    finalize(resources, name)


class _Booking:
    """What one epoch tells the loader's resume book (the batches its consumer took, its
    end), passed on only while it is the loader's newest epoch: an older iterator still open
    beside it (``zip(loader, loader)``, an evaluation pass in another task) runs its own full
    epoch, which the state does not describe; booked into the newest, its batches were
    counted as the newest's (samples skipped at a resume, ids twice). Told apart by identity,
    not by epoch number: ``set_epoch`` may give two iterators the same one.

    Holds the loader and its epoch weakly: the epoch lives in the loader's resources, which
    its finalizer holds; a strong reference back would keep an unclosed loader alive forever
    (no warning, no release)."""

    __slots__ = ("_epoch", "_loader")

    def __init__(self, loader: DataLoader) -> None:
        self._loader = weakref.ref(loader)
        self._epoch: weakref.ref[Epoch] | None = None

    @property
    def epoch(self) -> Epoch | None:
        return None if self._epoch is None else self._epoch()

    @epoch.setter
    def epoch(self, epoch: Epoch) -> None:
        self._epoch = weakref.ref(epoch)

    def _book(self) -> EpochBook | None:
        loader = self._loader()
        if loader is None or self._epoch is None:
            return None
        current = loader._res.epoch
        return loader._book if current is not None and current is self._epoch() else None

    def took(self, batch_id: int, position: StreamPosition | None) -> None:
        book = self._book()
        if book is not None:
            book.took(batch_id, position)

    def finished(self) -> None:
        book = self._book()
        if book is not None:
            book.finished()


def _replicas(shard: Shard | None) -> int:
    return 1 if shard is None else shard.replicas
