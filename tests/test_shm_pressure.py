"""/dev/shm under pressure costs no batch (RELIABILITY.md row 20).

A batch that cannot get a segment (``/dev/shm`` filled by another process, by other ranks'
loaders, or a segment removed behind the loader's back) travels inline instead: every sample is
delivered exactly once and in order, one warning is logged (``aioloader.shm``), and
``statistics().shm_fallbacks`` counts those batches.

Two kinds of test:

- for real, where this machine allows it: each scenario runs in a private mount namespace
  whose ``/dev/shm`` is a fresh 64 MiB tmpfs (``unshare --mount`` and ``mount -t tmpfs``, as
  root), so nothing outside it is touched and it vanishes with the namespace. Elsewhere they
  skip, saying why. The loaders run ``tests/scripts/shm_pressure.py`` and report as JSON.
- everywhere: the same failures injected at the loader level into segment creation in the main
  process (the only one that creates segments), with real worker processes.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from procs import no_worker_left_behind

import aioloader
from aioloader import DataLoader, _shm
from aioloader._shm import Slot, SlotPool
from aioloader._types import Made
from aioloader._workers._wire import Packer, Receiver

TESTS_DIR = pathlib.Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent
SCRIPT = TESTS_DIR / "scripts" / "shm_pressure.py"
SAMPLES = 96  # the script's epoch
BOUND_S = 30.0  # each scenario, its processes' start-up included
RANKS = 4  # loaders sharing one /dev/shm, as the ranks of a node; AIOLOADER_TEST_RANKS: more
MOUNT = "mount -t tmpfs -o size=64m tmpfs /dev/shm"


@functools.cache
def _why_no_small_shm() -> str | None:
    """Why a private 64 MiB /dev/shm cannot be had here, or None if it can."""
    if not sys.platform.startswith("linux"):
        return f"needs Linux mount namespaces, this is {sys.platform}"
    if os.geteuid() != 0:
        return f"needs root to mount a private tmpfs on /dev/shm (euid is {os.geteuid()})"
    if shutil.which("unshare") is None:
        return "needs unshare(1) from util-linux, which is not on PATH"
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", MOUNT],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    if probe.returncode != 0:
        return f"cannot mount a private tmpfs on /dev/shm here: {probe.stderr.strip()!r}"
    return None


def _in_small_shm(command: str) -> None:
    """Run ``command`` (sh) in a private mount namespace with a 64 MiB tmpfs on /dev/shm."""
    reason = _why_no_small_shm()
    if reason is not None:
        pytest.skip(reason)
    package_root = pathlib.Path(aioloader.__file__).resolve().parent.parent  # this run's copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package_root), str(TESTS_DIR)])}
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", f"{MOUNT} && {command}"],
        cwd=REPO_DIR,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a hang is killed whole: the shell, loaders and workers
    )
    try:
        out, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the scenario ran past {BOUND_S} s:\n{out[-2000:]}\n{err[-4000:]}")
    assert proc.returncode == 0, f"{out[-2000:]}\n{err[-4000:]}"
    assert "Bus error" not in err
    assert "resource_tracker" not in err, err[-3000:]


def _run(mode: str, report: pathlib.Path) -> dict[str, Any]:
    _in_small_shm(f"exec {sys.executable} {SCRIPT} {mode} {report}")
    result: dict[str, Any] = json.loads(report.read_text())
    return result


def _inline_warnings(messages: list[str]) -> list[str]:
    return [m for m in messages if "travel inline" in m]


# -- for real: a private 64 MiB /dev/shm ------------------------------------------------------


def test_ranks_sharing_a_64mb_dev_shm_each_deliver_every_sample_once(
    tmp_path: pathlib.Path,
) -> None:
    ranks = int(os.environ.get("AIOLOADER_TEST_RANKS", RANKS))
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    reports = [tmp_path / f"rank{r}.json" for r in range(ranks)]
    starts = " ".join(
        f'{sys.executable} {SCRIPT} rank {report} {barrier} {ranks} & pids="$pids $!";'
        for report in reports
    )
    _in_small_shm(f'pids=""; {starts} rc=0; for p in $pids; do wait $p || rc=1; done; exit $rc')
    fallbacks = 0
    for report in reports:
        result = json.loads(report.read_text())
        for epoch in result["epochs"]:
            assert epoch["indices"] == list(range(SAMPLES))  # each once, in order
        rank_fallbacks = result["epochs"][-1]["fallbacks"]
        assert len(_inline_warnings(result["warnings"])) == min(rank_fallbacks, 1)
        fallbacks += rank_fallbacks
    # Each rank may use 48 MiB and holds ~25 MiB at the barrier: some had to go inline.
    assert fallbacks > 0


def test_a_dev_shm_filled_while_the_loader_runs_costs_no_batch(tmp_path: pathlib.Path) -> None:
    result = _run("fill", tmp_path / "fill.json")
    (epoch,) = result["epochs"]
    assert epoch["indices"] == list(range(SAMPLES))
    assert epoch["fallbacks"] > 0
    (warning,) = _inline_warnings(result["warnings"])
    assert "/dev/shm has 0 bytes free (ENOSPC)" in warning
    assert "--shm-size" in warning


def test_a_dev_shm_full_at_start_costs_no_batch(tmp_path: pathlib.Path) -> None:
    # 1 MiB left: the workers start, no batch of 2 MiB fits; the pre-flight check says so.
    result = _run("full", tmp_path / "full.json")
    (epoch,) = result["epochs"]
    assert epoch["indices"] == list(range(SAMPLES))
    assert any("/dev/shm has" in m and "available" in m for m in result["preflight"])


def test_a_dev_shm_without_a_byte_left_costs_no_batch(tmp_path: pathlib.Path) -> None:
    # Not a byte left: the workers start all the same (no lock or queue of theirs lives in
    # /dev/shm), the loader makes no slot pool, and every batch travels inline, said once.
    result = _run("brim", tmp_path / "brim.json")
    (epoch,) = result["epochs"]
    assert epoch["indices"] == list(range(SAMPLES))
    (warning,) = _inline_warnings(result["warnings"])
    assert "/dev/shm has 0 bytes free" in warning
    assert "--shm-size" in warning


# -- everywhere: failures injected into segment creation ----------------------------------------


class Images:
    """128 KiB per sample, each filled with its index: batches go through shared memory."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> Any:
        return np.full((128, 1024), i, dtype=np.uint8)


def _indices(batch: Any) -> list[int]:
    return [int(v) for v in batch[:, 0, 0].tolist()]


@no_worker_left_behind()
def test_no_room_to_reserve_a_segment_sends_batches_inline(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # /dev/shm fills up after two segments: the kernel refuses the third one's pages.
    real = os.posix_fallocate
    calls = {"n": 0}

    def filling_up(fd: int, offset: int, length: int) -> None:
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", filling_up)
    caplog.set_level(logging.WARNING, logger="aioloader.shm")
    with DataLoader(Images(), batch_size=2, num_workers=2, prefetch=4, timeout=BOUND_S) as loader:
        held = list(loader)  # every batch held: each needs a segment of its own
        stats = loader.statistics()
        assert [i for b in held for i in _indices(b)] == list(range(48))
    assert calls["n"] > 2
    # 24 batches: the first few travel inline anyway (the batch size is not known yet), two
    # get a slot, and the rest could not.
    assert stats.shm_fallbacks >= 24 - 4 - 2 - 4
    (warning,) = _inline_warnings([r.getMessage() for r in caplog.records])
    assert "ENOSPC" in warning


@no_worker_left_behind()
def test_a_segment_removed_behind_the_loaders_back_costs_no_batch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Every new segment is removed from /dev/shm before a worker opens it (as systemd-logind's
    # RemoveIPC or a cleanup script would): only our own segments, by the names we made. Those
    # the workers make for the first batches (their size unknown yet) go once the pool took
    # them over, with their batch already in them.
    real, real_adopt = SlotPool.lease, SlotPool.adopt

    def lease_then_lose(self: SlotPool, nbytes: int) -> Slot | None:
        slot = real(self, nbytes)
        if slot is not None:  # an adopted one leased again is gone already
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(_shm.SHM_DIR, slot.name))
        return slot

    def adopt_then_lose(self: SlotPool, name: str, size: int, reserved: int = 0) -> Slot:
        slot = real_adopt(self, name, size, reserved)
        os.unlink(os.path.join(_shm.SHM_DIR, name))
        return slot

    monkeypatch.setattr(SlotPool, "lease", lease_then_lose)
    monkeypatch.setattr(SlotPool, "adopt", adopt_then_lose)
    caplog.set_level(logging.WARNING, logger="aioloader.shm")
    with DataLoader(Images(), batch_size=4, num_workers=2, prefetch=4, timeout=BOUND_S) as loader:
        for _ in range(2):  # a second epoch: no removed segment is leased again
            seen = [i for batch in loader for i in _indices(batch)]
            assert seen == list(range(48))
        stats = loader.statistics()
    assert stats.shm_fallbacks >= 12  # all but the first few, made in the workers' segments
    assert stats.held_shm_slots == 0
    (warning,) = _inline_warnings([r.getMessage() for r in caplog.records])
    assert "is gone from /dev/shm" in warning
    assert "RemoveIPC" in warning


def test_a_removed_segment_is_named_with_its_likely_causes() -> None:
    pool = SlotPool(8 << 20)
    receiver = Receiver(pool, prefetch=2)
    try:
        slot = pool.lease(1 << 20)
        assert slot is not None
        os.unlink(os.path.join(_shm.SHM_DIR, slot.name))
        with pytest.raises(FileNotFoundError) as info:
            _shm.attach(slot)
        message = str(info.value)
        assert slot.name in message
        for cause in ("RemoveIPC", "cleanup script", "container restart"):
            assert cause in message
        # A worker in that place sends the batch inline and says why; the pool forgets it.
        parcel = Packer(slot).pack(np.arange(1 << 16))
        assert not parcel.in_slot
        assert parcel.slot_vanished
        assert "RemoveIPC" in parcel.slot_error
        made = receiver.open(Made(parcel, samples=1), slot)
        assert made.batch.tolist() == list(range(1 << 16))
        assert receiver.fallbacks == 1
        assert pool.stats().slots == 0  # never leased again
    finally:
        pool.close()
        _shm.detach_all()
