"""A smoke run of ``benchmarks/ray_workers.py`` on the session's Ray cluster: it prints the
table of Ray actors against local worker processes, Ray Data and bare Ray calls, with ratios,
and where the CPU went per batch."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "ray_workers.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_benchmark_prints_ratios_against_local_workers_and_ray_data(ray_cluster: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--json",
            "--sizes=1MB",
            "--num-cpus=0.25",
            f"--address={ray_cluster}",
        ],
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    row = next(line for line in lines if line.startswith("| 1MB |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert re.fullmatch(r"[\d.]+x", cells[3]), row  # ray / local
    assert re.fullmatch(r"[\d.]+x", cells[5]), row  # ray / ray data
    assert re.fullmatch(r"[\d.]+x", cells[7]), row  # bare ray / local
    assert re.fullmatch(r"[+-][\d.]+ ms", cells[9]), row  # added p50 latency
    cpu_row = next(line for line in lines if line.startswith("| 1MB | ray actors |"))
    cpu_cells = [cell.strip() for cell in cpu_row.strip("|").split("|")]
    assert all(re.fullmatch(r"[\d.]+", cell) for cell in cpu_cells[2:]), cpu_row
    # The JSON rows are the benchmark's last own line; Ray may print after it (a message of
    # another node's raylet, ended meanwhile by another test, reaches every driver).
    (record,) = json.loads(next(line for line in reversed(lines) if line.startswith("[")))
    assert record["size"] == "1MB"
    assert min(record["local_sps"], record["ray_sps"], record["data_sps"], record["bare_sps"]) > 0
    assert record["ray_cpu_ms"]["workers"] > 0  # the actors' CPU, found by their pids
    assert record["vs_local"] == pytest.approx(record["ray_sps"] / record["local_sps"])
