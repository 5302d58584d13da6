"""Parquet's parts read: footers and row groups, from local files or remote objects; and Arrow
tables made rows. The IO for :mod:`._parquet`.

pyarrow's calls block, so they run in threads (the loop's default executor); remote bytes are
read on the loop, by an :class:`~aioloader.sources.FsspecDataset` over the files (fsspec's
async filesystems, retried by the sources' policy), and only parsed in a thread::

    local file   ─▶ pyarrow reads it itself, in a thread: read_metadata / read_row_group
    remote URL   ─▶ footer:    size ─▶ its last FOOTER_GUESS bytes (more if the footer is
                               longer) ─▶ read_metadata of those bytes, in a thread
                 ─▶ row group: the byte ranges of its column chunks (the columns asked for;
                               ranges closer than RANGE_GAP merged), fetched at once ─▶ a
                               sparse file over them ─▶ read_row_group, in a thread

Sharp edges:

- Remote files are of one protocol (one filesystem's ``storage_options``), as for
  :class:`~aioloader.sources.FsspecDataset`.
- Bounds: a footer longer than ``max_bytes`` is refused before it is read (row groups are
  bounded by :mod:`._parquet`, from the footer's sizes). URLs are shown masked.
- The sparse file serves only the bytes fetched; pyarrow is asked to read page by page
  (``pre_buffer=False``), inside one column chunk at a time, so it never reads between them.
"""

from __future__ import annotations

import asyncio
import io
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from ._base import too_large
from ._fsspec import FsspecDataset
from ._redact import redact
from ._retry import RetryPolicy

__all__ = [
    "PARQUET_EXTRA_HINT",
    "Storage",
    "is_remote",
    "pyarrow_parquet",
    "row_group_bytes",
    "rows",
]

PARQUET_EXTRA_HINT = "pip install 'aioloader[parquet]'"

#: Bytes read from a remote file's end first: its footer, in one request, unless the footer is
#: longer (then one more). pyarrow's own guess.
FOOTER_GUESS = 64 << 10

#: Column chunks of a row group closer than this are fetched in one request (the bytes between
#: are read for nothing, and a request is saved).
RANGE_GAP = 1 << 20

_MAGIC = b"PAR1"


def pyarrow_parquet() -> Any:
    """``pyarrow.parquet``, or an ImportError naming the extra."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError(
            f"ParquetDataset needs the 'pyarrow' package, which is not installed: "
            f"{PARQUET_EXTRA_HINT}"
        ) from exc
    return pq


def is_remote(path: str) -> bool:
    protocol, sep, _ = path.partition("://")
    return bool(sep) and protocol != "file"


class Storage:
    """Footers and row groups of ``files`` (local paths and URLs of one protocol); a remote
    footer over ``max_bytes`` (``None``: no bound) is refused."""

    def __init__(
        self,
        files: Sequence[str],
        storage_options: Mapping[str, Any],
        retry: RetryPolicy,
        max_bytes: int | None = None,
    ) -> None:
        self._max_bytes = max_bytes
        remote = [url for url in files if is_remote(url)]
        self._index = {url: i for i, url in enumerate(remote)}
        self._sizes: dict[str, int] = {}  # learnt with each footer
        self._objects = (
            FsspecDataset(remote, storage_options=storage_options, retry=retry) if remote else None
        )

    async def metadata(self, url: str) -> Any:
        """The footer of ``url`` (pyarrow's ``FileMetaData``).

        Raises:
            ValueError: it is not a Parquet file (no magic bytes at its end).
            Exception: what the read or pyarrow raised.
        """
        pq = pyarrow_parquet()
        if self._objects is None or url not in self._index:
            return await asyncio.to_thread(pq.read_metadata, url.removeprefix("file://"))
        objects, index = self._objects, self._index[url]
        size = self._sizes[url] = await objects.size(index)
        tail = await objects.fetch_range(index, max(0, size - FOOTER_GUESS), size)
        shown = redact(url)
        if len(tail) < 12 or tail[-4:] != _MAGIC:
            raise ValueError(f"{shown}: not a Parquet file (it does not end with {_MAGIC!r})")
        needed = int.from_bytes(tail[-8:-4], "little") + 8
        if needed + 4 > size:
            raise ValueError(f"{shown}: its footer claims {needed} bytes of a {size}-byte file")
        if self._max_bytes is not None and needed > self._max_bytes:
            what = f"the footer of {shown}"
            raise ValueError(too_large(what, needed, "max_row_group_bytes", self._max_bytes))
        if needed > len(tail):
            tail = await objects.fetch_range(index, size - needed, size)
        return await asyncio.to_thread(_parse_footer, tail)

    async def row_group(
        self, url: str, metadata: Any, group: int, columns: Sequence[str] | None
    ) -> Any:
        """Row group ``group`` of ``url`` as an Arrow table of ``columns`` (all: None)."""
        cols = None if columns is None else list(columns)
        if self._objects is None or url not in self._index:
            path = url.removeprefix("file://")
            return await asyncio.to_thread(_read_local, path, metadata, group, cols)
        objects, index = self._objects, self._index[url]
        ranges = _ranges(metadata.row_group(group), columns)
        pieces = await asyncio.gather(*(objects.fetch_range(index, a, b) for a, b in ranges))
        size = self._sizes.get(url)
        if size is None:
            size = self._sizes[url] = await objects.size(index)
        sparse = _Sparse(
            url, size, [(a, data) for (a, _), data in zip(ranges, pieces, strict=True)]
        )
        return await asyncio.to_thread(_read_sparse, sparse, metadata, group, cols)

    async def aclose(self) -> None:
        if self._objects is not None:
            await self._objects.aclose()


def _parse_footer(tail: bytes) -> Any:
    import pyarrow as pa

    return pyarrow_parquet().read_metadata(pa.BufferReader(tail))


def _read_local(path: str, metadata: Any, group: int, columns: list[str] | None) -> Any:
    parquet = pyarrow_parquet().ParquetFile(path, metadata=metadata)
    return parquet.read_row_group(group, columns=columns)


def _read_sparse(sparse: _Sparse, metadata: Any, group: int, columns: list[str] | None) -> Any:
    parquet = pyarrow_parquet().ParquetFile(sparse, metadata=metadata, pre_buffer=False)
    return parquet.read_row_group(group, columns=columns)


def _chunks(group: Any, columns: Sequence[str] | None) -> list[Any]:
    """The column chunks of a row group that ``columns`` (by their top-level name) read."""
    wanted = None if columns is None else set(columns)
    chunks = (group.column(j) for j in range(group.num_columns))
    return [c for c in chunks if wanted is None or c.path_in_schema.split(".")[0] in wanted]


def row_group_bytes(group: Any, columns: Sequence[str] | None) -> int:
    """The bytes a row group's ``columns`` take once read (uncompressed, as its footer says):
    about what the row group holds in memory as Arrow data."""
    return sum(chunk.total_uncompressed_size for chunk in _chunks(group, columns))


def _ranges(group: Any, columns: Sequence[str] | None) -> list[tuple[int, int]]:
    """The byte ranges ``[start, end)`` of a row group's column chunks of ``columns`` (by
    their top-level name), sorted, near ones merged (see :data:`RANGE_GAP`)."""
    spans = []
    for chunk in _chunks(group, columns):
        # Some writers leave dictionary_page_offset 0 without a dictionary: the smallest
        # offset set is where the chunk starts.
        starts = [chunk.data_page_offset]
        if chunk.has_dictionary_page and chunk.dictionary_page_offset:
            starts.append(chunk.dictionary_page_offset)
        start = min(starts)
        spans.append((start, start + chunk.total_compressed_size))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start - merged[-1][1] <= RANGE_GAP:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


class _Sparse(io.RawIOBase):
    """A read-only file of ``size`` bytes of which only ``pieces`` (offset, bytes) are known;
    a read elsewhere raises, naming the offset (see the module's sharp edges)."""

    def __init__(self, url: str, size: int, pieces: list[tuple[int, bytes]]) -> None:
        super().__init__()
        self._url = url
        self._size = size
        self._pieces = pieces
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = base + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        position = self._position
        if position >= self._size:
            return 0
        for start, data in self._pieces:
            if start <= position < start + len(data):
                with memoryview(buffer) as out:
                    n = min(len(out), start + len(data) - position)
                    out[:n] = data[position - start : position - start + n]
                self._position += n
                return n
        raise OSError(
            f"{redact(self._url)}: a read at byte {position} lies outside the ranges fetched"
        )


def rows(table: Any) -> list[dict[str, Any]]:
    """The rows of an Arrow table as dicts: numpy scalars for numeric columns, a 1-D numpy
    array per row for lists of numbers, ``to_pylist``'s values for the rest (and for any
    column with nulls)."""
    names = table.column_names
    values = [_values(column.combine_chunks()) for column in table.columns]
    return [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]


def _values(array: Any) -> Any:
    """One column's values, one per row (see :func:`rows`)."""
    import pyarrow as pa

    kind = array.type
    if array.null_count:
        return array.to_pylist()
    if _numeric(pa, kind):
        return array.to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_list(kind) and _numeric(pa, kind.value_type):
        flat = array.flatten()
        if not flat.null_count:
            width = kind.list_size
            return flat.to_numpy(zero_copy_only=False, writable=True).reshape(-1, width)
    lists = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    if lists and _numeric(pa, kind.value_type):
        flat = array.flatten()
        if not flat.null_count:
            numbers = flat.to_numpy(zero_copy_only=False, writable=True)
            offsets = array.offsets.to_numpy()
            offsets = offsets - offsets[0]  # a slice's offsets start where the slice does
            return [numbers[a:b] for a, b in itertools.pairwise(offsets)]
    return array.to_pylist()


def _numeric(pa: Any, kind: Any) -> bool:
    return bool(
        pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
    )
