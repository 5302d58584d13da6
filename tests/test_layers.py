"""The package's structure, checked from the source with ``ast``, so it stays true; and the
module map on the architecture page (``docs/architecture.md``), rendered from the same tables,
so the two cannot drift.

- Every top-level module or package (a *unit*) has a level in :data:`LEVELS` and imports only
  units of lower levels. A unit outside a package enters it through its ``__init__`` (the
  package's facade), never through one of its modules.
- Every module inside a package has a level in :data:`PACKAGE_LEVELS`, and imports only modules
  of lower levels of the same package; the package's ``__init__`` stands above them all.
- No import cycle, counting imports inside functions (only ``if TYPE_CHECKING:`` blocks are
  left out: they never run).
- No module uses another module's private names: neither ``from .x import _name`` nor
  ``x._name`` on an imported module of ours.
- No module is over :data:`MAX_CODE_LINES` lines of code (docstrings, comments and blank lines
  not counted). Size follows cohesion; this is only the alarm for a room that grew two jobs.

``python tests/test_layers.py`` rewrites the architecture page's module map from these tables
and the modules' docstrings; :func:`test_the_architecture_map_is_the_enforced_one` fails until
it is run.

Each rule is also run against a small synthetic package, to prove the checker catches a
violation (a checker that cannot fail would prove nothing).
"""

from __future__ import annotations

import ast
import io
import pathlib
import sys
import textwrap
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "aioloader"
ARCHITECTURE = PACKAGE_DIR.parent / "docs" / "architecture.md"

MAX_CODE_LINES = 800

# Level of each unit: a top-level module or package of ``aioloader``. A unit imports only from
# strictly lower levels. What each level is, in the architecture page's words:
LEVEL_NAMES: dict[int, str] = {
    0: "vocabulary: errors, protocols, checks, the tree walker, loggers, statistics",
    1: "one resource or one order each: sampling, shared memory, CUDA, storage",
    2: "making one batch; the loader's settings, checked once",
    3: "threads: batches made without workers, the loop behind `for`, blocking calls",
    4: "worker processes; one epoch (producer, reorder, consumer)",
    5: "the loader and the pool that own lifetimes; the doctor",
    6: "workers past one machine: Ray actors, a pool the loader attaches to",
    7: "the facade",
    8: "the command line",
}
LEVELS: dict[str, int] = {
    "_errors": 0,
    "_types": 0,
    "_validate": 0,
    "_tree": 0,
    "_log": 0,
    "_lazy": 0,
    "_signals": 0,
    "_stats": 0,
    "_sampling": 1,
    "_shm": 1,
    "_device": 1,
    "sources": 1,
    "_batch": 2,
    "_config": 2,
    "_threads": 3,
    "_workers": 4,
    "_epoch": 4,
    "_loader": 5,
    "_doctor": 5,
    "distributed": 5,  # merge_states reads the loader's state (_epoch)
    "_ray": 6,
    "__init__": 7,
    "__main__": 8,
}

# Level of each module inside a package, for imports between modules of one package.
PACKAGE_LEVELS: dict[str, dict[str, int]] = {
    "_stats": {"_cpu": 0, "_counters": 1, "_progress": 2},
    "_sampling": {"_batch_sampler": 0, "_distributed": 0, "_lockstep": 0, "_sampler": 1},
    "_shm": {"_segment": 0, "_descriptors": 0, "_attach": 1, "_pool": 1},
    "_device": {
        "_backend": 0,
        "_completion": 0,
        "_leaves": 0,
        "_parse": 0,
        "_ring": 0,
        "_staging": 0,
        "_transfer": 0,
        "_plan": 1,
        "_stage": 2,
    },
    "sources": {
        "_mixing": 0,
        "_redact": 0,
        "_tarfmt": 0,
        "_base": 1,
        "_elastic": 1,
        "_inflight": 1,
        "_readers": 2,
        "_retry": 1,
        "_classify": 2,
        "_file": 2,
        "_http": 2,
        "_fsspec": 3,
        "_listing": 4,
        "_parquetio": 4,
        "_tar": 4,
        "_parquet": 5,
    },
    "_batch": {"_mismatch": 0, "_stacking": 0, "_prestack": 0, "_collate": 1, "_make": 2},
    "_threads": {"_loop": 0, "_offloop": 0, "_reuse": 0, "_routes": 0, "_run": 1, "_runner": 1},
    "_workers": {
        # what both sides share: the records on the wire and in shared memory, the private
        # CPython workers start with, what a worker knows
        "_cpython": 0,
        "_info": 0,
        "_mapped": 0,
        "_records": 0,
        # packing, pickling and moving the records; the start methods
        "_copy": 1,
        "_frames": 1,
        "_payload": 1,
        "_raw": 1,
        "_wire": 1,
        "_zygote": 1,
        "_channel": 2,
        "_context": 2,
        # the worker's side: its serve loop and jobs; then the main side, which starts workers,
        # sees their deaths and submits jobs
        "_worker": 3,
        "_starting": 4,
        "_death": 5,
        "_launch": 6,
        "_pool": 7,
        "_runner": 8,
    },
    "_epoch": {
        "_reorder": 0,
        "_failures": 0,
        "_plan": 0,
        "_chain": 0,
        "_resume": 1,
        "_deadline": 0,
        "_fetch": 1,
        "_produce": 2,
        "_consume": 3,
    },
    "_ray": {"_wire": 0, "_actor": 1, "_fleet": 2, "_runner": 3, "_pool": 4},
    "_loader": {
        "_closing": 0,
        "_settings": 0,
        "_shared_pool": 1,
        "_resources": 2,
        "_dataloader": 3,
    },
}


@dataclass(frozen=True, slots=True)
class Import:
    source: str  # dotted module that imports
    target: str  # dotted module imported
    names: tuple[str, ...]  # names taken with ``from target import ...``
    line: int


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted name (``pkg._x._y``) of every module below ``root`` (a package directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes under ``if TYPE_CHECKING:``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skip.update(id(n) for n in ast.walk(child))
    return skip


def imports(name: str, path: pathlib.Path, top: str) -> Iterator[Import]:
    """The imports of package ``top`` made by module ``name``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: -(node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target != top and not target.startswith(top + "."):
                continue
            if node.module is None:  # ``from . import _shm``: each name is a module
                for alias in node.names:
                    yield Import(name, f"{target}.{alias.name}", (), node.lineno)
            else:
                yield Import(name, target, tuple(a.name for a in node.names), node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == top or alias.name.startswith(top + "."):
                    yield Import(name, alias.name, (), node.lineno)


def unit(dotted: str, top: str) -> str:
    """The top-level module or sub-package a dotted module belongs to (its level's key)."""
    parts = dotted.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def inner_name(dotted: str, top: str) -> str | None:
    """A package's module's name inside its package (``_pool`` of ``top._shm._pool``); None for
    a top-level module or a package's ``__init__``."""
    parts = dotted.split(".")
    return parts[2] if len(parts) >= 3 else None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def code_lines(text: str) -> int:
    """Lines that hold code: not blank, not only a comment, not part of a docstring."""
    tree = ast.parse(text)
    doc_lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = body[0] if body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                doc_lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skip = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - doc_lines)


def problems(
    root: pathlib.Path,
    levels: dict[str, int],
    package_levels: dict[str, dict[str, int]],
    max_lines: int,
) -> list[str]:
    """Every violation of the module's rules in the package at ``root``."""
    top = root.name
    mods = modules(root)
    found: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        lines = code_lines(path.read_text())
        if lines > max_lines:
            found.append(f"{name}: {lines} lines of code, more than {max_lines}: two jobs?")
        here = unit(name, top)
        if here not in levels:
            found.append(f"{name}: no level in the table; place it")
            continue
        inner = inner_name(name, top)
        if inner is not None and inner not in package_levels.get(here, {}):
            found.append(f"{name}: no level inside {here}; place it")
            continue
        module_aliases: dict[str, str] = {}
        for imp in imports(name, path, top):
            target = imp.target
            if target not in mods and target.rpartition(".")[0] in mods:
                target = target.rpartition(".")[0]  # ``from .pkg import mod`` -> the package
            graph[name].add(target)
            there = unit(target, top)
            if there != here:
                if there in levels and levels[there] >= levels[here]:
                    found.append(
                        f"{name}:{imp.line} imports {imp.target} (level {levels[there]}) from "
                        f"level {levels[here]}: only lower levels may be imported"
                    )
                if inner_name(target, top) is not None:
                    found.append(
                        f"{name}:{imp.line} imports {target}: enter {top}.{there} through its "
                        f"__init__"
                    )
            else:
                mine, theirs = inner_name(name, top), inner_name(target, top)
                table = package_levels.get(here, {})
                if (
                    mine is not None
                    and theirs is not None
                    and theirs in table
                    and table[theirs] >= table[mine]
                ):
                    found.append(
                        f"{name}:{imp.line} imports {target} (level {table[theirs]} in {here}) "
                        f"from level {table[mine]}: only lower levels may be imported"
                    )
                if mine is not None and theirs is None and target != name:
                    found.append(f"{name}:{imp.line} imports its own package's __init__")
            reexport = path.name == "__init__.py" and target.startswith(name + ".")
            for n in imp.names:
                if _private(n) and not reexport and target != name:
                    found.append(f"{name}:{imp.line} imports private {n} from {imp.target}")
            if not imp.names:
                module_aliases[imp.target.rpartition(".")[2]] = imp.target
        found.extend(_private_attribute_uses(name, path, module_aliases))
    found.extend(_cycles(graph))
    return found


def _private_attribute_uses(name: str, path: pathlib.Path, aliases: dict[str, str]) -> list[str]:
    """``mod._name`` where ``mod`` is one of our modules imported by ``name``."""
    out = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and _private(node.attr)
        ):
            out.append(f"{name}:{node.lineno} uses private {aliases[node.value.id]}.{node.attr}")
    return out


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per import cycle found (depth-first search)."""
    found: list[str] = []
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                found.append("import cycle: " + " -> ".join(cycle))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


# -- the package itself --------------------------------------------------------------------------


def test_the_package_keeps_its_layers() -> None:
    found = problems(PACKAGE_DIR, LEVELS, PACKAGE_LEVELS, MAX_CODE_LINES)
    assert not found, "\n".join(found)


def test_every_level_names_a_module_that_exists() -> None:
    mods = modules(PACKAGE_DIR)
    units = {unit(m, "aioloader") for m in mods}
    assert set(LEVELS) - units == set(), "the table names modules that are gone"
    for package, table in PACKAGE_LEVELS.items():
        inner = {inner_name(m, "aioloader") for m in mods if unit(m, "aioloader") == package}
        assert set(table) - inner == set(), f"the table of {package} names modules that are gone"


def test_the_top_of_the_package_stays_small() -> None:
    entries = [p for p in PACKAGE_DIR.iterdir() if p.name != "__pycache__"]
    assert len(entries) <= 25, sorted(p.name for p in entries)


# -- the architecture page's module map ---------------------------------------------------

MAP_START = "<!-- module map: generated by `python tests/test_layers.py`; do not edit -->"
MAP_END = "<!-- end of module map -->"


def summary(path: pathlib.Path) -> str:
    """The first sentence of a module's docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    end = first.find(". ")
    return first if end < 0 else first[: end + 1]


def module_map(root: pathlib.Path = PACKAGE_DIR) -> str:
    """The module map: every unit by level, every package's modules by their level
    inside it, each with the first sentence of its docstring."""
    mods = modules(root)
    top = root.name
    out = ["```"]
    for level in sorted(set(LEVELS.values())):
        out.append(f"level {level}: {LEVEL_NAMES[level]}")
        for name in sorted(u for u, lv in LEVELS.items() if lv == level):
            dotted = top if name == "__init__" else f"{top}.{name}"
            is_package = name in PACKAGE_LEVELS
            label = f"{name}/" if is_package else f"{name}.py"
            out.extend(_entry("  ", label, summary(mods[dotted]), 18))
            for inner, inner_level in sorted(
                PACKAGE_LEVELS.get(name, {}).items(), key=lambda kv: (kv[1], kv[0])
            ):
                text = summary(mods[f"{dotted}.{inner}"])
                out.extend(_entry("    ", f"{inner_level} {inner}", text, 18))
    out.append("```")
    return "\n".join(out)


def _entry(indent: str, label: str, text: str, width: int) -> list[str]:
    head = f"{indent}{label:<{width}} "
    lines = textwrap.wrap(text, 100 - len(head)) or [""]
    return [head + lines[0], *(" " * len(head) + line for line in lines[1:])]


def page_with_map(page: str, rendered: str) -> str:
    before, _, rest = page.partition(MAP_START)
    _, _, after = rest.partition(MAP_END)
    return f"{before}{MAP_START}\n{rendered}\n{MAP_END}{after}"


def test_the_architecture_map_is_the_enforced_one() -> None:
    page = ARCHITECTURE.read_text()
    assert MAP_START in page, f"{ARCHITECTURE} lost its module map's start marker"
    assert MAP_END in page, f"{ARCHITECTURE} lost its module map's end marker"
    assert page_with_map(page, module_map()) == page, (
        f"the module map in {ARCHITECTURE} differs from the levels enforced here: "
        "run `python tests/test_layers.py`"
    )


def test_every_module_says_what_it_is() -> None:
    missing = [name for name, path in modules(PACKAGE_DIR).items() if not summary(path)]
    assert not missing, f"modules without a docstring: {missing}"


# -- the checker catches what it must -------------------------------------------------------------


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    pkg = root / "pkg"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


LOW_HIGH = {"__init__": 2, "_low": 0, "_high": 1, "_sub": 0}
INNER = {"_sub": {"_b": 0, "_a": 1}}


def test_a_clean_package_passes(tmp_path: pathlib.Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "from ._high import thing as thing\n",
            "_low.py": "VALUE = 1\n",
            "_high.py": "from ._low import VALUE\nthing = VALUE\n",
            "_sub/__init__.py": "from ._a import A as A\n",
            "_sub/_a.py": "from ._b import B\nA = B\n",
            "_sub/_b.py": "B = 2\n",
        },
    )
    assert problems(pkg, LOW_HIGH, INNER, 50) == []


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            {"_low.py": "from ._high import thing\n", "_high.py": "thing = 1\n"},
            "only lower levels may be imported",
            id="upward import",
        ),
        pytest.param(
            {"_low.py": "def f():\n    from . import _high\n", "_high.py": "x = 1\n"},
            "only lower levels may be imported",
            id="upward import inside a function",
        ),
        pytest.param(
            {"_low.py": "x = 1\n_y = 2\n", "_high.py": "from ._low import _y\n"},
            "imports private _y",
            id="private name imported",
        ),
        pytest.param(
            {"_low.py": "x = 1\n_y = 2\n", "_high.py": "from . import _low\nz = _low._y\n"},
            "uses private pkg._low._y",
            id="private attribute used",
        ),
        pytest.param(
            {"_low.py": "x = 1\n", "_high.py": "x = 1\n" * 51},
            "more than 50",
            id="module too long",
        ),
        pytest.param(
            {"_low.py": "x = 1\n", "_high.py": "x = 1\n", "_new.py": "x = 1\n"},
            "no level in the table",
            id="module without a level",
        ),
        pytest.param(
            {
                "_low.py": "x = 1\n",
                "_high.py": "x = 1\n",
                "_sub/__init__.py": "from ._a import A as A\n",
                "_sub/_a.py": "from ._b import B\nA = 1\n",
                "_sub/_b.py": "from ._a import A\nB = 1\n",
            },
            "import cycle",
            id="cycle inside a package",
        ),
        pytest.param(
            {
                "_low.py": "x = 1\n",
                "_high.py": "from ._sub._b import B\n",
                "_sub/__init__.py": "from ._b import B as B\n",
                "_sub/_a.py": "A = 1\n",
                "_sub/_b.py": "B = 1\n",
            },
            "through its __init__",
            id="a package entered past its facade",
        ),
        pytest.param(
            {
                "_low.py": "x = 1\n",
                "_high.py": "x = 1\n",
                "_sub/__init__.py": "",
                "_sub/_a.py": "A = 1\n",
                "_sub/_b.py": "from ._a import A\n",
            },
            "(level 1 in _sub) from level 0",
            id="upward import inside a package",
        ),
        pytest.param(
            {
                "_low.py": "x = 1\n",
                "_high.py": "x = 1\n",
                "_sub/__init__.py": "",
                "_sub/_a.py": "A = 1\n",
                "_sub/_b.py": "B = 1\n",
                "_sub/_c.py": "C = 1\n",
            },
            "no level inside _sub",
            id="module without a level inside its package",
        ),
        pytest.param(
            {
                "_low.py": "x = 1\n",
                "_high.py": "x = 1\n",
                "_sub/__init__.py": "",
                "_sub/_a.py": "from . import _b\nA = 1\n",
                "_sub/_b.py": "from . import X\nB = 1\n",
            },
            "imports its own package's __init__",
            id="a module importing its own package's facade",
        ),
    ],
)
def test_the_checker_catches(tmp_path: pathlib.Path, files: dict[str, str], expected: str) -> None:
    pkg = _write(tmp_path, {"__init__.py": "", **files})
    found = problems(pkg, LOW_HIGH, INNER, 50)
    assert any(expected in line for line in found), found


def test_type_checking_imports_are_left_out(tmp_path: pathlib.Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "_low.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from ._high import thing\n"
            ),
            "_high.py": "thing = 1\n",
        },
    )
    assert problems(pkg, LOW_HIGH, INNER, 50) == []


def test_docstrings_and_comments_are_not_code() -> None:
    text = (
        '"""Doc.\n\nMore doc.\n"""\n\n# a comment\nx = 1\n\n\n'
        'def f():\n    """Doc."""\n    return (\n        1\n    )\n'
    )
    # x = 1 / def f(): / return ( / 1 / )
    assert code_lines(text) == 5


if __name__ == "__main__":
    ARCHITECTURE.write_text(page_with_map(ARCHITECTURE.read_text(), module_map()))
    sys.exit(0)
