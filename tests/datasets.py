"""The small datasets the loader tests share, one definition each.

Defined at module level so that worker processes can unpickle them by reference (workers
import this module by name: ``tests/`` is on ``sys.path``, and the forkserver passes
``sys.path`` on to its children). Datasets that hold a lock or an event (:class:`Recorder`,
:class:`HangAt`) do not pickle: use them with threads (``num_workers=0`` or
``thread_pool=True``). The fault-injection datasets for worker processes are in
``fault_datasets``.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import threading
import time
from collections import namedtuple
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np
import torch.utils.data

import aioloader
from aioloader import get_worker_info

# How long a blocked read waits for its release at most: it only turns a hang into a failure.
BLOCK_BOUND_S = 10.0


class Range:
    """``dataset[i] == i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return index


class FailAt(Range):
    """Raises ``error_type`` for the indices in ``bad``."""

    def __init__(self, n: int, bad: set[int], error_type: type[Exception] = KeyError) -> None:
        super().__init__(n)
        self.bad = bad
        self.error_type = error_type

    def __getitem__(self, index: int) -> int:
        if index in self.bad:
            raise self.error_type(f"sample {index} is broken")
        return super().__getitem__(index)


class FailOnce(Range):
    """Raises KeyError the first time index ``bad`` is read, then behaves (threads only: a
    worker process would fail on its own copy)."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad
        self.failed = False

    def __getitem__(self, index: int) -> int:
        if index == self.bad and not self.failed:
            self.failed = True
            raise KeyError(index)
        return super().__getitem__(index)


Point = namedtuple("Point", ["x", "y"])


class Nested(Range):
    """Samples with every container kind the default collate handles."""

    def __getitem__(self, index: int) -> Any:  # a dict, not Range's int
        return {
            "image": np.full((2, 3), index, dtype=np.float32),
            "label": index,
            "name": f"item-{index}",
            "pair": (index, float(index) / 2),
            "point": Point(index, -index),
        }


class Slow(Range):
    """Sleeps in ``__getitem__`` and records the order in which indices finished.

    Args:
        n: length.
        delay: seconds to sleep, or a function of the index giving them (a function defined
            at module level, for worker processes).
    """

    def __init__(self, n: int, delay: float | Callable[[int], float]) -> None:
        super().__init__(n)
        self.delay = delay
        self.finished: list[int] = []  # list.append is atomic: threads need no lock for it

    def __getitem__(self, index: int) -> int:
        time.sleep(self.delay(index) if callable(self.delay) else self.delay)
        self.finished.append(index)
        return index


class Recorder(Range):
    """Records every index read and the largest number of reads running at once."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        super().__init__(n)
        self.delay = delay
        self.read: list[int] = []
        self.running = 0
        self.max_running = 0
        self._lock = threading.Lock()

    def __getitem__(self, index: int) -> int:
        with self._lock:
            self.read.append(index)
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            time.sleep(self.delay)
            return index
        finally:
            with self._lock:
                self.running -= 1


class HangAt(Range):
    """Blocks reading index ``bad`` until ``release`` is set (or :data:`BLOCK_BOUND_S`
    passes)."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad
        self.release = threading.Event()

    def __getitem__(self, index: int) -> int:
        if index == self.bad:
            self.release.wait(BLOCK_BOUND_S)
        return index


class AsyncRange:
    """``await dataset[i] == i`` after a short sleep; records concurrency; fails on ``bad``."""

    def __init__(
        self,
        n: int,
        delay: float = 0.0,
        bad: set[int] | None = None,
        error_type: type[Exception] = KeyError,
    ) -> None:
        self.n = n
        self.delay = delay
        self.bad = bad or set()
        self.error_type = error_type
        self.running = 0
        self.max_running = 0

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, index: int) -> int:
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(self.delay)
            if index in self.bad:
                raise self.error_type(f"async sample {index} is broken")
            return index
        finally:
            self.running -= 1


class ShuffledStream:
    """Yields ``0 .. n-1`` in an order it draws itself from the global generators, as user
    streams do without knowing about workers: ``"random"`` shuffles a list up front,
    ``"numpy"`` keeps a shuffle buffer of 8 that draws as it goes, ``"torch"`` reads a
    ``torch.randperm``."""

    def __init__(self, n: int, how: str) -> None:
        self.n = n
        self.how = how

    def __iter__(self) -> Iterator[int]:
        if self.how == "random":
            order = list(range(self.n))
            random.shuffle(order)
            yield from order
        elif self.how == "numpy":
            buffer: list[int] = []
            for i in range(self.n):
                buffer.append(i)
                if len(buffer) == 8:
                    yield buffer.pop(int(np.random.randint(len(buffer))))
            while buffer:
                yield buffer.pop(int(np.random.randint(len(buffer))))
        else:
            yield from (int(i) for i in torch.randperm(self.n))


class OwnIterator:
    """A stream that is its own iterator, as a file reader often is: ``__iter__`` starts over
    (it would reopen its file) and returns ``self``; ``__next__`` gives the next item."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.at = 0

    def __iter__(self) -> OwnIterator:
        self.at = 0
        return self

    def __next__(self) -> int:
        if self.at >= self.n:
            raise StopIteration
        self.at += 1
        return self.at - 1


class ShuffledShards:
    """Shards itself the common way: shuffles its ``n`` shards with ``random``, then reads which
    worker it is in and yields its part, each shard with a ``random.random()`` draw (its
    augmentation)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[tuple[int, float]]:
        shards = list(range(self.n))
        random.shuffle(shards)
        info = get_worker_info()
        mine = shards if info is None else shards[info.id :: info.num_workers]
        for shard in mine:
            yield shard, random.random()


class EntropyShuffled:
    """Yields ``0 .. n-1`` shuffled by ``np.random.default_rng()`` without a seed: fresh entropy
    in every process, so no two workers' copies order the stream alike."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        yield from (int(i) for i in np.random.default_rng().permutation(self.n))


class NamesOfASet:
    """Yields ``n`` file names in the order of a set of strings: an order drawn from the
    process's string hash secret, which a fresh interpreter draws anew (``PYTHONHASHSEED``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[str]:
        yield from {f"shard-{i:04d}.tar" for i in range(self.n)}


class HashSeeds:
    """``dataset[i]`` is the ``PYTHONHASHSEED`` the process that reads it was started with."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> str:
        return os.environ.get("PYTHONHASHSEED", "unset")


class Stream:
    """Yields ``0 .. n-1``; does not know about workers (the loader shards it). With
    ``fail_at``, raises ``error_type`` when it reaches that item instead."""

    def __init__(
        self, n: int, fail_at: int | None = None, error_type: type[Exception] = OSError
    ) -> None:
        self.n = n
        self.fail_at = fail_at
        self.error_type = error_type

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            if i == self.fail_at:
                raise self.error_type(f"the stream broke at item {i}")
            yield i


class Broken(Stream):
    """Yields ``0 .. fail_at-1`` then raises ValueError."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(fail_at + 10, fail_at=fail_at, error_type=ValueError)


class SelfSharded:
    """Reads only its worker's share, as a torch user writes it (a generator, so the worker info
    is asked for at the first ``next``, not at ``iter``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        yield from range(start, self.n, step)


class AsyncStream:
    """An async stream of ``0 .. n-1``, optionally failing at item ``fail_at``; counts how
    often its generator was closed."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n = n
        self.fail_at = fail_at
        self.closed = 0

    async def __aiter__(self) -> AsyncIterator[int]:
        try:
            for i in range(self.n):
                await asyncio.sleep(0)
                if i == self.fail_at:
                    raise ConnectionError(f"the async stream broke at item {i}")
                yield i
        finally:
            self.closed += 1


async def cancelled_under_us() -> None:
    """Await something that another party cancels (a library's request, a peer's task): the
    awaiting code gets a CancelledError although nobody cancelled it."""
    inner = asyncio.ensure_future(asyncio.sleep(10))
    asyncio.get_running_loop().call_later(0.005, inner.cancel)
    await inner


class CancelledAt(AsyncRange):
    """An async map dataset whose items in ``bad`` raise such a CancelledError."""

    async def __getitem__(self, index: int) -> int:
        if index in self.bad:
            await cancelled_under_us()
        return index


class AsyncStreamCancelledAt(AsyncStream):
    """An async stream that raises such a CancelledError at item ``fail_at``."""

    async def __aiter__(self) -> AsyncIterator[int]:
        for i in range(self.n):
            if i == self.fail_at:
                await cancelled_under_us()
            yield i


def fail_collate_on_7(samples: list[int]) -> list[int]:
    """A collate_fn that fails for a batch holding sample 7."""
    if 7 in samples:
        raise ValueError("cannot collate 7")
    return list(samples)


class NumpySamples(Range):
    """Samples with numpy leaves: a numeric array, a string array, a numpy scalar and an int
    (what ``default_convert`` turns into tensors, or leaves alone)."""

    def __getitem__(self, index: int) -> Any:  # a dict, not Range's int
        index = super().__getitem__(index)
        return {
            "x": np.full(3, index, dtype=np.int64),
            "name": np.array([f"s{index}"]),
            "scalar": np.float32(index),
            "index": index,
        }


class Blocks(Range):
    """``dataset[i]`` is a 1 MiB float32 array full of ``i``: batches large enough for shared
    memory."""

    def __getitem__(self, index: int) -> Any:  # an array, not Range's int
        return np.full(1 << 18, super().__getitem__(index), dtype=np.float32)


class TorchDraws(Range):
    """``(index, a draw from torch's global generator)``: shows how a worker was seeded."""

    def __getitem__(self, index: int) -> Any:  # a tuple, not Range's int
        import torch

        return super().__getitem__(index), float(torch.rand(()).item())


def one_sample_tagged(sample: Any) -> tuple[str, Any]:
    """A collate_fn for ``batch_size=None``: torch hands it one sample, not a list."""
    return ("one", sample)


# -- what a worker knows: torch's API, seeds, its dataset copy (test_worker_compat) -----------

# The calls of record_init in this process (a worker): (worker id, info seed, torch's seed).
INIT_CALLS: list[tuple[int, int, int]] = []


def record_init(worker_id: int) -> None:
    """A worker_init_fn that records what code seeding there would see."""
    info = torch.utils.data.get_worker_info()
    assert info is not None, "torch.utils.data.get_worker_info() is None in worker_init_fn"
    INIT_CALLS.append((worker_id, info.seed, torch.initial_seed()))


class IntraOpThreads:
    """Returns ``torch.get_num_threads()``: the threads torch runs an op on where it is read."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return torch.get_num_threads()


def two_intra_op_threads(worker_id: int) -> None:
    """A worker_init_fn that gives torch two threads again."""
    torch.set_num_threads(2)


def keep(samples: list[Any]) -> list[Any]:
    """A collate_fn that keeps the samples as they are."""
    return list(samples)


class Probe:
    """Sample ``i`` tells what its worker knows: both worker infos, torch's seed, this copy's
    ``x`` and its reads so far, the worker_init_fn calls in the process, and one draw of
    ``random``, numpy and torch. ``pickled`` counts how often this object was pickled (in the
    process that pickles it)."""

    def __init__(self, n: int, x: int = 0) -> None:
        self.n = n
        self.x = x
        self.reads = 0
        self.pickled = 0

    def __len__(self) -> int:
        return self.n

    def __getstate__(self) -> dict[str, Any]:
        self.pickled += 1
        return self.__dict__.copy()

    def __getitem__(self, index: int) -> dict[str, Any]:
        ours = aioloader.get_worker_info()
        theirs = torch.utils.data.get_worker_info()
        assert ours is not None, "aioloader.get_worker_info() is None in a worker"
        assert theirs is not None, "torch.utils.data.get_worker_info() is None in a worker"
        self.reads += 1
        return {
            "index": index,
            "pid": os.getpid(),
            "x": self.x,
            "reads": self.reads,
            "id": ours.id,
            "num_workers": ours.num_workers,
            "seed": ours.seed,
            "ours_is_self": ours.dataset is self,
            "torch": (theirs.id, theirs.num_workers, theirs.seed, _same(theirs.dataset, self)),
            "initial_seed": torch.initial_seed(),
            "inits": list(INIT_CALLS),
            "draws": (random.random(), float(np.random.rand()), float(torch.rand(1))),
        }


def _same(a: object, b: object) -> bool:
    """``a is b``, for objects whose declared types do not overlap (torch's ``Dataset``)."""
    return a is b


class TorchSharded:
    """A stream of ``shards`` that shards itself with torch's API, as WebDataset and Hugging
    Face's IterableDataset do: worker ``k`` of ``n`` reads shards ``k, k + n, ...``. Yields
    ``(item, pid)``."""

    def __init__(self, shards: list[list[int]]) -> None:
        self.shards = shards

    def __iter__(self) -> Iterator[tuple[int, int]]:
        info = torch.utils.data.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for shard in self.shards[first::step]:
            for item in shard:
                yield item, os.getpid()


class Span:
    """Yields ``start .. end-1``: torch's documented stream that :func:`split_span`, a
    worker_init_fn, sets up per worker."""

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))


def split_span(worker_id: int) -> None:
    """torch's documented worker_init_fn: this worker's copy reads only its part of the span."""
    info = torch.utils.data.get_worker_info()
    assert info is not None
    dataset: Any = info.dataset
    per_worker = math.ceil((dataset.end - dataset.start) / info.num_workers)
    start = dataset.start + worker_id * per_worker
    dataset.start, dataset.end = start, min(start + per_worker, dataset.end)


def seed_numpy_from_info(worker_id: int) -> None:
    """A worker_init_fn that only seeds (it reads the seed, not which worker it is)."""
    info = torch.utils.data.get_worker_info()
    assert info is not None
    np.random.seed(info.seed % 2**32)


class FdReport(Range):
    """Sample ``i``: 16,384 int32 (64 KiB, so every batch of one travels in a slot) holding
    ``[i, open descriptors of the reading process, its pid, i, i, ...]``.

    With ``starve_at``, reading that index lowers the reading process's own soft
    ``RLIMIT_NOFILE`` so that no new descriptor fits, for good (``starve_for_good``: from then
    on it cannot open a segment) or only while it opens one file (which then fails with
    EMFILE, the way a dataset that leaks open files ends).
    """

    def __init__(self, n: int, starve_at: int = -1, starve_for_good: bool = False) -> None:
        super().__init__(n)
        self.starve_at = starve_at
        self.starve_for_good = starve_for_good

    def __getitem__(self, index: int) -> Any:
        import resource

        sample = np.full(16384, index, dtype=np.int32)
        try:
            sample[1] = len(os.listdir("/proc/self/fd")) - 1  # less listdir's own
        except OSError:  # starved for good: no descriptor left to list them with
            sample[1] = -1
        sample[2] = os.getpid()
        if index == self.starve_at:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            lowest_free = os.dup(0)  # the number the next open would get: make it too high
            os.close(lowest_free)
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
            if not self.starve_for_good:
                try:
                    with open(os.devnull):
                        pass
                finally:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        return sample


class HeapChurn:
    """Each sample allocates 64 objects of 64 KiB (a batch's worth of tar members), frees them,
    and returns the page faults that cost its process (``ru_minflt`` before and after)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> int:
        import resource

        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        members = [bytes(64 << 10) for _ in range(64)]
        del members
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


# -- tar shards (tests/test_tar_shards.py, tests/scripts/dist_ranks.py) -----------------------


def tar_shard(shard: int, samples: int, size: int = 24) -> bytes:
    """A WebDataset-style shard: samples ``{shard:03d}/{i:04d}`` with a ``bin`` member of
    ``size`` deterministic bytes and a ``cls`` member holding ``i``."""
    import io
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for i in range(samples):
            body = random.Random(shard * 100_003 + i).randbytes(size)
            for ext, data in (("bin", body), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{shard:03d}/{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def tar_digest(raw: dict[str, Any]) -> dict[str, Any]:
    """A tar sample's decode that says what arrived: the key, the type and CRC-32 of each
    member's bytes (``bytes`` or not: what ``decode`` is handed), and the decoding process."""
    import zlib

    members = {k: (type(v).__name__, zlib.crc32(v)) for k, v in raw.items() if k[:2] != "__"}
    return {"key": raw["__key__"], "members": members, "pid": os.getpid()}


def tar_keys(shards: int, samples: Callable[[int], int]) -> list[str]:
    """Every sample key of the shards :func:`tar_shard` makes, in shard order."""
    return [f"{s:03d}/{i:04d}" for s in range(shards) for i in range(samples(s))]


def tar_sample(raw: dict[str, Any]) -> dict[str, Any]:
    """A tar sample's decode: its key, its class, and the process that decoded it."""
    return {"key": raw["__key__"], "cls": int(raw["cls"]), "pid": os.getpid()}


# -- Parquet files (tests/test_parquet.py, tests/scripts/dist_ranks.py) ------------------------


def parquet_bytes(file: int, rows: int, row_group_size: int) -> bytes:
    """A Parquet file of ``rows`` rows in row groups of ``row_group_size``: ``id`` (int64,
    ``file * 1000 + i``), ``emb`` (2 float32: ``[id, -id]``), ``tag`` (a string) and ``vec``
    (a list of ``i % 3`` float64s)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = np.arange(rows, dtype=np.int64) + file * 1000
    emb = np.stack([ids, -ids], axis=1).astype(np.float32).reshape(-1)
    table = pa.table(
        {
            "id": pa.array(ids),
            "emb": pa.FixedSizeListArray.from_arrays(pa.array(emb), 2),
            "tag": [f"f{file}r{i}" for i in range(rows)],
            "vec": pa.array([[float(i)] * (i % 3) for i in range(rows)], pa.list_(pa.float64())),
        }
    )
    out = io.BytesIO()
    pq.write_table(table, out, row_group_size=row_group_size)
    return out.getvalue()


def parquet_row(raw: dict[str, Any]) -> dict[str, Any]:
    """A Parquet row's decode: its id and the process that decoded it."""
    return {"id": int(raw["id"]), "pid": os.getpid()}


class Counted:
    """A stream of ``0 .. n-1`` that says its length (read on threads only: not pickled)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


class Resumable:
    """Yields ``0 .. n-1`` and continues where it stood (an :class:`aioloader.ResumableStream`):
    its state is the position after the last item yielded. ``self_sharded`` reads only its
    worker's share (items ``id, id + W, ...``), as a torch user writes it. Counts the items it
    yielded (``yielded``), so a test can tell a continued stream from a replayed one."""

    def __init__(self, n: int, *, self_sharded: bool = False) -> None:
        self.n = n
        self.self_sharded = self_sharded
        self._next = 0
        self._resume: int | None = None
        self.yielded = 0

    def state_dict(self) -> dict[str, Any]:
        return {"next": self._next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = int(state["next"])

    def __iter__(self) -> Iterator[int]:
        start, self._resume = self._resume or 0, None
        info = get_worker_info() if self.self_sharded else None
        mine, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n):
            if i % step != mine:
                continue
            self._next = i + 1  # before the yield: a state taken while suspended is exact
            self.yielded += 1
            yield i


class AsyncResumable:
    """:class:`Resumable` as an async stream."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._next = 0
        self._resume: int | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"next": self._next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = int(state["next"])

    async def __aiter__(self) -> AsyncIterator[int]:
        start, self._resume = self._resume or 0, None
        for i in range(start, self.n):
            await asyncio.sleep(0)
            self._next = i + 1
            yield i


# -- loaders that share one worker pool (tests/test_shared_pool.py) ---------------------------


def _touch(marker_dir: str, name: str) -> None:
    """Create a marker file named ``name`` plus a unique suffix (any process)."""
    for attempt in range(1000):
        try:
            fd = os.open(os.path.join(marker_dir, f"{name}-{attempt}"), os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            continue
        os.close(fd)
        return
    raise AssertionError(f"too many markers named {name!r}")  # pragma: no cover


def markers(marker_dir: str, prefix: str) -> list[str]:
    """The markers in ``marker_dir`` whose name starts with ``prefix`` (suffix dropped)."""
    names = [n.rpartition("-")[0] for n in os.listdir(marker_dir)]
    return sorted(n for n in names if n.startswith(prefix))


class InitMarker:
    """A worker_init_fn that leaves ``init-<tag>-<pid>-<worker id>`` in ``marker_dir`` per call,
    so a test counts the calls of each loader's worker_init_fn in each worker process."""

    def __init__(self, marker_dir: str, tag: str) -> None:
        self.marker_dir = marker_dir
        self.tag = tag

    def __call__(self, worker_id: int) -> None:
        _touch(self.marker_dir, f"init-{self.tag}-{os.getpid()}-{worker_id}")


class Tagged:
    """Sample ``i`` tells which dataset made it (``tag``) and what its worker knows: its id,
    pid and seed, and whether ``get_worker_info().dataset`` is this very copy. A copy dropped
    in a worker process leaves ``dropped-<tag>-<pid>`` in ``marker_dir``."""

    def __init__(self, n: int, tag: str, marker_dir: str) -> None:
        self.n = n
        self.tag = tag
        self.marker_dir = marker_dir
        self.owner = os.getpid()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        info = get_worker_info()
        assert info is not None, "get_worker_info() is None in a worker"
        return {
            "tag": self.tag,
            "index": index,
            "id": info.id,
            "num_workers": info.num_workers,
            "pid": os.getpid(),
            "seed": info.seed,
            "mine": info.dataset is self,
        }

    def __del__(self) -> None:
        if os.getpid() != self.owner:  # a worker's copy, not the test's own dataset
            _touch(self.marker_dir, f"dropped-{self.tag}-{os.getpid()}")
