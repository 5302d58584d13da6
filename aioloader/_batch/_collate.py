"""Collation: a list of samples in, one batch out, with torch's rules and clear errors.

:func:`default_collate` follows ``torch.utils.data.default_collate``: arrays and tensors are
stacked along a new first axis, Python numbers become one tensor, strings stay a list, and
containers are transposed (a list of dicts becomes a dict of batches). :func:`numpy_collate` uses
the same rules but produces numpy arrays, never tensors. Both walk the samples once, top down::

    samples ──▶ kind of each sample at this key path (one kind, torch's mixes, or an error)
                 ├─ mapping / namedtuple / sequence ──▶ recurse per key, field or position
                 ├─ tensor / ndarray / numbers ──▶ one dtype (promoted) ──▶ stack into one leaf
                 └─ str / bytes / None, or None beside values ──▶ a list, as it is

**Straight into shared memory.** Both accept ``alloc(shape, dtype)``: when it is given, every
stacked leaf is written into the array ``alloc`` returns (a view of a shared-memory slot, in a
worker process) and the result is that array, or ``torch.from_numpy`` of it: no copy after the
stack itself. Tensors whose dtype numpy lacks (``bfloat16``), that live on a device, that require
grad or that are not strided are stacked the ordinary way instead; the caller copies those.

**Mixed types promote as in torch**, but never depending on which sample comes first (torch
picks its rule from the first sample, so ``[1, 2.5]`` and ``[2.5, 1]`` give float32 and float64
there). Numbers of any flavour mix (Python ``bool``/``int``/``float``, numpy scalars, 0-d
arrays): Python bools count as ``bool``, ints as ``int64``, floats as ``float64``, numpy values
as their dtype, and the batch gets the dtype ``torch.promote_types`` gives for all of them
(``[1, 2.5]`` is float64; ``[True, 2]`` int64; float32 beside float64 is float64). Arrays and
tensors of one shape but different dtypes promote the same way, and numpy arrays mix with
tensors. :func:`numpy_collate` promotes arrays and numbers by numpy's rule instead
(``np.result_type``). Strings, bytes and None mix into one list.

Sharp edges, each deliberate:

- **Errors name where and what.** Samples that cannot form one batch raise
  :class:`~aioloader.CollateError` naming the key path (``batch['image'][1]``), the positions in
  the batch and what differs. A type that cannot be collated or mixed raises its subclass
  :class:`~aioloader.CollateTypeError` (also a ``TypeError``, as in torch); different shapes,
  lengths or devices :class:`~aioloader.CollateShapeError` (also a ``RuntimeError``, as in
  torch), with the fix: a ``collate_fn`` that pads (:data:`PAD_HINT`). Samples whose keys
  differ are refused (torch raises ``KeyError`` for a missing key and silently drops an extra
  one).
- **Tuples come back as lists**, as in torch (its "backwards compatibility" rule); namedtuples
  keep their type, and mappings keep theirs where it can be rebuilt. Also as in torch, strings
  inside a sequence come back as a tuple (a column of the transposed samples), while strings
  under a mapping key, or at the top, come back as a list.
- **None is kept**, so optional fields pass through: a field that is None in every sample is a
  list of ``None``, and one that is None in some samples only (``[0.5, None, 1.5]``) is a list
  of the samples as they are, None kept, as torch users write by hand (torch refuses both).
  Such a field is a tensor in a batch without None and a list in one with: a sentinel value
  (NaN, -1) keeps it a tensor in every batch.
- **Byte order is normalised**: big-endian arrays are stacked into native order, because
  ``torch.from_numpy`` refuses anything else.
- **A batch is a list.** Called with anything but a sequence of samples (anything with
  ``__len__`` and ``__getitem__``, an iterator, an array of rows), such as one sample that is
  a dict or a set, the collate functions raise :class:`~aioloader.CollateTypeError` instead of
  collating its keys; with ``batch_size=None`` a sample needs ``default_convert``. A str or
  bytes given alone comes back as it is, as torch returns it, never as its characters.
- **requires_grad never depends on the batch's size.** Collated in this process
  (``num_workers=0``, ``thread_pool=True``) a batch of tensors that require grad is what
  ``torch.stack`` makes: it requires grad, with its graph. From worker processes it arrives as
  a leaf that requires grad at every size, in shared memory or pickled, as torch's own
  reductions carry the flag (the graph cannot cross processes: torch's workers refuse such a
  batch, "autograd does not support crossing process boundaries").
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import (
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
    MutableSequence,
    Sequence,
)
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import CollateError, CollateShapeError, CollateTypeError
from .._lazy import lazy_module
from .._types import Alloc
from ._mismatch import grouped, key_mismatch, layout_mismatch, positions, type_name
from ._stacking import stack_into, stack_large

if TYPE_CHECKING:
    import torch
else:  # torch is imported at the first tensor made (see _lazy)
    torch = lazy_module("torch", globals())

__all__ = ["collate_prestacked", "default_collate", "default_convert", "numpy_collate"]


_INT64 = np.dtype(np.int64)
_FLOAT64 = np.dtype(np.float64)
_BOOL = np.dtype(np.bool_)

# A batch of arrays this large and bound for torch is stacked by torch (``stack_large``). It is
# numpy's threshold for asking the kernel to back an array with huge pages.
_LARGE_BATCH_BYTES = 1 << 22

# numpy dtype kinds that have no torch equivalent: bytes, str, void/structured, datetimes.
_NOT_FOR_TORCH = frozenset("SUVMm")

# Kinds that mix at one key path, as they do in torch: numbers of any flavour (numpy 0-d arrays
# join them too), and text with None.
_NUMBER_KINDS = frozenset({"bool", "int", "float", "numpy scalar"})
_TEXT_KINDS = frozenset({"str", "bytes", "None"})
# The dtype a Python number counts as when numbers are mixed.
_PYTHON_DTYPES = {"bool": _BOOL, "int": _INT64, "float": _FLOAT64}

_SUPPORTED = (
    "torch tensors, numpy arrays and scalars, Python int/float/bool, str, bytes, None, "
    "mappings, namedtuples and sequences"
)


def default_collate(samples: Sequence[Any], *, alloc: Alloc | None = None) -> Any:
    """Collate ``samples`` into a batch of torch tensors, like torch's ``default_collate``.

    Arrays and tensors are stacked into one tensor; Python ints become an ``int64`` tensor,
    floats ``float64``, bools ``bool``; numpy scalars a tensor of their dtype; mixed numbers,
    and arrays or tensors of mixed dtypes, promote (see the module's docstring); str and bytes
    stay a list, and so does None. Mappings, namedtuples and other sequences are collated per
    key, field or position (a tuple comes back as a list, as in torch).

    Args:
        samples: the samples of one batch, all of the same structure.
        alloc: where to put each stacked leaf: ``alloc(shape, dtype)`` returns a writable
            C-contiguous numpy array, and the leaf becomes ``torch.from_numpy`` of it.

    Returns:
        The batch, with the structure of one sample.

    Raises:
        CollateError: if the batch is empty, or samples disagree at some key path (keys, an
            int too large for int64). The message names the key path, the positions and what
            differs. Its subclasses: :class:`CollateTypeError` (also ``TypeError``) for a leaf
            that cannot become a tensor (object dtype, unsupported type) or types that cannot
            mix; :class:`CollateShapeError` (also ``RuntimeError``) for different shapes,
            lengths or devices.
    """
    return _Collator(to_torch=True, alloc=alloc).batch(samples)


def numpy_collate(samples: Sequence[Any], *, alloc: Alloc | None = None) -> Any:
    """Collate ``samples`` like :func:`default_collate`, but into numpy arrays.

    The structure rules are the same; every stacked leaf is a numpy array (Python ints become
    ``int64``, floats ``float64``, bools ``bool``; torch tensors are converted; mixed numbers
    and arrays promote by numpy's rule). Use it when the consumer is not torch (JAX, numpy
    code) or to keep torch out of a worker's output.

    Args:
        samples: the samples of one batch, all of the same structure.
        alloc: where to put each stacked leaf: ``alloc(shape, dtype)`` returns a writable
            C-contiguous numpy array, which becomes the leaf itself.

    Returns:
        The batch, with the structure of one sample.

    Raises:
        CollateError: as :func:`default_collate`; also for tensors whose dtype numpy lacks.
    """
    return _Collator(to_torch=False, alloc=alloc).batch(samples)


def collate_prestacked(samples: Sequence[Any], to_torch: bool, alloc: Alloc, stacked: Any) -> Any:
    """:func:`default_collate` (``to_torch``) or :func:`numpy_collate` of ``samples`` whose
    arrays at the key paths of ``stacked`` (path -> array) were stacked as they were read
    (``_prestack``): such a leaf, checked as ever, is the array given, if its shape and dtype
    are the ones collation would make (else it is stacked anew)."""
    return _Collator(to_torch=to_torch, alloc=alloc, stacked=stacked).batch(samples)


# -- kinds of samples ---------------------------------------------------------------------------


# Classifying a type takes a dozen issubclass calls; a batch has few types, so cache them. The
# bound only matters for programs that create classes on the fly.
_KIND_CACHE_SIZE = 1024
_kinds: dict[type, str] = {}


def _kind_of(cls: type) -> str:
    """What collation does with an instance of ``cls``."""
    kind = _kinds.get(cls)
    if kind is None:
        if len(_kinds) >= _KIND_CACHE_SIZE:
            _kinds.clear()
        kind = _kinds[cls] = _classify(cls)
    return kind


def _classify(cls: type) -> str:
    # The order of the checks matters: np.str_ is a str and a np.generic, bool is an int.
    # Without torch imported nothing can be a tensor: no need to import it to find out.
    if "torch" in sys.modules and issubclass(cls, sys.modules["torch"].Tensor):
        return "tensor"
    if issubclass(cls, np.ndarray):
        return "ndarray"
    if issubclass(cls, str):  # before np.generic: np.str_ is both
        return "str"
    if issubclass(cls, bytes):
        return "bytes"
    if issubclass(cls, np.generic):
        return "numpy scalar"
    if issubclass(cls, bool):  # before int: bool is an int
        return "bool"
    if issubclass(cls, int):
        return "int"
    if issubclass(cls, float):
        return "float"
    if cls is type(None):
        return "None"
    if issubclass(cls, Mapping):
        return "mapping"
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return "namedtuple"
    if issubclass(cls, Sequence):
        return "sequence"
    return "unsupported"


@functools.lru_cache(maxsize=64)
def _numpy_dtype_of(dtype: torch.dtype) -> np.dtype[Any] | None:
    """The numpy dtype of a torch dtype, or None where numpy has none (bfloat16, float8...)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None


@functools.lru_cache(maxsize=64)
def _torch_dtype_of(dtype: np.dtype[Any]) -> torch.dtype:
    """The torch dtype of a numpy dtype torch can hold (see :func:`_torch_can_hold`)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


@functools.lru_cache(maxsize=64)
def _torch_can_hold(dtype: np.dtype[Any]) -> bool:
    if dtype.kind in _NOT_FOR_TORCH or dtype.hasobject:
        return False
    try:
        torch.from_numpy(np.empty(0, dtype=dtype))
    except (TypeError, ValueError):  # e.g. float128, complex256
        return False
    return True


# -- error messages (phrased by _mismatch) ------------------------------------------------------


def _error(path: str, problem: str, cls: type[CollateError] = CollateError) -> CollateError:
    return cls(f"cannot collate {path}: {problem}")


#: The fix for samples of different lengths or shapes, said with their error.
PAD_HINT = (
    "to batch samples of different lengths, pass a collate_fn that pads them "
    "(torch.nn.utils.rnn.pad_sequence) or keeps them as a list (collate_fn=list)"
)


def _is_batch(samples: Any) -> bool:
    """Whether ``samples`` can be the samples of a batch: a sequence that is not text, an
    iterator of samples, an array or tensor of at least one dimension (its rows, as torch
    takes what a ``__getitems__`` returns), or anything else with ``__len__`` and
    ``__getitem__`` (torch indexes it; a class need not register as a ``Sequence``). A
    mapping, a set or a string is one sample."""
    if isinstance(samples, str | bytes | bytearray | Mapping | AbstractSet):
        return False
    if isinstance(samples, Sequence | Iterator):
        return True
    if isinstance(samples, np.ndarray) or _kind_of(type(samples)) == "tensor":
        return bool(samples.ndim)
    cls = type(samples)
    if callable(getattr(cls, "keys", None)):
        # Keyed like a mapping though not one (a pandas DataFrame or Series: iterating gives
        # column names or values, losing the index): one sample, refused by name.
        return False
    return callable(getattr(cls, "__len__", None)) and callable(getattr(cls, "__getitem__", None))


def _as_list(samples: Any) -> list[Any]:
    """The samples of a batch :func:`_is_batch` accepted, as a list: by index where the
    object cannot be iterated otherwise (``iter()`` would index it until ``IndexError``,
    without end for one that never raises it)."""
    if isinstance(samples, Iterable):
        return list(samples)
    return [samples[i] for i in range(len(samples))]


def _not_a_batch(samples: Any) -> CollateError:
    """The error for a collate call given one sample (a dict, a string, a set) instead of the
    list of a batch's samples: taken as a sequence, it would come back as its keys or
    characters, silently (torch raises a bare ``KeyError`` for a dict)."""
    return CollateTypeError(
        f"cannot collate a {type_name(type(samples))}: a collate function takes the list of "
        "the samples of one batch (a list, a tuple or another sequence, an iterator, an array "
        "of rows); "
        "with batch_size=None the loader hands it one sample at a time, which is not a batch: "
        "leave collate_fn out there, or pass collate_fn=default_convert"
    )


def _ragged(path: str, problem: str) -> CollateError:
    """The error for samples that differ in shape or length, with :data:`PAD_HINT`."""
    return _error(path, f"{problem}; {PAD_HINT}", CollateShapeError)


# -- the walk -----------------------------------------------------------------------------------


class _Collator:
    """One collation: the output flavour, the allocator, and the recursive walk."""

    __slots__ = ("alloc", "stacked", "to_torch")

    def __init__(
        self,
        *,
        to_torch: bool,
        alloc: Alloc | None,
        stacked: dict[str, np.ndarray[Any, Any]] | None = None,
    ) -> None:
        self.to_torch = to_torch
        self.alloc = alloc
        self.stacked = stacked  # key path -> that leaf, already stacked (collate_prestacked)

    def batch(self, samples: Sequence[Any]) -> Any:
        if not isinstance(samples, list | tuple):
            if isinstance(samples, str | bytes):
                # As torch: a string handed over alone (batch_size=None, one sample a call)
                # comes back as it is, never as its characters.
                return samples
            if not _is_batch(samples):
                raise _not_a_batch(samples)
            samples = _as_list(samples)
        if not samples:
            raise CollateError("cannot collate an empty batch: there are no samples")
        return self.collate(samples, "batch")

    def collate(self, samples: Sequence[Any], path: str) -> Any:
        kind = _kind_of(type(samples[0]))
        if len(set(map(type, samples))) > 1:
            kind, samples = self._unify(samples, path)
        if kind == "tensor":
            return self._tensors(samples, path)
        if kind == "ndarray":
            return self._arrays(samples, path)
        if kind == "mapping":
            return self._mappings(samples, path)
        if kind == "namedtuple":
            return self._namedtuples(samples, path)
        if kind == "sequence":
            return self._sequences(samples, path)
        if kind == "int":
            return self._numbers(samples, _INT64, path)
        if kind == "float":
            return self._numbers(samples, _FLOAT64, path)
        if kind == "bool":
            return self._numbers(samples, _BOOL, path)
        if kind in ("numpy scalar", "number"):
            return self._scalars(samples, path)
        if kind in _TEXT_KINDS or kind == "optional":
            # As torch: a tuple (a column of transposed sequences) stays a tuple; a list is
            # copied so that the batch never aliases the caller's list.
            return samples if isinstance(samples, tuple) else list(samples)
        problem = f"unsupported type {grouped([type(s) for s in samples], type_name)}"
        raise _error(path, f"{problem}; collation supports {_SUPPORTED}", CollateTypeError)

    def _unify(self, samples: Sequence[Any], path: str) -> tuple[str, Sequence[Any]]:
        """The one kind that samples of several types collate as, and the samples in its form.

        Subclasses of one kind mix (ndarray and memmap, dict and OrderedDict), and so do the
        kinds torch mixes: numbers of any flavour (with 0-d arrays), text with None, numpy
        arrays with tensors (the arrays become tensors). Other kinds never do, nor different
        namedtuple types.
        """
        kinds = {_kind_of(type(s)) for s in samples}
        if len(kinds) == 1 and "namedtuple" not in kinds:
            return kinds.pop(), samples
        if kinds <= _TEXT_KINDS:
            return "str", samples
        if "None" in kinds and len(kinds) == 2:
            # An optional field: values in some samples, None in others. Kept as a list of
            # the samples as they are, None included, as torch users write by hand (torch
            # refuses it). The field's type then differs between batches (a tensor where no
            # sample is None): a sentinel value (NaN, -1) keeps it a tensor in every batch.
            return "optional", samples
        if kinds <= _NUMBER_KINDS | {"ndarray"} and all(
            s.ndim == 0 for s in samples if isinstance(s, np.ndarray)
        ):
            # A 0-d array's item is a numpy scalar of its dtype, except for object arrays,
            # whose item is any Python object: those are refused here, with their key path.
            objects = [
                p for p, s in enumerate(samples) if isinstance(s, np.ndarray) and s.dtype.hasobject
            ]
            if objects:
                problem = f"numpy dtype object (Python objects) at {positions(objects)}"
                raise _error(path, f"{problem} is not supported", CollateTypeError)
            return "number", [s[()] if isinstance(s, np.ndarray) else s for s in samples]
        if kinds == {"tensor", "ndarray"}:
            arrays = [s for s in samples if isinstance(s, np.ndarray)]
            self._check_dtypes([a.dtype for a in arrays], path, for_torch=True)
            return "tensor", [_as_tensor(s) if isinstance(s, np.ndarray) else s for s in samples]
        problem = f"samples have different types: {grouped(list(map(type, samples)), type_name)}"
        raise _error(path, problem, CollateTypeError)

    # -- containers --

    def _mappings(self, samples: Sequence[Mapping[Any, Any]], path: str) -> Any:
        first = samples[0]
        keys = first.keys()
        if not all(s.keys() == keys for s in samples):
            raise _error(path, key_mismatch(samples))
        result = {key: self.collate([s[key] for s in samples], f"{path}[{key!r}]") for key in keys}
        return result if type(first) is dict else _like_mapping(first, result)

    def _namedtuples(self, samples: Sequence[Any], path: str) -> Any:
        cls = type(samples[0])
        fields = cls._fields
        columns = zip(*samples, strict=True)
        return cls(*(self.collate(c, f"{path}.{f}") for f, c in zip(fields, columns, strict=True)))

    def _sequences(self, samples: Sequence[Sequence[Any]], path: str) -> Any:
        lengths = [len(s) for s in samples]
        if len(set(lengths)) > 1:
            raise _ragged(path, f"sequences have different lengths: {grouped(lengths)}")
        columns = zip(*samples, strict=True)
        items = [self.collate(c, f"{path}[{i}]") for i, c in enumerate(columns)]
        first = samples[0]
        if isinstance(first, tuple) or type(first) is list:
            return items  # tuples become lists, as in torch
        return _like_sequence(first, items)

    # -- leaves --

    def _out(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
        """The caller's array for one leaf; checked, because a wrong one would corrupt data."""
        assert self.alloc is not None
        out = self.alloc(shape, dtype)
        if not (
            isinstance(out, np.ndarray)
            and out.shape == shape
            and out.dtype == dtype
            and out.flags.c_contiguous
            and out.flags.writeable
        ):
            raise TypeError(
                f"alloc({shape}, {dtype}) must return a writable C-contiguous numpy array of "
                f"that shape and dtype, got {type(out).__name__} "
                f"{getattr(out, 'shape', '')} {getattr(out, 'dtype', '')}"
            )
        return out

    def _leaf(self, array: np.ndarray[Any, Any]) -> Any:
        return torch.from_numpy(array) if self.to_torch else array

    def _numbers(self, samples: Sequence[Any], dtype: np.dtype[Any], path: str) -> Any:
        # One conversion for the whole list: per-element work would cost microseconds a sample.
        try:
            if self.alloc is None:
                array = np.array(samples, dtype=dtype)
            else:
                array = self._out((len(samples),), dtype)
                array[...] = samples
        except OverflowError as exc:
            bad = [p for p, v in enumerate(samples) if not _fits(v, dtype)]
            raise _error(path, f"ints do not fit in {dtype} at {positions(bad)}") from exc
        return self._leaf(array)

    def _scalars(self, samples: Sequence[Any], path: str) -> Any:
        """Numbers, numpy scalars among them: one array of their common dtype."""
        dtypes = [
            s.dtype if isinstance(s, np.generic) else _PYTHON_DTYPES[_kind_of(type(s))]
            for s in samples
        ]
        return self._numbers(samples, self._common_dtype(dtypes, path), path)

    def _check_dtypes(
        self, dtypes: Sequence[np.dtype[Any]], path: str, *, for_torch: bool | None = None
    ) -> None:
        """Refuse object dtypes, and dtypes torch lacks when the leaf is to be a tensor."""
        for_torch = self.to_torch if for_torch is None else for_torch
        groups: dict[np.dtype[Any], list[int]] = {}
        for position, dtype in enumerate(dtypes):
            groups.setdefault(dtype, []).append(position)
        for dtype, at in groups.items():
            where = positions(at)
            if dtype.hasobject:
                problem = f"numpy dtype {dtype} (Python objects) at {where} is not supported"
                raise _error(path, problem, CollateTypeError)
            if for_torch and not _torch_can_hold(dtype.newbyteorder("=")):
                problem = f"numpy dtype {dtype} at {where} has no torch equivalent"
                raise _error(path, f"{problem}; use numpy_collate", CollateTypeError)

    def _common_dtype(self, dtypes: Sequence[np.dtype[Any]], path: str) -> np.dtype[Any]:
        """The dtype leaves of ``dtypes`` stack into: torch's promotion (numpy's for numpy
        output), in native byte order; the same whatever the order of the samples."""
        self._check_dtypes(dtypes, path)
        unique = {d.newbyteorder("=") for d in dtypes}
        if len(unique) == 1:
            return unique.pop()
        try:
            if self.to_torch:
                torch_dtypes = sorted((_torch_dtype_of(d) for d in unique), key=str)
                common = _numpy_dtype_of(functools.reduce(torch.promote_types, torch_dtypes))
                assert common is not None  # promoting dtypes numpy has gives one numpy has
                return common
            return np.result_type(*unique).newbyteorder("=")
        except (TypeError, RuntimeError) as exc:  # e.g. uint64 with int64 in torch
            problem = f"dtypes that do not combine: {grouped([str(d) for d in dtypes])}"
            raise _error(path, problem, CollateTypeError) from exc

    def _arrays(self, samples: Sequence[np.ndarray[Any, Any]], path: str) -> Any:
        first = samples[0]
        if len({a.shape for a in samples}) > 1:
            raise _ragged(path, layout_mismatch(samples, "arrays"))
        dtype = self._common_dtype([a.dtype for a in samples], path)
        # Shapes agree (checked above) and the dtype holds every sample's values (promoted),
        # so stacking cannot fail.
        shape = (len(samples), *first.shape)
        done = self.stacked.pop(path, None) if self.stacked else None
        if done is not None and done.shape == shape and done.dtype == dtype:
            return self._leaf(done)
        if self.alloc is None:
            if self.to_torch and dtype.itemsize * first.size * len(samples) >= _LARGE_BATCH_BYTES:
                return stack_large(samples, shape, dtype, _torch_dtype_of(dtype))
            # C-contiguous, as torch.stack makes (np.stack keeps Fortran-ordered samples so).
            array = np.empty(shape, dtype)
        else:
            array = self._out(shape, dtype)
        np.stack(samples, out=array, casting="same_kind")
        return self._leaf(array)

    def _tensors(self, column: Sequence[torch.Tensor], path: str) -> Any:
        samples = column if isinstance(column, list | tuple) else list(column)  # for torch.stack
        nested = [p for p, t in enumerate(samples) if t.is_nested]
        if nested:  # torch.stack has no rule for them (its error is an internal one)
            # Ragged by nature: a RuntimeError, as torch raises, with the padding hint.
            raise _ragged(path, f"nested tensors at {positions(nested)} cannot be stacked")
        dtypes = {t.dtype for t in samples}
        if len(dtypes) > 1:  # promoted here: a numpy-backed ``out`` needs the dtype up front
            try:
                common = functools.reduce(torch.promote_types, sorted(dtypes, key=str))
            except (TypeError, RuntimeError) as exc:  # e.g. uint64 with int64
                problem = f"dtypes that do not combine: {grouped([str(t.dtype) for t in samples])}"
                raise _error(path, problem, CollateTypeError) from exc
            samples = [t.to(common) for t in samples]
        # torch.stack checks shapes, devices and layouts itself; its error is explained here.
        try:
            return self._stack_tensors(samples, path)
        except RuntimeError as exc:
            problem = layout_mismatch(samples, "tensors")
            if "different shapes" in problem:
                raise _ragged(path, problem) from exc
            raise _error(path, problem or f"torch.stack failed: {exc}", CollateShapeError) from exc

    def _stack_tensors(
        self, samples: list[torch.Tensor] | tuple[torch.Tensor, ...], path: str
    ) -> Any:
        first = samples[0]
        np_dtype = _numpy_dtype_of(first.dtype)
        if not self.to_torch and np_dtype is None:
            raise _error(
                path,
                f"torch dtype {first.dtype} at {positions(list(range(len(samples))))} has no "
                "numpy equivalent; convert it in the dataset or use default_collate",
                CollateTypeError,
            )
        if self.to_torch and self.alloc is None:
            return torch.stack(samples)  # the common main-process case: nothing to check
        shape = (len(samples), *first.shape)
        done = self.stacked.pop(path, None) if self.stacked else None
        if done is not None and done.shape == shape and done.dtype == np_dtype:
            # Stacked as read (_prestack): every sample was a plain CPU tensor of this shape
            # and dtype, copied in.
            return torch.from_numpy(done) if self.to_torch else done
        # Only plain CPU tensors of one shape are stacked into a numpy-backed ``out`` (by numpy):
        # a device tensor must stay on its device, and the others go to torch.stack, whose
        # error for a mismatch _tensors explains.
        plain = all(
            t.device.type == "cpu"
            and t.layout == torch.strided
            and not t.requires_grad
            and t.shape == first.shape
            for t in samples
        )
        if self.to_torch:
            if np_dtype is None or not plain:
                return torch.stack(samples)
            array = self._out(shape, np_dtype)
            stack_into(samples, array)
            return torch.from_numpy(array)
        assert np_dtype is not None
        strided = all(t.layout == torch.strided for t in samples)
        if not strided:
            layouts = grouped([str(t.layout) for t in samples])
            raise _error(
                path,
                f"tensors of layout {layouts} have no numpy form; make them dense "
                "(.to_dense()) in the dataset, or use default_collate",
                CollateTypeError,
            )
        if not plain:
            stacked = torch.stack([t.detach() for t in samples]).cpu().resolve_conj().numpy()
            if self.alloc is None:
                return stacked
            array = self._out(stacked.shape, np_dtype)
            array[...] = stacked
            return array
        if self.alloc is None:
            return torch.stack(samples).resolve_conj().numpy()
        array = self._out(shape, np_dtype)
        stack_into(samples, array)
        return array


def _fits(value: Any, dtype: np.dtype[Any]) -> bool:
    """Whether ``value`` converts to ``dtype`` without an OverflowError (an int beyond int64,
    or one beyond float64's range beside floats)."""
    try:
        np.array(value, dtype=dtype)
    except OverflowError:
        return False
    return True


def _as_tensor(array: np.ndarray[Any, Any]) -> torch.Tensor:
    """A tensor of an array that is mixed with tensors: a copy, in native byte order (which
    also spares torch's warning about arrays that are not writable)."""
    return torch.tensor(array.astype(array.dtype.newbyteorder("="), copy=False))


# -- one sample, no batching --------------------------------------------------------------------

# numpy dtype kinds ``default_convert`` leaves as they are: bytes, str, void/structured, objects,
# datetimes (torch has no tensor of them; torch's own default_convert leaves the first four).
_KEEP_AS_NUMPY = frozenset("SUVOMm")


def default_convert(data: Any) -> Any:
    """Convert one sample's numpy arrays and scalars to tensors, as torch's ``default_convert``.

    The loader calls it on each sample when ``batch_size=None`` (no automatic batching) and no
    ``collate_fn`` is given. Numeric numpy arrays (``np.ndarray`` and ``np.memmap``) become
    tensors sharing their memory (a read-only array, one in non-native byte order or one with
    a negative stride, ``img[:, ::-1]``, is copied first: torch cannot share those), numpy
    scalars 0-d tensors; arrays and scalars of strings, bytes, objects, records or dates stay
    as they are, and so do other ndarray subclasses (a masked array keeps its mask), as in
    torch. Mappings, namedtuples and sequences are converted item by item and keep
    their type where it can be rebuilt (a tuple becomes a list, as in torch); everything else,
    tensors and Python numbers included, is returned unchanged.

    Args:
        data: one sample.

    Returns:
        The sample with its numpy leaves as tensors.
    """
    import torch  # here, not at import: only loaders without batching need it

    return _convert(data, torch)


def _convert(data: Any, torch: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data
    if type(data) is np.ndarray or isinstance(data, np.memmap | np.generic):
        # Other ndarray subclasses (a masked array, np.matrix) stay as they are, as in torch:
        # a tensor of a masked array would drop its mask.
        if data.dtype.kind in _KEEP_AS_NUMPY:
            return data
        if isinstance(data, np.ndarray) and (
            not data.flags.writeable
            or not data.dtype.isnative
            or any(stride < 0 for stride in data.strides)  # torch cannot view those either
        ):
            data = np.array(data, dtype=data.dtype.newbyteorder("="))
        return torch.as_tensor(data)
    if isinstance(data, str | bytes):
        return data
    if isinstance(data, Mapping):
        return _like_mapping(data, {key: _convert(value, torch) for key, value in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_convert(item, torch) for item in data))
    if isinstance(data, tuple):
        return [_convert(item, torch) for item in data]  # tuples become lists, as in torch
    if isinstance(data, Sequence):
        return _like_sequence(data, [_convert(item, torch) for item in data])
    return data


# -- containers rebuilt as the samples' own types --------------------------------------------


def _like_mapping(like: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """``items`` as a mapping of ``like``'s type, as torch rebuilds it: a copy keeps what a
    constructor call would lose (a defaultdict's factory); a type that cannot be rebuilt
    gives the dict."""
    try:
        if isinstance(like, MutableMapping):
            clone = copy.copy(like)
            clone.update(items)
            return clone
        return type(like)(items)  # type: ignore[call-arg]
    except (TypeError, ValueError):
        return items


def _like_sequence(like: Sequence[Any], items: list[Any]) -> Any:
    """``items`` as a sequence of ``like``'s type (the same length), as torch rebuilds it; a
    type that cannot be rebuilt from a list (a ``range``) gives the list."""
    try:
        if isinstance(like, MutableSequence):
            clone = copy.copy(like)
            for i, item in enumerate(items):
                clone[i] = item
            return clone
        return type(like)(items)  # type: ignore[call-arg]
    except (TypeError, ValueError):
        return items
