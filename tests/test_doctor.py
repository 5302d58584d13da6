"""``python -m aioloader doctor``: the checks fed made-up machines, the report, the exit code,
and the real command run as a subprocess on this machine."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from aioloader import _doctor
from aioloader.__main__ import main
from aioloader._doctor import Check, Facts, Status, TorchFacts
from aioloader._shm import BUDGET_FRACTION, BUDGET_MAX

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30
SECTIONS = (
    "python",
    "shared memory",
    "open files",
    "start methods",
    "uvloop",
    "cpus",
    "torch",
)

HEALTHY = Facts(
    python=(3, 11, 7),
    implementation="CPython",
    system="Linux",
    machine="x86_64",
    shm_total=32 * GiB,
    shm_free=32 * GiB,
    nofile_soft=65536,
    nofile_hard=65536,
    start_methods=("fork", "spawn", "forkserver"),
    python_default_method="fork",
    loader_method="forkserver",
    uvloop_version="0.21.0",
    cpu_count=8,
    cpu_affinity=8,
    cpu_quota=None,
    torch=TorchFacts(
        version="2.5.1+cu124",
        cuda_build="12.4",
        cuda_available=True,
        device_count=1,
        device_name="NVIDIA H100",
    ),
)
# What a stock `docker run` gives: 64 MiB of /dev/shm, 1024 open files, a CPU quota.
DOCKER = dataclasses.replace(
    HEALTHY,
    shm_total=64 * MiB,
    shm_free=64 * MiB,
    nofile_soft=1024,
    nofile_hard=1024,
    cpu_count=64,
    cpu_affinity=64,
    cpu_quota=4.0,
    torch=TorchFacts(version="2.5.1+cu124", cuda_build="12.4"),
)


def by_section(checks: list[Check]) -> dict[str, Check]:
    return {c.section: c for c in checks}


# -- shared memory -------------------------------------------------------------------------------


def test_dockers_64_mib_shm_warns_and_says_how_to_raise_it() -> None:
    check = _doctor.check_shm(64 * MiB, 64 * MiB)
    assert check.status is Status.WARN
    assert "--shm-size=16g" in check.fix
    assert "Kubernetes" in check.fix
    assert "16.0 MiB" in check.detail  # the loader's budget: a quarter of free


def test_a_large_shm_is_ok_and_the_budget_is_capped() -> None:
    check = _doctor.check_shm(64 * GiB, 60 * GiB)
    assert check.status is Status.OK
    assert check.fix == ""
    assert "budget 4.0 GiB" in check.detail


def test_a_large_but_full_shm_points_at_what_uses_it() -> None:
    check = _doctor.check_shm(8 * GiB, 100 * MiB)
    assert check.status is Status.WARN
    assert "in use" in check.fix
    assert "--shm-size" not in check.fix


def test_a_missing_shm_fails() -> None:
    check = _doctor.check_shm(None, None)
    assert check.status is Status.FAIL
    assert "shm_max_bytes=0" in check.fix
    assert _doctor.exit_code([check]) == 1


@pytest.mark.parametrize("free", [0, 64 * MiB, 1 * GiB, 16 * GiB, 100 * GiB])
def test_the_budget_is_the_loaders_rule(free: int) -> None:
    assert _doctor.shm_budget(free) == int(min(BUDGET_MAX, free * BUDGET_FRACTION))


def test_the_suggested_size_gives_the_full_budget() -> None:
    assert _doctor.shm_budget(_doctor.SHM_FULL_SIZE) == BUDGET_MAX


# -- open files ----------------------------------------------------------------------------------


def test_nofile_256_warns_and_suggests_ulimit_when_the_hard_limit_allows() -> None:
    check = _doctor.check_open_files(256, 524288)
    assert check.status is Status.WARN
    assert "ulimit -n 65536" in check.fix


def test_nofile_below_the_minimum_with_a_low_hard_limit_says_to_raise_the_hard_limit() -> None:
    check = _doctor.check_open_files(1024, 1024)
    assert check.status is Status.WARN
    assert "--ulimit nofile=65536:65536" in check.fix


def test_nofile_suggestion_never_exceeds_the_hard_limit() -> None:
    check = _doctor.check_open_files(1024, 8192)
    assert "ulimit -n 8192" in check.fix


@pytest.mark.parametrize(("soft", "hard"), [(4096, 4096), (65536, 1 << 20), (-1, -1)])
def test_nofile_at_or_above_the_minimum_is_ok(soft: int, hard: int) -> None:
    check = _doctor.check_open_files(soft, hard)
    assert check.status is Status.OK
    assert check.fix == ""


def test_unlimited_is_spelled_out() -> None:
    assert "unlimited" in _doctor.check_open_files(-1, -1).detail


# -- start methods, uvloop -----------------------------------------------------------------------


def test_forkserver_is_ok() -> None:
    check = _doctor.check_start_methods(["fork", "spawn", "forkserver"], "fork", "forkserver")
    assert check.status is Status.OK
    assert "workers use: forkserver" in check.detail
    assert "Python's default: fork" in check.detail


def test_spawn_only_warns_about_the_main_guard() -> None:
    check = _doctor.check_start_methods(["spawn"], "spawn", "spawn")
    assert check.status is Status.WARN
    assert "__name__ == '__main__'" in check.fix


def test_fork_warns() -> None:
    check = _doctor.check_start_methods(["fork"], "fork", "fork")
    assert check.status is Status.WARN
    assert "mp_context=" in check.fix


def test_uvloop_missing_warns_off_windows_only() -> None:
    assert _doctor.check_uvloop(None, system="Linux").status is Status.WARN
    assert "pip install uvloop" in _doctor.check_uvloop(None, system="Linux").fix
    assert _doctor.check_uvloop(None, system="Windows").status is Status.OK
    assert _doctor.check_uvloop("0.21.0", system="Linux").status is Status.OK


# -- cpus ----------------------------------------------------------------------------------------


def test_cpus_all_usable_is_ok() -> None:
    assert _doctor.check_cpus(8, 8, None).status is Status.OK
    assert _doctor.check_cpus(8, None, None).status is Status.OK  # no sched_getaffinity
    assert _doctor.check_cpus(None, None, None).status is Status.OK


def test_an_affinity_mask_smaller_than_the_machine_warns() -> None:
    check = _doctor.check_cpus(64, 4, None)
    assert check.status is Status.WARN
    assert "from 4 usable CPUs" in check.fix


def test_a_cgroup_quota_smaller_than_the_machine_warns() -> None:
    check = _doctor.check_cpus(64, 64, 2.5)
    assert check.status is Status.WARN
    assert "2.5 of 64" in check.detail
    assert "from 2 usable CPUs" in check.fix


def test_the_cgroup_quota_is_read_from_cpu_max(tmp_path: Path) -> None:
    path = tmp_path / "cpu.max"
    path.write_text("max 100000\n")
    assert _doctor._observe_cpu_quota(str(path)) is None
    path.write_text("250000 100000\n")
    assert _doctor._observe_cpu_quota(str(path)) == 2.5
    assert _doctor._observe_cpu_quota(str(tmp_path / "absent")) is None


# -- torch, python -------------------------------------------------------------------------------


def test_torch_missing_fails() -> None:
    check = _doctor.check_torch(TorchFacts(version=None))
    assert check.status is Status.FAIL
    assert check.fix == "pip install torch"


def test_torch_that_fails_to_import_fails_with_the_error() -> None:
    check = _doctor.check_torch(TorchFacts(version=None, error="OSError: libcudart.so.12"))
    assert check.status is Status.FAIL
    assert "libcudart" in check.detail


def test_old_torch_fails() -> None:
    assert _doctor.check_torch(TorchFacts(version="2.0.1")).status is Status.FAIL


def test_cpu_torch_is_ok() -> None:
    check = _doctor.check_torch(TorchFacts(version="2.5.1+cpu"))
    assert check.status is Status.OK
    assert "CPU build" in check.detail


def test_cuda_torch_without_a_visible_gpu_warns() -> None:
    check = _doctor.check_torch(TorchFacts(version="2.5.1", cuda_build="12.4"))
    assert check.status is Status.WARN
    assert "--gpus" in check.fix


def test_cuda_torch_with_a_gpu_is_ok() -> None:
    check = _doctor.check_torch(HEALTHY.torch)
    assert check.status is Status.OK
    assert "1 GPU(s) visible (NVIDIA H100)" in check.detail


def test_rocm_torch_is_named() -> None:
    facts = TorchFacts(version="2.5.1", hip_build="6.2", cuda_available=True, device_count=1)
    assert "ROCm 6.2 build" in _doctor.check_torch(facts).detail


def test_torch_is_not_imported_when_it_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert _doctor._observe_torch() == TorchFacts(version=None)


def test_old_python_fails() -> None:
    assert _doctor.check_python((3, 10, 12), "CPython", "Linux", "x86_64").status is Status.FAIL
    assert _doctor.check_python((3, 11, 0), "CPython", "Linux", "x86_64").status is Status.OK


# -- the whole report ----------------------------------------------------------------------------


def test_a_healthy_machine_is_all_ok() -> None:
    checks = _doctor.diagnose(HEALTHY)
    assert [c.section for c in checks] == list(SECTIONS)
    assert {c.status for c in checks} == {Status.OK}
    assert _doctor.exit_code(checks) == 0


def test_a_stock_container_warns_but_does_not_fail() -> None:
    checks = by_section(_doctor.diagnose(DOCKER))
    warned = {name for name, c in checks.items() if c.status is Status.WARN}
    assert warned == {"shared memory", "open files", "cpus", "torch"}
    assert _doctor.exit_code(list(checks.values())) == 0


def test_render_prints_each_check_its_fix_and_a_summary() -> None:
    checks = _doctor.diagnose(DOCKER)
    text = _doctor.render(checks, version="9.9")
    lines = text.splitlines()
    assert lines[0] == "aioloader 9.9 doctor"
    for check in checks:
        assert any(check.section in line and check.status.value in line for line in lines)
        if check.fix:
            assert f"fix: {check.fix}" in text
    assert lines[-1] == "3 ok, 4 warning(s), 0 failure(s)"


def test_observe_reads_this_machine() -> None:
    facts = _doctor.observe()
    assert facts.python == tuple(sys.version_info[:3])
    assert facts.loader_method in facts.start_methods
    assert facts.torch.version is not None  # torch is a dependency
    assert len(_doctor.diagnose(facts)) == len(SECTIONS)


# -- the command line ----------------------------------------------------------------------------


def test_help_lists_doctor(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "doctor" in capsys.readouterr().out


def test_no_command_prints_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    # `python -m aioloader` alone is what a newcomer types first: the help, not a usage error.
    assert main([]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith("usage: python -m aioloader")
    assert "doctor" in out


def test_python_m_aioloader_doctor_prints_every_section() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "aioloader", "doctor"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("aioloader "), proc.stdout + proc.stderr
    assert lines[0].endswith(" doctor"), proc.stdout
    for section in SECTIONS:
        assert any(
            line.split()[:1] in (["OK"], ["WARN"], ["FAIL"]) and f"  {section}  " in line
            for line in lines
        ), (section, proc.stdout)
    failed = any(line.split()[:1] == ["FAIL"] for line in lines)
    assert proc.returncode == (1 if failed else 0), proc.stdout + proc.stderr
    assert "failure(s)" in lines[-1]
