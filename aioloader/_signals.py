"""Release worker processes before a SIGTERM ends the program.

Python's default for SIGTERM is to die at once: no ``finally``, no ``atexit``. A scheduler, a
cluster manager or ``torchrun`` stopping a job sends exactly that, and a loader that was never
closed then leaves its worker processes to notice on their own (they do, within a watchdog
interval) and the multiprocessing resource tracker to complain about the locks it must clean
up. :func:`release_before_sigterm` installs a handler that keeps the default's meaning (the
process still ends, killed by SIGTERM, as its parent expects) but releases what the loaders
hold first.

It is installed only where it changes nothing else: in the main thread, over the default
disposition. A handler the program installed itself (Lightning's, an orchestrator's) is left
alone; such a program ends through its own handler, and the exit hook in ``_resources``
releases the loaders then.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

__all__ = ["release_before_sigterm", "terminating"]

# How long the handler waits for the release before it lets the signal end the process.
RELEASE_BOUND_S = 3.0

_installed_in: int | None = None  # the pid whose handler is ours

#: Set while the handler releases: the main thread waits in it, so an event loop that runs
#: there runs nothing until the process ends. Whoever would wait for such a loop must not.
terminating = threading.Event()


def release_before_sigterm(release: Callable[[], None]) -> None:
    """Make a SIGTERM run ``release`` (bounded by :data:`RELEASE_BOUND_S`) before the process
    ends by it. Idempotent per process; a no-op off the main thread or over a handler that is
    not the default."""
    global _installed_in
    if _installed_in == os.getpid() or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        terminating.set()
        # On a thread of its own: the main thread was interrupted anywhere, perhaps holding a
        # lock the release needs; it must not wait on itself, and a stuck release must not
        # keep the process from ending.
        worker = threading.Thread(target=release, name="aioloader-sigterm", daemon=True)
        worker.start()
        worker.join(RELEASE_BOUND_S)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    _installed_in = os.getpid()
