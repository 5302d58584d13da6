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
    """Run ``main`` to completion on a fresh event loop (uvloop when installed) and close it.

    Raises:
        RuntimeError: a loop already runs in this thread (a notebook, or inside ``async def``):
            ``main`` is closed unrun (no "never awaited" warning follows), and the message
            says to ``await main()`` there instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # no loop runs here: the usual case
    else:
        main.close()  # never started: closing it is what spares the "never awaited" warning
        name = getattr(main, "__qualname__", "main")
        raise RuntimeError(
            "aioloader.run() cannot start a loop here: an event loop is already running in "
            f"this thread (a notebook runs one). There, write `await {name}()` instead of "
            f"`aioloader.run({name}())`"
        )
    with asyncio.Runner(debug=debug, loop_factory=new_event_loop) as runner:
        return runner.run(main)
