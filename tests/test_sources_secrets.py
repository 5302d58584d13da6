"""Secrets in URLs never shown, objects too large refused (RELIABILITY.md rows 37 and 38).

Every source is driven down its error paths with URLs that carry credentials the ways people
write them (presigned S3 and GCS queries, an Azure SAS ``sig``, a token, ``user:password@``),
against the loopback HTTP server and moto's S3 server. Then the secret must be absent from the
exception as a traceback prints it (the whole chain, notes included), from every ``aioloader``
log record at DEBUG, and from the ``repr`` of the dataset, the loader and its statistics; and
the server must still have received it. The size bounds are tested by the error and by skip.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import tarfile
import traceback
import tracemalloc
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiobotocore.session
import pytest
from datasets import keep, parquet_bytes, tar_digest, tar_sample, tar_shard
from helpers import Sleeps
from http_server import Fault, FaultServer, payload
from s3_server import moto_s3, s3_options

import aioloader.sources as sources
from aioloader import DataLoader
from aioloader._errors import (
    RemoteError,
    RemoteNotFoundError,
    RemoteTimeoutError,
    RetriesExhaustedError,
    ShardError,
)
from aioloader.sources import (
    FileDataset,
    FsspecDataset,
    HTTPDataset,
    ParquetDataset,
    RetryPolicy,
    TarDataset,
    alist_objects,
)
from aioloader.sources._base import ListedName
from aioloader.sources._redact import MARKER, redact

SECRET = "Zq7SECRETq7Z"
FAST = RetryPolicy(max_attempts=2, backoff_initial=0.01, backoff_max=0.1, jitter=False)
BUCKET = "aiol-secrets"

#: How each kind of URL carries the secret: (query or None, userinfo or None).
KINDS: dict[str, tuple[str | None, str | None]] = {
    "s3-presigned": (
        f"X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA{SECRET}%2F20240101"
        f"&X-Amz-Security-Token={SECRET}tok&X-Amz-Signature={SECRET}sig",
        None,
    ),
    "gcs-presigned": (f"X-Goog-Credential=svc{SECRET}&X-Goog-Signature={SECRET}", None),
    "azure-sas": (f"sv=2022-11-02&se=2030-01-01&sp=r&sig={SECRET}%3D", None),
    "token": (f"access_token={SECRET}&v=1", None),
    "userinfo": (None, f"reader:{SECRET}"),
}


def secret_url(server: FaultServer, path: str, kind: str) -> str:
    query, userinfo = KINDS[kind]
    url = server.url(path)
    if userinfo is not None:
        url = url.replace("://", f"://{userinfo}@", 1)
    return url if query is None else f"{url}?{query}"


def sent_the_secret(server: FaultServer, kind: str) -> bool:
    """Whether the server received the secret: in the query, or as Basic credentials."""
    query, userinfo = KINDS[kind]
    if query is not None:
        return any(SECRET in path for path, _ in server.received)
    assert userinfo is not None
    basic = "Basic " + base64.b64encode(userinfo.encode()).decode()
    return any(auth == basic for _, auth in server.received)


def shown(exc: BaseException) -> str:
    """Everything a traceback prints of ``exc``: the chain, the messages, the notes."""
    return "".join(traceback.format_exception(exc))


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="aioloader")
    return caplog


def logged(caplog: pytest.LogCaptureFixture) -> str:
    """Every aioloader record as a handler formats it (message and traceback)."""
    formatter = logging.Formatter("%(name)s %(message)s")
    return "\n".join(formatter.format(r) for r in caplog.records if r.name.startswith("aioloader"))


def assert_hidden(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text, text


# -- the rule ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (
            "https://b.s3.amazonaws.com/k.bin?X-Amz-Signature=abc&X-Amz-Date=1",
            f"https://b.s3.amazonaws.com/k.bin?X-Amz-Signature={MARKER}&X-Amz-Date=1",
        ),
        ("https://u:p%40ss@h/a", f"https://u:{MARKER}@h/a"),
        ("https://u@h:8080/a?size=3", f"https://{MARKER}@h:8080/a?size=3"),  # may be a token
        ("url='http://h/x?sig=a%2Fb#frag'", f"url='http://h/x?sig={MARKER}#frag'"),
        ("http://h/x?Token=t;sessiontoken=s", f"http://h/x?Token={MARKER};sessiontoken={MARKER}"),
        ("not a url: a=b & c", "not a url: a=b & c"),
        ("http://h/x?key=", "http://h/x?key="),
    ],
)
def test_the_rule_masks_passwords_and_credential_parameters_only(given: str, expected: str) -> None:
    assert redact(given) == expected


def test_users_add_parameter_names() -> None:
    url = "https://h/a?my_auth=hush&page=2"
    assert redact(url) == url
    sources.add_credential_parameters("My_Auth")
    assert redact(url) == f"https://h/a?my_auth={MARKER}&page=2"
    with pytest.raises(TypeError, match="non-empty string"):
        sources.add_credential_parameters("")


# -- every error path, every source ------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
async def test_http_errors_logs_and_reprs_never_show_the_secret(
    kind: str, logs: pytest.LogCaptureFixture
) -> None:
    async with FaultServer() as server:
        paths = {"missing": "/obj/1", "503": "/obj/2", "stall": "/obj/3", "short": "/obj/4"}
        urls = {name: secret_url(server, path, kind) for name, path in paths.items()}
        server.fail_always("/obj/1", Fault.http(404))
        server.fail_always("/obj/2", Fault.http(503, retry_after="0"))
        server.fail_always("/obj/3", Fault.stall(30))
        server.fail_always("/obj/4", Fault.short())
        ds = HTTPDataset(
            list(urls.values()), retry=FAST, sleep=Sleeps(), read_timeout=0.2, stall_warning=0.05
        )
        errors: dict[str, RemoteError] = {}
        async with ds:
            for position, name in enumerate(urls):
                with pytest.raises(RemoteError) as info:
                    await ds.fetch(position)
                errors[name] = info.value
            with pytest.raises(RemoteError) as streamed:
                async for _ in ds.stream(1):
                    pass
    assert isinstance(errors["missing"], RemoteNotFoundError)
    assert isinstance(errors["503"], RetriesExhaustedError)
    assert isinstance(errors["stall"], RemoteTimeoutError)
    assert isinstance(errors["short"], RetriesExhaustedError)
    for error in [*errors.values(), streamed.value]:
        text = shown(error)
        assert_hidden(text, *error.attempts)
        assert f"127.0.0.1:{server.port}/obj/" in text  # the object failing is still named
    if KINDS[kind][0] is not None:
        assert MARKER in shown(errors["503"])
    assert errors["503"].url == urls["503"]  # the program's own value, as given
    assert "retrying" in logged(logs)  # the retries were logged, masked
    assert "stalls" in logged(logs)
    assert_hidden(logged(logs), repr(ds), ds.item_name(0))
    assert sent_the_secret(server, kind)


@pytest.mark.parametrize("kind", ["s3-presigned", "userinfo"])
async def test_a_loader_skipping_secret_urls_shows_none_in_statistics_or_repr(
    kind: str, logs: pytest.LogCaptureFixture
) -> None:
    async with FaultServer() as server:
        server.fail_always("/obj/1", Fault.http(404))
        server.fail_always("/obj/2", Fault.http(503))
        urls = [secret_url(server, f"/obj/{i}", kind) for i in range(4)]
        ds = HTTPDataset(urls, retry=FAST, sleep=Sleeps())
        options: dict[str, Any] = {"on_error": "skip", "max_failures": 2, "collate_fn": keep}
        async with DataLoader(ds, batch_size=4, **options) as loader:
            batches = [batch async for batch in loader]
            stats = loader.statistics()
            assert_hidden(repr(loader), repr(stats), str(stats.skipped))
        async with DataLoader(ds, batch_size=4, collate_fn=keep) as loader:
            with pytest.raises(RemoteNotFoundError) as info:
                [batch async for batch in loader]
    assert [len(batch) for batch in batches] == [2]
    assert stats.skipped_count == 2
    assert f"127.0.0.1:{server.port}/obj/1" in str(stats.skipped)
    assert_hidden(shown(info.value), logged(logs))
    assert sent_the_secret(server, kind)


@pytest.mark.parametrize("kind", ["s3-presigned", "azure-sas", "userinfo"])
async def test_fsspec_over_http_errors_never_show_the_secret(
    kind: str, logs: pytest.LogCaptureFixture
) -> None:
    async with FaultServer() as server:
        server.fail_always("/obj/1", Fault.http(404))
        server.fail_always("/obj/2", Fault.http(503))
        urls = [secret_url(server, f"/obj/{i}", kind) for i in (1, 2)]
        async with FsspecDataset(urls, retry=FAST, sleep=Sleeps()) as ds:
            with pytest.raises(RemoteNotFoundError) as missing:
                await ds.fetch(0)
            with pytest.raises(RetriesExhaustedError) as exhausted:
                await ds.fetch(1)
            with pytest.raises(RemoteError) as sized:
                await ds.size(1)
    for error in (missing.value, exhausted.value, sized.value):
        assert_hidden(shown(error))
        assert f"127.0.0.1:{server.port}/obj/" in shown(error)
    assert_hidden(logged(logs), repr(ds))
    assert sent_the_secret(server, kind)


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    objects = {f"obj-{i}": payload(i, 3000) for i in range(2)}
    with moto_s3({BUCKET: objects}) as endpoint:
        yield endpoint


async def test_s3_errors_never_show_a_secret_in_a_key(
    moto_endpoint: str, logs: pytest.LogCaptureFixture
) -> None:
    # Keys that carry a token (taken from a listing, so read literally): one missing (s3fs
    # raises FileNotFoundError(path)), one throttled until the attempts run out.
    keys = [ListedName(f"s3://{BUCKET}/{name}?token={SECRET}") for name in ("missing", "obj-0")]
    session = aiobotocore.session.AioSession()
    session.register("before-call.s3.GetObject", _slow_down_obj_0)
    options = s3_options(moto_endpoint, session=session)
    async with FsspecDataset(keys, retry=FAST, sleep=Sleeps(), storage_options=options) as ds:
        with pytest.raises(RemoteNotFoundError) as missing:
            await ds.fetch(0)
        with pytest.raises(RetriesExhaustedError) as throttled:
            await ds.fetch(1)
    for error in (missing.value, throttled.value):
        assert_hidden(shown(error))
    assert f"s3://{BUCKET}/missing?token={MARKER}" in str(missing.value)
    assert "SlowDown" in str(throttled.value)
    assert_hidden(logged(logs), repr(ds))


def _slow_down_obj_0(params: dict[str, Any], **_: Any) -> tuple[Any, dict[str, Any]] | None:
    """A before-call hook: GetObject of ``obj-0...`` answers S3's SlowDown; others go on."""
    if not str(params.get("url_path", "")).split("/")[-1].startswith("obj-0"):
        return None
    http = types.SimpleNamespace(status_code=503, headers={}, content=b"")
    return http, {
        "Error": {"Code": "SlowDown", "Message": "injected SlowDown"},
        "ResponseMetadata": {"HTTPStatusCode": 503, "HTTPHeaders": {}},
    }


async def test_file_errors_never_show_a_secret_in_a_path(tmp_path: Path) -> None:
    path = tmp_path / f"a?token={SECRET}.bin"
    path.write_bytes(b"x")
    ds = FileDataset([str(path)])
    path.unlink()
    with pytest.raises(FileNotFoundError) as missing:
        await ds.fetch(0)
    with pytest.raises(ValueError, match="a directory or a glob") as refused:
        FileDataset([str(path)])
    with pytest.raises(FileNotFoundError) as listed:
        await alist_objects(str(tmp_path / f"*?token={SECRET}"))
    for error in (missing.value, refused.value, listed.value):
        assert_hidden(shown(error))
    assert str(tmp_path) in shown(missing.value)
    assert_hidden(repr(ds), ds.item_name(0))


async def test_tar_parquet_and_listing_errors_never_show_the_secret(
    logs: pytest.LogCaptureFixture,
) -> None:
    kind = "s3-presigned"
    async with FaultServer() as server:
        server.files["s0.tar"] = tar_shard(0, 4)
        server.fail_always("/files/s1.tar", Fault.http(404))
        shards = [secret_url(server, f"/files/s{i}.tar", kind) for i in range(2)]
        tar = TarDataset(shards, decode=tar_sample, source=None)
        for on_error in ("raise", "skip"):
            options: dict[str, Any] = {"on_error": on_error, "collate_fn": keep}
            if on_error == "skip":
                options["max_failures"] = 1
            async with DataLoader(tar, batch_size=2, **options) as loader:
                if on_error == "raise":
                    with pytest.raises(ShardError) as broken:
                        [batch async for batch in loader]
                else:
                    assert len([s async for batch in loader for s in batch]) == 4
                    assert_hidden(repr(loader.statistics()), repr(loader))
        server.fail_always("/files/t.parquet", Fault.http(404))
        parquet = ParquetDataset(secret_url(server, "/files/t.parquet", kind), retry=FAST)
        async with DataLoader(parquet, batch_size=2, collate_fn=keep) as loader:
            with pytest.raises(ShardError) as footer:
                [batch async for batch in loader]
        with pytest.raises(RemoteNotFoundError) as index:
            await alist_objects(secret_url(server, "/index.txt", kind), retry=FAST)
        server.put("/empty.txt", b"# nothing\n")
        with pytest.raises(RemoteNotFoundError) as empty:
            await alist_objects(secret_url(server, "/empty.txt", kind), retry=FAST)
    for error in (broken.value, footer.value, index.value, empty.value):
        assert_hidden(shown(error))
        assert f"127.0.0.1:{server.port}/" in shown(error)
    assert_hidden(repr(tar), repr(parquet), logged(logs))
    assert sent_the_secret(server, kind)


# -- the size bound ----------------------------------------------------------------------------


@pytest.mark.parametrize("on_error", ["raise", "skip"])
async def test_a_content_length_over_the_bound_is_refused_before_the_body(on_error: str) -> None:
    async with FaultServer(size=5000) as server:
        urls = [secret_url(server, f"/obj/{i}", "token") for i in range(3)]
        urls[1] = urls[1].replace("&v=1", "&v=1&size=100")  # one object within the bound
        ds = HTTPDataset(urls, retry=FAST, max_object_bytes=4096)
        if on_error == "raise":
            async with ds:
                with pytest.raises(RemoteError) as info:
                    await ds.fetch(0)
            message = str(info.value)
            assert "5000 bytes" in message
            assert "max_object_bytes=4096" in message
            assert server.url("/obj/0") in message
            assert_hidden(shown(info.value))
            assert server.count("/obj/0") == 1  # refused, never retried
            return
        options: dict[str, Any] = {"on_error": "skip", "max_failures": 2, "collate_fn": keep}
        async with DataLoader(ds, batch_size=3, **options) as loader:
            batches = [batch async for batch in loader]
            stats = loader.statistics()
    assert [len(b) for b in batches] == [1]
    assert stats.skipped_count == 2
    assert "max_object_bytes=4096" in stats.skipped[0][1]


async def test_an_endless_chunked_body_is_refused_holding_about_the_bound() -> None:
    bound = 2 << 20
    async with FaultServer() as server:
        server.fail_always("/obj/0", Fault.endless())
        async with HTTPDataset([server.obj_url(0)], retry=FAST, max_object_bytes=bound) as ds:
            tracemalloc.start()
            try:
                with pytest.raises(RemoteError) as info:
                    await ds.fetch(0)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
    assert "a body without a length that passed 2097152 bytes" in str(info.value)
    assert "max_object_bytes=2097152" in str(info.value)
    assert peak < 3 * bound, peak  # the body held up to the bound and one read, no more
    assert server.count("/obj/0") == 1


@pytest.mark.parametrize("on_error", ["raise", "skip"])
async def test_an_endless_body_through_fsspec_is_refused_or_skipped(on_error: str) -> None:
    async with FaultServer() as server:
        server.fail_always("/obj/0", Fault.endless())
        ds = FsspecDataset(
            [server.obj_url(0), server.obj_url(1)], retry=FAST, max_object_bytes=1 << 20
        )
        options: dict[str, Any] = {"on_error": on_error, "collate_fn": keep}
        if on_error == "skip":
            options["max_failures"] = 1
        async with DataLoader(ds, batch_size=2, **options) as loader:
            if on_error == "raise":
                with pytest.raises(RemoteError, match="max_object_bytes=1048576"):
                    [batch async for batch in loader]
                return
            batches = [batch async for batch in loader]
    assert batches == [[payload(1)]]


async def test_s3_objects_over_the_bound_are_refused_by_their_size(moto_endpoint: str) -> None:
    urls = [f"s3://{BUCKET}/obj-0", f"s3://{BUCKET}/obj-1"]
    options = s3_options(moto_endpoint)
    async with FsspecDataset(urls, storage_options=options, max_object_bytes=2999) as ds:
        with pytest.raises(RemoteError, match=r"3000 bytes .*max_object_bytes=2999"):
            await ds.fetch(0)
    async with FsspecDataset(urls, storage_options=options, max_object_bytes=3000) as ds:
        assert await ds.fetch(1) == payload(1, 3000)


async def test_local_files_over_the_bound_are_refused(tmp_path: Path) -> None:
    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    big.write_bytes(bytes(5000))
    small.write_bytes(b"ok")
    ds = FileDataset([str(big), str(small)], max_object_bytes=4096)
    with pytest.raises(OSError, match=r"5000 bytes .*max_object_bytes=4096") as info:
        await ds.fetch(0)
    assert info.value.errno == __import__("errno").EFBIG
    assert await ds.fetch(1) == b"ok"
    read, write = os.pipe()  # no size to go by: refused while read
    os.write(write, bytes(5000))
    os.close(write)
    try:
        pipe = FileDataset([f"/proc/self/fd/{read}"], max_object_bytes=4096)
        with pytest.raises(OSError, match="a body without a length"):
            await pipe.fetch(0)
    finally:
        os.close(read)
    with pytest.raises(ValueError, match="max_object_bytes"):
        FileDataset([str(big)], max_object_bytes=0)


def _shard_with_a_large_member(size: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in (("s/0000.bin", b"a"), ("s/0001.bin", bytes(size)), ("s/0002.bin", b"c")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize("on_error", ["raise", "skip"])
async def test_a_tar_member_over_the_bound_ends_its_shard_or_is_skipped(on_error: str) -> None:
    async with FaultServer() as server:
        server.files["big.tar"] = _shard_with_a_large_member(5000)
        server.files["ok.tar"] = tar_shard(1, 3)
        urls = [secret_url(server, "/files/big.tar", "azure-sas"), server.file_url("ok.tar")]
        ds = TarDataset(urls, decode=tar_digest, max_member_bytes=4096)
        options: dict[str, Any] = {"on_error": on_error, "collate_fn": keep}
        if on_error == "skip":
            options["max_failures"] = 1
        async with DataLoader(ds, batch_size=8, **options) as loader:
            if on_error == "raise":
                with pytest.raises(ShardError) as info:
                    [batch async for batch in loader]
            else:
                samples = [s for batch in [b async for b in loader] for s in batch]
                stats = loader.statistics()
    if on_error == "raise":
        message = str(info.value)
        assert "member 's/0001.bin' is 5000 bytes" in message
        assert "max_member_bytes=4096" in message
        assert info.value.member == "s/0001.bin"
        assert_hidden(shown(info.value))
        return
    assert len(samples) == 1 + 3  # the sample before the large member, and the other shard
    assert stats.skipped_count == 1
    assert "max_member_bytes=4096" in stats.skipped[0][1]
    assert_hidden(repr(stats))


async def test_a_parquet_row_group_over_the_bound_fails_alone(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    path.write_bytes(parquet_bytes(0, 40, 10))
    ds = ParquetDataset(str(path), max_row_group_bytes=10)
    options: dict[str, Any] = {"on_error": "skip", "max_failures": 4, "collate_fn": keep}
    async with DataLoader(ds, batch_size=8, **options) as loader:
        assert [b async for b in loader] == []
        assert loader.statistics().skipped_count == 4
        assert "max_row_group_bytes=10" in loader.statistics().skipped[0][1]
    async with DataLoader(ParquetDataset(str(path)), batch_size=40, collate_fn=keep) as loader:
        assert sum(len(b) for b in [b async for b in loader]) == 40  # the default bound
