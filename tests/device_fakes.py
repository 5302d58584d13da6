"""A fake CUDA whose events are waited on from a thread, and whose device memory is reused.

:class:`ThreadFake` extends ``test_device.FakeBackend`` with what the device stage's completion
thread and device ring need: an ``event_waiter`` that blocks the calling thread until a test
(or another thread) completes the event, never completing it itself, and real storage use
counts. Its pinned buffers live as long as the fake, so no address is ever taken for pinned
memory after it was freed. Copies stay deferred (a destination is filled only when an event
after it completes), so a slot reused too early shows up as wrong values.

Events on streams other than the side stream (a ring slot's release events, recorded on the
consumer's stream) complete at once with ``consumer_done=True``, or when a test fires them.

Each thread has a current device, 0 until it calls ``set_thread_device`` (as in CUDA) or
while it is inside ``on_device``; the waiter notes the thread and its current device at each
wait, and so do ``query_event`` and ``synchronize_event``. ``hold`` keeps the stage's
staging thread at its first copy until a test sets it; ``fail_pinned`` makes that many
pinned allocations fail as an exhausted page-locked pool does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from test_device import FakeBackend, FakeEvent, FakeStream

from aioloader._device._backend import storage_users

__all__ = ["ThreadFake", "ThreadedEvent"]

# Bounds every wait of the fake's waiter (the suite's per-test timeout is the real bound).
WAITER_CAP_S = 30.0


class ThreadedEvent(FakeEvent):
    """A fake event a thread can block on until it is fired."""

    def __init__(self) -> None:
        super().__init__()
        self.done = threading.Event()

    def fire(self) -> None:
        super().fire()
        assert self.stream is not None
        for ev in self.stream.events:
            if ev.completed and isinstance(ev, ThreadedEvent):
                ev.done.set()


class ThreadFake(FakeBackend):
    """``FakeBackend`` with a thread-waitable event and the device ring on."""

    def __init__(self, *, consumer_done: bool = True, auto_fire: bool = False) -> None:
        super().__init__()
        self.consumer_done = consumer_done
        self.auto_fire = auto_fire
        self.waited_from: list[str] = []  # the threads the waiter ran on
        self.waited_on: list[tuple[str, int]] = []  # (thread, its current device) per wait
        self.queried_on: list[tuple[str, int]] = []  # (thread, its device) per query/sync
        self.device_allocs = 0
        self.kept: list[torch.Tensor] = []
        self.copied_on: list[tuple[str, int]] = []  # (thread, its device) per copy off the loop
        self.hold: threading.Event | None = None
        self.fail_pinned = 0
        self._thread_device = threading.local()

    def set_thread_device(self, device: torch.device) -> None:
        super().set_thread_device(device)
        self._thread_device.index = device.index

    @contextlib.contextmanager
    def on_device(self, device: torch.device) -> Iterator[None]:
        before = self.thread_device()
        self._thread_device.index = device.index
        try:
            yield
        finally:
            self._thread_device.index = before

    def query_event(self, event: FakeEvent) -> bool:
        self.queried_on.append((threading.current_thread().name, self.thread_device()))
        return super().query_event(event)

    def synchronize_event(self, event: FakeEvent) -> None:
        self.queried_on.append((threading.current_thread().name, self.thread_device()))
        super().synchronize_event(event)

    def thread_device(self) -> int:
        """The calling thread's current device (0 until it set one, as in CUDA)."""
        return int(getattr(self._thread_device, "index", 0))

    def _held(self) -> None:
        name = threading.current_thread().name
        if name.startswith("aioloader"):
            self.copied_on.append((name, self.thread_device()))
        if self.hold is not None and name.startswith("aioloader-stage"):
            assert self.hold.wait(WAITER_CAP_S), "the test never let the staging thread go"

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._held()
        super().copy_into(dst, src)

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        self._held()
        return super().to_device(tensor, device)

    def new_event(self) -> ThreadedEvent:
        return ThreadedEvent()

    def record_event(self, event: FakeEvent, stream: FakeStream) -> None:
        super().record_event(event, stream)
        if (stream is not self.side and self.consumer_done) or (
            self.auto_fire and stream is self.side
        ):
            event.fire()

    def event_waiter(self) -> Any:
        def wait(event: ThreadedEvent) -> None:
            self.waited_from.append(threading.current_thread().name)
            self.waited_on.append((threading.current_thread().name, self.thread_device()))
            if not event.done.wait(WAITER_CAP_S):
                raise RuntimeError("fake event never completed")

        return wait

    def storage_users(self, tensor: torch.Tensor) -> int | None:
        return storage_users(tensor)

    def empty_device(self, nbytes: int, device: torch.device) -> torch.Tensor:
        self.device_allocs += 1
        return super().empty_device(nbytes, device)

    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        if self.fail_pinned > 0:
            self.fail_pinned -= 1
            raise RuntimeError("CUDA error: out of memory (injected: page-locked memory)")
        buf = super().alloc_pinned(nbytes)
        self.kept.append(buf)  # never freed while the fake lives: no address taken twice
        return buf

    def release_events(self) -> list[ThreadedEvent]:
        """Events recorded on streams other than the side stream (the ring's releases)."""
        return [
            e[1]
            for e in self.log
            if e[0] == "record" and e[2] is not self.side and isinstance(e[1], ThreadedEvent)
        ]
