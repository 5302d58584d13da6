"""Findings of the third review of the sources: what the shard_list and catalog digests
compare (object names in credential-named parameters, Azure SAS names of unsigned URLs,
datasets in sibling folders), and the readers' gate, masking and refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, cast

import pytest
from helpers import BOUND_S

from aioloader.sources import TarDataset
from aioloader.sources._redact import redact, same_objects


def refused(saved: list[str], other: list[str]) -> bool:
    state = TarDataset(saved, shards_in_flight=1).state_dict()
    try:
        TarDataset(other, shards_in_flight=1).load_state_dict(state)
    except ValueError as exc:
        error = str(exc)
    else:
        return False
    assert "other shards" in error
    return True


def test_shard_names_in_a_credential_named_parameter_tell_shards_apart() -> None:
    urls = [f"https://h.example/dl?key=train-{i:04d}.tar" for i in range(3)]
    assert refused(urls, urls[::-1])
    assert refused(urls, [url.replace("train", "val") for url in urls])
    assert not refused(urls, list(urls))


def test_a_credential_value_per_url_is_kept_hashed_never_in_clear() -> None:
    urls = [f"https://h.example/dl?key=secret-{i}" for i in range(2)]
    names = same_objects(urls)
    assert len(set(names)) == 2
    assert not any("secret" in name for name in names)


def test_a_credential_shared_by_every_url_is_left_out() -> None:
    def urls(token: str) -> list[str]:
        return [f"https://h.example/train-{i}.tar?token={token}" for i in range(2)]

    assert not refused(urls("one"), urls("two"))
    assert all("one" not in name for name in same_objects(urls("one")))


def test_azure_sas_names_split_an_unsigned_url_and_are_dropped_from_a_signed_one() -> None:
    unsigned = [f"https://h.example/get?sp=train&n={i}" for i in range(2)]
    assert refused(unsigned, [url.replace("train", "val") for url in unsigned])

    def signed(stamp: str) -> list[str]:
        return [
            f"https://acct.blob.example/c/train-{i}.tar?sv=2024&sp=r&se={stamp}&st={stamp}"
            f"&sr=b&sig={stamp}{i}"
            for i in range(2)
        ]

    assert not refused(signed("2026-01-01"), signed("2026-02-02"))


def test_amz_fields_are_dropped_only_beside_a_signature() -> None:
    unsigned = [f"https://h.example/x-{i}.tar?X-Amz-Meta-Split=train" for i in range(2)]
    assert refused(unsigned, [url.replace("train", "val") for url in unsigned])


@pytest.mark.parametrize(
    ("saved", "other"),
    [
        (["/data/train/all.tar"], ["/data/val/all.tar"]),
        ([f"/d/train/{i}.tar" for i in range(2)], [f"/d/val/{i}.tar" for i in range(2)]),
    ],
)
def test_shards_in_sibling_folders_are_other_shards(saved: list[str], other: list[str]) -> None:
    assert refused(saved, other)


def test_the_same_folder_at_another_mount_is_the_same_shards() -> None:
    saved = [f"/data/train/{i}.tar" for i in range(2)]
    assert not refused(saved, [f"/scratch/job-7/train/{i}.tar" for i in range(2)])
    assert not refused(["/data/train/all.tar"], ["/scratch/job-7/train/all.tar"])


LEFT_OPEN = """
import asyncio, gc, sys, weakref
sys.path.insert(0, {tests!r})
from test_sources_pool import CountedUnits
from aioloader.sources._readers import Epoch

class Pool:
    pass

def once():
    loop = asyncio.new_event_loop()
    pool = Pool()
    units = CountedUnits([200] * 6, 2, 0)
    epoch = Epoch(units, 0, None, 2, 2, pool).samples()  # readers ahead wait at the gate
    loop.run_until_complete(anext(epoch))
    loop.run_until_complete(asyncio.sleep(0.01))
    refs = weakref.ref(loop), weakref.ref(pool), weakref.ref(units)
    loop.close()  # no shutdown_asyncgens: the epoch is left open
    return refs

refs = [once() for _ in range(2)]
for _ in range(3):
    gc.collect()
print("ALIVE", sum(ref() is not None for group in refs for ref in group))
"""


def test_an_epoch_left_open_on_a_closed_loop_frees_the_loop_and_the_source() -> None:
    tests = str(Path(__file__).parent)
    run = subprocess.run(
        [sys.executable, "-c", LEFT_OPEN.format(tests=tests)],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        check=False,
    )
    assert "ALIVE 0" in run.stdout, run.stdout + run.stderr[-2000:]


def test_the_loose_password_rule_stops_at_the_next_scheme() -> None:
    # The token of a loose password ends at the next "://" (what keeps the rule linear on a
    # text of many "a://b:": it once scanned the rest of the text from each of them).
    assert redact("a://b:c/d,e://f@g") == "a://b:c/d,e://REDACTED@g"
    crafted = "@ " + "a://b:" * 4000
    assert redact(crafted) == crafted
    assert redact("https://u:p/ss@host/x.tar") == "https://u:REDACTED@host/x.tar"


def test_an_ipv6_host_with_a_port_is_no_password() -> None:
    text = "GET http://[::1]:8080/files/a@2x.tar failed"
    assert redact(text) == text
    assert redact("http://u:pw@[::1]:8080/x") == "http://u:REDACTED@[::1]:8080/x"


def test_the_refusal_names_where_shard_list_sits_in_a_loaders_state() -> None:
    saved = [f"/data/train/{i}.tar" for i in range(2)]
    state = TarDataset(saved, shards_in_flight=1).state_dict()
    with pytest.raises(ValueError, match=r'state\["streams"\]\["states"\]\[i\]\["shard_list"\]'):
        TarDataset(saved[::-1], shards_in_flight=1).load_state_dict(state)


async def test_an_epoch_waiting_for_one_whose_close_hangs_is_refused_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from test_sources_pool import CountedUnits

    from aioloader.sources import _readers

    class HungClose(CountedUnits):
        async def records(self, unit: int) -> AsyncGenerator[tuple[int, int], None]:
            try:
                async for record in super().records(unit):
                    yield record
            finally:
                await asyncio.Event().wait()  # a stream's close that never returns

    monkeypatch.setattr(_readers, "CLOSING_WAIT_S", 0.0)  # the bound, jumped over
    pool = object()
    first = _readers.Epoch(HungClose([50] * 4, 2, 0), 0, None, 2, 2, pool).samples()
    await anext(first)
    closer = asyncio.create_task(cast(Any, first).aclose())
    await asyncio.sleep(0)
    second = _readers.Epoch(CountedUnits([50] * 4, 2, 0), 0, None, 2, 2, pool).samples()
    try:
        async with asyncio.timeout(BOUND_S):
            with pytest.raises(RuntimeError, match="began to close"):
                await anext(second)
    finally:
        closer.cancel()
        with contextlib.suppress(BaseException):
            await closer
