"""The documentation cannot rot: the site builds strictly, every page and internal link of it
resolves, every public name has a reference entry, and every Python block runs.

- The site (``docs/``) is built once per test session with the command ``.ci/run`` uses
  (:data:`BUILD`: ``-W`` makes a warning an error, ``-n`` a reference that resolves to nothing a
  warning). Under pytest-xdist the test processes share that one build through a lock file.
- The built HTML is then read back: every Markdown page has its page, every internal ``href``
  and ``src`` names a file that exists and, after a ``#``, an ``id`` that exists in it.
- Every name in ``aioloader.__all__`` and ``aioloader.sources.__all__`` has an entry (an
  ``id`` of its dotted name) in the API reference.
- Every fenced ``python`` block of the README and of the pages runs, each in a subprocess of its
  own under :data:`BLOCK_TIMEOUT_S`, with warnings shown and none allowed. Top-level ``await``
  and ``async with`` run on an event loop. A block that cannot run here (it needs a GPU, a
  cluster, a network) is preceded by a visible marker, ``<!-- not-runnable: the reason -->``,
  and the reason is required.
"""

from __future__ import annotations

import fcntl
import html.parser
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

import aioloader
import aioloader.sources

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 200

#: The strict build, as ``.ci/run`` runs it (the output directory is appended).
BUILD = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html"]
#: A build takes seconds; this bounds one on a loaded 2-core machine.
BUILD_TIMEOUT_S = 150
#: Each block is an example sized to take seconds; the bound leaves room for a loaded machine.
BLOCK_TIMEOUT_S = 45

NOT_RUNNABLE = re.compile(r"<!-- not-runnable: (?P<reason>.*?) -->")
FENCE = re.compile(r"^(?P<fence>`{3,})(?P<info>[^`]*)$")

# Runs one block as the __main__ module: a block with top-level await (``async with`` in a
# guide) is compiled as a coroutine and run on the loop aioloader.run gives a program.
RUNNER = """\
import ast, pathlib, sys, types
path, label = sys.argv[1], sys.argv[2]
code = compile(pathlib.Path(path).read_text(), label, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
main = sys.modules["__main__"]
if code.co_flags & 0x80:  # inspect.CO_COROUTINE: the block awaits at its top level
    import aioloader
    aioloader.run(types.FunctionType(code, vars(main))())
else:
    exec(code, vars(main))
"""


# -- the blocks -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_runnable: str | None  # the reason given by the marker before it, if any

    @property
    def label(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def markdown_files() -> list[Path]:
    pages = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)
    return [README, *pages]


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the not-runnable marker before it."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, language = opening["fence"], opening["info"].strip().split(" ")[0]
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), len(lines))
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUNNABLE.fullmatch(previous.strip())
        code = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(path, i + 1, language, code, marker["reason"] if marker else None))
        i = end + 1
    return found


def python_blocks() -> list[Block]:
    return [b for path in markdown_files() for b in blocks_of(path) if b.language == "python"]


def test_markers_stand_before_python_blocks_and_give_a_reason() -> None:
    python = {(b.path, b.line) for b in python_blocks()}
    for path in markdown_files():
        lines = path.read_text().splitlines()
        fences = {(b.path, b.line): b for b in blocks_of(path)}
        for number, line in enumerate(lines, 1):
            if "not-runnable" not in line:
                continue
            marker = NOT_RUNNABLE.fullmatch(line.strip())
            where = f"{path.relative_to(ROOT)}:{number}"
            assert marker is not None, f"{where}: write <!-- not-runnable: the reason -->"
            assert len(marker["reason"].split()) >= 3, f"{where}: the reason is missing"
            following = [key for key in fences if key[1] > number]
            assert following, f"{where}: no block follows the marker"
            assert min(following, key=lambda k: k[1]) in python, (
                f"{where}: the marker does not stand before a python block"
            )


def test_the_block_parser_reads_fences_and_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n<!-- not-runnable: needs a GPU here -->\n"
        "```python\nimport cuda\n```\n\n````markdown\n```python\nnested\n```\n````\n"
    )
    found = blocks_of(page)
    assert [(b.line, b.language, b.not_runnable) for b in found] == [
        (3, "python", None),
        (8, "python", "needs a GPU here"),
        (12, "markdown", None),
    ]
    assert found[0].code == "x = 1\n"


def test_the_readme_is_read_in_five_minutes() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_the_readme_links_name_files_that_exist() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    local = [link for link in links if not urlsplit(link).scheme]
    assert local, "the README links into the documentation"
    for link in local:
        target = ROOT / unquote(urlsplit(link).path)
        assert target.exists(), f"README.md links to {link}, which does not exist"


def run_block(code: str, label: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run one block in a fresh interpreter, as the ``__main__`` module, warnings shown."""
    source = cwd / "block.py"
    source.write_text(code)
    return subprocess.run(
        [sys.executable, "-W", "default", "-c", RUNNER, str(source), label],
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
        check=False,
        cwd=cwd,  # a block that writes files writes them here
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: b.label)
def test_every_python_block_runs(block: Block, tmp_path: Path) -> None:
    if block.not_runnable is not None:
        pytest.skip(block.not_runnable)
    result = run_block(block.code, block.label, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{block.label} failed:\n{output}"
    assert "Warning" not in result.stderr, f"{block.label} warned:\n{result.stderr}"


def test_the_runner_awaits_at_top_level_and_reports_a_failing_block(tmp_path: Path) -> None:
    awaited = run_block(
        "import asyncio\nawait asyncio.sleep(0)\nprint(asyncio.get_running_loop() is not None)\n",
        "page.md:3",
        tmp_path,
    )
    assert (awaited.returncode, awaited.stdout) == (0, "True\n"), awaited.stderr
    failing = run_block("x = 1\nraise ValueError('boom')\n", "page.md:9", tmp_path)
    assert failing.returncode != 0
    assert 'File "page.md:9", line 2' in failing.stderr, failing.stderr  # names the block
    assert "ValueError: boom" in failing.stderr


# -- the built site -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built strictly once per session: the first test process to get here builds
    it, under a lock in the directory all pytest-xdist processes share; the others wait and
    read the result."""
    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each process has its own base directory inside the session's; alone,
    # the base directory is the session's (its parent holds earlier sessions' too).
    shared = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base
    out = shared / "docs-html"
    report = shared / "docs-build.txt"
    with (shared / "docs-build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not report.exists():
                result = subprocess.run(
                    [*BUILD, "-d", str(shared / "docs-doctrees"), str(DOCS), str(out)],
                    capture_output=True,
                    text=True,
                    timeout=BUILD_TIMEOUT_S,
                    check=False,
                    cwd=ROOT,
                )
                report.write_text(f"{result.returncode}\n{result.stdout}{result.stderr}")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    status, _, output = report.read_text().partition("\n")
    assert status == "0", f"the strict documentation build failed:\n{output}"
    return out


class _Page(html.parser.HTMLParser):
    """The ids a built page defines and the local links it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id":
                self.ids.add(value)
            elif (name, tag) in {("href", "a"), ("href", "link"), ("src", "img")}:
                self.links.append(value)


def read_page(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    return page


def pages_of(site: Path) -> Iterator[Path]:
    for path in sorted(site.rglob("*.html")):
        if "_static" not in path.relative_to(site).parts:
            yield path


@pytest.mark.timeout(BUILD_TIMEOUT_S + 30)
def test_every_page_is_built(site: Path) -> None:
    for page in markdown_files()[1:]:
        built = site / page.relative_to(DOCS).with_suffix(".html")
        assert built.exists(), f"{page.relative_to(ROOT)} has no page in the built site"


def broken_links(site: Path) -> tuple[int, list[str]]:
    """How many local links and image sources the built pages make, and those that name a
    file or an anchor that does not exist."""
    parsed = {path.resolve(): read_page(path) for path in pages_of(site)}
    broken: list[str] = []
    checked = 0
    for path, page in parsed.items():
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc:
                continue  # another site: not this build's business
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            checked += 1
            where = f"{path.relative_to(site.resolve())}: {link}"
            if not target.exists():
                broken.append(f"{where} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else read_page(target).ids
                if parts.fragment not in ids:
                    broken.append(f"{where} (no such anchor)")
    return checked, broken


@pytest.mark.timeout(BUILD_TIMEOUT_S + 30)
def test_every_internal_link_resolves(site: Path) -> None:
    checked, broken = broken_links(site)
    assert checked > 100, f"only {checked} internal links: is the site empty?"
    assert not broken, "\n".join(broken)


def test_the_link_checker_finds_missing_pages_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "guides").mkdir()
    (tmp_path / "guides" / "b.html").write_text('<h2 id="x">x</h2><a href="#x">self</a>')
    (tmp_path / "a.html").write_text(
        '<a href="guides/b.html#x">ok</a> <a href="guides/b.html#gone">anchor</a> '
        '<a href="c.html">page</a> <img src="pic.png"> <a href="https://example.org/">out</a>'
    )
    checked, broken = broken_links(tmp_path)
    assert checked == 5  # four of a.html (not the other site's), one of b.html
    assert sorted(broken) == [
        "a.html: c.html (no such file)",
        "a.html: guides/b.html#gone (no such anchor)",
        "a.html: pic.png (no such file)",
    ]


@pytest.mark.timeout(BUILD_TIMEOUT_S + 30)
def test_every_public_name_has_a_reference_entry(site: Path) -> None:
    ids: set[str] = set()
    for path in (site / "api").rglob("*.html"):
        ids |= read_page(path).ids
    missing = [
        f"{module.__name__}.{name}"
        for module in (aioloader, aioloader.sources)
        for name in module.__all__
        if f"{module.__name__}.{name}" not in ids
    ]
    assert not missing, f"public names without an entry in docs/api/: {missing}"
