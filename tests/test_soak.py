"""The soak (RELIABILITY.md row 21): epochs with a SIGKILL, a SIGSEGV, a collate error, a hang
past the deadline, a consumer that gives up and a ``break`` injected (see ``soak``), ending with
nothing above the leak baseline and every epoch's index checksum exact.

The default run soaks a few epochs. ``AIOLOADER_SOAK=full`` runs the full soak (20 epochs, RSS
growth of the main process under 5% from epoch 2 to 20) in a fresh interpreter through
``tests/scripts/full_soak.py``, which prints its figures; the script also runs on its own::

    AIOLOADER_SOAK=full pytest -n 0 -s tests/test_soak.py   # or: python tests/scripts/full_soak.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import soak
from helpers import Baseline

TESTS = Path(__file__).resolve().parent
FULL = os.environ.get("AIOLOADER_SOAK") == "full"


async def test_a_short_soak_stays_exact_and_leaves_nothing(
    tmp_path: Path, baseline: Baseline
) -> None:
    figures = await soak.run_soak(4, str(tmp_path))
    assert figures.epochs == 4
    assert figures.broken_epochs == 1
    assert figures.faults == {
        "sigkill": 4,
        "sigsegv": 4,
        "collate": 4,
        "hang": 4,
        "cancel": 4,
        "break": 1,
    }


@pytest.mark.skipif(not FULL, reason="the full soak runs with AIOLOADER_SOAK=full")
@pytest.mark.timeout(600)
def test_the_full_soak(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, str(TESTS / "scripts" / "full_soak.py"), "--epochs", "20"],
        capture_output=True,
        text=True,
        env=env,
        timeout=570,
        check=False,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resource_tracker" not in proc.stderr, proc.stderr
    assert "leaked" not in proc.stderr, proc.stderr
