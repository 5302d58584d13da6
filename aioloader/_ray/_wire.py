"""How a batch crosses from an actor to the training process, both sides in one place.

::

    actor:  collate_fn's batch ──as_arrays──▶ torch CPU tensors become ``TensorLeaf(numpy view)``
            ──▶ Ray pickles it (protocol 5): every array's bytes go out of band, into the object
                store of the actor's node, without a copy
    main:   ``await ref`` ──▶ the object arrives in this node's object store (moved between nodes
            by Ray, or already here) ──▶ numpy arrays are zero-copy, *read-only* views of it
            ──opened──▶ ``TensorLeaf`` becomes a writable tensor (see the rule below)

The rule for read-only memory (the user's side of it is in ``docs/ray.md``):

- A numpy leaf stays a view of the object store: no copy, and read-only (``flags.writeable``
  is False; writing raises ``ValueError: assignment destination is read-only``). The memory
  stays pinned in the store while any view of it lives.
- A tensor leaf is copied once into memory of its own, writable as any tensor. torch cannot
  mark a tensor read-only: ``torch.from_numpy`` of a read-only array warns and hands out a
  tensor whose in-place ops would write into the store's shared, immutable pages. Never that,
  silently or not. (An array Ray hands over writable is wrapped without a copy.)

Why torch's own pickling is not used for tensors: it copies the bytes into the pickle stream
(twice more: in and out), where a numpy view goes out of band.

An actor on this machine (the same ``/dev/shm``: :func:`shm_key` matches) skips the object
store once its loader knows how large a batch is: as a local worker, it collates straight into
a slot of the pool's shared memory leased here, and Ray carries only the slot's descriptors
(small enough to travel inside the call's reply)::

    main:   Receiver.lease() ──slot──▶ make.remote(copy_id, request, slot)
    actor:  Packer(slot): collate into the slot ──▶ Parcel of descriptors (in_slot), or the
            batch inline (:func:`in_parcel`: its tensors as ``TensorLeaf``, as above)
    main:   Receiver.open(): views of the slot; an inline parcel ──opened──▶ as above

A Ray call costs the same either way; the object store's part of it (putting the batch in,
getting it out, freeing it: raylet and plasma round trips) is most of the CPU a batch of a
megabyte costs through Ray, and it is gone.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any

import numpy as np

from .. import _shm
from .._tree import map_tree
from .._workers import Parcel, from_wire

__all__ = ["TensorLeaf", "as_arrays", "in_parcel", "opened", "read_only", "shm_key"]


class TensorLeaf:
    """A CPU tensor on its way from an actor: its bytes as a numpy array (out of band)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, ...]:
        return TensorLeaf, (self.array,)


def as_arrays(batch: Any) -> Any:
    """``batch`` with every CPU tensor as a :class:`TensorLeaf` (in the actor)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return batch  # no tensor can be in it

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.is_sparse:
            try:
                return TensorLeaf(value.detach().numpy())
            except (TypeError, RuntimeError):  # no numpy dtype for it (bfloat16): torch's way
                return value
        return value

    return map_tree(batch, leaf)


def opened(batch: Any) -> Any:
    """``batch`` as the consumer gets it (in the training process): tensors back, writable."""

    def leaf(value: Any) -> Any:
        if not isinstance(value, TensorLeaf):
            return value
        import torch  # an actor sent a tensor: torch is there

        array = value.array
        if not array.flags.writeable:
            array = array.copy()  # see the module docstring: never a tensor over the store
        return torch.from_numpy(array)

    return map_tree(batch, leaf)


def in_parcel(parcel: Parcel) -> Parcel:
    """A local worker's ``parcel`` (the actor's :class:`~aioloader._workers.Packer` made it)
    ready for Ray: a batch that came inline after all (tiny, or it did not fit its slot) has
    its tensors as :class:`TensorLeaf`, since Ray may hand its arrays over read-only."""
    if parcel.in_slot:
        return parcel
    return dataclasses.replace(parcel, tree=as_arrays(from_wire(parcel.tree)))


def read_only(batch: Any) -> Any:
    """``batch`` (opened from a slot) with its numpy arrays read-only, as they are when they
    come through the object store: a user's code behaves the same wherever its actors run."""

    def leaf(value: Any) -> Any:
        if isinstance(value, np.ndarray):
            value.flags.writeable = False
        return value

    return map_tree(batch, leaf)


@functools.cache
def shm_key() -> str | None:
    """What tells this machine's ``/dev/shm`` apart, for this user: the kernel's boot id, the
    tmpfs's device and inode, and the user id (segments are made readable by their owner
    only). Two processes with the same key map each other's segments by name (actors in
    another container of the same host, with a ``/dev/shm`` of their own, differ; so do those
    of a node started by another user). None: no shared memory here."""
    if not _shm.shm_available():
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        st = os.stat(_shm.SHM_DIR)
    except OSError:
        return None
    return f"{boot}:{st.st_dev}:{st.st_ino}:{os.getuid()}"
