"""Leaf routes: how each leaf of a batch travels to the device, and where it sits in staging.

Before it enqueues anything, :class:`~aioloader._device._stage.DeviceStage` walks the batch once
with :func:`plan_batch`, which gives every array leaf one of three routes:

- ``keep``: already on the target device, or not numeric (strings, objects, datetimes);
- ``direct``: copied to the device straight from where it lies: page-locked host memory (a range
  registered with the stage, a pinned tensor, or a numpy array over pinned memory: a batch
  collated straight into pinned memory on the loader's threads), or a tensor torch must copy
  itself (another device, sparse, quantized);
- ``stage``: pageable host memory, first copied into the batch's pinned staging buffer by
  :func:`stage_leaf`, at an offset :func:`plan_batch` laid out.

Every leaf of ``ring_min_bytes`` or more copied from contiguous host memory (staged, or direct
from page-locked memory) also gets a place in the batch's device buffer (``device_offset``), a
slot of the stage's device ring (:mod:`._ring`); the others get their own device tensor (a
small leaf kept by the user must not keep a whole slot).

Planning makes no CUDA call: the stage passes in how to find a registered range and how to ask
whether a tensor is pinned.

Sharp edges:

- Read-only, byte-swapped or non-contiguous numpy leaves are staged even when their memory is
  registered (torch cannot view them without a copy or a warning).
- The plans pair with a second walk of the batch by visiting order (:func:`map_arrays`), so the
  batch must not change between the two walks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ._leaves import NUMERIC_KINDS, array_as_tensor_view, array_ptr, map_arrays, torch_dtype
from ._staging import align_up

__all__ = ["LeafPlan", "RegisteredBase", "plan_batch", "plan_leaf", "stage_leaf"]

# ``(address, nbytes)`` -> the base of the registered page-locked range that holds all of those
# bytes, or None.
RegisteredBase = Callable[[int, int], int | None]


@dataclass(slots=True)
class LeafPlan:
    """How one leaf of a batch travels.

    Attributes:
        kind: the route: ``keep``, ``direct`` or ``stage``.
        leaf: what the copy reads: the leaf, or a tensor view of it (``direct`` numpy leaves).
        nbytes: bytes copied to the device (0 for ``keep``).
        offset: where a ``stage`` leaf starts in the batch's staging buffer.
        range_base: the registered range a ``direct`` leaf is read from, if any.
        device_offset: where the leaf lands in the batch's device buffer; None for a leaf
            that gets a device tensor of its own (kept, or copied by torch itself).
    """

    kind: Literal["keep", "stage", "direct"]
    leaf: Any
    nbytes: int = 0
    offset: int = 0
    range_base: int | None = None
    device_offset: int | None = None


def plan_leaf(
    leaf: Any,
    device: torch.device,
    registered_base: RegisteredBase,
    is_pinned: Callable[[torch.Tensor], bool],
) -> LeafPlan:
    """Decide how one leaf travels: kept as is, copied directly, or staged."""
    if isinstance(leaf, np.ndarray):
        if leaf.dtype.kind not in NUMERIC_KINDS:
            return LeafPlan("keep", leaf)
        if leaf.nbytes and leaf.flags.c_contiguous:
            base = registered_base(array_ptr(leaf), leaf.nbytes)
            view = array_as_tensor_view(leaf)
            if view is not None and (base is not None or is_pinned(view)):
                return LeafPlan("direct", view, leaf.nbytes, range_base=base)
        return LeafPlan("stage", leaf, leaf.nbytes)
    tensor: torch.Tensor = leaf.detach()
    if tensor.device == device:
        return LeafPlan("keep", leaf)
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_quantized:
        # Other devices, sparse and quantized tensors: torch's own copy is correct for them.
        return LeafPlan("direct", tensor, tensor.nbytes)
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes and tensor.is_contiguous():
        base = registered_base(tensor.data_ptr(), nbytes)
        if base is not None or is_pinned(tensor):
            return LeafPlan("direct", tensor, nbytes, range_base=base)
    return LeafPlan("stage", tensor, nbytes)


def plan_batch(
    batch: Any,
    device: torch.device,
    registered_base: RegisteredBase,
    is_pinned: Callable[[torch.Tensor], bool],
    ring_min_bytes: int,
) -> tuple[list[LeafPlan], int, int]:
    """Plan every array leaf of ``batch``, in visiting order, and lay out the staged ones and
    the ones that land in the batch's device buffer (those of ``ring_min_bytes`` or more).

    Returns:
        The plans, the bytes of staging buffer the batch needs (0 if nothing is staged), and
        the bytes of device buffer it needs (0 if no leaf lands in one).
    """
    plans: list[LeafPlan] = []

    def collect(leaf: Any) -> Any:
        plans.append(plan_leaf(leaf, device, registered_base, is_pinned))
        return leaf

    map_arrays(batch, collect)
    total = device_total = 0
    for plan in plans:
        if plan.kind == "stage":
            plan.offset = total
            total += align_up(plan.nbytes)
        if plan.nbytes >= ring_min_bytes and (
            plan.kind == "stage" or (plan.kind == "direct" and _from_host(plan.leaf))
        ):
            plan.device_offset = device_total
            device_total += align_up(plan.nbytes)
    return plans, total, device_total


def _from_host(tensor: torch.Tensor) -> bool:
    """Whether a ``direct`` leaf is a plain contiguous host tensor (one bytewise copy)."""
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and tensor.is_contiguous()
    )


def stage_leaf(lease: torch.Tensor, plan: LeafPlan) -> torch.Tensor:
    """Copy one leaf into its slice of the staging buffer and return that slice."""
    raw = lease[plan.offset : plan.offset + plan.nbytes]
    leaf = plan.leaf
    if isinstance(leaf, np.ndarray):
        staged = raw.view(torch_dtype(leaf.dtype)).view(leaf.shape)
        if leaf.nbytes:
            # numpy reads any layout, read-only and byte-swapped arrays without a warning.
            np.copyto(staged.numpy(), leaf, casting="equiv")
        return staged
    staged = raw.view(leaf.dtype).view(leaf.shape)
    staged.copy_(leaf)
    return staged
