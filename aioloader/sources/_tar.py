"""WebDataset-style tar shards as an async stream of samples, many shards read at once.

``TarDataset(urls)`` is an async iterable dataset: the loader iterates it on its event loop,
which streams ``shards_in_flight`` shards at a time (HTTP through aiohttp, object stores through
fsspec, local files through aiofiles; no temporary files), parses each as it arrives
(:mod:`._tarfmt`), groups members into samples by key, and hands each sample's bytes to
``decode`` in a worker process or thread (the loader's two stages, as for the other sources)::

    shard readers (one task per open shard)      the epoch (one async generator)
      source.stream(i) ─▶ TarParser ─▶ Grouper     Mixer.want() ─▶ (shard, position)
        ─▶ bounded queue of raw samples ─────────▶ await that shard's queue ─▶ Mixer.put()
                                                   ─▶ shuffle buffer ─▶ raw sample ─▶ loader
                                                                                      │
                               decode(raw) in a worker process or thread ◀────────────┘

Who decides what: the order samples are used in is the :class:`~._mixing.Mixer`'s, a pure
function of (seed, epoch, rank share) and of where shards end; the network decides only when
they arrive. Hence the shuffle is reproducible and a position can be recomputed. The readers and
the epoch are :mod:`._readers`' (shared with the Parquet reader); this module says what a shard
is and how its bytes become samples.

**Resume.** ``state_dict()`` records the epoch, how many samples this iteration yielded, and
how many samples each shard that ended had: a few integers per shard, no sample data, whatever
the buffer size. ``load_state_dict(state)`` makes the next iteration replay the mixer to that
point without IO (:func:`~._mixing.replay`), then read again only what the buffer held then and
the open shards from their positions on: it yields exactly the samples, in exactly the order,
that the uninterrupted epoch would still have yielded. It is an
:class:`aioloader.ResumableStream`: the loader takes a state after each batch it pulls and
keeps the one of the last batch its consumer took, so batches in flight are not lost (see
``DataLoader.state_dict``). Reading happens on the loader's loop, one reader whatever
``num_workers`` is, so a state resumes under any number of workers.

**Ranks.** Shards, not samples, are split: rank ``r`` of ``R`` reads shards ``r, r + R, ...``
of the epoch's shard order (the loader tells it its rank through :meth:`TarDataset.set_rank`);
worker processes only decode, so each shard is read once per epoch across ranks and workers.
Ranks may get different numbers of samples, as with any stream; with ``even_shares`` and the
shards' ``lengths`` they get as many, a shard split between two ranks being read by both, each
keeping its part (:mod:`._elastic`). A rank's state resumes that rank; every rank's states,
merged (``aioloader.distributed.merge_states``), resume on any number of ranks.

**Failures.** A shard that is corrupt, truncated, or cannot be read (after the source's
retries) yields one record in place of its next sample and ends; decoding that record raises
:class:`~aioloader.ShardError` naming the shard URL and the member. So ``on_error="raise"``
stops at it and ``on_error="skip"`` skips it within ``max_failures``, counted as one failure,
like any sample whose decode fails; the other shards go on.

Sharp edges:

- Iterating it directly (``async for raw in dataset``) yields raw samples; ``decode(raw)``
  makes a sample (and raises for a failed shard). The loader does both.
- Over HTTP a body that breaks off is continued from the byte it stopped at (a ``Range``
  request, within the retry policy's attempts); fsspec and local reads are not: a read that
  fails mid-shard ends the shard with a failure record.
- A member is held whole until its last byte arrives: one over ``max_member_bytes`` (its
  header says its size) ends the shard with a failure record naming the member, its size and
  the setting, before any of its data is held. Shards themselves have no bound: they stream.
- Shard URLs are shown masked (:mod:`._redact`) in errors, notes and ``repr``; a sample's
  ``__url__`` is the URL as given (it is data).
- Connections: an open shard holds one of its source's pooled connections from its first
  byte to its last, also while its samples wait for their turn, and the epoch takes from
  every open shard in turn: the pool must hold ``shards_in_flight`` of them. The pools this
  module can size are sized for ``2 x shards_in_flight + 1`` (an ``s3://`` source it makes,
  an ``HTTPDataset`` without ``max_connections``), and a smaller one than
  ``shards_in_flight`` is refused at construction, naming its setting and both values.
  Between the two, the epoch's gate (:mod:`._readers`) serves the open shards and a resumed
  epoch's re-reads first; the shards ahead open as connections free. Epochs open at once
  over one source (``zip`` of two iterations, an evaluation pass beside training, two
  datasets over one source) share its pool: each keeps ``shards_in_flight`` connections
  for its open shards and both go on; one that does not fit beside the others is refused
  at its start with a ``RuntimeError`` naming the setting and what they need (give
  ``2 x shards_in_flight`` or more for two). The pools of other fsspec filesystems are not
  known here.
- A state holds a digest of the shard URLs (``"shard_list"``): a state of other shards,
  even as many, is refused; an older state without it (or with it set to None) is checked
  by the count. Each URL counts without its user info and its credential, expiry and
  signing parameters (presigned URLs signed again are the same shards; other parameters,
  ``?file=train-0001.tar``, tell shards apart), and below the part all the URLs share up to
  a ``/``: the same shards at another mount (``/scratch/$JOB/``), bucket or mirror resume,
  and shards of the same names in two directories of their own are not told apart.
- Exact resume needs the loader's ``in_order=True`` (the default); out of order, batches taken
  past one still in flight are yielded again after a resume, never lost.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import ShardError
from .._validate import (
    boolean,
    callable_or_none,
    check_state_keys,
    non_negative_int,
    positive_int,
)
from ._base import MAX_OBJECT_BYTES, byte_limit, too_large
from ._elastic import Plan, plan, rest_of
from ._file import LISTING_HINT, FileDataset
from ._fsspec import FsspecDataset
from ._http import HTTPDataset
from ._readers import UnitStream, check_fits
from ._redact import add_credential_parameters, parameters_state, redact, same_objects
from ._tarfmt import Grouper, MemberTooLargeError, TarFormatError, TarParser

__all__ = ["BrokenShard", "TarDataset"]

Source = HTTPDataset | FsspecDataset | FileDataset

#: Shards streamed at once by default; as many more are opened ahead (their first samples
#: wait in memory). Each costs a connection and up to ``READAHEAD`` samples of memory; more
#: hide more latency per byte of bandwidth.
SHARDS_IN_FLIGHT = 8

#: Samples in the shuffle buffer by default (WebDataset's ``shuffle(1000)``). More mixes shards
#: better and holds more memory; resume re-reads what it held.
SHUFFLE_BUFFER = 1000

#: Connections an S3 client pools when ``config_kwargs`` names no ``max_pool_connections``
#: (botocore's default). An open shard holds one while its samples wait (see
#: :func:`_pool_size`).
S3_POOL = 10

#: fsspec's protocols whose pool :func:`_pool_size` knows (s3fs's, through aiobotocore).
S3 = frozenset({"s3", "s3a"})

STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class BrokenShard:
    """In place of a sample: the shard ``url`` failed after ``member``; ``decode`` raises."""

    url: str
    member: str | None
    reason: str

    def error(self) -> ShardError:
        where = "before its first member" if self.member is None else f"at member {self.member!r}"
        return ShardError(
            f"tar shard {redact(self.url)} failed {where}: {redact(self.reason)}",
            url=self.url,
            member=self.member,
        )


def _make_source(
    urls: tuple[str, ...], storage_options: Mapping[str, Any] | None, in_flight: int
) -> Source:
    if storage_options is not None and not isinstance(storage_options, Mapping):
        # The type only: a string or a list of pairs holds the credentials themselves.
        raise TypeError(
            "storage_options must be a mapping of the fsspec filesystem's options, got a "
            f"{type(storage_options).__name__}"
        )
    if not storage_options:
        storage_options = None  # an empty mapping (a config's default) says nothing
    http = all(url.lower().startswith(("http://", "https://")) for url in urls)
    local = not http and all("://" not in url or url.startswith("file://") for url in urls)
    if storage_options is not None and (http or local):
        # The names only, never the values: they are credentials.
        raise ValueError(
            f"storage_options (keys {sorted(map(str, storage_options))}) apply to fsspec "
            + (
                "filesystems, and these shards are http(s) URLs: give "
                "TarDataset(source=HTTPDataset(urls, headers=...)) for HTTP settings"
                if http
                else "filesystems, and these shards are local files: leave them out"
            )
        )
    if http:
        return HTTPDataset(urls)
    if local:
        return FileDataset([url.removeprefix("file://") for url in urls])
    options = storage_options
    if urls[0].partition("://")[0].lower() in S3 and isinstance(options, Mapping | None):
        # The pool sized for the readers, unless the user said its size (checked later).
        config = (options or {}).get("config_kwargs", {})
        if isinstance(config, Mapping) and "max_pool_connections" not in config:
            size = max(S3_POOL, _pool_wanted(in_flight))
            config = {**config, "max_pool_connections": size}
            options = {**(options or {}), "config_kwargs": config}
    return FsspecDataset(urls, storage_options=options)


def _pool_wanted(in_flight: int) -> int:
    """Connections that let every reader of an epoch hold one: the open shards, as many
    opened ahead, and one for a resumed epoch's re-reads (see :mod:`._readers`)."""
    return 2 * in_flight + 1


def _pool_size(source: Source, in_flight: int) -> tuple[int | None, str]:
    """The most connections ``source`` opens at once per event loop, and the setting that
    says so, where it is known (None: not bounded, or not known: local files, fsspec's
    other filesystems). A source whose pool is left to its default is sized for
    :func:`_pool_wanted` first (HTTP's ``expect_in_flight``)."""
    if isinstance(source, HTTPDataset):
        source.expect_in_flight(_pool_wanted(in_flight))  # where max_connections is not given
        return source._connection_limit(), "max_connections"
    if isinstance(source, FsspecDataset) and source.protocol in S3:
        config = source._options.get("config_kwargs")
        given = config.get("max_pool_connections") if isinstance(config, Mapping) else None
        size = given if isinstance(given, int) and not isinstance(given, bool) else S3_POOL
        return size, "storage_options['config_kwargs']['max_pool_connections']"
    return None, ""


def _check_pool(source: Source, in_flight: int) -> tuple[int | None, str]:
    """The connections of ``source``'s pool (None: not bounded) and the setting that says
    so, refused where fewer than the
    open shards: each holds its connection while its samples wait for their turn, and the
    epoch takes from every open shard in turn, so it would wait for ever.

    Raises:
        ValueError: naming the pool's setting, its value and ``shards_in_flight``.
    """
    size, setting = _pool_size(source, in_flight)
    if size is not None and size < in_flight:
        raise ValueError(
            f"TarDataset: shards_in_flight={in_flight} needs a connection per open shard, and "
            f"the source's pool has {setting}={size}: an open shard holds its connection while "
            "its samples wait for their turn, so the epoch would wait for ever. Give "
            f"{setting}>={in_flight} ({_pool_wanted(in_flight)} also lets the shards ahead "
            "open early), or lower shards_in_flight"
        )
    return size, setting


def _shard_list(urls: tuple[str, ...]) -> str:
    """A short digest of the shards, in order (a state's ``"shard_list"``): a state of other
    shards, even as many, is refused. Each URL counts less its user info and its credential,
    expiry and signing parameters (a presigned URL signed again is the same shard; the other
    parameters, ``?file=train-0001.tar``, tell shards apart), and less the part every URL
    shares up to a ``/`` (the same shards at another mount or mirror are the same shards):
    see :func:`~._redact.same_objects`."""
    seen = json.dumps(same_objects(urls), separators=(",", ":"))
    return hashlib.sha256(seen.encode()).hexdigest()[:16]


class TarDataset(UnitStream):
    """WebDataset-style tar shards, streamed concurrently, shuffled reproducibly, resumable.

    Each sample is a dict ``{"__key__": key, "__url__": shard url, ext: bytes, ...}`` of the
    members that share a key (``a/b/0001.jpg`` and ``a/b/0001.cls``: key ``a/b/0001``,
    extensions ``jpg`` and ``cls``), handed to ``decode`` off the event loop.

    Example::

        shards = [f"https://data.example.com/train-{i:05d}.tar" for i in range(1024)]
        ds = TarDataset(shards, decode=decode_sample, shuffle=True, shards_in_flight=16)
        async with DataLoader(ds, batch_size=64, num_workers=4) as loader:
            async for batch in loader: ...

    Args:
        urls: the shards: http(s) URLs, local paths, or fsspec URLs (``s3://...``); one kind
            per dataset.
        decode: turns a sample dict into what the loader collates, off the event loop;
            ``None`` keeps the dict. Must be picklable to be used with worker processes.
        shuffle: shuffle the shard order each epoch and the samples through a buffer.
        shuffle_buffer: samples held by the shuffle buffer (with ``shuffle``).
        seed: seeds the shard order and the buffer, with the epoch (the same on every rank).
        shards_in_flight: shards streamed at once (per rank); the source's pool needs as many
            connections (see the module's sharp edges).
        storage_options: options of the fsspec filesystem (credentials, endpoint); refused
            for http(s) URLs and local files, and with ``source``.
        source: a ready :class:`HTTPDataset`, :class:`FsspecDataset` or :class:`FileDataset`
            over the shards, for its retry and timeout settings; then ``urls`` is ``None``.
        max_member_bytes: the most bytes of one member (held whole until complete): a larger
            one ends its shard with a failure naming the member, its size and this setting
            (``ShardError`` when decoded; skipped under ``on_error="skip"``). ``None``: no
            bound. Whole shards are streamed and never bounded.
        lengths: the number of samples of each shard (from the shards' index), for
            ``even_shares``.
        even_shares: even the ranks' shares up front by ``lengths``: every rank gets as many
            samples (the first ``samples mod R`` ranks one more), a shard split between two
            ranks being read by both, each keeping its part (a shard longer than its length
            says gives its extra samples to the rank with its last part). ``False``: each rank
            reads whole shards, and the shares differ in length.

    Raises:
        TypeError: an argument of the wrong type, naming it.
        ValueError: a count out of range or no shards, naming the argument and the value; a
            source's pool of fewer connections than ``shards_in_flight``, naming both.
    """

    def __init__(
        self,
        urls: Iterable[str | os.PathLike[str]] | str | None,
        decode: Callable[[dict[str, Any]], Any] | None = None,
        *,
        shuffle: bool = False,
        shuffle_buffer: int = SHUFFLE_BUFFER,
        seed: int = 0,
        shards_in_flight: int = SHARDS_IN_FLIGHT,
        storage_options: Mapping[str, Any] | None = None,
        source: Source | None = None,
        max_member_bytes: int | None = MAX_OBJECT_BYTES,
        lengths: Iterable[int] | None = None,
        even_shares: bool = False,
    ) -> None:
        self.shards_in_flight = positive_int("shards_in_flight", shards_in_flight)
        if source is None:
            if urls is None:
                raise TypeError("TarDataset needs urls or a source, got neither")
            names = urls if isinstance(urls, str | os.PathLike) else list(urls)
            shards = _names(names)
            if isinstance(urls, str | os.PathLike) and os.path.isdir(shards[0]):
                # One local directory would read as one shard that fails (as FileDataset).
                raise ValueError(
                    f"urls={redact(shards[0])!r} is a directory, not one tar shard; list the "
                    f"shards first: {LISTING_HINT}"
                )
            source = _make_source(shards, storage_options, self.shards_in_flight)
        elif urls is not None:
            raise TypeError("TarDataset takes urls or a source, not both")
        elif storage_options:  # an empty mapping says nothing
            raise TypeError("TarDataset takes storage_options or a source, not both")
        elif not isinstance(source, HTTPDataset | FsspecDataset | FileDataset):
            raise TypeError(
                f"source must be an HTTPDataset, FsspecDataset or FileDataset, got {source!r}"
            )
        self._source: Source = source
        self._urls = source.paths if isinstance(source, FileDataset) else source.urls
        if not self._urls:
            raise ValueError("TarDataset needs at least one shard, got urls=[]")
        self._decode_fn = callable_or_none("decode", decode)
        self.shuffle = boolean("shuffle", shuffle)
        self.shuffle_buffer = positive_int("shuffle_buffer", shuffle_buffer)
        self.seed = non_negative_int("seed", seed)
        self._connections, self._setting = _check_pool(source, self.shards_in_flight)
        self.max_member_bytes = byte_limit("max_member_bytes", max_member_bytes)
        self.lengths = _lengths(lengths, len(self._urls))
        self.even_shares = boolean("even_shares", even_shares)
        if self.even_shares and self.lengths is None:
            raise ValueError(
                "TarDataset(even_shares=True) needs lengths= (the samples of each shard, from "
                "the shards' index), got lengths=None"
            )
        self._epoch = 0
        self._rank = (0, 1)
        self._resume: dict[str, Any] | None = None
        self._current = None

    @property
    def urls(self) -> tuple[str, ...]:
        """The shards, in the order given."""
        return self._urls

    def __repr__(self) -> str:
        return (
            f"TarDataset({len(self._urls)} shards, first={redact(self._urls[0])!r}, "
            f"shuffle={self.shuffle}, shards_in_flight={self.shards_in_flight})"
        )

    # -- what the loader calls -----------------------------------------------------------

    def decode(self, raw: Any) -> Any:
        """Turn a raw sample into what the loader collates (runs off the event loop).

        Raises:
            ShardError: ``raw`` stands for a shard that failed (see the module docstring).
            Exception: what ``decode`` raised, with a note naming the sample and its shard.
        """
        if isinstance(raw, BrokenShard):
            raise raw.error()
        if self._decode_fn is None:
            return raw
        try:
            return self._decode_fn(raw)
        except Exception as exc:
            exc.add_note(
                f"decoding sample {raw.get('__key__')!r} of {redact(str(raw.get('__url__')))}"
            )
            raise

    def state_dict(self) -> dict[str, Any]:
        """Where the current (or last) iteration is: after the samples it has yielded.

        Between iterations (or after one ran to its end) it points at the next epoch's start.
        """
        lengths = list(self.lengths) if self.even_shares and self.lengths else None
        return {
            **self._position(STATE_VERSION),
            **self._fingerprint(),
            "lengths": lengths,
            "shard_list": _shard_list(self._urls),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration continue from ``state`` (see the module docstring).

        Raises:
            ValueError: the state lacks a key or was saved by a dataset that orders samples
                differently (other shards, even as many, shuffle settings, seed or
                ``shards_in_flight``), naming what differs and both values. (A state saved
                before states had ``"shard_list"`` is checked by the number of shards only.)
        """
        state = check_state_keys("TarDataset", state, ("epoch", "yielded", "ended", "shards"))
        fingerprint = self._fingerprint()
        del fingerprint["rank"]  # the loader may tell the rank later: checked by __aiter__
        saved = {**state, "even_shares": state.get("even_shares", False)}  # (older states)
        check_fits("TarDataset", saved, fingerprint)
        mine = _shard_list(self._urls)
        if state.get("shard_list") is not None and state["shard_list"] != mine:
            raise ValueError(
                f"TarDataset.load_state_dict: the state was saved over other shards "
                f"(shard_list={state['shard_list']!r}), this dataset's {len(self._urls)} shards "
                f"give shard_list={mine!r} (a digest of the URLs in order): as many shards, but "
                "not the same ones in the same order, so samples would repeat and others be "
                "lost. Resume with the shard list the state was saved with (shards are "
                "compared by their names below the directory they share, less credentials "
                "and expiry parameters); to resume over shards renamed on purpose, set the "
                'state\'s "shard_list" to None (then only their number is checked; in a '
                'DataLoader\'s state it is state["streams"]["states"][i]["shard_list"], i '
                "the stream's place)"
            )
        self._resume_from(state)

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "shards": len(self._urls),
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer if self.shuffle else 0,
            "seed": self.seed,
            "shards_in_flight": self.shards_in_flight,
            "even_shares": self.even_shares,
            "rank": list(self._rank),
        }

    async def aclose(self) -> None:
        """Close the source's connections (the loader calls it when it closes)."""
        await self._source.aclose()

    def __aiter__(self) -> AsyncIterator[Any]:
        # The epochs open over one source share its pool (zip of two, an evaluation pass
        # beside training, two datasets over one source): see _readers._Gate.
        return self._start(
            "TarDataset",
            _Shards(self),
            self.shards_in_flight,
            self._connections,
            self._source,
            self._setting,
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_current"] = None  # the live iteration belongs to this process's loop
        # A worker masks what it shows (failed shards, decode notes) as this process does.
        state["_credential_parameters"] = parameters_state()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        add_credential_parameters(*state.pop("_credential_parameters", ()))
        self.__dict__.update(state)


class _Shards:
    """The shards as an epoch reads them (:class:`~._readers.Units`)."""

    kind = "tar"

    def __init__(self, dataset: TarDataset) -> None:
        self.dataset = dataset

    async def start(self, epoch: int, resume: Mapping[str, Any] | None) -> Plan:
        """The mixer of ``epoch``: this rank's shards in the epoch's order, or its share of
        the rest of an epoch saved on other ranks (no IO first)."""
        ds = self.dataset
        rank, world = ds._rank
        rest = rest_of("TarDataset", resume)
        if rest is not None and rest.units != len(ds.urls):
            raise ValueError(
                f"TarDataset: the state being resumed has a rest of {rest.units} shards, and "
                f"this dataset has {len(ds.urls)}; the order of samples would differ"
            )
        return plan(
            len(ds.urls),
            rest,
            ds.lengths if ds.even_shares else None,
            shuffle=ds.shuffle,
            seed=ds.seed,
            epoch=epoch,
            rank=rank,
            world=world,
            slots=ds.shards_in_flight,
            buffer=ds.shuffle_buffer if ds.shuffle else 0,
        )

    def where(self, unit: int) -> tuple[str, str]:
        url = self.dataset.urls[unit]
        return f"tar shard {redact(url)}", url

    async def records(self, unit: int) -> AsyncGenerator[Any, None]:
        """The samples of shard ``unit``, parsed as its bytes arrive; a failure ends it with
        a :class:`BrokenShard`."""
        url = self.dataset.urls[unit]
        parser = TarParser(self.dataset.max_member_bytes)
        grouper = Grouper(url)
        try:
            async with contextlib.aclosing(self.dataset._source.stream(unit)) as chunks:
                async for chunk in chunks:
                    for name, data in parser.feed(chunk):
                        sample = grouper.add(name, data)
                        if sample is not None:
                            yield sample
                    if parser.ended:
                        break
            parser.close()
            sample = grouper.flush()
            if sample is not None:
                yield sample
        except Exception as exc:
            member = exc.member if isinstance(exc, TarFormatError) else parser.last_member
            cut = parser.reading_file
            if isinstance(exc, MemberTooLargeError):
                cut = exc.member  # refused at its header: what came before it is whole
                for name, data in exc.completed:
                    sample = grouper.add(name, data)
                    if sample is not None:
                        yield sample
            pending = grouper.flush()
            if pending is not None and cut is not None and grouper.ends(pending, cut):
                yield pending  # whole: the file member that was cut began another sample
            if isinstance(exc, MemberTooLargeError):
                what = f"member {exc.member!r}"
                reason = too_large(what, exc.size, "max_member_bytes", exc.limit)
            else:
                reason = redact(f"{type(exc).__name__}: {exc}")
            yield BrokenShard(url, member, reason)


def _lengths(lengths: Iterable[int] | None, shards: int) -> tuple[int, ...] | None:
    if lengths is None:
        return None
    if isinstance(lengths, str) or not isinstance(lengths, Iterable):
        raise TypeError(f"lengths must be a list of sample counts, one per shard, got {lengths!r}")
    counts = tuple(non_negative_int(f"lengths[{i}]", n) for i, n in enumerate(lengths))
    if len(counts) != shards:
        raise ValueError(
            f"lengths must give one sample count per shard ({shards} shards), got {len(counts)}"
        )
    return counts


def _names(items: Any) -> tuple[str, ...]:
    if isinstance(items, str | os.PathLike):
        items = [items]
    names = []
    for position, item in enumerate(items):
        if not isinstance(item, str | os.PathLike):
            raise TypeError(f"urls[{position}] must be a string or path, got {item!r}")
        names.append(os.fspath(item))
    return tuple(names)
