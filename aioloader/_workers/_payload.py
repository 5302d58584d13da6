"""How the dataset copy and the user's callables travel to a worker: pickled, with whatever lives
in ``__main__`` pickled by value.

Plain pickle saves a class or function by reference (module and name), and a worker imports
the module to find it. That fails for ``__main__``: a worker does not run the user's main script
(:mod:`._context`), and a notebook or ``python -c`` has no script to run at all. So what refers
to ``__main__`` is pickled with cloudpickle (imported only then), which takes the classes and
functions a worker cannot import by value (``__main__``'s, and what they are made of) and the
rest by reference; everything else is pickled plainly (fast)::

    main:   pickle.dumps(obj)  ──▶ no "__main__" in the bytes ──▶ sent as is
                               └─▶ "__main__" in the bytes (or a pickling error while
                                   __main__ defines things) ──▶ pickled again, __main__'s
                                   classes and functions by value, and after them the table
                                   {name: object} of those defined at its top level
    worker: load()             ──▶ the object, and each table entry set on the worker's own
                                   ``__main__``: a batch holding an instance of such a class
                                   pickles back by reference, and the main process finds the
                                   original class under the same name

Sharp edges:
- The byte test can be fooled only towards the slow path: the text ``__main__`` inside the data
  costs a second pickling, never a wrong one.
- Job records (indices, samples an async dataset fetched on the loop) are pickled plainly: an
  item of a class defined in ``__main__`` reaches a worker only if the dataset or a callable
  sent here refers to that class too.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from typing import Any

__all__ = ["dumps", "loads"]

_MAIN = b"__main__"


def dumps(obj: Any, *, main_by_value: bool) -> bytes:
    """``obj`` pickled for a worker (see the module docstring).

    Args:
        obj: what to send.
        main_by_value: pickle the classes and functions of ``__main__`` by value (a worker
            that did not fork from this process cannot import them).

    Raises:
        Exception: whatever pickling raised (``pickle.PicklingError``, ``TypeError``,
            ``AttributeError`` ...).
    """
    if not main_by_value:
        return _plain(obj)
    try:
        data = _plain(obj)
    except Exception:
        if not _main_defines_any():
            raise
        return _by_value(obj)  # a lambda or local function of __main__, say
    if _MAIN in data:
        return _by_value(obj)
    return data


def loads(data: bytes) -> Any:
    """The object :func:`dumps` pickled; what ``__main__`` defined is set on this process's
    ``__main__`` under the same names (in a worker, the parent's ``__main__`` is not here)."""
    unpickler = pickle.Unpickler(io.BytesIO(data))
    obj = unpickler.load()
    table: dict[str, Any] = unpickler.load()
    if table:
        main = sys.modules["__main__"]
        for name, value in table.items():
            setattr(main, name, value)
    return obj


def _plain(obj: Any) -> bytes:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dump(obj)
    pickler.dump({})
    return buffer.getvalue()


def _by_value(obj: Any) -> bytes:
    buffer = io.BytesIO()
    pickler = _main_by_value_pickler(buffer)
    pickler.dump(obj)
    # The same pickler, so the same memo: the table refers to the very objects pickled above.
    pickler.dump(pickler.main_table)
    return buffer.getvalue()


def _main_defines_any() -> bool:
    """Whether ``__main__`` defines a class or a function (else nothing can be by value)."""
    main = sys.modules.get("__main__")
    return main is not None and any(_in_main(value) for value in list(vars(main).values()))


def _in_main(obj: Any) -> bool:
    return (
        isinstance(obj, (type, types.FunctionType))
        and getattr(obj, "__module__", None) == "__main__"
    )


_pickler_class: type | None = None


def _main_by_value_pickler(buffer: io.BytesIO) -> Any:
    """A cloudpickle pickler that records ``__main__``'s top-level classes and functions it
    meets in ``main_table``. Made at first use, so cloudpickle is imported only by a program
    that needs it."""
    global _pickler_class
    if _pickler_class is None:
        import cloudpickle

        class MainByValuePickler(cloudpickle.Pickler):  # type: ignore[misc]
            def __init__(self, file: io.BytesIO) -> None:
                super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
                self.main_table: dict[str, Any] = {}

            def reducer_override(self, obj: Any) -> Any:
                if _in_main(obj) and obj.__qualname__.isidentifier():  # its top level
                    self.main_table[obj.__qualname__] = obj
                # cloudpickle takes by reference whatever a worker can import, by value what
                # it cannot: __main__'s, and what they are made of (a namedtuple's methods,
                # code objects, a lambda they hold).
                return super().reducer_override(obj)

        _pickler_class = MainByValuePickler
    return _pickler_class(buffer)
