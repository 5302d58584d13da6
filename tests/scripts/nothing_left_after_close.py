"""Ends one loader with workers the way a program does (``close()``, ``async with``, an
unfinished iterator dropped with its loader, an exception in the training loop, two loaders one
after the other), then lists every descendant process of this one, the standard resource
tracker aside, while the program still runs: a helper left behind (the forked worker server)
would hold a copy of the program's memory for its whole life.

Prints ``LEFT [(pid, name), ...]`` and exits 1 if anything of the loader is still there after
a grace of a few seconds, else prints ``LEFT []`` and exits 0.

Usage: ``python tests/scripts/nothing_left_after_close.py close|async_with|dropped|exception|two``
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time
import warnings

import psutil

import aioloader

GRACE_S = 5.0  # workers stop within the pool's close; this only covers a slow machine


def descendants() -> list[tuple[int, str]]:
    """Every live descendant of this process but the standard resource tracker."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" in " ".join(child.cmdline()):
                continue
            found.append((child.pid, child.name()))
        except psutil.Error:  # gone meanwhile
            continue
    return found


def left_after_grace() -> list[tuple[int, str]]:
    deadline = time.monotonic() + GRACE_S
    while (left := descendants()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def make() -> aioloader.DataLoader:
    return aioloader.DataLoader(list(range(64)), batch_size=4, num_workers=2)


async def iterate_async() -> None:
    async with make() as loader:
        async for _ in loader:
            pass


def main(scenario: str) -> int:
    if scenario == "close":
        loader = make()
        list(loader)
        loader.close()
    elif scenario == "async_with":
        asyncio.run(iterate_async())
    elif scenario == "dropped":
        warnings.simplefilter("ignore", ResourceWarning)  # unclosed on purpose
        loader = make()
        it = iter(loader)
        next(it)
        del it, loader
        gc.collect()
    elif scenario == "exception":
        try:
            with make() as loader:
                for step, _ in enumerate(loader):
                    if step == 2:
                        raise ValueError("the training step failed")
        except ValueError:
            pass
    elif scenario == "two":
        for _ in range(2):  # the second forks the server again, and ends it again
            with make() as loader:
                list(loader)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    left = left_after_grace()
    print("LEFT", left, flush=True)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
