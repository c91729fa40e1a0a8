"""Where a rollback's checkpoint is on this node, verified before any rank loads it: the node agent's cache of
committed checkpoints, else what this node staged itself (no platform, or a commit that never came)."""

import re
from collections.abc import Callable
from pathlib import Path

import structlog

from flightdeck.events.ranklink import RollbackReady
from flightdeck.trainer import checkpointing
from flightdeck.trainer.config import RunConfig
from flightdeck.trainer.distributed import Dist

log = structlog.get_logger("trainer")
ROLLBACK_WAIT_S = 30.0  # for the node agent's download of a rollback's checkpoint to land
Ready = Callable[[str, float], RollbackReady | None]  # the agent's word on a checkpoint, waited for up to N s


def rollback_source(cfg: RunConfig, job_id: str, checkpoint_id: str, step: int, staged_here: list[Path],
                    ready: Ready | None = None) -> Path:
    """The verified copy to load: the cache's (a copy appears whole or not at all; the agent downloads one a
    rollback names and says when it is there, or why it could not be: `ready`), else a staged set (same id, or
    `staged_here`). CorruptCheckpoint says what is wrong with the copy, or that there is none."""
    staged = [cfg.staging / job_id / checkpoint_id, *staged_here]
    cached = cfg.checkpoints / job_id / checkpoint_id if cfg.checkpoints else None
    if cached is not None:
        if not cached.is_dir() and ready is not None:
            word = ready(checkpoint_id, ROLLBACK_WAIT_S)
            if word is not None and word.problem:
                raise checkpointing.CorruptCheckpoint(
                    f"node {cfg.node or '?'} could not fetch checkpoint {checkpoint_id}: {word.problem[:2000]}")
        if cached.is_dir():
            manifest = checkpointing.manifest_in(cached)
            if manifest is None:
                raise checkpointing.CorruptCheckpoint(f"checkpoint {cached} has lost its manifest; restore another "
                                                      "checkpoint")
            checkpointing.verify(cached, checkpointing.read_manifest(manifest))
            return cached
    for path in staged:
        if (path / ".metadata").exists():
            log.warning("rolling back from local staging, not a committed checkpoint", path=str(path))
            return path
    raise checkpointing.CorruptCheckpoint(
        f"checkpoint {checkpoint_id} (step {step}) is in none of {[str(p) for p in [cached, *staged] if p]}")


def newest_local(root: Path, dist: Dist) -> Path | None:
    """No-platform mode after a torchrun restart: the newest complete staged set under `root`, as rank 0 sees it."""
    found: list[tuple[int, int, Path]] = []
    for d in root.glob("step-*") if root.is_dir() else []:
        m = re.fullmatch(r"step-(\d+)(?:-t(\d+))?", d.name)
        if m and (d / ".metadata").exists():
            found.append((int(m[1]), int(m[2] or 0), d))
    mine = str(max(found)[2]).encode() if found and dist.rank == 0 else b""
    _, agreed = dist.agree([], mine)  # every rank loads the set rank 0 picked
    return Path(agreed.decode()) if agreed else None
