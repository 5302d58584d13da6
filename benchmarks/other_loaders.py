"""The benchmarks' workloads on other data loaders: torchdata.nodes, SPDL and seqtools.

Each ``build_<name>(kind, n, batch, workers, port=0)`` sets that library up the way its
documentation suggests and returns ``(epoch, close)``: ``epoch()`` is an iterable of one
epoch's batches (call it again for the next epoch), ``close()`` releases what the pipeline
holds (worker processes, pools). Both benchmarks use them: :func:`timed` for the warm one
(``bench_loader.py --loaders``: one warm-up epoch, then timed epochs) and ``cold_start.py``,
which builds in a fresh process and times one epoch from construction.

Two kinds of data:

- the data sets of :mod:`bench_loader` (``kind`` ``large``, ``cpu`` or ``tiny``), map-style,
  compute-bound: the same batch size, ``workers`` worker processes (0: none; see each
  function); batches are torch's ``default_collate`` of the samples, as torch's DataLoader
  makes them;
- ``kind`` :data:`HTTP`: ``n`` objects of the loopback server on ``port``
  (``remote_http.py``), IO-bound: each library keeps :data:`IO_CONCURRENCY` requests in
  flight in one process, with its own means for IO (SPDL: an async stage; torchdata and
  seqtools: threads), ``workers`` is ignored; a batch is the list of the objects' bytes.

None of these libraries is a dependency: :data:`MODULES` names the module each needs, and
the benchmarks run only those installed (``pip install torchdata``, ``pip install
spdl-core``, ``pip install seqtools``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

#: loader name: the module whose presence means it can run.
MODULES = {"torchdata": "torchdata.nodes", "spdl": "spdl.pipeline", "seqtools": "seqtools"}

#: Batches each loader may hold ready ahead of the consumer (aioloader's default: 2 per
#: worker), so no loader wins by buffering more.
AHEAD_PER_WORKER = 2

#: The data set kind of remote objects, and the requests each loader keeps in flight for it
#: (aioloader's ``io_concurrency`` in the same benchmark).
HTTP = "http"
IO_CONCURRENCY = 64

#: What a builder returns: one epoch's batches, on each call, and the pipeline's closing.
Built = tuple[Callable[[], Iterable[Any]], Callable[[], None]]


class BatchFetch:
    """``indices -> default_collate([dataset[i] for i in indices])``; the data set is made on
    first use in the process that calls it, so pickling this object costs nothing."""

    def __init__(self, kind: str, n: int) -> None:
        self.kind, self.n = kind, n
        self._dataset: Any = None

    def __call__(self, indices: list[int]) -> Any:
        if self._dataset is None:
            self._dataset = dataset_for(self.kind, self.n)
        from torch.utils.data import default_collate

        return default_collate([self._dataset[i] for i in indices])

    def __getstate__(self) -> dict[str, Any]:
        return {"kind": self.kind, "n": self.n, "_dataset": None}


@functools.cache
def dataset_for(kind: str, n: int) -> Any:
    """:func:`bench_loader.make_dataset`, once per process (and the processes it forks): a
    cold run makes it before its clock starts, as it does for torch's DataLoader."""
    import bench_loader

    return bench_loader.make_dataset(kind, n)


def batches_of(n: int, batch: int) -> list[list[int]]:
    return [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]


def http_dataset(n: int, port: int) -> Any:
    """The ``n`` objects on the loopback server as a synchronous map-style data set (one
    keep-alive connection per thread), as torch's DataLoader reads them."""
    import remote_http

    return remote_http.SyncHTTPDataset(remote_http.object_urls(port, n))


def timed(epoch: Callable[[], Iterable[Any]], epochs: int) -> dict[str, float]:
    """One warm-up epoch, then ``epochs`` timed ones; the rate and the peak PSS."""
    import bench_loader

    with bench_loader.PeakPss() as mem:
        for _ in epoch():
            pass
        started = time.perf_counter()
        batches = 0
        for _ in range(epochs):
            for _ in epoch():
                batches += 1
        elapsed = time.perf_counter() - started
    return {"batches_per_s": batches / elapsed, "peak_pss_mb": mem.peak / 2**20}


# -- torchdata.nodes --------------------------------------------------------------------------


def build_torchdata(kind: str, n: int, batch: int, workers: int, port: int = 0) -> Built:
    """torchdata.nodes. Data sets: batches of indices, then ``ParallelMapper`` over worker
    processes (forkserver) that read and collate a batch each, in order; ``Mapper`` inline
    without workers. torchdata starts its worker processes again at every epoch. Remote
    objects: ``ParallelMapper`` over :data:`IO_CONCURRENCY` threads (its ``method="thread"``,
    for IO) that GET one object each, in order, then ``Batcher``."""
    from torch.utils.data import SequentialSampler
    from torchdata.nodes import Batcher, Loader, Mapper, ParallelMapper, SamplerWrapper

    node: Any = SamplerWrapper(SequentialSampler(range(n)))
    if kind == HTTP:
        node = ParallelMapper(
            node,
            http_dataset(n, port).__getitem__,
            num_workers=IO_CONCURRENCY,
            in_order=True,
            method="thread",
        )
        node = Batcher(node, batch, drop_last=False)
    else:
        node = Batcher(node, batch, drop_last=False)
        fetch = BatchFetch(kind, n)
        if workers:
            node = ParallelMapper(
                node,
                fetch,
                num_workers=workers,
                in_order=True,
                method="process",
                multiprocessing_context="forkserver",
            )
        else:
            node = Mapper(node, fetch)
    # torchdata has no close: its nodes stop their threads and processes when collected.
    held = [Loader(node)]
    return (lambda: held[0]), held.clear


# -- SPDL -------------------------------------------------------------------------------------


def build_spdl(kind: str, n: int, batch: int, workers: int, port: int = 0) -> Built:
    """SPDL's pipeline, built for each epoch. Data sets: a source of index batches, one
    ``pipe`` stage that reads and collates a batch in a ``ProcessPoolExecutor`` of ``workers``
    processes (forkserver, kept across epochs), output in input order; without workers the
    stage runs on SPDL's thread pool. Remote objects: a source of URLs, an async ``pipe``
    stage (aiohttp, on SPDL's event loop) with ``concurrency`` :data:`IO_CONCURRENCY`, output
    in input order (the batches torch makes), then ``aggregate`` into batches."""
    if kind == HTTP:
        return _spdl_http(n, batch, port)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from spdl.pipeline import PipelineBuilder

    fetch = BatchFetch(kind, n)
    executor = (
        ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver"))
        if workers
        else None
    )

    def epoch() -> Iterator[Any]:
        pipeline = (
            PipelineBuilder()
            .add_source(batches_of(n, batch))
            .pipe(
                fetch,
                concurrency=max(1, AHEAD_PER_WORKER * workers),
                executor=executor,
                output_order="input",
            )
            .add_sink(AHEAD_PER_WORKER * max(1, workers))
            .build(num_threads=1)
        )
        with pipeline.auto_stop():
            yield from pipeline.get_iterator(timeout=300)

    def close() -> None:
        if executor is not None:
            executor.shutdown()

    return epoch, close


def _spdl_http(n: int, batch: int, port: int) -> Built:
    import aiohttp
    import remote_http
    from spdl.pipeline import PipelineBuilder

    urls = remote_http.object_urls(port, n)

    def epoch() -> Iterator[Any]:
        # The session lives on SPDL's event loop (a thread of its own): the first request
        # makes it, the last one to finish closes it (after the last item, SPDL stops the
        # loop, and a close sent to it from here is cancelled).
        session: list[aiohttp.ClientSession] = []
        left = [len(urls)]

        async def get(url: str) -> bytes:
            if not session:
                connector = aiohttp.TCPConnector(limit=4 * IO_CONCURRENCY)
                session.append(aiohttp.ClientSession(connector=connector))
            try:
                async with session[0].get(url) as response:
                    response.raise_for_status()
                    return await response.read()
            finally:
                left[0] -= 1
                if not left[0]:
                    await session[0].close()

        pipeline = (
            PipelineBuilder()
            .add_source(urls)
            .pipe(get, concurrency=IO_CONCURRENCY, output_order="input")
            .aggregate(batch)
            .add_sink(AHEAD_PER_WORKER)
            .build(num_threads=1)
        )
        with pipeline.auto_stop():
            yield from pipeline.get_iterator(timeout=300)

    return epoch, lambda: None


# -- seqtools ---------------------------------------------------------------------------------


def build_seqtools(kind: str, n: int, batch: int, workers: int, port: int = 0) -> Built:
    """seqtools. Data sets: a lazy sequence of collated batches, ``prefetch``-ed by
    ``workers`` processes (its default start method, fork on Linux) through its shared-memory
    buffers; without workers the batches are made inline, as torch does. Remote objects:
    the objects ``prefetch``-ed by :data:`IO_CONCURRENCY` threads (its ``method="thread"``,
    for IO), then ``batch``-ed into lists."""
    import seqtools

    batches: Any
    if kind == HTTP:
        objects = seqtools.prefetch(
            http_dataset(n, port),
            nworkers=IO_CONCURRENCY,
            method="thread",
            max_buffered=AHEAD_PER_WORKER * IO_CONCURRENCY,
        )
        batches = seqtools.batch(objects, batch, collate_fn=list)
    else:
        batches = seqtools.smap(BatchFetch(kind, n), batches_of(n, batch))
        if workers:
            ahead = AHEAD_PER_WORKER * workers
            # Room for every buffered batch: the large case's batches are 9.6 MB.
            shm = (ahead + 2) * 10 * 2**20 if kind == "large" else 0
            batches = seqtools.prefetch(
                batches, nworkers=workers, method="process", max_buffered=ahead, shm_size=shm
            )
    # seqtools has no close: its workers stop when the prefetching sequence is collected.
    held = [batches]
    return (lambda: held[0]), held.clear


BUILDERS: dict[str, Callable[..., Built]] = {
    "torchdata": build_torchdata,
    "spdl": build_spdl,
    "seqtools": build_seqtools,
}


def run_timed(
    build: Callable[..., Built], kind: str, n: int, batch: int, workers: int, epochs: int
) -> dict[str, float]:
    """The warm benchmark's run of one loader: build, :func:`timed`, close."""
    epoch, close = build(kind, n, batch, workers)
    try:
        return timed(epoch, epochs)
    finally:
        close()


RUNNERS: dict[str, Callable[[str, int, int, int, int], dict[str, float]]] = {
    name: functools.partial(run_timed, build) for name, build in BUILDERS.items()
}
