"""Tests of the device stage on the CPU, through a fake CUDA backend.

The fake models what matters about CUDA: copies are *deferred* work on a stream (the
destination is filled only when an event recorded after the copy completes), events complete
when a test says so (or after N queries, or at a wall-clock time), and every stream operation is
logged. So a staging buffer reused too early, a hand-over before completion or a copy on the
wrong stream shows up as wrong values or a wrong log, deterministically.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioloader._device import (
    MAX_POOLED_STAGING_BYTES,
    STAGING_GRANULE,
    DeviceStage,
    DeviceUnavailableWarning,
    Transfer,
    falls_back,
    parse_device,
)
from aioloader._device._staging import StagingPool
from aioloader._errors import TransferError

CUDA0 = torch.device("cuda", 0)


# --- the fake backend -------------------------------------------------------------------------


def _ran() -> None:
    """A stream op that already ran."""


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: list[Any] = []  # deferred copies, run in order when an event completes
        self.done_upto = 0
        self.events: list[FakeEvent] = []

    def run_until(self, mark: int) -> None:
        while self.done_upto < mark:
            self.ops[self.done_upto]()
            self.ops[self.done_upto] = _ran  # as the device does, forget the copy's tensors
            self.done_upto += 1

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class FakeEvent:
    def __init__(self) -> None:
        self.stream: FakeStream | None = None
        self.mark = 0
        self.completed = False
        self.queries = 0
        self.complete_at: float | None = None

    def fire(self) -> None:
        """Complete this event and, as on a real stream, every event recorded before it."""
        assert self.stream is not None, "event was never recorded"
        for ev in self.stream.events:
            if ev.mark <= self.mark:
                ev.completed = True
        self.stream.run_until(self.mark)


class FakeBackend:
    """A scripted stand-in for torch.cuda; see the module docstring."""

    def __init__(self, *, available: bool = True, auto_complete_after: int | None = None) -> None:
        self.available = available
        self.devices = 1
        self.auto_complete_after = auto_complete_after
        self.complete_after_s: float | None = None
        self.log: list[tuple[Any, ...]] = []
        self.default = FakeStream("default")
        self.side: FakeStream | None = None
        self._current: list[FakeStream] = [self.default]
        self.pinned: dict[int, int] = {}
        self.registered: dict[int, int] = {}
        self.register_ok = True
        self.allocs = 0
        self.copies = 0
        self.fail_copy_at: int | None = None
        self.fail_query = False

    # availability
    def is_available(self) -> bool:
        return self.available

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        return 0

    def set_thread_device(self, device: torch.device) -> None:
        self.log.append(("set_device", threading.current_thread().name, device.index))

    def on_device(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    # streams and events
    def new_stream(self, device: torch.device) -> FakeStream:
        assert self.side is None, "one side stream per stage"
        self.side = FakeStream("side")
        return self.side

    def current_stream(self, device: torch.device) -> FakeStream:
        return self._current[-1]

    @contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[FakeStream]:
        self._current.append(stream)
        try:
            yield stream
        finally:
            self._current.pop()

    def new_event(self) -> FakeEvent:
        return FakeEvent()

    def record_event(self, event: FakeEvent, stream: FakeStream) -> None:
        event.stream, event.mark = stream, len(stream.ops)
        if self.complete_after_s is not None:
            event.complete_at = time.monotonic() + self.complete_after_s
        stream.events.append(event)
        self.log.append(("record", event, stream))

    def query_event(self, event: FakeEvent) -> bool:
        event.queries += 1
        if self.fail_query:
            raise RuntimeError("injected device fault")
        if self.auto_complete_after is not None and event.queries >= self.auto_complete_after:
            event.fire()
        if event.complete_at is not None and time.monotonic() >= event.complete_at:
            event.fire()
        return event.completed

    def synchronize_event(self, event: FakeEvent) -> None:
        self.log.append(("synchronize", event))
        event.fire()

    def elapsed_seconds(self, start: FakeEvent, end: FakeEvent) -> float:
        assert start.completed
        assert end.completed
        return 0.25

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        self.log.append(("wait_event", stream, event))

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", tensor, stream))

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.copies += 1
        if self.copies == self.fail_copy_at:
            raise RuntimeError("injected copy failure")
        stream = self._current[-1]
        dst = torch.empty(tensor.shape, dtype=tensor.dtype)
        if dst.numel():
            dst.view(-1).view(torch.uint8).fill_(0xA5)  # garbage until the copy "runs"
        # Deferred, like a DMA: the source is read when the stream reaches this op.
        stream.ops.append(lambda: dst.copy_(tensor))
        self.log.append(("copy", stream, tensor.data_ptr(), tensor.nbytes))
        return dst

    # host memory
    def alloc_pinned(self, nbytes: int) -> torch.Tensor:
        self.allocs += 1
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned[buf.data_ptr()] = nbytes
        return buf

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.data_ptr()
        return any(base <= ptr < base + size for base, size in self.pinned.items())

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone(memory_format=torch.contiguous_format)
        self.pinned[out.data_ptr()] = max(out.nbytes, 1)
        self.log.append(("pin", out))
        return out

    def host_register(self, ptr: int, nbytes: int, device: torch.device) -> bool:
        self.log.append(("register", ptr, nbytes, device))
        if self.register_ok:
            self.registered[ptr] = nbytes
        return self.register_ok

    def host_unregister(self, ptr: int) -> bool:
        self.log.append(("unregister", ptr))
        return self.registered.pop(ptr, None) is not None

    # completion thread and device ring: off in this fake (its events are polled, and every
    # batch gets fresh device tensors); test_device_completion's fake turns them on
    def event_waiter(self) -> Any:
        return None

    def storage_users(self, tensor: torch.Tensor) -> int | None:
        return None

    def empty_device(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.full((nbytes,), 0xA5, dtype=torch.uint8)  # garbage until a copy runs

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies += 1
        if self.copies == self.fail_copy_at:
            raise RuntimeError("injected copy failure")
        stream = self._current[-1]
        stream.ops.append(lambda: dst.copy_(src))  # deferred, like a DMA
        self.log.append(("copy", stream, src.data_ptr(), src.nbytes))

    # helpers for tests
    def fire_all(self) -> None:
        assert self.side is not None
        if self.side.events:
            self.side.events[-1].fire()

    def entries(self, kind: str) -> list[tuple[Any, ...]]:
        return [e for e in self.log if e[0] == kind]

    def staging_of(self, ptr: int) -> int | None:
        return next((b for b, n in self.pinned.items() if b <= ptr < b + n), None)


def end_event(backend: FakeBackend) -> FakeEvent:
    """The event recorded last on the side stream (the end event of the latest batch)."""
    assert backend.side is not None
    return backend.side.events[-1]


def make_batch(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(4, 3, generator=g),
        "y": torch.randint(0, 10, (4,), generator=g).numpy(),
        "nested": [torch.arange(6, dtype=torch.int16).reshape(2, 3) + seed, "label", seed],
    }


def assert_same_values(host: Any, device: Any) -> None:
    if isinstance(host, torch.Tensor):
        assert isinstance(device, torch.Tensor)
        assert device.dtype == host.dtype
        assert device.shape == host.shape
        assert torch.equal(device, host)
    elif isinstance(host, np.ndarray) and host.dtype.kind in "biufc":
        assert isinstance(device, torch.Tensor)
        expected = torch.from_numpy(np.array(host, dtype=host.dtype.newbyteorder("=")))
        assert device.dtype == expected.dtype
        assert device.shape == expected.shape
        assert torch.equal(device, expected)
    elif isinstance(host, dict):
        assert type(device) is type(host)
        assert list(device) == list(host)
        for key in host:
            assert_same_values(host[key], device[key])
    elif isinstance(host, (list, tuple)):
        assert type(device) is type(host)
        assert len(device) == len(host)
        for h, d in zip(host, device, strict=True):
            assert_same_values(h, d)
    else:
        assert device is host


def device_tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in device_tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in device_tensors(v)]
    return []


# --- parse_device -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("cpu", None),
        (torch.device("cpu"), None),
        ("cuda", torch.device("cuda")),
        ("cuda:1", torch.device("cuda", 1)),
        (torch.device("cuda", 2), torch.device("cuda", 2)),
        (3, torch.device("cuda", 3)),
        (0, torch.device("cuda", 0)),
    ],
)
def test_parse_device_accepts(value: Any, expected: torch.device | None) -> None:
    assert parse_device(value) == expected


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("cuda:x", ValueError),
        ("gpu", ValueError),
        ("cuda:-1", ValueError),
        ("", ValueError),
        ("mps", ValueError),
        ("meta", ValueError),
        (-1, ValueError),
        (True, TypeError),
        (1.5, TypeError),
        (["cuda"], TypeError),
    ],
)
def test_parse_device_rejects_naming_the_value(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"device=") as info:
        parse_device(value)
    assert repr(value) in str(info.value)


@given(st.text(max_size=12))
def test_parse_device_never_leaks_torch_errors(text: str) -> None:
    # Any string gives None, a cuda device, or our ValueError: never torch's RuntimeError.
    outcome: Any
    try:
        outcome = parse_device(text)
    except ValueError as exc:
        outcome = exc
    if isinstance(outcome, ValueError):
        assert f"device={text!r}" in str(outcome)
    else:
        assert outcome is None or outcome.type == "cuda"


# --- without CUDA: pass-through ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"device": "auto"},
        {"device": None, "pin_memory": True},
        {"device": "auto", "pin_memory": True},
    ],
    ids=["auto", "pin", "auto-pin"],
)
async def test_without_cuda_the_fallbacks_asked_for_pass_through(kwargs: dict[str, Any]) -> None:
    backend = FakeBackend(available=False)
    if kwargs.get("pin_memory"):
        with pytest.warns(DeviceUnavailableWarning, match="batches stay on the CPU") as record:
            stage = DeviceStage(backend=backend, **kwargs)
        assert len(record) == 1
    else:  # device="auto" is the explicit fallback: quiet (warnings are errors in this suite)
        stage = DeviceStage(backend=backend, **kwargs)
    assert not stage.enabled
    # No further warning per batch (warnings are errors in this suite).
    for i in range(3):
        batch = make_batch(i)
        transfer = stage.start(batch, i)
        assert transfer.done()
        assert await transfer.wait() is batch
    assert backend.log == []
    assert stage.stats().batches_copied == 0
    assert stage.register_host_memory(4096, 4096) is False
    stage.close()


@pytest.mark.parametrize("device", ["cuda", "cuda:1", 0, torch.device("cuda", 0)])
@pytest.mark.parametrize("pin_memory", [False, True])
def test_without_cuda_a_cuda_device_raises_naming_the_fixes(device: Any, pin_memory: bool) -> None:
    # torch's .to("cuda") raises at once; passing CPU batches on would fail the model later.
    with pytest.raises(RuntimeError, match="CUDA is not available") as info:
        DeviceStage(device, pin_memory=pin_memory, backend=FakeBackend(available=False))
    message = str(info.value)
    assert f"device={str(parse_device(device))!r} was asked for" in message
    assert "device=None" in message
    assert "device='auto'" in message
    assert torch.__version__ in message  # what is there


def test_pin_memory_without_cuda_warns_once_per_process() -> None:
    backend = FakeBackend(available=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # Python's own filter would hide repeats anyway
        for _ in range(3):  # three loaders' stages
            DeviceStage(None, pin_memory=True, backend=backend).close()
    assert [w.category for w in record] == [DeviceUnavailableWarning]


def test_auto_parses_as_cuda_and_asks_for_the_fallback() -> None:
    assert parse_device("auto") == torch.device("cuda")
    assert falls_back("auto")
    assert not any(falls_back(d) for d in ("cuda", None, "cpu", 0, torch.device("cuda")))


async def test_default_backend_without_cuda_raises_or_passes_through() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="device='cuda:0' was asked for"):
        DeviceStage(parse_device("cuda:0"), pin_memory=True)
    with pytest.warns(DeviceUnavailableWarning):
        stage = DeviceStage("auto", pin_memory=True)
    batch = make_batch(0)
    assert await stage.start(batch, 0).wait() is batch
    stage.close()


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
async def test_cpu_is_a_silent_no_op(device: Any) -> None:
    backend = FakeBackend()
    stage = DeviceStage(device, backend=backend)
    assert not stage.enabled
    batch = make_batch(1)
    assert await stage.start(batch, 0).wait() is batch
    assert backend.log == []
    stage.close()


def test_bad_arguments_are_named() -> None:
    backend = FakeBackend()
    with pytest.raises(TypeError, match=r"pin_memory='yes'"):
        DeviceStage("cuda", pin_memory="yes", backend=backend)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"device='cuda:3' does not exist.*1 CUDA device"):
        DeviceStage("cuda:3", backend=backend)
    stage = DeviceStage("cuda", backend=FakeBackend())
    assert stage.device == CUDA0
    with pytest.raises(ValueError, match=r"ptr=-1"):
        stage.register_host_memory(-1, 10)
    with pytest.raises(ValueError, match=r"nbytes='10'"):
        stage.register_host_memory(4096, "10")  # type: ignore[arg-type]
    stage.close()


# --- the copy path ----------------------------------------------------------------------------


async def test_copies_run_on_the_side_stream_between_two_events() -> None:
    backend = FakeBackend()
    stage = DeviceStage("cuda", backend=backend)
    batch = make_batch(2)
    transfer = stage.start(batch, 5)
    assert transfer.batch_id == 5
    copies = [i for i, e in enumerate(backend.log) if e[0] == "copy"]
    records = [i for i, e in enumerate(backend.log) if e[0] == "record"]
    assert len(copies) == 3  # x, y, nested[0]; the string and int are not copied
    assert all(backend.log[i][1] is backend.side for i in copies)
    assert all(backend.log[i][2] is backend.side for i in records)
    assert len(records) == 2
    assert records[0] < min(copies)
    assert records[1] > max(copies)
    # Staged sources lie in the pinned staging buffer, not in the pageable host batch.
    assert all(backend.staging_of(backend.log[i][2]) is not None for i in copies)
    backend.fire_all()
    assert_same_values(batch, await transfer.wait())
    stage.close()


async def test_wait_returns_only_after_the_event_completes() -> None:
    backend = FakeBackend()
    stage = DeviceStage("cuda", backend=backend)
    batch = make_batch(3)
    transfer = stage.start(batch, 0)
    task = asyncio.create_task(transfer.wait())
    for _ in range(30):
        await asyncio.sleep(0.001)
    assert not task.done()
    assert not transfer.done()
    assert stage.stats().in_flight == 1
    end = end_event(backend)
    assert end.queries >= 2  # it polled, rather than giving up or blocking
    end.fire()
    result = await asyncio.wait_for(task, 5)
    assert transfer.done()
    assert_same_values(batch, result)
    stats = stage.stats()
    assert stats.in_flight == 0
    assert stats.batches_copied == 1
    assert stats.bytes_copied == 4 * 3 * 4 + 4 * 8 + 6 * 2
    assert stats.copy_seconds == pytest.approx(0.25)
    stage.close()


async def test_hand_over_makes_the_consumer_stream_wait_and_records_streams() -> None:
    backend = FakeBackend(auto_complete_after=1)
    stage = DeviceStage("cuda", backend=backend)
    transfer = stage.start(make_batch(4), 0)
    end = end_event(backend)
    result = await transfer.wait()
    waits = backend.entries("wait_event")
    assert waits == [("wait_event", backend.default, end)]
    recorded = backend.entries("record_stream")
    assert {id(e[1]) for e in recorded} == {id(t) for t in device_tensors(result)}
    assert all(e[2] is backend.default for e in recorded)
    # The stream wait precedes the record_stream calls (both before the batch is returned).
    assert backend.log.index(waits[0]) < backend.log.index(recorded[0])

    consumer = FakeStream("consumer")
    transfer = stage.start(make_batch(5), 1)
    await transfer.wait(stream=consumer)
    assert backend.entries("wait_event")[-1] == ("wait_event", consumer, end_event(backend))
    assert backend.entries("record_stream")[-1][2] is consumer
    stage.close()


async def test_staging_buffers_are_reused_only_after_completion() -> None:
    backend = FakeBackend()
    stage = DeviceStage("cuda", backend=backend)

    def staging_used() -> set[int | None]:
        new = backend.entries("copy")[seen:]
        return {backend.staging_of(e[2]) for e in new}

    seen = 0
    a = make_batch(10)
    ta = stage.start(a, 0)
    buf_a = staging_used()
    seen = len(backend.entries("copy"))
    assert len(buf_a) == 1
    assert None not in buf_a
    # B starts while A's copy is pending: it must not get A's buffer.
    b = make_batch(11)
    tb = stage.start(b, 1)
    buf_b = staging_used()
    seen = len(backend.entries("copy"))
    assert buf_b.isdisjoint(buf_a)
    assert backend.allocs == 2
    backend.fire_all()
    assert_same_values(a, await ta.wait())
    assert_same_values(b, await tb.wait())
    # Both completed: C and D reuse them; no new pinned allocation.
    c = make_batch(12)
    tc = stage.start(c, 2)
    d = make_batch(13)
    td = stage.start(d, 3)
    assert staging_used() <= buf_a | buf_b
    assert backend.allocs == 2
    assert stage.stats().staging_buffers == 2
    assert stage.stats().pinned_bytes == 2 * STAGING_GRANULE
    backend.fire_all()
    assert_same_values(c, await tc.wait())
    assert_same_values(d, await td.wait())
    stage.close()
    assert stage.stats().staging_buffers == 0


async def test_deep_pipeline_values_survive_buffer_reuse() -> None:
    # Many batches, up to `depth` in flight, events completed in random order of bursts: the
    # deferred fake copies would read overwritten staging memory if a buffer were reused early.
    backend = FakeBackend()
    stage = DeviceStage("cuda", backend=backend)
    rng = np.random.default_rng(0)
    pending: collections.deque[tuple[dict[str, Any], Transfer]] = collections.deque()
    for i in range(40):
        batch = make_batch(100 + i)
        pending.append((batch, stage.start(batch, i)))
        if len(pending) > 3 or rng.random() < 0.3:
            backend.fire_all()
            while pending and (len(pending) > 1 or rng.random() < 0.5):
                host, transfer = pending.popleft()
                assert_same_values(host, await transfer.wait())
    backend.fire_all()
    while pending:
        host, transfer = pending.popleft()
        assert_same_values(host, await transfer.wait())
    assert backend.allocs <= 5
    assert stage.stats().batches_copied == 40
    stage.close()


async def test_registered_and_pinned_memory_is_copied_directly() -> None:
    backend = FakeBackend()
    stage = DeviceStage("cuda", backend=backend)
    slot = np.zeros(1 << 16, dtype=np.uint8)  # stands in for a shared-memory slot
    base = slot.__array_interface__["data"][0]
    assert stage.register_host_memory(base, slot.nbytes)
    assert stage.register_host_memory(base, slot.nbytes)  # idempotent
    assert ("register", base, slot.nbytes, CUDA0) in backend.log
    assert stage.stats().registered_bytes == slot.nbytes
    images = slot[4096 : 4096 + 4 * 64].view(np.float32).reshape(4, 16)
    images[:] = np.arange(64, dtype=np.float32).reshape(4, 16)
    pinned = backend.pin(torch.arange(8))
    batch = {"images": images, "labels": pinned, "plain": torch.ones(3)}
    transfer = stage.start(batch, 0)
    sources = {e[2] for e in backend.entries("copy")}
    assert images.__array_interface__["data"][0] in sources
    assert pinned.data_ptr() in sources
    # Only the pageable tensor went through staging.
    assert backend.allocs == 1
    # Unregistering a range that a copy still reads waits for that copy first.
    stage.unregister_host_memory(base)
    sync_at = backend.log.index(("synchronize", end_event(backend)))
    assert sync_at < backend.log.index(("unregister", base))
    assert transfer.done()
    assert_same_values(batch, await transfer.wait())
    assert stage.stats().registered_bytes == 0
    stage.unregister_host_memory(base)  # unknown pointers are ignored
    assert len(backend.entries("unregister")) == 1
    stage.close()


async def test_registration_failure_falls_back_to_staging() -> None:
    backend = FakeBackend()
    backend.register_ok = False
    stage = DeviceStage("cuda", backend=backend)
    slot = np.arange(1024, dtype=np.int32)
    assert not stage.register_host_memory(slot.__array_interface__["data"][0], slot.nbytes)
    transfer = stage.start({"a": slot}, 0)
    assert backend.staging_of(backend.entries("copy")[0][2]) is not None
    backend.fire_all()
    assert_same_values({"a": slot}, await transfer.wait())
    stage.close()


async def test_copy_failure_raises_transfer_error_and_drops_the_host_batch() -> None:
    backend = FakeBackend()
    stage = DeviceStage("cuda", backend=backend)
    backend.fail_copy_at = 2
    leaf = torch.randn(256)
    leaf_ref = weakref.ref(leaf)
    array = np.arange(100.0)
    array_ref = weakref.ref(array)
    batch = {"a": leaf, "b": array, "c": torch.zeros(2)}
    with pytest.raises(TransferError, match=r"batch 7\b.*injected copy failure") as info:
        stage.start(batch, 7)
    error = info.value
    assert isinstance(error.__cause__, RuntimeError)
    del batch, leaf, array
    gc.collect()
    # The error (kept alive here, as a traceback would) holds no reference to the host batch.
    assert leaf_ref() is None
    assert array_ref() is None
    assert stage.stats().in_flight == 0
    # The first leaf's copy was already enqueued: its staging buffer retires behind an event
    # and is not reused until that event completes.
    backend.fail_copy_at = None
    failed_buffer = backend.staging_of(backend.entries("copy")[0][2])
    batch2 = make_batch(20)
    t2 = stage.start(batch2, 8)
    assert backend.allocs == 2
    assert backend.staging_of(backend.entries("copy")[-1][2]) != failed_buffer
    backend.fire_all()
    assert_same_values(batch2, await t2.wait())
    t3 = stage.start(make_batch(21), 9)
    assert backend.allocs == 2  # both buffers are back in the pool now
    backend.fire_all()
    await t3.wait()
    del error, info
    stage.close()


async def test_device_fault_while_waiting_raises_transfer_error() -> None:
    backend = FakeBackend()
    stage = DeviceStage("cuda", backend=backend)
    batch = make_batch(30)
    batch_ref = weakref.ref(batch["x"])
    transfer = stage.start(batch, 12)
    del batch
    backend.fail_query = True
    with pytest.raises(TransferError, match=r"batch 12\b.*injected device fault") as info:
        await transfer.wait()
    assert isinstance(info.value.__cause__, RuntimeError)
    gc.collect()
    assert batch_ref() is None
    assert stage.stats().in_flight == 0
    # A buffer the device may still read is never reused.
    assert stage.stats().staging_buffers == 0
    stage.close()


async def test_cancelled_wait_does_not_lose_the_batch() -> None:
    backend = FakeBackend()
    stage = DeviceStage("cuda", backend=backend)
    batch = make_batch(40)
    transfer = stage.start(batch, 0)
    task = asyncio.create_task(transfer.wait())
    await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.005):
            await transfer.wait()
    assert backend.entries("wait_event") == []  # nothing was handed over yet
    backend.fire_all()
    assert_same_values(batch, await transfer.wait())
    stage.close()


async def test_loop_stays_responsive_while_a_copy_is_pending() -> None:
    backend = FakeBackend()
    backend.complete_after_s = 0.1
    stage = DeviceStage("cuda", backend=backend)
    batch = make_batch(50)
    transfer = stage.start(batch, 0)
    lags: list[float] = []
    period = 0.002

    async def ticker() -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(period)
            lags.append(time.monotonic() - before - period)

    tick_task = asyncio.create_task(ticker())
    started = time.monotonic()
    result = await transfer.wait()
    waited = time.monotonic() - started
    tick_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await tick_task
    assert_same_values(batch, result)
    assert waited >= 0.09
    # A wait that blocked the loop (synchronize(), busy polling) would starve the ticker for the
    # whole 100 ms; polling with a capped back-off keeps every tick's lag small.
    assert len(lags) >= 10
    assert max(lags) < 0.075
    # Back-off: far fewer queries than a busy loop, more than a single check.
    queries = end_event(backend).queries
    assert 3 <= queries <= 0.1 / 50e-6
    stage.close()


async def test_close_settles_copies_in_flight_and_is_idempotent() -> None:
    backend = FakeBackend()
    stage = DeviceStage("cuda", backend=backend)
    slot = np.zeros(4096, dtype=np.uint8)
    base = slot.__array_interface__["data"][0]
    assert stage.register_host_memory(base, slot.nbytes)
    batch = make_batch(60)
    transfer = stage.start(batch, 0)
    stage.close()
    assert ("synchronize", end_event(backend)) in backend.log
    assert backend.registered == {}
    stats = stage.stats()
    assert stats.in_flight == 0
    assert stats.staging_buffers == 0
    assert stats.registered_bytes == 0
    # A transfer started before close() still delivers.
    assert transfer.done()
    assert_same_values(batch, await transfer.wait())
    stage.close()
    assert len(backend.entries("unregister")) == 1
    with pytest.raises(RuntimeError, match="closed"):
        stage.start(batch, 1)
    assert not stage.register_host_memory(base, slot.nbytes)


async def test_drain_awaits_every_copy_without_handing_over() -> None:
    backend = FakeBackend(auto_complete_after=3)
    stage = DeviceStage("cuda", backend=backend)
    transfers = [stage.start(make_batch(70 + i), i) for i in range(3)]
    await stage.drain()
    assert all(t.done() for t in transfers)
    assert stage.stats().in_flight == 0
    assert backend.entries("wait_event") == []
    stage.close()


async def test_completed_copies_release_their_buffers_without_a_wait() -> None:
    # A consumer that never waits (an abandoned iterator) must not pin staging buffers forever:
    # the next start() reaps copies that completed.
    backend = FakeBackend()
    stage = DeviceStage("cuda", backend=backend)
    abandoned = stage.start(make_batch(80), 0)
    backend.fire_all()
    stage.start(make_batch(81), 1)
    assert backend.allocs == 1
    assert abandoned.done()
    stage.close()


async def test_pin_only_mode_returns_pinned_host_tensors() -> None:
    backend = FakeBackend()
    stage = DeviceStage(None, pin_memory=True, backend=backend)
    assert stage.enabled
    slot = np.arange(32, dtype=np.float64)
    assert stage.register_host_memory(slot.__array_interface__["data"][0], slot.nbytes)
    readonly = np.arange(6, dtype=np.int64)
    readonly.flags.writeable = False
    batch = {"t": torch.arange(5), "a": readonly, "slot": slot, "s": np.array(["x", "y"])}
    transfer = stage.start(batch, 0)
    assert transfer.done()
    result = await transfer.wait()
    assert_same_values(batch, result)
    assert backend.is_pinned(result["t"])
    assert backend.is_pinned(result["a"])
    # Registered memory is already page-locked: returned as a view, not copied.
    assert result["slot"].data_ptr() == slot.__array_interface__["data"][0]
    assert result["s"] is batch["s"]
    assert backend.entries("copy") == []
    assert backend.entries("wait_event") == []
    assert stage.stats().batches_copied == 1
    stage.close()


# --- invariants -------------------------------------------------------------------------------


class Pair(NamedTuple):
    left: Any
    right: Any


_DTYPES = ["bool", "uint8", "int16", "int32", "int64", "float16", "float32", "float64", "complex64"]


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    dtype = np.dtype(draw(st.sampled_from(_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    values = np.random.default_rng(draw(st.integers(0, 2**16))).integers(0, 100, size=shape)
    arr = values.astype(dtype)
    variant = draw(st.sampled_from(["plain", "readonly", "byteswapped", "transposed", "strided"]))
    if variant == "readonly":
        arr.flags.writeable = False
    elif variant == "byteswapped" and dtype.itemsize > 1 and dtype.kind != "b":
        arr = arr.astype(dtype.newbyteorder())
    elif variant == "transposed":
        arr = arr.T
    elif variant == "strided" and arr.ndim:
        arr = arr[::-1]
    return arr


leaves = st.one_of(
    arrays(),
    arrays().map(lambda a: torch.from_numpy(np.array(a, dtype=a.dtype.newbyteorder("=")))),
    arrays().map(
        lambda a: (
            torch.from_numpy(np.array(a, dtype=a.dtype.newbyteorder("="))).transpose(0, -1)
            if a.ndim
            else torch.tensor(1.5)
        )
    ),
    st.integers(),
    st.text(max_size=3),
    st.just(np.array(["a", "bc"])),
    st.none(),
)

trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.builds(Pair, children, children),
        st.dictionaries(st.text(max_size=2), children, max_size=3),
        st.dictionaries(st.text(max_size=2), children, max_size=3).map(collections.OrderedDict),
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=trees)
def test_any_batch_arrives_with_its_structure_and_values(batch: Any) -> None:
    backend = FakeBackend(auto_complete_after=2)
    stage = DeviceStage("cuda", backend=backend)
    transfers = [stage.start(batch, i) for i in range(2)]  # two in flight share nothing

    async def collect() -> list[Any]:
        return [await t.wait() for t in transfers]

    for result in asyncio.run(collect()):
        assert_same_values(batch, result)
    assert backend.allocs <= 2
    stage.close()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * STAGING_GRANULE)), max_size=30))
def test_staging_pool_never_double_leases(ops: list[tuple[bool, int]]) -> None:
    cap = 3 * STAGING_GRANULE
    pool = StagingPool(lambda n: torch.empty(n, dtype=torch.uint8), cap)
    leased: list[torch.Tensor] = []
    for acquire, nbytes in ops:
        if acquire or not leased:
            buf = pool.acquire(nbytes)
            assert buf.numel() >= nbytes
            assert all(buf.data_ptr() != other.data_ptr() for other in leased)
            leased.append(buf)
        else:
            pool.release(leased.pop(nbytes % len(leased)))
        free_bytes = pool.nbytes - sum(b.numel() for b in leased)
        assert 0 <= free_bytes <= cap
        assert pool.buffers >= len(leased)
    assert MAX_POOLED_STAGING_BYTES >= STAGING_GRANULE


# --- structure --------------------------------------------------------------------------------


def test_device_modules_import_one_way_and_no_private_names() -> None:
    """``_stage`` uses the other modules, none of them uses it, and none reads ``_private``."""
    import ast
    import pathlib

    import aioloader._device

    package = pathlib.Path(aioloader._device.__file__).parent
    for path in sorted(package.glob("_*.py")):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            if path.name != "_stage.py":
                assert node.module != "_stage", f"{path.name} imports _stage"
            private = [a.name for a in node.names if a.name.startswith("_")]
            assert not private, f"{path.name} imports {private} from {node.module}"
