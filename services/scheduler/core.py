"""The scheduler's pure core: queue, gang admission, preemption, restarts, job ends.

Why it works this way: docs/internals.md, "3. The scheduler and its recovery recipes".
"""

import msgspec

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import (
    CheckpointCommitted,
    CheckpointDeleted,
    CheckpointFailed,
    CheckpointPending,
    CheckpointRefused,
    CheckpointRejected,
    CheckpointScrubbed,
    CheckpointsFailing,
    CheckpointsRecovered,
)
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.commands import PauseRequested, ResumeRequested
from flightdeck.events.findings import LossSpikeDetected, NonFiniteLoss, RankHung, RankLost, StragglerDetected
from flightdeck.events.fleet import NodeCordoned, NodeLost, NodeRegistered, NodeUncordoned, SelfCheckFailed
from flightdeck.events.job import (
    AllocationDenied,
    AllocationGranted,
    CancelRequested,
    JobSubmitted,
    RollbackAsked,
    WorkersExited,
    WorkersStarted,
)
from flightdeck.events.training import RolledBack
from flightdeck.services.core import Output, Service
from flightdeck.services.scheduler import claims, commit_wait, lifecycle, queue, recovery, store_incidents
from flightdeck.services.scheduler.state import Settings, State
from flightdeck.services.scheduler.tx import Tx

NAME = "scheduler"

CONTROL_TYPES = ("JobSubmitted", "CancelRequested", "AllocationGranted", "AllocationDenied", "WorkersStarted",
                 "WorkersExited", "CheckpointCommitted", "CheckpointDeleted", "CheckpointRejected", "CheckpointPending",
                 "CheckpointFailed", "CheckpointScrubbed", "RollbackAsked", "RankLost", "PauseRequested",
                 "ResumeRequested", "CheckpointsFailing", "CheckpointsRecovered",
                 "RankHung", "StragglerDetected", "NonFiniteLoss", "LossSpikeDetected")
TELEMETRY_TYPES = ("RolledBack", "CheckpointRefused")
FLEET_TYPES = ("NodeRegistered", "NodeCordoned", "NodeUncordoned", "SelfCheckFailed", "NodeLost")


def transition(state: State, event: Event) -> tuple[State, tuple[Output, ...]]:
    match event:
        case CoreConfigured(service=service) if service == NAME:
            return msgspec.structs.replace(state, settings=msgspec.convert(event.settings, Settings)), ()
        case ClockTick(now=at):
            pass
        case RolledBack() | CheckpointRefused():  # a rank's clock is not the scheduler's
            at = state.now
        case _:
            at = event.occurred_at
    tx = Tx(state, at)
    stop_timeout_s, landing_timeout_s = state.settings.stop_timeout_s, state.settings.landing_timeout_s
    match event:
        case JobSubmitted():
            lifecycle.submitted(tx, event)
        case CancelRequested():
            lifecycle.cancel(tx, event)
        case PauseRequested() | ResumeRequested():
            lifecycle.pause(tx, event)
        case AllocationGranted():
            lifecycle.granted(tx, event)
        case AllocationDenied():
            lifecycle.denied(tx, event)
        case WorkersStarted():
            lifecycle.started(tx, event)
        case WorkersExited():
            commit_wait.exits_owed(tx, event)
            lifecycle.exited(tx, event)
        case RankLost() | RankHung() | StragglerDetected():
            lifecycle.finding(tx, event)
        case LossSpikeDetected() | NonFiniteLoss():
            recovery.loss_finding(tx, event, landing_timeout_s)
        case RollbackAsked():
            recovery.asked(tx, event, landing_timeout_s)
        case RolledBack():
            recovery.rolled_back(tx, event)
        case CheckpointCommitted():
            recovery.checkpoint_committed(tx, event, landing_timeout_s)
            commit_wait.settled(tx, event)
        case CheckpointPending():
            commit_wait.pending(tx, event)
        case CheckpointFailed():
            commit_wait.settled(tx, event)
        case CheckpointDeleted():
            lifecycle.checkpoint_deleted(tx, event)
            if claims.verifying(tx):
                claims.deleted(tx, event)
        case CheckpointRejected() if claims.verifying(tx):
            claims.rejected(tx, event)
        case CheckpointRejected():
            lifecycle.checkpoint_rejected(tx, event)
        case CheckpointScrubbed() if claims.verifying(tx):
            claims.read_back(tx, event)
        case CheckpointsFailing():
            store_incidents.failing(tx, event)
        case CheckpointsRecovered():
            store_incidents.recovered(tx, event)
        case CheckpointRefused():
            recovery.refused(tx, event)
        case NodeRegistered(node=name):
            tx.set_node(name, slots=event.slots, spare=event.spare, lost=False)
            tx.epoch += 1
        case NodeUncordoned(node=name):
            tx.set_node(name, cordoned=False)
            tx.epoch += 1
        case NodeCordoned(node=name) | SelfCheckFailed(node=name):
            tx.set_node(name, cordoned=True)
        case NodeLost(node=name, reason=reason):
            lifecycle.node_lost(tx, name, reason, event.event_id)
        case ClockTick():
            lifecycle.stop_deadlines(tx, stop_timeout_s)
            commit_wait.deadlines(tx)
            claims.deadlines(tx)
        case _:
            return state, ()
    queue.admit(tx)
    return tx.freeze()


def wants_tick(state: State, now: float) -> bool:
    landing_timeout_s = state.settings.landing_timeout_s
    return any(job.run.stop or job.waits_for or recovery.in_flight(job, now, landing_timeout_s)
               for job in state.jobs.values())


def core_service(*, stop_timeout_s: float = 120.0, landing_timeout_s: float = 120.0,
                 memory_wait: bool = True) -> Service[State]:
    """The scheduler core wired as a Service, starting from these settings; the shell adds consumers, effects and
    logging. `landing_timeout_s`: how long a rollback counts as in flight when no rank reports RolledBack.
    `memory_wait`: restarts wait for the set persisted from the ranks' snapshots (commit_wait.MEMORY)."""
    settings = Settings(stop_timeout_s=stop_timeout_s, landing_timeout_s=landing_timeout_s,
                        memory_wait="promised" if memory_wait else "no", phases="yes", restores="requested",
                        claims="verify", agent_faults="free")
    return Service(
        name=NAME,
        initial=State(settings=settings),
        transition=transition,
        control_subjects=(*subjects.job_types(*CONTROL_TYPES),
                          *(f"fd.ctl.node.*.{t}" for t in FLEET_TYPES)),
        telemetry_subjects=tuple(f"fd.tel.*.*.{t}" for t in TELEMETRY_TYPES),
        wants_tick=wants_tick,
        settings=msgspec.structs.asdict(settings),
        unrecorded=msgspec.structs.asdict(msgspec.structs.replace(settings, memory_wait="no", phases="no",
                                                                              restores="granted", claims="trust",
                                                                              agent_faults="charged")),
    )
