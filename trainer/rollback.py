"""A rollback as a rank carries it out (RollbackRequested): load the command's checkpoint on every rank or refuse it
on every rank, then, when the command asks, re-run the spike's batches from it (trainer/replay.py) before loading
it again; landing skips the command's window and says so (RolledBack).
"""

import time
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from flightdeck.events.checkpoint import CheckpointRefused
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.training import RolledBack, SpikeReplayed
from flightdeck.trainer import checkpointing, restore_points
from flightdeck.trainer.replay import Replay

if TYPE_CHECKING:
    from flightdeck.trainer.session import Run

log = structlog.get_logger("trainer")


def roll_back(run: "Run", cmd: RollbackRequested) -> None:
    """Load the command's checkpoint (all ranks or none), then re-run the spike's batches first when it asks, or
    land at once."""
    run.reporter.flush()
    run.ckpt.wait()
    run.replay = None  # a newer rollback ends a re-run under way
    reached, started = run.step, time.perf_counter()
    problem, path = "", None
    try:
        path = restore_points.rollback_source(run.cfg, run.job_id, cmd.checkpoint_id, cmd.to_step,
                                              run.ckpt.staged_dirs(cmd.to_step), run.inbox.rollback_ready)
    except checkpointing.CorruptCheckpoint as exc:
        problem = str(exc)
    (refused,), _ = run.dist.agree([int(bool(problem))], b"")  # DCP loads are collective: all or none
    # Every rollback command starts a timeline, loaded or refused: the services count them the same way.
    timeline = run.ckpt.rolled_back()
    if refused or path is None:
        if problem:
            run.emitter.emit(CheckpointRefused(checkpoint_id=cmd.checkpoint_id, to_step=cmd.to_step,
                                               cause=problem[:4000], **run.emitter.envelope))
        log.error("rollback refused: its checkpoint is bad; training on until the scheduler picks another",
                  checkpoint_id=cmd.checkpoint_id, error=problem or "(found by another rank)")
        return
    run._load(path, None)  # verified by rollback_source
    if cmd.replay and reached > run.step:
        # The same batches again, unskipped, before the skip: whether the spike comes back tells its cause.
        run.replay = Replay(cmd=cmd, path=path, timeline=timeline, start=run.step, until=reached, started=started)
        run.emitter.set_step(run.step - 1)
        log.warning("re-running the spike's batches before skipping them", checkpoint=str(path),
                    from_step=run.step, until=reached)
        return
    land(run, cmd, path, timeline)


def land(run: "Run", cmd: RollbackRequested, path: Path, timeline: int) -> None:
    """The rollback's checkpoint is loaded: skip its window and say so."""
    run.cursor.skip(cmd.skip_from, cmd.skip_to)
    run.saved_at = run.step
    run.emitter.set_step(run.step - 1)
    run.emitter.emit(RolledBack(checkpoint_id=cmd.checkpoint_id, to_step=run.step, skip_from=cmd.skip_from,
                                skip_to=cmd.skip_to, timeline=timeline, **run.emitter.envelope))
    log.warning("rolled back", checkpoint=str(path), to_step=run.step, skip=(cmd.skip_from, cmd.skip_to))


def end_replay(run: "Run") -> None:
    """The re-run reached the step the spike was found at: report its losses, restore the checkpoint again."""
    replay, run.replay = run.replay, None
    assert replay is not None
    run.reporter.flush()
    run._load(replay.path, None)
    run.emitter.emit(SpikeReplayed(checkpoint_id=replay.cmd.checkpoint_id, from_step=replay.start,
                                   losses=replay.losses(), seconds=replay.seconds(), **run.emitter.envelope))
    log.warning("re-ran the spike's batches", steps=replay.until - replay.start, seconds=replay.seconds())
    land(run, replay.cmd, replay.path, replay.timeline)
