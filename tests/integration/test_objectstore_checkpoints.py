"""Commit and restore through each object store: each rank's agent stores its shards, checked against the
rank's announcement; the checkpoint service reads them back and writes the manifest last. Failures leave nothing
committed and nothing stored; restores refuse tampered shards and manifests that point outside."""

import asyncio
import hashlib
import os
import re
import shutil
from pathlib import Path

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointStaged,
    DataPosition,
    ShardInfo,
    ShardsUploaded,
)
from flightdeck.services.checkpoints import core
from flightdeck.services.checkpoints.state import CommitArgs, DeleteArgs
from flightdeck.services.checkpoints.uploader import handlers
from flightdeck.services.core import Emit
from flightdeck.services.shell.objects import manifest as mf
from flightdeck.services.shell.objects.store import ObjectStore
from tests.integration.s3_fixture import moto_s3, store
from tests.integration.shipping_helpers import fold, ship, ship_and_commit

__all__ = ["moto_s3", "store"]
pytestmark = pytest.mark.timeout(90)
JOB = "llm-0a1b2c"


def stage(root: Path, step: int, world: int = 2, *, attempt: int = 0, big: int = 0) -> list[CheckpointStaged]:
    """What `world` ranks leave in a shared staging folder (DCP layout), and what they announce."""
    folder = root / JOB / f"step-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for rank in range(world):
        names = [f"__{rank}_0.distcp"] + ([".metadata"] if rank == 0 else [])
        shards = []
        for name in names:
            data = os.urandom(big if (big and rank == 0 and name != ".metadata") else 4096 + rank)
            (folder / name).write_bytes(data)
            shards.append(ShardInfo(path=name, size=len(data), sha256=hashlib.sha256(data).hexdigest()))
        out.append(CheckpointStaged(job_id=JOB, rank=rank, attempt=attempt, node="n0", step=step, world_size=world,
                                    staging_dir=str(folder), shards=shards, data=DataPosition(next_batch=step),
                                    stall_s=0.0, write_s=0.0, occurred_at=1000.0 + step))
    return out


async def commit_args(store: ObjectStore, stagings: list[CheckpointStaged], root: Path) -> CommitArgs:
    """Every rank's agent stored its shards: the commit the pure core then asks for."""
    events: list[CheckpointStaged | ShardsUploaded] = []
    for ev in stagings:
        events += [ev, await ship(store, ev, [root])]
    args, failed = await fold(store, events)
    assert failed is None and args is not None, failed
    return args


async def commit(store: ObjectStore, args: CommitArgs) -> CheckpointCommitted | CheckpointFailed:
    [emit] = await handlers(store)["commit"](args)
    assert isinstance(emit, Emit) and emit.subject == subjects.job(JOB, type(emit.event).__name__)
    assert isinstance(emit.event, CheckpointCommitted | CheckpointFailed)
    return emit.event


async def test_commit_then_restore(store: ObjectStore, tmp_path: Path) -> None:
    stagings = stage(tmp_path / "staging", 100, big=6 * 1024 * 1024)  # multipart on the S3 store
    args = await commit_args(store, stagings, tmp_path / "staging")
    ev = await commit(store, args)
    assert isinstance(ev, CheckpointCommitted), ev
    cid = args.checkpoint_id
    raw = await store.get_bytes(mf.manifest_key(JOB, cid))
    assert ev.manifest_sha256 == hashlib.sha256(raw).hexdigest() and ev.uri == store.uri(mf.manifest_key(JOB, cid))
    shards = [s for st in stagings for s in st.shards]
    assert ev.bytes == sum(s.size for s in shards) and (ev.step, ev.world_size) == (100, 2)
    assert ev.rank_bytes == max(sum(s.size for s in st.shards) for st in stagings) > 0  # a rank's snapshot's size
    manifest = msgspec.json.decode(raw, type=mf.Manifest)
    assert manifest.shards == shards and manifest.created_at == 1100.0 and manifest.attempt == 0
    assert await store.list(mf.prefix(JOB, cid)) == sorted(mf.shard_key(JOB, cid, p) for p in
                                                          [s.path for s in shards] + [mf.MANIFEST])
    dest = tmp_path / "restore" / cid
    restored = await mf.download(store, JOB, cid, dest, expected_sha256=ev.manifest_sha256)
    assert restored == manifest
    for s in shards:
        assert (dest / s.path).read_bytes() == (Path(stagings[0].staging_dir) / s.path).read_bytes()
    assert (dest / mf.MANIFEST).read_bytes() == raw  # what the trainer's --restore reads
    assert sorted(p.name for p in dest.parent.iterdir()) == [cid]  # no partial folder left


async def test_a_corrupted_shard_fails_the_checkpoint_and_commits_nothing(store: ObjectStore, tmp_path: Path) -> None:
    stagings = stage(tmp_path / "staging", 50)
    shard = Path(stagings[1].staging_dir) / stagings[1].shards[0].path
    data = bytearray(shard.read_bytes())
    data[100:104] = bytes(b ^ 0xFF for b in data[100:104])  # bit rot after the rank hashed it
    shard.write_bytes(bytes(data))
    ev = await ship_and_commit(store, stagings, [tmp_path / "staging"])
    assert isinstance(ev, CheckpointFailed) and ev.step == 50
    assert "node n0 could not store" in ev.reason and "corrupt" in ev.reason and "rank 1" in ev.reason
    assert await store.list("") == []  # rank 0's shards, stored before, are removed with the failed set
    with pytest.raises(mf.CheckpointMissing):
        await mf.download(store, JOB, core.checkpoint_id(0, 50), tmp_path / "restore")


async def test_a_missing_shard_fails_the_checkpoint(store: ObjectStore, tmp_path: Path) -> None:
    stagings = stage(tmp_path / "staging", 50)
    (Path(stagings[0].staging_dir) / ".metadata").unlink()
    ev = await ship_and_commit(store, stagings, [tmp_path / "staging"])
    assert isinstance(ev, CheckpointFailed) and "'.metadata' of rank 0" in ev.reason and "missing" in ev.reason
    assert await store.list("") == []


async def test_announced_paths_outside_the_staging_folder_are_refused(store: ObjectStore, tmp_path: Path) -> None:
    stagings = stage(tmp_path / "staging", 50)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not a checkpoint")
    info = ShardInfo(path="../../../secret", size=16, sha256=hashlib.sha256(b"not a checkpoint").hexdigest())
    escaping = msgspec.structs.replace(stagings[1], shards=[info])
    ev = await ship_and_commit(store, [stagings[0], escaping], [tmp_path / "staging"])
    assert isinstance(ev, CheckpointFailed) and "'..'" in ev.reason
    os.symlink(secret, Path(stagings[1].staging_dir) / "link.distcp")  # a symlink that leads out is refused too
    linked = msgspec.structs.replace(stagings[1], shards=[msgspec.structs.replace(info, path="link.distcp")])
    ev = await ship_and_commit(store, [stagings[0], linked], [tmp_path / "staging"])
    assert isinstance(ev, CheckpointFailed) and "outside" in ev.reason
    assert await store.list("") == []


async def test_the_commit_reads_the_store_back_and_refuses_what_differs_from_the_announcement(
        store: ObjectStore, tmp_path: Path) -> None:
    """An agent that reports a shard stored that is not what its rank announced (altered in the store after the
    upload, or never uploaded): the commit names it, writes no manifest and leaves nothing stored."""
    args = await commit_args(store, stage(tmp_path / "staging", 60), tmp_path / "staging")
    key = mf.shard_key(JOB, args.checkpoint_id, "__1_0.distcp")
    await store.put_bytes(key, b"something else")
    ev = await commit(store, args)
    assert isinstance(ev, CheckpointFailed)
    assert "shard '__1_0.distcp' of rank 1 (stored by node n0) does not match its rank's announcement: the store " \
           "holds 14 bytes" in ev.reason, ev.reason
    assert ev.node == "n0" and ev.schema_version == 3  # the node's word against the store's: the node is the suspect
    assert await store.list("") == []
    args = await commit_args(store, stage(tmp_path / "staging", 70), tmp_path / "staging")
    await store.delete(mf.shard_key(JOB, args.checkpoint_id, ".metadata"))
    ev = await commit(store, args)
    assert isinstance(ev, CheckpointFailed) and "'.metadata' of rank 0 (stored by node n0) is not in the store" \
        in ev.reason, ev.reason
    assert ev.node == "n0"
    assert await store.list("") == []


async def test_a_rerun_commits_again_but_a_different_writer_is_refused(store: ObjectStore, tmp_path: Path) -> None:
    args = await commit_args(store, stage(tmp_path / "staging", 75), tmp_path / "staging")
    first = await commit(store, args)
    again = await commit(store, args)  # the same effect after a crash: its own manifest is already there
    assert isinstance(first, CheckpointCommitted) and again == first
    other = await commit(store, msgspec.structs.replace(args, created_at=5.0))
    assert isinstance(other, CheckpointFailed) and "different manifest" in other.reason
    await mf.download(store, JOB, args.checkpoint_id, tmp_path / "r", expected_sha256=first.manifest_sha256)


async def test_restore_refuses_a_tampered_shard(store: ObjectStore, tmp_path: Path) -> None:
    ev = await ship_and_commit(store, stage(tmp_path / "staging", 20), [tmp_path / "staging"])
    assert isinstance(ev, CheckpointCommitted)
    await store.put_bytes(mf.shard_key(JOB, ev.checkpoint_id, "__1_0.distcp"), b"tampered")
    with pytest.raises(mf.CorruptCheckpoint, match=re.escape("__1_0.distcp")):
        await mf.download(store, JOB, ev.checkpoint_id, tmp_path / "restore" / "x", expected_sha256=ev.manifest_sha256)
    assert list((tmp_path / "restore").iterdir()) == []  # neither the folder nor a partial one
    await store.delete(mf.shard_key(JOB, ev.checkpoint_id, "__1_0.distcp"))
    with pytest.raises(mf.CorruptCheckpoint, match="missing"):
        await mf.download(store, JOB, ev.checkpoint_id, tmp_path / "restore" / "y")


async def test_restore_refuses_a_manifest_pointing_outside_its_prefix(store: ObjectStore, tmp_path: Path) -> None:
    await store.put_bytes("checkpoints/other-job/c1/secret", b"x")
    bad = mf.Manifest(job_id=JOB, checkpoint_id="c1", step=1, world_size=1, attempt=0, created_at=0.0,
                      data=DataPosition(next_batch=0),
                      shards=[ShardInfo(path="../../other-job/c1/secret", size=1, sha256="2d" * 32)])
    await store.put_bytes(mf.manifest_key(JOB, "c1"), mf.encode(bad))
    with pytest.raises(mf.CorruptCheckpoint, match="not allowed"):
        await mf.download(store, JOB, "c1", tmp_path / "restore")
    good = msgspec.structs.replace(bad, shards=[])
    await store.put_bytes(mf.manifest_key(JOB, "c1"), mf.encode(good))
    with pytest.raises(mf.CorruptCheckpoint, match="was committed"):  # not the manifest the event recorded
        await mf.download(store, JOB, "c1", tmp_path / "restore", expected_sha256="0" * 64)
    assert not (tmp_path / "restore").exists()


async def test_delete_effect_removes_only_the_named_checkpoints(store: ObjectStore, tmp_path: Path) -> None:
    one = await ship_and_commit(store, stage(tmp_path / "staging", 10), [tmp_path / "staging"])
    two = await ship_and_commit(store, stage(tmp_path / "staging", 20), [tmp_path / "staging"])
    assert isinstance(one, CheckpointCommitted) and isinstance(two, CheckpointCommitted)
    assert await handlers(store)["delete"](DeleteArgs(job_id=JOB, checkpoint_ids=[one.checkpoint_id])) == []
    assert await store.list(mf.prefix(JOB, one.checkpoint_id)) == []
    assert len(await store.list(mf.prefix(JOB, two.checkpoint_id))) == 4


async def test_the_commit_needs_no_staging_folder_only_the_store(store: ObjectStore, tmp_path: Path) -> None:
    """The checkpoint service reads no host's disk: with the staging gone once the agents stored the shards (as
    on another machine), the commit still lands and restores whole."""
    stagings = stage(tmp_path / "staging", 30)
    args = await commit_args(store, stagings, tmp_path / "staging")
    await asyncio.to_thread(shutil.rmtree, tmp_path / "staging")
    ev = await commit(store, args)
    assert isinstance(ev, CheckpointCommitted), ev
    await mf.download(store, JOB, ev.checkpoint_id, tmp_path / "r", expected_sha256=ev.manifest_sha256)
