"""Checkpoint manifests and shards that lie: a manifest pointing outside its prefix (`..`, absolute paths,
another job's or checkpoint's prefix), a manifest swapped after the commit, truncated and bit-flipped shards.
A restore (what the node agent runs before ranks start) refuses each with CorruptCheckpoint naming what is
wrong, writes nothing where the checkpoint would land, and the previous checkpoint restores whole: nothing
that should be kept is touched. Runs on the local store and on S3 (moto over HTTP)."""

import os
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from flightdeck.events.checkpoint import CheckpointCommitted, DataPosition, ShardInfo
from flightdeck.services.checkpoints.state import CommitArgs
from flightdeck.services.checkpoints.uploader import commit
from flightdeck.services.shell.objects import manifest as mf
from flightdeck.services.shell.objects.store import ObjectStore
from tests.integration.s3_fixture import moto_s3, store
from tests.integration.shipping_helpers import fold, ship, staged_files

__all__ = ["moto_s3", "store"]
pytestmark = pytest.mark.timeout(60)

JOB, OTHER = "victim-1", "other-1"
SHA = "ab" * 32


def manifest(**shard: object) -> mf.Manifest:
    fields = {"path": "r0.distcp", "size": 1, "sha256": SHA, **shard}
    return mf.Manifest(job_id=JOB, checkpoint_id="step000000020-a0", step=20, world_size=1, attempt=0,
                       created_at=1.0, shards=[ShardInfo(**fields)], data=DataPosition(next_batch=21))  # type: ignore[arg-type]


@pytest.mark.parametrize("path", [
    "../step000000010-a0/r0.distcp", "../../other-1/step000000010-a0/r0.distcp", "/etc/passwd", "a/../../b",
    "..", ".", "", "a//b", "a\\..\\b", "r0\x00.distcp", "r0\n.distcp", "x" * 300, "MANIFEST.json",
])
def test_a_shard_path_outside_its_prefix_is_refused(path: str) -> None:
    raw = mf.encode(manifest(path=path))
    with pytest.raises(mf.CorruptCheckpoint, match=r"shard path|may not be called"):
        mf.decode(raw, job_id=JOB, checkpoint_id="step000000020-a0")


@pytest.mark.parametrize(("change", "says"), [
    ({"job_id": OTHER}, "names other-1"), ({"checkpoint_id": "step000000010-a0"}, "names victim-1/step000000010-a0"),
    ({"format": 99}, "newer than"),
])
def test_a_manifest_for_another_checkpoint_or_newer_code_is_refused(change: dict[str, object], says: str) -> None:
    body = {**msgspec.to_builtins(manifest()), **change}
    with pytest.raises(mf.CorruptCheckpoint, match=says):
        mf.decode(msgspec.json.encode(body), job_id=JOB, checkpoint_id="step000000020-a0")


@pytest.mark.parametrize("shard", [{"size": -1}, {"sha256": "00"}, {"sha256": 7}, {"size": "big"}])
def test_impossible_or_wrong_typed_shards_are_refused(shard: dict[str, object]) -> None:
    body = msgspec.to_builtins(manifest())
    body["shards"][0].update(shard)
    with pytest.raises(mf.CorruptCheckpoint):
        mf.decode(msgspec.json.encode(body), job_id=JOB, checkpoint_id="step000000020-a0")


def test_shards_listed_twice_are_refused() -> None:
    m = manifest()
    raw = mf.encode(msgspec.structs.replace(m, shards=[*m.shards, *m.shards]))
    with pytest.raises(mf.CorruptCheckpoint, match="appears twice"):
        mf.decode(raw, job_id=JOB, checkpoint_id="step000000020-a0")


async def _commit(store: ObjectStore, tmp: Path, step: int) -> tuple[CommitArgs, CheckpointCommitted]:
    staged = staged_files(tmp / "staging", JOB, step, {"r0.distcp": os.urandom(70_000), ".metadata": os.urandom(500)})
    args, _ = await fold(store, [staged, await ship(store, staged, [tmp / "staging"])])
    assert args is not None
    (out,) = await commit(store, args)
    assert isinstance(out.event, CheckpointCommitted), out.event
    return args, out.event


def _listing(folder: Path) -> list[Path]:
    return list(folder.iterdir()) if folder.exists() else []


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flip(data: bytes) -> bytes:
    return data[:1000] + bytes([data[1000] ^ 0x10]) + data[1001:]


Tamper = Callable[[ObjectStore, CheckpointCommitted], object]


async def _truncated_shard(s: ObjectStore, c: CheckpointCommitted) -> str:
    k = mf.shard_key(JOB, c.checkpoint_id, "r0.distcp")
    await s.put_bytes(k, _truncate(await s.get_bytes(k)))
    return "r0.distcp"


async def _flipped_shard(s: ObjectStore, c: CheckpointCommitted) -> str:
    k = mf.shard_key(JOB, c.checkpoint_id, "r0.distcp")
    await s.put_bytes(k, _flip(await s.get_bytes(k)))
    return "sha256"


async def _missing_shard(s: ObjectStore, c: CheckpointCommitted) -> str:
    await s.delete(mf.shard_key(JOB, c.checkpoint_id, ".metadata"))
    return "missing"


async def _swapped_manifest(s: ObjectStore, c: CheckpointCommitted) -> str:
    """A manifest rewritten to take its shards from the older checkpoint's prefix."""
    k = mf.manifest_key(JOB, c.checkpoint_id)
    body = msgspec.json.decode(await s.get_bytes(k))
    body["shards"][0]["path"] = "../step000000010-a0/r0.distcp"
    await s.put_bytes(k, msgspec.json.encode(body))
    return "was committed"


@pytest.mark.parametrize("tamper", [_truncated_shard, _flipped_shard, _missing_shard, _swapped_manifest],
                         ids=["truncated", "bit-flipped", "missing", "manifest-outside-prefix"])
async def test_a_damaged_checkpoint_is_refused_and_the_previous_one_restores_whole(
        store: ObjectStore, tmp_path: Path, tamper: Callable[..., object]) -> None:
    older, older_event = await _commit(store, tmp_path, 10)
    newer, newer_event = await _commit(store, tmp_path, 20)
    kept = {k: await store.get_bytes(k) for k in await store.list(mf.prefix(JOB, older.checkpoint_id))}
    says = await tamper(store, newer_event)  # type: ignore[misc]
    cache = tmp_path / "cache"
    dest = cache / newer.checkpoint_id
    with pytest.raises(mf.CorruptCheckpoint, match=str(says)):
        await mf.download(store, JOB, newer.checkpoint_id, dest, expected_sha256=newer_event.manifest_sha256)
    assert not dest.exists() and not any(p.name.endswith(".partial") for p in _listing(cache)), \
        "a refused restore left files where the cache would use them"
    back = await mf.download(store, JOB, older.checkpoint_id, cache / older.checkpoint_id,
                             expected_sha256=older_event.manifest_sha256)
    assert back.step == 10
    assert {k: await store.get_bytes(k) for k in await store.list(mf.prefix(JOB, older.checkpoint_id))} == kept


async def test_a_manifest_swapped_without_its_hash_still_cannot_leave_its_prefix(store: ObjectStore,
                                                                                 tmp_path: Path) -> None:
    """Even a restore that was not given the committed hash refuses a manifest reaching into another prefix."""
    await _commit(store, tmp_path, 10)
    _, newer_event = await _commit(store, tmp_path, 20)
    await _swapped_manifest(store, newer_event)
    with pytest.raises(mf.CorruptCheckpoint, match=r"shard path '\.\./step000000010-a0/r0\.distcp' is not allowed"):
        await mf.download(store, JOB, newer_event.checkpoint_id, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
