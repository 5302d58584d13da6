"""One rank of a real gloo job of 4: tar shards and Parquet row groups saved mid-epoch on 4
ranks x 2 workers, every rank's state merged, resumed on 2 ranks x 1 worker, 3 x 2 and 4 x 0.
Reports what this rank read, as JSON, for ``tests/test_distributed_elastic.py`` to compare
across ranks.

Run by the test (one process per rank) with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``GLOO_SOCKET_IFNAME`` and ``PYTHONPATH`` holding ``tests/``::

    python tests/scripts/elastic_streams.py CONFIG.json REPORT.json

``CONFIG.json`` names the tar shards and Parquet files (written by the test) and the save
points, each a fraction of the shortest share of the 4 ranks (chosen by Hypothesis in the
test: the job starts once for all of them). Every collective runs under the group's timeout.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from datasets import tar_sample

from aioloader import DataLoader
from aioloader.distributed import merge_states
from aioloader.sources import ParquetDataset, TarDataset

#: Bounds every collective of this job (group creation and the gathers of the states).
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
BATCH = 4
SEED = 9


def items(batch: Any) -> list[Any]:
    """A batch's samples as JSON-able values: a tar sample's key, a Parquet row's id."""
    if "key" in batch:
        return list(batch["key"])
    return [int(i) for i in batch["id"].tolist()]


def main() -> None:
    # A rank still running near the test's limit shows where it waits (the test kills it).
    faulthandler.dump_traceback_later(float(os.environ.get("ELASTIC_STACKS_AFTER_S", 120)))
    with open(sys.argv[1]) as f:
        config = json.load(f)
    out = sys.argv[2]
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    # The smaller jobs are groups of the first ranks, as a job restarted on fewer machines.
    two = dist.new_group([0, 1], timeout=COLLECTIVE_TIMEOUT)
    three = dist.new_group([0, 1, 2], timeout=COLLECTIVE_TIMEOUT)
    topologies = (("2x1", two, 2, 1), ("3x2", three, 3, 2), ("4x0", None, 4, 0))
    report: dict[str, Any] = {"pid": os.getpid(), "rank": rank, "world": world, "workers": []}

    def parquet(*, even_shares: bool) -> ParquetDataset:
        return ParquetDataset(
            config["parquet"],
            columns=["id"],
            shuffle=True,
            shuffle_buffer=4,
            seed=3,
            row_groups_in_flight=2,
            even_shares=even_shares,
        )

    datasets: dict[str, Callable[[], Any]] = {
        "tar": lambda: TarDataset(
            config["tar"],
            decode=tar_sample,
            shuffle=True,
            shuffle_buffer=4,
            seed=3,
            shards_in_flight=2,
        ),
        "parquet": lambda: parquet(even_shares=False),
        "parquet_even": lambda: parquet(even_shares=True),
    }

    def make(kind: str, group: Any, workers: int) -> DataLoader:
        if kind == "parquet_even":
            # Shares evened up front by the footers, under equal steps on every topology (4
            # ranks, and the groups of 2 and 3: the agreement runs over each, bounded by its
            # own timeout): every rank as many steps; the remainder (fewer records than
            # ranks) is dropped, and counted.
            return DataLoader(
                datasets[kind](),
                batch_size=BATCH,
                num_workers=workers,
                seed=SEED,
                shard=True if group is None else group,
                leftover="drop",
            )
        # equal_steps=False: each rank reads its whole share, so that the epoch's records can
        # be counted exactly (with equal steps the longer shares' ends wait for the next
        # epoch); no collective runs in the loaders.
        return DataLoader(
            datasets[kind](),
            batch_size=BATCH,
            num_workers=workers,
            seed=SEED,
            shard=True if group is None else group,
            equal_steps=False,
        )

    def run(kind: str) -> dict[str, Any]:
        result: dict[str, Any] = {}
        with make(kind, None, 0) as whole:
            whole.set_epoch(0)
            mine = [items(b) for b in whole]
            result["whole_dropped"] = whole.statistics().dropped_samples
        result["whole"] = [i for b in mine for i in b]
        lengths: list[Any] = [None] * world
        dist.all_gather_object(lengths, len(mine))
        shortest = min(lengths)
        steps = sorted({min(int(f * shortest), shortest - 1) for f in config["cuts"]})
        result["steps"] = steps
        states: dict[int, Any] = {}
        heads: dict[int, list[Any]] = {}
        with make(kind, None, 2) as first:
            for step in steps:
                first.set_epoch(0)
                it = iter(first)
                heads[step] = [i for _ in range(step) for i in items(next(it))]
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, first.state_dict())
                del it
                states[step] = merge_states(gathered)
            report["workers"].extend(first.worker_pids)
        result["cuts"] = {str(step): {"head": heads[step]} for step in steps}
        for name, group, size, workers in topologies:
            # One topology at a time, the other ranks waiting: a rank outside this one's group
            # would otherwise wait in the next topology's agreement while this one runs.
            dist.barrier()
            if rank >= size:
                continue
            with make(kind, group, 0) as fresh:
                fresh.set_epoch(1)
                uninterrupted = [i for b in fresh for i in items(b)]
            with make(kind, group, workers) as resumed:
                for step in steps:
                    resumed.load_state_dict(states[step])
                    before = resumed.statistics().dropped_samples
                    rest = [items(b) for b in resumed]
                    dropped = resumed.statistics().dropped_samples - before
                    following = [i for b in resumed for i in items(b)]
                    result["cuts"][str(step)][name] = {
                        "rest": [i for b in rest for i in b],
                        "steps": len(rest),
                        "dropped": dropped,
                        "next": following,
                        "fresh": uninterrupted,
                    }
                report["workers"].extend(resumed.worker_pids)
        return result

    kinds = os.environ.get("ELASTIC_KINDS", "tar,parquet,parquet_even").split(",")
    for kind in kinds:
        try:
            report[kind] = run(kind)
        except Exception:
            report[kind] = {"error": traceback.format_exc()}
        dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
