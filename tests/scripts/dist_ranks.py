"""One rank of a real gloo job: builds loaders the way a training script does and reports what
this rank read, as JSON, for ``tests/test_distributed.py`` to compare across ranks.

Run by the test (one process per rank) with the usual environment: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` (127.0.0.1), ``MASTER_PORT`` (a free port), ``GLOO_SOCKET_IFNAME`` (loopback)
and ``PYTHONPATH`` holding ``tests/`` (worker processes import ``datasets`` by name)::

    python tests/scripts/dist_ranks.py REPORT.json

Every case records the warnings and the ``aioloader.distributed`` log records it caused; a case
that raises records the error and the next one runs (each case is the same on every rank, so a
failure does not leave one rank waiting in a collective the others skipped).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data as tud
from datasets import (
    AsyncStream,
    Counted,
    Range,
    SelfSharded,
    ShuffledStream,
    Stream,
    TorchDraws,
    keep,
    parquet_bytes,
    parquet_row,
    tar_sample,
    tar_shard,
)

from aioloader import BatchSampler, DataLoader, DistributedSampler, SequentialSampler
from aioloader.sources import ParquetDataset, TarDataset

# Bounds each collective (and so each case) of this rank: a rank that waits longer for its peer
# fails instead of hanging. The test's own limit on the whole process is wider.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
STACKS_AFTER_S = 50.0  # a rank waiting this long at a barrier dumps its threads' stacks

#: Rows of the Parquet files of the "parquet" case (row groups of 3: 2, 3, 1 and 3 of them).
PARQUET_ROWS = (5, 7, 3, 9)


class Records(logging.Handler):
    """Keeps the messages of the records it handles."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.getMessage()}")


@contextlib.contextmanager
def observed(report: dict[str, Any]) -> Iterator[None]:
    """Record into ``report`` the warnings and distributed log records of the block, and the
    error it raised, if any."""
    logger = logging.getLogger("aioloader.distributed")
    handler = Records()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield
            except Exception:
                report["error"] = traceback.format_exc()
    finally:
        logger.removeHandler(handler)
    report["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    report["log"] = handler.messages


def lists(loader: DataLoader) -> list[list[int]]:
    """One epoch's batches, as lists of ints."""
    return [[int(i) for i in batch] for batch in loader]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def case(reports: dict[str, Any], name: str, body: Callable[[dict[str, Any]], None]) -> None:
    report: dict[str, Any] = {}
    with observed(report):
        body(report)
    reports[name] = report


def main() -> None:
    out = sys.argv[1]
    reports: dict[str, Any] = {"pid": os.getpid(), "worker_pids": []}

    early_holder: list[DataLoader] = []
    early_streams: list[DataLoader] = []

    def build_early(report: dict[str, Any]) -> None:
        # No process group yet. One loader is only built (as a script hands it to Lightning's
        # fit(), which makes the group); the other also runs an epoch before the group exists.
        early_holder.append(DataLoader(Range(10), batch_size=5))
        # A stream whose worker processes start at construction, before the group too.
        early_streams.append(DataLoader(Stream(24), batch_size=4, num_workers=2))
        started = DataLoader(Range(10), batch_size=5)
        report["before"] = lists(started)
        early_holder.append(started)
        report["draws_before"] = draws()

    def draws() -> list[list[float]]:
        # Each batch's draws from torch's generator in worker processes (the same seed= on
        # every rank, as the README asks): what a random crop or flip would use.
        with DataLoader(TorchDraws(16), batch_size=4, shuffle=True, seed=100, num_workers=2) as dl:
            return [[float(d) for d in batch[1]] for batch in dl]

    case(reports, "early_build", build_early)
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    reports["rank"], reports["world"] = rank, world

    def early(report: dict[str, Any]) -> None:
        with early_holder.pop() as started:
            report["started_epochs"] = [lists(started), lists(started)]
        with early_holder.pop() as loader:
            report["len"] = len(loader)
            report["epochs"] = [lists(loader), lists(loader)]
        with early_streams.pop() as stream:
            report["stream_epochs"] = [flat(lists(stream)), flat(lists(stream))]

    def auto(report: dict[str, Any]) -> None:
        # No sampler, no seed: sharded, shuffled by the default share seed on every rank.
        with DataLoader(Range(23), batch_size=4, shuffle=True) as loader:
            report["len"] = len(loader)
            report["epochs"] = [lists(loader), lists(loader)]
            loader.set_epoch(0)
            report["again0"] = lists(loader)
            report["seed"] = loader.seed
            report["sampler_seed"] = loader.sampler.seed
            report["sampler"] = type(loader.sampler).__name__

    def seeded(report: dict[str, Any]) -> None:
        # Every rank passes the same seed: it orders the shares.
        with DataLoader(Range(40), batch_size=4, shuffle=True, seed=100) as loader:
            loader.set_epoch(5)
            report["epoch5"] = lists(loader)
            report["epoch6"] = lists(loader)
            report["seed"] = loader.seed
        with DataLoader(Range(40), batch_size=4, shuffle=True, seed=100) as fresh:
            fresh.set_epoch(5)
            report["fresh5"] = lists(fresh)

    def rank0_only(report: dict[str, Any]) -> None:
        # An evaluation loader built on rank 0 alone: nothing waits for the other rank.
        if rank == 0:
            with DataLoader(Range(10), batch_size=2, shuffle=True) as loader:
                report["epoch"] = lists(loader)

    def sequential(report: dict[str, Any]) -> None:
        with DataLoader(Range(11), batch_size=2) as loader:
            report["epoch"] = lists(loader)
            report["len"] = len(loader)

    def drop_last(report: dict[str, Any]) -> None:
        with DataLoader(Range(23), batch_size=4, shuffle=True, drop_last=True, seed=3) as loader:
            report["epoch"] = lists(loader)
            report["len"] = len(loader)

    def step_locked(report: dict[str, Any]) -> None:
        # A collective per batch, as DDP's backward does: it would hang if the counts differed.
        steps = 0
        with DataLoader(Range(29), batch_size=3, shuffle=True, num_workers=0) as loader:
            for _ in range(2):
                for _batch in loader:
                    total = torch.ones(1)
                    dist.all_reduce(total)
                    steps += 1
        report["steps"] = steps

    def resume(report: dict[str, Any]) -> None:
        def make() -> DataLoader:
            return DataLoader(Range(40), batch_size=4, shuffle=True, seed=7)

        with make() as whole:
            lists(whole)
            report["whole"] = lists(whole)  # epoch 1, uninterrupted
        with make() as first:
            lists(first)
            it = iter(first)
            report["taken"] = [[int(i) for i in next(it)] for _ in range(2)]
            state = first.state_dict()
            it.close()
        with make() as second:
            second.load_state_dict(state)
            report["rest"] = lists(second)
        # The state holds no rank: rank 0's resumes this rank's share too (DDP's lockstep).
        shared = [state]
        dist.broadcast_object_list(shared, src=0)
        with make() as third:
            third.load_state_dict(shared[0])
            report["rest_from_rank0"] = lists(third)

    def plain_sampler(report: dict[str, Any]) -> None:
        with DataLoader(Range(12), batch_size=4, sampler=SequentialSampler(12)) as loader:
            report["epoch"] = lists(loader)

    def plain_batch_sampler(report: dict[str, Any]) -> None:
        with DataLoader(Range(12), batch_sampler=[[0, 1], [2, 3]], batch_size=None) as loader:
            report["epoch"] = lists(loader)

    def rank_aware(report: dict[str, Any]) -> None:
        theirs: Any = tud.DistributedSampler(Range(12), shuffle=False)  # type: ignore[arg-type]
        samplers: dict[str, dict[str, Any]] = {
            "torch": {"sampler": theirs},
            "ours": {"sampler": DistributedSampler(12, shuffle=False)},
            "ours_batches": {
                "batch_sampler": BatchSampler(DistributedSampler(12, shuffle=False), 4),
                "batch_size": None,
            },
        }
        for name, kwargs in samplers.items():
            kwargs.setdefault("batch_size", 4)
            with DataLoader(Range(12), **kwargs) as loader:
                report[name] = flat(lists(loader))

    def shard_off(report: dict[str, Any]) -> None:
        with DataLoader(Range(12), batch_size=4, shuffle=True, seed=1, shard=False) as loader:
            report["epoch"] = flat(lists(loader))
        with DataLoader(Stream(12), batch_size=4, shard=False) as loader:
            report["stream"] = flat(lists(loader))

    def shard_true_refuses(report: dict[str, Any]) -> None:
        try:
            DataLoader(Range(12), batch_size=4, sampler=[0, 1, 2], shard=True)
        except ValueError as exc:
            report["refused"] = str(exc)

    def streams(report: dict[str, Any]) -> None:
        for name, dataset, workers in (
            ("workers", Stream(37), 2),
            ("self_sharded", SelfSharded(37), 2),
            ("shuffled", ShuffledStream(37, "random"), 2),  # ordered alike on every rank
            ("thread", Stream(37), 0),
        ):
            with DataLoader(dataset, batch_size=4, num_workers=workers) as loader:
                report[name] = [flat(lists(loader)), flat(lists(loader))]
                reports["worker_pids"].extend(loader.worker_pids)

        async def pull() -> list[int]:
            async with DataLoader(AsyncStream(37), batch_size=4) as loader:
                return [int(i) for batch in [b async for b in loader] for i in batch]

        report["async"] = asyncio.run(pull())
        with DataLoader(Counted(37), batch_size=4) as loader:
            report["counted_len"] = len(loader)
            report["counted_batches"] = len(lists(loader))

    def epochs_and_resume(
        make: Callable[[int], DataLoader], key: str, report: dict[str, Any]
    ) -> None:
        # Two epochs under 2 workers (who decoded what), then epoch 0 stopped after 2 batches
        # without workers and resumed under 2: the stream's state crosses worker counts.
        with make(2) as loader:
            epochs = [[s for b in loader for s in b] for _ in range(2)]
            reports["worker_pids"].extend(loader.worker_pids)
        report["epochs"] = [[s[key] for s in samples] for samples in epochs]
        report["decoded_by"] = sorted({s["pid"] for samples in epochs for s in samples})
        with make(0) as stopped:
            it = iter(stopped)
            report["head"] = [s[key] for _ in range(2) for s in next(it)]
            state = stopped.state_dict()
        with make(2) as resumed:
            resumed.load_state_dict(state)
            report["rest"] = [s[key] for b in resumed for s in b]
            reports["worker_pids"].extend(resumed.worker_pids)

    def tar(report: dict[str, Any]) -> None:
        # Tar shards (TAR_SHARDS of them, 3 to 6 samples each), shuffled, 2 worker processes
        # decoding: each rank reads whole shards of its own, on its loop.
        directory = os.path.join(os.path.dirname(out), f"tar-rank{rank}")
        os.makedirs(directory, exist_ok=True)
        paths = []
        for shard in range(7):
            paths.append(os.path.join(directory, f"{shard}.tar"))
            with open(paths[-1], "wb") as f:
                f.write(tar_shard(shard, 3 + shard % 4))

        def make(workers: int) -> DataLoader:
            ds = TarDataset(paths, decode=tar_sample, shuffle=True, shuffle_buffer=5, seed=1)
            # The split itself, each share read whole: the ranks' shares differ in length, and
            # equal steps (which end them at the shortest) are tested in dist_lockstep.py.
            return DataLoader(
                ds, batch_size=4, num_workers=workers, collate_fn=keep, equal_steps=False
            )

        epochs_and_resume(make, "key", report)

    def parquet(report: dict[str, Any]) -> None:
        # Parquet files (PARQUET_ROWS rows, row groups of 3), shuffled, 2 worker processes
        # decoding: each rank reads whole row groups of its own, on its loop.
        directory = os.path.join(os.path.dirname(out), f"parquet-rank{rank}")
        os.makedirs(directory, exist_ok=True)
        for file, rows in enumerate(PARQUET_ROWS):
            with open(os.path.join(directory, f"part-{file}.parquet"), "wb") as f:
                f.write(parquet_bytes(file, rows, 3))

        def make(workers: int) -> DataLoader:
            ds = ParquetDataset(
                directory, decode=parquet_row, shuffle=True, shuffle_buffer=5, seed=1
            )
            return DataLoader(
                ds, batch_size=4, num_workers=workers, collate_fn=keep, equal_steps=False
            )

        epochs_and_resume(make, "id", report)

    def augment(report: dict[str, Any]) -> None:
        report["draws"] = draws()

    for name, body in (
        ("early", early),
        ("augment", augment),
        ("auto", auto),
        ("seeded", seeded),
        ("rank0_only", rank0_only),
        ("sequential", sequential),
        ("drop_last", drop_last),
        ("step_locked", step_locked),
        ("resume", resume),
        ("plain_sampler", plain_sampler),
        ("plain_batch_sampler", plain_batch_sampler),
        ("rank_aware", rank_aware),
        ("shard_off", shard_off),
        ("shard_true_refuses", shard_true_refuses),
        ("streams", streams),
        ("tar", tar),
        ("parquet", parquet),
    ):
        case(reports, name, body)
        # A rank still waiting here near the barrier's timeout shows every thread's stack in
        # its output (which the test prints when the job fails): where the other rank is stuck.
        faulthandler.dump_traceback_later(STACKS_AFTER_S)
        dist.barrier()  # the next case starts together on every rank
        faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(reports, f)


if __name__ == "__main__":
    main()
