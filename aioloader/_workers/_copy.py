"""The dataset copy the worker processes load: pickled once, in a thread, as it is given.

The copy (the batch maker and ``worker_init_fn``, see ``_payload``) is given when an epoch
starts (:meth:`._pool.WorkerPool.load`, so a loader whose epoch never starts pickles nothing)
and pickled from then on (:meth:`DatasetCopy.start`), while the workers start and the first
jobs are queued, rather than when the first worker asks for it. The pickling runs in a thread
of its own, tied to no event loop, so a large dataset never stalls the loop, and every worker
waits on the one result.

A copy whose buffers or stream lie in a shared-memory segment depends on that segment for as
long as a worker may load it (a replacement worker loads it again mid-epoch). If something
removed it behind our back (systemd-logind's ``RemoveIPC``, a script emptying ``/dev/shm``),
the next job pickles the copy afresh (:meth:`DatasetCopy.job`), so a replacement worker
still starts; the vanished segment is forgotten.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable

from .. import _shm
from ._records import LoadJob, Payload

__all__ = ["DatasetCopy"]


class DatasetCopy:
    """One dataset copy for the workers: pickled once, in a thread, when first needed.

    Args:
        make: pickles the copy (``_payload.dumps_copy`` of the batch maker and
            worker_init_fn).
        epoch: the epoch it is made for (the workers' seeds derive from it).
        copy_id: which copy of the workers' it replaces (see :class:`._records.LoadJob`).
        seed: the loader's seed, if not the one the workers started with.
        per_batch_seeds: likewise, ``worker_seeding='batch'``.
    """

    def __init__(
        self,
        make: Callable[[], Payload],
        epoch: int,
        copy_id: int = 0,
        *,
        seed: int | None = None,
        per_batch_seeds: bool | None = None,
    ) -> None:
        self.epoch = epoch
        self.copy_id = copy_id
        self._seeds = (seed, per_batch_seeds)
        self._make: Callable[[], Payload] | None = make
        self._remake = make  # for a copy whose segment vanished
        self._remaking = threading.Lock()  # one re-pickling at a time
        self._lock = threading.Lock()
        self._done: concurrent.futures.Future[Payload] = concurrent.futures.Future()
        self._released = False
        # Per worker slot (its id): the generation of its process known to have loaded this
        # copy (it answered a job after loading it). The pool's loop thread keeps it.
        self._loaded: dict[int, int] = {}

    def loaded_by(self, worker: int, generation: int) -> None:
        """Note that ``worker``'s process of ``generation`` has loaded this copy."""
        self._loaded[worker] = generation

    def was_loaded_by(self, worker: int, generation: int) -> bool:
        """Whether ``worker``'s process of ``generation`` is known to have loaded this copy."""
        return self._loaded.get(worker) == generation

    def start(self) -> None:
        """Start pickling the copy, in its own thread, if nobody did yet."""
        with self._lock:
            make, self._make = self._make, None
        if make is not None:
            # A thread of its own, tied to no event loop: the pickling finishes and keeps its
            # result even if the caller that needs it first is cancelled or its loop closes
            # meanwhile; every caller waits on the one future.
            threading.Thread(
                target=self._run, args=(make,), name="aioloader-pickle", daemon=True
            ).start()

    async def job(self) -> LoadJob:
        """The job that loads this copy (pickled off the loop: see :meth:`start`)."""
        self.start()
        try:
            # Shielded: a waiter cancelled (its epoch closed) must not cancel the one future
            # that every other waiter, of this epoch or the next, waits on too (wrap_future
            # passes a cancellation on to the future it wraps).
            payload = await asyncio.shield(asyncio.wrap_future(self._done))
        except TypeError as exc:
            raise TypeError(str(exc)) from exc
        if payload.segment is not None and not _shm.segment_exists(payload.segment):
            payload = await asyncio.to_thread(self._fresh, payload)
        return LoadJob(payload, self.epoch, self.copy_id, *self._seeds)

    def _fresh(self, vanished: Payload) -> Payload:
        """The copy pickled again in place of ``vanished``, whose segment is gone (once, for
        every job that found it gone). Blocking: call it off the loop."""
        with self._remaking:
            current = self._done.result()
            if current is vanished:
                payload = self._remake()
                with self._lock:
                    released = self._released
                    if not released:
                        self._done = concurrent.futures.Future()
                        self._done.set_result(payload)
                vanished.release()  # tells the resource tracker; the segment is gone
                if released:
                    payload.release()
                current = payload
            return current

    def _run(self, make: Callable[[], Payload]) -> None:
        try:
            payload = make()
        except BaseException as exc:
            self._done.set_exception(exc)
            return
        with self._lock:  # with release(): exactly one of the two unlinks a released copy
            self._done.set_result(payload)
            released = self._released
        if released:  # no worker will load it any more: its segment goes at once
            payload.release()

    def release(self) -> None:
        """No worker will load this copy again: unlink the shared memory of its buffers (now,
        or when its pickling finishes). Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
            made = self._done.done() and self._done.exception() is None
        if made:
            self._done.result().release()
