"""The device stage: copy host batches to a CUDA device without blocking the event loop.

This is the only module that touches CUDA (streams, events, pinned memory, host registration).
One batch flows through it like this::

    host batch (views of a shared-memory slot, or any nested dict/list/tuple of
    │           torch tensors and numpy arrays)
    │  start(batch, batch_id)                 [sync, on the loop thread]
    ▼
    per leaf: already page-locked?  ── yes ──▶ copied from directly (zero extra copies)
    │  no                                      (registered shm slot, or a pinned tensor)
    ▼
    memcpy into a pinned staging buffer (one per batch, leased from a pool)
    ▼
    tensor.to(device, non_blocking=True) on the stage's side stream; then an event
    │  Transfer.wait()                        [async]
    ▼
    poll event.query() with asyncio.sleep backoff (never synchronize() on the loop)
    ▼
    copy complete: staging buffer back to the pool, host references dropped
    ▼
    hand-over: consumer_stream.wait_event(event); tensor.record_stream(consumer_stream)
    ▼
    device batch returned to the consumer

Who owns what: :class:`DeviceStage` owns the side stream, the staging pool and the registry of
page-locked host ranges; each :class:`Transfer` leases one staging buffer and keeps the host
tensors it copies from *directly* alive until its event has completed. Tensors copied through
staging are read synchronously inside ``start()``, so their host batch (and its shared-memory
slot) can be released as soon as ``start()`` returns.

Sharp edges:

- Invariant: a staging buffer is leased by at most one copy in flight. It returns to the pool
  only after the event recorded after its copies completed; a failed ``start()`` retires its
  buffer behind a fresh event on the side stream instead of returning it at once.
- Device memory is allocated on the side stream but used on the consumer's stream. Without
  ``record_stream`` the caching allocator could hand a freed batch's block to the next copy
  while the consumer's kernels still read it (the side-stream/free race).
- The staging memcpy runs on the calling thread, inside ``start()``: for a large pageable batch
  that is a few milliseconds of the loop. Batches in registered shared memory skip it entirely,
  which is why the loader registers its slots with :meth:`DeviceStage.register_host_memory`.
- ``cudaHostRegister`` is best effort: where it fails, the slot is simply copied through
  staging. A registered range must be unregistered before it is unmapped; the stage first
  waits for any copy still reading from it.
- ``close()`` blocks until in-flight copies finish (it is cleanup that must run from
  ``finally``); ``await drain()`` first to keep the loop free.
- The stage is not thread-safe: call it from one thread (the event loop's). The hand-over uses
  the *calling thread's* current stream unless ``wait(stream=...)`` names the consumer's stream.
- Non-numeric numpy arrays (strings, objects, datetimes) and other objects pass through
  unchanged; numeric numpy arrays come back as device tensors (``torch.from_numpy`` semantics).
  Read-only, byte-swapped or non-contiguous leaves are staged even when their memory is
  registered (torch cannot view them without a copy or a warning).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import copy
import ctypes
import functools
import os
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch

from ._errors import TransferError

__all__ = [
    "CudaBackend",
    "DeviceStage",
    "DeviceStats",
    "DeviceUnavailableWarning",
    "TorchCudaBackend",
    "Transfer",
    "parse_device",
]

# Event polling. The first check after a miss only yields (sleep(0)), because small copies are
# often done by the next loop iteration; then the delay doubles from POLL_FIRST_DELAY_S up to
# POLL_MAX_DELAY_S. A lower cap hands batches over sooner but wakes the loop more often; at
# 1 ms a pending copy costs at most ~1000 cheap wake-ups a second and adds at most ~1 ms to a
# hand-over, small against the multi-millisecond copies and steps this stage overlaps.
POLL_FIRST_DELAY_S = 50e-6
POLL_MAX_DELAY_S = 1e-3
POLL_GROWTH = 2.0

# Each leaf starts at a multiple of this many bytes inside a batch's staging buffer: enough for
# any dtype's alignment and for efficient DMA, at a cost of < 512 bytes per leaf.
STAGING_ALIGN = 512
# Staging buffers are allocated in multiples of this, so batches of slightly different size
# (the last batch, variable-length samples) reuse the same buffers; wastes < 1 MiB per buffer.
STAGING_GRANULE = 1 << 20
# Free staging buffers beyond this many bytes are released. Pinned memory is locked RAM that
# the rest of the machine cannot page; the pool normally holds (copies in flight + 1) buffers,
# so the cap only matters when batch sizes keep changing. (A released buffer goes back to
# torch's caching host allocator, which keeps it pinned for torch's own reuse.)
MAX_POOLED_STAGING_BYTES = 1 << 30

# cudaHostRegister flags: cudaHostRegisterDefault. Registration happens with the stage's device
# current, which is the device that later reads the memory.
_HOST_REGISTER_FLAGS = 0

_NUMERIC_KINDS = frozenset("biufc")  # bool, signed, unsigned, float, complex


class DeviceUnavailableWarning(UserWarning):
    """A device copy or pinning was requested but CUDA is not available; batches stay on CPU."""


@dataclass(frozen=True, slots=True)
class DeviceStats:
    """A snapshot of the device stage.

    Attributes:
        batches_copied: batches whose copy completed.
        bytes_copied: bytes of those batches moved to the device (or into pinned memory).
        copy_seconds: device time of those copies (CUDA event elapsed time; wall time where
            events cannot time).
        in_flight: transfers started whose copy has not completed yet.
        staging_buffers: pinned staging buffers the stage owns (pooled and leased).
        pinned_bytes: bytes of those staging buffers.
        registered_bytes: bytes of host memory registered as page-locked by this stage.
    """

    batches_copied: int
    bytes_copied: int
    copy_seconds: float
    in_flight: int
    staging_buffers: int
    pinned_bytes: int
    registered_bytes: int


def parse_device(device: str | torch.device | int | None) -> torch.device | None:
    """Normalise the loader's ``device`` argument; ``None`` means "no device stage".

    Accepts ``None``, ``"cpu"``, ``"cuda"``, ``"cuda:<index>"``, a :class:`torch.device` of type
    cpu or cuda, or a CUDA ordinal. Parsing never initialises CUDA, so a bad value is reported
    at construction even on a machine without a GPU.

    Raises:
        ValueError: for a malformed string, a negative ordinal or a device type other than
            cpu and cuda, naming the value.
        TypeError: for a value of another type.
    """
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise TypeError(
            f"device={device!r} must be None, a string such as 'cuda:0', a torch.device "
            "or a CUDA ordinal"
        )
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device={device!r} is not a valid CUDA ordinal: it must be >= 0")
        return torch.device("cuda", device)
    if isinstance(device, str):
        try:
            parsed = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(
                f"device={device!r} is not a valid device: expected 'cpu', 'cuda' or 'cuda:<index>'"
            ) from exc
    else:
        parsed = device
    if parsed.type == "cpu":
        return None
    if parsed.type != "cuda":
        raise ValueError(
            f"device={device!r} is not supported: batches go to 'cuda' devices or stay on 'cpu'"
        )
    return parsed


class CudaBackend(Protocol):
    """The CUDA operations the stage uses, so tests can swap in a fake with scripted events.

    Streams and events are opaque handles. ``to_device`` enqueues a copy on the stream entered
    last with ``use_stream`` and returns without waiting for it; ``query_event`` never blocks,
    ``synchronize_event`` does. ``elapsed_seconds`` is asked only once both events completed.
    ``alloc_pinned`` returns a 1-D uint8 page-locked tensor; ``pin`` returns a page-locked copy
    of a CPU tensor (or the tensor itself if it is already page-locked). ``host_register`` and
    ``host_unregister`` report failure by returning False.
    """

    def is_available(self) -> bool: ...

    def device_count(self) -> int: ...

    def current_device(self) -> int: ...

    def new_stream(self, device: torch.device) -> Any: ...

    def current_stream(self, device: torch.device) -> Any: ...

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]: ...

    def new_event(self) -> Any: ...

    def record_event(self, event: Any, stream: Any) -> None: ...

    def query_event(self, event: Any) -> bool: ...

    def synchronize_event(self, event: Any) -> None: ...

    def elapsed_seconds(self, start: Any, end: Any) -> float: ...

    def wait_event(self, stream: Any, event: Any) -> None: ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor: ...

    def alloc_pinned(self, nbytes: int) -> torch.Tensor: ...

    def is_pinned(self, tensor: torch.Tensor) -> bool: ...

    def pin(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def host_register(self, ptr: int, nbytes: int, device: torch.device) -> bool: ...

    def host_unregister(self, ptr: int) -> bool: ...


class TorchCudaBackend:
    """:class:`CudaBackend` over ``torch.cuda``."""

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def use_stream(self, stream: torch.cuda.Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def record_event(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def query_event(self, event: torch.cuda.Event) -> bool:
        return bool(event.query())  # type: ignore[no-untyped-call]

    def synchronize_event(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def elapsed_seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return float(start.elapsed_time(end)) / 1000.0

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return tensor.to(device, non_blocking=True)

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return bool(tensor.is_pinned())

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.is_pinned() else tensor.pin_memory()

    def host_register(self, ptr: int, nbytes: int, device: torch.device) -> bool:
        with torch.cuda.device(device):
            err = int(_cudart().cudaHostRegister(ptr, nbytes, _HOST_REGISTER_FLAGS))
        if err != 0:
            _clear_last_cuda_error()
            return False
        return True

    def host_unregister(self, ptr: int) -> bool:
        err = int(_cudart().cudaHostUnregister(ptr))
        if err != 0:
            _clear_last_cuda_error()
            return False
        return True


def _cudart() -> Any:
    """torch's bindings of the CUDA runtime (initialises CUDA)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


@functools.cache
def _loaded_cudart() -> Any:
    # Only a libcudart that torch already loaded (RTLD_NOLOAD): its per-thread "last error"
    # is the one torch's kernel-launch checks read.
    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None:  # pragma: no cover - not Linux/macOS
        return None
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=noload | os.RTLD_NOW)
        except OSError:
            continue
        lib.cudaGetLastError.restype = ctypes.c_int
        return lib
    return None


def _clear_last_cuda_error() -> None:
    """Reset CUDA's sticky-until-read "last error" after a failed (and handled) call.

    torch's binding of cudaHostRegister returns the error without clearing it, and torch checks
    ``cudaGetLastError()`` after every kernel launch: an unrelated kernel would then fail with
    our registration error. Best effort: a statically linked runtime cannot be reached.
    """
    lib = _loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()


# --- batches as trees -------------------------------------------------------------------------


def _map_tree(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every tensor and ndarray leaf, rebuilding the containers around them.

    Containers keep their type where it can be rebuilt (dict subclasses through ``copy.copy``,
    namedtuples field by field); leaves are visited in a deterministic order, which callers rely
    on to pair a first walk with a second one.
    """
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = {key: _map_tree(value, fn) for key, value in obj.items()}
        if type(obj) is dict:
            return items
        if isinstance(obj, MutableMapping):
            with contextlib.suppress(Exception):
                clone = copy.copy(obj)
                clone.update(items)
                return clone
        return items
    if isinstance(obj, tuple):
        values = [_map_tree(value, fn) for value in obj]
        if type(obj) is tuple:
            return tuple(values)
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*values)
        try:
            return type(obj)(values)
        except Exception:
            return tuple(values)
    if isinstance(obj, list):
        values = [_map_tree(value, fn) for value in obj]
        if type(obj) is list:
            return values
        if isinstance(obj, MutableSequence):
            with contextlib.suppress(Exception):
                seq = copy.copy(obj)
                seq[:] = values
                return seq
        return values
    return obj


@functools.lru_cache(maxsize=64)
def _torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype


def _array_as_tensor_view(arr: np.ndarray[Any, Any]) -> torch.Tensor | None:
    """A zero-copy tensor over ``arr``; None where ``torch.from_numpy`` cannot (or would warn)."""
    if (
        not arr.flags.writeable
        or not arr.dtype.isnative
        or not arr.flags.c_contiguous
        or not arr.flags.aligned
    ):
        return None
    return torch.from_numpy(arr)


def _array_ptr(arr: np.ndarray[Any, Any]) -> int:
    return int(arr.__array_interface__["data"][0])


def _next_delay(delay: float) -> float:
    """The poll back-off: 0, then POLL_FIRST_DELAY_S growing by POLL_GROWTH to the cap."""
    return POLL_FIRST_DELAY_S if delay == 0.0 else min(delay * POLL_GROWTH, POLL_MAX_DELAY_S)


def _empty_like_leaf(leaf: torch.Tensor | np.ndarray[Any, Any]) -> torch.Tensor:
    dtype = _torch_dtype(leaf.dtype) if isinstance(leaf, np.ndarray) else leaf.dtype
    return torch.empty(tuple(leaf.shape), dtype=dtype)


def _align(n: int) -> int:
    return -(-n // STAGING_ALIGN) * STAGING_ALIGN


# --- staging pool -----------------------------------------------------------------------------


class _StagingPool:
    """Pinned staging buffers, reused across batches; a sync state machine.

    Invariant: every buffer the pool allocated is either in ``_free`` (sorted by size) or
    leased, and ``_bytes`` is the sum over both.
    """

    def __init__(self, alloc: Callable[[int], torch.Tensor], max_free_bytes: int) -> None:
        self._alloc = alloc
        self._max_free_bytes = max_free_bytes
        self._free: list[torch.Tensor] = []
        self._leased: dict[int, torch.Tensor] = {}
        self._bytes = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """Lease the smallest free buffer that fits, or allocate one rounded up to the granule."""
        sizes = [buf.numel() for buf in self._free]
        i = bisect.bisect_left(sizes, nbytes)
        if i < len(self._free):
            buf = self._free.pop(i)
        else:
            size = -(-nbytes // STAGING_GRANULE) * STAGING_GRANULE
            buf = self._alloc(size)
            self._bytes += buf.numel()
        self._leased[id(buf)] = buf
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Return a leased buffer whose copies have completed."""
        if self._leased.pop(id(buf), None) is None:
            return
        bisect.insort(self._free, buf, key=lambda b: b.numel())
        free_bytes = sum(b.numel() for b in self._free)
        while free_bytes > self._max_free_bytes and self._free:
            # The smallest buffers serve the fewest requests: drop them first.
            dropped = self._free.pop(0)
            free_bytes -= dropped.numel()
            self._bytes -= dropped.numel()

    def discard(self, buf: torch.Tensor) -> None:
        """Forget a leased buffer that must not be reused (its copy failed on the device)."""
        if self._leased.pop(id(buf), None) is not None:
            self._bytes -= buf.numel()

    def clear(self) -> None:
        """Drop every free buffer and forget leased ones (they die with their last user)."""
        self._free.clear()
        self._leased.clear()
        self._bytes = 0

    @property
    def buffers(self) -> int:
        return len(self._free) + len(self._leased)

    @property
    def nbytes(self) -> int:
        return self._bytes


# --- transfers --------------------------------------------------------------------------------

_State = Literal["pending", "copied", "failed"]


class Transfer:
    """One batch on its way to the device, returned by :meth:`DeviceStage.start`.

    ``await wait()`` returns the device batch. Cancelling ``wait()`` loses nothing: the copy
    carries on and a later ``wait()`` returns the batch.
    """

    __slots__ = (
        "_device_tensors",
        "_end_event",
        "_error",
        "_lease",
        "_nbytes",
        "_ranges",
        "_result",
        "_sources",
        "_stage",
        "_start_event",
        "_started_at",
        "_state",
        "batch_id",
    )

    def __init__(self, stage: DeviceStage, batch_id: int) -> None:
        self.batch_id = batch_id
        self._stage = stage
        self._state: _State = "pending"
        self._result: Any = None
        self._error: TransferError | None = None
        # Device tensors of the result: each gets record_stream(consumer) at hand-over.
        self._device_tensors: list[torch.Tensor] = []
        # Host tensors copied from directly: kept alive until the copy has completed.
        self._sources: list[torch.Tensor] = []
        # Bases of registered ranges this copy reads from.
        self._ranges: set[int] = set()
        self._lease: torch.Tensor | None = None
        self._start_event: Any = None
        self._end_event: Any = None
        self._nbytes = 0
        self._started_at = time.perf_counter()

    def done(self) -> bool:
        """Whether the copy has completed (or failed); never blocks."""
        if self._state == "pending":
            self._stage._poll(self)
        return self._state != "pending"

    async def wait(self, *, stream: Any = None) -> Any:
        """Await the copy without blocking the loop, hand the batch over, and return it.

        Args:
            stream: the CUDA stream that will consume the batch; by default the calling
                thread's current stream for the stage's device.

        Raises:
            TransferError: the copy failed on the device, naming the batch.
        """
        delay = 0.0
        while not self.done():
            await asyncio.sleep(delay)
            delay = _next_delay(delay)
        if self._error is not None:
            raise self._error
        self._stage._hand_over(self, stream)
        return self._result

    def __repr__(self) -> str:
        return f"<Transfer batch_id={self.batch_id} {self._state}>"


@dataclass(slots=True)
class _Leaf:
    """How one leaf of a batch travels."""

    kind: Literal["keep", "stage", "direct"]
    leaf: Any
    nbytes: int = 0
    offset: int = 0
    range_base: int | None = None


# --- the stage --------------------------------------------------------------------------------


class DeviceStage:
    """Copies batches to one CUDA device from pinned memory on a side stream.

    With ``device=None`` and ``pin_memory=True`` it only pins (the batch comes back in page-locked
    host memory, ready for the user's own non-blocking copies). Without CUDA, a requested device
    or pinning warns once, here, with :class:`DeviceUnavailableWarning`, and batches pass
    through unchanged; :attr:`enabled` then says there is nothing to do.

    Args:
        device: the target device (anything :func:`parse_device` accepts); ``None`` or cpu
            for none.
        pin_memory: with no device, return batches in pinned host memory. With a CUDA device
            copies always go through pinned memory and the flag changes nothing.
        backend: the CUDA operations to use; by default ``torch.cuda``.

    Raises:
        ValueError: the device index does not exist.
        TypeError: ``pin_memory`` is not a bool.
    """

    def __init__(
        self,
        device: torch.device | str | int | None,
        *,
        pin_memory: bool = False,
        backend: CudaBackend | None = None,
    ) -> None:
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory={pin_memory!r} must be a bool")
        target = parse_device(device)
        self._backend: CudaBackend = backend if backend is not None else TorchCudaBackend()
        self._cuda = self._backend.is_available()
        self._closed = False
        self._device: torch.device | None = None
        self._pin_only = False
        self._side_stream: Any = None
        if not self._cuda:
            if target is not None or pin_memory:
                what = f"device={str(target)!r}" if target is not None else "pin_memory=True"
                warnings.warn(
                    f"{what} was requested but CUDA is not available: batches stay on the CPU",
                    DeviceUnavailableWarning,
                    stacklevel=2,
                )
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
        self._pool = _StagingPool(self._backend.alloc_pinned, MAX_POOLED_STAGING_BYTES)
        # Transfers whose copy has not completed, in start order (= completion order: one
        # stream runs them in order). Insertion-ordered dict as an ordered set.
        self._in_flight: dict[int, Transfer] = {}
        # Staging buffers of failed starts, free once their event has completed.
        self._retiring: list[tuple[Any, torch.Tensor | None, set[int]]] = []
        # Registered page-locked host ranges: base pointer -> size, plus sorted bases.
        self._registered: dict[int, int] = {}
        self._bases: list[int] = []
        self._batches = 0
        self._bytes = 0
        self._seconds = 0.0

    @property
    def enabled(self) -> bool:
        """Whether the stage does anything; when False the loader can skip it entirely."""
        return self._device is not None or self._pin_only

    @property
    def device(self) -> torch.device | None:
        """The resolved target device (with its index), or None."""
        return self._device

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
        transfer = Transfer(self, batch_id)
        if not self.enabled:
            transfer._result = batch
            transfer._state = "copied"
            return transfer
        self._reap()
        try:
            if self._pin_only:
                self._pin(transfer, batch)
            else:
                self._copy(transfer, batch)
        except Exception as exc:
            del batch
            # The cause's traceback holds the frames that walked the batch; clear their locals
            # so the error does not keep the host batch (and its slot) alive.
            traceback.clear_frames(exc.__traceback__)
            where = f"to {self._device}" if self._device is not None else "into pinned memory"
            raise TransferError(f"batch {batch_id}: copying {where} failed: {exc!r}") from exc
        return transfer

    async def drain(self) -> None:
        """Await every copy in flight without blocking the loop (results stay with transfers)."""
        for transfer in list(self._in_flight.values()):
            delay = 0.0
            while not transfer.done():
                await asyncio.sleep(delay)
                delay = _next_delay(delay)
        self._reap()

    def register_host_memory(self, ptr: int, nbytes: int) -> bool:
        """Page-lock ``nbytes`` of host memory at ``ptr`` so batches there are copied directly.

        Best effort: returns False where CUDA is unavailable or registration fails, and the
        memory is then copied through staging. Registering a base already registered by this
        stage with the same size returns True.

        Raises:
            ValueError: ``ptr`` or ``nbytes`` is negative or not an int.
        """
        if isinstance(ptr, bool) or not isinstance(ptr, int) or ptr < 0:
            raise ValueError(f"ptr={ptr!r} must be a non-negative int address")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes={nbytes!r} must be a non-negative int")
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
        for transfer in list(self._in_flight.values()):
            if ptr in transfer._ranges:
                self._settle(transfer)
        for entry in list(self._retiring):
            if ptr in entry[2]:
                with contextlib.suppress(Exception):
                    self._backend.synchronize_event(entry[0])
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
        for transfer in list(self._in_flight.values()):
            self._settle(transfer)
        for event, _buf, _ranges in self._retiring:
            with contextlib.suppress(Exception):
                self._backend.synchronize_event(event)
        self._retiring.clear()
        self._pool.clear()
        for ptr in list(self._registered):
            with contextlib.suppress(Exception):
                self._backend.host_unregister(ptr)
        self._registered.clear()
        self._bases.clear()

    def stats(self) -> DeviceStats:
        """A snapshot of counters and pool sizes."""
        return DeviceStats(
            batches_copied=self._batches,
            bytes_copied=self._bytes,
            copy_seconds=self._seconds,
            in_flight=len(self._in_flight),
            staging_buffers=self._pool.buffers,
            pinned_bytes=self._pool.nbytes,
            registered_bytes=sum(self._registered.values()),
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

    def _plan(self, leaf: Any) -> _Leaf:
        """Decide how one leaf travels: kept as is, copied directly, or staged."""
        device = self._device
        assert device is not None
        if isinstance(leaf, np.ndarray):
            if leaf.dtype.kind not in _NUMERIC_KINDS:
                return _Leaf("keep", leaf)
            if leaf.nbytes and leaf.flags.c_contiguous:
                base = self._registered_base(_array_ptr(leaf), leaf.nbytes)
                view = _array_as_tensor_view(leaf) if base is not None else None
                if view is not None:
                    return _Leaf("direct", view, leaf.nbytes, range_base=base)
            return _Leaf("stage", leaf, leaf.nbytes)
        tensor: torch.Tensor = leaf.detach()
        if tensor.device == device:
            return _Leaf("keep", leaf)
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
            # Other devices, sparse and quantized tensors: torch's own copy is correct for them.
            return _Leaf("direct", tensor, tensor.nbytes)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes and tensor.is_contiguous():
            base = self._registered_base(tensor.data_ptr(), nbytes)
            if base is not None or self._backend.is_pinned(tensor):
                return _Leaf("direct", tensor, nbytes, range_base=base)
        return _Leaf("stage", tensor, nbytes)

    def _copy(self, transfer: Transfer, batch: Any) -> None:
        plans: list[_Leaf] = []

        def collect(leaf: Any) -> Any:
            plans.append(self._plan(leaf))
            return leaf

        _map_tree(batch, collect)
        total = 0
        for plan in plans:
            if plan.kind == "stage":
                plan.offset = total
                total += _align(plan.nbytes)
        lease = self._pool.acquire(total) if total else None
        device = self._device
        assert device is not None
        backend = self._backend
        start_event, end_event = backend.new_event(), backend.new_event()
        enqueued = False
        try:
            with backend.use_stream(self._side_stream):
                backend.record_event(start_event, self._side_stream)
                plan_iter = iter(plans)

                def move(leaf: Any) -> Any:
                    plan = next(plan_iter)
                    if plan.kind == "keep":
                        return leaf
                    if plan.kind == "direct":
                        src: torch.Tensor = plan.leaf
                        transfer._sources.append(src)
                        if plan.range_base is not None:
                            transfer._ranges.add(plan.range_base)
                    elif plan.nbytes == 0:
                        src = _empty_like_leaf(plan.leaf)  # nothing to stage or to wait for
                    else:
                        assert lease is not None
                        src = self._stage_leaf(lease, plan)
                    nonlocal enqueued
                    enqueued = True
                    out = backend.to_device(src, device)
                    transfer._device_tensors.append(out)
                    transfer._nbytes += plan.nbytes
                    return out

                with torch.no_grad():
                    result = _map_tree(batch, move)
                backend.record_event(end_event, self._side_stream)
        except BaseException:
            # Closures of this walk outlive their frames in the traceback (a frame keeps its
            # function, a function its cells): empty the plan so no host leaf stays reachable.
            plans.clear()
            if enqueued:
                self._retire(lease, transfer._ranges)
            elif lease is not None:
                self._pool.release(lease)  # nothing was enqueued: nobody reads it
            transfer._sources.clear()
            transfer._device_tensors.clear()
            raise
        transfer._result = result
        transfer._lease = lease
        transfer._start_event, transfer._end_event = start_event, end_event
        self._in_flight[id(transfer)] = transfer

    @staticmethod
    def _stage_leaf(lease: torch.Tensor, plan: _Leaf) -> torch.Tensor:
        """Copy one leaf into its slice of the staging buffer and return that slice."""
        raw = lease[plan.offset : plan.offset + plan.nbytes]
        leaf = plan.leaf
        if isinstance(leaf, np.ndarray):
            staged = raw.view(_torch_dtype(leaf.dtype)).view(leaf.shape)
            if leaf.nbytes:
                # numpy reads any layout, read-only and byte-swapped arrays without a warning.
                np.copyto(staged.numpy(), leaf, casting="equiv")
            return staged
        staged = raw.view(leaf.dtype).view(leaf.shape)
        staged.copy_(leaf)
        return staged

    def _pin(self, transfer: Transfer, batch: Any) -> None:
        backend = self._backend
        nbytes = 0

        def pin(leaf: Any) -> Any:
            nonlocal nbytes
            if isinstance(leaf, np.ndarray):
                if leaf.dtype.kind not in _NUMERIC_KINDS:
                    return leaf
                view = _array_as_tensor_view(leaf)
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
            transfer._result = _map_tree(batch, pin)
        transfer._state = "copied"
        self._batches += 1
        self._bytes += nbytes
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
        """Complete finished copies and free retired buffers; stops at the first pending one."""
        for transfer in list(self._in_flight.values()):
            if not transfer.done():
                break
        while self._retiring:
            event, lease, _ranges = self._retiring[0]
            try:
                ready = self._backend.query_event(event)
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

    def _poll(self, transfer: Transfer) -> None:
        try:
            ready = self._backend.query_event(transfer._end_event)
        except Exception as exc:
            self._fail(transfer, exc)
            return
        if ready:
            self._finish(transfer)

    def _settle(self, transfer: Transfer) -> None:
        """Block until ``transfer``'s copy is done (cleanup paths only)."""
        try:
            self._backend.synchronize_event(transfer._end_event)
        except Exception as exc:
            self._fail(transfer, exc)
            return
        self._finish(transfer)

    def _finish(self, transfer: Transfer) -> None:
        try:
            seconds = self._backend.elapsed_seconds(transfer._start_event, transfer._end_event)
        except Exception:
            seconds = time.perf_counter() - transfer._started_at
        if transfer._lease is not None:
            self._pool.release(transfer._lease)
        transfer._lease = None
        transfer._sources.clear()
        transfer._state = "copied"
        self._in_flight.pop(id(transfer), None)
        self._batches += 1
        self._bytes += transfer._nbytes
        self._seconds += seconds

    def _fail(self, transfer: Transfer, exc: Exception) -> None:
        error = TransferError(
            f"batch {transfer.batch_id}: the copy to {self._device} failed on the device: {exc!r}"
        )
        error.__cause__ = exc
        transfer._error = error
        if transfer._lease is not None:
            self._pool.discard(transfer._lease)
        transfer._lease = None
        transfer._sources.clear()
        transfer._device_tensors.clear()
        transfer._result = None
        transfer._state = "failed"
        self._in_flight.pop(id(transfer), None)

    def _hand_over(self, transfer: Transfer, stream: Any) -> None:
        """Order the consumer's stream after the copy and tell the allocator who uses the data."""
        if self._device is None or not transfer._device_tensors:
            return
        try:
            consumer = stream if stream is not None else self._backend.current_stream(self._device)
            self._backend.wait_event(consumer, transfer._end_event)
            for tensor in transfer._device_tensors:
                self._backend.record_stream(tensor, consumer)
        except Exception as exc:
            raise TransferError(
                f"batch {transfer.batch_id}: handing the batch over to the consumer's stream "
                f"failed: {exc!r}"
            ) from exc
