"""The "scrub" effect: read one committed checkpoint back from the store at a bounded rate and record whether its
manifest and every shard still match what was committed (CheckpointScrubbed).

Why it works this way: docs/internals.md, "5. Checkpoints".
"""

import time
from typing import Any

import structlog

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointScrubbed
from flightdeck.services.checkpoints.state import ScrubArgs
from flightdeck.services.core import Emit
from flightdeck.services.shell.objects import manifest as mf
from flightdeck.services.shell.objects.store import ObjectNotFound, ObjectStore

log = structlog.get_logger("flightdeck.checkpoints")


async def scrub(store: ObjectStore, args: ScrubArgs) -> list[Emit]:
    """Re-verify `args`' checkpoint: its manifest's sha256 as committed, each shard's size and sha256. The first
    mismatch is the finding; a store that cannot be read raises (the core asks again later)."""
    started, read, cause = time.perf_counter(), 0, ""
    try:
        manifest, raw = await mf.read_manifest(store, args.job_id, args.checkpoint_id,
                                               expected_sha256=args.manifest_sha256)
        read += len(raw)
        for shard in manifest.shards:
            try:
                size, digest = await store.hash_object(mf.shard_key(args.job_id, args.checkpoint_id, shard.path),
                                                       bytes_per_s=args.bytes_per_s)
            except ObjectNotFound:
                cause = f"shard {shard.path!r} of {args.job_id}/{args.checkpoint_id} is missing from the store"
                break
            read += size
            if (size, digest) != (shard.size, shard.sha256):
                cause = (f"shard {shard.path!r} of {args.job_id}/{args.checkpoint_id}: the store holds {size} bytes "
                         f"with sha256 {digest}, the manifest says {shard.size} bytes with {shard.sha256}")
                break
    except (mf.CorruptCheckpoint, mf.CheckpointMissing) as exc:
        cause = str(exc)
    seconds = time.perf_counter() - started
    bound = log.bind(job_id=args.job_id, checkpoint_id=args.checkpoint_id, bytes=read, seconds=round(seconds, 3))
    if cause:
        bound.error("scrub found a bad checkpoint", cause=cause, claim_node=args.claim_node or None)
    elif args.claim_node:
        bound.warning("a checkpoint a node claimed bad reads back intact: the node is the suspect",
                      claim_node=args.claim_node, claim_cause=args.claim_cause)
    else:
        bound.info("scrubbed")
    event = CheckpointScrubbed(job_id=args.job_id, checkpoint_id=args.checkpoint_id, step=args.step, bytes=read,
                               seconds=seconds, cause=cause[:2000], occurred_at=time.time(),
                               claim_node=args.claim_node, claim_cause=args.claim_cause[:2000],
                               schema_version=2 if args.claim_node else 1)
    return [Emit(subjects.job(args.job_id, "CheckpointScrubbed"), event)]


def handler(store: ObjectStore) -> Any:
    async def on_scrub(args: Any) -> list[Emit]:
        assert isinstance(args, ScrubArgs), type(args)
        return await scrub(store, args)

    return on_scrub
