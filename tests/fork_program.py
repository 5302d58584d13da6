"""A dataset that shows what a worker sees of the program: its own field, and a global of this
module that the program sets (``tests/test_torch_compat.py``'s ``fork`` tests). Imported by
name in workers, so the global is the worker's copy of the module's, not one sent with it."""

from __future__ import annotations

import threading

import torch.utils.data as tud

STATE = "at import"


class Program(tud.Dataset[str]):
    def __init__(self) -> None:
        self.tag = "at construction"

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> str:
        return f"{self.tag}/{STATE}"


#: A lock of the program's, which a thread of the program may hold while workers are forked.
LOCK = threading.Lock()


class Locked(tud.Dataset[int]):
    """Reads take the program's :data:`LOCK`: a worker forked while another thread holds it
    waits for ever (its copy is never released)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        with LOCK:
            return i
