"""`python -m trainer`: run one rank (rank and world from the torchrun variables; see docs/internals.md).

Exit 0: all steps done, stopped on command, or preempted by SIGTERM after saving a checkpoint.
Any other code: the rank failed (an exception is reported as RankFault first).
"""

import sys
from typing import Any

import structlog

from events.nodelocal import BeatChannel
from events.training import RankFault
from trainer import config, distributed
from trainer.beats import steps_to_bus
from trainer.commands import CommandInbox
from trainer.loop import Loop
from trainer.reports import Emitter
from trainer.telemetry import Telemetry

EXCEPTION_EXIT_CODE = 1


def main(argv: list[str] | None = None) -> int:
    cfg = config.from_args(argv)
    structlog.contextvars.bind_contextvars(job_id=cfg.job_id, rank=cfg.rank, attempt=cfg.attempt)
    log = structlog.get_logger("trainer")
    envelope: dict[str, Any] = {"job_id": cfg.job_id, "rank": cfg.rank, "attempt": cfg.attempt, "node": cfg.node}
    beats = BeatChannel.from_env()  # the node agent batches this node's heartbeats (events/nodelocal.py)
    telemetry = Telemetry(cfg.nats_url, cfg.job_id, cfg.rank, cfg.attempt, cfg.node,
                          heartbeat_s=cfg.spec.policy.heartbeat_interval_s, beats=beats)
    # Only rank 0's view of the commands counts (it is broadcast), so only rank 0 subscribes.
    inbox = CommandInbox(cfg.nats_url if cfg.rank == 0 else None, cfg.job_id, cfg.rank, cfg.attempt)
    emitter = Emitter(telemetry, envelope, cfg.events_log, steps_to_bus=steps_to_bus(cfg.rank, beats))
    telemetry.start()
    inbox.start()
    loop: Loop | None = None
    dist: distributed.Dist | None = None
    try:
        dist = distributed.init(cfg.rank, cfg.world_size, cfg.local_rank, cfg.device)
        loop = Loop(cfg, dist, emitter, inbox)
        loop.install_signals()
        code = loop.run()
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        log.exception("rank failed", error=text)
        emitter.emit(RankFault(kind="cuda" if "CUDA" in text else "exception", error_type=type(exc).__name__,
                               message=str(exc)[:4000], step=loop.step if loop else 0, **envelope))
        code = EXCEPTION_EXIT_CODE
    finally:
        inbox.close()
        emitter.close()
    if code == 0 and dist is not None:
        dist.close()  # only when the peers are healthy: tearing down a broken group can block
    log.info("rank exiting", exit_code=code)
    return code


if __name__ == "__main__":
    sys.exit(main())
