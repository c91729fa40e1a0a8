"""The checkpoint service's effects: commit (upload, verify, manifest last) and delete.

Why it works this way: docs/internals.md, "5. Checkpoints".
"""

import asyncio
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from events import subjects
from events.checkpoint import CheckpointCommitted, CheckpointFailed, ShardInfo
from services.checkpoints import scrubber
from services.checkpoints.core import CommitArgs, DeleteArgs, StagedRank
from services.core import EffectHandler, Emit
from services.shell.objects import manifest as mf
from services.shell.objects.store import (
    ObjectAlreadyExists,
    ObjectNotFound,
    ObjectStore,
    ObjectTooLarge,
    local_path,
)

log = structlog.get_logger(__name__)


class Rejected(Exception):
    """Why a checkpoint cannot be committed; becomes CheckpointFailed.reason."""


def build_manifest(args: CommitArgs) -> mf.Manifest:
    return mf.Manifest(
        job_id=args.job_id, checkpoint_id=args.checkpoint_id, step=args.step, world_size=args.world_size,
        attempt=args.attempt, timeline=args.timeline, created_at=args.created_at, data=args.data,
        shards=[s for r in args.ranks for s in r.shards],
    )


def _job_set(real: Path, root: Path, job_id: str) -> bool:
    """`real` is <root>/.../<job_id>/<set>: a set in a folder named after the job, that folder inside `root`."""
    folder = real.parent
    return folder.name == job_id and folder != root and folder.is_relative_to(root)


def confine(job_id: str, rank: StagedRank, roots: Sequence[Path]) -> Path:
    """The rank's staging dir with symlinks resolved, if it is a set of `job_id`'s inside one of `roots`."""
    where = f"rank {rank.rank} (node {rank.node or '?'}) announced the staging dir {rank.staging_dir!r}"
    announced = Path(rank.staging_dir)
    if not announced.is_absolute():
        raise Rejected(f"{where}: not an absolute path; nothing was uploaded")
    try:
        real = announced.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # missing, unreadable, a symlink loop
        raise Rejected(f"{where}, which cannot be resolved ({type(exc).__name__}: {exc}); "
                       "nothing was uploaded") from None
    if not real.is_dir():
        raise Rejected(f"{where}, which resolves to {real}, not a folder; nothing was uploaded")
    real_roots = [r.resolve() for r in roots]
    inside_roots = [r for r in real_roots if real != r and real.is_relative_to(r)]
    if not inside_roots:
        raise Rejected(f"{where}, which resolves to {real}, outside the staging roots "
                       f"{[str(r) for r in real_roots]}; nothing was uploaded")
    if not any(_job_set(real, r, job_id) for r in inside_roots):
        raise Rejected(f"{where}, which resolves to {real}: not a set of job {job_id}'s "
                       f"(<staging root>/{job_id}/<set>); nothing was uploaded")
    return real


async def _upload_shard(store: ObjectStore, args: CommitArgs, rank: StagedRank, staged: Path, shard: ShardInfo,
                        readback: bool) -> None:
    where = f"shard {shard.path!r} of rank {rank.rank} (node {rank.node or '?'})"
    try:
        local = local_path(staged, shard.path).resolve()  # uploaded by its real path: checked, not re-followed
    except ValueError as exc:
        raise Rejected(f"{where}: {exc}") from None
    key = mf.shard_key(args.job_id, args.checkpoint_id, shard.path)
    try:
        size, sha = await store.put_file(key, local)
    except (FileNotFoundError, IsADirectoryError):
        raise Rejected(f"{where} is missing from {rank.staging_dir}") from None
    if (size, sha) != (shard.size, shard.sha256):
        raise Rejected(f"{where} is corrupt: staged {size} bytes with sha256 {sha}, the rank announced "
                       f"{shard.size} bytes with {shard.sha256}")
    if readback:
        stored = await store.hash_object(key)
        if stored != (size, sha):
            raise Rejected(f"{where}: the stored copy has {stored[0]} bytes with sha256 {stored[1]}, "
                           f"not what was written ({size} bytes, {sha})")


async def _upload_all(store: ObjectStore, args: CommitArgs, staged: dict[int, Path], file_concurrency: int,
                      readback: bool) -> None:
    slots = asyncio.Semaphore(file_concurrency)
    errors: list[Exception] = []

    async def one(rank: StagedRank, shard: ShardInfo) -> None:
        async with slots:
            if errors:  # one bad shard dooms the checkpoint: start no more uploads
                return
            try:
                await _upload_shard(store, args, rank, staged[rank.rank], shard, readback)
            except Exception as exc:
                errors.append(exc)

    # uploads already running are let finish rather than cancelled: a local store's write runs in a
    # thread that a cancel would not stop, and it must not land after the failed checkpoint is cleaned up
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


async def commit(store: ObjectStore, args: CommitArgs, *, file_concurrency: int = 4,
                 readback: bool | None = None, staging_roots: Sequence[Path] | None = None) -> list[Emit]:
    """Upload and verify one checkpoint; the Emits record the outcome (committed or failed).

    `staging_roots`: where ranks stage (`confine`); None trusts the announced dirs, for callers that staged
    the files themselves. The service always passes its roots (service.py)."""
    blog = log.bind(job_id=args.job_id, checkpoint_id=args.checkpoint_id, step=args.step)
    manifest = build_manifest(args)
    body = mf.encode(manifest)
    mkey = mf.manifest_key(args.job_id, args.checkpoint_id)
    started = time.monotonic()
    wrote_shards = False
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
            # only before an upload: a re-run of a commit that landed may find its staging already removed
            staged = {r.rank: Path(r.staging_dir) if staging_roots is None
                      else await asyncio.to_thread(confine, args.job_id, r, staging_roots) for r in args.ranks}
            wrote_shards = True
            await _upload_all(store, args, staged, file_concurrency,
                              store.readback_after_put if readback is None else readback)
            try:
                await store.put_bytes(mkey, body, if_none_match=True)  # last: this write is the commit
            except ObjectAlreadyExists:
                existing = await _existing_manifest(store, mkey)
        if existing is not None and existing != body:
            wrote_shards = False  # the prefix belongs to the checkpoint that holds it: leave it alone
            raise Rejected(f"{store.uri(mkey)} already holds a different manifest")
    except Rejected as exc:
        return await _failed(store, args, str(exc), cleanup=wrote_shards)
    except Exception as exc:
        blog.error("checkpoint upload failed", exc_info=True)
        return await _failed(store, args, f"upload failed: {type(exc).__name__}: {exc}", cleanup=wrote_shards)
    seconds = time.monotonic() - started
    blog.info("checkpoint committed", bytes=manifest.bytes, seconds=round(seconds, 3),
              mb_s=round(manifest.bytes / (1 << 20) / max(seconds, 1e-9), 1), uri=store.uri(mkey))
    event = CheckpointCommitted(
        job_id=args.job_id, checkpoint_id=args.checkpoint_id, step=args.step, world_size=args.world_size,
        uri=store.uri(mkey), bytes=manifest.bytes, data=args.data, manifest_sha256=mf.sha256(body),
        attempt=args.attempt, timeline=args.timeline,
    )
    return [Emit(subjects.job(args.job_id, "CheckpointCommitted"), event)]


async def _failed(store: ObjectStore, args: CommitArgs, reason: str, *, cleanup: bool) -> list[Emit]:
    log.warning("checkpoint failed", job_id=args.job_id, checkpoint_id=args.checkpoint_id, reason=reason)
    if cleanup:
        try:
            await store.delete_prefix(mf.prefix(args.job_id, args.checkpoint_id))
        except Exception:  # orphans without a manifest are harmless; the failure is what must be recorded
            log.error("could not remove a failed checkpoint's shards", checkpoint_id=args.checkpoint_id, exc_info=True)
    event = CheckpointFailed(job_id=args.job_id, step=args.step, reason=f"{args.checkpoint_id}: {reason}")
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


def remove_staged(args: CommitArgs) -> None:
    """Delete the staged files a commit uploaded (and their folders once empty)."""
    for rank in args.ranks:
        root = Path(rank.staging_dir)
        for shard in rank.shards:
            local_path(root, shard.path).unlink(missing_ok=True)
        try:
            os.rmdir(root)
        except OSError:  # other ranks' files, or already gone
            pass


def handlers(store: ObjectStore, *, file_concurrency: int = 4, readback: bool | None = None,
             remove_staging: bool = False, staging_roots: Sequence[Path] | None = None) -> dict[str, EffectHandler]:
    """The effect handlers `core_service` needs, bound to one store.

    `remove_staging`: after a commit, delete the staged files (where the service shares the ranks' disk).
    `staging_roots`: upload only sets of the job's under these (see `commit`)."""

    async def on_commit(args: Any) -> list[Emit]:
        assert isinstance(args, CommitArgs), type(args)
        out = await commit(store, args, file_concurrency=file_concurrency, readback=readback,
                           staging_roots=staging_roots)
        if remove_staging and isinstance(out[0].event, CheckpointCommitted):
            await asyncio.to_thread(remove_staged, args)
        return out

    async def on_delete(args: Any) -> list[Emit]:
        assert isinstance(args, DeleteArgs), type(args)
        return await delete(store, args)

    return {"commit": on_commit, "delete": on_delete, "scrub": scrubber.handler(store)}
