"""The public surface: ``aioloader.__all__`` is sorted, complete, and every export lives at
``aioloader`` (reprs, docs and pickles name the facade, never a private module)."""

from __future__ import annotations

import pickle
import types

import aioloader


def _public_names() -> set[str]:
    names = set()
    for name, value in vars(aioloader).items():
        if name.startswith("_"):
            continue  # private, and dunders such as __version__ / __all__
        if isinstance(value, types.ModuleType):
            continue  # submodules (aioloader.sources) and imported modules
        if name == "annotations":
            continue  # `from __future__ import annotations`
        names.add(name)
    return names


def test_all_is_sorted_and_unique() -> None:
    assert list(aioloader.__all__) == sorted(aioloader.__all__)
    assert len(set(aioloader.__all__)) == len(aioloader.__all__)


def test_all_equals_the_public_names() -> None:
    assert set(aioloader.__all__) == _public_names()


def test_every_export_reports_the_facade_as_its_module() -> None:
    wrong = {
        name: getattr(getattr(aioloader, name), "__module__", None)
        for name in aioloader.__all__
        if getattr(getattr(aioloader, name), "__module__", None) != "aioloader"
    }
    assert wrong == {}


def test_exports_pickle_by_reference_through_the_facade() -> None:
    for name in aioloader.__all__:
        obj = getattr(aioloader, name)
        if isinstance(obj, type) or callable(obj):
            assert pickle.loads(pickle.dumps(obj)) is obj, name


def test_version_is_a_string() -> None:
    assert isinstance(aioloader.__version__, str)
    assert aioloader.__version__.count(".") >= 1


def test_importing_aioloader_does_not_import_torch() -> None:
    """A program that only wants numpy batches does not pay for torch (about a second); torch
    comes in when a torch feature is used: here, the first default-collated batch."""
    import subprocess
    import sys

    code = (
        "import sys, aioloader\n"
        "print('torch' in sys.modules)\n"
        "numpy_collate = aioloader.numpy_collate\n"
        "with aioloader.DataLoader(list(range(8)), batch_size=4, collate_fn=numpy_collate,"
        " num_workers=2) as loader:\n"
        "    print(type(next(iter(loader))).__module__, 'torch' in sys.modules)\n"
        "with aioloader.DataLoader(list(range(8)), batch_size=4) as loader:\n"
        "    print(type(next(iter(loader))).__module__, 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split("\n")[:3] == ["False", "numpy False", "torch True"], out.stdout
