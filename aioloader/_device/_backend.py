"""The CUDA operations the device stage uses, behind a protocol that tests can fake.

:class:`CudaBackend` lists every CUDA call :class:`DeviceStage` makes (streams, events, copies,
pinned allocation, host registration); :class:`TorchCudaBackend` implements it over
``torch.cuda`` and torch's bindings of the CUDA runtime. Nothing else in the stage calls CUDA
directly, so a fake backend with scripted events exercises every path without a GPU.

Sharp edges:

- ``cudaHostRegister`` is best effort: failures are reported as ``False`` and the caller copies
  through staging instead. Registration happens with the stage's device current, which is the
  device that later reads the memory.
- A failed runtime call leaves CUDA's per-thread "last error" set, and torch checks
  ``cudaGetLastError()`` after every kernel launch: an unrelated kernel would fail with our
  error. :func:`_clear_last_cuda_error` reads (and so resets) it through the ``libcudart`` torch
  already loaded (``RTLD_NOLOAD``); a statically linked runtime cannot be reached.
- ``torch.cuda.cudart()`` initialises CUDA: only the registration calls use it.
- Events are made with ``blocking=True`` (``cudaEventBlockingSync``): the stage's completion
  thread sleeps in ``synchronize()`` until the driver's interrupt, where a spinning wait would
  burn a CPU core for as long as any copy is pending (nearly always, with copies queued ahead).
  See :data:`BLOCKING_EVENTS` for the trade-off.
- How many tensors use a storage is read with ``torch._C._storage_Use_Count``, torch's own
  private test helper; :meth:`TorchCudaBackend.storage_users` is the one place that reads it,
  and answers None where this torch lacks it (the device ring is then off). That count misses
  a Python storage object the user keeps (``s = leaf.untyped_storage()``): torch keeps one
  Python object per storage, and the reading itself goes through it, so the object's own
  reference count is added (see :func:`storage_users`).
- CUDA calls use the calling thread's current device, which is device 0 on a fresh thread: a
  stage on another GPU would create a context (hundreds of MB) on GPU 0 from its completion
  and staging threads. Each of those threads calls :meth:`CudaBackend.set_thread_device`
  once, before its first CUDA call (as torch's pin-memory thread does).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

__all__ = ["BLOCKING_EVENTS", "CudaBackend", "TorchCudaBackend", "storage_users"]

# cudaHostRegister flags: cudaHostRegisterDefault. Registration happens with the stage's device
# current, which is the device that later reads the memory.
_HOST_REGISTER_FLAGS = 0

#: Events wait by blocking sync (the thread sleeps until the driver's interrupt) rather than by
#: spinning. Spinning wakes the completion thread a few microseconds sooner but keeps one CPU
#: core busy whenever a copy is pending, a core the loader's workers and the training loop need;
#: blocking sync is expected to wake it within tens of microseconds. Not measured yet:
#: ``benchmarks/gpu_transfer.py`` prints the wake latency, ``--spin-events`` the other choice's.
BLOCKING_EVENTS = True


class CudaBackend(Protocol):
    """The CUDA operations the stage uses, so tests can swap in a fake with scripted events.

    Streams and events are opaque handles. ``to_device`` enqueues a copy on the stream entered
    last with ``use_stream`` and returns without waiting for it; ``query_event`` never blocks,
    ``synchronize_event`` does. ``elapsed_seconds`` is asked only once both events completed.
    ``alloc_pinned`` returns a 1-D uint8 page-locked tensor; ``pin`` returns a page-locked copy
    of a CPU tensor (or the tensor itself if it is already page-locked). ``host_register`` and
    ``host_unregister`` report failure by returning False.

    ``event_waiter`` returns a function that blocks the *calling thread* until an event has
    completed (never completing it itself), safe to call from a thread of its own; None where
    events can only be polled (the stage then polls them with a back-off). ``empty_device``
    returns a 1-D uint8 tensor on the device; ``copy_into`` enqueues a copy of a host tensor
    into a device tensor of the same shape and dtype on the current stream. ``storage_users``
    counts the tensors that share ``tensor``'s storage (None where it cannot tell: the stage
    then allocates device memory per batch instead of reusing its ring).
    ``set_thread_device`` makes ``device`` the calling thread's current device (each thread of
    the stage calls it once, before its first CUDA call). ``on_device`` is a context in which
    ``device`` is the calling thread's current device, restored after: the stage queries and
    synchronizes events under it from threads that are not its own (the event loop's, the
    loader's loop thread), whose current device may be another.
    """

    def is_available(self) -> bool: ...

    def device_count(self) -> int: ...

    def current_device(self) -> int: ...

    def set_thread_device(self, device: torch.device) -> None: ...

    def on_device(self, device: torch.device) -> AbstractContextManager[Any]: ...

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

    def event_waiter(self) -> Callable[[Any], None] | None: ...

    def empty_device(self, nbytes: int, device: torch.device) -> torch.Tensor: ...

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def storage_users(self, tensor: torch.Tensor) -> int | None: ...


class TorchCudaBackend:
    """:class:`CudaBackend` over ``torch.cuda``."""

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_thread_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def on_device(self, device: torch.device) -> AbstractContextManager[Any]:
        # cudaEventQuery/cudaEventSynchronize run under no device guard of torch's: on a thread
        # whose current device is another (a fresh thread's is 0) they would create a context
        # there. The guard restores the thread's device after (it may be the user's thread).
        return torch.cuda.device(device)

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def use_stream(self, stream: torch.cuda.Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event(  # type: ignore[no-untyped-call]
            enable_timing=True, blocking=BLOCKING_EVENTS
        )

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

    def event_waiter(self) -> Callable[[torch.cuda.Event], None]:
        # torch releases the GIL inside Event.synchronize (cudaEventSynchronize).
        return self.synchronize_event

    def empty_device(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def storage_users(self, tensor: torch.Tensor) -> int | None:
        return storage_users(tensor)


def storage_users(tensor: torch.Tensor) -> int | None:
    """How many references the storage under ``tensor`` has (tensors and views sharing it, and
    Python storage objects a user keeps), or None where this torch cannot say. Only
    differences between two readings mean anything: the reading itself holds some.

    The storage's use count alone misses a kept ``leaf.untyped_storage()``: torch keeps one
    Python object per storage, which holds one reference whether or not anybody else holds the
    object, and the reading goes through that same object. So that object's Python reference
    count is added: it is one higher for each reference the user keeps.
    """
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # pragma: no cover - every torch this package supports has it
        return None
    storage = tensor.untyped_storage()
    return int(use_count(storage._cdata)) + sys.getrefcount(storage)


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
