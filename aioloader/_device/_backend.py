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
"""

from __future__ import annotations

import ctypes
import functools
import os
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

__all__ = ["CudaBackend", "TorchCudaBackend"]

# cudaHostRegister flags: cudaHostRegisterDefault. Registration happens with the stage's device
# current, which is the device that later reads the memory.
_HOST_REGISTER_FLAGS = 0


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
