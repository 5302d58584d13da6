"""The packaging promises that nothing else checks: one version source, extras split by need
with no development tool in any of them, and CI running the README's test command and its
documentation build verbatim."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path
from typing import Any

import aioloader

ROOT = Path(__file__).resolve().parent.parent
DEV_TOOLS = {"pytest", "pytest-timeout", "hypothesis", "psutil", "moto", "mypy", "ruff"}


def _pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _name(requirement: str) -> str:
    """The distribution name of a requirement string, without extras, versions or markers."""
    match = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    assert match is not None, requirement
    return match.group(0).lower()


def _extra(extras: dict[str, list[str]], name: str) -> set[str]:
    """The distributions an extra installs, following `aioloader[...]` self-references."""
    names: set[str] = set()
    for requirement in extras[name]:
        inner = re.fullmatch(r"aioloader\[([^\]]+)\]", requirement)
        if inner is None:
            names.add(_name(requirement))
        else:
            for other in inner.group(1).split(","):
                names |= _extra(extras, other.strip())
    return names


def test_the_version_is_written_once_as_a_literal_setuptools_can_read() -> None:
    project = _pyproject()
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "aioloader.__version__"
    # setuptools reads the value from the syntax tree without importing the package (which
    # needs numpy and torch, absent from the build environment): it must stay a plain literal.
    tree = ast.parse((ROOT / "aioloader" / "__init__.py").read_text())
    literals = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
    ]
    assert literals == [aioloader.__version__]


def test_license_is_an_spdx_expression_with_the_text_shipped() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License")
    assert "END OF TERMS AND CONDITIONS" in text


def test_extras_are_split_by_need_and_remote_is_their_union() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    assert set(extras) == {
        "http",
        "fsspec",
        "s3",
        "progress",
        "plot",
        "parquet",
        "remote",
        "test-frameworks",
        "docs",
        "ray",
        "bench",
    }
    assert _extra(extras, "http") == {"aiohttp"}
    assert _extra(extras, "fsspec") == {"fsspec"}
    assert _extra(extras, "s3") == {"fsspec", "s3fs"}
    assert _extra(extras, "progress") == {"tqdm"}
    assert _extra(extras, "plot") == {"matplotlib"}
    assert _extra(extras, "parquet") == {"pyarrow"}
    assert _extra(extras, "remote") == {"aiohttp", "fsspec", "s3fs"}
    assert _extra(extras, "ray") == {"ray"}
    # What the integration tests run the loader under (the package imports neither).
    assert _extra(extras, "test-frameworks") == {"lightning", "accelerate"}
    # What builds the documentation site (docs/conf.py).
    assert _extra(extras, "docs") == {"sphinx", "myst-parser", "furo"}
    # What benchmarks/ runs beside the loader: the JPEG decoder, the memory columns, the peers.
    assert _extra(extras, "bench") == {"pillow", "psutil", "torchdata", "spdl"}


def test_no_published_extra_carries_a_development_tool() -> None:
    extras = _pyproject()["project"]["optional-dependencies"]
    for name in extras:
        # The benchmarks read every process's memory with psutil: there it is what is measured
        # with, not a tool of the test suite.
        allowed = {"psutil"} if name == "bench" else set()
        assert (_extra(extras, name) - allowed).isdisjoint(DEV_TOOLS), name


def test_development_requirements_list_every_tool() -> None:
    lines = [
        line.split("#")[0].strip()
        for line in (ROOT / "requirements-dev.txt").read_text().splitlines()
    ]
    names = {_name(line) for line in lines if line and not line.startswith("-")}
    assert names >= DEV_TOOLS


def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    after = readme.split("The tests (", 1)[1]
    block = after.split("```sh\n", 1)[1].split("```", 1)[0]
    lines = block.strip().splitlines()
    assert len(lines) == 1, "the README's test command is one line a new user copies"
    return lines[0]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    command = _readme_test_command()
    assert "requirements-dev.txt" in command
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    # Verbatim, then the guard that makes a failure inside the && list fail the run: set -e
    # does not stop there, and a lint error would skip the tests and still pass.
    [line] = [line for line in ci_lines if line.startswith(command)]
    assert line.startswith(command + " || {"), line
    assert line.endswith("exit 1; }"), line


def test_ci_builds_the_documentation_as_the_readme_says() -> None:
    readme = (ROOT / "README.md").read_text()
    after = readme.split("## Documentation", 1)[1]
    command = after.split("```sh\n", 1)[1].split("```", 1)[0].strip()
    assert command.startswith(".venv/bin/sphinx-build -W "), command  # strict: warnings fail
    ci = (ROOT / ".ci" / "run").read_text()
    tests_at = ci.index("the README's test command failed")
    assert ci.index("\n" + command + "\n") > tests_at, "the build runs after the tests"
    # The development requirements install what the build needs.
    dev = (ROOT / "requirements-dev.txt").read_text()
    [project] = [line for line in dev.splitlines() if line.startswith("-e .[")]
    assert "docs" in project.split("[", 1)[1].rstrip("]").split(",")
