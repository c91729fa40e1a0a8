"""Flightdeck's trainer API: what a training script imports (`import flightdeck`) to be run, watched,
checkpointed and healed by Flightdeck. The whole API:

    run = flightdeck.init()                      # join the job (or run alone: no-platform mode)
    run.register(model, optimizer, **extras)     # what a checkpoint holds; extras: state_dict()/load_state_dict()
    start = run.restore()                        # optional: steps() restores first anyway; returns the step
    for step in run.steps():                     # commands, checkpoints, preemption, drills at step boundaries
        x, y = my_batch(step.batch)              # read global batch `step.batch` (a rollback skips some)
        ...                                      # forward, backward, optimizer step: your code
        run.report(step, loss, lr=lr, **metrics) # tensors are read later: no host sync
    for step, (x, y) in run.batches(loader):     # or: your data loader, kept at step.batch (trainer/loaders.py)

`run.rank`, `run.world_size`, `run.local_rank`, `run.device` say where this rank runs; `run.plan` is the
parallel layout Flightdeck recorded for this world size (dp, tp, pp, micro-batches); `run.spec` the job spec;
`run.seed` the seed the script gave torch, from which each step's random numbers derive (seeded before each step).
A stop or a preemption (SIGTERM) ends the process with exit code 75 after its checkpoint is saved; exit 0 means
every step ran (a script that leaves `steps()` early exits 75 too). Details
and the no-platform mode: docs/user-code.md.
"""

import atexit
import sys
from typing import Any

import structlog

from flightdeck.events.nodelocal import BeatChannel
from flightdeck.trainer import config, distributed
from flightdeck.trainer.beats import steps_to_bus
from flightdeck.trainer.checkpointing import CorruptCheckpoint
from flightdeck.trainer.cursor import Step
from flightdeck.trainer.exits import at_exit, fail_hook
from flightdeck.trainer.link import AgentLink, Offline
from flightdeck.trainer.reports import Emitter
from flightdeck.trainer.session import Run
from flightdeck.trainer.state import Stateful

__all__ = ["CorruptCheckpoint", "Run", "Stateful", "Step", "init"]

_run: Run | None = None


def init() -> Run:
    """Join this rank's job from what the node agent (or torchrun) set; the same Run on a second call.

    Joins torch.distributed when the world has more than one rank and the script has not joined already."""
    global _run
    if _run is not None:
        return _run
    cfg = config.from_env()
    structlog.contextvars.bind_contextvars(job_id=cfg.job_id, rank=cfg.rank, attempt=cfg.attempt)
    envelope: dict[str, Any] = {"job_id": cfg.job_id, "rank": cfg.rank, "attempt": cfg.attempt, "node": cfg.node}
    beats = BeatChannel.from_env() if cfg.platform else None  # the agent batches its node's heartbeats
    link: AgentLink | Offline = Offline()
    if cfg.agent is not None:  # the rank's only link to the platform: its node agent
        link = AgentLink(cfg.agent, cfg.job_id, cfg.rank, cfg.attempt, cfg.node,
                         heartbeat_s=cfg.spec.policy.heartbeat_interval_s, beats=beats)
        link.connect()
        link.start()
    emitter = Emitter(link, envelope, cfg.events_log, steps_to_bus=steps_to_bus(cfg.rank, beats))
    try:
        dist = distributed.init(cfg.rank, cfg.world_size, cfg.local_rank, cfg.device,
                                identity=f"{cfg.job_id} attempt {cfg.attempt}")
    except BaseException:
        emitter.close()
        raise
    run = Run(cfg, dist, emitter, link)
    run.install_signals()
    if run.last is not None and cfg.platform:  # a rank stuck in a step snapshots its last boundary on SIGTERM
        run.last.watch_sigterm()
    sys.excepthook = fail_hook(run)
    atexit.register(at_exit, run)
    _run = run
    return run
