"""Parquet files as an async stream of rows, row groups read many at once.

``ParquetDataset(paths)`` is an async iterable dataset, read on the loader's event loop as
:class:`~aioloader.sources.TarDataset` is; the unit of work is the *row group* (Parquet's unit
of independent reading, typically 10^4 to 10^6 rows), as the shard is for tar::

    first iteration: alist_objects(paths) ─▶ files ─▶ each file's footer (at once)
        ─▶ row groups [(file, row group), ...], kept for later epochs
    each epoch: Mixer(this rank's share of the row groups, in the epoch's order)
      row group readers (one task per open row group)   the epoch (:mod:`._readers`)
        its bytes ─▶ read_row_group (a thread)            Mixer.want() ─▶ (row group, row)
        ─▶ rows, a slice at a time (a thread)             ─▶ shuffle buffer ─▶ row ─▶ loader
        ─▶ bounded queue ─────────────────────────────▶                                │
                                  decode(row) in a worker process or thread ◀───────────┘

pyarrow's calls block (parsing, decompressing, converting to Python), so each runs in a thread
of the loop's default executor, never on the loop; ``row_groups_in_flight`` row groups are read
at once (and as many more are opened ahead). Local files are read by pyarrow itself; any other
URL's bytes (the footer, then the byte ranges of the columns asked for) are read on the loop
through fsspec's async filesystems, retried by the sources' :class:`~aioloader.sources.RetryPolicy`
(:mod:`._parquetio`).

A row is a dict ``{column: value}`` of the ``columns`` asked for (all by default). A numeric
column without nulls gives numpy scalars (its dtype kept); a list column of numbers without
nulls (embeddings) gives a 1-D numpy array per row; any other column gives what pyarrow's
``to_pylist`` gives (``str``, ``bytes``, ``None``, dicts for structs ...). So
``default_collate`` stacks numbers and embeddings into tensors and keeps strings as lists.

**Order, ranks, resume** are :class:`~aioloader.sources.TarDataset`'s, with row groups for
shards: rank ``r`` of ``R`` reads row groups ``r, r + R, ...`` of the epoch's order (shuffled
from ``(seed, epoch)`` with ``shuffle``, rows then mixed by a seeded buffer); worker processes
only decode, so each row group is read once per epoch across ranks and workers.
With ``even_shares`` the ranks get as many rows, cut by the footers' row counts (a row group
split between two ranks is read by both, each keeping its part); every rank's states, merged,
resume on any number of ranks (:mod:`._elastic`). ``state_dict()`` records the epoch, the rows
yielded and how many rows each row group that ended gave; a resumed epoch yields exactly the
rows, in exactly the order, that the uninterrupted one would still have yielded, under any
``num_workers`` (the loop is the one reader). The listing and footers are read again in a new
process and must agree (the number of row groups and rows, then the ``"catalog"`` digest below:
a file renamed or replaced keeps the counts and changes the digest; the files count without
credential and expiry parameters and below the directory they share, so presigned URLs signed
again and the same files at another mount resume). Each rank lists and
reads the footers itself, so a footer that fails on one rank only (it counts as one record
there) or a listing that changed between ranks gives them different row groups: a state
records a digest of the files, row groups and rows it planned with (``"catalog"``), and
merging the ranks' states refuses ones that differ, naming the ranks.

**Failures.** A pattern that matches nothing fails the first iteration with a
``FileNotFoundError`` naming it (:class:`~aioloader.RemoteNotFoundError` for remote ones). A
file whose footer cannot be read, or a row group that cannot be read or decoded (after the
retries), yields one record in place of its next row and ends; decoding it raises
:class:`~aioloader.ShardError` naming the file and the row group. So ``on_error="skip"``
skips it as one failure, and the other row groups go on.

Sharp edges:

- Memory: a row group whose columns read take more than ``max_row_group_bytes`` (the
  uncompressed sizes its footer gives) is refused before it is read: a failure record naming
  the file, the row group, its size and the setting. Files of any size are read; only one
  row group is held whole.
- URLs are shown masked (:mod:`._redact`) in errors and ``repr``.
- Memory: each row group in flight is held whole as Arrow data (compressed size times the
  codec's ratio), ``2 x row_groups_in_flight`` of them with those opened ahead; its rows are
  made Python objects ``ROWS_PER_SLICE`` at a time. Write files with row groups of tens of MB.
- Directories and globs leave out files whose names start with ``_`` or ``.`` (Spark's
  ``_SUCCESS``, ``_metadata``), as pyarrow's datasets do; a file named explicitly is read.
- An ``http(s)://`` path is one file (not an index file as for the other sources). Remote
  paths are of one protocol (one filesystem's ``storage_options``).
- The listing and footers are read once, at the first iteration, and kept: files added later
  are read by a new dataset.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import posixpath
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import ShardError
from .._validate import boolean, callable_or_none, check_state_keys, non_negative_int, positive_int
from ._base import as_names, byte_limit, too_large
from ._elastic import Plan, plan, rest_of
from ._listing import alist_objects
from ._parquetio import Storage, pyarrow_parquet, row_group_bytes
from ._parquetio import rows as as_rows
from ._readers import UnitStream, check_fits
from ._redact import add_credential_parameters, parameters_state, redact, same_objects
from ._retry import RetryPolicy

__all__ = ["BrokenRowGroup", "ParquetDataset"]

#: Row groups read at once by default (as many more are opened ahead). Each holds its Arrow
#: data in memory; more hide more latency per byte of bandwidth.
ROW_GROUPS_IN_FLIGHT = 4

#: Rows in the shuffle buffer by default (as TarDataset's samples).
SHUFFLE_BUFFER = 1000

#: Rows made Python objects per thread hop: fewer hops for more, less memory for fewer.
ROWS_PER_SLICE = 256

#: The default bound on one row group's columns, uncompressed (``max_row_group_bytes``): 4 GiB.
#: Above the 1 GiB of other sources because row groups are large by design: pyarrow's default
#: of 1,048,576 rows of a 768-float embedding is 3 GiB, and those files must keep working;
#: below what a row group from a mistaken file (one row group of a whole table) would take.
#: Each of ``2 x row_groups_in_flight`` row groups may hold this much.
MAX_ROW_GROUP_BYTES = 4 << 30

#: Footers read at once on the first iteration (each a thread and a request or two).
FOOTERS_AT_ONCE = 16

STATE_VERSION = 1

#: File names a listing leaves out (Spark's _SUCCESS and _metadata, hidden files).
IGNORED_PREFIXES = ("_", ".")


@dataclass(frozen=True, slots=True)
class BrokenRowGroup:
    """In place of a row: ``row_group`` of ``url`` (None: its footer) failed; ``decode``
    raises."""

    url: str
    row_group: int | None
    reason: str

    def error(self) -> ShardError:
        where = "its footer" if self.row_group is None else f"row group {self.row_group}"
        return ShardError(
            f"Parquet file {redact(self.url)} failed at {where}: {redact(self.reason)}",
            url=self.url,
            row_group=self.row_group,
        )


@dataclass(frozen=True, slots=True)
class _Catalog:
    """What the first iteration learnt: the files, their footers, and the row groups."""

    files: tuple[str, ...]
    metadata: tuple[Any, ...]  # pyarrow FileMetaData per file; _Failed where the footer failed
    units: tuple[tuple[int, int | None], ...]  # (file, row group); (file, None): a bad footer
    failures: Mapping[int, str]  # file -> why its footer failed
    rows: int
    lengths: tuple[int, ...]  # rows per unit, from the footers (a bad footer's unit: 1 record)

    def digest(self) -> str:
        """A short digest of the files, their row groups and rows (a state's ``"catalog"``):
        every rank lists and reads the footers itself, so ranks that saw different data (a
        footer that failed on one rank only, a listing that changed) differ in it, and
        ``merge_states`` refuses their states, naming them. The files count as the tar
        shards' digest counts them (:func:`~._redact.same_objects`): without credential and
        expiry parameters (presigned URLs signed again are the same files) and below the part
        all of them share up to a ``/`` (the same files at another mount or bucket)."""
        files = same_objects(self.files)
        seen = json.dumps([files, self.units, self.lengths], separators=(",", ":"))
        return hashlib.sha256(seen.encode()).hexdigest()[:16]


class ParquetDataset(UnitStream):
    """Parquet files' rows, row groups read concurrently, shuffled reproducibly, resumable.

    Example::

        ds = ParquetDataset("s3://bucket/train/", columns=["embedding", "label"],
                            shuffle=True, storage_options={"anon": True})
        async with DataLoader(ds, batch_size=256, num_workers=2) as loader:
            async for batch in loader: ...  # batch["embedding"]: a (256, d) tensor

    Args:
        paths: files, directories, globs (``data/*.parquet``, ``s3://b/train/**.parquet``) or
            prefixes of any fsspec filesystem; listed at the first iteration, each pattern's
            files sorted, the patterns in the order given.
        decode: turns a row (a dict) into what the loader collates, off the event loop;
            ``None`` keeps the dict. Must be picklable to be used with worker processes.
        columns: the columns to read (all by default).
        shuffle: shuffle the row group order each epoch and the rows through a buffer.
        shuffle_buffer: rows held by the shuffle buffer (with ``shuffle``).
        seed: seeds the row group order and the buffer, with the epoch (the same on every rank).
        row_groups_in_flight: row groups read at once (per rank).
        storage_options: options of the fsspec filesystem (credentials, endpoint).
        retry: attempts and backoff of each remote listing and read.
        max_row_group_bytes: the most bytes of one row group's columns read, uncompressed
            (from its footer): a larger one fails before it is read (``ShardError`` naming the
            file, the row group, its size and this setting when decoded; skipped under
            ``on_error="skip"``). ``None``: no bound.
        even_shares: even the ranks' shares up front by the footers' row counts: every rank
            gets as many rows (the first ``rows mod R`` ranks one more), a row group split
            between two ranks being read by both, each keeping its part. ``False``: each rank
            reads whole row groups, and the shares differ in length.

    Raises:
        ImportError: pyarrow is not installed (the ``parquet`` extra).
        TypeError: an argument of the wrong type, naming it.
        ValueError: a count out of range or no paths, naming the argument and the value.
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        decode: Callable[[dict[str, Any]], Any] | None = None,
        *,
        columns: Iterable[str] | None = None,
        shuffle: bool = False,
        shuffle_buffer: int = SHUFFLE_BUFFER,
        seed: int = 0,
        row_groups_in_flight: int = ROW_GROUPS_IN_FLIGHT,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        max_row_group_bytes: int | None = MAX_ROW_GROUP_BYTES,
        even_shares: bool = False,
    ) -> None:
        pyarrow_parquet()
        self._paths = as_names(paths, "paths", paths=True)
        if not self._paths:
            raise ValueError("ParquetDataset needs at least one path, got paths=[]")
        self.columns = _columns(columns)
        self._decode_fn = callable_or_none("decode", decode)
        self.shuffle = boolean("shuffle", shuffle)
        self.shuffle_buffer = positive_int("shuffle_buffer", shuffle_buffer)
        self.seed = non_negative_int("seed", seed)
        self.row_groups_in_flight = positive_int("row_groups_in_flight", row_groups_in_flight)
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a mapping, got {storage_options!r}")
        self._storage_options = dict(storage_options or {})
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry must be a RetryPolicy, got {retry!r}")
        self._retry = retry if retry is not None else RetryPolicy()
        self.max_row_group_bytes = byte_limit("max_row_group_bytes", max_row_group_bytes)
        self.even_shares = boolean("even_shares", even_shares)
        self._epoch = 0
        self._rank = (0, 1)
        self._resume: dict[str, Any] | None = None
        self._current = None
        self._catalog: _Catalog | None = None
        self._storage: Storage | None = None

    @property
    def paths(self) -> tuple[str, ...]:
        """The paths and patterns, as given."""
        return self._paths

    @property
    def files(self) -> tuple[str, ...] | None:
        """The files read, once the first iteration listed them (None before)."""
        return None if self._catalog is None else self._catalog.files

    def __repr__(self) -> str:
        return (
            f"ParquetDataset({len(self._paths)} paths, first={redact(self._paths[0])!r}, "
            f"columns={self.columns!r}, shuffle={self.shuffle}, "
            f"row_groups_in_flight={self.row_groups_in_flight})"
        )

    # -- what the loader calls -----------------------------------------------------------

    def decode(self, raw: Any) -> Any:
        """Turn a row into what the loader collates (runs off the event loop).

        Raises:
            ShardError: ``raw`` stands for a row group that failed (see the module docstring).
            Exception: what ``decode`` raised, unchanged.
        """
        if isinstance(raw, BrokenRowGroup):
            raise raw.error()
        if self._decode_fn is None:
            return raw
        return self._decode_fn(raw)

    def state_dict(self) -> dict[str, Any]:
        """Where the current (or last) iteration is: after the rows it has yielded.

        Between iterations (or after one ran to its end) it points at the next epoch's start.
        """
        catalog = self._catalog
        return {
            **self._position(STATE_VERSION),
            **self._fingerprint(),
            "rank": list(self._rank),
            "row_groups": None if catalog is None else len(catalog.units),
            "rows": None if catalog is None else catalog.rows,
            "lengths": list(catalog.lengths) if catalog and self.even_shares else None,
            "catalog": None if catalog is None else catalog.digest(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration continue from ``state`` (see the module docstring).

        Raises:
            ValueError: the state lacks a key or was saved by a dataset that orders rows
                differently (shuffle settings, seed or ``row_groups_in_flight``), or from
                other files (other row groups or rows, or the same counts from other files:
                its ``"catalog"`` digest), naming what differs and both values. The files are
                listed at the first iteration: a dataset that has not iterated yet refuses
                other files when its next iteration starts.
        """
        state = check_state_keys("ParquetDataset", state, ("epoch", "yielded", "ended", "seed"))
        saved = {**state, "even_shares": state.get("even_shares", False)}  # (older states)
        check_fits("ParquetDataset", saved, self._fingerprint())
        if self._catalog is not None:  # listed already: refused here, not at the iteration
            _check_catalog("ParquetDataset.load_state_dict", state, self._catalog)
        self._resume_from(state)

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer if self.shuffle else 0,
            "seed": self.seed,
            "row_groups_in_flight": self.row_groups_in_flight,
            "even_shares": self.even_shares,
        }

    async def aclose(self) -> None:
        """Close the remote files' connections (the loader calls it when it closes)."""
        storage, self._storage = self._storage, None
        if storage is not None:
            await storage.aclose()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._start("ParquetDataset", _RowGroups(self), self.row_groups_in_flight)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # The live iteration belongs to this process's loop; a copy (a worker's, which only
        # decodes) lists and reads footers again if it is ever iterated.
        state["_current"] = None
        state["_catalog"] = None
        state["_storage"] = None
        # A worker masks what it shows (failed row groups) as this process does.
        state["_credential_parameters"] = parameters_state()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        add_credential_parameters(*state.pop("_credential_parameters", ()))
        self.__dict__.update(state)

    # -- IO, for _RowGroups --------------------------------------------------------------

    async def _catalogue(self) -> tuple[_Catalog, Storage]:
        """The files and their row groups: listed and read at the first iteration, kept."""
        if self._catalog is None:
            files = await self._list()
            storage = self._storage = self._open_storage(files)
            gate = asyncio.Semaphore(FOOTERS_AT_ONCE)

            async def footer(url: str) -> Any:
                async with gate:
                    try:
                        return await storage.metadata(url)
                    except Exception as exc:
                        return _Failed(redact(f"{type(exc).__name__}: {exc}"))

            metadata = await asyncio.gather(*(footer(url) for url in files))
            self._catalog = _catalog(tuple(files), metadata, self.columns)
        if self._storage is None:  # closed since (aclose): it reopens
            self._storage = self._open_storage(self._catalog.files)
        return self._catalog, self._storage

    def _open_storage(self, files: Iterable[str]) -> Storage:
        options, retry = self._storage_options, self._retry
        return Storage(list(files), options, retry, self.max_row_group_bytes)

    async def _list(self) -> list[str]:
        """The files: the http(s) ones as given (HTTP cannot list), then every other pattern's,
        listed at once, each pattern's sorted, the patterns in the order given."""
        files = [path for path in self._paths if _is_http(path)]
        patterns = [path for path in self._paths if not _is_http(path)]
        if patterns:
            found = await alist_objects(
                patterns, storage_options=self._storage_options, retry=self._retry
            )
            # An expanded pattern leaves out _SUCCESS, _metadata, hidden files; a file named
            # explicitly is read whatever its name.
            files += [name for name in found if name in self._paths or not _ignored(name)]
        if not files:
            raise FileNotFoundError(
                errno.ENOENT,
                "no Parquet files (every file listed starts with _ or .)",
                [redact(pattern) for pattern in patterns],
            )
        return list(dict.fromkeys(files))


@dataclass(frozen=True, slots=True)
class _Failed:
    """A footer that could not be read, and why."""

    reason: str


def _catalog(
    files: tuple[str, ...], metadata: list[Any], columns: tuple[str, ...] | None
) -> _Catalog:
    units: list[tuple[int, int | None]] = []
    lengths: list[int] = []
    failures: dict[int, str] = {}
    rows = 0
    for index, (url, meta) in enumerate(zip(files, metadata, strict=True)):
        if isinstance(meta, _Failed):
            failures[index] = meta.reason
            units.append((index, None))
            lengths.append(1)  # its failure record
            continue
        if columns is not None:
            names = meta.schema.to_arrow_schema().names
            missing = [c for c in columns if c not in names]
            if missing:
                raise ValueError(
                    f"columns={list(columns)!r}: {redact(url)} has no column {missing[0]!r} "
                    f"(its columns: {names})"
                )
        units += [(index, group) for group in range(meta.num_row_groups)]
        lengths += [meta.row_group(group).num_rows for group in range(meta.num_row_groups)]
        rows += meta.num_rows
    return _Catalog(files, tuple(metadata), tuple(units), failures, rows, tuple(lengths))


def _check_catalog(owner: str, state: Mapping[str, Any], catalog: _Catalog) -> None:
    """Refuse a state saved from other files, row groups or rows than ``catalog``'s: its
    counts where they differ, else its digest (``"catalog"``; a state saved before states
    had one is checked by the counts only).

    Raises:
        ValueError: naming what differs and both values.
    """
    for key, value in (("row_groups", len(catalog.units)), ("rows", catalog.rows)):
        if state.get(key) is not None and state[key] != value:
            raise ValueError(
                f"{owner}: the state being resumed was saved with {key}={state[key]}, and the "
                f"files have {value} now; the order of rows would differ"
            )
    digest = catalog.digest()
    if state.get("catalog") is not None and state["catalog"] != digest:
        raise ValueError(
            f"{owner}: the state being resumed was saved from other files "
            f"(catalog={state['catalog']!r}, a digest of the files, their row groups and "
            f"rows), and the files give catalog={digest!r} now, with as many row groups "
            f"({len(catalog.units)}) and rows ({catalog.rows}): a file renamed, replaced or "
            "listed in another order, so rows would repeat and others be lost. Resume over "
            "the files the state was saved from (compared by their names below the directory "
            "they share, less credentials and expiry parameters); to resume over files "
            'renamed on purpose, set the state\'s "catalog" to None (then only the counts '
            'are checked; in a DataLoader\'s state it is '
            'state["streams"]["states"][i]["catalog"], i the stream\'s place)'
        )


class _RowGroups:
    """The row groups as an epoch reads them (:class:`~._readers.Units`)."""

    kind = "parquet"

    def __init__(self, dataset: ParquetDataset) -> None:
        self.dataset = dataset
        self.catalog: _Catalog | None = None
        self.storage: Storage | None = None

    async def start(self, epoch: int, resume: Mapping[str, Any] | None) -> Plan:
        """The mixer of ``epoch``, after the first iteration's listing and footers."""
        ds = self.dataset
        catalog, self.storage = await ds._catalogue()
        self.catalog = catalog
        if resume is not None:
            _check_catalog("ParquetDataset", resume, catalog)
        rest = rest_of("ParquetDataset", resume)
        if rest is not None and rest.units != len(catalog.units):
            raise ValueError(
                f"ParquetDataset: the state being resumed was saved with {rest.units} row "
                f"groups, and the files have {len(catalog.units)} now; the order of rows "
                "would differ"
            )
        rank, world = ds._rank
        return plan(
            len(catalog.units),
            rest,
            catalog.lengths if ds.even_shares else None,
            shuffle=ds.shuffle,
            seed=ds.seed,
            epoch=epoch,
            rank=rank,
            world=world,
            slots=ds.row_groups_in_flight,
            buffer=ds.shuffle_buffer if ds.shuffle else 0,
        )

    def where(self, unit: int) -> tuple[str, str]:
        assert self.catalog is not None
        file, group = self.catalog.units[unit]
        url = self.catalog.files[file]
        what = "footer" if group is None else f"row group {group}"
        return f"Parquet {what} of {redact(url)}", url

    async def records(self, unit: int) -> AsyncGenerator[Any, None]:
        """The rows of row group ``unit``; a failure ends it with a :class:`BrokenRowGroup`."""
        catalog = self.catalog
        assert catalog is not None
        file, group = catalog.units[unit]
        url = catalog.files[file]
        if group is None:
            yield BrokenRowGroup(url, None, catalog.failures[file])
            return
        assert self.storage is not None
        limit = self.dataset.max_row_group_bytes
        metadata = catalog.metadata[file]
        size = row_group_bytes(metadata.row_group(group), self.dataset.columns)
        if limit is not None and size > limit:
            what = f"row group {group} (its columns read, uncompressed)"
            yield BrokenRowGroup(url, group, too_large(what, size, "max_row_group_bytes", limit))
            return
        try:
            table = await self.storage.row_group(
                url, catalog.metadata[file], group, self.dataset.columns
            )
            for start in range(0, table.num_rows, ROWS_PER_SLICE):
                for row in await asyncio.to_thread(as_rows, table.slice(start, ROWS_PER_SLICE)):
                    yield row
        except Exception as exc:
            yield BrokenRowGroup(url, group, redact(f"{type(exc).__name__}: {exc}"))


def _columns(columns: Iterable[str] | None) -> tuple[str, ...] | None:
    if columns is None:
        return None
    if isinstance(columns, str):
        raise TypeError(f"columns must be a list of column names, got the string {columns!r}")
    names = tuple(columns)
    for position, name in enumerate(names):
        if not isinstance(name, str):
            raise TypeError(f"columns[{position}] must be a column name (str), got {name!r}")
    if not names:
        raise ValueError("columns must name at least one column, got columns=[]")
    return names


def _is_http(path: str) -> bool:
    return path.lower().startswith(("http://", "https://"))


def _ignored(path: str) -> bool:
    return posixpath.basename(path.replace(os.sep, "/")).startswith(IGNORED_PREFIXES)
