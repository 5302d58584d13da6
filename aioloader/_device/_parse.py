"""Parsing the loader's ``device`` argument, without initialising CUDA.

:func:`parse_device` turns what a user may pass (``None``, ``"cpu"``, ``"cuda:1"``, a
:class:`torch.device`, a CUDA ordinal) into a :class:`torch.device` or ``None`` ("no device
stage"). Whether the device exists is checked later, by :class:`DeviceStage`, because that needs
CUDA.

Sharp edges:

- ``torch.device(text)`` raises ``RuntimeError`` for malformed text; it is translated to a
  ``ValueError`` naming the value, so torch's error type never leaks to the user.
- ``True`` is an ``int`` to Python but never a device: bools are refused with ``TypeError``,
  while numpy integers are ordinals (:mod:`aioloader._validate`'s int rule).
- ``"cpu"`` means "no device stage" and parses to ``None``.
- ``"auto"`` is the one explicit fallback: the current CUDA device where CUDA is available,
  else no device stage. It parses to ``cuda``; :func:`falls_back` tells the stage that a
  missing GPU is then no error. Every other CUDA device without CUDA raises at the first
  iteration, as torch's ``.to("cuda")`` raises: a model on the GPU would fail later, far from
  the cause.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._validate import is_int

if TYPE_CHECKING:
    import torch

__all__ = ["AUTO", "falls_back", "parse_device"]

#: ``device=AUTO``: CUDA where it is available, else the batches stay on the CPU, quietly.
AUTO = "auto"


def falls_back(device: object) -> bool:
    """Whether ``device`` asks for the CPU fallback where there is no CUDA (``"auto"``)."""
    return isinstance(device, str) and device == AUTO


def parse_device(device: str | torch.device | int | None) -> torch.device | None:
    """Normalise the loader's ``device`` argument; ``None`` means "no device stage".

    Accepts ``None``, ``"cpu"``, ``"cuda"``, ``"cuda:<index>"``, ``"auto"`` (parsed as ``cuda``;
    see :func:`falls_back`), a :class:`torch.device` of type cpu or cuda, or a CUDA ordinal.
    Parsing never initialises CUDA, so a bad value is reported at construction even on a
    machine without a GPU.

    Raises:
        ValueError: for a malformed string, a negative ordinal or a device type other than
            cpu and cuda, naming the value.
        TypeError: for a value of another type.
    """
    if device is None or (isinstance(device, str) and device == "cpu"):
        return None  # no device stage: nothing of torch is needed
    import torch  # a device is a torch feature; importing it here keeps `import aioloader` light

    if is_int(device):
        ordinal = int(device)
        if ordinal < 0:
            raise ValueError(f"device={device!r} is not a valid CUDA ordinal: it must be >= 0")
        return torch.device("cuda", ordinal)
    if not isinstance(device, str | torch.device):
        raise TypeError(
            f"device={device!r} must be None, a string such as 'cuda:0', a torch.device "
            "or a CUDA ordinal"
        )
    if falls_back(device):
        return torch.device("cuda")
    if isinstance(device, str):
        try:
            parsed = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(
                f"device={device!r} is not a valid device: expected 'cpu', 'cuda', 'cuda:<index>' "
                "or 'auto'"
            ) from exc
    else:
        parsed = device
    if parsed.type == "cpu":
        return None
    if parsed.type != "cuda":
        raise ValueError(
            f"device={device!r} is not supported: batches go to 'cuda' devices or stay on 'cpu'"
        )
    return parsed
