"""The tar format, parsed incrementally, and WebDataset's rule for grouping members into samples.

:class:`TarParser` is a pure state machine: ``feed(chunk)`` takes bytes as they arrive (from a
socket, an object store or a file, in chunks of any size) and returns the regular-file members
completed so far; ``close()`` says whether the archive ended cleanly. No IO, no loop, so the
async readers in :mod:`._tar` call it between two reads, and the tests drive it byte by byte::

    chunk ──▶ buffer ──▶ 512-byte header ──▶ member data (padded to 512) ──▶ (name, bytes)
                           │ GNU 'L' long name, pax 'x' path/size: applied to the next header
                           │ directories, links, pax 'g', GNU 'K': skipped
                           └ two zero blocks (or the end of the input at a block boundary): end

:class:`Grouper` applies WebDataset's rule: a member's *key* is its path up to the first dot of
its file name, the *extension* (lower-cased) the rest; consecutive members with one key form a
sample ``{"__key__": key, "__url__": url, ext: bytes, ...}``. Members with no dot in their file
name are left out (WebDataset does the same).

Why our own parser rather than :mod:`tarfile` in stream mode ``'r|'``: tarfile reads from a
blocking file object, so feeding it from an async stream needs a thread per open shard (or a
bridge that blocks on the loop); it also builds a ``TarInfo`` per member and copies each
member's data through its own buffered reads. This parser is ~150 lines, copies each member's
bytes once out of the receive buffer, and never blocks. It handles what shard writers produce:
ustar (with its 155-byte prefix), GNU long names, pax ``path`` and ``size`` records, and
base-256 sizes. Sparse files and multi-volume archives are refused as format errors.

A member is held whole until its last byte arrives, so the parser takes a bound: a header
announcing more than ``max_member`` bytes is refused (:class:`MemberTooLargeError`) before
any of its data is held. A shard of any size parses in memory of about its largest member.

Invariant: ``_pieces`` hold exactly the bytes received and not yet parsed (``_have`` of them),
which are less than the next header or member needs.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

__all__ = [
    "BLOCK",
    "Grouper",
    "MemberTooLargeError",
    "TarFormatError",
    "TarParser",
    "split_name",
]

BLOCK = 512
_ZERO = bytes(BLOCK)
_REGULAR = frozenset({b"0", b"\0", b"7"})
_SKIPPED = frozenset({b"1", b"2", b"3", b"4", b"5", b"6", b"g", b"K", b"V"})  # no file data

# WebDataset's split: the directory part, then the file name up to its first dot (the key);
# the extension is what follows the dot.
_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


class TarFormatError(ValueError):
    """The bytes are not a (complete) tar archive; ``member`` names where it went wrong."""

    def __init__(self, message: str, member: str | None) -> None:
        super().__init__(message)
        self.member = member


class MemberTooLargeError(TarFormatError):
    """A member's header announces ``size`` bytes, over the parser's bound ``limit``;
    ``completed`` holds the members the same :meth:`TarParser.feed` completed before it."""

    def __init__(self, member: str, size: int, limit: int) -> None:
        super().__init__(f"member {member!r} is {size} bytes, over the bound of {limit}", member)
        self.size = size
        self.limit = limit
        self.completed: list[tuple[str, bytes]] = []


class _Header(NamedTuple):  # a tuple: made twice per sample, it must be cheap
    name: str
    size: int
    kind: bytes


def _octal(field: bytes, what: str, name: str) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 (sizes of 8 GiB and more)
        value = int.from_bytes(field[1:], "big")
        return -value if field[0] & 0x40 else value
    text = field.split(b"\0", 1)[0].strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise TarFormatError(f"bad {what} field {field!r} in the header", name) from None


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _parse_pax(data: bytes, name: str) -> dict[str, str]:
    """The records ``"<length> <key>=<value>\\n"`` of a pax extended header."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos : pos + 1] != b"\0":
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise TarFormatError("malformed pax extended header", name) from None
        record = data[space + 1 : pos + length]
        if length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise TarFormatError("malformed pax extended header", name)
        key, _, value = record[:-1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


class TarParser:
    """Tar members from bytes fed in pieces; see the module docstring.

    Args:
        max_member: the most bytes of one member (its data, held whole until complete);
            ``None``: no bound.
    """

    def __init__(self, max_member: int | None = None) -> None:
        self._max_member = max_member
        # An incomplete header or member, from the last chunks: pieces of them (views of
        # ``bytes`` chunks, which cannot change; copies of other buffers), ``_have`` bytes.
        self._pieces: list[Any] = []
        self._have = 0
        self._header: _Header | None = None  # the member whose data comes next
        self._long_name: str | None = None  # from a GNU 'L' member, for the next header
        self._pax: dict[str, str] = {}  # from a pax 'x' member, for the next header
        self._last: str | None = None  # the last member seen, for error messages
        self.ended = False

    @property
    def last_member(self) -> str | None:
        """The name of the last header parsed (where an error is reported), None before."""
        return self._last

    @property
    def reading_file(self) -> str | None:
        """The name of the regular file member whose data is being read (its header parsed,
        its data not all here), None between members, in a header or in another member."""
        header = self._header
        return header.name if header is not None and header.kind in _REGULAR else None

    def _after(self) -> str:
        return "at the start" if self._last is None else f"after member {self._last!r}"

    def feed(self, data: bytes | bytearray | memoryview) -> list[tuple[str, bytes]]:
        """Add received bytes; returns the regular-file members completed by them, in order.

        Raises:
            TarFormatError: a header whose checksum or fields are wrong, naming the member.
            MemberTooLargeError: a header announces a member over ``max_member`` bytes.
        """
        out: list[tuple[str, bytes]] = []
        try:
            return self._feed(data, out)
        except MemberTooLargeError as exc:
            exc.completed = out  # whole members before it: their samples are good
            raise

    def _feed(
        self, data: bytes | bytearray | memoryview, out: list[tuple[str, bytes]]
    ) -> list[tuple[str, bytes]]:
        keep = type(data) is bytes  # its views may be held until a later chunk
        with memoryview(data) as view:
            # A header or member left incomplete by the last chunks is completed first, with
            # just the bytes it needs, and joined from its pieces; the rest is parsed straight
            # from this chunk. Either way each byte is copied once, into its member.
            position = 0
            if self._have and not self.ended:
                need = self._needed() - self._have
                if len(view) < need:
                    self._hold(view, keep)
                    return out
                self._pieces.append(view[:need])
                pieces, self._pieces, self._have = self._pieces, [], 0
                self._complete(pieces, out)
                position = need
            while not self.ended:
                advanced = self._step(view, position, out)
                if advanced is None:
                    break
                position = advanced
            if not self.ended and position < len(view):
                self._hold(view[position:], keep)
        return out

    def _hold(self, piece: memoryview, keep: bool) -> None:
        # A slice, not the view itself: feed() releases its view on the way out.
        self._pieces.append(piece[:] if keep else piece.tobytes())
        self._have += len(piece)

    def _complete(self, pieces: list[Any], out: list[tuple[str, bytes]]) -> None:
        """Parse the header or member data whose bytes (padding included) are ``pieces``."""
        header = self._header
        if header is None:
            self._header_block(b"".join(pieces))
            return
        self._header = None
        left = header.size  # the member's bytes; the padding after them is dropped
        taken = []
        for piece in pieces:
            if left <= 0:
                break
            taken.append(piece[:left] if len(piece) > left else piece)
            left -= len(piece)
        self._member(header, b"".join(taken), out)

    def _needed(self) -> int:
        """Bytes the next header, or the current member's padded data, takes."""
        if self._header is None:
            return BLOCK
        return (self._header.size + BLOCK - 1) // BLOCK * BLOCK

    def _step(self, view: memoryview, position: int, out: list[tuple[str, bytes]]) -> int | None:
        """Parse one header or one member's data at ``position`` if ``view`` holds all of it;
        returns the position after it (None if it is incomplete)."""
        need = self._needed()
        if len(view) - position < need:
            return None
        header = self._header
        if header is None:
            self._header_block(bytes(view[position : position + BLOCK]))
        else:
            self._header = None
            self._member(header, bytes(view[position : position + header.size]), out)
        return position + need

    def _header_block(self, block: bytes) -> None:
        if block == _ZERO:
            self.ended = True
        else:
            self._header = self._parse_header(block)

    def close(self) -> None:
        """The input ended: check that it ended where an archive may.

        Raises:
            TarFormatError: the input stopped inside a header or a member's data.
        """
        if self.ended:
            return
        left = self._have
        header = self._header
        if header is not None:
            if left >= header.size:  # the bytes are there; the padding to the block is not
                what = f"the padding after member {header.name!r}'s {header.size} bytes stops"
                raise TarFormatError(
                    f"truncated: {what} after {left - header.size} of "
                    f"{self._needed() - header.size} bytes",
                    header.name,
                )
            raise TarFormatError(
                f"truncated: the data of member {header.name!r} stops after {left} of "
                f"{header.size} bytes",
                header.name,
            )
        if left:
            raise TarFormatError(f"truncated: {left} bytes of a header {self._after()}", self._last)
        # A stream cut exactly at a member boundary, before the two zero blocks, reads as a
        # complete archive; GNU tar accepts it too (with a warning). It cannot be told apart
        # from a writer that left the end marker out.
        self.ended = True

    def _parse_header(self, block: bytes) -> _Header:
        name = self._long_name or _text(block[0:100])
        field = block[148:156]
        stored = _octal(field, "checksum", name)
        unsigned = sum(block) - sum(field) + 8 * 32
        if stored != unsigned:
            signed = sum(b - 256 if b > 127 else b for b in block[:148] + block[156:]) + 256
            if stored != signed:
                raise TarFormatError(
                    f"bad header checksum {self._after()} (not a tar archive, or corrupt)",
                    self._last,
                )
        magic = block[257:263]
        prefix = _text(block[345:500]) if magic == b"ustar\x00" else ""
        if self._long_name is None and prefix:
            name = f"{prefix}/{name}"
        size = _octal(block[124:136], "size", name)
        kind = block[156:157]
        if self._pax:
            pax, self._pax = self._pax, {}
            if "path" in pax:
                name = pax["path"]
            if "size" in pax:
                size = int(pax["size"])
        self._long_name = None
        if size < 0:
            raise TarFormatError(f"negative size {size} in the header", name)
        self._last = name
        if self._max_member is not None and size > self._max_member:
            raise MemberTooLargeError(name, size, self._max_member)
        return _Header(name, size, kind)

    def _member(self, header: _Header, body: bytes, out: list[tuple[str, bytes]]) -> None:
        kind = header.kind
        if kind in _REGULAR:
            out.append((header.name, body))
        elif kind == b"L":
            self._long_name = body.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif kind == b"x":
            self._pax = _parse_pax(body, header.name)
        elif kind not in _SKIPPED:
            raise TarFormatError(
                f"member type {kind!r} is not supported (sparse or multi-volume archive?)",
                header.name,
            )


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member name by WebDataset's rule, or None without a dot."""
    match = _NAME.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


class Grouper:
    """Consecutive members with one key into samples (see the module docstring).

    Args:
        url: the shard's URL, written into each sample as ``__url__``.
    """

    def __init__(self, url: str) -> None:
        self._url = url
        self._sample: dict[str, Any] | None = None

    def add(self, name: str, data: bytes) -> dict[str, Any] | None:
        """Add a member; returns the previous sample when this member starts a new one.

        Raises:
            TarFormatError: a sample holds two members with the same extension.
        """
        parts = split_name(name)
        if parts is None:
            return None
        key, ext = parts
        sample = self._sample
        if sample is not None and sample["__key__"] == key:
            if ext in sample:
                raise TarFormatError(f"sample {key!r} has two {ext!r} members", name)
            sample[ext] = data
            return None
        self._sample = {"__key__": key, "__url__": self._url, ext: data}
        return sample

    def flush(self) -> dict[str, Any] | None:
        """The last sample, at the end of the shard."""
        sample, self._sample = self._sample, None
        return sample

    @staticmethod
    def ends(sample: dict[str, Any], name: str) -> bool:
        """Whether a file member ``name`` begins another sample than ``sample``: members of a
        sample are consecutive, so ``sample`` is whole then. False where ``name`` has no key
        (it may still be followed by one of ``sample``'s)."""
        parts = split_name(name)
        return parts is not None and parts[0] != sample["__key__"]
