"""Logging (_log): one logger per area under ``aioloader``, silent until the application
configures logging, and a record for each event worth knowing: worker replacements and batch
re-runs, remote retries (cause and delay) and stalls, skips (index and reason), each epoch's
verdict.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fault_datasets as fd
import pytest
from datasets import FailAt, Slow
from helpers import Sleeps, collect
from http_server import Fault, FaultServer

from aioloader import DataLoader
from aioloader._epoch._consume import _log_verdict
from aioloader._log import first_time, reset_once
from aioloader._stats import VERDICT_WARNING_MIN_S, WAIT_SHARE_THRESHOLD
from aioloader.sources import HTTPDataset, RetryPolicy

TESTS = Path(__file__).resolve().parent


def records(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == name]


def test_silent_by_default_nothing_reaches_stderr() -> None:
    # A fresh interpreter with no logging set up: skips (WARNING) and the verdict of a slow
    # epoch (WARNING) must not reach Python's last-resort handler, and nothing is printed.
    script = textwrap.dedent(
        """
        import logging
        import aioloader
        from datasets import FailAt, Slow

        root = logging.getLogger()
        with aioloader.DataLoader(FailAt(8, {1, 5}), batch_size=2, on_error="skip",
                                  max_failures=2) as loader:
            list(loader)
        with aioloader.DataLoader(Slow(8, 0.01), batch_size=2) as loader:
            list(loader)
        assert loader.statistics().epoch_stats.wait_share > 0.2
        assert loader.statistics().skipped_count == 0
        assert root.handlers == [], root.handlers  # no basicConfig
        ours = logging.getLogger("aioloader").handlers
        assert [type(h).__name__ for h in ours] == ["NullHandler"], ours
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert (result.stdout, result.stderr) == ("", "")


async def test_skips_are_logged_with_index_and_reason(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "aioloader")
    async with DataLoader(FailAt(12, {3, 7}), batch_size=4, on_error="skip", max_failures=2) as ld:
        await collect(ld)
    skips = [r.getMessage() for r in records(caplog, "aioloader.epoch") if "skipped" in r.msg]
    assert skips == [
        "skipped sample index 3: KeyError: 'sample 3 is broken'",
        "skipped sample index 7: KeyError: 'sample 7 is broken'",
    ]
    assert all(r.levelno == logging.WARNING for r in records(caplog, "aioloader.epoch"))


async def test_no_skip_is_formatted_when_warnings_are_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, "aioloader")
    async with DataLoader(FailAt(12, {3}), batch_size=4, on_error="skip", max_failures=1) as ld:
        await collect(ld)
        assert ld.statistics().skipped_count == 1
    assert caplog.records == []


async def test_each_epoch_logs_its_verdict_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "aioloader")
    async with DataLoader(Slow(16, 0.01), batch_size=4) as loader:
        for _ in range(2):
            await collect(loader)
    verdicts = [r for r in records(caplog, "aioloader.epoch") if "bottleneck" in r.getMessage()]
    assert [r.getMessage().split(":")[0] for r in verdicts] == ["epoch 0", "epoch 1"]
    # The consumer waited for a slow dataset, and the verdict names the knob; but an epoch of
    # a fraction of a second needs no action: INFO, not WARNING (issue #42).
    assert all(r.levelno == logging.INFO for r in verdicts)
    assert all("num_workers" in r.getMessage() for r in verdicts)


async def test_a_short_epoch_warns_nothing_at_the_default_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # logging.basicConfig()'s level: a newcomer's first short runs print no warning.
    caplog.set_level(logging.WARNING)
    async with DataLoader(Slow(16, 0.01), batch_size=4) as loader:
        for _ in range(3):
            await collect(loader)
        assert loader.statistics().epoch_stats.wait_share > WAIT_SHARE_THRESHOLD
    assert records(caplog, "aioloader.epoch") == []


async def test_a_verdict_that_needs_action_warns_once_per_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "aioloader")
    async with DataLoader(Slow(16, 0.01), batch_size=4) as loader:
        await collect(loader)
        short = loader.statistics().epoch_stats
    assert short.wait_share > WAIT_SHARE_THRESHOLD
    assert not short.needs_action
    long = dataclasses.replace(short, wall_s=VERDICT_WARNING_MIN_S)
    assert long.needs_action
    assert not dataclasses.replace(long, wait_share=WAIT_SHARE_THRESHOLD / 2).needs_action
    caplog.clear()
    for _ in range(3):  # three long, slow epochs, in any loaders: one WARNING, then INFO
        _log_verdict(long)
    levels = [r.levelno for r in records(caplog, "aioloader.epoch")]
    assert levels == [logging.WARNING, logging.INFO, logging.INFO]
    reset_once()  # what tests (the autouse fixture) do between tests: said again
    _log_verdict(long)
    assert records(caplog, "aioloader.epoch")[-1].levelno == logging.WARNING


async def test_a_fast_loader_logs_its_verdict_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "aioloader")
    async with DataLoader(FailAt(16, set()), batch_size=4) as loader:
        async for _ in loader:
            await asyncio.sleep(0.02)  # the training step is the limit
    [verdict] = [r for r in records(caplog, "aioloader.epoch") if "bottleneck" in r.getMessage()]
    assert verdict.levelno == logging.INFO
    assert "bottleneck: consumer" in verdict.getMessage()


async def test_an_epoch_left_early_logs_its_verdict_too(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "aioloader.epoch")
    async with DataLoader(Slow(40, 0.005), batch_size=4) as loader:
        async for _ in loader:
            break
    [record] = records(caplog, "aioloader.epoch")
    assert "epoch 0: 1 batches" in record.getMessage()


async def test_remote_retries_are_logged_with_cause_and_delay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "aioloader.remote")
    policy = RetryPolicy(max_attempts=3, backoff_initial=0.25, jitter=False)
    sleeps = Sleeps()
    async with FaultServer() as server:
        server.fail("/obj/2", Fault.http(503, retry_after="1"))
        dataset = HTTPDataset([server.obj_url(i) for i in range(4)], retry=policy, sleep=sleeps)
        async with DataLoader(dataset, batch_size=4, collate_fn=list) as loader:
            await collect(loader)
            assert loader.statistics().remote_retries == 1
    [record] = records(caplog, "aioloader.remote")
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert server.obj_url(2) in message
    assert "in 1.000 s" in message  # the Retry-After, above the 0.25 s backoff
    assert "HTTP 503" in message
    assert "attempt 1 of 3" in message
    assert sleeps == [1.0]


async def test_a_stalled_read_is_logged_while_it_stalls(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "aioloader.remote")
    async with FaultServer() as server:
        server.fail("/obj/1", Fault.stall(0.8))  # headers, then 0.8 s of silence, then the body
        dataset = HTTPDataset(
            [server.obj_url(i) for i in range(2)], stall_warning=0.2, read_timeout=10
        )
        async with DataLoader(dataset, batch_size=2, collate_fn=list) as loader:
            await collect(loader)
            stats = loader.statistics()
    [record] = records(caplog, "aioloader.remote")
    assert record.levelno == logging.WARNING
    assert server.obj_url(1) in record.getMessage()
    assert "stalls" in record.getMessage()
    assert "stall_warning=0.2" in record.getMessage()
    assert stats.remote_stalls == 1
    assert stats.remote_retries == 0  # it recovered within read_timeout: no retry


def test_stall_warning_is_checked() -> None:
    with pytest.raises(ValueError, match="stall_warning"):
        HTTPDataset(["http://127.0.0.1/x"], stall_warning=-1)
    assert HTTPDataset(["http://127.0.0.1/x"], stall_warning=None) is not None


@pytest.mark.slow
async def test_a_worker_crash_logs_the_replacement_and_the_rerun(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.WARNING, "aioloader")
    dataset = fd.Faulty(8, faults={5: fd.SIGKILL}, marker_dir=str(tmp_path))
    async with fd.make_loader(dataset, num_workers=1, max_retries=1) as loader:
        assert len(await collect(loader)) == 2
        assert loader.statistics().worker_restarts == 1
        assert loader.statistics().retries == 1
    messages = [r.getMessage() for r in records(caplog, "aioloader.workers")]
    [replaced] = [m for m in messages if m.startswith("worker process replaced")]
    assert "SIGKILL" in replaced
    assert "pid" in replaced
    [rerun] = [m for m in messages if m.startswith("re-running")]
    assert "batch 1" in rerun
    assert "retry 1 of max_retries=1" in rerun
    assert "crashed" in rerun


@pytest.mark.slow
async def test_a_worker_killed_at_its_deadline_is_logged(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.WARNING, "aioloader.workers")
    dataset = fd.Faulty(8, faults={2: fd.HANG}, marker_dir=str(tmp_path))
    async with fd.make_loader(dataset, num_workers=1, timeout=0.5, max_retries=1) as loader:
        assert len(await collect(loader)) == 2
        assert loader.statistics().timeouts == 1
    messages = [r.getMessage() for r in records(caplog, "aioloader.workers")]
    [killed] = [m for m in messages if "killed and replaced" in m]
    assert "batch 0 passed its deadline" in killed
    [rerun] = [m for m in messages if m.startswith("re-running")]
    assert "batch 0" in rerun
    assert "passed its 0.5 s deadline" in rerun
    assert not [m for m in messages if m.startswith("worker process replaced")]  # said once


def test_a_forked_child_says_once_per_process_warnings_again() -> None:
    # "Once per process": a child made by os.fork() (a ddp_fork rank) has said nothing yet,
    # whatever its parent said; the parent still says it only once.
    key = ("test", "forked child")
    assert first_time(key)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            code = 0 if first_time(key) and not first_time(key) else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 10
    status = None
    while status is None and time.monotonic() < deadline:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
        else:
            time.sleep(0.01)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the child did not exit within 10 s")
    assert status == 0, "the child found the key said already (1)"
    assert not first_time(key)  # the parent's record is untouched
