"""Arrays and tensors in memory-mapped files reach the workers as references to their files
(``_workers._mapped``, through ``_workers._payload.dumps_copy``): the worker maps the file
again and sees what the main process sees, views and odd offsets included; writes through a
shared writable map reach the file, as through ``fork``; the copy carries no array bytes; a
file gone before a worker maps it fails that worker naming the path, and a file gone or
changed before the pickling is pickled as before (this process still holds the bytes).
"""

from __future__ import annotations

import gc
import mmap
import os
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aioloader import DataLoader, WorkerInitError, _shm
from aioloader._workers._payload import dumps_copy, loads
from aioloader._workers._records import Payload

pytestmark = pytest.mark.usefixtures("baseline")

TOKENS = 3 << 19  # uint16: a 3 MiB file, larger than any payload here by far
ODD = mmap.PAGESIZE + 3  # a byte offset that is neither page-aligned nor uint16-aligned
SMALL_PAYLOAD = 4096


def tokens() -> np.ndarray[Any, np.dtype[np.uint16]]:
    return (np.arange(TOKENS, dtype=np.int64) * 7 % 65521).astype(np.uint16)


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    path = tmp_path / "tokens.bin"
    tokens().tofile(path)
    return str(path)


def own_segments() -> set[str]:
    prefix = f"{_shm.SHM_PREFIX}{os.getpid()}_"
    return {name for name in os.listdir(_shm.SHM_DIR) if name.startswith(prefix)}


class TokenWindows:
    """The pretraining pattern: windows of a token file, through a memmap opened at an odd
    offset, a 2-D reshape of it, and a strided slice of that with an odd start."""

    def __init__(self, path: str) -> None:
        shape = ((2 * TOKENS - ODD) // 2,)  # the whole uint16 values after ODD
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r", offset=ODD, shape=shape)
        self.rows = np.memmap(path, dtype=np.uint16, mode="r").reshape(-1, 64)
        self.view = self.rows[5:, 3::2]  # a view: a memmap too, its data inside the map

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "window": np.array(self.tokens[index * 1001 : index * 1001 + 8]),
            "view": np.array(self.view[index * 97, :4]),
            # Mapped in this process, not a copy of the bytes (a copy has no mmap as base).
            "mapped": all(isinstance(a.base, mmap.mmap) for a in (self.tokens, self.view)),
        }


def test_workers_read_a_memmap_and_its_odd_views_as_the_main_process_does(
    token_file: str,
) -> None:
    dataset = TokenWindows(token_file)
    seen: list[set[str]] = []
    with DataLoader(dataset, batch_size=4, num_workers=2) as loader:
        batches = []
        for batch in loader:
            batches.append(batch)
            seen.append(own_segments())
    assert len(batches) == 4
    for number, batch in enumerate(batches):
        for row in range(4):
            want = dataset[number * 4 + row]
            assert batch["window"][row].tolist() == want["window"].tolist()
            assert batch["view"][row].tolist() == want["view"].tolist()
        assert batch["mapped"].tolist() == [True] * 4
    # Batches this small travel inline: no segment at all, the copy's array bytes included.
    assert seen == [set()] * 4


def test_the_copy_carries_a_reference_to_the_file_not_its_bytes(token_file: str) -> None:
    dataset = TokenWindows(token_file)
    payload = dumps_copy(dataset, main_by_value=False)
    assert payload.segment is None
    assert len(payload.data) < SMALL_PAYLOAD  # the file is 3 MiB
    copy = loads(payload)
    assert type(copy.tokens) is np.memmap
    assert np.array_equal(copy.tokens, dataset.tokens)
    assert np.array_equal(copy.view, dataset.view)
    assert copy.view.strides == dataset.view.strides
    assert copy.tokens.mode == "r"
    assert not copy.tokens.flags.writeable  # read-only, as the original
    assert copy.rows._mmap is copy.view._mmap  # one mapping for an array and its views


class Writer:
    """Writes its index into a shared writable memmap (mode ``r+``) as it reads."""

    def __init__(self, path: str) -> None:
        self.data = np.memmap(path, dtype=np.uint16, mode="r+")

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        self.data[index] = 60000 + index
        return index


def test_writes_through_an_r_plus_memmap_in_a_worker_reach_the_file(token_file: str) -> None:
    dataset = Writer(token_file)
    with DataLoader(dataset, batch_size=2, num_workers=2) as loader:
        assert sorted(int(i) for batch in loader for i in batch) == list(range(8))
    on_disk = np.fromfile(token_file, dtype=np.uint16)
    assert on_disk[:8].tolist() == [60000 + i for i in range(8)]
    assert dataset.data[:8].tolist() == on_disk[:8].tolist()  # the main process sees them
    assert np.array_equal(on_disk[8:], tokens()[8:])


class RemoveWhenPickled:
    """Removes ``path`` as it is pickled: after the memmap before it, before any worker maps
    the file again."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        os.remove(self.path)
        return str, (self.path,)


class Doomed(TokenWindows):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.remove = RemoveWhenPickled(path)  # pickled after the memmaps (dict order)


def test_a_file_removed_before_a_worker_maps_it_fails_the_worker_naming_it(
    token_file: str,
) -> None:
    loader = DataLoader(Doomed(token_file), batch_size=4, num_workers=2, timeout=30)
    gone = f"FileNotFoundError.*is gone.*{re.escape(token_file)}"
    with loader, pytest.raises(WorkerInitError, match=gone):
        next(iter(loader))


def test_a_file_changed_after_the_pickling_is_reported_naming_it(token_file: str) -> None:
    payload = dumps_copy(TokenWindows(token_file), main_by_value=False)
    os.truncate(token_file, TOKENS)  # half of it
    with pytest.raises(OSError, match=f"shortened.*{re.escape(token_file)}"):
        loads(payload)
    tokens().tofile(token_file)  # whole again, the same file
    payload = dumps_copy(TokenWindows(token_file), main_by_value=False)
    replacement = token_file + ".new"
    tokens().tofile(replacement)
    os.replace(replacement, token_file)
    with pytest.raises(OSError, match=f"replaced.*{re.escape(token_file)}"):
        loads(payload)


def test_a_file_removed_before_the_pickling_is_copied_as_before(token_file: str) -> None:
    dataset = TokenWindows(token_file)
    os.remove(token_file)  # this process still maps it: the bytes go with the copy
    payload = dumps_copy(dataset, main_by_value=False)
    try:
        assert stream_bytes(payload) > TOKENS
        copy = loads(payload)
        assert np.array_equal(copy.tokens, dataset.tokens)
        assert np.array_equal(copy.view, dataset.view)
    finally:
        payload.release()


def test_a_copy_on_write_memmap_goes_by_reference_until_this_process_changes_it(
    token_file: str,
) -> None:
    private = np.memmap(token_file, dtype=np.uint16, mode="c")
    payload = dumps_copy(private, main_by_value=False)
    assert len(payload.data) < SMALL_PAYLOAD
    copy = loads(payload)
    assert np.array_equal(copy, private)
    copy[0] = 1  # its own change: neither the file nor the original sees it
    assert private[0] == 0
    assert np.fromfile(token_file, dtype=np.uint16, count=1)[0] == 0
    private[1] = 12345  # changed here: only a copy carries that, as fork would
    payload = dumps_copy(private, main_by_value=False)
    try:
        assert stream_bytes(payload) > TOKENS
        assert loads(payload)[1] == 12345
    finally:
        payload.release()


def stream_bytes(payload: Payload) -> int:
    """The length of ``payload``'s pickle stream, in the job or (large) in its segment."""
    return payload.stream[1] if payload.stream is not None else len(payload.data)


class Tensors:
    """Tensors over mapped files: ``torch.from_numpy`` of a memmap (and a strided view of
    it), and a ``torch.load(mmap=True)``."""

    def __init__(self, path: str, saved: str) -> None:
        self.numpy = torch.from_numpy(np.memmap(path, dtype=np.int16, mode="r+"))
        self.strided = self.numpy[3::5]
        self.loaded = torch.load(saved, mmap=True)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        at = index * 1001
        return self.numpy[at : at + 4], self.strided[at : at + 4], self.loaded[at : at + 4]


def test_tensors_over_mapped_files_go_by_reference(token_file: str, tmp_path: Path) -> None:
    saved = str(tmp_path / "weights.pt")
    torch.save(torch.arange(TOKENS, dtype=torch.float32), saved)
    dataset = Tensors(token_file, saved)
    payload = dumps_copy(dataset, main_by_value=False)
    assert payload.segment is None
    assert len(payload.data) < SMALL_PAYLOAD  # 3 MiB and 6 MiB of tensors
    copy = loads(payload)
    for name in ("numpy", "strided", "loaded"):
        sent, got = getattr(dataset, name), getattr(copy, name)
        assert got.dtype == sent.dtype
        assert got.stride() == sent.stride()
        assert torch.equal(got, sent)
    del copy
    with DataLoader(dataset, batch_size=2, num_workers=2) as loader:
        for number, batch in enumerate(loader):
            for row in range(2):
                want = dataset[number * 2 + row]
                assert all(torch.equal(b[row], w) for b, w in zip(batch, want, strict=True))


# -- tensors in torch's shared memory (share_memory_()) --------------------------------------


def shared(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` moved into torch's shared memory (``share_memory_`` is untyped)."""
    tensor.share_memory_()  # type: ignore[no-untyped-call]
    return tensor


class SharedLabels:
    """Labels the training loop refines in place between epochs, and a cache the workers fill:
    tensors in torch's shared memory, shared with torch's workers (fork or spawn)."""

    def __init__(self) -> None:
        self.labels = shared(torch.zeros(8))
        self.cache = shared(torch.zeros(16, dtype=torch.int64))
        self.odd = self.cache[1::2]  # a view of the same storage

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> float:
        self.odd[index] = 100 + index  # written by the worker, seen by the main process
        return float(self.labels[index])


@pytest.mark.parametrize("method", [None, "spawn"])
def test_tensors_in_torchs_shared_memory_stay_shared_with_the_workers(method: str | None) -> None:
    dataset = SharedLabels()
    with DataLoader(
        dataset, batch_size=4, num_workers=2, persistent_workers=True, mp_context=method
    ) as loader:
        assert [x for b in loader for x in b.tolist()] == [0.0] * 8
        assert dataset.cache[1::2].tolist() == [100 + i for i in range(8)]
        assert dataset.cache[0::2].tolist() == [0] * 8  # the view wrote where it lies
        dataset.labels += 7  # the same workers, the same copy: they see it
        assert [x for b in loader for x in b.tolist()] == [7.0] * 8


def test_a_shared_tensor_travels_as_a_reference_not_its_bytes() -> None:
    big = shared(torch.arange(1 << 20, dtype=torch.float32))  # 4 MiB
    payload = dumps_copy({"big": big, "half": big[::2]}, main_by_value=False)
    try:
        assert len(payload.data) < SMALL_PAYLOAD
        assert payload.segment is None
        loaded = loads(payload)
        assert torch.equal(loaded["big"], big)
        assert torch.equal(loaded["half"], big[::2])
        loaded["half"][1] = -1.0  # mapped shared: the write is big's too
        assert big[2] == -1.0
    finally:
        payload.release()


def test_a_copy_keeps_its_shared_tensors_alive_until_it_is_loaded(tmp_path: Path) -> None:
    # A replacement worker loads a persistent copy long after the pickling: the training loop
    # may have swapped the tensor for another meanwhile, freeing the old one and its
    # descriptor, whose number the next file opened takes. The copy keeps what it refers to.
    payload = dumps_copy({"labels": shared(torch.arange(8.0))}, main_by_value=False)
    gc.collect()
    opened = [(tmp_path / f"f{i}").open("w") for i in range(4)]  # reuse freed numbers
    try:
        assert torch.equal(loads(payload)["labels"], torch.arange(8.0))
    finally:
        for file in opened:
            file.close()
        payload.release()
    assert pickle.loads(pickle.dumps(payload)).keep == ()  # what it keeps is never sent
