"""TarDataset: the tar parser, WebDataset's grouping rule, the mixer's replay, and shards read
through the loader from local files, a real loopback HTTP server and a moto S3 server.

Shards are tiny (a few samples of 24 bytes), so every test takes well under a second of its
own; the loader tests with worker processes are the slow part.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import tarfile
from collections.abc import AsyncGenerator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from datasets import keep, tar_keys, tar_sample, tar_shard
from helpers import collect, until
from http_server import Fault, FaultServer
from hypothesis import given, settings
from hypothesis import strategies as st
from s3_server import moto_s3, s3_options

import aioloader
from aioloader import DataLoader, ShardError
from aioloader.sources import BrokenShard, HTTPDataset, TarDataset
from aioloader.sources._mixing import Mixer, buffer_rng, replay, shard_order
from aioloader.sources._readers import Epoch
from aioloader.sources._tarfmt import Grouper, TarFormatError, TarParser, split_name


def counts(shard: int) -> int:
    """Samples per shard in these tests: uneven, so shards end at different turns."""
    return 3 + shard % 4


def write_shards(directory: Path, n: int) -> list[str]:
    paths = []
    for shard in range(n):
        path = directory / f"shard-{shard:03d}.tar"
        path.write_bytes(tar_shard(shard, counts(shard)))
        paths.append(str(path))
    return paths


@pytest.fixture
def shards(tmp_path: Path) -> list[str]:
    return write_shards(tmp_path, 6)


def keys_of(batches: list[list[dict[str, Any]]]) -> list[str]:
    return [sample["key"] for batch in batches for sample in batch]


async def raw_keys(dataset: TarDataset) -> list[str]:
    return [raw["__key__"] async for raw in dataset]


# -- the parser --------------------------------------------------------------------------------


def archive(fmt: int) -> bytes:
    """Members that need each format's extensions: a long path, a non-ASCII name, an empty file,
    a directory entry and a symlink (skipped)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        directory = tarfile.TarInfo("d" * 90)
        directory.type = tarfile.DIRTYPE
        tar.addfile(directory)
        for name, data in (
            (f"{'d' * 90}/{'n' * 40}.0001.jpg", b"x" * 700),
            ("caf\u00e9/0002.txt", b""),
            ("0003.cls", b"3"),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("0004.lnk")
        link.type = tarfile.SYMTYPE
        link.linkname = "0003.cls"
        tar.addfile(link)
    return out.getvalue()


def reference(data: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [
            (m.name, tar.extractfile(m).read())  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile()
        ]


def parse(data: bytes, step: int) -> list[tuple[str, bytes]]:
    parser = TarParser()
    out = []
    for start in range(0, len(data), step):
        out += parser.feed(data[start : start + step])
    parser.close()
    return out


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("step", [1, 511, 512, 513, 4096, 1 << 30])
def test_the_parser_reads_what_tarfile_reads_in_any_chunking(fmt: int, step: int) -> None:
    data = archive(fmt)
    assert parse(data, step) == reference(data)


@pytest.mark.parametrize("step", [300, 513, 4096])
def test_the_parser_is_fed_from_a_buffer_reused_for_every_chunk(step: int) -> None:
    # Pieces of a member left incomplete by a chunk are kept as views only of immutable bytes;
    # a bytearray the reader fills again for the next chunk must not change what was read.
    data = archive(tarfile.PAX_FORMAT)
    parser = TarParser()
    buffer = bytearray(step)
    out = []
    for start in range(0, len(data), step):
        piece = data[start : start + step]
        buffer[: len(piece)] = piece
        out += parser.feed(memoryview(buffer)[: len(piece)])
        buffer[:] = bytes(step)  # the next read overwrites it
    parser.close()
    assert out == reference(data)


def test_a_truncated_archive_is_an_error_naming_the_member() -> None:
    data = archive(tarfile.GNU_FORMAT)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = {None, "././@LongLink", *(m.name for m in tar.getmembers())}
        end = tar.offset  # where the end marker and the record's padding begin
    for cut in range(1, end, 97):
        if cut % 512 == 0:
            continue  # a cut at a block boundary may read as a complete archive (see close())
        parser = TarParser()
        parser.feed(data[:cut])
        with pytest.raises(TarFormatError, match="truncated") as info:
            parser.close()
        member = info.value.member
        assert (member.rstrip("/") if member else None) in names  # tarfile strips a dir's /


def test_a_corrupt_header_is_an_error_naming_the_member_before() -> None:
    data = bytearray(tar_shard(0, 3))
    second = 1024  # after 0000.bin (a header and one block of data): 0000.cls's header
    data[second + 10] ^= 0xFF
    parser = TarParser()
    with pytest.raises(TarFormatError, match="checksum") as info:
        parser.feed(bytes(data))
    assert info.value.member == "000/0000.bin"


def test_webdatasets_rule_splits_key_and_extension() -> None:
    assert split_name("a.b/c.d.E") == ("a.b/c", "d.e")
    assert split_name("x/0001.seg.png") == ("x/0001", "seg.png")
    assert split_name("x/README") is None
    grouper = Grouper("u")
    assert grouper.add("a/1.jpg", b"j") is None
    assert grouper.add("a/1.cls", b"c") is None
    assert grouper.add("a/README", b"?") is None  # no dot: left out
    first = grouper.add("a/2.jpg", b"k")
    assert first == {"__key__": "a/1", "__url__": "u", "jpg": b"j", "cls": b"c"}
    with pytest.raises(TarFormatError, match="two 'jpg' members"):
        grouper.add("a/2.jpg", b"again")


# -- the mixer: order, shares and replay ---------------------------------------------------------


def test_ranks_share_the_shards_of_one_order() -> None:
    orders = [shard_order(11, shuffle=True, seed=3, epoch=1, reader=r, readers=3) for r in range(3)]
    assert sorted(s for order in orders for s in order) == list(range(11))
    again = shard_order(11, shuffle=True, seed=3, epoch=1, reader=0, readers=3)
    other = shard_order(11, shuffle=True, seed=3, epoch=2, reader=0, readers=3)
    assert orders[0] == again
    assert orders[0] != other


def run_mixer(mixer: Mixer, sizes: list[int], stop: int | None = None) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    if stop == 0:
        return out
    while (want := mixer.want()) is not None:
        got = mixer.put(want[1] < sizes[want[0]])
        if got is not None:
            out.append(got)
            if len(out) == stop:
                return out
    drained = mixer.drain()
    return out + drained[: None if stop is None else stop - len(out)]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=7),
    slots=st.integers(1, 4),
    buffer=st.integers(0, 9),
    data=st.data(),
)
def test_replay_stands_the_mixer_where_any_cut_left_it(
    sizes: list[int], slots: int, buffer: int, data: st.DataObject
) -> None:
    order = list(range(len(sizes)))

    def mixer() -> Mixer:
        return Mixer(order, slots, buffer, buffer_rng(1, 2, 0, 1))

    full = run_mixer(mixer(), sizes)
    assert sorted(full) == [(s, p) for s in order for p in range(sizes[s])]
    cut = data.draw(st.integers(0, len(full)), label="cut")
    before = mixer()
    assert run_mixer(before, sizes, stop=cut) == full[:cut]
    resumed = mixer()
    tail = replay(resumed, before.ended, cut)
    rest = tail if tail else run_mixer(resumed, sizes)
    assert full[:cut] + rest == full


class RaisingUnits:
    """Two units of two records; unit 1's generator raises after its first (a bug)."""

    kind = "test"

    async def start(self, epoch: int, resume: Mapping[str, Any] | None) -> Mixer:
        return Mixer([0, 1], 2, 0, buffer_rng(0, epoch, 0, 1))

    async def records(self, unit: int) -> AsyncGenerator[str, None]:
        yield f"{unit}a"
        if unit == 1:
            raise RuntimeError("a bug in the records generator")
        yield f"{unit}b"

    def where(self, unit: int) -> tuple[str, str]:
        return f"unit {unit}", f"u{unit}"


async def test_a_records_generator_that_raises_fails_the_epoch_at_its_turn() -> None:
    got: list[str] = []

    async def read() -> None:
        async for record in Epoch(RaisingUnits(), 0, None, 2).samples():
            got.append(record)

    with pytest.raises(RuntimeError, match="a bug in the records generator"):  # never a hang
        await read()
    assert got == ["0a", "1a", "0b"]  # everything before the failing turn is delivered


# -- the dataset on its own ------------------------------------------------------------------------


async def test_samples_are_grouped_and_every_one_arrives_once(shards: list[str]) -> None:
    ds = TarDataset(shards, shards_in_flight=3)
    raws = [raw async for raw in ds]
    assert sorted(r["__key__"] for r in raws) == tar_keys(6, counts)
    first = next(r for r in raws if r["__key__"] == "000/0000")
    assert set(first) == {"__key__", "__url__", "bin", "cls"}
    assert first["__url__"] == shards[0]
    assert first["cls"] == b"0"
    await ds.aclose()


async def test_shuffling_depends_on_seed_and_epoch_only(shards: list[str]) -> None:
    def make(seed: int) -> TarDataset:
        return TarDataset(shards, shuffle=True, shuffle_buffer=5, seed=seed, shards_in_flight=2)

    a, b = make(0), make(0)
    first, second = await raw_keys(a), await raw_keys(a)  # epochs 0 and 1
    assert first == await raw_keys(b)
    assert first != second
    assert sorted(first) == sorted(second) == tar_keys(6, counts)
    assert first != await raw_keys(make(1))
    a.set_epoch(0)
    assert await raw_keys(a) == first
    plain = await raw_keys(TarDataset(shards, shards_in_flight=2))
    assert plain[:4] == ["000/0000", "001/0000", "000/0001", "001/0001"]  # round-robin


@settings(max_examples=12, deadline=None)
@given(cut=st.integers(0, 25), slots=st.integers(1, 3), buffer=st.sampled_from([0, 4, 40]))
def test_a_state_resumes_exactly_where_any_cut_left_off(
    tmp_path_factory: pytest.TempPathFactory, cut: int, slots: int, buffer: int
) -> None:
    asyncio.run(resume_at(shared_shards(tmp_path_factory), cut, slots, buffer))


async def resume_at(paths: list[str], cut: int, slots: int, buffer: int) -> None:
    options: dict[str, Any] = {"shards_in_flight": slots, "seed": 5}
    if buffer:
        options.update(shuffle=True, shuffle_buffer=buffer)
    ds = TarDataset(paths, **options)
    ds.set_epoch(1)
    full = await raw_keys(ds)
    assert len(full) == 25
    ds.set_epoch(1)
    it = aiter(ds)
    head = [(await anext(it))["__key__"] for _ in range(cut)]
    state = ds.state_dict()
    await it.aclose()  # type: ignore[attr-defined]
    resumed = TarDataset(paths, **options)
    resumed.load_state_dict(state)
    assert head + await raw_keys(resumed) == full
    assert resumed.state_dict()["epoch"] == 2  # the epoch ran to its end


_SHARED: dict[str, list[str]] = {}


def shared_shards(factory: pytest.TempPathFactory) -> list[str]:
    """Six shards (25 samples) written once per session, for the Hypothesis examples."""
    if "paths" not in _SHARED:
        _SHARED["paths"] = write_shards(factory.mktemp("tar"), 6)
    return _SHARED["paths"]


def test_a_state_of_another_order_is_refused(shards: list[str]) -> None:
    state = TarDataset(shards, shuffle=True, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1, this dataset has seed=2"):
        TarDataset(shards, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="lacks"):
        TarDataset(shards).load_state_dict({"epoch": 0})
    ranked = TarDataset(shards)
    ranked.set_rank(1, 2)
    elsewhere = TarDataset(shards)
    elsewhere.load_state_dict(ranked.state_dict())  # the rank may be told later ...
    with pytest.raises(ValueError, match=r"rank=\[1, 2\], this dataset has rank=\[0, 1\]"):
        aiter(elsewhere)  # ... but not another one


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"shards_in_flight": 0}, ValueError, "shards_in_flight"),
        ({"shuffle_buffer": -1}, ValueError, "shuffle_buffer"),
        ({"decode": 3}, TypeError, "decode"),
        ({"seed": "x"}, TypeError, "seed"),
    ],
)
def test_bad_arguments_are_named(
    shards: list[str], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        TarDataset(shards, **kwargs)


def test_no_shards_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        TarDataset([])


def test_a_broken_shard_record_pickles_and_raises_on_decode() -> None:
    import pickle

    record = pickle.loads(pickle.dumps(BrokenShard("http://x/s.tar", "a/1.jpg", "boom")))
    ds = TarDataset(["/nonexistent.tar"])
    with pytest.raises(ShardError, match=r"http://x/s.tar failed at member 'a/1.jpg': boom"):
        ds.decode(record)


# -- through the loader: local files, HTTP, S3 --------------------------------------------------


def test_workers_decode_and_every_sample_arrives_once(shards: list[str]) -> None:
    ds = TarDataset(shards, decode=tar_sample, shuffle=True, shuffle_buffer=8)
    with DataLoader(ds, batch_size=4, num_workers=2, collate_fn=keep) as loader:
        batches = list(loader)
    assert sorted(keys_of(batches)) == tar_keys(6, counts)
    pids = {sample["pid"] for batch in batches for sample in batch}
    assert pids
    assert os.getpid() not in pids  # decoded in the worker processes


async def test_an_abandoned_epoch_stops_its_readers_and_the_next_is_whole(
    shards: list[str],
) -> None:
    ds = TarDataset(shards, decode=tar_sample, shards_in_flight=2)
    async with DataLoader(ds, batch_size=2, collate_fn=keep) as loader:
        async for _batch in loader:
            break  # the stream is closed: its shard readers are cancelled and awaited
        assert sorted(keys_of([b async for b in loader])) == tar_keys(6, counts)
    tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith("aioloader-tar-")]
    assert tasks == []


def key_as_int(raw: dict[str, Any]) -> int:
    return int(raw["__key__"])  # "000/0000" is no int: a ValueError


def test_a_decode_error_keeps_its_type_and_names_the_sample(shards: list[str]) -> None:
    ds = TarDataset(shards, decode=key_as_int)
    with (
        DataLoader(ds, batch_size=2, collate_fn=keep) as loader,
        pytest.raises(ValueError, match="invalid literal") as info,
    ):
        next(iter(loader))
    notes = "\n".join(info.value.__notes__)
    assert f"decoding sample '000/0000' of {shards[0]}" in notes


@pytest.mark.slow
def test_loader_resume_is_exact_under_another_number_of_workers(shards: list[str]) -> None:
    def loader(workers: int) -> DataLoader:
        ds = TarDataset(shards, decode=tar_sample, shuffle=True, shuffle_buffer=6, seed=9)
        return DataLoader(ds, batch_size=3, num_workers=workers, collate_fn=keep, prefetch=4)

    with loader(0) as whole:
        full = keys_of(list(whole))
    for cut, first, then in ((2, 2, 0), (5, 0, 2)):
        with loader(first) as stopped:
            it = iter(stopped)
            head = keys_of([next(it) for _ in range(cut)])
            state = stopped.state_dict()
        with loader(then) as resumed:
            resumed.load_state_dict(state)
            assert head + keys_of(list(resumed)) == full


@pytest.fixture
def server() -> Iterator[FaultServer]:
    with FaultServer().in_thread() as served:
        for shard in range(8):
            served.files[f"s{shard}.tar"] = tar_shard(shard, counts(shard))
        yield served


async def test_http_shards_stream_concurrently(server: FaultServer) -> None:
    server.latency = 0.05  # every shard answers late: the readers' requests overlap
    urls = [server.file_url(f"s{shard}.tar") for shard in range(8)]
    ds = TarDataset(urls, decode=tar_sample, shards_in_flight=4)
    async with DataLoader(ds, batch_size=5, collate_fn=keep) as loader:
        batches = [batch async for batch in loader]
    assert sorted(keys_of(batches)) == tar_keys(8, counts)
    # The four open shards at once, and up to four more opened ahead.
    assert server.most_active >= 4
    assert all(server.count(f"/files/s{shard}.tar") == 1 for shard in range(8))


@pytest.mark.parametrize("on_error", ["raise", "skip"])
async def test_a_cut_http_shard_names_its_url_or_is_skipped(
    server: FaultServer, on_error: str
) -> None:
    server.files["s2.tar"] = tar_shard(2, 40, size=2000)  # half of it is a few samples
    server.fail_always("/files/s2.tar", Fault.short())  # every attempt breaks off
    urls = [server.file_url(f"s{shard}.tar") for shard in range(4)]
    ds = TarDataset(urls, decode=tar_sample, shards_in_flight=2)
    options: dict[str, Any] = {"on_error": on_error}
    if on_error == "skip":
        options["max_failures"] = 1
    async with DataLoader(ds, batch_size=4, collate_fn=keep, **options) as loader:
        if on_error == "raise":
            with pytest.raises(ShardError) as info:
                [batch async for batch in loader]
            assert info.value.url == urls[2]
            assert urls[2] in str(info.value)
            assert "RetriesExhaustedError" in str(info.value)  # as fetch() ends
            assert "gave up after 5 attempts" in str(info.value)  # the default max_attempts
            return
        keys = keys_of([batch async for batch in loader])
        assert loader.statistics().skipped_count == 1
    others = [k for k in tar_keys(4, counts) if not k.startswith("002/")]
    assert sorted(k for k in keys if not k.startswith("002/")) == others
    cut = sorted(k for k in keys if k.startswith("002/"))
    assert 0 < len(cut) < 40
    assert cut == [f"002/{i:04d}" for i in range(len(cut))]  # a prefix: nothing out of place


async def test_a_shard_that_breaks_off_once_continues_where_it_stopped(
    server: FaultServer,
) -> None:
    server.files["s2.tar"] = tar_shard(2, 40, size=2000)
    server.fail("/files/s2.tar", Fault.short(), Fault.reset())  # then served whole
    urls = [server.file_url(f"s{shard}.tar") for shard in range(4)]
    counts_here = {0: 3, 1: 4, 2: 40, 3: 6}
    async with DataLoader(TarDataset(urls), batch_size=4, collate_fn=keep) as loader:
        keys = [raw["__key__"] for batch in [b async for b in loader] for raw in batch]
        assert loader.statistics().remote_retries >= 2
    assert sorted(keys) == tar_keys(4, counts_here.__getitem__)  # nothing lost or repeated
    assert server.count("/files/s2.tar") == 3


async def test_a_streamed_shard_is_in_flight_until_its_body_ends() -> None:
    async with FaultServer() as server:
        server.files["s0.tar"] = tar_shard(0, 40, size=2000)
        server.fail("/files/s0.tar", Fault.hold())  # half the body, then held
        ds = TarDataset([server.file_url("s0.tar")], decode=tar_sample)
        async with DataLoader(ds, batch_size=4, collate_fn=keep) as loader:
            epoch = asyncio.ensure_future(collect(loader))
            await until(lambda: server.holding == 1 and loader.statistics().bytes_read > 0)
            # Its headers and part of its body arrived; the rest is still to come.
            assert loader.statistics().requests_in_flight == 1
            server.release()
            batches = await epoch
            assert loader.statistics().requests_in_flight == 0
    assert sorted(keys_of(batches)) == tar_keys(1, lambda _: 40)


async def test_a_stalled_shard_body_is_warned_and_counted_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "aioloader.remote")
    async with FaultServer() as server:
        server.files["s0.tar"] = tar_shard(0, 40, size=2000)
        server.fail("/files/s0.tar", Fault.hold())
        url = server.file_url("s0.tar")
        source = HTTPDataset([url], stall_warning=0.2, read_timeout=60)
        ds = TarDataset(None, source=source, decode=tar_sample)
        async with DataLoader(ds, batch_size=4, collate_fn=keep) as loader:
            epoch = asyncio.ensure_future(collect(loader))
            await until(lambda: loader.statistics().remote_stalls > 0)
            server.release()
            batches = await epoch
            stats = loader.statistics()
    assert sorted(keys_of(batches)) == tar_keys(1, lambda _: 40)  # it went on, whole
    [record] = [r for r in caplog.records if r.name == "aioloader.remote"]
    assert url in record.getMessage()
    assert "no byte after" in record.getMessage()
    assert "stall_warning=0.2" in record.getMessage()
    assert (stats.remote_stalls, stats.remote_retries) == (1, 0)


async def test_a_missing_http_shard_is_a_shard_error_naming_it(server: FaultServer) -> None:
    urls = [server.file_url("s0.tar"), server.file_url("gone.tar")]
    async with DataLoader(TarDataset(urls), batch_size=2, collate_fn=keep) as loader:
        with pytest.raises(ShardError, match=r"gone\.tar failed before its first member: "):
            [batch async for batch in loader]


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_corrupt_local_shard_names_the_member_or_is_skipped(
    tmp_path: Path, on_error: str
) -> None:
    paths = write_shards(tmp_path, 3)
    data = bytearray(Path(paths[1]).read_bytes())
    data[2 * 1024 + 100] ^= 0xFF  # the header of 001/0001.bin, after 001/0000's two members
    Path(paths[1]).write_bytes(bytes(data))
    ds = TarDataset(paths, decode=tar_sample)
    options: dict[str, Any] = {"on_error": on_error}
    if on_error == "skip":
        options["max_failures"] = 1
    with DataLoader(ds, batch_size=2, collate_fn=keep, **options) as loader:
        if on_error == "raise":
            with pytest.raises(ShardError, match="checksum") as info:
                list(loader)
            assert info.value.url == paths[1]
            assert info.value.member == "001/0000.cls"
            assert f"tar shard {paths[1]} failed at member '001/0000.cls'" in str(info.value)
            return
        keys = keys_of(list(loader))
        assert loader.statistics().skipped_count == 1
    # 001/0000 was not complete yet when the shard broke (a next member might have been its):
    # it goes with the rest of the shard.
    assert sorted(keys) == [k for k in tar_keys(3, counts) if not k.startswith("001/")]


def test_a_shard_cut_in_a_new_samples_member_delivers_the_whole_sample_before(
    tmp_path: Path,
) -> None:
    # Cut inside the data of 000/0002.bin: 000/0001 ended before it (the members of a sample
    # are consecutive), so it is whole and arrives; the skip names the member that broke.
    data = tar_shard(0, 4, size=600)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        broken = tar.getmember("000/0002.bin")
    path = tmp_path / "cut.tar"
    path.write_bytes(data[: broken.offset_data + 100])
    ds = TarDataset([str(path)], decode=tar_sample)
    options: dict[str, Any] = {"on_error": "skip", "max_failures": 1}
    with DataLoader(ds, batch_size=2, collate_fn=keep, **options) as loader:
        keys = keys_of(list(loader))
        assert loader.statistics().skipped_count == 1
    assert keys == ["000/0000", "000/0001"]


def test_a_shard_cut_in_a_long_name_record_keeps_the_sample_before_for_the_error(
    tmp_path: Path,
) -> None:
    # The cut record (a GNU long name) may name one more member of the sample before it: that
    # sample is not known whole, so it goes with the shard's error.
    out = io.BytesIO()
    stem = "d" * 120  # past 100 characters: a long-name record before each header
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in ((f"{stem}/s0.bin", b"a"), (f"{stem}/s0.cls", b"0")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path = tmp_path / "long.tar"
    path.write_bytes(out.getvalue()[: 2 * 1024 + 600])  # inside s0.cls's long-name record
    ds = TarDataset([str(path)], decode=tar_sample)
    options: dict[str, Any] = {"on_error": "skip", "max_failures": 1}
    with DataLoader(ds, batch_size=2, collate_fn=keep, **options) as loader:
        assert keys_of(list(loader)) == []
        assert loader.statistics().skipped_count == 1


def test_a_member_whose_padding_is_cut_says_so() -> None:
    data = tar_shard(0, 1, size=1)  # 000/0000.bin: one byte of data, then 511 of padding
    cut = 512 + 1 + 100
    parser = TarParser()
    parser.feed(data[:cut])
    with pytest.raises(TarFormatError, match=r"padding after member '000/0000\.bin'") as info:
        parser.close()
    assert "stops after 100 of 511 bytes" in str(info.value)


def test_s3_shards_through_moto(moto_tar: tuple[str, list[str]]) -> None:
    endpoint, urls = moto_tar
    ds = TarDataset(
        urls, decode=tar_sample, storage_options=s3_options(endpoint), shards_in_flight=2
    )
    with DataLoader(ds, batch_size=4, collate_fn=keep) as loader:
        assert sorted(keys_of(list(loader))) == tar_keys(3, counts)


@pytest.fixture(scope="module")
def moto_tar() -> Iterator[tuple[str, list[str]]]:
    shards = {f"s{shard}.tar": tar_shard(shard, counts(shard)) for shard in range(3)}
    with moto_s3({"tars": shards}) as endpoint:
        yield endpoint, [f"s3://tars/{key}" for key in shards]


def test_exported() -> None:
    assert aioloader.sources.TarDataset is TarDataset
    assert aioloader.ShardError is ShardError
