"""What a worker knows about itself, where torch's API finds it too, and its seeds.

:func:`get_worker_info` returns the worker's :class:`WorkerInfo`; ``torch.utils.data.
get_worker_info()`` returns a torch ``WorkerInfo`` with the same values, so datasets that shard
themselves with torch's API (WebDataset, Hugging Face ``IterableDataset``, torch's own
documented examples) read each shard once here too. torch keeps its worker info in a module
global of ``torch.utils.data._utils.worker``; :func:`publish` sets it, in this one place, if
torch is imported in the worker, and again the moment it arrives later (torch is never
imported for this: a numpy-only pipeline never loads it).

Whether a stream shards itself is seen, not asked: while a stream starts, and while
``worker_init_fn`` runs, reading ``id``, ``num_workers`` or ``dataset`` of either info object is
noted (:func:`watch`). A stream of a dataset that did neither is sharded by the worker (see
:mod:`._worker`), so that no item is produced twice; one that did is left as it is, since
sharding it again would silently drop items.

Seeds, as torch: worker ``k`` gets ``seed = base + k``, where the base is drawn from the loader's
seed and the epoch its dataset copy was made for (torch draws a fresh base for each epoch's
workers); ``random``, ``numpy.random`` and torch are seeded with it before ``worker_init_fn``
runs (the last two when imported, or the moment they are: see :func:`seed_on_import`), so
``torch.initial_seed() == get_worker_info().seed`` there. With the default
``worker_seeding='batch'`` the three are then reseeded before every batch from (seed, epoch,
batch id) (:func:`seed_everything`), so a sample's randomness does not depend on which worker
made it or how many there are.

A stream (an iterable dataset) that readers split is read under a random state of its own
(:class:`StreamRandom`), the same in every worker: each worker reads the whole stream and
keeps its share of the items, which is exact only if every worker's copy orders the stream
alike. A stream that shuffles with ``random``, ``numpy.random`` or torch (a shuffled file
list, a shuffle buffer) drew from the batch's or the worker's seed before, so each worker saw
another order and kept items that another worker also kept, losing as many: silently.

torch in a worker runs its ops on one thread, as in torch's workers: set as each dataset copy
loads, before its ``worker_init_fn`` (which may set more), and the moment torch is imported.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import random
import sys
import threading
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from .._log import workers_log

__all__ = [
    "StreamRandom",
    "WorkerInfo",
    "catch_up",
    "get_worker_info",
    "publish",
    "seed_everything",
    "seed_on_import",
    "seed_worker",
    "torch_on_one_thread",
    "unwatch",
    "watch",
    "worker_seed",
]

# Reading these tells which part of the data a worker should read: a dataset that reads them
# shards itself (or has its copy set up by worker_init_fn).
_SHARDING_ATTRS = frozenset({"id", "num_workers", "dataset"})

_watching = False
_seen = False
_on_seen: Callable[[], None] | None = None


def watch(on_seen: Callable[[], None] | None = None) -> None:
    """Start noting reads of the sharding attributes of the worker info (see the module
    docstring); :func:`unwatch` tells whether there were any. ``on_seen`` is called at the
    first such read."""
    global _watching, _seen, _on_seen
    _watching, _seen, _on_seen = True, False, on_seen


def unwatch() -> bool:
    """Stop noting; whether a sharding attribute was read since :func:`watch`."""
    global _watching, _on_seen
    _watching, _on_seen = False, None
    return _seen


def _noted(name: str) -> None:
    global _seen, _on_seen
    if name in _SHARDING_ATTRS:
        _seen = True
        on_seen, _on_seen = _on_seen, None
        if on_seen is not None:
            on_seen()


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker knows about itself; :func:`get_worker_info` returns it inside a worker.

    Attributes:
        id: the worker's number, ``0 <= id < num_workers``; stable across rebuilds.
        num_workers: how many workers the loader runs.
        seed: this worker's seed (``base + id``, the base drawn from the loader's seed and the
            epoch): ``torch.initial_seed()`` while ``worker_init_fn`` runs. With
            ``worker_seeding='batch'`` every batch is reseeded from (seed, epoch, batch id).
        dataset: this worker's copy of the dataset.
    """

    id: int
    num_workers: int
    seed: int
    dataset: Any

    def __getattribute__(self, name: str) -> Any:
        if _watching:
            _noted(name)
        return object.__getattribute__(self, name)


_current: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """Inside a worker process: its :class:`WorkerInfo`; in the main process: ``None``.

    An iterable dataset uses it in ``__iter__`` to read only its shard (torch's
    ``torch.utils.data.get_worker_info()`` works as well). If a dataset never reads which worker
    it is in, the loader shards its stream for it (worker ``k`` keeps items ``k, k + n, k + 2n,
    ...``) so that no item is produced twice.
    """
    return _current


# Whether torch has the current info (torch was imported when it was published).
_torch_has_it = False


def publish(info: WorkerInfo | None) -> None:
    """Make ``info`` what :func:`get_worker_info` and torch's ``get_worker_info`` return here."""
    global _current, _torch_has_it
    _current = info
    _torch_has_it = _publish_to_torch(info)


def catch_up() -> None:
    """Before each job: a generator imported since the last one that the import hook did not
    see (a finder put before it on ``sys.meta_path`` found it first) gets the seed in force,
    and torch the worker info."""
    global _torch_has_it
    for name in _SEEDED:
        if name not in _arrived and name in sys.modules:
            _arrive(name)
    if not _torch_has_it and "torch" in sys.modules:
        _torch_has_it = _publish_to_torch(_current)


def _publish_to_torch(info: WorkerInfo | None) -> bool:
    """Set torch's worker info global; False if torch is not imported here (yet)."""
    torch_worker: Any = sys.modules.get("torch.utils.data._utils.worker")
    if torch_worker is None and "torch" in sys.modules:
        try:
            import torch.utils.data._utils.worker as torch_worker
        except ImportError:  # pragma: no cover - a torch without it
            return True  # nothing to catch up with
    if torch_worker is None:
        return False  # torch is not imported here: nothing can ask it yet
    if not hasattr(torch_worker, "_worker_info"):  # pragma: no cover - kept elsewhere
        return True
    # torch.utils.data.get_worker_info() returns this module global; torch's own workers set it
    # the same way. A torch whose WorkerInfo cannot be made with these fields is left alone.
    try:
        torch_info = (
            None
            if info is None
            else _torch_info_class(torch_worker)(
                id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=info.dataset
            )
        )
    except TypeError:  # pragma: no cover - a torch whose WorkerInfo takes other fields
        return True
    torch_worker._worker_info = torch_info
    return True


_torch_class: type | None = None


def _torch_info_class(torch_worker: Any) -> type:
    """torch's ``WorkerInfo``, with reads of its sharding attributes noted like ours."""
    global _torch_class
    if _torch_class is None:

        class WatchedWorkerInfo(torch_worker.WorkerInfo):  # type: ignore[misc]
            __slots__ = ()

            def __getattribute__(self, name: str) -> Any:
                if _watching:
                    _noted(name)
                return super().__getattribute__(name)

        _torch_class = WatchedWorkerInfo
    return _torch_class


# -- seeds -------------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_MASK62 = (1 << 62) - 1
_MASK63 = (1 << 63) - 1
_MASK64 = 0xFFFFFFFFFFFFFFFF


def worker_seed(seed: int, epoch: int, worker_id: int) -> int:
    """Worker ``worker_id``'s seed for a dataset copy made for ``epoch``: ``base + worker_id``
    (torch's rule), the base drawn from (seed, epoch) below 2**62, so the seed stays below
    2**63 (an int64) as torch's do."""
    base = _mix(_mix(seed & _MASK64) ^ _mix(epoch ^ 0x5EED)) & _MASK62
    return base + worker_id


def seed_worker(seed: int, *, every_device: bool) -> None:
    """Seed ``random``, ``numpy.random`` and torch once, as torch seeds a worker:
    ``torch.initial_seed()`` is ``seed`` afterwards (once torch is imported, see below).

    With ``every_device``, torch is seeded through ``torch.manual_seed``, accelerators included,
    as torch's own workers are (``worker_seeding='worker'``). Otherwise only its CPU generator:
    batches are reseeded that way anyway (:func:`seed_everything`), and ``torch.manual_seed``
    costs 1-3 ms the first time (it records a stack trace for each lazy accelerator seed).
    """
    random.seed(seed)
    _in_force(_mix(seed) & _MASK32, seed, every_device=every_device)  # numpy: not random's


def seed_everything(seed: int, epoch: int, batch_id: int) -> int:
    """Seed ``random``, ``numpy.random`` and ``torch`` from (seed, epoch, batch id).

    A sample's randomness then depends on which batch it is in, never on which worker ran it or
    how many workers there are. Returns the derived 64-bit seed.

    Runs before every batch, so it must be cheap: the mix is three rounds of splitmix64 in
    Python (~2 us; ``SeedSequence`` costs ~120 us), and torch is seeded through its CPU
    generator (``torch.manual_seed`` also reseeds every accelerator: ~300 us). torch gets the
    low 63 bits, as torch keeps its worker seeds below 2**63: a sample that returns
    ``torch.initial_seed()`` then fits an int64 tensor.
    """
    derived = _mix(_mix(_mix(seed) ^ epoch) ^ batch_id)
    random.seed(derived)
    _in_force(derived & _MASK32, derived & _MASK63, every_device=False)
    return derived


class StreamRandom:
    """The random state of one dataset copy's stream, one per epoch being read, where the
    loader splits the stream among readers (worker processes, ranks).

    :meth:`reading` swaps it in while the stream is pulled (opened, then each batch's items) and
    gives the batch its own state back after, so a stream's draws depend on (seed, epoch) and on
    how far it has been read, never on which worker reads it, which batch is next, or how many
    workers there are. Every worker reading a stream must start from the same state: ``seed``
    is the loader's (the same on every rank where the stream is split by rank).

    A stream that shards itself draws from the batch's state, as before, from the moment it
    reads which worker it is in (:meth:`leave`; draws made before that, such as a shuffle of
    its shards before it takes its part, stay common to every worker, as they must).

    Cost: ~20 us a batch with ``random`` and torch; numpy's legacy global generator adds
    ~80 us (saving and restoring its state is slow: paid only where numpy.random is imported).
    Generators not imported yet are left alone, as :func:`seed_everything` does.
    """

    __slots__ = ("_back", "_seed", "_states")

    def __init__(self, seed: int) -> None:
        self._seed = seed
        # StreamRequest.key -> its stream's state, or None once it showed it shards itself
        self._states: dict[Hashable, _RandomState | None] = {}
        # While a stream's state is swapped in: how the batch gets its own back.
        self._back: Callable[[], None] | None = None

    @contextlib.contextmanager
    def reading(
        self,
        key: Hashable,
        epoch: int,
        opens: bool,
        *,
        keep: int,
        then: Callable[[], None] | None = None,
    ) -> Iterator[None]:
        """Pull the stream of reading ``key`` (``StreamRequest.key``) of ``epoch`` inside this
        block; ``opens``: it starts afresh, from (seed, epoch).

        Args:
            keep: the readings remembered at most (the streams a reader keeps open at once).
            then: re-establishes the batch's state afterwards (reseeding it, with per-batch
                seeds); None: the state before the block is saved and restored.
        """
        # Popped either way: the reading pulled last is remembered last (evicted last).
        saved = self._states.pop(key, _FRESH)
        if opens:
            saved = _FRESH
        if saved is not None:  # None: the stream shards itself and draws as the batch does
            self._back = then if then is not None else _RandomState.capture().restore
            if isinstance(saved, _RandomState):
                saved.restore()
            else:
                derived = _mix(_mix(_mix(self._seed) ^ epoch) ^ _STREAM_TAG)
                random.seed(derived)
                _in_force(derived & _MASK32, derived & _MASK63, every_device=False)
        try:
            yield
        finally:
            if self._back is not None:
                self._states[key] = _RandomState.capture()
                self.leave()
            else:
                self._states[key] = None
            while len(self._states) > keep:
                del self._states[next(iter(self._states))]

    def leave(self) -> None:
        """Give the batch its state back now: the stream being read shards itself (it read
        which worker it is in), so its draws from here on are the batch's, for good."""
        back, self._back = self._back, None
        if back is not None:
            back()


_FRESH: Final = "fresh"  # a reading whose stream starts from (seed, epoch)


_STREAM_TAG = 0x57EA4  # keeps a stream's seed apart from any batch's


@dataclass(slots=True)
class _RandomState:
    """``random``'s state, numpy's and torch's CPU generator's (None: not imported), and the
    seeds in force for a generator imported later (see :func:`_in_force`)."""

    python: Any
    numpy: Any
    torch: Any
    numpy_seed: int | None
    torch_seed: tuple[int, bool] | None

    @classmethod
    def capture(cls) -> _RandomState:
        np_random: Any = sys.modules.get("numpy.random")
        torch: Any = sys.modules.get("torch")
        return cls(
            random.getstate(),
            np_random.get_state() if np_random is not None else None,
            torch.default_generator.get_state() if torch is not None else None,
            _numpy_seed,
            _torch_seed,
        )

    def restore(self) -> None:
        global _numpy_seed, _torch_seed
        random.setstate(self.python)
        _numpy_seed, _torch_seed = self.numpy_seed, self.torch_seed
        for name, saved in (("numpy.random", self.numpy), ("torch", self.torch)):
            module: Any = sys.modules.get(name)
            if module is None:
                continue
            if saved is None:  # imported meanwhile: as if imported under this state's seeds
                _seed(name)
            elif name == "torch":
                module.default_generator.set_state(saved)
            else:
                module.set_state(saved)


# numpy.random and torch are seeded only once imported: a worker does not import numpy.random
# (~5 ms) or torch (~1 s) to seed a generator that nothing may use. One imported later (by the
# dataset, in the middle of a batch) is seeded the moment its import completes, with the seed
# in force then, by an import hook (:func:`seed_on_import`): its first draw is as reproducible
# as if it had been imported from the start.
_SEEDED = ("numpy.random", "torch")
_numpy_seed: int | None = None
_torch_seed: tuple[int, bool] | None = None  # (seed, through torch.manual_seed: every device)
_arrived: set[str] = set()  # of _SEEDED, those seen imported (and seeded then)


def _in_force(numpy_seed: int, torch_seed: int, *, every_device: bool) -> None:
    global _numpy_seed, _torch_seed
    _numpy_seed, _torch_seed = numpy_seed, (torch_seed, every_device)
    for name in _SEEDED:
        if name in sys.modules:
            _seed(name)


def _seed(name: str) -> None:
    module: Any = sys.modules[name]
    if name == "numpy.random":
        if _numpy_seed is not None:
            module.seed(_numpy_seed)
    elif _torch_seed is not None:
        seed, every_device = _torch_seed
        if every_device:
            module.manual_seed(seed)
        else:
            module.default_generator.manual_seed(seed)


def _arrive(name: str) -> None:
    """``name`` was just imported: seed it, and give torch the worker info."""
    global _torch_has_it
    _arrived.add(name)
    _seed(name)
    if name == "torch":
        _torch_has_it = _publish_to_torch(_current)


def torch_on_one_thread() -> None:
    """Where torch is imported: run its ops on one thread, as torch's workers do. The workers
    share the cores already (2 workers of 2 threads each ran 4 threads on 2 cores). Called as
    each dataset copy loads, before its ``worker_init_fn`` (which may set more), and when the
    import hook sees torch arrive; never by :func:`catch_up`, which may come after a
    ``worker_init_fn`` that set its own."""
    torch: Any = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


class _SeedOnImport(importlib.abc.MetaPathFinder):
    """A meta path finder for the generators of :data:`_SEEDED`: their spec is the one the
    other finders give, with a loader that runs the real one, then :func:`_arrive`
    (:class:`_ThenSeed`). A spec found but never executed (``importlib.util.find_spec``, as
    libraries do to see whether torch is installed) leaves nothing behind."""

    def __init__(self) -> None:
        self._finding = threading.local()  # names being looked up by this thread, below

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        finding: set[str] = self._finding.__dict__.setdefault("names", set())
        if name not in _SEEDED or name in finding:
            return None
        finding.add(name)
        try:
            for finder in sys.meta_path:
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            finding.discard(name)
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenSeed(spec.loader)
        return spec


class _ThenSeed(importlib.abc.Loader):
    """A module's own loader, then :func:`_arrive` once the module is executed."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = module.__spec__.loader = self._loader  # as if found without the hook
        self._loader.exec_module(module)
        try:
            _arrive(module.__spec__.name)
            if module.__spec__.name == "torch":
                torch_on_one_thread()
        except Exception:  # the import itself succeeded: never fail it for a seed
            workers_log.warning("could not seed %s", module.__spec__.name, exc_info=True)


def seed_on_import() -> None:
    """In a worker: seed numpy.random and torch as they are imported (see :data:`_SEEDED`);
    torch also gets one intra-op thread then (:func:`torch_on_one_thread`)."""
    _arrived.update(name for name in _SEEDED if name in sys.modules)
    if not any(isinstance(finder, _SeedOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SeedOnImport())


def _mix(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
