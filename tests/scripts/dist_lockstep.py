"""One rank of a real gloo job of 4: streams of unequal shares under equal steps, the slow rank
named, data-parallel groups. Reports what this rank read, as JSON, for
``tests/test_distributed_lockstep.py`` to compare across ranks.

Run by the test (one process per rank) with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``GLOO_SOCKET_IFNAME`` and ``PYTHONPATH`` holding ``tests/``::

    python tests/scripts/dist_lockstep.py REPORT.json

As in ``dist_ranks.py``, a case that raises records the error and the next one runs, and every
case starts together on every rank (a barrier).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist
from datasets import (
    AsyncStream,
    Counted,
    Range,
    Resumable,
    Stream,
    TorchDraws,
    keep,
    tar_sample,
    tar_shard,
)
from torch.nn.parallel import DistributedDataParallel

import aioloader._sampling._lockstep as lockstep_module
from aioloader import DataLoader
from aioloader._sampling import Lockstep
from aioloader.distributed import gather_statistics
from aioloader.sources import TarDataset

# Bounds each collective of this rank (the agreement's own group has its own, longer bound:
# a case that hangs there is ended by the test's limit on the whole job).
COLLECTIVE_TIMEOUT = timedelta(seconds=90)
SHORT_AGREEMENT_S = 1.0  # the agreement's bound, lowered for the rank-0-only case

#: The length of each rank's copy of the "uneven" stream: the loader keeps items r, r + 4, ...
#: of it, so the shares are 10, 3, 6 and 2 items long (3, 1, 2 and 1 batches of 4).
UNEVEN = (40, 13, 27, 8)
CAP_PREFETCH, CAP_EPOCHS = 3, 6  # at most 3 batches carried across 6 epochs
ZIP_ITEMS = 40  # rank r's copy has 40 + r items: a share of 10, five batches of 2, on each
#: The elastic case: a map dataset's length, and the batches every rank takes before the cut.
ELASTIC_N = 45
CUTS = (1, 2)  # of the 3 batches of 4 each rank has (45 samples, 12 a rank)
#: The "crossed" case: two loaders whose first epochs start in the opposite order on odd ranks;
#: each rank's share of the first is 3 batches of 2, of the second 1.
CROSSED = (24, 8)
PEEK_ITEMS = 32  # the "peeked" case: a share of 8 items, 4 batches of 2, on every rank
MID_PREFETCH = 4  # the "carried_mid_epoch" case: rank 0 carries up to 4 batches
CLOSE_S = 4.0  # how long the "end_cancelled" case's stream takes to close when cut short
#: Tar shards of 2 to 9 samples: each rank reads whole shards of its own, of unequal sizes.
TAR_SHARDS = 9
#: The "subgroups" case: each rank's copy of the stream of the loader of ranks 0-1 (shares of
#: 5 and 2 batches of 2), then of the loader of ranks 0-2 (shares of 4, 2 and 3 batches of 2).
SUBGROUP_STREAMS = ((20, 7), (24, 10, 17))
FORK_ALARM_S = 20  # the forked child's alarm: a hang there ends it with SIGALRM, reported


def tar_size(shard: int) -> int:
    return 2 + (shard * 5) % 8


class Timed(Range):
    """``dataset[i] == i`` after ``delay`` seconds (a rank slowed on purpose sleeps longer)."""

    def __init__(self, n: int, delay: float) -> None:
        super().__init__(n)
        self.delay = delay

    def __getitem__(self, index: int) -> int:
        time.sleep(self.delay)
        return super().__getitem__(index)


class SlowToClose:
    """An async stream of ``0 .. n-1`` whose reader, when closed before its end, takes
    ``CLOSE_S`` to hang up (a remote reader): closing an epoch cut short takes that long."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def __aiter__(self) -> Any:
        try:
            for i in range(self.n):
                await asyncio.sleep(0)
                yield i
        except (GeneratorExit, asyncio.CancelledError):
            await asyncio.shield(asyncio.sleep(CLOSE_S))
            raise


class Flag(logging.Handler):
    """Sets ``event`` once a record whose message holds ``text`` is emitted (on the loop's
    thread: the epoch logs from its consumer)."""

    def __init__(self, text: str, event: asyncio.Event) -> None:
        super().__init__(logging.DEBUG)
        self.text = text
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.levelname} {record.getMessage()}")


@contextlib.contextmanager
def observed(report: dict[str, Any]) -> Iterator[None]:
    logger = logging.getLogger("aioloader.distributed")
    handler = Records()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    except Exception:
        report["error"] = traceback.format_exc()
    finally:
        logger.removeHandler(handler)
    report["log"] = handler.messages


def items(batch: Any) -> list[Any]:
    """A batch's samples as JSON-able values (ints, or a tar sample's key)."""
    out = []
    for sample in batch:
        if isinstance(sample, dict):
            out.append(sample["key"])
        else:
            out.append(int(sample))
    return out


def train(loader: DataLoader, epochs: int) -> dict[str, Any]:
    """A DDP training loop on CPU over ``epochs`` epochs: the steps and samples of each."""
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    per_epoch = []
    for _ in range(epochs):
        seen: list[list[Any]] = []
        for batch in loader:
            got = items(batch)
            x = torch.tensor([[float(len(got))]])
            loss = model(x).pow(2).mean()  # DDP's gradient all-reduce in backward()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen.append(got)
        per_epoch.append(seen)
    stats = loader.statistics()
    return {
        "epochs": per_epoch,
        "leftover_batches": stats.leftover_batches,
        "leftover_samples": stats.leftover_samples,
        "dropped_batches": stats.dropped_batches,
        "dropped_samples": stats.dropped_samples,
    }


def equal_steps_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if "equal-steps" in t.name]


def case(reports: dict[str, Any], name: str, body: Callable[[dict[str, Any]], None]) -> None:
    report: dict[str, Any] = {}
    with observed(report):
        body(report)
    reports[name] = report


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    reports: dict[str, Any] = {"pid": os.getpid(), "rank": rank, "world": world, "workers": []}

    def uneven(report: dict[str, Any]) -> None:
        # A user's stream that ends at a different point on each rank, in threads and in
        # worker processes, carried and dropped.
        for name, workers, leftover in (
            ("thread_carry", 0, "carry"),
            ("workers_carry", 2, "carry"),
            ("thread_drop", 0, "drop"),
        ):
            with DataLoader(
                Stream(UNEVEN[rank]), batch_size=4, num_workers=workers, leftover=leftover
            ) as loader:
                report[name] = train(loader, 2)
                reports["workers"].extend(loader.worker_pids)

    def async_uneven(report: dict[str, Any]) -> None:
        async def run() -> list[list[list[int]]]:
            async with DataLoader(AsyncStream(UNEVEN[rank]), batch_size=4) as loader:
                epochs = []
                for _ in range(2):
                    epochs.append([items(b) async for b in loader])
                    total = torch.ones(1)
                    dist.all_reduce(total)  # (a collective between epochs: all still there)
                return epochs

        report["epochs"] = asyncio.run(run())

    def tar(report: dict[str, Any]) -> None:
        directory = os.path.join(os.path.dirname(out), f"tar-rank{rank}")
        os.makedirs(directory, exist_ok=True)
        paths = []
        for shard in range(TAR_SHARDS):
            paths.append(os.path.join(directory, f"{shard}.tar"))
            with open(paths[-1], "wb") as f:
                f.write(tar_shard(shard, tar_size(shard)))
        dataset = TarDataset(paths, decode=tar_sample, shuffle=True, shuffle_buffer=4, seed=1)
        with DataLoader(dataset, batch_size=3, num_workers=2, collate_fn=keep) as loader:
            report.update(train(loader, 2))
            reports["workers"].extend(loader.worker_pids)

    def left_early(report: dict[str, Any]) -> None:
        # Ranks 1-3 leave their first epoch after one batch (a break); rank 0 wants two: the
        # others' leaving ends its epoch at their step. The next epoch is whole and in step.
        with DataLoader(Stream(UNEVEN[rank]), batch_size=4, num_workers=2) as loader:
            first = []
            for batch in loader:
                first.append(items(batch))
                if len(first) == (2 if rank == 0 else 1):
                    break
            report["first"] = first
            report["after"] = train(loader, 1)["epochs"][0]
            reports["workers"].extend(loader.worker_pids)

    def zip_self(report: dict[str, Any]) -> None:
        # Two epochs of one loader open at once under equal steps: refused at once (never a
        # first epoch silently cut short); the first goes on, and a later epoch is whole.
        with DataLoader(Stream(ZIP_ITEMS + rank), batch_size=2) as loader:
            first = iter(loader)
            report["head"] = items(next(first))
            try:
                report["second"] = items(next(iter(loader)))
            except RuntimeError as exc:
                report["refused"] = str(exc)
            report["rest"] = [items(b) for b in first]
            report["after"] = train(loader, 1)["epochs"][0]

    def collected(report: dict[str, Any]) -> None:
        # A loader dropped without close() after an uneven epoch (some ranks carry batches):
        # its finalizer closes the agreement (thread, group, carried batches); nothing of it
        # stays alive, its group's connections to the other ranks included.
        def connections() -> set[tuple[Any, Any]]:
            # The loader's gloo group is not torch's (never registered): its sockets, each by
            # its two ends. Compared as sets: a count went negative where a connection of an
            # earlier case (another rank's, closing late) was still there at the start.
            return {
                (c.laddr, c.raddr)
                for c in psutil.Process().net_connections(kind="tcp")
                if c.status == psutil.CONN_ESTABLISHED
            }

        before = connections()
        loader = DataLoader(Stream(UNEVEN[rank]), batch_size=2)
        report["steps"] = sum(1 for _ in loader)
        report["threads_while_open"] = equal_steps_threads()
        report["connections_while_open"] = len(connections() - before)
        # Every rank counted before any lets its loader go: a rank done first closed its
        # group's sockets while a slower one counted (2 of 3 there, on busy cores).
        dist.barrier()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # unclosed, on purpose
            del loader
            gc.collect()
        deadline = time.monotonic() + 10
        while equal_steps_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        gc.collect()
        report["threads_after"] = equal_steps_threads()
        report["locksteps_after"] = sum(1 for o in gc.get_objects() if isinstance(o, Lockstep))
        report["connections_after"] = len(connections() - before)

    def closed_behind_jobs(report: dict[str, Any]) -> None:
        # Rank 0 leaves its first epoch after one batch and closes the loader while its
        # agreement thread still has steps queued (the others' consumers are a second behind):
        # those steps run on the loader's group after the close, never on a second group of
        # this rank alone, so the next loader of every rank pairs with the others' next one.
        with DataLoader(Stream(40), batch_size=2, prefetch=2) as first:
            it = iter(first)
            report["head"] = items(next(it))
            if rank != 0:
                time.sleep(1.0)
                report["rest"] = [items(b) for b in it]
            del it
        with DataLoader(Stream(8), batch_size=2) as second:
            report["next"] = [items(b) for b in second]

    def crossed(report: dict[str, Any]) -> None:
        # Two loaders built in the same order on every rank; their first epochs start in the
        # opposite order on odd ranks (an evaluation loop begun before training there): each
        # pairs with the same loader of the others, never crossed.
        async def run() -> dict[str, list[list[int]]]:
            async with (
                DataLoader(Stream(CROSSED[0]), batch_size=2) as a,
                DataLoader(Stream(CROSSED[1]), batch_size=2) as b,
            ):

                async def epoch(loader: DataLoader) -> list[list[int]]:
                    return [items(batch) async for batch in loader]

                order = (a, b) if rank % 2 == 0 else (b, a)
                first = asyncio.ensure_future(epoch(order[0]))
                await asyncio.sleep(0.5)  # its agreement has begun before the other's
                second = asyncio.ensure_future(epoch(order[1]))
                await asyncio.wait_for(asyncio.gather(first, second), 60)
                got = {"a": first.result(), "b": second.result()}
                if rank % 2:
                    got = {"a": got["b"], "b": got["a"]}
                return got

        report.update(asyncio.run(run()))

    def past_the_end(report: dict[str, Any]) -> None:
        # Rank 0's stream breaks right after its first batch, the others' shares are one
        # batch: the failed batch is past the agreed end (step 1). Its error is logged, not
        # swallowed; the epoch ends at step 1 everywhere.
        stream = Stream(40, fail_at=8) if rank == 0 else Stream(8)
        with DataLoader(stream, batch_size=2) as loader:
            report["epoch"] = [items(b) for b in loader]

    def end_cancelled(report: dict[str, Any]) -> None:
        # Rank 0's share is longer; its consumer is cancelled at the agreed end while the
        # epoch closes (its stream takes CLOSE_S to hang up): what it read past the end is
        # settled first, so it is carried (handed first in the next epoch), not lost.
        logger = logging.getLogger("aioloader.distributed")

        async def run() -> None:
            settled = asyncio.Event()
            flag = Flag("ends at step", settled)
            logger.addHandler(flag)
            try:
                await epochs(settled)
            finally:
                logger.removeHandler(flag)

        async def epochs(settled: asyncio.Event) -> None:
            dataset = SlowToClose(40 if rank == 0 else 8)
            async with DataLoader(dataset, batch_size=2) as loader:
                it = aiter(loader)
                report["head"] = items(await anext(it))
                if rank == 0:
                    ending = asyncio.ensure_future(anext(it))
                    flagged = asyncio.ensure_future(settled.wait())
                    # Cancelled once settled (then closing, for CLOSE_S), or at the latest
                    # a second before it could have closed: before a settle that waited for it.
                    await asyncio.wait(
                        [ending, flagged], timeout=CLOSE_S - 1, return_when=asyncio.FIRST_COMPLETED
                    )
                    flagged.cancel()
                    report["settled_before_cancel"] = settled.is_set()
                    ending.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await ending
                try:
                    report["more"] = items(await anext(it))
                except StopAsyncIteration:
                    report["ended"] = True
                report["next"] = [items(b) async for b in loader]
                stats = loader.statistics()
                report["leftover"] = stats.leftover_batches
                report["dropped"] = stats.dropped_batches
                report["cut_epochs"] = stats.cut_epochs
                report["unread_samples"] = stats.unread_samples

        asyncio.run(run())

    def carried_resume(report: dict[str, Any]) -> None:
        # Each rank saves its own state after an uneven epoch (some carry batches into the
        # next) and resumes from it in a new loader: the carried batches come first there, as
        # in the loader that saved it.
        with DataLoader(Stream(UNEVEN[rank]), batch_size=4) as first:
            report["first"] = [items(b) for b in first]
            state = first.state_dict()
        report["saved"] = len(state.get("equal_steps", {}).get("carried", []))
        with DataLoader(Stream(UNEVEN[rank]), batch_size=4) as resumed:
            resumed.load_state_dict(state)
            report["next"] = [items(b) for b in resumed]

    def unread(report: dict[str, Any]) -> None:
        # A stream that knows its length: what a longer share leaves unread at the agreed end
        # is counted (and logged).
        n = 400 if rank == 0 else 8
        with DataLoader(Counted(n), batch_size=2, prefetch=2) as loader:
            report["epoch"] = [items(b) for b in loader]
            stats = loader.statistics()
            report["leftover_samples"] = stats.leftover_samples
            report["cut_epochs"] = stats.cut_epochs
            report["unread_samples"] = stats.unread_samples
            report["share"] = len(range(rank, n, world))

    def capped(report: dict[str, Any]) -> None:
        # Rank 0's share is always longer (50 batches against 1): it reads ahead past every
        # epoch's end; what it carries stays within prefetch, the excess counted as dropped.
        loader = DataLoader(Stream(400 if rank == 0 else 8), batch_size=2, prefetch=CAP_PREFETCH)
        report["steps"] = [sum(1 for _ in loader) for _ in range(CAP_EPOCHS)]
        stats = loader.statistics()
        report["leftover"] = stats.leftover_batches
        report["dropped_open"] = stats.dropped_batches
        loader.close()  # what is still carried is released now, counted as dropped
        report["dropped_closed"] = loader.statistics().dropped_batches

    def alone(report: dict[str, Any]) -> None:
        # Loaders built on rank 0 only: nothing waits for the other ranks.
        if rank == 0:
            with DataLoader(Stream(10), batch_size=4, shard=False) as loader:
                report["whole"] = [i for b in loader for i in items(b)]
            with DataLoader(Stream(10), batch_size=4, equal_steps=False) as loader:
                report["share"] = [i for b in loader for i in items(b)]

    def slow_rank(report: dict[str, Any]) -> None:
        # The last rank's samples take 3x as long; an all-reduce per step, as DDP's.
        slow = world - 1
        delay = 0.006 if rank == slow else 0.002
        with DataLoader(Timed(160, delay), batch_size=4, num_workers=0) as loader:
            for _ in loader:
                total = torch.ones(1)
                dist.all_reduce(total)
            gathered = gather_statistics(loader, log=True)
            again = gather_statistics(loader, log=True)  # the same epoch: logged once
        report["slowest"] = gathered.slowest
        report["stage"] = gathered.stage
        report["table"] = str(gathered)
        report["ranks"] = [r.rank for r in gathered.ranks]
        report["again"] = again.slowest

    def dp_groups(report: dict[str, Any]) -> None:
        # Model-parallel pairs (0, 1) and (2, 3); data-parallel groups (0, 2) and (1, 3).
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mine = groups[rank % 2]
        assert isinstance(mine, dist.ProcessGroup)  # a member: not the non-member marker
        with DataLoader(Range(24), batch_size=4, shuffle=True, seed=3, shard=mine) as loader:
            report["map"] = [items(b) for b in loader]
        with DataLoader(Stream(30), batch_size=4, shard=mine) as loader:
            report["stream"] = [items(b) for b in loader]
        with DataLoader(
            TorchDraws(16), batch_size=4, shuffle=True, seed=5, num_workers=2, shard=mine
        ) as loader:
            report["draws"] = [[float(d) for d in b[1]] for b in loader]
            reports["workers"].extend(loader.worker_pids)

    def elastic(report: dict[str, Any]) -> None:
        # Epoch 0 of a shuffled map dataset on 4 ranks x 2 workers, cut after CUTS batches;
        # rank 0's state resumes on 2 ranks x 1 worker, 3 x 2 and 4 x 0 (the smaller worlds
        # are groups of the first ranks, as a job restarted on fewer machines would be).
        two, three = dist.new_group([0, 1]), dist.new_group([0, 1, 2])
        topologies = (("2x1", two, 2, 1), ("3x2", three, 3, 2), ("4x0", None, 4, 0))

        def make(group: Any, workers: int) -> DataLoader:
            shard = True if group is None else group
            return DataLoader(
                Range(ELASTIC_N),
                batch_size=4,
                shuffle=True,
                seed=9,
                num_workers=workers,
                shard=shard,
            )

        for taken in CUTS:
            with make(None, 2) as first:
                it = iter(first)
                head = [i for _ in range(taken) for i in items(next(it))]
                state = first.state_dict()
                del it
                reports["workers"].extend(first.worker_pids)
            shared = [state]
            dist.broadcast_object_list(shared, src=0)
            result: dict[str, Any] = {"head": head}
            for name, group, size, workers in topologies:
                if rank >= size:
                    continue
                with make(group, workers) as resumed:
                    resumed.load_state_dict(shared[0])
                    length = len(resumed)  # the batches this rank's rest of the epoch has
                    rest_batches = [items(b) for b in resumed]
                    rest = [i for b in rest_batches for i in b]
                    following = [i for b in resumed for i in items(b)]
                with make(group, 0) as fresh:
                    fresh.set_epoch(1)
                    uninterrupted = [i for b in fresh for i in items(b)]
                result[name] = {
                    "rest": rest,
                    "next": following,
                    "fresh1": uninterrupted,
                    "len": length,
                    "rest_batches": len(rest_batches),
                }
            report[str(taken)] = result

    def subgroups(report: dict[str, Any]) -> None:
        # Stream loaders of two data-parallel groups one after the other: ranks 0-1 read one
        # of new_group([0, 1]), then ranks 0-2 one of new_group([0, 1, 2]), which rank 2
        # builds as its first of that group while ranks 0-1 built one of another group before
        # it. Each agrees over its own group (it sat in the agreement's making until the
        # bound when the loaders were keyed by one count across groups).
        two, three = dist.new_group([0, 1]), dist.new_group([0, 1, 2])
        start = time.monotonic()
        for name, group, streams in (
            ("two", two, SUBGROUP_STREAMS[0]),
            ("three", three, SUBGROUP_STREAMS[1]),
        ):
            if rank < len(streams):
                with DataLoader(Stream(streams[rank]), batch_size=2, shard=group) as loader:
                    report[name] = [items(b) for b in loader]
            dist.barrier()
        report["elapsed"] = time.monotonic() - start

    def forked(report: dict[str, Any]) -> None:
        # Each rank forks after an epoch of a stream loader under equal steps (its agreement's
        # thread and group exist): the child's epoch of its copy refuses at once, naming both
        # processes (its process group is the parent's); closing the copy and exiting
        # normally there do not wait on the parent's group; the parent's next epoch agrees
        # with the other ranks as before.
        with DataLoader(Stream(UNEVEN[rank]), batch_size=4) as loader:
            report["before"] = [items(b) for b in loader]
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(FORK_ALARM_S)
                os.close(read_fd)
                started = time.monotonic()
                child: dict[str, Any]
                try:
                    child = {"batches": sum(1 for _ in loader)}
                except Exception as exc:
                    child = {"raised": [type(exc).__name__, str(exc)]}
                child["elapsed"] = time.monotonic() - started
                child["pid"] = os.getpid()
                with os.fdopen(write_fd, "w") as pipe:
                    json.dump(child, pipe)
                loader.close()
                del loader
                gc.collect()
                sys.exit(0)  # a normal exit: the interpreter clears what it holds
            os.close(write_fd)
            with os.fdopen(read_fd) as pipe:
                text = pipe.read()  # until the child closes its end (its alarm bounds it)
            deadline = time.monotonic() + FORK_ALARM_S + 5
            status = None
            while status is None and time.monotonic() < deadline:
                done, code = os.waitpid(pid, os.WNOHANG)
                if done:
                    status = os.waitstatus_to_exitcode(code)
                else:
                    time.sleep(0.05)
            if status is None:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            report["child"] = json.loads(text) if text else None
            report["child_status"] = status
            report["after"] = [items(b) for b in loader]

    def store_keys(report: dict[str, Any]) -> None:
        # Each rank deletes its rendezvous key once the group formed: a loader leaves nothing
        # in the default store (the keys hold every rank's addresses: O(world^2) a loader).
        store = dist.distributed_c10d._get_default_store()
        before = store.num_keys()
        dist.barrier()
        with DataLoader(Stream(UNEVEN[rank]), batch_size=4) as loader:
            report["steps"] = [sum(1 for _ in loader) for _ in range(2)]
        dist.barrier()
        report["keys_added"] = store.num_keys() - before

    def peeked(report: dict[str, Any]) -> None:
        # Rank 0 peeks at a batch (next(iter(loader)), the iterator dropped: an extra epoch 0
        # on rank 0 only), then every rank runs epochs 0 and 1 with set_epoch: rank 0's epoch 0
        # meets the others' epoch 1. That pairing fails on every rank, naming both epochs,
        # and a later epoch fails at once with it as its cause (never pairs wrongly again).
        with DataLoader(Stream(PEEK_ITEMS), batch_size=2) as loader:
            if rank == 0:
                report["peek"] = items(next(iter(loader)))
            outcomes: list[dict[str, Any]] = []
            for epoch in range(2):
                loader.set_epoch(epoch)
                got: list[list[int]] = []
                outcome: dict[str, Any] = {"batches": got}
                started = time.monotonic()
                try:
                    for batch in loader:
                        got.append(items(batch))
                except RuntimeError as exc:
                    outcome["error"] = str(exc)
                    outcome["cause"] = str(exc.__cause__) if exc.__cause__ else None
                outcome["elapsed"] = time.monotonic() - started
                outcomes.append(outcome)
            report["epochs"] = outcomes

    def carried_mid_epoch(report: dict[str, Any]) -> None:
        # Rank 0's share is long, the others' one batch (they start a second late, so rank 0
        # has read ahead): rank 0 carries up to prefetch batches into epoch 1. After one batch
        # of epoch 1 its state holds those it has not handed yet (not the one it has); a
        # loader resumed from it hands them first.
        def make() -> DataLoader:
            return DataLoader(
                Resumable(400 if rank == 0 else 8), batch_size=2, prefetch=MID_PREFETCH
            )

        def carried(state: dict[str, Any]) -> list[list[int]]:
            return [items(c[0]) for c in state.get("equal_steps", {}).get("carried", [])]

        with make() as first:
            if rank != 0:
                time.sleep(1.0)
            report["epoch0"] = [items(b) for b in first]
            report["between"] = carried(first.state_dict())
            it = iter(first)
            report["head1"] = items(next(it))
            mid = first.state_dict()
            report["mid"] = carried(mid)
            del it  # left after one batch: the carried ones not handed are kept for the next
            report["after_break"] = carried(first.state_dict())
        with make() as resumed:
            resumed.load_state_dict(mid)
            report["loaded"] = carried(resumed.state_dict())
            report["resumed"] = [[items(b) for b in resumed] for _ in range(2)]

    def rank0_only(report: dict[str, Any]) -> None:
        # A sharded stream iterated on rank 0 only (an evaluation loader built without
        # shard=False): the agreement's group never forms; rank 0 fails after the (lowered)
        # bound, naming the way out, and does not hang. Last: rank 0's group count is ahead.
        # Its next epoch fails at once with that cause (no second rendezvous under the same
        # keys), and rank 0's rendezvous key is deleted.
        lockstep_module.AGREEMENT_TIMEOUT_S = SHORT_AGREEMENT_S
        if rank == 0:
            store = dist.distributed_c10d._get_default_store()
            before = store.num_keys()
            start = time.monotonic()
            with DataLoader(Stream(20), batch_size=2) as loader:
                try:
                    report["batches"] = sum(1 for _ in loader)
                except Exception as exc:
                    report["raised"] = [type(exc).__name__, str(exc)]
                report["elapsed"] = time.monotonic() - start
                again = time.monotonic()
                try:
                    report["batches_again"] = sum(1 for _ in loader)
                except Exception as exc:
                    report["again"] = [type(exc).__name__, str(exc), str(exc.__cause__)]
                report["again_elapsed"] = time.monotonic() - again
            report["keys_added"] = store.num_keys() - before

    for name, body in (
        ("elastic", elastic),
        ("uneven", uneven),
        ("async_uneven", async_uneven),
        ("tar", tar),
        ("left_early", left_early),
        ("zip_self", zip_self),
        ("collected", collected),
        ("closed_behind_jobs", closed_behind_jobs),
        ("crossed", crossed),
        ("past_the_end", past_the_end),
        ("end_cancelled", end_cancelled),
        ("unread", unread),
        ("carried_resume", carried_resume),
        ("capped", capped),
        ("alone", alone),
        ("store_keys", store_keys),
        ("peeked", peeked),
        ("carried_mid_epoch", carried_mid_epoch),
        ("slow_rank", slow_rank),
        ("dp_groups", dp_groups),
        ("subgroups", subgroups),
        ("forked", forked),
        ("rank0_only", rank0_only),
    ):
        case(reports, name, body)
        dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(reports, f)


if __name__ == "__main__":
    main()
