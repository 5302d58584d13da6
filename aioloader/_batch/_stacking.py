"""The copy at the heart of collation: samples stacked into one array, by whom and into what.

:mod:`aioloader._batch._collate` decides what a batch is; this module makes the copy of a leaf's
samples, whose cost depends on the memory it lands in and the thread that makes it:

- :func:`stack_large`: a large batch bound for torch, made in torch's own memory (no ``alloc``:
  a main-process batch, as torch's collate makes it), by ``torch.stack``.
- :func:`stack_into`: tensors stacked into the array an ``alloc`` gave (a shared-memory slot in
  a worker, reused memory on a loader thread), by numpy, on the calling thread alone.

torch is imported by the caller (these run only on tensors, or to make one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["stack_into", "stack_large"]


def stack_large(
    samples: Sequence[np.ndarray[Any, Any]],
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    torch_dtype: torch.dtype,
) -> torch.Tensor:
    """Stack large arrays as torch's collate does: into torch's memory, by ``torch.stack``
    where torch can view every sample. numpy asks the kernel for huge pages from 4 MiB on; a
    kernel that compacts memory at the fault for those (THP ``defrag`` = ``madvise``) made a
    9.6 MB batch take 24 ms in some processes and 6 in others, for a whole run. And
    ``torch.stack`` copies on torch's threads: 2.3 ms against 4.4 for ``np.stack``, 2 cores."""
    import torch

    if all(_torch_can_view(a, dtype) for a in samples):
        return torch.stack([torch.from_numpy(a) for a in samples])
    # On the CPU whatever torch's default device: the batch is made here, then moved.
    tensor = torch.empty(shape, dtype=torch_dtype, device="cpu")
    np.stack(samples, out=tensor.numpy(), casting="same_kind")
    return tensor


def stack_into(samples: Sequence[torch.Tensor], array: np.ndarray[Any, Any]) -> None:
    """Stack plain CPU tensors (strided, no grad, one shape) into ``array``, by numpy.

    ``torch.stack(..., out=)`` splits the copy over torch's intra-op threads. Called from a
    thread other than the main one (a loader thread), that took 4-5 ms for a 9.6 MB batch here,
    against 0.7 ms for numpy's single copy into the same memory (2 cores, already faulted in).
    """
    np.stack([t.resolve_conj().resolve_neg().numpy() for t in samples], out=array)


def _torch_can_view(array: np.ndarray[Any, Any], dtype: np.dtype[Any]) -> bool:
    """Whether ``torch.from_numpy`` takes ``array`` as a tensor of ``dtype``. torch refuses
    negative strides and partial-item ones (a packed record's field), and warns on read-only
    arrays; zero strides are left out, as numpy warns when a broadcast array is asked that."""
    return (
        array.dtype == dtype
        and all(stride > 0 and stride % array.itemsize == 0 for stride in array.strides)
        and array.flags.writeable
    )
