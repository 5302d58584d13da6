"""Ready datasets for real storage: local files, HTTP(S), object stores.

Each source is an async map-style dataset in two stages: ``await fetch(i)`` does the IO on the
event loop (with retries, for remote ones) and returns bytes whose length was checked;
``decode(raw)`` does the CPU work, off the loop. ``await dataset[i]`` does both. The
:class:`~aioloader.DataLoader` awaits ``fetch`` with ``io_concurrency`` requests in flight and
runs ``decode`` in a thread or worker process.

- :class:`FileDataset`: local files, through aiofiles.
- :class:`HTTPDataset`: http:// and https:// URLs, through aiohttp (the ``remote`` extra).
- :class:`FsspecDataset`: s3://, gs://, ... through fsspec's async filesystems (the ``remote``
  extra).
- :class:`TarDataset`: WebDataset-style tar shards from any of the three, streamed many at
  once, shuffled reproducibly, resumable mid-epoch (an async iterable dataset).
- :class:`ParquetDataset`: Parquet files (local, s3://, any fsspec URL) as a stream of rows,
  row groups read many at once, shuffled and resumable as tar shards are (the ``parquet``
  extra: pyarrow).
- :class:`RetryPolicy` and :func:`retrying`: the retry loop both remote sources share, for
  writing another one.
- :func:`add_credential_parameters`: more query parameters whose values are masked wherever a
  URL is shown (presigned signatures, SAS ``sig``, tokens and userinfo passwords already are).
  Every source masks the URLs it shows in errors, logs and ``repr``, and bounds what it holds
  of one object (``max_object_bytes``; a tar member's ``max_member_bytes``, a Parquet row
  group's ``max_row_group_bytes``).
- :func:`list_objects` / :func:`alist_objects`: the objects behind a prefix, a glob or an
  index file (``s3://b/train/*.tar``, ``data/train/``, ``https://host/index.txt``), sorted,
  for any source that takes a list; each dataset's ``from_prefix`` (``from_index`` for HTTP)
  builds one from such a listing. A prefix or glob given where one object is expected is
  refused at construction.

Importing this package imports neither aiohttp, fsspec nor pyarrow; a source imports its library
when it is made, and says which extra to install (``pip install 'aioloader[remote]'``,
``'aioloader[parquet]'``) if it is missing.
"""

from __future__ import annotations

from ._elastic import merge_stream_states as merge_stream_states  # (distributed.merge_states)
from ._file import FileDataset as FileDataset
from ._fsspec import FsspecDataset as FsspecDataset
from ._http import HTTPDataset as HTTPDataset
from ._http import read_index as read_index
from ._listing import alist_objects as alist_objects
from ._listing import list_objects as list_objects
from ._parquet import BrokenRowGroup as BrokenRowGroup
from ._parquet import ParquetDataset as ParquetDataset
from ._redact import add_credential_parameters as add_credential_parameters
from ._retry import RetryableError as RetryableError
from ._retry import RetryPolicy as RetryPolicy
from ._retry import parse_retry_after as parse_retry_after
from ._retry import retrying as retrying
from ._tar import BrokenShard as BrokenShard
from ._tar import TarDataset as TarDataset

__all__ = [
    "BrokenRowGroup",
    "BrokenShard",
    "FileDataset",
    "FsspecDataset",
    "HTTPDataset",
    "ParquetDataset",
    "RetryPolicy",
    "RetryableError",
    "TarDataset",
    "add_credential_parameters",
    "alist_objects",
    "list_objects",
    "parse_retry_after",
    "read_index",
    "retrying",
]

for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
