"""One contract, every object store: the local folder and S3 (moto's server over HTTP)."""

import asyncio
import hashlib
import os
from pathlib import Path

import pytest

from flightdeck.services.shell.objects.s3 import S3Store
from flightdeck.services.shell.objects.store import InvalidKey, ObjectAlreadyExists, ObjectNotFound, ObjectStore
from tests.integration.s3_fixture import moto_s3, store

__all__ = ["moto_s3", "store"]  # fixtures, imported for pytest
pytestmark = pytest.mark.timeout(60)


async def test_bytes_round_trip_listing_and_delete(store: ObjectStore) -> None:
    await store.put_bytes("a/b/one", b"1")
    await store.put_bytes("a/b/two", b"22")
    await store.put_bytes("a/bc/three", b"333")
    await store.put_bytes("a/b/one", b"111")  # an unconditional put overwrites
    assert await store.get_bytes("a/b/one") == b"111"
    assert await store.list("a/b/") == ["a/b/one", "a/b/two"]  # not a/bc: prefixes end at a '/'
    assert await store.list("") == ["a/b/one", "a/b/two", "a/bc/three"]
    assert await store.exists("a/b/two") and not await store.exists("a/b/zz")
    await store.delete("a/b/two")
    await store.delete("a/b/two")  # deleting a missing key is fine
    assert await store.delete_prefix("a/") == 2
    assert await store.list("") == []
    with pytest.raises(ObjectNotFound):
        await store.get_bytes("a/b/one")


async def test_files_up_and_down_with_hashes(store: ObjectStore, tmp_path: Path) -> None:
    data = os.urandom(12 * 1024 * 1024 + 17)  # above the S3 store's 5 MiB parts: multipart there
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    want = (len(data), hashlib.sha256(data).hexdigest())
    assert await store.put_file("ck/x/shard", src) == want
    assert await store.hash_object("ck/x/shard") == want
    dest = tmp_path / "down" / "shard"
    assert await store.get_file("ck/x/shard", dest) == want
    assert dest.read_bytes() == data
    assert [p.name for p in dest.parent.iterdir()] == ["shard"]  # no temp file left beside it
    with pytest.raises(ObjectNotFound):
        await store.get_file("ck/x/missing", tmp_path / "down" / "missing")
    assert not (tmp_path / "down" / "missing").exists()


async def test_empty_object(store: ObjectStore, tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    assert await store.put_file("e", tmp_path / "empty") == (0, hashlib.sha256(b"").hexdigest())
    assert await store.get_bytes("e") == b""


async def test_conditional_create_refuses_a_second_writer(store: ObjectStore) -> None:
    await store.put_bytes("ck/MANIFEST.json", b"first", if_none_match=True)
    with pytest.raises(ObjectAlreadyExists):
        await store.put_bytes("ck/MANIFEST.json", b"second", if_none_match=True)
    assert await store.get_bytes("ck/MANIFEST.json") == b"first"


async def test_concurrent_conditional_creates_have_one_winner(store: ObjectStore) -> None:
    if isinstance(store, S3Store):
        # moto's server checks If-None-Match and then writes, unlocked: on CI two of six racing creates both
        # won. That is moto's race, not S3's (which makes conditional writes atomic); the refusal of a create
        # over an existing object is tested on both stores above.
        pytest.skip("moto does not make concurrent conditional creates atomic")
    async def attempt(i: int) -> bool:
        try:
            await store.put_bytes("race/MANIFEST.json", f"writer {i}".encode(), if_none_match=True)
            return True
        except ObjectAlreadyExists:
            return False

    wins = await asyncio.gather(*(attempt(i) for i in range(6)))
    assert sum(wins) == 1
    assert await store.get_bytes("race/MANIFEST.json") == f"writer {wins.index(True)}".encode()


@pytest.mark.parametrize("bad", ["../escape", "/abs", "a//b", "a\\b", "a/\x00"])
async def test_invalid_keys_are_refused_by_every_method(store: ObjectStore, bad: str, tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    calls = [store.put_bytes(bad, b"x"), store.put_file(bad, tmp_path / "f"), store.get_bytes(bad),
             store.get_file(bad, tmp_path / "g"), store.exists(bad), store.delete(bad), store.hash_object(bad)]
    for call in calls:
        with pytest.raises(InvalidKey):
            await call
    with pytest.raises(InvalidKey):
        await store.list(bad + "/")
    assert await store.list("") == []
