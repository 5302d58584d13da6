"""Worker processes: the only package that creates processes.

One module a job, by seam: what both sides share, what packs and moves it, the worker's side,
then the main side that starts workers, sees them die and routes their jobs::

    shared    _records   the records that travel between the main process and a worker:
                         frame kinds, the jobs, the parcel a batch comes back in, a dataset
                         copy's Payload; the cells a worker publishes its job's tag in
              _cpython   CPython's private multiprocessing and import internals, one function
                         per need, each with its fallback
              _info      what a worker knows (get_worker_info, torch's too) and its seeds
              _mapped    arrays and tensors of memory-mapped files: sent as file regions
    packing   _frames    frames built and taken apart: results and errors packed
              _payload   how the dataset copy travels: pickle, with __main__'s classes by value
              _wire      a batch's way back: the one place that decides shared memory or
                         inline, on both sides
              _raw       the samples the loop fetched, to the worker through the job's slot
              _copy      the dataset copy the workers load: pickled once, in a thread
    moving    _channel   the pipes a job and its reply travel over, watched by the event loop
    starting  _zygote    the forkserver forked from this process; when a fork is safe
              _context   which start method: the forked server by default, 'fork' made safe;
                         workers never run the user's __main__ again
    worker    _worker    everything that runs inside a worker: initializer, loading a dataset
                         copy, the map and stream jobs, stream sharding, the watchdog
    main      _starting  workers that hang while they start: the start deadline, their stacks
              _death     a worker's death: how it is seen, what its error says, what happens
                         to its jobs
              _launch    starting the workers' processes, on threads (never the event loop's)
              _pool      WorkerPool: a process and two pipes per worker; routing, rebuilds
              _runner    ProcessRunner: the epoch's Runner over the pool

One map-style batch on its way (a stream's batch goes the same way, as ``pull`` →
``StreamJob`` → ``run_stream_job``, always to the stream's own worker)::

    main process                                              worker process (least loaded)
    ────────────                                              ─────────────────────────────
    epoch ── BatchRequest ──▶ _runner.ProcessRunner.start_make
      _wire.Receiver.lease() ──▶ a slot, or None (inline)
      _records.MapJob(request, slot)
      _pool.WorkerPool.submit(run_map_job, job)
        first job of an epoch that renews the copy:
        _records.LoadJob(_payload.dumps_copy(...)) ─── pipe ─────▶ _worker.load_copy: the
                                                                  dataset copy, seeds,
                                                                  worker_init_fn
      _channel.Channel.send ──── pipe: pickle((fn, job)) ────▶ _channel.serve_over
                                                              _worker.run_map_job(job)
                                                                BatchMaker.make(request,
                                                                    _wire.Packer(slot).alloc)
                                                                Packer.pack(batch) ─▶ Parcel
      _channel.Channel ◀── pipe: pickle(Made(batch=Parcel)) ──┘
      _wire.Receiver.open(made, slot): views of the slot, or the inline batch
    epoch ◀── Made(batch) ──┘

The record that comes back is :class:`~aioloader._types.Made` from the worker to the epoch;
only its ``batch`` changes, from the :class:`._records.Parcel` to the batch, when it is opened.

Sharp edges (each module's docstring tells its own in full):
- ``fork`` is forked only where no other thread may hold a lock: from the main thread, as an
  epoch begins, with no loader thread running; a worker that must start elsewhere starts from
  the safe start method, with one warning per process (``_context``). ``forkserver`` and
  ``spawn`` re-import ``aioloader`` in a fresh interpreter; the forkserver preloads the
  worker module once; neither runs the user's ``__main__`` again (``_context``), so what lives
  there travels by value (``_payload``).
- The dataset copy is pickled when an epoch starts, off the event loop, once for all
  workers; ``persistent_workers=False`` renews it each epoch in the same processes (``_pool``).
- Workers ignore SIGINT, and a watchdog ends a worker whose main process died, zombies
  included (``_worker``).
- A worker's death is seen twice, as end-of-file on its pipe and as its process sentinel; the
  job it was running gets ``WorkerCrashedError``, jobs only queued behind it go to its
  replacement, and a worker that keeps dying while it starts ends in ``WorkerInitError``
  (``_death``); so does one that hangs while it starts, at the start deadline, with its stack
  (``_starting``).
- A slot goes back to the pool only once no worker can write into it: a cancelled job's slot
  waits for the worker to finish or die (``_channel``, ``_pool``, ``_wire``).
- Pipe ends are bound to one event loop at a time; a loader iterated with ``for`` and later
  with ``async for`` moves them between loops (``_channel``).
- CPU tensors of an inline batch travel as numpy arrays: torch's own pickling would put each
  into a new shared-memory file (``_wire``).
- A CPython release that changes the internals workers are started with breaks ``_cpython``
  alone, whose fallbacks keep the workers starting (the standard forkserver, ``__main__`` run
  again), never an ``AttributeError``.
"""

from __future__ import annotations

from ._context import hold_server as hold_server
from ._context import pickles_main_by_value as pickles_main_by_value
from ._context import resolve_context as resolve_context
from ._context import starts_early as starts_early
from ._frames import picklable as picklable
from ._info import WorkerInfo as WorkerInfo
from ._info import get_worker_info as get_worker_info
from ._info import publish as publish_worker_info
from ._info import seed_everything as seed_everything
from ._info import seed_on_import as seed_on_import
from ._info import seed_worker as seed_worker
from ._info import torch_on_one_thread as torch_on_one_thread
from ._info import unwatch as sharding_seen
from ._info import watch as watch_sharding
from ._info import worker_seed as worker_seed
from ._payload import dumps as dumps_payload
from ._payload import dumps_copy as dumps_copy
from ._payload import loads as loads_payload
from ._payload import preload_pickler as preload_pickler
from ._pool import DEFAULT_START_TIMEOUT_S as DEFAULT_START_TIMEOUT_S
from ._pool import WorkerPool as WorkerPool
from ._pool import starts_through_pythons_forkserver as starts_through_pythons_forkserver
from ._pool import warn_more_workers_than_cpus as warn_more_workers_than_cpus
from ._records import Parcel as Parcel
from ._records import Payload as Payload
from ._runner import ProcessRunner as ProcessRunner
from ._wire import Packer as Packer
from ._wire import Receiver as Receiver
from ._wire import batch_nbytes as batch_nbytes
from ._wire import from_wire as from_wire
from ._wire import sweep_unclaimed as sweep_unclaimed
from ._worker import WorkerCopy as WorkerCopy
from ._worker import read_stream as read_stream
from ._zygote import is_zygote as is_zygote

__all__ = [
    "DEFAULT_START_TIMEOUT_S",
    "Packer",
    "Parcel",
    "Payload",
    "ProcessRunner",
    "Receiver",
    "WorkerCopy",
    "WorkerInfo",
    "WorkerPool",
    "batch_nbytes",
    "dumps_copy",
    "dumps_payload",
    "from_wire",
    "get_worker_info",
    "hold_server",
    "is_zygote",
    "loads_payload",
    "picklable",
    "pickles_main_by_value",
    "preload_pickler",
    "publish_worker_info",
    "read_stream",
    "resolve_context",
    "seed_everything",
    "seed_on_import",
    "seed_worker",
    "sharding_seen",
    "starts_early",
    "starts_through_pythons_forkserver",
    "sweep_unclaimed",
    "torch_on_one_thread",
    "watch_sharding",
    "worker_seed",
]
