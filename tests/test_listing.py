"""Listing prefixes, globs and index files: against moto's S3 server on loopback (one for the
module), the loopback HTTP test server, fsspec's in-memory filesystem and real directories.
"""

from __future__ import annotations

import asyncio
import errno
import pathlib
from collections.abc import Iterator
from typing import Any

import aiobotocore.session
import fsspec
import pytest
from helpers import BOUND_S, Sleeps
from http_server import Fault, FaultServer, payload
from s3_server import moto_s3, s3_options

from aioloader._errors import RemoteNotFoundError
from aioloader.sources import (
    FileDataset,
    FsspecDataset,
    HTTPDataset,
    RetryPolicy,
    alist_objects,
    list_objects,
    read_index,
)

BUCKET = "listing"
#: More than one S3 page (1,000 keys): listing them all takes a second request.
MANY = 1001
SHARDS = [f"train/shard-{i:03d}.tar" for i in range(5)]
OTHERS = ["train/shard-003.idx", "train/sub/shard-100.tar", "train/sub/deeper/shard-200.tar"]
FAST = RetryPolicy(max_attempts=3, backoff_initial=0.01, backoff_max=1.0, jitter=False)


def s3(key: str) -> str:
    return f"s3://{BUCKET}/{key}"


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    keys = {f"many/key-{i:05d}": b"" for i in range(MANY)}
    # Put in reverse so the store's insertion order is not the sorted order.
    keys |= {name: name.encode() for name in reversed(SHARDS + OTHERS)}
    keys |= {"marker/": b"", "marker/a": b"a"}  # a "directory marker" key, as consoles make
    with moto_s3({BUCKET: keys}) as url:
        yield url


class Calls:
    """A before-call hook that counts the S3 calls of one operation and lets them through."""

    def __init__(self, operation: str) -> None:
        self.operation = operation
        self.count = 0

    def __call__(self, **_: Any) -> None:
        self.count += 1

    def session(self) -> aiobotocore.session.AioSession:
        session = aiobotocore.session.AioSession()
        session.register(f"before-call.s3.{self.operation}", self)
        return session


# -- object stores ----------------------------------------------------------------------------


async def test_lists_past_one_page_of_keys(endpoint: str) -> None:
    pages = Calls("ListObjectsV2")
    options = s3_options(endpoint, session=pages.session())
    got = await alist_objects(s3("many/"), storage_options=options)
    assert got == [s3(f"many/key-{i:05d}") for i in range(MANY)]
    assert pages.count == 2  # 1,000 keys, then the last one: every page was read


def test_glob_matches_one_level_and_double_star_any_depth(endpoint: str) -> None:
    options = s3_options(endpoint)
    assert list_objects(s3("train/*.tar"), storage_options=options) == [s3(key) for key in SHARDS]
    deep = list_objects(s3("train/**/*.tar"), storage_options=options)
    assert deep == sorted(s3(key) for key in SHARDS + OTHERS if key.endswith(".tar"))


def test_prefix_lists_everything_below_sorted_without_markers(endpoint: str) -> None:
    options = s3_options(endpoint)
    expected = sorted(s3(key) for key in SHARDS + OTHERS)
    assert list_objects(s3("train/"), storage_options=options) == expected
    assert list_objects(s3("train"), storage_options=options) == expected
    assert list_objects(s3("marker/"), storage_options=options) == [s3("marker/a")]
    # One object named in full is its own listing.
    assert list_objects(s3(SHARDS[0]), storage_options=options) == [s3(SHARDS[0])]


def test_order_is_deterministic_and_patterns_keep_theirs(endpoint: str) -> None:
    options = s3_options(endpoint)
    patterns = [s3("train/sub/"), s3("train/*.tar"), s3("train/sub/shard-100.tar")]
    first = list_objects(patterns, storage_options=options)
    again = list_objects(patterns, storage_options=options)
    assert (
        first
        == again
        == [
            s3("train/sub/deeper/shard-200.tar"),
            s3("train/sub/shard-100.tar"),  # listed twice, kept where first listed
            *[s3(key) for key in SHARDS],
        ]
    )


@pytest.mark.parametrize(
    "url", [s3("nothing-here/"), s3("train/*.zip"), "s3://no-such-bucket/train/"]
)
def test_missing_prefix_or_empty_listing_names_the_url(endpoint: str, url: str) -> None:
    with pytest.raises(RemoteNotFoundError) as info:
        list_objects(url, storage_options=s3_options(endpoint), retry=FAST)
    assert isinstance(info.value, FileNotFoundError)
    assert url in str(info.value)
    assert info.value.url == url


async def test_one_missing_pattern_fails_the_listing(endpoint: str) -> None:
    with pytest.raises(RemoteNotFoundError) as info:
        await alist_objects([s3("train/"), s3("absent/")], storage_options=s3_options(endpoint))
    assert info.value.url == s3("absent/")


def test_from_prefix_reads_the_listed_objects(endpoint: str) -> None:
    ds = FsspecDataset.from_prefix(
        s3("train/*.tar"), decode=bytes.decode, storage_options=s3_options(endpoint)
    )
    assert ds.urls == tuple(s3(key) for key in SHARDS)

    async def read() -> list[str]:
        async with ds:
            return list(await asyncio.gather(*(ds[i] for i in range(len(ds)))))

    assert asyncio.run(read()) == SHARDS


async def test_sync_listing_works_inside_a_running_loop(endpoint: str) -> None:
    # A notebook runs a loop in the caller's thread: the listing runs on a helper thread.
    urls = list_objects(s3("train/*.tar"), storage_options=s3_options(endpoint))
    assert urls == [s3(key) for key in SHARDS]
    ds = FsspecDataset.from_prefix(s3("marker/"), storage_options=s3_options(endpoint))
    assert ds.urls == (s3("marker/a"),)


def test_any_fsspec_filesystem_even_a_synchronous_one() -> None:
    memory = fsspec.filesystem("memory")
    names = ["b/x.npy", "a/y.npy", "a/z.txt"]
    try:
        for name in names:
            memory.pipe(f"/listing-test/{name}", b"1")
        assert list_objects("memory://listing-test/**/*.npy") == [
            "memory://listing-test/a/y.npy",
            "memory://listing-test/b/x.npy",
        ]
        assert len(list_objects("memory://listing-test/")) == 3
        with pytest.raises(RemoteNotFoundError, match="memory://listing-test/c/"):
            list_objects("memory://listing-test/c/")
    finally:
        memory.rm("/listing-test", recursive=True)


# -- refused at construction ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("urls", "named"),
    [
        (["s3://b/train/"], "urls[0]='s3://b/train/'"),
        ("s3://b/*.npy", "urls[0]='s3://b/*.npy'"),
        (["s3://b/k", "s3://b/shard-?.tar"], "urls[1]='s3://b/shard-?.tar'"),
    ],
)
def test_a_prefix_or_glob_as_one_object_is_refused(urls: Any, named: str) -> None:
    with pytest.raises(ValueError, match="is a prefix or a glob") as info:
        FsspecDataset(urls)
    assert named in str(info.value)
    assert "FsspecDataset.from_prefix" in str(info.value)
    assert "list_objects" in str(info.value)


@pytest.mark.parametrize(
    "url", ["https://host/a?version=2", "s3://b/img[1].png", "s3://b/k?versionId=3Lg8"]
)
def test_queries_versions_and_brackets_are_not_patterns(url: str) -> None:
    assert FsspecDataset([url]).urls == (url,)


def test_a_local_directory_or_glob_as_one_file_is_refused(tmp_path: pathlib.Path) -> None:
    for given in (f"{tmp_path}/", str(tmp_path / "*.npy")):
        with pytest.raises(ValueError, match=r"paths\[0\]=.*directory or a glob") as info:
            FileDataset(given)
        assert "FileDataset.from_prefix" in str(info.value)
    odd = tmp_path / "what?.npy"  # a real file whose name holds a wildcard is one file
    odd.write_bytes(b"1")
    assert FileDataset([odd]).paths == (str(odd),)


# -- local files ------------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: pathlib.Path) -> pathlib.Path:
    for name in ["b/2.npy", "a/1.npy", "a/deep/3.npy", "a/notes.txt", "c/.hidden.npy"]:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(name.encode())
    (tmp_path / "empty").mkdir()
    return tmp_path


def test_local_directory_glob_and_file(tree: pathlib.Path) -> None:
    root = str(tree)
    every = ["a/1.npy", "a/deep/3.npy", "a/notes.txt", "b/2.npy", "c/.hidden.npy"]
    assert list_objects(root) == [f"{root}/{name}" for name in every]
    assert list_objects(f"file://{root}/a") == [f"{root}/{name}" for name in every[:3]]
    assert list_objects(f"{root}/*/*.npy") == [f"{root}/a/1.npy", f"{root}/b/2.npy"]
    assert list_objects(f"{root}/**/*.npy") == [
        f"{root}/a/1.npy",
        f"{root}/a/deep/3.npy",
        f"{root}/b/2.npy",
    ]
    assert list_objects(tree / "b" / "2.npy") == [f"{root}/b/2.npy"]
    ds = FileDataset.from_prefix(tree / "a", decode=bytes.decode)
    assert asyncio.run(ds[0]) == "a/1.npy"


@pytest.mark.parametrize("name", ["missing", "empty", "*.zip"])
def test_local_nothing_found_names_the_path(tree: pathlib.Path, name: str) -> None:
    with pytest.raises(FileNotFoundError) as info:
        list_objects(tree / name)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(tree / name)


# -- index files over HTTP --------------------------------------------------------------------


INDEX = b"""\xef\xbb\xbf# shards of the training set
shard-0.bin

  ../obj/1
/obj/2
http://other.example/abs.bin
"""


async def test_index_resolves_relative_urls_in_file_order() -> None:
    async with FaultServer() as server:
        index = server.put("/data/train/index.txt", INDEX)
        assert await read_index(index) == [
            server.url("/data/train/shard-0.bin"),
            server.url("/data/obj/1"),
            server.url("/obj/2"),
            "http://other.example/abs.bin",
        ]


async def test_index_is_retried_and_missing_or_empty_is_named() -> None:
    sleeps = Sleeps()
    async with FaultServer() as server:
        index = server.put("/index.txt", b"/obj/3\n")
        server.fail("/index.txt", Fault.http(503))
        assert await read_index(index, retry=FAST, sleep=sleeps) == [server.obj_url(3)]
        assert server.count("/index.txt") == 2
        assert sleeps == pytest.approx([0.01])
        missing = server.url("/nope.txt")
        with pytest.raises(RemoteNotFoundError, match=r"nope\.txt") as info:
            await alist_objects(missing)
        assert info.value.url == missing
        empty = server.put("/empty.txt", b"# nothing yet\n\n")
        with pytest.raises(RemoteNotFoundError, match="lists no URL") as info:
            await alist_objects(empty)
        assert info.value.url == empty


class GatedServer(FaultServer):
    """Answers no file request until ``count`` of them are in flight at once (or the bound
    passed: then 503), so a listing that read its patterns one after another would fail."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.count_to = count
        self.arrived = 0
        self.all_in = asyncio.Event()

    async def _handle_file(self, request: Any) -> Any:
        self.arrived += 1
        if self.arrived >= self.count_to:
            self.all_in.set()
        try:
            async with asyncio.timeout(BOUND_S):
                await self.all_in.wait()
        except TimeoutError:
            from aiohttp import web

            return web.Response(status=503, text="the listings did not overlap")
        return await super()._handle_file(request)


async def test_patterns_are_listed_concurrently() -> None:
    async with GatedServer(3) as server:
        indexes = [server.put(f"/{i}.txt", f"/obj/{i}\n".encode()) for i in range(3)]
        got = await alist_objects(indexes, retry=RetryPolicy(max_attempts=1))
    assert got == [server.obj_url(i) for i in range(3)]


def test_from_index_reads_the_listed_objects() -> None:
    with FaultServer().in_thread() as server:
        index = server.put("/index.txt", b"/obj/4\n/obj/5\n")
        ds = HTTPDataset.from_index(index)

        async def read() -> list[bytes]:
            async with ds:
                return [await ds.fetch(0), await ds.fetch(1)]

        assert asyncio.run(read()) == [payload(4), payload(5)]


def test_http_glob_is_refused_before_any_request() -> None:
    with pytest.raises(ValueError, match=r"cannot be globbed.*index file"):
        list_objects("https://host/data/*.tar")
