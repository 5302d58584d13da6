"""Every script in examples/ runs with its default arguments, in seconds, and prints what it
promises.

Each example runs in a subprocess as a user first runs it (``python examples/<name>.py``, no
argument), under :data:`TIMEOUT_S`; its defaults are sized to take seconds on 2 CPUs (issue #42:
a newcomer's first run must not take half an hour). The assertions read its output, not only its
exit status. A new example without a check here fails :func:`test_every_example_is_checked`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
#: The bound on one example's default run. They take seconds; this leaves room for a loaded
#: machine (two test processes on 2 CPUs) without letting a regression to minutes pass.
TIMEOUT_S = 50

#: Examples whose requirements this file does not set up, and the test that runs them.
ELSEWHERE = {
    "ddp_train.py": "needs torchrun and several ranks: tests/test_distributed.py runs it",
    "lightning_train.py": "needs PyTorch Lightning: tests/test_lightning.py runs it",
    "ray_actor.py": "needs a Ray cluster: tests/test_ray.py runs it on the session's",
}


def run_example(name: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        cwd=cwd,
    )
    return result


def ok(result: subprocess.CompletedProcess[str]) -> str:
    """The example's stdout, once it exited 0 and wrote nothing alarming to stderr."""
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "Warning" not in result.stderr, result.stderr
    return result.stdout


def numbers(pattern: str, text: str) -> list[float]:
    return [float(m.replace(",", "")) for m in re.findall(pattern, text)]


def check_quickstart() -> None:
    out = ok(run_example("quickstart.py"))
    assert re.search(r"epoch 0: 32 batches, 2048 samples in .* batches/s", out), out
    assert "event loop lag while loading: p50" in out
    assert "bottleneck" in out  # the statistics table


def check_remote_http() -> None:
    out = ok(run_example("remote_http.py"))
    losses = numbers(r"loss ([\d.]+)", out)
    assert len(losses) == 2, out
    assert losses[1] < losses[0], out
    assert "samples/s" in out


def check_why_slow() -> None:
    # The other cases are checked by tests/test_stats.py; the default one, "dataset", here.
    out = ok(run_example("why_slow.py"))  # --case dataset: the knob is num_workers
    assert "consumer waited" in out, out  # the table came first
    assert "verdict: workers (knob: num_workers)" in out, out
    assert "with num_workers turned up" in out, out


def check_train_small() -> None:
    out = ok(run_example("train_small.py"))
    losses = numbers(r"loss ([\d.]+)", out)
    assert len(losses) == 3, out
    assert losses[-1] < losses[0] - 0.1, f"the loss did not go down: {out}"
    assert len(numbers(r"([\d,]+) samples/s", out)) == 3, out
    assert out.splitlines()[-1].startswith("loader: "), out


def check_train_gpu() -> None:
    # On a machine with CUDA this trains on the GPU through the device stage; here, on the CPU,
    # at the size it picks without CUDA.
    out = ok(run_example("train_gpu.py"))
    wrong = numbers(r"wrong or missing samples (\d+)", out)
    assert wrong == [0, 0], out
    assert len(numbers(r"([\d,]+) samples/s", out)) == 2, out
    assert out.splitlines()[-1].startswith("loader: "), out


def check_orchestrator() -> None:
    out = ok(run_example("orchestrator.py"))
    assert len(re.findall(r"eval of version \d+: accuracy \d+%", out)) >= 2, out
    assert len(re.findall(r"train epoch \d: mean loss", out)) == 2, out
    busy = re.search(
        r"while training and evaluating .*: (\d+) answers, lag p50 .* p99 ([\d.]+)", out
    )
    assert busy is not None, out
    assert int(busy[1]) > 0
    # The loader never blocks the loop: a stall for a whole epoch would show here in seconds.
    assert float(busy[2]) < 1000, out


def check_resume(tmp_path: Path) -> None:
    common = ("--checkpoint", str(tmp_path / "state.pt"))  # the defaults otherwise
    whole = ok(run_example("resume.py", *common))
    stopped = run_example("resume.py", *common, "--stop-after", "21")
    assert stopped.returncode == 3, stopped.stdout + stopped.stderr
    assert "stopped in epoch 1 after 21 batches (5 of 16 in this epoch)" in stopped.stdout
    resumed = ok(run_example("resume.py", *common, "--resume"))
    assert "resumed in epoch 1 after 21 batches: 11 left in this epoch" in resumed, resumed
    assert "epoch 1: 11 batches after the resume" in resumed, resumed

    def checksums(out: str) -> list[str]:
        return re.findall(r"(?:batches|weights) checksum: ([0-9a-f]+)", out)

    assert len(checksums(whole)) == 2, whole
    assert checksums(resumed) == checksums(whole), (whole, resumed)
    assert "32 batches in 2 epochs" in resumed


def check_migrate_from_torch() -> None:
    out = ok(run_example("migrate_from_torch.py"))
    equal = "16 batches in 2 epochs; equal to torch's, epoch by epoch: [True, True]"
    assert f"aioloader (for): {equal}" in out, out
    assert f"aioloader (async for): {equal}" in out, out
    assert "torch: 16 batches" in out


def check_migrate_from_gluon() -> None:
    out = ok(run_example("migrate_from_gluon.py"))
    assert (
        "last_batch='keep'      batch sizes per epoch: 4 4 2; 4 4 2; 4 4 2  (Gluon's rule: True)"
        in out
    ), out
    assert (
        "last_batch='discard'   batch sizes per epoch: 4 4; 4 4; 4 4  (Gluon's rule: True)" in out
    ), out
    # 10 samples: 2 left over, then 12 (3 batches), then 10 again.
    assert (
        "last_batch='rollover'  batch sizes per epoch: 4 4; 4 4 4; 4 4  (Gluon's rule: True)" in out
    ), out


CHECKS: dict[str, Callable[..., None]] = {
    "migrate_from_gluon.py": check_migrate_from_gluon,
    "migrate_from_torch.py": check_migrate_from_torch,
    "orchestrator.py": check_orchestrator,
    "quickstart.py": check_quickstart,
    "remote_http.py": check_remote_http,
    "resume.py": check_resume,
    "train_gpu.py": check_train_gpu,
    "train_small.py": check_train_small,
    "why_slow.py": check_why_slow,
}


def example_names() -> list[str]:
    return sorted(p.name for p in EXAMPLES.glob("*.py"))


def test_every_example_is_checked() -> None:
    unchecked = set(example_names()) - CHECKS.keys() - ELSEWHERE.keys()
    assert not unchecked, f"add a check to tests/test_examples.py for {sorted(unchecked)}"


#: Examples that take more than a few seconds (several runs, or worker processes).
SLOW = {"resume.py"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in example_names()],
)
def test_example_runs(name: str, tmp_path: Path) -> None:
    if name in ELSEWHERE:
        pytest.skip(ELSEWHERE[name])
    check = CHECKS[name]
    if name == "resume.py":
        check(tmp_path)
    else:
        check()
