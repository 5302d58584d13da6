"""The warm benchmark's workloads on other data loaders: torchdata.nodes, SPDL and seqtools.

Each ``run_<name>(kind, n, batch, workers, epochs)`` loads the data sets of
:mod:`bench_loader` the way that library's documentation suggests for a map-style data set,
with the same batch size, ``workers`` worker processes (0: no process; see each function), one
warm-up epoch and then ``epochs`` timed epochs, and returns ``{"batches_per_s": ...,
"peak_pss_mb": ...}`` like :func:`bench_loader.run_torch`. Batches are torch's
``default_collate`` of the samples, as torch's DataLoader makes them.

None of these libraries is a dependency: :data:`MODULES` names the module each needs, and
``benchmarks/run_all.py`` runs only those installed (``pip install torchdata``,
``pip install spdl-core``, ``pip install seqtools``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

#: loader name: the module whose presence means it can run.
MODULES = {"torchdata": "torchdata.nodes", "spdl": "spdl.pipeline", "seqtools": "seqtools"}

#: Batches each loader may hold ready ahead of the consumer (aioloader's default: 2 per
#: worker), so no loader wins by buffering more.
AHEAD_PER_WORKER = 2


class BatchFetch:
    """``indices -> default_collate([dataset[i] for i in indices])``; the data set is made on
    first use in the process that calls it, so pickling this object costs nothing."""

    def __init__(self, kind: str, n: int) -> None:
        self.kind, self.n = kind, n
        self._dataset: Any = None

    def __call__(self, indices: list[int]) -> Any:
        if self._dataset is None:
            import bench_loader

            self._dataset = bench_loader.make_dataset(self.kind, self.n)
        from torch.utils.data import default_collate

        return default_collate([self._dataset[i] for i in indices])

    def __getstate__(self) -> dict[str, Any]:
        return {"kind": self.kind, "n": self.n, "_dataset": None}


def batches_of(n: int, batch: int) -> list[list[int]]:
    return [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]


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


def run_torchdata(kind: str, n: int, batch: int, workers: int, epochs: int) -> dict[str, float]:
    """torchdata.nodes: batches of indices, then ``ParallelMapper`` over worker processes
    (forkserver) that read and collate a batch each, in order; ``Mapper`` inline without
    workers. torchdata starts its worker processes again at every epoch."""
    from torch.utils.data import SequentialSampler
    from torchdata.nodes import Batcher, Loader, Mapper, ParallelMapper, SamplerWrapper

    node: Any = Batcher(SamplerWrapper(SequentialSampler(range(n))), batch, drop_last=False)
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
    loader = Loader(node)
    return timed(lambda: loader, epochs)


def run_spdl(kind: str, n: int, batch: int, workers: int, epochs: int) -> dict[str, float]:
    """SPDL's pipeline: a source of index batches, one ``pipe`` stage that reads and collates
    a batch in a ``ProcessPoolExecutor`` of ``workers`` processes (forkserver, kept across
    epochs), output in input order; without workers the stage runs on SPDL's thread pool."""
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

    try:
        return timed(epoch, epochs)
    finally:
        if executor is not None:
            executor.shutdown()


def run_seqtools(kind: str, n: int, batch: int, workers: int, epochs: int) -> dict[str, float]:
    """seqtools: a lazy sequence of collated batches, ``prefetch``-ed by ``workers``
    processes (its default start method, fork on Linux) through its shared-memory buffers;
    without workers the batches are made inline, as torch does."""
    import seqtools

    fetch = BatchFetch(kind, n)
    batches = seqtools.smap(fetch, batches_of(n, batch))
    if workers:
        ahead = AHEAD_PER_WORKER * workers
        # Room for every buffered batch: the large case's batches are 9.6 MB.
        shm = (ahead + 2) * 10 * 2**20 if kind == "large" else 0
        batches = seqtools.prefetch(
            batches, nworkers=workers, method="process", max_buffered=ahead, shm_size=shm
        )
    return timed(lambda: batches, epochs)


RUNNERS: dict[str, Callable[[str, int, int, int, int], dict[str, float]]] = {
    "torchdata": run_torchdata,
    "spdl": run_spdl,
    "seqtools": run_seqtools,
}
