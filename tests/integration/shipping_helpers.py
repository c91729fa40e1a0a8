"""The checkpoint path with no shared disk, in-process: each rank's agent stores its staged shards
(services/agent/shipping.store_rank), the checkpoint core folds the stagings and the agents' reports, and the
commit (or delete) effects it asks for run against the store."""

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path

from flightdeck.events.checkpoint import (
    CheckpointCommitted,
    CheckpointFailed,
    CheckpointStaged,
    DataPosition,
    ShardInfo,
    ShardsUploaded,
)
from flightdeck.services.agent.shipping import NotStored, store_rank
from flightdeck.services.checkpoints import core, uploader
from flightdeck.services.checkpoints.state import CommitArgs, DeleteArgs, Settings
from flightdeck.services.core import Effect, Emit
from flightdeck.services.shell.objects.store import ObjectStore

LIVE = core.State(settings=Settings(shards_from="agents"))


def staged_files(root: Path, job_id: str, step: int, files: dict[str, bytes], *, rank: int = 0, world: int = 1,
                 node: str = "n0") -> CheckpointStaged:
    """Write one rank's files into its set under the staging root, as a rank does; what it then announces."""
    folder = root / job_id / f"step-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    shards = [ShardInfo(path=n, size=len(d), sha256=hashlib.sha256(d).hexdigest()) for n, d in files.items()]
    return CheckpointStaged(job_id=job_id, rank=rank, attempt=0, node=node, step=step, world_size=world,
                            staging_dir=str(folder), shards=shards, data=DataPosition(next_batch=step + 1),
                            stall_s=0.0, write_s=0.0, occurred_at=float(step))


async def ship(store: ObjectStore, staged: CheckpointStaged, roots: Sequence[Path]) -> ShardsUploaded:
    """What the rank's agent does with one announcement: store the shards, report (failed says why not)."""
    started = time.monotonic()
    try:
        size, failed = await store_rank(store, staged, roots), ""
    except NotStored as exc:
        size, failed = 0, str(exc)
    return ShardsUploaded(job_id=staged.job_id, rank=staged.rank, attempt=staged.attempt, node=staged.node,
                          step=staged.step, timeline=staged.timeline, world_size=staged.world_size,
                          ranks=[staged.rank], bytes=size, seconds=time.monotonic() - started, failed=failed,
                          occurred_at=staged.occurred_at)


async def fold(store: ObjectStore, events: Sequence[CheckpointStaged | ShardsUploaded]
               ) -> tuple[CommitArgs | None, CheckpointFailed | None]:
    """Fold through the live core; run the deletes it asks for. The commit it asks for, or the failure it records."""
    state = LIVE
    asked: CommitArgs | None = None
    failed: CheckpointFailed | None = None
    for ev in events:
        state, outs = core.transition(state, ev)
        for out in outs:
            if isinstance(out, Effect) and out.kind == core.COMMIT:
                asked = out.args
            elif isinstance(out, Effect) and out.kind == core.DELETE:
                assert isinstance(out.args, DeleteArgs)
                await uploader.delete(store, out.args)
            elif isinstance(out, Emit) and isinstance(out.event, CheckpointFailed):
                failed = out.event
    return asked, failed


async def ship_and_commit(store: ObjectStore, stagings: Sequence[CheckpointStaged], roots: Sequence[Path]
                          ) -> CheckpointCommitted | CheckpointFailed:
    """Every rank's agent stores its shards, then the checkpoint service commits (or records why not)."""
    events: list[CheckpointStaged | ShardsUploaded] = []
    for staged in stagings:
        events += [staged, await ship(store, staged, roots)]
    asked, failed = await fold(store, events)
    if failed is not None:
        return failed
    assert asked is not None, "every rank staged and was stored, so a commit is due"
    [emit] = await uploader.commit(store, asked)
    assert isinstance(emit.event, CheckpointCommitted | CheckpointFailed)
    return emit.event
