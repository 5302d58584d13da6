"""TarDataset and its source's connection pool: an open shard holds its connection while its
samples wait for their turn, so a pool smaller than what an epoch reads at once must never
leave the epoch waiting for ever. Either the pool is sized for the readers (S3's when the
dataset makes its source, HTTP's default), or a smaller one is refused at construction
naming both values, or the readers share it through the epoch's gate (the open shards and the
re-reads of a resumed epoch first, the shards ahead with what is left).

Shards hold more samples than a reader's queue (``READAHEAD``) and more bytes than a client
buffers, so a reader whose queue is full keeps its connection, as a real one does. Every
epoch here is bounded by ``helpers.collect``'s timeout: a hang fails the test instead of
stalling the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterator, Mapping
from typing import Any, cast

import pytest
from datasets import tar_keys, tar_shard
from helpers import BOUND_S, collect
from http_server import FaultServer
from hypothesis import given, settings
from hypothesis import strategies as st
from s3_server import moto_s3, s3_options

from aioloader.sources import FsspecDataset, HTTPDataset, TarDataset
from aioloader.sources._mixing import Mixer, buffer_rng
from aioloader.sources._readers import READAHEAD, Epoch

SHARDS = 8

#: Bytes of a sample's member: a shard (1-2 MB) is far more than aiohttp buffers before it
#: stops reading the socket, so a reader that waits keeps its connection (a body received
#: whole would give it back at once).
SAMPLE_BYTES = 64 << 10


def counts(shard: int) -> int:
    """Samples per shard: more than a queue holds, and uneven, so shards end at other turns."""
    return 3 * READAHEAD + 8 * (shard % 3)


@pytest.fixture(scope="module")
def server() -> Iterator[FaultServer]:
    with FaultServer().in_thread() as served:
        for shard in range(SHARDS):
            served.files[f"s{shard}.tar"] = tar_shard(shard, counts(shard), size=SAMPLE_BYTES)
        yield served


def http_tar(server: FaultServer, max_connections: int, in_flight: int, **options: Any) -> Any:
    urls = [server.file_url(f"s{shard}.tar") for shard in range(SHARDS)]
    source = HTTPDataset(urls, max_connections=max_connections)
    return TarDataset(None, source=source, shards_in_flight=in_flight, **options)


async def keys(dataset: TarDataset) -> list[str]:
    try:
        return [raw["__key__"] for raw in await collect(dataset)]
    finally:
        await dataset.aclose()


async def cut_at(dataset: TarDataset, n: int) -> tuple[list[str], dict[str, Any]]:
    """The first ``n`` keys of an epoch and the state after them; the epoch is closed (its
    readers stopped) before the source."""
    head = []
    epoch = cast(AsyncGenerator[Any, None], aiter(dataset))  # the epoch's generator
    try:
        async with asyncio.timeout(BOUND_S), contextlib.aclosing(epoch) as samples:
            async for raw in samples:
                head.append(raw["__key__"])
                if len(head) == n:
                    break
        return head, dataset.state_dict()
    finally:
        await dataset.aclose()


@pytest.mark.parametrize(("max_connections", "in_flight"), [(1, 2), (3, 4), (7, 8)])
def test_an_http_pool_below_the_open_shards_is_refused_naming_both(
    server: FaultServer, max_connections: int, in_flight: int
) -> None:
    with pytest.raises(ValueError, match="needs a connection per open shard") as caught:
        http_tar(server, max_connections, in_flight)
    message = str(caught.value)
    assert f"shards_in_flight={in_flight}" in message
    assert f"max_connections={max_connections}" in message
    assert f"max_connections>={in_flight}" in message  # and how to fix it


@pytest.mark.parametrize(("max_connections", "in_flight"), [(2, 2), (4, 4), (5, 4), (9, 4)])
async def test_a_pool_of_at_least_the_open_shards_reads_every_sample_once(
    server: FaultServer, max_connections: int, in_flight: int
) -> None:
    ds = http_tar(server, max_connections, in_flight, shuffle=True, shuffle_buffer=50, seed=3)
    got = await keys(ds)
    assert sorted(got) == tar_keys(SHARDS, counts)  # each once: nothing repeated, none lost


@pytest.mark.parametrize("cut", [30, 130, 250])
@pytest.mark.parametrize("in_flight", [2, 3])
async def test_a_resumed_epoch_with_a_pool_of_the_open_shards_ends_exactly(
    server: FaultServer, in_flight: int, cut: int
) -> None:
    # Resuming re-reads what the buffer held (other shards than the open ones) while the
    # open shards' readers fill their queues: with as many connections as open shards, the
    # re-reads must still get one.
    def make() -> Any:
        return http_tar(server, in_flight, in_flight, shuffle=True, shuffle_buffer=100, seed=cut)

    whole = await keys(make())
    head, state = await cut_at(make(), cut)
    resumed = make()
    resumed.load_state_dict(state)
    assert head + await keys(resumed) == whole  # the rest exactly, in its order


# -- S3 (aiobotocore pools 10 connections unless config_kwargs says otherwise) -------------


S3_SHARDS = 12


@pytest.fixture(scope="module")
def moto_tar() -> Iterator[tuple[str, list[str]]]:
    shards = {
        f"s{shard:02d}.tar": tar_shard(shard, counts(shard), size=SAMPLE_BYTES)
        for shard in range(S3_SHARDS)
    }
    with moto_s3({"pool": shards}) as endpoint:
        yield endpoint, [f"s3://pool/{key}" for key in shards]


async def test_s3_shards_past_botocores_default_pool_are_read_once(
    moto_tar: tuple[str, list[str]],
) -> None:
    endpoint, urls = moto_tar
    ds = TarDataset(urls, shards_in_flight=11, storage_options=s3_options(endpoint))
    assert sorted(await keys(ds)) == tar_keys(S3_SHARDS, counts)


async def test_s3_explicit_pool_of_the_open_shards_reads_once_and_resumes(
    moto_tar: tuple[str, list[str]],
) -> None:
    endpoint, urls = moto_tar
    options = s3_options(endpoint, config_kwargs={"max_pool_connections": 3})

    def make() -> TarDataset:
        return TarDataset(
            urls, shards_in_flight=3, shuffle=True, shuffle_buffer=80, storage_options=options
        )

    whole = await keys(make())
    assert sorted(whole) == tar_keys(S3_SHARDS, counts)
    head, state = await cut_at(make(), 150)
    resumed = make()
    resumed.load_state_dict(state)
    assert head + await keys(resumed) == whole


def test_an_s3_pool_below_the_open_shards_is_refused_naming_both(
    moto_tar: tuple[str, list[str]],
) -> None:
    endpoint, urls = moto_tar
    setting = "storage_options['config_kwargs']['max_pool_connections']"
    options = s3_options(endpoint, config_kwargs={"max_pool_connections": 4})
    with pytest.raises(ValueError, match=r"shards_in_flight=8 .*max_pool_connections'\]=4"):
        TarDataset(urls, shards_in_flight=8, storage_options=options)
    # A ready source keeps its own pool: botocore's 10, below 11 open shards.
    source = FsspecDataset(urls, storage_options=s3_options(endpoint))
    with pytest.raises(ValueError, match="needs a connection per open shard") as caught:
        TarDataset(None, source=source, shards_in_flight=11)
    assert f"{setting}=10" in str(caught.value)
    assert "shards_in_flight=11" in str(caught.value)


# -- the gate on its own: units that count how many of them are open ---------------------------


class CountedUnits:
    """Units of given lengths whose records are ``(unit, position)``; each counts as open (a
    connection held) from its first record until its generator is closed."""

    kind = "test"

    def __init__(self, lengths: list[int], slots: int, buffer: int) -> None:
        self.lengths = lengths
        self.slots = slots
        self.buffer = buffer
        self.open = 0
        self.most = 0
        self.shared: Opened | None = None  # also counted there (epochs over one pool)

    async def start(self, epoch: int, resume: Mapping[str, Any] | None) -> Mixer:
        order = list(range(len(self.lengths)))
        return Mixer(order, self.slots, self.buffer, buffer_rng(7, epoch, 0, 1))

    async def records(self, unit: int) -> AsyncGenerator[tuple[int, int], None]:
        counters: list[Any] = [self] if self.shared is None else [self, self.shared]
        for counter in counters:
            counter.open += 1
            counter.most = max(counter.most, counter.open)
        try:
            for position in range(self.lengths[unit]):
                yield unit, position
                await asyncio.sleep(0)  # the other readers run between records
        finally:
            for counter in counters:
                counter.open -= 1

    def where(self, unit: int) -> tuple[str, str]:
        return f"unit {unit}", f"u{unit}"


async def read(epoch: Epoch, stop: int | None = None) -> list[tuple[int, int]]:
    got: list[tuple[int, int]] = []
    samples = cast(AsyncGenerator[tuple[int, int], None], epoch.samples())
    async with asyncio.timeout(BOUND_S), contextlib.aclosing(samples):
        async for record in samples:
            got.append(record)
            if len(got) == stop:
                break
    return got


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 2 * READAHEAD + 5), min_size=1, max_size=7),
    slots=st.integers(1, 3),
    spare=st.integers(0, 4),
    buffer=st.integers(0, 60),
    data=st.data(),
)
def test_the_gate_opens_at_most_its_connections_and_never_leaves_the_epoch_waiting(
    lengths: list[int], slots: int, spare: int, buffer: int, data: st.DataObject
) -> None:
    connections = slots + spare  # from the open units alone to more than twice as many

    async def run() -> None:
        units = CountedUnits(lengths, slots, buffer)
        whole = await read(Epoch(units, 0, None, slots, connections))
        assert sorted(whole) == [(u, p) for u, n in enumerate(lengths) for p in range(n)]
        cut = data.draw(st.integers(0, len(whole)), label="cut")
        first = Epoch(units, 0, None, slots, connections)
        head = await read(first, cut) if cut else []
        epoch, yielded, ended = first.position()
        state = {"epoch": epoch, "yielded": yielded, "ended": ended, "rest": None}
        rest = await read(Epoch(units, 0, state, slots, connections))
        assert head + rest == whole  # the resumed epoch's re-reads got their connections
        assert units.most <= connections
        assert units.open == 0

    asyncio.run(run())


# -- epochs open at once over one pool (zip of two, an evaluation pass beside training) ------


async def zipped(
    first: AsyncGenerator[Any, None], second: AsyncGenerator[Any, None], key: Any
) -> tuple[list[Any], list[Any]]:
    """Both epochs' records, taken one of each in turn (as ``zip`` does) until both end:
    neither consumer runs ahead, so a reader of one that waits for its consumer waits for
    the other epoch too."""
    got: tuple[list[Any], list[Any]] = ([], [])
    live = [first, second]
    async with asyncio.timeout(BOUND_S), contextlib.aclosing(first), contextlib.aclosing(second):
        for _ in range(100_000):  # far more than the records of both
            if not any(live):
                break
            for side, samples in enumerate(live):
                if samples is None:
                    continue
                try:
                    got[side].append(key(await anext(samples)))
                except StopAsyncIteration:
                    live[side] = None  # type: ignore[call-overload]
    return got


@pytest.mark.parametrize("spare", [0, 1, 3])
@pytest.mark.parametrize("in_flight", [2, 3])
async def test_two_epochs_of_one_dataset_zipped_both_read_every_sample_once(
    server: FaultServer, in_flight: int, spare: int
) -> None:
    # Both epochs hold their open shards' connections while their samples wait for the
    # other epoch's consumer: with a connection per open shard of each, both must go on,
    # also where the first took the pool for its shards ahead before the second began.
    ds = http_tar(server, 2 * in_flight + spare, in_flight, shuffle=True, shuffle_buffer=40)
    try:
        first = cast(AsyncGenerator[Any, None], aiter(ds))
        ahead = await anext(first)  # the first epoch opens its shards ahead, alone
        await asyncio.sleep(0.05)
        a, b = await zipped(first, cast(AsyncGenerator[Any, None], aiter(ds)), itemgetter)
    finally:
        await ds.aclose()
    assert sorted([ahead["__key__"], *a]) == tar_keys(SHARDS, counts)
    assert sorted(b) == tar_keys(SHARDS, counts)


def itemgetter(raw: Any) -> Any:
    return raw["__key__"]


async def test_two_datasets_over_one_source_zipped_both_read_every_sample_once(
    server: FaultServer,
) -> None:
    urls = [server.file_url(f"s{shard}.tar") for shard in range(SHARDS)]
    source = HTTPDataset(urls, max_connections=5)
    one = TarDataset(None, source=source, shards_in_flight=2)
    two = TarDataset(None, source=source, shards_in_flight=3, shuffle=True, shuffle_buffer=20)
    try:
        a, b = await zipped(
            cast(AsyncGenerator[Any, None], aiter(one)),
            cast(AsyncGenerator[Any, None], aiter(two)),
            itemgetter,
        )
    finally:
        await source.aclose()
    assert sorted(a) == sorted(b) == tar_keys(SHARDS, counts)


async def test_an_epoch_that_does_not_fit_beside_the_open_one_is_refused_at_once(
    server: FaultServer,
) -> None:
    # As many connections as one epoch's open shards: a second epoch would wait for ever for
    # the first's, whose samples wait for the second's consumer. It is refused at its start,
    # naming the setting, its value and what two epochs need; the first reads on, and once it
    # is closed another epoch starts.
    ds = http_tar(server, 3, 3)
    try:
        first = cast(AsyncGenerator[Any, None], aiter(ds))
        head = [itemgetter(await anext(first))]
        second = cast(AsyncGenerator[Any, None], aiter(ds))
        with pytest.raises(RuntimeError) as caught:
            async with asyncio.timeout(BOUND_S):
                await anext(second)
        message = str(caught.value)
        for needle in ("TarDataset", "max_connections=3", "needs 3 more", "max_connections>=6"):
            assert needle in message, message
        rest = [itemgetter(raw) for raw in await collect(first)]
        assert sorted(head + rest) == tar_keys(SHARDS, counts)
        assert sorted(itemgetter(raw) for raw in await collect(ds)) == tar_keys(SHARDS, counts)
    finally:
        await ds.aclose()


async def test_loader_iterators_zipped_over_one_tar_dataset_both_end() -> None:
    from aioloader import DataLoader

    with FaultServer().in_thread() as served:
        for shard in range(4):
            served.files[f"z{shard}.tar"] = tar_shard(shard, counts(shard), size=SAMPLE_BYTES)
        urls = [served.file_url(f"z{shard}.tar") for shard in range(4)]
        ds = TarDataset(None, source=HTTPDataset(urls, max_connections=5), shards_in_flight=2)
        loader = DataLoader(ds, batch_size=16, collate_fn=len)
        sizes: tuple[list[int], list[int]] = ([], [])
        try:
            first, second = aiter(loader), aiter(loader)
            async with asyncio.timeout(BOUND_S):
                for _ in range(1000):  # more than the batches of one epoch
                    try:
                        sizes[0].append(await anext(first))
                        sizes[1].append(await anext(second))
                    except StopAsyncIteration:
                        break
            await cast(AsyncGenerator[Any, None], first).aclose()
            await cast(AsyncGenerator[Any, None], second).aclose()
        finally:
            await loader.aclose()
            await ds.aclose()
    total = sum(counts(shard) for shard in range(4))
    assert sum(sizes[0]) == sum(sizes[1]) == total


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 2 * READAHEAD + 5), min_size=1, max_size=6),
    slots=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    spare=st.integers(0, 4),
    buffer=st.integers(0, 40),
    data=st.data(),
)
def test_epochs_sharing_a_gate_stay_within_its_connections_and_all_end(
    lengths: list[int],
    slots: tuple[int, int],
    spare: int,
    buffer: int,
    data: st.DataObject,
) -> None:
    # Two epochs over one pool, the second started after the first took some records (its
    # readers ahead hold what they could), maybe a resumed one (re-reads), their consumers
    # taking records in turn: the open units of both never pass the connections, and each
    # yields exactly what it yields alone.
    connections = sum(slots) + spare
    pool = object()

    async def run() -> None:
        alone = [await read(Epoch(CountedUnits(lengths, n, buffer), 0, None, n)) for n in slots]
        resume: dict[str, Any] | None = None
        if data.draw(st.booleans(), label="resumed"):
            saved = Epoch(CountedUnits(lengths, slots[1], buffer), 0, None, slots[1])
            cut = data.draw(st.integers(0, len(alone[1])), label="cut")
            if cut:
                await read(saved, cut)
            epoch, yielded, ended = saved.position()
            resume = {"epoch": epoch, "yielded": yielded, "ended": ended, "rest": None}
        one_units = CountedUnits(lengths, slots[0], buffer)
        two_units = CountedUnits(lengths, slots[1], buffer)
        two_units.shared = one_units.shared = Opened()
        one = cast(
            AsyncGenerator[Any, None],
            Epoch(one_units, 0, None, slots[0], connections, pool).samples(),
        )
        lead = min(data.draw(st.integers(0, 5), label="lead"), len(alone[0]))
        async with asyncio.timeout(BOUND_S):
            early = [await anext(one) for _ in range(lead)]
            await asyncio.sleep(0)  # its readers ahead take what they may
        two = Epoch(two_units, 0, resume, slots[1], connections, pool)
        a, b = await zipped(one, cast(AsyncGenerator[Any, None], two.samples()), tuple)
        assert early + a == alone[0]
        assert b == alone[1][int(resume["yielded"]) if resume else 0 :]
        assert one_units.shared.most <= connections
        assert one_units.shared.open == 0

    asyncio.run(run())


class Opened:
    """Units open at once, counted over the epochs that share it."""

    def __init__(self) -> None:
        self.open = 0
        self.most = 0


async def test_an_epoch_dropped_unclosed_leaves_its_connections_to_the_next(
    server: FaultServer,
) -> None:
    # ``break`` out of ``async for`` leaves the epoch to be closed by a task the loop runs
    # next: the next epoch, over a pool of one epoch's open shards, waits for that close
    # rather than being refused as a second epoch at once. Directly and through a loader.
    from aioloader import DataLoader

    ds = http_tar(server, 2, 2)
    loader = DataLoader(ds, batch_size=8, collate_fn=len)
    try:
        async with asyncio.timeout(BOUND_S):
            for _ in range(3):
                async for _raw in ds:
                    break
            for _ in range(3):
                async for _batch in loader:
                    break
        assert sorted(itemgetter(raw) for raw in await collect(ds)) == tar_keys(SHARDS, counts)
    finally:
        await loader.aclose()
        await ds.aclose()
