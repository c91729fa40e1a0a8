"""A manifest is read whole into memory, so none larger than MAX_MANIFEST_BYTES (~16 MiB, what a 65,536-rank
job's needs) is read: a restore (what the node agent runs before ranks start) refuses a bigger one unread with
CorruptCheckpoint, writes nothing where the checkpoint would land, and the previous checkpoint restores whole; a
commit never writes one, and the trainer's own manifest read is capped the same. Local store (a sparse 8 GiB
manifest: reading it would take 8 GiB) and S3 (moto over HTTP, the cap plus one byte)."""

import os
import time
import tracemalloc
from pathlib import Path

import pytest

from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointFailed, DataPosition, ShardInfo
from flightdeck.events.codec import MAX_SLOTS
from flightdeck.services.checkpoints.state import CommitArgs, StagedRank
from flightdeck.services.checkpoints.uploader import commit
from flightdeck.services.shell.objects import manifest as mf
from flightdeck.services.shell.objects.local import LocalStore
from flightdeck.services.shell.objects.store import ObjectStore, ObjectTooLarge
from flightdeck.trainer import checkpointing
from tests.integration.s3_fixture import moto_s3, store
from tests.integration.shipping_helpers import ship_and_commit, staged_files

__all__ = ["moto_s3", "store"]
pytestmark = pytest.mark.timeout(60)

JOB = "victim-2"
HUGE = 8 << 30  # a sparse file: no disk used, but a reader without a cap would allocate all of it


async def _commit(store: ObjectStore, tmp: Path, step: int) -> CheckpointCommitted:
    out = await ship_and_commit(store, [staged_files(tmp / "staging", JOB, step, {"r0.distcp": os.urandom(4000)})],
                                [tmp / "staging"])
    assert isinstance(out, CheckpointCommitted), out
    return out


async def _oversize(store: ObjectStore, key: str) -> int:
    """Replace an object with one bigger than the cap; returns its size."""
    if isinstance(store, LocalStore):
        os.truncate(store.root / key, HUGE)
        return HUGE
    await store.put_bytes(key, b" " * (mf.MAX_MANIFEST_BYTES + 1))
    return mf.MAX_MANIFEST_BYTES + 1


async def test_a_restore_refuses_an_oversized_manifest_unread_and_the_previous_checkpoint_restores(
        store: ObjectStore, tmp_path: Path) -> None:
    older = await _commit(store, tmp_path, 10)
    newer = await _commit(store, tmp_path, 20)
    size = await _oversize(store, mf.manifest_key(JOB, newer.checkpoint_id))
    cache = tmp_path / "cache"
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(mf.CorruptCheckpoint, match=rf"refused unread: .* holds {size} bytes, more than the "
                                                        rf"{mf.MAX_MANIFEST_BYTES}"):
            await mf.download(store, JOB, newer.checkpoint_id, cache / newer.checkpoint_id,
                              expected_sha256=newer.manifest_sha256)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Reading the 8 GiB sparse file would take minutes and the memory check below would fail first; refusing it
    # unread takes milliseconds, so 60 s only guards against a read that streams without holding.
    assert time.monotonic() - started < 60
    assert peak < 2 * mf.MAX_MANIFEST_BYTES  # nothing near the manifest's size was held (S3: it is only the cap +1)
    assert not cache.exists() or list(cache.iterdir()) == []  # nothing where the cache would use it
    back = await mf.download(store, JOB, older.checkpoint_id, cache / older.checkpoint_id,
                             expected_sha256=older.manifest_sha256)
    assert back.step == 10 and (cache / older.checkpoint_id / "r0.distcp").stat().st_size == 4000
    # the store's bound itself, at the edge
    await store.put_bytes("edge/k", b"x" * 100)
    assert await store.get_bytes("edge/k", max_bytes=100) == await store.get_bytes("edge/k") == b"x" * 100
    with pytest.raises(ObjectTooLarge, match="holds 100 bytes, more than the 99"):
        await store.get_bytes("edge/k", max_bytes=99)


async def test_a_commit_over_an_oversized_foreign_manifest_fails_and_leaves_it(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "objects")
    first = await _commit(store, tmp_path, 10)
    key = mf.manifest_key(JOB, first.checkpoint_id)
    await _oversize(store, key)
    args = CommitArgs(job_id=JOB, checkpoint_id=first.checkpoint_id, attempt=0, step=10, world_size=1,
                      created_at=10.0, data=DataPosition(next_batch=11),
                      ranks=[StagedRank(rank=0, node="n0", shards=[])])
    (out,) = await commit(store, args)
    assert isinstance(out.event, CheckpointFailed) and "already holds a different manifest" in out.event.reason
    assert (store.root / key).stat().st_size == HUGE  # the prefix belongs to whoever wrote it: left alone


async def test_a_commit_never_writes_a_manifest_no_restore_would_read(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "objects")
    shards = [ShardInfo(path=f"{i:0200d}.distcp", size=1, sha256="ab" * 32) for i in range(MAX_SLOTS)]
    args = CommitArgs(job_id=JOB, checkpoint_id="step000000001-a0", attempt=0, step=1, world_size=1, created_at=1.0,
                      data=DataPosition(next_batch=2),
                      ranks=[StagedRank(rank=0, node="n0", shards=shards)])
    (out,) = await commit(store, args)
    assert isinstance(out.event, CheckpointFailed), out.event
    assert f"shards), more than the {mf.MAX_MANIFEST_BYTES} a restore reads" in out.event.reason
    assert await store.list("checkpoints/") == []


def test_the_largest_real_checkpoint_fits_under_the_cap() -> None:
    """MAX_SLOTS ranks with DCP's file names, every number at its widest: what the cap is computed for."""
    shards = [ShardInfo(path=f"__{r}_0.distcp", size=10**15, sha256="f" * 64) for r in range(MAX_SLOTS)]
    m = mf.Manifest(job_id="j" * 63, checkpoint_id=f"step{10**9:09d}-a{10**6}-t{10**6}", step=10**9,
                    world_size=MAX_SLOTS, attempt=10**6, timeline=10**6, created_at=1.7e9,
                    shards=[*shards, ShardInfo(path=".metadata", size=10**12, sha256="f" * 64)],
                    data=DataPosition(next_batch=10**12, skipped=[(10**9 + i, 10**9 + i + 500) for i in range(500)]))
    body = mf.encode(m)
    assert len(body) < mf.MAX_MANIFEST_BYTES
    assert mf.decode(body, job_id=m.job_id, checkpoint_id=m.checkpoint_id).world_size == MAX_SLOTS


def test_the_trainer_refuses_an_oversized_manifest_unread(tmp_path: Path) -> None:
    assert checkpointing.MAX_MANIFEST_BYTES == mf.MAX_MANIFEST_BYTES
    path = tmp_path / "MANIFEST.json"
    path.write_bytes(b'{"shards": []}')
    assert checkpointing.read_manifest(path) == []
    os.truncate(path, HUGE)
    with pytest.raises(checkpointing.CorruptCheckpoint, match=f"larger than {mf.MAX_MANIFEST_BYTES} bytes"):
        checkpointing.read_manifest(path)
