"""The scheduler's pure core: queue, gang admission, preemption, restarts, job ends.

`evolve` applies a whole transition, decisions included, because an output comes back through the
stream only later and the inputs in between must already see it (a job asked for must not be asked
for twice). The outputs of the latest transition ride in `State.outbox`, which `decide` returns. The
scheduler reads only the types it needs (see `CONTROL_TYPES`); its own outputs, if a shell feeds them
back anyway, change nothing. After every input the queue is given a chance to admit (queue.py).
Time is the input's `occurred_at`, or `now` for a ClockTick; ticks only matter while a stop is in
flight (a stop that outlasts `stop_timeout_s` ends anyway).
"""

import msgspec

from events.base import Event
from events.checkpoint import CheckpointCommitted, CheckpointDeleted
from events.clock import ClockTick
from events.findings import RankHung, RankLost
from events.fleet import NodeCordoned, NodeLost, NodeRegistered, NodeUncordoned, SelfCheckFailed
from events.job import (
    AllocationDenied,
    AllocationGranted,
    CancelRequested,
    JobSubmitted,
    WorkersExited,
    WorkersStarted,
)
from services.core import Output, Service
from services.scheduler import lifecycle, queue
from services.scheduler.state import State
from services.scheduler.tx import Tx

NAME = "scheduler"

CONTROL_TYPES = ("JobSubmitted", "CancelRequested", "AllocationGranted", "AllocationDenied", "WorkersStarted",
                 "WorkersExited", "CheckpointCommitted", "CheckpointDeleted", "RankLost", "RankHung")
FLEET_TYPES = ("NodeRegistered", "NodeCordoned", "NodeUncordoned", "SelfCheckFailed", "NodeLost")


def transition(state: State, event: Event, *, stop_timeout_s: float) -> State:
    tx = Tx(state, event.now if isinstance(event, ClockTick) else event.occurred_at)
    match event:
        case JobSubmitted():
            lifecycle.submitted(tx, event)
        case CancelRequested():
            lifecycle.cancel(tx, event)
        case AllocationGranted():
            lifecycle.granted(tx, event)
        case AllocationDenied():
            lifecycle.denied(tx, event)
        case WorkersStarted():
            lifecycle.started(tx, event)
        case WorkersExited():
            lifecycle.exited(tx, event)
        case RankLost() | RankHung():
            lifecycle.finding(tx, event)
        case CheckpointCommitted():
            lifecycle.checkpoint_committed(tx, event)
        case CheckpointDeleted():
            lifecycle.checkpoint_deleted(tx, event)
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
        case _:
            return msgspec.structs.replace(state, outbox=()) if state.outbox else state
    queue.admit(tx)
    return tx.freeze()


def decide(state: State, event: Event) -> list[Output]:
    return list(state.outbox)


def wants_tick(state: State, now: float) -> bool:
    return any(job.stop for job in state.jobs.values())


def core_service(*, stop_timeout_s: float = 120.0) -> Service[State]:
    """The scheduler core wired as a Service; the shell adds consumers, effects and logging."""
    return Service(
        name=NAME,
        initial=State(),
        evolve=lambda state, event: transition(state, event, stop_timeout_s=stop_timeout_s),
        decide=decide,
        control_subjects=(*(f"fd.ctl.job.*.{t}" for t in CONTROL_TYPES),
                          *(f"fd.ctl.node.*.{t}" for t in FLEET_TYPES)),
        wants_tick=wants_tick,
    )
