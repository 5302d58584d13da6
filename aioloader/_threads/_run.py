"""``aioloader.run``: ``asyncio.run`` on uvloop where it is installed.

uvloop is the default loop of this project where it is installed and the user did not choose
one; we do not change the global event-loop policy behind the user's back, so the choice is made
here, by the entry point, instead. Everything also works on the stock asyncio loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from ._loop import new_event_loop

__all__ = ["run"]

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run ``main`` to completion on a fresh event loop (uvloop when installed) and close it."""
    with asyncio.Runner(debug=debug, loop_factory=new_event_loop) as runner:
        return runner.run(main)
