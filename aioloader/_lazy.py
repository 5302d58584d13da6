"""A module imported at its first use rather than when the importing module loads.

``import aioloader`` should not import torch (about a second) for a program that has not used
torch yet. Modules whose functions need torch only once a tensor is made bind the name through
:func:`lazy_module`::

    if TYPE_CHECKING:
        import torch
    else:
        torch = lazy_module("torch", globals())

The first attribute read (``torch.from_numpy``) imports torch and rebinds the global to the
real module, so every later use is a plain global lookup, as after a normal import.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["lazy_module"]


class _LazyModule:
    __slots__ = ("_name", "_namespace")

    def __init__(self, name: str, namespace: dict[str, Any]) -> None:
        self._name = name
        self._namespace = namespace

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self._name)
        for key, value in list(self._namespace.items()):
            if value is self:  # rebind every name this stand-in was bound to
                self._namespace[key] = module
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<{self._name}, imported at first use>"


def lazy_module(name: str, namespace: dict[str, Any]) -> Any:
    """A stand-in for module ``name`` that imports it on first attribute access and replaces
    itself in ``namespace`` (the caller's ``globals()``) by the module."""
    return _LazyModule(name, namespace)
