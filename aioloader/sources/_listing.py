"""Listing: from a prefix, a glob or an index file to the list of objects behind a dataset.

Remote sources read one object per sample from an explicit list. This module makes that list
from what people have at hand, for any source (the ready ones, or a shard reader that takes
a list of URLs)::

    alist_objects(["s3://b/train/*.tar", "s3://b/extra/"]) ── one task per pattern, at once
        │ local path, file://         ─▶ list_local (a thread: it walks the disk)   (_file)
        │ http://, https://           ─▶ read_index: an index file, one URL a line  (_http)
        │ s3://, gs://, any fsspec    ─▶ list_fsspec: glob or prefix, paginated     (_fsspec)
        ▼
    each pattern's objects sorted (an index keeps its own order), the patterns in the order
    given, a name listed twice kept once ──▶ list[str]

Every pattern must match something: an empty listing is an error naming the pattern (a
``FileNotFoundError``; :class:`~aioloader.RemoteNotFoundError` for remote ones), never an
empty dataset that trains on nothing. Listings are retried as reads are, with the same
:class:`~aioloader.sources.RetryPolicy`.

Sharp edges:

- The order is code point order of the names (``shard-10`` before ``shard-9``): zero-pad
  shard numbers, as every sharding tool does. It is the same on every machine and every run,
  which is what distributed ranks need to agree on the shards.
- :func:`list_objects` is blocking. Called while an event loop runs in its thread (a
  notebook), it lists on a helper thread's loop and blocks that loop meanwhile; async code
  awaits :func:`alist_objects` instead.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any

from ._base import as_names, run_sync
from ._file import list_local
from ._fsspec import list_fsspec
from ._http import read_index
from ._redact import redact
from ._retry import RetryPolicy

__all__ = ["alist_objects", "list_objects"]

Pattern = str | os.PathLike[str]


async def alist_objects(
    patterns: Pattern | Iterable[Pattern],
    *,
    storage_options: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    retry: RetryPolicy | None = None,
) -> list[str]:
    """The objects behind one or more prefixes, globs or index files, listed concurrently.

    Each pattern is one of:

    - a local directory, file or glob (``data/train/``, ``data/**/*.npy``, ``file://...``):
      the files, sorted (see :func:`~aioloader.sources.FileDataset.from_prefix`);
    - an ``http://`` or ``https://`` URL: an index file, one URL per line, relative ones
      resolved against it, in the file's order;
    - a URL of any fsspec filesystem (``s3://b/train/``, ``gs://b/train/*.tar``,
      ``s3://b/**/*.npy``): the objects under the prefix or matching the glob, sorted; S3's
      pages of 1,000 keys are all read.

    Example::

        shards = await alist_objects("s3://bucket/train/*.tar", storage_options={"anon": True})

    Args:
        patterns: one pattern or several; several are listed at once and their objects
            joined in the order given (a name listed twice is kept once, where first listed).
        storage_options: the fsspec filesystem's options (credentials, endpoint).
        headers: extra request headers for index files.
        retry: attempts and backoff of each listing (default :class:`RetryPolicy()`).

    Returns:
        The objects' paths or URLs.

    Raises:
        FileNotFoundError: a pattern matches nothing (remote ones raise its subclass
            :class:`~aioloader.RemoteNotFoundError`); the message names the pattern.
        ValueError: a URL without a known protocol, or a glob in an http(s) URL (HTTP cannot
            list: give an index file).
        TypeError: ``patterns`` is not a string, a path or a sequence of them.
    """
    names = as_names(patterns, "patterns", paths=True)
    if not names:
        raise ValueError("patterns is empty: give at least one prefix, glob or index URL")
    listings = [_lister(name, storage_options, headers, retry) for name in names]
    tasks = [asyncio.ensure_future(listing()) for listing in listings]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        # The first failure is the error (not a group of one: a missing prefix is a plain
        # FileNotFoundError); the other listings are of no use now and stop.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    joined: dict[str, None] = {}  # ordered, each name once
    for found in results:
        joined.update(dict.fromkeys(found))
    return list(joined)


def list_objects(
    patterns: Pattern | Iterable[Pattern],
    *,
    storage_options: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    retry: RetryPolicy | None = None,
) -> list[str]:
    """:func:`alist_objects` for synchronous code (blocking; see the module's sharp edges).

    Example::

        urls = list_objects("s3://bucket/train/")
        ds = FsspecDataset(urls, decode=decode)
    """
    return run_sync(
        lambda: alist_objects(
            patterns, storage_options=storage_options, headers=headers, retry=retry
        )
    )


def _lister(
    name: str,
    storage_options: Mapping[str, Any] | None,
    headers: Mapping[str, str] | None,
    retry: RetryPolicy | None,
) -> Callable[[], Coroutine[Any, Any, list[str]]]:
    """How to list ``name`` (checked now, so a bad pattern fails before any IO starts)."""
    scheme, sep, _ = name.partition("://")
    if not sep or scheme == "file":
        return lambda: asyncio.to_thread(list_local, name)
    if scheme in ("http", "https"):
        if "*" in name:
            raise ValueError(
                f"pattern {redact(name)!r}: an http(s) URL cannot be globbed (HTTP has no "
                "listing); give the URL of an index file that lists one URL per line"
            )
        options: dict[str, Any] = {"headers": headers}
        if retry is not None:
            options["retry"] = retry
        return lambda: read_index(name, **options)
    return lambda: list_fsspec(name, storage_options=storage_options, retry=retry)
