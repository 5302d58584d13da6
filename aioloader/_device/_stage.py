"""The device stage itself: plan each leaf's route, enqueue copies, complete and hand them over.

:class:`DeviceStage` owns the side stream, the staging pool, the device ring, the completion
thread and the registry of page-locked host ranges. ``start()`` plans each leaf's route (kept,
copied directly from page-locked memory, or staged: :mod:`._plan`), takes a slot of the device
ring (:mod:`._ring`) for the leaves that land in one, enqueues the copies on the side stream,
records an event and gives it to the completion thread (:mod:`._completion`). The stage keeps a
record of each copy (``_CopyRecord``, which implements
:class:`~aioloader._device._transfer.Copy`) and returns a :class:`Transfer` over it; the
transfer awaits the record's completion future, which the loop sets when the completion thread
saw the event complete, then asks the stage to hand the batch over: the consumer's stream
waits on the copy's event (``wait_event``: ordered on the device, no host wait). Only this
module touches a record's fields.

What the consumer's stream may rely on, and when a batch's memory is reused:

- The hand-over orders the consumer's stream after the copy; ``wait()`` returns once the copy
  has completed (the completion thread says so), so the batch is also complete for any other
  stream or for the host.
- Leaves of :data:`~aioloader._device._ring.RING_MIN_LEAF_BYTES` or more copied from
  contiguous host memory land in a slot of the device ring, reused only once nobody references
  the batch any more and the consumer's stream has run past a release event recorded after
  that (the rule is in :mod:`._ring`): no ``record_stream``. They share the slot's storage:
  to keep or ``torch.save`` one leaf on its own, ``clone()`` it. Other leaves, and every leaf
  of a batch that found no free slot, get fresh device tensors with
  ``record_stream(consumer)``, as before; so does a slot's buffer handed over after
  ``close()`` (the ring no longer watches it).
- Copies ahead: the stage enqueues whatever it is given at once; the loader starts
  ``device_prefetch`` batches ahead of the one it hands over, so their copies run on the side
  stream while the consumer's step runs, host syncs (``loss.item()``) included.

Sharp edges:

- A failed ``start()`` retires its staging buffer behind a fresh event on the side stream
  instead of returning it at once: copies already enqueued may still read it.
- Device memory is allocated on the side stream but used on the consumer's stream. Without
  ``record_stream`` the caching allocator could hand a freed batch's block to the next copy
  while the consumer's kernels still read it (the side-stream/free race).
- A batch with :data:`OFF_LOOP_STAGING_BYTES` or more to stage is staged and enqueued on the
  stage's one thread: inline, a 128 MB batch held the loop ~250 ms. While that thread has a
  batch to enqueue, later batches go through it too, so copies are enqueued, and complete, in
  start order. Registered shared memory is not staged at all (the loader registers its slots).
- Every thread of the stage that makes CUDA calls (the completion thread, the staging thread)
  first makes the stage's device its current one: on a fresh thread that is device 0, and a
  stage on another GPU would create a context there.
- :meth:`DeviceStage.host_alloc` falls back to pageable memory, with a warning once per
  stage, when pinned memory cannot be had; such batches are then staged (and counted in
  ``staged_bytes`` and ``pinned_fallbacks``).
- A registered range must be unregistered before it is unmapped; the stage first waits for any
  copy still reading from it.
- ``close()`` blocks until in-flight copies finish (it is cleanup that must run from
  ``finally``); ``await drain()`` first to keep the loop free. It then ends the completion
  thread.
- The stage is not thread-safe: call it from one thread (the event loop's). The completion
  thread only stamps a record and asks the record's loop to complete it; the staging thread
  only fills a record it was given. :meth:`DeviceStage.host_alloc` alone is for any thread.
- A ``TransferError`` from ``start()`` keeps no reference to the host batch (the cause's frames
  are cleared), so the batch's shared-memory slot can be released.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import contextlib
import functools
import math
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from .._errors import DeviceUnavailableWarning, TransferError
from .._log import first_time
from .._validate import is_int
from ._backend import CudaBackend, TorchCudaBackend
from ._completion import Completer
from ._leaves import NUMERIC_KINDS, array_as_tensor_view, empty_like_leaf, map_arrays
from ._parse import falls_back, parse_device
from ._plan import LeafPlan, plan_batch, stage_leaf
from ._ring import RING_MIN_LEAF_BYTES, DeviceRing, Slot
from ._staging import MAX_POOLED_STAGING_BYTES, StagingPool
from ._transfer import CopyState, Transfer, until_copied

__all__ = [
    "OFF_LOOP_STAGING_BYTES",
    "WAKE_SAMPLES",
    "DeviceStage",
    "DeviceStats",
    "DeviceUnavailableWarning",
]

# Smaller batches are staged inline: ~1 ms of the loop at most (on an H100 host, 4 MB inline cost
# 0.2 ms of p99 loop lag and ran 3x faster than through the thread).
OFF_LOOP_STAGING_BYTES = 8 << 20

#: Wake latencies kept for the p50 / p99 in :class:`DeviceStats` (the newest): ten samples
#: beyond the p99, bounded for a run of millions of batches, and sorted in well under a
#: millisecond by each ``statistics()``.
WAKE_SAMPLES = 1024


@dataclass(frozen=True, slots=True)
class DeviceStats:
    """A snapshot of the device stage.

    Attributes:
        batches_copied: batches whose copy completed.
        bytes_copied: bytes of those batches moved to the device (or into pinned memory).
        copy_seconds: device time of those copies (CUDA event elapsed time; wall time where
            events cannot time).
        in_flight: transfers started whose copy has not completed yet (copies in flight).
        staging_buffers: pinned staging buffers the stage owns (pooled and leased).
        pinned_bytes: bytes of those staging buffers.
        registered_bytes: bytes of host memory registered as page-locked by this stage.
        staged_bytes: host bytes copied on the way to the device, by the host: the memcpy of
            pageable leaves into staging (and, with only ``pin_memory``, into pinned memory).
            0 for batches in registered shared memory or collated into pinned memory.
        wait_seconds: time ``wait()`` calls were suspended for copies not complete yet (the
            consumer waiting on a copy); ``drain()`` does not count.
        waits: ``wait()`` calls that were suspended.
        handoff_p50_s: median hand-off latency: from the completion thread seeing a copy's
            event complete (``cudaEventSynchronize`` returned) to the awaiting task resuming;
            0.0 before any. The time from the event completing on the device to that return
            is not in it (``benchmarks/gpu_transfer.py`` measures the wake latency end to end).
        handoff_p99_s: its 99th percentile (over the newest :data:`WAKE_SAMPLES`).
        handoffs: waits woken by the completion thread.
        ring_slots: device buffers of the ring (:mod:`aioloader._device._ring`).
        ring_bytes: their bytes.
        ring_fallbacks: batches that got fresh device tensors because no slot was free.
        pinned_fallbacks: :meth:`DeviceStage.host_alloc` calls that got pageable memory
            because pinned memory could not be had.
    """

    batches_copied: int
    bytes_copied: int
    copy_seconds: float
    in_flight: int
    staging_buffers: int
    pinned_bytes: int
    registered_bytes: int
    staged_bytes: int = 0
    wait_seconds: float = 0.0
    waits: int = 0
    handoff_p50_s: float = 0.0
    handoff_p99_s: float = 0.0
    handoffs: int = 0
    ring_slots: int = 0
    ring_bytes: int = 0
    ring_fallbacks: int = 0
    pinned_fallbacks: int = 0

    @property
    def staged_bytes_per_batch(self) -> float:
        """Host bytes copied per batch on the way to the device (see ``staged_bytes``)."""
        return self.staged_bytes / self.batches_copied if self.batches_copied else 0.0


@dataclass(eq=False, slots=True, weakref_slot=True)
class _CopyRecord:
    """The stage's record of one batch's copy: what its :class:`Transfer` waits on.

    Implements :class:`~aioloader._device._transfer.Copy`; only this module reads or writes
    its fields. Invariant: ``lease`` and ``sources`` are held only while ``state`` is
    ``"pending"``; a failed copy holds no result and no device tensors.
    """

    stage: DeviceStage
    batch_id: int
    state: CopyState = "pending"
    result: Any = None
    error: TransferError | None = None
    # Device tensors of the result outside the ring: record_stream(consumer) at hand-over.
    device_tensors: list[torch.Tensor] = field(default_factory=list)
    # The ring slot the ring-placed leaves are views of (None: every leaf is its own tensor).
    slot: Slot | None = None
    # Host bytes memcpy'd into staging for this copy.
    staged: int = 0
    # The loop that started it, and its future set once the copy completed or failed.
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future[None] | None = None
    # When the completion thread saw the end event complete (perf_counter), if it did.
    completed_at: float | None = None
    # Host tensors copied from directly: kept alive until the copy has completed.
    sources: list[torch.Tensor] = field(default_factory=list)
    # Bases of registered ranges this copy reads from.
    ranges: set[int] = field(default_factory=set)
    lease: torch.Tensor | None = None
    start_event: Any = None
    end_event: Any = None
    nbytes: int = 0
    started_at: float = field(default_factory=time.perf_counter)
    # The stage thread's job while it stages and enqueues this copy (None once collected).
    fill: concurrent.futures.Future[Any] | None = None
    # Whether any copy was enqueued: after a failure, then, the lease may still be read.
    enqueued: bool = False

    def done(self) -> bool:
        """Whether the copy has completed (or failed); polls its event, never blocks."""
        if self.state == "pending":
            self.stage._poll(self)
        return self.state != "pending"

    def host_work(self) -> concurrent.futures.Future[Any] | None:
        return self.fill  # the stage thread's job for this copy while it runs (see the protocol)

    def completion(self) -> asyncio.Future[None] | None:
        """The completion future, if the copy reports completion to the running loop."""
        if self.future is None:
            return None
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return None
        return self.future if running is self.loop else None

    def waited(self, seconds: float, *, woken: bool) -> None:
        self.stage._waited(self, seconds, woken)

    def hand_over(self, stream: Any) -> Any:
        """The device batch, once ``stream`` is ordered after the copy (see the protocol)."""
        if self.error is not None:
            raise self.error
        self.stage._hand_over(self, stream)
        return self.result


class DeviceStage:
    """Copies batches to one CUDA device from pinned memory on a side stream.

    With ``device=None`` and ``pin_memory=True`` it only pins (the batch comes back in page-locked
    host memory, ready for the user's own non-blocking copies). Without CUDA, a requested CUDA
    device raises here (torch's ``.to("cuda")`` raises too: a model on the GPU would fail later,
    far from the cause), unless it is ``"auto"``, the explicit fallback: then batches pass
    through unchanged, quietly. ``pin_memory=True`` without CUDA warns
    :class:`DeviceUnavailableWarning` once per process (as torch warns) and batches pass
    through. :attr:`enabled` then says there is nothing to do.

    Args:
        device: the target device (anything :func:`parse_device` accepts); ``None`` or cpu
            for none; ``"auto"`` for CUDA where it is available, else none.
        pin_memory: with no device, return batches in pinned host memory. With a CUDA device
            copies always go through pinned memory and the flag changes nothing.
        backend: the CUDA operations to use; by default ``torch.cuda``.
        ring_min_leaf_bytes: leaves of at least this many bytes land in a slot of the device
            ring; smaller ones get device tensors of their own.

    Raises:
        ValueError: the device index does not exist, or ``ring_min_leaf_bytes`` is negative.
        RuntimeError: a CUDA device was asked for (not ``"auto"``) and CUDA is not available.
        TypeError: ``pin_memory`` is not a bool.
    """

    #: Makes the backend of a stage made without one: the seam through which a loader's stage
    #: can be given a fake CUDA (tests replace it; everything else leaves it alone).
    default_backend: ClassVar[type[CudaBackend]] = TorchCudaBackend

    def __init__(
        self,
        device: torch.device | str | int | None,
        *,
        pin_memory: bool = False,
        backend: CudaBackend | None = None,
        ring_min_leaf_bytes: int = RING_MIN_LEAF_BYTES,
    ) -> None:
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory={pin_memory!r} must be a bool")
        if not is_int(ring_min_leaf_bytes) or ring_min_leaf_bytes < 0:
            raise ValueError(
                f"ring_min_leaf_bytes={ring_min_leaf_bytes!r} must be a non-negative int"
            )
        self._ring_min = int(ring_min_leaf_bytes)
        target = parse_device(device)
        self._backend: CudaBackend = backend if backend is not None else self.default_backend()
        self._cuda = self._backend.is_available()
        self._closed = False
        self._device: torch.device | None = None
        self._pin_only = False
        self._side_stream: Any = None
        if not self._cuda:
            if target is not None and not falls_back(device):
                raise RuntimeError(_no_cuda_message(target))
            if pin_memory and first_time(("pin_memory without CUDA", DeviceUnavailableWarning)):
                warnings.warn(
                    "pin_memory=True was requested but CUDA is not available: batches stay on "
                    "the CPU, unpinned (said once per process)",
                    DeviceUnavailableWarning,
                    stacklevel=2,
                )
            target = None
        elif target is not None:
            index = target.index if target.index is not None else self._backend.current_device()
            count = self._backend.device_count()
            if index >= count:
                raise ValueError(
                    f"device={str(target)!r} does not exist: this machine has {count} CUDA "
                    f"device{'s' if count != 1 else ''}"
                )
            self._device = torch.device("cuda", index)
            self._side_stream = self._backend.new_stream(self._device)
        elif pin_memory:
            self._pin_only = True
        self._pool = StagingPool(self._backend.alloc_pinned, MAX_POOLED_STAGING_BYTES)
        # Copies not completed yet, in start order (= completion order: one stream runs them
        # in order). Insertion-ordered dict as an ordered set.
        self._in_flight: dict[int, _CopyRecord] = {}
        # Staging buffers of failed starts, free once their event has completed.
        self._retiring: list[tuple[Any, torch.Tensor | None, set[int]]] = []
        # Registered page-locked host ranges: base pointer -> size, plus sorted bases.
        self._registered: dict[int, int] = {}
        self._bases: list[int] = []
        self._batches = 0
        self._bytes = 0
        self._seconds = 0.0
        self._staged = 0
        self._wait_s = 0.0
        self._waits = 0
        self._handoffs = 0
        self._pinned_fallbacks = 0
        self._pinned_warned = False
        self._alloc_lock = threading.Lock()  # host_alloc runs on any thread
        self._handoff_samples: collections.deque[float] = collections.deque(maxlen=WAKE_SAMPLES)
        # Stages and enqueues large pageable batches off the caller's thread (made on first use).
        self._stager: concurrent.futures.ThreadPoolExecutor | None = None
        # The stager's newest job: while it runs, later batches queue behind it (start order).
        # Dropped once collected, as record.fill is.
        self._last_fill: concurrent.futures.Future[Any] | None = None
        # Reports completed copies to the loop (no polling); None where events can only be
        # polled. Events are recorded and pushed to it under one lock: in stream order.
        self._completer: Completer | None = None
        self._order = threading.Lock()
        self._ring: DeviceRing | None = None
        if self._device is not None:
            waiter = self._backend.event_waiter()
            if waiter is not None:
                self._completer = Completer(waiter, prepare=self._enter_device())
                # A stage collected unclosed ends its thread too (closing waits for it).
                weakref.finalize(self, self._completer.stop)
            device = self._device
            self._ring = DeviceRing(
                lambda n: self._backend.empty_device(n, device), self._backend.storage_users
            )

    @property
    def enabled(self) -> bool:
        """Whether the stage does anything; when False the loader can skip it entirely."""
        return self._device is not None or self._pin_only

    @property
    def device(self) -> torch.device | None:
        """The resolved target device (with its index), or None."""
        return self._device

    @property
    def pins_collation(self) -> bool:
        """Whether batches made in this process should be collated into :meth:`host_alloc`
        memory: the stage copies to a CUDA device, and pinned memory spares it the staging
        memcpy."""
        return self._device is not None and not self._closed

    def host_alloc(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        """A writable C-contiguous array of ``shape`` and ``dtype`` in page-locked memory.

        The ``alloc`` a collate function writes a batch into when it is made in this process
        (``num_workers=0``, ``thread_pool=True``): the stage then copies its leaves to the
        device directly, with no staging memcpy. Safe from any thread. The memory comes from
        torch's caching host allocator and goes back to it once the array (and every view of
        it) is collected; the stage keeps a copy's source alive until the copy completed.

        Where pinned memory cannot be had (the allocation fails: page-locked memory is
        exhausted or capped), the array is ordinary pageable memory instead, which the stage
        then stages like any pageable batch (counted in ``staged_bytes`` and
        ``pinned_fallbacks``); the first such fallback of a stage warns.
        """
        nbytes = math.prod(shape) * dtype.itemsize
        try:
            buffer = self._backend.alloc_pinned(max(nbytes, 1))
        except (RuntimeError, MemoryError) as exc:  # a failed cudaHostAlloc, as torch raises it
            with self._alloc_lock:
                self._pinned_fallbacks += 1
                warn = not self._pinned_warned
                self._pinned_warned = True
            if warn:
                warnings.warn(
                    f"pinned memory for a batch of {nbytes} bytes could not be allocated "
                    f"({exc}); batches are collated into pageable memory and staged instead "
                    "(slower; said once per loader). Free page-locked memory or raise the "
                    "memlock limit (ulimit -l)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return np.empty(shape, dtype=dtype)
        # numpy keeps the tensor as the array's base: the memory lives as long as any view.
        return buffer.numpy()[:nbytes].view(dtype).reshape(shape)

    def start(self, batch: Any, batch_id: int) -> Transfer:
        """Enqueue the copies of ``batch`` and return its :class:`Transfer`.

        Never waits for the device; the host-side memcpy into staging happens here.

        Raises:
            TransferError: pinning or copying failed; names the batch id and keeps the cause.
                No reference to ``batch`` survives in the error, so its shared-memory slot can
                be released.
            RuntimeError: the stage is closed.
        """
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        record = _CopyRecord(self, batch_id)
        transfer = Transfer(batch_id, record)
        if not self.enabled:
            record.result = batch
            record.state = "copied"
            return transfer
        self._reap()
        if self._completer is not None:
            with contextlib.suppress(RuntimeError):  # no loop: done() is polled instead
                record.loop = asyncio.get_running_loop()
                record.future = record.loop.create_future()
        try:
            if self._pin_only:
                self._pin(record, batch)
            else:
                self._copy(record, batch)
        except Exception as exc:
            del batch
            # The cause's traceback holds the frames that walked the batch; clear their locals
            # so the error does not keep the host batch (and its slot) alive.
            traceback.clear_frames(exc.__traceback__)
            where = f"to {self._device}" if self._device is not None else "into pinned memory"
            raise TransferError(f"batch {batch_id}: copying {where} failed: {exc!r}") from exc
        return transfer

    async def drain(self) -> None:
        """Await every copy in flight without blocking the loop (results stay with transfers).

        Not a consumer's wait: it adds nothing to ``wait_seconds`` or the hand-off samples.
        """
        for record in list(self._in_flight.values()):
            await until_copied(record, counted=False)
        self._reap()

    def register_host_memory(self, ptr: int, nbytes: int) -> bool:
        """Page-lock ``nbytes`` of host memory at ``ptr`` so batches there are copied directly.

        Best effort: returns False where CUDA is unavailable or registration fails, and the
        memory is then copied through staging. Registering a base already registered by this
        stage with the same size returns True.

        Raises:
            ValueError: ``ptr`` or ``nbytes`` is negative or not an int.
        """
        if not is_int(ptr) or ptr < 0:
            raise ValueError(f"ptr={ptr!r} must be a non-negative int address")
        if not is_int(nbytes) or nbytes < 0:
            raise ValueError(f"nbytes={nbytes!r} must be a non-negative int")
        ptr, nbytes = int(ptr), int(nbytes)
        if not self._cuda or self._closed or nbytes == 0 or not self.enabled:
            return False
        if ptr in self._registered:
            return self._registered[ptr] == nbytes
        device = self._device if self._device is not None else torch.device("cuda")
        try:
            ok = self._backend.host_register(ptr, nbytes, device)
        except Exception:
            return False
        if ok:
            self._registered[ptr] = nbytes
            bisect.insort(self._bases, ptr)
        return ok

    def unregister_host_memory(self, ptr: int) -> None:
        """Undo :meth:`register_host_memory`; waits first for copies still reading the range.

        Unknown pointers are ignored, so the loader may call it for every slot it destroys.
        """
        if ptr not in self._registered:
            return
        for record in list(self._in_flight.values()):
            if ptr in record.ranges:
                self._settle(record)
        for entry in list(self._retiring):
            if ptr in entry[2]:
                with contextlib.suppress(Exception):
                    self._synchronize(entry[0])
                self._retiring.remove(entry)
                if entry[1] is not None:
                    self._pool.release(entry[1])
        del self._registered[ptr]
        self._bases.remove(ptr)
        with contextlib.suppress(Exception):
            self._backend.host_unregister(ptr)

    def close(self) -> None:
        """Wait for copies in flight, free the staging buffers, unregister host memory.

        Transfers started before ``close()`` still return their batch from ``wait()``.
        Idempotent; blocks while copies finish (``await drain()`` first to avoid that).
        """
        if self._closed:
            return
        self._closed = True
        for record in list(self._in_flight.values()):
            self._settle(record)
        for event, _buf, _ranges in self._retiring:
            with contextlib.suppress(Exception):
                self._synchronize(event)
        self._retiring.clear()
        if self._completer is not None:
            self._completer.close()  # every copy it waits for is complete by now
        if self._ring is not None:
            self._ring.close(self._backend.record_stream)
        self._pool.clear()
        for ptr in list(self._registered):
            with contextlib.suppress(Exception):
                self._backend.host_unregister(ptr)
        self._registered.clear()
        self._bases.clear()
        if self._stager is not None:
            self._stager.shutdown(wait=True)

    def stats(self) -> DeviceStats:
        """A snapshot of counters and pool sizes."""
        samples = sorted(self._handoff_samples)
        ring = self._ring
        return DeviceStats(
            batches_copied=self._batches,
            bytes_copied=self._bytes,
            copy_seconds=self._seconds,
            in_flight=len(self._in_flight),
            staging_buffers=self._pool.buffers,
            pinned_bytes=self._pool.nbytes,
            registered_bytes=sum(self._registered.values()),
            staged_bytes=self._staged,
            wait_seconds=self._wait_s,
            waits=self._waits,
            handoff_p50_s=_percentile(samples, 0.5),
            handoff_p99_s=_percentile(samples, 0.99),
            handoffs=self._handoffs,
            ring_slots=ring.slots if ring is not None else 0,
            ring_bytes=ring.nbytes if ring is not None else 0,
            ring_fallbacks=ring.fallbacks if ring is not None else 0,
            pinned_fallbacks=self._pinned_fallbacks,
        )

    def __repr__(self) -> str:
        s = self.stats()
        target = (
            str(self._device) if self._device is not None else ("pin" if self._pin_only else "off")
        )
        state = "closed" if self._closed else "open"
        return (
            f"<DeviceStage {target} {state}: {s.batches_copied} batches, in flight {s.in_flight}, "
            f"staging {s.staging_buffers} ({s.pinned_bytes} B)>"
        )

    # -- internals -----------------------------------------------------------------------------

    def _registered_base(self, ptr: int, nbytes: int) -> int | None:
        i = bisect.bisect_right(self._bases, ptr) - 1
        if i < 0:
            return None
        base = self._bases[i]
        return base if ptr + nbytes <= base + self._registered[base] else None

    def _copy(self, record: _CopyRecord, batch: Any) -> None:
        device = self._device
        assert device is not None
        plans, total, device_total = plan_batch(
            batch, device, self._registered_base, self._backend.is_pinned, self._ring_min
        )
        if self._ring is not None and device_total:
            # Allocated on the side stream, which writes it: should the ring ever drop it, the
            # caching allocator reuses the block in that stream's order.
            with self._backend.use_stream(self._side_stream):
                record.slot = self._ring.take(device_total)
        lease = None
        try:
            lease = self._pool.acquire(total) if total else None
            record.start_event = self._backend.new_event()
            record.end_event = self._backend.new_event()
        except BaseException:
            self._undo_start(record, lease)  # nothing enqueued: both go back at once
            raise
        behind = self._last_fill is not None and not self._last_fill.done()
        if total >= OFF_LOOP_STAGING_BYTES or behind:
            # Behind a batch the thread still enqueues: through the thread too, in start order
            # (a job that is done has recorded its events, so an inline enqueue follows them).
            if self._stager is None:
                self._stager = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1,
                    thread_name_prefix="aioloader-stage",
                    initializer=self._enter_device(),
                )
            record.lease = lease
            # The job holds its record weakly and leaves the result in it: the thread's work
            # item outlives the job by a moment, and through a strong reference (or the
            # future's result) it would keep a batch the user let go, and so its ring slot.
            record.fill = self._last_fill = self._stager.submit(
                _enqueue_into, weakref.ref(record), self._enqueue, batch, plans, lease
            )
            self._in_flight[id(record)] = record
            return
        try:
            result = self._enqueue(record, batch, plans, lease)
        except BaseException:
            self._undo_start(record, lease)
            raise
        record.result = result
        record.lease = lease
        self._in_flight[id(record)] = record

    def _enqueue(
        self, record: _CopyRecord, batch: Any, plans: list[LeafPlan], lease: torch.Tensor | None
    ) -> Any:
        """Stage the pageable leaves, enqueue every copy on the side stream; return the result.

        Runs on the caller's thread or the stage's thread: it touches only ``record`` (its
        tensors, ranges and events), the backend and the completion thread's queue, never the
        stage's own bookkeeping.
        """
        device, backend = self._device, self._backend
        assert device is not None
        slot = record.slot
        try:
            with backend.use_stream(self._side_stream):
                backend.record_event(record.start_event, self._side_stream)
                plan_iter = iter(plans)

                def move(leaf: Any) -> Any:
                    plan = next(plan_iter)
                    if plan.kind == "keep":
                        return leaf
                    if plan.kind == "direct":
                        src: torch.Tensor = plan.leaf
                        record.sources.append(src)
                        if plan.range_base is not None:
                            record.ranges.add(plan.range_base)
                    elif plan.nbytes == 0:
                        src = empty_like_leaf(plan.leaf)  # nothing to stage or to wait for
                    else:
                        assert lease is not None
                        src = stage_leaf(lease, plan)
                        record.staged += plan.nbytes
                    record.enqueued = True
                    record.nbytes += plan.nbytes
                    if slot is not None and plan.device_offset is not None:
                        out = slot.view(plan.device_offset, src)
                        backend.copy_into(out, src)
                        return out
                    out = backend.to_device(src, device)
                    record.device_tensors.append(out)
                    return out

                with torch.no_grad():
                    result = map_arrays(batch, move)
                with self._order:  # the completion thread's queue in the stream's order
                    backend.record_event(record.end_event, self._side_stream)
                    completer = self._completer
                    if completer is not None and record.loop is not None:
                        # A weak reference, as in _notify: a pending record is the stage's.
                        notify = functools.partial(self._notify, weakref.ref(record))
                        if not completer.push(record.end_event, notify):
                            record.future = None  # the thread was stopped: done() is polled
        except BaseException:
            # Closures of this walk outlive their frames in the traceback (a frame keeps its
            # function, a function its cells): empty the plan so no host leaf stays reachable.
            plans.clear()
            record.sources.clear()
            record.device_tensors.clear()
            raise
        return result

    def _undo_start(self, record: _CopyRecord, lease: torch.Tensor | None) -> None:
        """After staging or enqueueing failed: give the lease back once nothing reads it."""
        record.lease = None
        self._drop_slot(record)
        if record.enqueued:
            self._retire(lease, record.ranges)
        elif lease is not None:
            self._pool.release(lease)  # nothing was enqueued: nobody reads it

    def _collect_fill(self, record: _CopyRecord, *, block: bool) -> bool:
        """Take in the stage thread's job of ``record``; False while it still runs."""
        fill = record.fill
        if fill is None:
            return True
        if not block and not fill.done():
            return False
        record.fill = None
        if self._last_fill is fill:
            self._last_fill = None  # its result is the batch: holding it would hold its slot
        try:
            fill.result()  # the job left the batch in record.result (see _enqueue_into)
        except BaseException as exc:
            lease = record.lease
            self._undo_start(record, lease)
            traceback.clear_frames(exc.__traceback__)
            error = TransferError(
                f"batch {record.batch_id}: copying to {self._device} failed: {exc!r}"
            )
            error.__cause__ = exc
            record.error = error
            record.result = None
            record.state = "failed"
            self._in_flight.pop(id(record), None)
            _wake(record)
        return True

    def _pin(self, record: _CopyRecord, batch: Any) -> None:
        backend = self._backend
        nbytes = 0

        def pin(leaf: Any) -> Any:
            nonlocal nbytes
            if isinstance(leaf, np.ndarray):
                if leaf.dtype.kind not in NUMERIC_KINDS:
                    return leaf
                view = array_as_tensor_view(leaf)
                if view is None:
                    # Arrays torch cannot view (read-only, byte-swapped, strided): copy once.
                    native = leaf.dtype.newbyteorder("=")
                    view = torch.from_numpy(np.array(leaf, dtype=native, order="C", copy=True))
                tensor = view
            else:
                tensor = leaf.detach()
                if tensor.device.type != "cpu" or tensor.layout != torch.strided:
                    return leaf
            size = tensor.numel() * tensor.element_size()
            if (
                size
                and tensor.is_contiguous()
                and self._registered_base(tensor.data_ptr(), size) is not None
            ):
                return tensor
            nbytes += size
            return backend.pin(tensor)

        started = time.perf_counter()
        with torch.no_grad():
            record.result = map_arrays(batch, pin)
        record.state = "copied"
        self._batches += 1
        self._bytes += nbytes
        self._staged += nbytes
        self._seconds += time.perf_counter() - started

    def _retire(self, lease: torch.Tensor | None, ranges: set[int]) -> None:
        """After a failed start: free ``lease`` only once copies already enqueued are done."""
        try:
            event = self._backend.new_event()
            self._backend.record_event(event, self._side_stream)
        except Exception:
            # The device is unusable; never reuse a buffer it might still read.
            if lease is not None:
                self._pool.discard(lease)
            return
        self._retiring.append((event, lease, set(ranges)))

    def _reap(self) -> None:
        """Complete finished copies, free retired buffers, move let-go ring slots on."""
        for record in list(self._in_flight.values()):
            if not record.done():
                break
        if self._ring is not None:
            self._ring.reap(self._mark, self._query)
        while self._retiring:
            event, lease, _ranges = self._retiring[0]
            try:
                ready = self._query(event)
            except Exception:
                ready = True
                lease_ok = False
            else:
                lease_ok = True
            if not ready:
                break
            self._retiring.pop(0)
            if lease is not None:
                if lease_ok:
                    self._pool.release(lease)
                else:
                    self._pool.discard(lease)

    def _query(self, event: Any) -> bool:
        """Whether ``event`` completed; asked with the stage's device current on this thread
        (the loop's, or the loader's loop thread: a fresh thread's device is 0)."""
        with self._on_device():
            return self._backend.query_event(event)

    def _synchronize(self, event: Any) -> None:
        """Block until ``event`` completed, with the stage's device current on this thread."""
        with self._on_device():
            self._backend.synchronize_event(event)

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        if self._device is None:
            return contextlib.nullcontext()
        return self._backend.on_device(self._device)

    def _poll(self, record: _CopyRecord) -> None:
        if not self._collect_fill(record, block=False) or record.state != "pending":
            return
        try:
            ready = self._query(record.end_event)
        except Exception as exc:
            self._fail(record, exc)
            return
        if ready:
            self._finish(record)

    def _settle(self, record: _CopyRecord) -> None:
        """Block until ``record``'s copy is done (cleanup paths only)."""
        self._collect_fill(record, block=True)
        if record.state != "pending":
            return
        try:
            self._synchronize(record.end_event)
        except Exception as exc:
            self._fail(record, exc)
            return
        self._finish(record)

    def _finish(self, record: _CopyRecord) -> None:
        try:
            seconds = self._backend.elapsed_seconds(record.start_event, record.end_event)
        except Exception:
            seconds = time.perf_counter() - record.started_at
        if record.lease is not None:
            self._pool.release(record.lease)
        record.lease = None
        record.sources.clear()
        record.state = "copied"
        if record.slot is not None and self._ring is not None:
            self._ring.copied(record.slot)
        self._in_flight.pop(id(record), None)
        self._batches += 1
        self._bytes += record.nbytes
        self._staged += record.staged
        self._seconds += seconds
        _wake(record)

    def _fail(self, record: _CopyRecord, exc: Exception) -> None:
        error = TransferError(
            f"batch {record.batch_id}: the copy to {self._device} failed on the device: {exc!r}"
        )
        error.__cause__ = exc
        record.error = error
        if record.lease is not None:
            self._pool.discard(record.lease)
        record.lease = None
        record.sources.clear()
        record.device_tensors.clear()
        self._drop_slot(record)
        record.result = None
        record.state = "failed"
        self._in_flight.pop(id(record), None)
        _wake(record)

    def _drop_slot(self, record: _CopyRecord) -> None:
        """A failed copy's ring slot is never reused (the device may still write it)."""
        if record.slot is not None and self._ring is not None:
            self._ring.discard(record.slot)
        record.slot = None

    def _enter_device(self) -> Callable[[], None]:
        """What a thread of the stage calls before its first CUDA call: makes the stage's
        device the thread's current one (a fresh thread's is device 0). It holds the backend
        and the device, not the stage: a stage collected unclosed ends its threads."""
        assert self._device is not None
        return functools.partial(self._backend.set_thread_device, self._device)

    def _mark(self, stream: Any) -> Any:
        """A new event recorded on ``stream`` now (a ring slot's release event)."""
        event = self._backend.new_event()
        self._backend.record_event(event, stream)
        return event

    def _notify(
        self, ref: weakref.ref[_CopyRecord], at: float, error: BaseException | None
    ) -> None:
        """On the completion thread: the end event of a record completed (or waiting failed).
        Stamps the record and asks its loop to complete it; nothing else. A record already
        completed (polled) and let go is gone: nothing to do."""
        record = ref()
        if record is None:
            return
        record.completed_at = at
        loop = record.loop
        # Let go of it before handing over: the loop may complete the copy, wake its task and
        # the user drop the batch while this thread is still here (descheduled under load), and
        # a strong reference held meanwhile kept the batch's ring slot from reuse.
        del record
        if loop is not None:
            # A weak reference: a copy completed meanwhile (polled) and let go must not have
            # its batch, and so its ring slot, held by this callback until the loop runs it.
            with contextlib.suppress(RuntimeError):  # the loop is closed: close() settles it
                loop.call_soon_threadsafe(self._completed_weak, ref, error)

    def _completed_weak(self, ref: weakref.ref[_CopyRecord], error: BaseException | None) -> None:
        record = ref()
        if record is not None:
            self._completed(record, error)

    def _completed(self, record: _CopyRecord, error: BaseException | None) -> None:
        """On the record's loop: complete the copy the completion thread saw complete."""
        if record.state == "pending":
            fill = record.fill
            if fill is not None and not fill.done():
                # The staging thread pushed the event before its job's future was done: come
                # back once it is (the thread is returning). Weakly: the future keeps its
                # callbacks, and the thread's work item (alive a moment longer) the future,
                # so a strong reference here would keep a let-go batch and its ring slot.
                loop = record.loop
                assert loop is not None
                ref = weakref.ref(record)

                def again(_: concurrent.futures.Future[Any]) -> None:
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(self._completed_weak, ref, error)

                fill.add_done_callback(again)
                return
            self._collect_fill(record, block=False)
        if record.state == "pending":
            if isinstance(error, Exception):
                self._fail(record, error)
            else:
                self._finish(record)
        _wake(record)

    def _waited(self, record: _CopyRecord, seconds: float, woken: bool) -> None:
        """Statistics of a suspended ``wait()``; ``woken``: now is when the task resumed."""
        self._wait_s += seconds
        self._waits += 1
        if woken and record.completed_at is not None:
            self._handoffs += 1
            self._handoff_samples.append(max(time.perf_counter() - record.completed_at, 0.0))
            record.completed_at = None  # one sample per completion

    def _hand_over(self, record: _CopyRecord, stream: Any) -> None:
        """Order the consumer's stream after the copy and tell the allocator who uses the data."""
        if self._device is None or (not record.device_tensors and record.slot is None):
            return
        try:
            consumer = stream if stream is not None else self._backend.current_stream(self._device)
            self._backend.wait_event(consumer, record.end_event)
            for tensor in record.device_tensors:
                self._backend.record_stream(tensor, consumer)
            slot = record.slot
            if slot is not None:
                if slot.owned and self._ring is not None:
                    self._ring.handed(slot, consumer)
                else:
                    # The ring forgot the slot (closed): nobody records a release event for
                    # it, so the allocator must wait for the consumer's work before reuse.
                    self._backend.record_stream(slot.buffer, consumer)
        except Exception as exc:
            raise TransferError(
                f"batch {record.batch_id}: handing the batch over to the consumer's stream "
                f"failed: {exc!r}"
            ) from exc


def _enqueue_into(
    ref: weakref.ref[_CopyRecord],
    enqueue: Callable[[_CopyRecord, Any, list[LeafPlan], torch.Tensor | None], Any],
    batch: Any,
    plans: list[LeafPlan],
    lease: torch.Tensor | None,
) -> None:
    """The stage thread's job: enqueue ``batch``'s copies and leave the result in its record
    (alive while in flight: the stage holds it)."""
    record = ref()
    if record is not None:
        record.result = enqueue(record, batch, plans, lease)


def _wake(record: _CopyRecord) -> None:
    """Set ``record``'s completion future, on its loop (from any thread)."""
    future, loop = record.future, record.loop
    if future is None or loop is None or future.done():
        return
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        _resolve(future)
    else:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits it
            loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted samples (nearest rank); 0.0 for none."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _no_cuda_message(target: torch.device) -> str:
    """What was asked, what is there, and the fixes, for a CUDA device on a machine without."""
    built = torch.version.cuda
    there = (
        f"this torch {torch.__version__} was built without CUDA"
        if built is None
        else f"this torch {torch.__version__} (CUDA {built}) sees no GPU"
    )
    return (
        f"device={str(target)!r} was asked for, but CUDA is not available: {there}. "
        "Run where a GPU is visible, pass device=None to keep batches on the CPU, or "
        "device='auto' to use CUDA where it is available and the CPU otherwise"
    )
