"""The one-command benchmark runner: its smoke run prints the ratio table and draws the chart.

``benchmarks/run_all.py --quick`` runs every benchmark (the GPU one only with CUDA) at a small
size, each in its own process through its ``--json`` output; these tests read what comes out.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

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
def test_run_all_quick_prints_the_table_and_draws_the_chart(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The runner's quick run, end to end but for one benchmark: warm and remote run, each in
    its own process, and every document becomes rows of one table, a chart and the JSON. The
    cold document is made by cold_start's own summary from runs of known times: the command
    run_all asks for is checked, and cold_start.py's quick run is the smoke test below (the
    same command, with a peer asked for); measured here too, it took a fifth of this test."""
    pytest.importorskip("matplotlib")
    run_all = load_run_all(monkeypatch)
    cold_start = load_benchmark(monkeypatch, "cold_start")
    measure = run_all.run_benchmark
    asked: list[list[str]] = []

    def run_benchmark(argv: list[str], timeout: float) -> dict[str, Any]:
        asked.append(argv)
        if argv[0] != "cold_start.py":
            document: dict[str, Any] = measure(argv, timeout)
            return document
        runs = {
            impl: [{"first_s": first_s, "rate": None, "import_s": 0.1}]
            for impl, first_s in (("aioloader", 0.05), ("torch", 0.2))
        }
        return {"benchmark": "cold_start", "rows": [cold_start.summarise("first", runs, {})]}

    monkeypatch.setattr(run_all, "run_benchmark", run_benchmark)
    assert run_all.main(["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert [argv[0] for argv in asked] == ["bench_loader.py", "cold_start.py", "remote_http.py"]
    assert asked[1][1:] == ["--only", "first", "--repeat", "1", "--peers"]
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


# -- the workloads people run, and the peers' micro-benchmarks (issue 40) ----------------------


def run_json(script: str, *argv: str, timeout: float = 110) -> tuple[dict[str, Any], str]:
    """``benchmarks/<script> *argv --json``: its document, and its table (on stderr)."""
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *argv, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return document, result.stderr


@pytest.mark.timeout(120)
def test_jpeg_pipeline_smoke_reports_rates_cpu_memory_and_the_ceiling(tmp_path: Path) -> None:
    doc, table = run_json(
        "jpeg_pipeline.py",
        *("--files", "24", "--batch", "8", "--epochs", "2", "--cache", str(tmp_path)),
        *("--loaders", "torch,aioloader", "--ceiling-s", "0.5"),
    )
    assert len(list((tmp_path / "jpeg-v1").glob("*.jpg"))) == 24  # the folder, made once
    assert doc["ceiling_img_s"] > 0
    # As many processes as CPUs decoding at once: each measured, their rates summed.
    assert doc["all_cores_img_s"] > 0
    assert all(c["all_cores_cpu_ms"] > 0 for c in doc["ceiling"])
    assert [(r["loader"], r["batch"], r["images"]) for r in doc["rows"]] == [
        ("torch", 8, 24),
        ("aioloader", 8, 24),
    ]
    for row in doc["rows"]:
        assert row["cold_img_s"] > 0
        assert row["warm_img_s"] > 0
        assert row["warm_cpu_ms"] > 0  # the tree's CPU: decoding 24 images costs some
        assert row["peak_pss_mb"] > 50  # the tree holds torch at least once
    assert doc["rows"][1]["verdict"]  # aioloader's own verdict on its warm epoch
    assert "| 8 | aioloader |" in table
    assert "warm / ceiling" in table
    assert "warm / all cores" in table


def test_jpeg_crop_follows_torchvisions_random_resized_crop(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    jpeg = load_benchmark(monkeypatch, "jpeg_pipeline")
    rng = random.Random(0)
    for width, height in [(640, 480), (400, 300), (300, 480)]:
        areas = []
        for _ in range(200):
            x0, y0, x1, y1 = jpeg.crop_box(width, height, rng)
            assert 0 <= x0 < x1 <= width
            assert 0 <= y0 < y1 <= height
            areas.append((x1 - x0) * (y1 - y0) / (width * height))
        assert min(areas) < 0.3 < 0.7 < max(areas)  # scale 0.08-1: small and large crops
    # No 3/4-4/3 crop of 8-100% of a 2000x100 image fits: the centre crop at ratio 4/3.
    assert jpeg.crop_box(2000, 100, rng) == (933, 0, 1066, 100)
    data = jpeg.make_image(3)
    assert 30_000 < len(data) < 300_000  # photo-like: tens of KB at quality 90, not noise
    (tmp_path / "x.jpg").write_bytes(data)
    sample = jpeg.load_sample(str(tmp_path / "x.jpg"), random.Random(0))
    assert tuple(sample.shape) == (3, 224, 224)
    assert str(sample.dtype) == "torch.uint8"


@pytest.mark.timeout(120)
def test_transport_smoke_reports_rates_consumer_cpu_and_memory() -> None:
    doc, table = run_json(
        "transport.py",
        *("--mib", "2", "--total-mib", "8", "--kinds", "numpy"),
        *("--loaders", "pipe,aioloader"),
    )
    rows = doc["rows"]
    assert [(r["loader"], r["kind"], r["mib"], r["items"]) for r in rows] == [
        ("pipe", "numpy", 2, 4),
        ("aioloader", "numpy", 2, 4),
    ]
    for row in rows:
        assert row["mb_s"] > 0
        assert row["consumer_cpu_s_per_gb"] >= 0
        assert row["pss_mb"] > 50
    assert "| numpy 2 MiB | aioloader |" in table


@pytest.mark.timeout(120)
def test_startup_size_smoke_times_the_first_batch_of_both_loaders() -> None:
    doc, table = run_json("startup_size.py", "--quick")
    assert {(r["loader"], r["mib"], r["workers"], r["method"]) for r in doc["rows"]} == {
        ("torch", 4, 1, "forkserver"),
        ("aioloader", 4, 1, "forkserver"),
    }
    assert all(r["first_batch_s"] > 0 and r["pss_mb"] > 50 for r in doc["rows"])
    assert "| forkserver | 4 | 1 |" in table


@pytest.mark.timeout(120)
def test_memory_breakdown_smoke_names_every_process_of_each_tree() -> None:
    doc, table = run_json("memory_breakdown.py", "--quick")
    by = {d["loader"]: d for d in doc["rows"]}
    assert set(by) == {"torch", "aioloader"}
    for loader, d in by.items():
        roles = [p["role"] for p in d["processes"]]
        assert roles[0] == "training process"
        assert roles.count("worker") == 2, (loader, roles)
        assert d["total_pss_mb"] == pytest.approx(sum(p["pss_mb"] for p in d["processes"]))
        for p in d["processes"]:
            parts = p["anon_mb"] + p["libs_mb"] + p["shm_mb"] + p["other_mb"]
            assert p["pss_mb"] == pytest.approx(parts)
    assert "worker server" in [p["role"] for p in by["aioloader"]["processes"]]
    assert "**tree**" in table


@pytest.mark.timeout(120)
def test_verdict_advice_smoke_follows_the_verdict_and_measures_again() -> None:
    doc, table = run_json("verdict_advice.py", "--case", "slow-reads")
    (row,) = doc["rows"]
    assert (row["case"], row["verdict"], row["knob"]) == ("slow-reads", "workers", "num_workers")
    assert row["tried"] == "num_workers=4"
    assert row["after"]["samples_per_s"] > 0
    assert row["ratio"] == pytest.approx(
        row["after"]["samples_per_s"] / row["before"]["samples_per_s"]
    )
    assert "| slow-reads | workers (num_workers) |" in table


def test_the_runner_turns_the_new_documents_into_ratio_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_all = load_run_all(monkeypatch)
    jpeg = {
        "files": 100,
        "ceiling_img_s": 400.0,
        "rows": [
            {
                "loader": "torch",
                "batch": 32,
                "warm_img_s": 200.0,
                "cold_img_s": 100.0,
                "warm_cpu_ms": 10.0,
                "peak_pss_mb": 300.0,
            },
            {
                "loader": "aioloader",
                "batch": 32,
                "warm_img_s": 380.0,
                "cold_img_s": 300.0,
                "warm_cpu_ms": 5.0,
                "peak_pss_mb": 250.0,
            },
            {
                "loader": "spdl",
                "batch": 32,
                "warm_img_s": 100.0,
                "cold_img_s": 50.0,
                "warm_cpu_ms": 20.0,
                "peak_pss_mb": 600.0,
            },
        ],
    }
    rows = {(r.measure, r.baseline): r for r in run_all.jpeg_rows(jpeg)}
    assert rows[("warm img/s", "torch")].ratio == pytest.approx(1.9)
    assert rows[("warm img/s", "torch")].others == {"spdl": pytest.approx(0.5)}
    assert rows[("CPU ms per image (tree)", "torch")].ratio == pytest.approx(2.0)  # lower: ahead
    assert rows[("CPU ms per image (tree)", "torch")].others == {"spdl": pytest.approx(0.5)}
    assert rows[("peak PSS (MB)", "torch")].ratio == pytest.approx(1.2)
    assert rows[("warm img/s", "machine ceiling")].ratio == pytest.approx(0.95)
    assert rows[("cold img/s", "machine ceiling")].ratio == pytest.approx(0.75)
    transport = {
        "rows": [
            {"loader": "pipe", "kind": "numpy", "mib": 8, "mb_s": 500.0},
            {"loader": "torch", "kind": "numpy", "mib": 8, "mb_s": 1000.0},
            {"loader": "aioloader", "kind": "numpy", "mib": 8, "mb_s": 4000.0},
            {"loader": "spdl", "kind": "numpy", "mib": 8, "mb_s": 2000.0},
        ]
    }
    pipe, torch_row = run_all.transport_rows(transport)
    assert (pipe.baseline, pipe.ratio, pipe.others) == ("pickle through a pipe", 8.0, {"spdl": 4.0})
    assert (torch_row.baseline, torch_row.ratio) == ("torch", 4.0)
    startup = {
        "rows": [
            {"loader": "torch", "mib": 128, "workers": 8, "method": "spawn", "first_batch_s": 20.0},
            {
                "loader": "aioloader",
                "mib": 128,
                "workers": 8,
                "method": "spawn",
                "first_batch_s": 0.8,
            },
        ]
    }
    (row,) = run_all.startup_rows(startup)
    assert (row.case, row.ratio) == ("128 MiB dataset, 8 workers, spawn", 25.0)
    memory = {
        "rows": [
            {"case": "large", "loader": "torch", "total_pss_mb": 280.0},
            {"case": "large", "loader": "aioloader", "total_pss_mb": 350.0},
        ]
    }
    (row,) = run_all.memory_rows(memory)
    assert row.ratio == pytest.approx(0.8)
    verdict = {
        "rows": [
            {
                "case": "remote",
                "verdict": "io",
                "knob": "io_concurrency",
                "tried": "io_concurrency=16",
                "before": {"samples_per_s": 100.0},
                "after": {"samples_per_s": 350.0},
                "ratio": 3.5,
            },
        ]
    }
    (row,) = run_all.verdict_rows(verdict)
    assert (row.case, row.measure, row.ratio) == (
        "remote: io (io_concurrency)",
        "samples/s with io_concurrency=16",
        3.5,
    )
