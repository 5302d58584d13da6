"""Sphinx configuration of aioloader's documentation site.

Built strictly by one command from the repository root (``.ci/run`` runs it after the tests,
and ``tests/test_docs.py`` builds it too)::

    .venv/bin/sphinx-build -W --keep-going -n -b html docs docs/_build/html

Why Sphinx: the docstrings carry hundreds of Sphinx roles (``:class:``, ``:func:``, ``:meth:``)
that Sphinx resolves natively. Pages are Markdown (MyST-Parser); the API reference is generated
from the docstrings by autodoc, whose Google-style sections napoleon reads. ``-n`` (nitpicky)
makes every cross-reference that does not resolve a warning, and ``-W`` makes every warning an
error, so a dead reference or a page missing from the table of contents fails the build.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aioloader  # noqa: E402

project = "aioloader"
author = "the aioloader authors"
copyright = "the aioloader authors"
release = aioloader.__version__
version = release

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

html_theme = "furo"
html_title = f"aioloader {release}"

myst_enable_extensions = ["colon_fence", "deflist"]
# Headings up to ### get anchors, so pages link to sections ([text](page.md#a-heading)).
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

nitpicky = True
# The references a strict build cannot resolve, and why each is left unresolved rather than
# fixed. Nothing else may be added here without a reason of the same kind.
nitpick_ignore_regex = [
    # Other projects' names (the standard library, numpy, torch) in signatures and docstrings.
    # Linking them needs intersphinx inventories fetched over the network, and the build must
    # work offline (CI, a laptop on a train); they render as plain names.
    (r"py:.*", r"(collections\.abc|os|asyncio|datetime|multiprocessing|numpy|torch)(\..+)?"),
    # Private names of the package in public signatures and docstrings (a type variable, a
    # private base class, a private module's helper): they have no reference entry on purpose,
    # since the reference documents what `aioloader` and `aioloader.sources` export.
    (r"py:.*", r"aioloader(\.sources)?\._.+"),
]
nitpick_ignore = [
    # Annotations naming private classes without their module (string annotations under
    # `from __future__ import annotations`, imported for type checking only).
    ("py:class", "BaseContext"),  # multiprocessing's, in WorkerPool's signature
    ("py:class", "DeviceStage"),
    ("py:class", "EpochStatistics"),  # LoaderStatistics.epoch_stats; fields in its docstring
    ("py:class", "LastBatch"),  # the Literal "keep" | "discard" | "rollover"
    ("py:class", "LoaderConfig"),
    ("py:class", "Runner"),
    ("py:class", "Source"),  # the sources' private base class
    # Roles in public docstrings that point at private names.
    ("py:attr", "EpochStatistics.bottleneck"),
    ("py:data", "SKIP_RECORDS"),  # the number is given in the sentence that names it
    ("py:func", "list_fsspec"),
    ("py:func", "list_local"),
    ("py:meth", "Source.expect_in_flight"),
    ("py:meth", "_Held.slot_pool"),
    # RandomSampler's `seed` is an instance attribute, described with the argument.
    ("py:attr", "seed"),
]


_PROSE_PROPERTIES: dict[str, list[str]] = {}


def _save_property_prose(
    app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    """Keep a property's first line as prose (before napoleon, which rewrites the lines).

    napoleon reads a property docstring's first line ``text: more`` as ``type: description``;
    where the part before the colon is a phrase (``torch's view of the policy: True when
    ...``), it would be rendered as a type that resolves to nothing. Such a docstring is plain
    prose with no Google-style section, so it is kept as written.
    """
    if what == "property" and lines:
        head, colon, _ = lines[0].partition(": ")
        if colon and " " in head.strip():
            _PROSE_PROPERTIES[name] = list(lines)


def _restore_property_prose(
    app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    saved = _PROSE_PROPERTIES.pop(name, None)
    if saved is not None:
        lines[:] = saved


def setup(app: Any) -> None:
    # napoleon's handler runs at the default priority, 500: one handler before it, one after.
    app.connect("autodoc-process-docstring", _save_property_prose, priority=400)
    app.connect("autodoc-process-docstring", _restore_property_prose, priority=600)
