"""Sampling: which samples an epoch reads, in which order, grouped into which batches, on
which rank.

::

    SequentialSampler / RandomSampler / DistributedSampler      (_sampler; or any iterable)
        │ int indices, a pure function of (seed, epoch)
        ▼
    BatchSampler(last_batch=keep | discard | rollover)            (_batch_sampler)
        │ list[int]
        ▼
    ShardedBatchSampler(num_shards)                               (_batch_sampler, optional)
        │ list[list[int]]
        ▼
    the epoch's plan (aioloader._epoch)

    torch.distributed ──▶ this rank's share (_distributed): a DistributedSampler over the
                          indices, or every R-th item of a stream, split again per reader
                      ──▶ equal steps (_lockstep): the ranks agree where a stream's epoch ends

- ``_batch_sampler``: the batch samplers and the last-batch policy; pure.
- ``_sampler``: the index samplers; pure, deterministic, with ``state_dict``.
- ``_distributed``: the rank's share, the seed the ranks agree on, and how a stream is split
  among ranks and readers.
- ``_lockstep``: the step-by-step agreement on a stream's end (one collective a step, on a
  thread of its own and a gloo group of its own, ahead of the consumer).

Nothing here starts a task or a process; the agreement's one thread is the only thread. This
module only re-exports.
"""

from __future__ import annotations

from ._batch_sampler import BatchSampler as BatchSampler
from ._batch_sampler import BulkKey as BulkKey
from ._batch_sampler import IndexCheck as IndexCheck
from ._batch_sampler import LastBatch as LastBatch
from ._batch_sampler import ShardedBatchSampler as ShardedBatchSampler
from ._batch_sampler import resolve_last_batch as resolve_last_batch
from ._distributed import DEFAULT_SHARE_SEED as DEFAULT_SHARE_SEED
from ._distributed import Shard as Shard
from ._distributed import StreamOrders as StreamOrders
from ._distributed import every_nth as every_nth
from ._distributed import every_nth_async as every_nth_async
from ._distributed import first_items_noted as first_items_noted
from ._distributed import one_by_one as one_by_one
from ._distributed import process_group as process_group
from ._distributed import rank_seed as rank_seed
from ._distributed import resolve_shard as resolve_shard
from ._distributed import stream_items as stream_items
from ._distributed import stream_share as stream_share
from ._distributed import warn_if_group_appeared as warn_if_group_appeared
from ._lockstep import EpochAgreement as EpochAgreement
from ._lockstep import Lockstep as Lockstep
from ._lockstep import resolve_equal_steps as resolve_equal_steps
from ._lockstep import resolve_leftover as resolve_leftover
from ._sampler import DistributedSampler as DistributedSampler
from ._sampler import RandomSampler as RandomSampler
from ._sampler import SequentialSampler as SequentialSampler
from ._sampler import consumed_positions as consumed_positions
