"""The one-command benchmark runner: its smoke run prints the ratio table and draws the chart.

``benchmarks/run_all.py --quick`` runs every benchmark (the GPU one only with CUDA) at a small
size, each in its own process through its ``--json`` output; these tests read what comes out.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
HEADER = "| benchmark | case | measure | baseline | baseline value | aioloader | ratio |"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_benchmark(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (benchmarks/ is not a package), for this test only;
    the modules it imports by name (other_loaders) come from benchmarks/ too."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def load_run_all(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark(monkeypatch, "run_all")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_all_quick_prints_the_table_and_draws_the_chart(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = result.stdout
    # Other loaders, where installed, add a column each after aioloader's ratio.
    assert any(line.startswith(HEADER.removesuffix(" |")) for line in out.splitlines()), out
    rows = [line for line in out.splitlines() if re.match(r"\| (warm|cold|remote|gpu) \|", line)]
    kinds = {row.split("|")[1].strip() for row in rows}
    assert {"warm", "cold", "remote"} <= kinds, out
    for row in rows:
        ratio = row.split("|")[7].strip()
        assert re.fullmatch(r"[\d.]+(e-\d+)?x", ratio), row
        assert float(ratio[:-1]) > 0, row
    # remote: against torch's DataLoader (2 workers) and against the bare aiohttp loop.
    assert any("torch DataLoader, workers=2" in row for row in rows), out
    assert any("bare aiohttp loop" in row for row in rows), out

    chart = tmp_path / "ratios.png"
    assert chart.read_bytes()[:8] == PNG_MAGIC
    assert chart.stat().st_size > 10_000  # a drawn chart, not an empty canvas
    record = json.loads((tmp_path / "results.json").read_text())
    assert len(record["rows"]) == len(rows)
    assert set(record["benchmarks"]) >= {"warm", "cold", "remote"}
    assert (tmp_path / "results.md").read_text().count("\n| ") == len(rows) + 1  # + separator


def test_run_all_without_matplotlib_stops_at_once_and_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_all = load_run_all(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec: not importable
    assert run_all.main(["--quick", "--out", str(tmp_path)]) == 2
    message = capsys.readouterr().err
    assert "pip install 'aioloader[plot]'" in message
    assert "--no-plot" in message
    assert not list(tmp_path.iterdir())  # nothing was measured or written


def test_gpu_transfer_json_says_it_skipped_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the quick run measures it")
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_transfer.py"), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"benchmark": "gpu_transfer", "skipped": "no CUDA device"}
    assert "no CUDA device is available" in result.stderr


@pytest.mark.timeout(120)
def test_tar_shards_quick_run_reports_rates_ceiling_and_ratios(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "tar_shards.py"),
            "--quick",
            "--json",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(result.stdout)
    assert document["benchmark"] == "tar_shards"
    rates = document["samples_per_s"]
    assert rates["aioloader"] > 0
    assert rates["bare"] > 0
    assert document["latency_ceiling_samples_per_s"] > 0
    assert document["ratios"]["ceiling"] > 0
    for name in rates:  # each run's CPU time per sample, by process, and their sum
        cpu = document["cpu_us_per_sample"][name]
        assert set(cpu) == {"server", "main", "workers", "total"}
        assert cpu["total"] == pytest.approx(cpu["server"] + cpu["main"] + cpu["workers"])
    if importlib.util.find_spec("webdataset") is None:
        assert "webdataset is not installed: skipped" in result.stderr
        assert "webdataset" not in rates
    else:
        assert document["ratios"]["webdataset"] > 0
    assert "latency ceiling" in (tmp_path / "tar_shards.md").read_text()
    assert json.loads((tmp_path / "tar_shards.json").read_text()) == document


@pytest.mark.timeout(120)
def test_cold_start_runs_the_other_loaders_in_fresh_processes_beside_torch() -> None:
    # The cheapest other loader (seqtools forks its workers; the others start forkservers),
    # or none where it is not installed: the run says it skipped it.
    has_seqtools = importlib.util.find_spec("seqtools") is not None
    result = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "cold_start.py"),
            *("--only", "first", "--repeat", "1", "--peers", "seqtools", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(result.stdout)
    (row,) = document["rows"]
    assert row["workload"] == "first"
    assert row["samples_per_s"] is None  # "first" stops at the first batch
    expected = {"torch", "aioloader", *(["seqtools"] if has_seqtools else [])}
    assert set(row["first_batch_s"]) == expected
    assert all(seconds > 0 for seconds in row["first_batch_s"].values())
    assert row["fastest_first_peer"] in expected - {"aioloader"}
    assert row["first_ratio_to_fastest_peer"] > 0
    assert "| workload | torch | aioloader |" in result.stderr
    if not has_seqtools:
        assert "seqtools: not installed" in result.stderr


def test_cold_start_best_other_loader_and_its_rows_in_the_runner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cold_start = load_benchmark(monkeypatch, "cold_start")
    run_all = load_run_all(monkeypatch)

    def runs(*pairs: tuple[float, float]) -> list[dict[str, float | None]]:
        return [{"first_s": first, "rate": rate, "import_s": 0.0} for first, rate in pairs]

    row = cold_start.summarise(
        "W1 w0",
        {
            "aioloader": runs((0.1, 900.0), (0.3, 1000.0), (0.2, 1100.0)),  # median 0.2, 1000
            "torch": runs((1.0, 250.0), (1.0, 300.0), (1.0, 200.0)),
            "spdl": runs((0.05, 800.0), (0.05, 800.0), (0.05, 800.0)),
            "seqtools": runs((0.1, 1250.0), (0.1, 1250.0), (0.1, 1250.0)),
            "torchdata": runs((0.1, 1e6)),  # failed later: left out of the workload
            "bare": [{"first_s": None, "rate": 2000.0, "import_s": 0.0}],
        },
        {"torchdata": "torchdata W1 w0 failed: RuntimeError"},
    )
    assert row["first_batch_s"] == {"aioloader": 0.2, "torch": 1.0, "spdl": 0.05, "seqtools": 0.1}
    assert "torchdata" not in row["samples_per_s"]
    assert (row["best_peer"], row["best_peer_samples_per_s"]) == ("seqtools", 1250.0)
    assert row["ratio_to_best_peer"] == pytest.approx(0.8)
    assert (row["fastest_first_peer"], row["first_ratio_to_fastest_peer"]) == ("spdl", 0.25)
    assert row["ratio_to_ceiling"] == pytest.approx(0.5)  # the bare loop is no "other loader"
    line = cold_start.cells(row, ["torch", "aioloader", "torchdata", "spdl", "seqtools", "bare"])
    assert line.startswith("| W1 w0 (torch w8) | 1,000 ms, 250/s | 200 ms, 1,000/s | failed |")
    assert "| seqtools 1,250/s | 0.80x | 0.25x (spdl) |" in line

    rows = run_all.cold_rows({"rows": [row]})
    assert [(r.measure, r.baseline) for r in rows] == [
        ("first batch (ms)", "torch"),
        ("samples/s from construction", "torch"),
        ("samples/s from construction", "best other: seqtools"),
        ("samples/s from construction", "bare aiohttp loop"),
    ]
    assert rows[0].case == "W1 w0 (torch w8)"
    assert rows[0].others == {"spdl": 20.0, "seqtools": 10.0}  # torch's time over theirs
    assert rows[1].ratio == pytest.approx(4.0)
    assert rows[1].others == {"spdl": pytest.approx(3.2), "seqtools": 5.0}
    assert rows[2].ratio == pytest.approx(0.8)
    assert rows[3].ratio == pytest.approx(0.5)


def test_server_latency_jitter_spreads_every_wait_over_its_range_around_the_same_mean() -> None:
    # W1's second server (cold_start's "W1 w0 jitter"): the same mean wait, spread uniformly
    # over latency * (1 +- jitter), the same draws every run; without jitter, every wait equal.
    from http_server import FaultServer

    steady = FaultServer(latency=0.02)
    assert {steady.next_latency() for _ in range(100)} == {0.02}
    spread = [FaultServer(latency=0.02, jitter=0.25).next_latency() for _ in range(2)]
    assert spread[0] == spread[1]  # seeded: runs see the same waits
    server = FaultServer(latency=0.02, jitter=0.25)
    waits = [server.next_latency() for _ in range(2000)]
    assert all(0.015 <= w <= 0.025 for w in waits)
    assert min(waits) < 0.0155  # reaches both ends
    assert max(waits) > 0.0245
    assert sum(waits) / len(waits) == pytest.approx(0.02, rel=0.02)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=rf"jitter must be from 0 to 1, got {bad}"):
            FaultServer(jitter=bad)
