"""An :class:`Epoch` whose ``__init__`` was interrupted (_epoch._consume): collected quietly,
with nothing to close, never ``Exception ignored in Epoch.__del__``.

A Ctrl-C may arrive anywhere in ``Epoch.__init__`` (or a part of it may fail); the half-made
epoch is then collected, and its ``__del__`` must not trip over the attributes it never got.
The interruption is injected through the ``config`` argument: a config that raises
``KeyboardInterrupt`` when a chosen setting is first read.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

import pytest
from datasets import Range
from helpers import build_config

from aioloader._batch._make import BatchMaker
from aioloader._epoch._consume import Epoch
from aioloader._epoch._plan import Plan
from aioloader._stats._counters import Counters
from aioloader._threads._runner import ThreadRunner

# The full leak check of RELIABILITY.md (conftest.baseline) after every test here.
pytestmark = pytest.mark.usefixtures("baseline")


class InterruptedAt:
    """A loader config that raises ``KeyboardInterrupt`` when ``setting`` is read."""

    def __init__(self, config: Any, setting: str) -> None:
        self._config = config
        self._setting = setting

    def __getattr__(self, name: str) -> Any:
        if name == self._setting:
            raise KeyboardInterrupt
        return getattr(self._config, name)


# Read in Epoch.__init__ before its producer is made, while it is made, and after it.
@pytest.mark.parametrize("setting", ["in_order", "timeout", "max_retries"])
def test_an_epoch_interrupted_while_made_is_collected_quietly(
    setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    config = build_config()
    runner = ThreadRunner(BatchMaker(Range(8), config.collate_fn), 1)
    try:
        with pytest.raises(KeyboardInterrupt):
            Epoch(
                InterruptedAt(config, setting),  # type: ignore[arg-type]
                0,
                runner,
                Counters(),
                plan=Plan(iter([(0, [0, 1, 2, 3])])),
                dataset=Range(8),
                device=None,
                on_batch=lambda batch_id, position: None,
            )
        gc.collect()  # the half-made epoch, freed with the traceback that held it
    finally:
        runner.close()
    assert [f"{u.exc_type.__name__}: {u.exc_value} in {u.object!r}" for u in unraisable] == []
