"""Data parallelism seen from every rank at once: which rank is data-bound, and at which stage.

Each rank's ``loader.statistics()`` says where its own time went; under data parallelism the
slowest rank sets the pace of all of them (the others wait in the gradient all-reduce), and
nothing in one rank's numbers shows which rank that is. :func:`gather_statistics` asks every
rank once, at a step boundary the user picks (it is one small collective, made by the user's
call, never hidden in the loader), and puts the answers in one table::

    rank  wait  samples/s  batches/s  bottleneck  verdict
       0    2%      812.0       50.7  consumer    the consumer is slow ...
    *  1   61%      811.9       50.7  workers     reading and collating samples is the limit ...
    slowest: rank 1 (workers): 9.8 s of 16.0 s waiting for data

The slowest rank is the one that waited longest for its batches (``wait_share x wall_s``):
under a collective per step every rank moves at the pace of the slowest, so throughput alone
cannot tell them apart, while the time spent waiting for data can (the other ranks wait in the
all-reduce instead, which the loader does not count). Ties go to the lower throughput. Its
``bottleneck`` verdict names the stage to fix (``workers``: raise ``num_workers`` there, or
make its samples cheaper; ``io``; ``source``; ...).

With ``log=True`` the table is logged on the group's rank 0 (INFO, WARNING when the slowest
rank waited for more than a fifth of its time), once per loader and epoch: call it at the end
of every epoch. Every rank of the group must call it, at the same step.

:func:`merge_states` makes one resumable state of every rank's (``TarDataset`` and
``ParquetDataset`` resume on another number of ranks from it; see docs/distributed.md).

This module also re-exports what distributed training with aioloader names:
:class:`~aioloader.DistributedSampler` lives in the facade.
"""

from __future__ import annotations

import logging
import sys
import weakref
from dataclasses import dataclass
from typing import Any

from ._epoch import merge_states as merge_states
from ._log import distributed_log
from ._stats import WAIT_SHARE_THRESHOLD

__all__ = ["GatheredStatistics", "RankStatistics", "gather_statistics", "merge_states"]


@dataclass(frozen=True, slots=True)
class RankStatistics:
    """One rank's epoch, as :func:`gather_statistics` gathers it (from its
    ``statistics().epoch_stats``: the running epoch, or the last one between epochs).

    Attributes:
        rank: the rank in the group gathered over.
        epoch: the epoch the numbers are of.
        wall_s: seconds of that epoch so far.
        wait_share: the share of them the consumer waited for a batch.
        samples_per_s, batches_per_s: the rates.
        bottleneck: the verdict's limiting stage (``workers``, ``io``, ``source``, ...).
        hint: the verdict in a sentence.
    """

    rank: int
    epoch: int | None
    wall_s: float
    wait_share: float
    samples_per_s: float
    batches_per_s: float
    bottleneck: str
    hint: str

    @property
    def wait_s(self) -> float:
        """Seconds this rank waited for data."""
        return self.wait_share * self.wall_s


@dataclass(frozen=True, slots=True)
class GatheredStatistics:
    """Every rank's statistics, and which rank is the slowest.

    Attributes:
        ranks: one :class:`RankStatistics` per rank, by rank.
        slowest: the rank that waited longest for data (see the module docstring).
        stage: its bottleneck verdict.
    """

    ranks: tuple[RankStatistics, ...]
    slowest: int
    stage: str

    @property
    def needs_action(self) -> bool:
        """Whether the slowest rank waited for data more than a fifth of its time."""
        return self.ranks[self.slowest].wait_share > WAIT_SHARE_THRESHOLD

    def __str__(self) -> str:
        lines = ["  rank  wait  samples/s  batches/s  bottleneck  verdict"]
        for r in self.ranks:
            mark = "*" if r.rank == self.slowest else " "
            lines.append(
                f"{mark} {r.rank:4d} {r.wait_share:5.0%} {r.samples_per_s:10.1f} "
                f"{r.batches_per_s:10.1f}  {r.bottleneck or '-':10s}  {r.hint}"
            )
        slow = self.ranks[self.slowest]
        lines.append(
            f"slowest: rank {self.slowest} ({self.stage or 'no batch yet'}): "
            f"{slow.wait_s:.1f} s of {slow.wall_s:.1f} s waiting for data"
        )
        return "\n".join(lines)


# The last epoch logged per loader (log=True logs once per loader and epoch).
_LOGGED: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def gather_statistics(loader: Any, group: Any = None, *, log: bool = False) -> GatheredStatistics:
    """Gather every rank's ``loader.statistics()`` and name the slowest rank and its stage.

    A collective over ``group`` (the default group if None): every rank of it calls this at
    the same step boundary. It sends a few numbers and the verdict's sentence per rank.

    Args:
        loader: this rank's loader (anything with aioloader's ``statistics()``).
        group: the ``torch.distributed`` group to gather over (the data-parallel group, say).
        log: log the table on the group's rank 0, once per loader and epoch.

    Returns:
        The same :class:`GatheredStatistics` on every rank.

    Raises:
        RuntimeError: no initialised ``torch.distributed`` process group.
    """
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "gather_statistics needs an initialised torch.distributed process group: call "
            "init_process_group first (each rank's own numbers are loader.statistics())"
        )
    stats = loader.statistics().epoch_stats
    mine = (
        stats.epoch,
        float(stats.wall_s),
        float(stats.wait_share),
        float(stats.samples_per_s),
        float(stats.batches_per_s),
        stats.bottleneck,
        stats.hint,
    )
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    ranks = tuple(RankStatistics(rank, *values) for rank, values in enumerate(gathered))
    slowest = max(ranks, key=lambda r: (r.wait_s, -r.samples_per_s, -r.rank)).rank
    result = GatheredStatistics(ranks, slowest, ranks[slowest].bottleneck)
    if log and dist.get_rank(group) == 0 and _LOGGED.get(loader, -1) != stats.epoch:
        _LOGGED[loader] = stats.epoch
        level = logging.WARNING if result.needs_action else logging.INFO
        distributed_log.log(level, "epoch %s across %d ranks:\n%s", stats.epoch, world, result)
    return result
