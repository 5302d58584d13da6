"""The frames on the pipes between the main process and a worker, built and taken apart: pure
encoding, no IO.

A frame is a fixed header ``(payload length, job id, kind)`` (:data:`._records.HEADER`) and a
payload; the kinds are records too (:mod:`._records`). Requests (main → worker)::

    JOB        pickle((fn, arg))
    CANCEL     empty: skip job ``job id`` if it has not started
    STOP       empty: return from the serve loop

Replies (worker → main)::

    RESULT     pack_result(value): buffer count, each buffer's length, the pickle, the buffers
    ERROR      pack_error(exc): pickle((exception, traceback text))
    CANCELLED  empty: the job was dropped before it ran

A result's large buffers (the arrays of a batch that travels inline) go out of band, after the
pickle, so the main side can read a large frame straight into one buffer of its size and
unpickle the arrays as views of it (:func:`unpack_result`): the bytes are copied once, by the
kernel. :mod:`._channel` moves the frames; this module only builds and takes them apart.

Sharp edges:

- An exception that does not survive pickling (it holds a lock, an open file, a response) is
  rebuilt, in the worker, from its type and its message, with its traceback text in the
  message, so that ``except TheError`` still catches it; a type that cannot be made from one
  message (an ``__init__`` of two required arguments) or that does not survive pickling
  either is replaced by a RuntimeError that names it (:func:`picklable`). torch's DataLoader
  rebuilds a worker's exception the same way.
- ``StopIteration`` and ``StopAsyncIteration`` cannot be set on a future (they would end the
  awaiting coroutine's iteration silently): :func:`unpack_error` wraps them in a RuntimeError.
- The arrays :func:`unpack_result` returns are views of the payload: they keep it alive.
- A reply stream is trusted only as far as its headers can be valid
  (:func:`reply_header_fault`): a process the dataset forks in a worker inherits the reply
  pipe, and what it writes there (a traceback, or replies of its own interleaved with the
  worker's) leaves the stream out of step for good. The main side then fails the worker.
"""

from __future__ import annotations

import pickle
import struct
import traceback
from collections.abc import Container
from typing import Any, Generic, TypeVar

from ._records import HEADER, MAX_REPLY_BYTES, REPLY_KINDS

T = TypeVar("T")

__all__ = [
    "KeyErrorMessage",
    "Packed",
    "RemoteTraceback",
    "pack_error",
    "pack_result",
    "picklable",
    "reply_header_fault",
    "take_frames",
    "unpack_error",
    "unpack_result",
]


def reply_header_fault(length: int, job_id: int, kind: int, awaited: Container[int]) -> str | None:
    """Why a reply header cannot be valid, or None if it can: a payload over
    :data:`MAX_REPLY_BYTES`, an unknown kind, or a reply to a job not in ``awaited`` (the ids
    sent and not answered yet): one never sent, or a second reply to one, which only a second
    writer on the pipe makes."""
    if kind not in REPLY_KINDS:
        return f"an unknown reply kind {kind}"
    if job_id not in awaited:
        return (
            f"a reply to job {job_id}, which awaits none (never sent, or answered already: "
            "a second process writes into the pipe)"
        )
    if length > MAX_REPLY_BYTES:
        return f"a payload of {length} bytes, over the bound of {MAX_REPLY_BYTES}"
    return None


class RemoteTraceback(Exception):
    """The worker's traceback text, attached as ``__cause__`` of an exception it raised."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class KeyErrorMessage(str):
    """A KeyError's message shown as it is: ``str(KeyError(m))`` is ``repr(m)``, which would
    print a traceback's line breaks as ``\\n``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def _round_trips(exc: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return False
    return True


def picklable(exc: BaseException) -> BaseException:
    """``exc`` itself if it survives pickling; else the same type made from a message that
    holds its text and traceback, where that type can be made so and survives pickling; else a
    RuntimeError that tells what it was. Notes are kept."""
    if _round_trips(exc):
        return exc
    kind = type(exc)
    name = f"{kind.__module__}.{kind.__qualname__}"
    text = "".join(traceback.format_exception(exc))
    message = (
        f"{exc} (a {name} that could not be pickled, rebuilt from its type and message; "
        f"its traceback follows)\n{text}"
    )
    try:
        replacement = kind(KeyErrorMessage(message) if issubclass(kind, KeyError) else message)
    except Exception:  # an __init__ of another shape (two arguments): not rebuildable
        replacement = None
    if replacement is None or type(replacement) is not kind or not _round_trips(replacement):
        replacement = RuntimeError(
            f"{name}: {exc} (the exception could not be pickled; its traceback follows)\n{text}"
        )
    for note in getattr(exc, "__notes__", ()):
        replacement.add_note(note)
    return replacement


def pack_error(exc: BaseException) -> bytes:
    """The payload of an ERROR reply: the exception (made picklable) and its traceback text."""
    text = "".join(traceback.format_exception(exc))
    return pickle.dumps((picklable(exc), text), protocol=pickle.HIGHEST_PROTOCOL)


def unpack_error(payload: bytearray) -> BaseException:
    """The exception of an ERROR reply, its traceback text as ``__cause__``, ready to be set
    on a future."""
    exc: BaseException
    text: str
    exc, text = pickle.loads(payload)
    exc.__cause__ = RemoteTraceback(text)
    if isinstance(exc, StopIteration | StopAsyncIteration):
        # A future cannot hold these (they would end the awaiting coroutine's iteration
        # silently): carry them the way a generator does.
        wrapped = RuntimeError(f"a worker job raised {type(exc).__name__}: {exc}")
        for note in getattr(exc, "__notes__", ()):
            wrapped.add_note(note)
        wrapped.__cause__ = exc
        return wrapped
    return exc


# A result travels as a pickle with its large buffers (numpy arrays) out of band: the main
# process reads their bytes straight from the pipe into the buffer they end up in, and
# unpickles without copying them again. Layout: buffer count, each buffer's length, the
# pickle, the buffers.
_COUNT = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")


class Packed(Generic[T]):
    """A job's result of type ``T`` that the job packed itself (:func:`pack_result`), so that
    it can tell what could not be pickled in its own words; sent as it is, and unpacked on the
    main side as the ``T`` it holds."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts


def pack_result(value: Any) -> list[Any]:
    """The payload of a RESULT reply, as the parts to write one after the other."""
    if isinstance(value, Packed):
        return value.parts
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    meta = _COUNT.pack(len(raws)) + b"".join(_LENGTH.pack(r.nbytes) for r in raws)
    return [meta, data, *raws]


def unpack_result(payload: bytearray) -> Any:
    """Unpickle a packed result; its arrays are views of ``payload`` (no copy)."""
    (count,) = _COUNT.unpack_from(payload, 0)
    lengths = [
        _LENGTH.unpack_from(payload, _COUNT.size + i * _LENGTH.size)[0] for i in range(count)
    ]
    start = _COUNT.size + count * _LENGTH.size
    end = len(payload) - sum(lengths)
    view = memoryview(payload)
    buffers = []
    at = end
    for length in lengths:
        buffers.append(view[at : at + length])
        at += length
    return pickle.loads(view[start:end], buffers=buffers)


def take_frames(inbox: bytearray) -> list[tuple[int, int, bytes]]:
    """Take the complete frames off the front of ``inbox``: ``(job id, kind, payload)`` each."""
    out: list[tuple[int, int, bytes]] = []
    start = 0
    size = HEADER.size
    with memoryview(inbox) as view:  # released before the buffer is resized below
        while len(inbox) - start >= size:
            length, job_id, kind = HEADER.unpack_from(view, start)
            end = start + size + length
            if len(inbox) < end:
                break
            out.append((job_id, kind, bytes(view[start + size : end])))
            start = end
    if start:
        del inbox[:start]
    return out
