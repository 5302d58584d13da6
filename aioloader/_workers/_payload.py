"""How the dataset copy and the user's callables travel to a worker: pickled, with whatever lives
in ``__main__`` pickled by value.

Plain pickle saves a class or function by reference (module and name), and a worker imports
the module to find it. That fails for ``__main__``: a worker does not run the user's main script
(:mod:`._context`), and a notebook or ``python -c`` has no script to run at all; and it fails
for a lambda or a local function anywhere (no name to import it by), the most common way to
write a ``collate_fn``, which torch's forked workers simply inherit. So what refers to
``__main__``, and what plain pickle refuses, is pickled with cloudpickle (imported only then),
which takes the classes and functions a worker cannot import by value (``__main__``'s, lambdas,
local functions, and what they are made of) and the rest by reference; everything else is
pickled plainly (fast)::

    main:   pickle.dumps(obj)  ──▶ no "__main__" in the bytes ──▶ sent as is
                               └─▶ "__main__" in the bytes, or a pickling error (a lambda or
                                   a local function, of any module) ──▶ pickled again with
                                   cloudpickle: what a worker cannot import by value, and
                                   after it the table {name: object} of ``__main__``'s
                                   top-level classes and functions
    worker: load()             ──▶ the object, and each table entry set on the worker's own
                                   ``__main__``: a batch holding an instance of such a class
                                   pickles back by reference, and the main process finds the
                                   original class under the same name

Large buffers (a numpy array's memory, 1 MiB and more: :data:`OUT_OF_BAND_MIN_BYTES`) do not
go through the pickle stream and the pipe: :func:`dumps_copy` pickles them out of band (pickle
protocol 5) into one shared-memory segment, which each worker maps copy-on-write and unpickles
the arrays over, without a copy. A dataset that holds its images in memory is then sent in
milliseconds rather than pickled, piped and copied per worker (9.6 MB: ~70 ms before), and
what a worker writes into it stays its own, as with torch's ``fork``. The segment belongs to
the copy (:meth:`._records.Payload.release`, by the pool); where shared memory is missing or short
(less than :data:`OUT_OF_BAND_SHARE` of it free would be left), the buffers go in the stream.

What cannot leave the stream (``bytes`` objects pickle in it, whatever their size: a dataset
holding its samples as many of them) makes the stream itself large. A stream of
:data:`STREAM_IN_SEGMENT_MIN_BYTES` or more goes into the segment too, and the job a worker
gets names where: instead of the main process writing it into every worker's pipe (128 MiB x 8
workers: seconds, and a copy of the job per worker in its heap meanwhile) and every worker
holding the received stream while it unpickles, each worker reads it from its mapping (one
copy, into the objects it makes; the mapping goes when the load ends, or where the copy's
arrays live on it, the stream's pages leave the worker's memory). The workers unpickle in
turns, as many at once as the CPUs they may use (:func:`aioloader._stats.cpus_available`: the
affinity, lowered by a cgroup quota; :func:`aioloader._shm.turn`): more at once only slow each
other, so the first worker's load, and the first batch, would end last. A worker waiting for a
turn has not begun its load: its start deadline counts from when it holds one, so a hang in
another worker's load never gets it killed, and the wait is bounded
(:data:`aioloader._shm.TURN_WAIT_S`, then it loads without a turn). Measured with 128 MiB of 64
KiB ``bytes`` and 8 workers on 2 CPUs: first batch 2.4-5.3 s before, 0.5-0.9 s after. Where
shared memory has room for the buffers but not for the stream beside them (a container's 64
MB ``/dev/shm``), the buffers alone go there and the stream through the pipes: an array through
every pipe would be a copy of it in every worker. If the segment is removed behind the loader's
back, the next worker to load the copy gets it pickled afresh (:mod:`._copy`).

An ``np.memmap`` or a tensor whose bytes lie in a memory-mapped file (a token file, a
``torch.load(path, mmap=True)``) is neither: it travels as a reference to the file, which the
worker maps again (:mod:`._mapped`), so a file of many GB costs a few hundred bytes a copy,
shared memory or not (an ``np.memmap`` pickled as numpy pickles it is all its bytes).

A module still being imported (a loader iterated at the top level of an imported module, or of
a test module as pytest imports it) is treated as ``__main__`` is: its classes and functions go
by value. By reference they would deadlock: pickling one imports its module, which waits for
the import that runs the loader; and a worker importing it would run that loader again.

Sharp edges:
- The byte test can be fooled only towards the slow path: the text ``__main__`` inside the data
  costs a second pickling, never a wrong one.
- Job records (indices, samples an async dataset fetched on the loop) are pickled plainly: an
  item of a class defined in ``__main__`` reaches a worker only if the dataset or a callable
  sent here refers to that class too.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import io
import math
import os
import pickle
import sys
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import numpy as np

from .. import _shm
from .._errors import SharedMemoryError
from .._stats import cpus_available
from ._cpython import module_locks
from ._mapped import Finder
from ._records import Payload

__all__ = [
    "OUT_OF_BAND_MIN_BYTES",
    "OUT_OF_BAND_SHARE",
    "STREAM_IN_SEGMENT_MIN_BYTES",
    "dumps",
    "dumps_copy",
    "loads",
]

_MAIN = b"__main__"

#: Buffers at least this large travel out of band, through shared memory. Smaller: more, and
#: smaller, copies saved; larger: fewer arrays skip the stream.
OUT_OF_BAND_MIN_BYTES = 1 << 20
#: The out-of-band buffers take shared memory only while they need at most this share of what
#: is free there (batches need the rest); else they go in the stream.
OUT_OF_BAND_SHARE = 0.25
#: A pickle stream at least this large goes into the copy's segment too, rather than through
#: every worker's pipe: each worker then reads it from its mapping, one copy into the objects
#: it makes (``bytes`` of a dataset that holds many), instead of the kernel's two copies
#: through a 64 KiB pipe per worker, the main process writing it once per worker, and the
#: worker holding the received stream while it unpickles. Lower: a segment for a small
#: stream (a few system calls); higher: large streams piped again.
STREAM_IN_SEGMENT_MIN_BYTES = 1 << 20


def dumps(
    obj: Any,
    *,
    main_by_value: bool,
    out_of_band: list[pickle.PickleBuffer] | None = None,
    map_files: bool = False,
    files: Finder | None = None,
) -> bytes:
    """``obj`` pickled for a worker (see the module docstring).

    Args:
        obj: what to send.
        main_by_value: pickle the classes and functions of ``__main__`` by value (a worker
            that did not fork from this process cannot import them).
        out_of_band: where buffers of :data:`OUT_OF_BAND_MIN_BYTES` or more go, out of the
            stream (pickle protocol 5), in the order the stream refers to them; None: all
            buffers in the stream.
        map_files: an ``np.memmap`` or a tensor in a mapped file goes as a reference to the
            file (:mod:`._mapped`): for a process that unpickles it on this machine.
        files: the :class:`Finder` to map files with (it tells what it referred to), rather
            than a new one.

    Raises:
        Exception: whatever pickling raised (``pickle.PicklingError``, ``TypeError``,
            ``AttributeError`` ...).
    """
    callback = None if out_of_band is None else _collector(out_of_band)
    if files is None and map_files:
        files = Finder()  # the second pickling asks it again: cached
    if half := _half_imported():  # by value, or the pickling waits for their import
        with _pickled_by_value(half):
            # A forked worker has this __main__: its names are not replaced by copies there.
            return _by_value(obj, callback, out_of_band, files, main_table=main_by_value)
    try:
        data = _plain(obj, callback, files)
    except Exception:
        # A lambda or a local function (of any module), or what holds one: by value, as a
        # forked torch worker would simply have it. What cannot travel even so (an open file,
        # a lock) raises here, naming its type.
        return _by_value(obj, callback, out_of_band, files, main_table=main_by_value)
    if main_by_value and _MAIN in data:
        return _by_value(obj, callback, out_of_band, files)
    return data


def _collector(into: list[pickle.PickleBuffer]) -> Callable[[pickle.PickleBuffer], bool]:
    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        if memoryview(buffer).nbytes < OUT_OF_BAND_MIN_BYTES:
            return True  # in the stream
        into.append(buffer)
        return False

    return out_of_band


def dumps_copy(obj: Any, *, main_by_value: bool) -> Payload:
    """``obj`` pickled for the workers as :func:`dumps` does, its large buffers out of band in
    shared memory, and there too the stream itself when it is large (see the module docstring).

    Raises:
        Exception: whatever pickling raised.
    """
    buffers: list[pickle.PickleBuffer] = []
    files = Finder()
    data = dumps(obj, main_by_value=main_by_value, out_of_band=buffers, files=files)
    keep = files.kept
    large_stream = len(data) >= STREAM_IN_SEGMENT_MIN_BYTES
    if not buffers and not large_stream:
        return Payload(data, keep=keep)
    parts = [buffer.raw() for buffer in buffers]
    if large_stream:
        payload = _in_segment([*parts, memoryview(data)], data, keep, stream=True)
        if payload is not None:
            return payload
    if buffers:
        # No room for both (a tight /dev/shm): the buffers alone, the stream through the
        # pipes, as before streams went into segments; an array through every pipe is a
        # copy of it in every worker.
        payload = _in_segment(parts, data, keep, stream=False)
        if payload is not None:
            return payload
        # No room at all: every byte in the stream, through the pipe.
        return Payload(dumps(obj, main_by_value=main_by_value, files=files), keep=keep)
    return Payload(data, keep=keep)


def _in_segment(
    parts: list[memoryview], data: bytes, keep: tuple[Any, ...], *, stream: bool
) -> Payload | None:
    """The payload with ``parts`` in a new segment, the last of them the stream ``data``
    where ``stream``; None if no segment could be had (see :func:`_segment_of`)."""
    spans, offset = [], 0
    for part in parts:
        spans.append((offset, part.nbytes))
        offset = -(-(offset + part.nbytes) // _shm.ALIGN) * _shm.ALIGN
    size = _shm.page_round(max(offset, 1))
    name = _segment_of(parts, spans, size)
    if name is None:
        return None
    if stream:
        return Payload(b"", name, size, tuple(spans[:-1]), keep, spans[-1])
    return Payload(data, name, size, tuple(spans), keep)


def _segment_of(parts: list[memoryview], spans: list[tuple[int, int]], size: int) -> str | None:
    """A new segment of ``size`` bytes holding each of ``parts`` at its span; None where shared
    memory is missing or short (less than :data:`OUT_OF_BAND_SHARE` of it free would be left),
    or the segment cannot be made."""
    if not _shm.shm_available() or size > OUT_OF_BAND_SHARE * _shm.free_bytes():
        return None
    try:
        name, mapping = _shm.create_segment(size, _shm.SHM_DIR)
    except (OSError, SharedMemoryError):
        return None
    view = _shm.as_bytes(mapping, size)
    for part, (start, length) in zip(parts, spans, strict=True):
        view[start : start + length] = np.frombuffer(part, dtype=np.uint8)
    return name


def loads(payload: Payload | bytes, *, waiting: Callable[[bool], None] | None = None) -> Any:
    """The object :func:`dumps` or :func:`dumps_copy` pickled; what ``__main__`` defined is set
    on this process's ``__main__`` under the same names (in a worker, the parent's
    ``__main__`` is not here). Out-of-band buffers are mapped copy-on-write, not copied; a
    stream in the segment is read from the mapping in a turn (:func:`aioloader._shm.turn`),
    and its pages leave this process's memory once it is read (the mapping itself goes once
    this returns unless buffers of the object use it); the files that memory-mapped arrays
    refer to are mapped again (:mod:`._mapped`). A failed load keeps no view of the segment
    in its traceback.

    Args:
        payload: what to load.
        waiting: told ``True`` while this process waits for a turn (others hold them all),
            ``False`` when the wait ends (see :func:`aioloader._shm.turn`).

    Raises:
        FileNotFoundError: the segment of the buffers is gone, or a file a memory-mapped array
            refers to (its path in the error).
        OSError: (ESTALE) such a file was replaced or shortened since the pickling.
    """
    if isinstance(payload, bytes):
        payload = Payload(payload)
    try:
        obj, table = _unpickle(payload, waiting)
    except BaseException as exc:
        # The frames below hold the mapping (the stream's reader, the buffers): a worker keeps
        # the error to report it, and with it the traceback's frames. Their lines stay.
        traceback.clear_frames(exc.__traceback__)
        raise
    if table:
        main = sys.modules["__main__"]
        for name, value in table.items():
            setattr(main, name, value)
    return obj


def _unpickle(payload: Payload, waiting: Callable[[bool], None] | None) -> tuple[Any, Any]:
    buffers = None
    stream: io.BytesIO | _ViewReader = io.BytesIO(payload.data)
    view = None
    if payload.segment is not None:
        view = _shm.map_private(payload.segment, payload.size)
        data = view.data
        buffers = [data[start : start + length] for start, length in payload.spans]
        if payload.stream is not None:
            start, length = payload.stream
            stream = _ViewReader(data[start : start + length])
        del data
    turn: contextlib.AbstractContextManager[bool | None] = contextlib.nullcontext()
    if payload.segment is not None and payload.stream is not None:
        turn = _shm.turn(payload.segment, _turns(), waiting=waiting)
    with turn:
        unpickler = pickle.Unpickler(stream, buffers=buffers)
        obj = unpickler.load()
        table: dict[str, Any] = unpickler.load()
    if view is not None and payload.stream is not None and payload.spans:
        # The buffers' arrays keep the mapping alive: the stream's pages, read once, go (it
        # lies after the buffers, so its pages are its own from its first whole page on).
        _shm.drop_pages(view, payload.stream[0])
    return obj, table


def _turns() -> int:
    """As many workers unpickle a large stream at once as this process has CPUs (its
    affinity, lowered by a cgroup quota: :func:`aioloader._stats.cpus_available`)."""
    return max(1, math.ceil(cpus_available()))


class _ViewReader:
    """A file over a memoryview, for ``pickle.Unpickler``: a read copies out only what it
    asks for, and a large ``bytes`` object is read straight into itself (``readinto``), so a
    stream in shared memory is copied once, into the objects it makes (``io.BytesIO`` would
    copy all of it first)."""

    __slots__ = ("_pos", "_view")

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n < 0 else min(self._pos + n, len(self._view))
        data = self._view[self._pos : end].tobytes()
        self._pos = end
        return data

    def readinto(self, buffer: Any) -> int:
        with memoryview(buffer) as target, target.cast("B") as out:
            n = min(len(out), len(self._view) - self._pos)
            out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def readline(self) -> bytes:
        # Only text opcodes read lines (older protocols); in chunks, not the rest of the view.
        end = self._pos
        while end < len(self._view):
            chunk = self._view[end : end + 4096].tobytes()
            found = chunk.find(b"\n")
            if found >= 0:
                end += found + 1
                break
            end += len(chunk)
        return self.read(end - self._pos)


_Callback = Callable[[pickle.PickleBuffer], bool] | None


def _plain(obj: Any, buffer_callback: _Callback, files: Finder | None) -> bytes:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(
        buffer, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=buffer_callback
    )
    table = _dispatch(buffer_callback is not None, files)
    if table:  # by type, in C: others pay nothing
        pickler.dispatch_table = {**copyreg.dispatch_table, **table}
    pickler.dump(obj)
    pickler.dump({})
    return buffer.getvalue()


def _dispatch(out_of_band: bool, files: Finder | None) -> dict[type, Callable[[Any], Any]]:
    """The reductions of arrays and tensors that differ from their own (see the module
    docstring), by type."""
    table: dict[type, Callable[[Any], Any]] = {}
    if files is not None:
        table[np.memmap] = functools.partial(_reduce_memmap, files=files)
    torch = sys.modules.get("torch")
    if torch is not None and (out_of_band or files is not None):
        table[torch.Tensor] = functools.partial(
            _reduce_tensor, out_of_band=out_of_band, files=files
        )
    return table


def _by_value(
    obj: Any,
    buffer_callback: _Callback,
    out_of_band: list[pickle.PickleBuffer] | None,
    files: Finder | None,
    *,
    main_table: bool = True,
) -> bytes:
    if out_of_band is not None:
        out_of_band.clear()  # those of the first pickling: this one finds them again
    buffer = io.BytesIO()
    pickler = _main_by_value_pickler(buffer, buffer_callback, files)
    pickler.dump(obj)
    # The same pickler, so the same memo: the table refers to the very objects pickled above.
    pickler.dump(pickler.main_table if main_table else {})
    return buffer.getvalue()


def _half_imported() -> list[ModuleType]:
    """The modules being imported now, in any thread (``__main__`` is not imported). Plain
    modules only: asking a lazy one (``importlib.util.LazyLoader``) anything would load it.
    Only those whose import holds a module lock are looked at (usually none: a scan of every
    module cost ~2 ms on the way to the first batch), else every module."""
    locks = module_locks()
    names = list(locks) if locks is not None else list(sys.modules)
    found = []
    for name in names:
        module = sys.modules.get(name)
        if (
            type(module) is ModuleType
            and name != "__main__"
            and getattr(module.__dict__.get("__spec__"), "_initializing", False)
        ):
            found.append(module)
    return found


_registry_lock = threading.Lock()


def _new_registry_lock() -> None:
    # A parent's thread may have held it (pickling) as the process forked: the child, which
    # may pickle a dataset copy of its own, starts with its own lock.
    global _registry_lock
    _registry_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_registry_lock)
_registered: dict[str, int] = {}  # module name -> our picklings that registered it, still on


@contextlib.contextmanager
def _pickled_by_value(modules: list[ModuleType]) -> Iterator[None]:
    """While in the block, cloudpickle takes what ``modules`` define by value; picklings of
    several threads at once share the registration (counted). cloudpickle's registry is the
    process's: another library pickling with cloudpickle meanwhile also takes those modules
    by value (bytes more, and copies of their classes where it unpickles)."""
    import cloudpickle

    names = []
    with _registry_lock:
        for module in modules:
            name = module.__name__
            if name not in _registered:
                if name in cloudpickle.list_registry_pickle_by_value():
                    continue  # the user's registration: theirs to keep
                try:
                    cloudpickle.register_pickle_by_value(module)
                except ValueError:  # gone from sys.modules meanwhile
                    continue
            _registered[name] = _registered.get(name, 0) + 1
            names.append(name)
    try:
        yield
    finally:
        with _registry_lock:
            for name in names:
                _registered[name] -= 1
                if not _registered[name]:
                    del _registered[name]
                    with contextlib.suppress(ValueError, KeyError):
                        cloudpickle.unregister_pickle_by_value(sys.modules[name])


def _reduce_memmap(array: np.memmap[Any, Any], files: Finder) -> Any:
    """An ``np.memmap`` as a reference to its file where a worker can map it, else as numpy
    pickles it (all its bytes)."""
    reduced = files.reduce_memmap(array)
    return reduced if reduced is not None else array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _reduce_tensor(tensor: Any, *, out_of_band: bool = True, files: Finder | None = None) -> Any:
    """A CPU tensor over a mapped file, as a reference to the file (``files``); a plain CPU
    tensor that owns its whole storage, pickled over a buffer (out of band when it is large:
    ``out_of_band``) rather than through ``torch.save`` (always a copy in the stream); any
    other tensor as torch pickles it."""
    import torch

    if files is not None:
        reduced = files.reduce_shared_tensor(tensor)
        if reduced is None:
            reduced = files.reduce_tensor(tensor)
        if reduced is not None:
            return reduced
    if (
        out_of_band
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes > 0
    ):
        raw = tensor.reshape(-1).view(torch.uint8).numpy()
        return _tensor_over, (pickle.PickleBuffer(raw), tensor.dtype, tuple(tensor.shape))
    return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _tensor_over(buffer: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
    """The tensor :func:`_reduce_tensor` pickled, over ``buffer`` (no copy)."""
    import torch

    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)


def _in_main(obj: Any) -> bool:
    return (
        isinstance(obj, (type, types.FunctionType))
        and getattr(obj, "__module__", None) == "__main__"
    )


_pickler_class: type | None = None


def preload_pickler(*parts: Any) -> None:
    """Import cloudpickle now if any of ``parts`` (a dataset, a ``collate_fn``...) is, or is an
    instance of, something defined in ``__main__``: its copy will travel by value. Called
    before the forked server and the first worker fork, so that they have it, rather than
    each worker importing it to load its copy (about 2 ms a process, on the way to the first
    batch) and the main process importing it as the first epoch starts."""
    if _pickler_class is None and any(_in_main(p) or _in_main(type(p)) for p in parts):
        with contextlib.suppress(ImportError):  # then the copy's pickling reports it
            _main_by_value_pickler(io.BytesIO(), None)


def _main_by_value_pickler(
    buffer: io.BytesIO, buffer_callback: _Callback, files: Finder | None = None
) -> Any:
    """A cloudpickle pickler that records ``__main__``'s top-level classes and functions it
    meets in ``main_table``. Made at first use, so cloudpickle is imported only by a program
    that needs it."""
    global _pickler_class
    if _pickler_class is None:
        import cloudpickle

        code_reduce = cloudpickle.Pickler.dispatch_table.get(types.CodeType)

        class MainByValuePickler(cloudpickle.Pickler):  # type: ignore[misc]
            def __init__(
                self, file: io.BytesIO, buffer_callback: _Callback, files: Finder | None
            ) -> None:
                super().__init__(
                    file, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=buffer_callback
                )
                self.main_table: dict[str, Any] = {}
                self.own = _dispatch(buffer_callback is not None, files)
                if code_reduce is not None:
                    self.own[types.CodeType] = functools.partial(_keep_file, code_reduce)

            def reducer_override(self, obj: Any) -> Any:
                reduce = self.own.get(type(obj))
                if reduce is not None:
                    return reduce(obj)
                if _in_main(obj) and obj.__qualname__.isidentifier():  # its top level
                    self.main_table[obj.__qualname__] = obj
                # cloudpickle takes by reference whatever a worker can import, by value what
                # it cannot: __main__'s, and what they are made of (a namedtuple's methods,
                # code objects, a lambda they hold).
                return super().reducer_override(obj)

        _pickler_class = MainByValuePickler
    return _pickler_class(buffer, buffer_callback, files)


def _keep_file(code_reduce: Callable[[Any], Any], code: types.CodeType) -> Any:
    """cloudpickle's reduction of a code object, with its file name kept: cloudpickle writes
    ``<dynamic-code>`` (for bytes that do not depend on where code was defined), and a worker's
    traceback would then name no file and show no line of it."""
    func, args = code_reduce(code)[:2]
    dynamic = "<dynamic-code>"
    return func, tuple(
        code.co_filename if isinstance(arg, str) and arg == dynamic else arg for arg in args
    )
