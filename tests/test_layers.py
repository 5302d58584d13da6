"""The package's structure, checked from the source with ``ast``, so it stays true.

- Every module has a level (the table below, drawn in the README too) and imports only modules
  of lower levels; modules of one package (``_workers/``, ``_device/``, ``sources/``) share their
  package's level and may import each other.
- No import cycle, counting imports inside functions (only ``if TYPE_CHECKING:`` blocks are
  left out: they never run).
- No module uses another module's private names: neither ``from .x import _name`` nor
  ``x._name`` on an imported module of ours.
- No module is over :data:`MAX_LINES` lines: past that, split it by job.

Each rule is also run against a small synthetic package, to prove the checker catches a
violation (a checker that cannot fail would prove nothing).
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "aioloader"

MAX_LINES = 600

# Level of each top-level module or sub-package of ``aioloader``. A module imports only from
# strictly lower levels.
LEVELS: dict[str, int] = {
    # 0 - vocabulary: records and protocols, errors, argument checks, pure state machines
    "_errors": 0,
    "_types": 0,
    "_validate": 0,
    "_tree": 0,
    "_mismatch": 0,
    "_signals": 0,
    "_closing": 0,
    "_lazy": 0,
    "_stats": 0,
    "_log": 0,
    "_reorder": 0,
    "_stacking": 0,
    "_offloop": 0,
    # 1 - pure building blocks, and what this process's rank reads (_distributed)
    "_batch_sampler": 1,
    "_collate": 1,
    "_prestack": 1,
    "_shm_tree": 1,
    "_failures": 1,
    "_sync": 1,
    "_progress": 1,
    "_distributed": 1,
    # 2 - one batch, one resource: samplers, making a batch, shared memory, CUDA, storage
    "_sampler": 2,
    "_batch": 2,
    "_shm": 2,
    "_reuse": 2,
    "_device": 2,
    "_run": 2,  # aioloader.run: a loop of _sync's making
    # its modules share it: _base, _retry, _file, _http, _fsspec, _listing; _tar, _tarfmt, the
    # epoch of units read at once (_readers) and its mixer (_mixing); _parquet, _parquetio
    "sources": 2,
    # 3 - the settings, and one concurrency mechanism each: threads, processes, awaited
    #     fetches, deadlines
    "_config": 3,
    "_threads": 3,
    "_workers": 3,
    "_fetch": 3,
    "_deadline": 3,
    # 4 - the producer side of an epoch, and the plan of its map-style batches
    "_produce": 4,
    "_plan": 4,
    # 4 - the loader's settings as attributes, and its epochs' bookkeeping for resume
    "_settings": 4,
    "_resume": 4,
    # 4 - worker processes that several loaders share
    "_shared_pool": 4,
    # 5 - the consumer side of an epoch
    "_epoch": 5,
    # 6 - what a loader holds between epochs: runner, slots, device stage, loop thread
    "_resources": 6,
    # 7 - the loader: composes the stages, owns lifetimes
    "_loader": 7,
    # 8 - entry points: the facade and the command line
    "__init__": 8,
    "__main__": 9,
    "_doctor": 4,
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


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def problems(root: pathlib.Path, levels: dict[str, int], max_lines: int) -> list[str]:
    """Every violation of the module's rules in the package at ``root``."""
    top = root.name
    mods = modules(root)
    found: list[str] = []
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        lines = len(path.read_text().splitlines())
        if lines > max_lines:
            found.append(f"{name}: {lines} lines, more than {max_lines}: split it by job")
        here = unit(name, top)
        if here not in levels:
            found.append(f"{name}: no level in the table; place it")
            continue
        module_aliases: dict[str, str] = {}
        for imp in imports(name, path, top):
            target = imp.target
            if target not in mods and target.rpartition(".")[0] in mods:
                target = target.rpartition(".")[0]  # ``from .pkg import mod`` -> the package
            graph[name].add(target)
            there = unit(target, top)
            if there != here and there in levels and levels[there] >= levels[here]:
                found.append(
                    f"{name}:{imp.line} imports {imp.target} (level {levels[there]}) from "
                    f"level {levels[here]}: only lower levels may be imported"
                )
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
    found = problems(PACKAGE_DIR, LEVELS, MAX_LINES)
    assert not found, "\n".join(found)


def test_every_level_names_a_module_that_exists() -> None:
    units = {unit(m, "aioloader") for m in modules(PACKAGE_DIR)}
    assert set(LEVELS) - units == set(), "the table names modules that are gone"


# -- the checker catches what it must -------------------------------------------------------------


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    pkg = root / "pkg"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


LOW_HIGH = {"__init__": 2, "_low": 0, "_high": 1, "_sub": 0}


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
    assert problems(pkg, LOW_HIGH, 50) == []


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
    ],
)
def test_the_checker_catches(tmp_path: pathlib.Path, files: dict[str, str], expected: str) -> None:
    pkg = _write(tmp_path, {"__init__.py": "", **files})
    found = problems(pkg, LOW_HIGH, 50)
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
    assert problems(pkg, LOW_HIGH, 50) == []
