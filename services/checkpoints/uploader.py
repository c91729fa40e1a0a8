"""The checkpoint service's effects: commit (verify what the agents stored, manifest last) and delete.

Why it works this way: docs/internals.md, "5. Checkpoints".
"""

import asyncio
import time
from typing import Any

import structlog

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointFailed, ShardInfo
from flightdeck.services.checkpoints import scrubber
from flightdeck.services.checkpoints.state import CommitArgs, DeleteArgs, StagedRank
from flightdeck.services.core import EffectHandler, Emit
from flightdeck.services.shell.objects import manifest as mf
from flightdeck.services.shell.objects.store import (
    ObjectAlreadyExists,
    ObjectNotFound,
    ObjectStore,
    ObjectTooLarge,
)

log = structlog.get_logger(__name__)


class Rejected(Exception):
    """Why a checkpoint cannot be committed; becomes CheckpointFailed.reason. `node`: the node whose report of a
    stored shard the store contradicts (CheckpointFailed.node)."""

    def __init__(self, why: str, node: str = "") -> None:
        super().__init__(why)
        self.node = node


def build_manifest(args: CommitArgs) -> mf.Manifest:
    return mf.Manifest(
        job_id=args.job_id, checkpoint_id=args.checkpoint_id, step=args.step, world_size=args.world_size,
        attempt=args.attempt, timeline=args.timeline, created_at=args.created_at, data=args.data,
        shards=[s for r in args.ranks for s in r.shards],
    )


async def _verify_shard(store: ObjectStore, args: CommitArgs, rank: StagedRank, shard: ShardInfo) -> None:
    where = f"shard {shard.path!r} of rank {rank.rank} (stored by node {rank.node or '?'})"
    key = mf.shard_key(args.job_id, args.checkpoint_id, shard.path)
    try:
        stored = await store.hash_object(key)
    except ObjectNotFound:
        raise Rejected(f"{where} is not in the store, though its agent reported it stored", rank.node) from None
    if stored != (shard.size, shard.sha256):
        raise Rejected(f"{where} does not match its rank's announcement: the store holds {stored[0]} bytes with "
                       f"sha256 {stored[1]}, the rank announced {shard.size} bytes with {shard.sha256}", rank.node)


async def _verify_all(store: ObjectStore, args: CommitArgs, file_concurrency: int) -> None:
    """Read every shard back from the store and check it against its rank's announcement."""
    slots = asyncio.Semaphore(file_concurrency)
    errors: list[Exception] = []

    async def one(rank: StagedRank, shard: ShardInfo) -> None:
        async with slots:
            if errors:  # one bad shard dooms the checkpoint: read no more
                return
            try:
                await _verify_shard(store, args, rank, shard)
            except Exception as exc:
                errors.append(exc)

    await asyncio.gather(*(one(rank, shard) for rank in args.ranks for shard in rank.shards))
    if errors:
        raise next((e for e in errors if isinstance(e, Rejected)), errors[0])


async def _existing_manifest(store: ObjectStore, key: str) -> bytes | None:
    try:
        return await store.get_bytes(key, max_bytes=mf.MAX_MANIFEST_BYTES)
    except ObjectNotFound:
        return None
    except ObjectTooLarge:
        return b""  # larger than any manifest we write, so not ours: "already holds a different manifest"


async def commit(store: ObjectStore, args: CommitArgs, *, file_concurrency: int = 4) -> list[Emit]:
    """Verify one checkpoint's shards in the store (the agents put them there) and write its manifest last; the
    Emits record the outcome (committed or failed). A failed checkpoint's objects are removed."""
    blog = log.bind(job_id=args.job_id, checkpoint_id=args.checkpoint_id, step=args.step)
    manifest = build_manifest(args)
    body = mf.encode(manifest)
    mkey = mf.manifest_key(args.job_id, args.checkpoint_id)
    started = time.monotonic()
    ours = True  # the prefix's objects belong to this checkpoint: remove them if it fails
    try:
        if len(body) > mf.MAX_MANIFEST_BYTES:  # no restore would read it
            raise Rejected(f"its manifest would be {len(body)} bytes ({len(manifest.shards)} shards), more than "
                           f"the {mf.MAX_MANIFEST_BYTES} a restore reads")
        try:
            mf.check_shard_paths(manifest.shards)
        except mf.CorruptCheckpoint as exc:
            raise Rejected(f"the ranks' shard lists cannot form a checkpoint: {exc}") from None
        existing = await _existing_manifest(store, mkey)
        if existing is None:
            await _verify_all(store, args, file_concurrency)
            try:
                await store.put_bytes(mkey, body, if_none_match=True)  # last: this write is the commit
            except ObjectAlreadyExists:
                existing = await _existing_manifest(store, mkey)
        if existing is not None and existing != body:
            ours = False  # the prefix belongs to the checkpoint that holds it: leave it alone
            raise Rejected(f"{store.uri(mkey)} already holds a different manifest")
    except Rejected as exc:
        return await _failed(store, args, str(exc), cleanup=ours, node=exc.node)
    except Exception as exc:
        blog.error("checkpoint commit failed", exc_info=True)
        return await _failed(store, args, f"commit failed: {type(exc).__name__}: {exc}", cleanup=ours)
    seconds = time.monotonic() - started
    blog.info("checkpoint committed", bytes=manifest.bytes, verify_s=round(seconds, 3),
              mb_s=round(manifest.bytes / (1 << 20) / max(seconds, 1e-9), 1), uri=store.uri(mkey))
    event = CheckpointCommitted(
        job_id=args.job_id, checkpoint_id=args.checkpoint_id, step=args.step, world_size=args.world_size,
        uri=store.uri(mkey), bytes=manifest.bytes, data=args.data, manifest_sha256=mf.sha256(body),
        attempt=args.attempt, timeline=args.timeline, from_memory=args.from_memory,
        rank_bytes=max((sum(s.size for s in r.shards) for r in args.ranks), default=0),
    )
    return [Emit(subjects.job(args.job_id, "CheckpointCommitted"), event)]


async def _failed(store: ObjectStore, args: CommitArgs, reason: str, *, cleanup: bool,
                  node: str = "") -> list[Emit]:
    log.warning("checkpoint failed", job_id=args.job_id, checkpoint_id=args.checkpoint_id, reason=reason)
    if cleanup:
        try:
            await store.delete_prefix(mf.prefix(args.job_id, args.checkpoint_id))
        except Exception:  # orphans without a manifest are harmless; the failure is what must be recorded
            log.error("could not remove a failed checkpoint's shards", checkpoint_id=args.checkpoint_id, exc_info=True)
    event = CheckpointFailed(job_id=args.job_id, step=args.step, reason=f"{args.checkpoint_id}: {reason}",
                             checkpoint_id=args.checkpoint_id, store=True, node=node, schema_version=3 if node else 2)
    return [Emit(subjects.job(args.job_id, "CheckpointFailed"), event)]


async def delete(store: ObjectStore, args: DeleteArgs) -> list[Emit]:
    """Remove deleted checkpoints' objects, manifest first so a half-removed one no longer exists."""
    for cid in args.checkpoint_ids:
        try:
            await store.delete(mf.manifest_key(args.job_id, cid))
            removed = await store.delete_prefix(mf.prefix(args.job_id, cid))
            log.info("checkpoint objects removed", job_id=args.job_id, checkpoint_id=cid, objects=removed + 1)
        except Exception:  # CheckpointDeleted is already recorded; leftover objects only cost space
            log.error("could not remove checkpoint objects", job_id=args.job_id, checkpoint_id=cid, exc_info=True)
    return []


def handlers(store: ObjectStore, *, file_concurrency: int = 4) -> dict[str, EffectHandler]:
    """The effect handlers `core_service` needs, bound to one store."""

    async def on_commit(args: Any) -> list[Emit]:
        assert isinstance(args, CommitArgs), type(args)
        return await commit(store, args, file_concurrency=file_concurrency)

    async def on_delete(args: Any) -> list[Emit]:
        assert isinstance(args, DeleteArgs), type(args)
        return await delete(store, args)

    return {"commit": on_commit, "delete": on_delete, "scrub": scrubber.handler(store)}
