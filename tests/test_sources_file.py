"""FileDataset: local files read through aiofiles, in two stages."""

from __future__ import annotations

import asyncio
import os
import pickle
import tempfile
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader.sources import FileDataset


def checksum(data: bytes) -> int:
    return zlib.crc32(data)


def write_files(root: Path, blobs: list[bytes]) -> list[Path]:
    paths = []
    for i, blob in enumerate(blobs):
        path = root / f"item-{i:04d}.bin"
        path.write_bytes(blob)
        paths.append(path)
    return paths


async def test_reads_every_file_concurrently(tmp_path: Path) -> None:
    blobs = [os.urandom(n) for n in [0, 1, 4095, 4096, 70_000, 1_000_000] * 10]
    paths = write_files(tmp_path, blobs)
    ds = FileDataset(paths)
    got = await asyncio.gather(*(ds.fetch(i) for i in range(len(ds))))
    assert got == blobs
    assert ds.paths == tuple(str(p) for p in paths)


async def test_getitem_decodes_and_accepts_strings_and_negative_indices(tmp_path: Path) -> None:
    paths = write_files(tmp_path, [b"alpha", b"beta"])
    ds = FileDataset([str(p) for p in paths], decode=checksum)
    assert await ds[0] == checksum(b"alpha")
    assert await ds[-1] == checksum(b"beta")
    assert ds.decode(b"x") == checksum(b"x")
    assert await FileDataset(paths[1]).fetch(0) == b"beta"  # one path is one item


async def test_missing_file_raises_file_not_found_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.bin"
    ds = FileDataset([missing])
    with pytest.raises(FileNotFoundError) as info:
        await ds[0]
    assert info.value.filename == str(missing)
    assert str(missing) in str(info.value)


async def test_a_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError):
        await FileDataset([tmp_path]).fetch(0)


async def test_a_file_cut_short_while_read_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (path,) = write_files(tmp_path, [b"0123456789"])
    real_fstat = os.fstat

    def fstat_of_a_bigger_file(fd: int) -> os.stat_result:
        # The size fstat saw at open was larger than what read() then found.
        info = list(real_fstat(fd))
        info[6] = 20  # st_size
        return os.stat_result(info)

    monkeypatch.setattr(os, "fstat", fstat_of_a_bigger_file)
    with pytest.raises(OSError, match="short read: got 10 of 20 bytes") as info:
        await FileDataset([path]).fetch(0)
    assert info.value.filename == str(path)


async def test_bad_indices(tmp_path: Path) -> None:
    ds = FileDataset(write_files(tmp_path, [b"a"]))
    with pytest.raises(IndexError, match="index 1 is out of range for 1 items"):
        await ds.fetch(1)
    with pytest.raises(TypeError, match="index must be an int"):
        await ds.fetch("0")  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="paths"):
        FileDataset(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"paths\[1\]"):
        FileDataset(["a", 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="decode"):
        FileDataset(["a"], decode="utf-8")  # type: ignore[arg-type]


async def test_pickles_and_works_after(tmp_path: Path) -> None:
    paths = write_files(tmp_path, [b"one", b"two"])
    ds = FileDataset(paths, decode=checksum)
    clone = pickle.loads(pickle.dumps(ds))
    assert len(clone) == 2
    assert await clone[1] == checksum(b"two")
    assert "2 files" in repr(clone)
    await clone.aclose()  # nothing pooled; still callable, as the loader calls it


@settings(max_examples=25, deadline=None)
@given(blobs=st.lists(st.binary(max_size=20_000), max_size=6))
def test_bytes_round_trip(blobs: list[bytes]) -> None:
    async def read_all(ds: FileDataset) -> list[bytes]:
        return list(await asyncio.gather(*(ds.fetch(i) for i in range(len(ds)))))

    with tempfile.TemporaryDirectory() as root:
        ds = FileDataset(write_files(Path(root), blobs))
        assert len(ds) == len(blobs)
        assert asyncio.run(read_all(ds)) == blobs
