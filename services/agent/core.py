"""The node agent's pure core: which ranks this node must start and stop, and what they restore from.

Why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import msgspec

from flightdeck.events import codec, lineage, subjects
from flightdeck.events.base import Event, JobEvent
from flightdeck.events.catalog import COMMAND_TYPES
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, CheckpointRejected
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import SpikeDiagnosed
from flightdeck.events.fleet import NodeLost, NodeRegistered
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobSubmitted,
    SlotRef,
    WorkersExited,
    WorkersStarted,
)
from flightdeck.events.plan import ParallelPlan, ReshardPlanned
from flightdeck.events.spec import JobSpec
from flightdeck.services.core import Effect, EffectHandler, Output, Service

SPAWN, STOP, PREFETCH, EVICT, SELFCHECK, TELL = "spawn", "stop", "prefetch", "evict", "selfcheck", "tell"
REJOIN = "rejoin"
EFFECTS = (SPAWN, STOP, PREFETCH, EVICT, SELFCHECK, TELL, REJOIN)


def service_name(node: str) -> str:
    return f"agent-{subjects.token(node)}"


class Restore(msgspec.Struct, frozen=True, kw_only=True):
    """A committed checkpoint, as much as a restore needs to find and verify it."""

    checkpoint_id: str
    step: int
    manifest_sha256: str = ""
    attempt: int = 0  # the attempt that staged it
    timeline: int = 0  # rollbacks that attempt had applied then
    from_memory: bool = False  # persisted from the ranks' snapshots: a node holding them restores from memory
    job_id: str = ""  # the job whose checkpoint it is, when not this one (the spec's init_from)
    model_only: bool = False  # load the weights only (init_from's what = "model"): the run starts at step 0


class SpawnArgs(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    attempt: int
    node: str
    ranks: list[SlotRef]  # the ranks this node runs, with the slot each one uses
    world_size: int
    master_addr: str
    master_port: int
    spec: JobSpec
    restore: Restore | None
    grant_id: str  # event id of the grant, the cause of what the agent records about these ranks
    skips: list[tuple[int, int]] = []  # batch windows the restore skips beyond its checkpoint's (RestorePoint.skips)
    plan: ParallelPlan | None = None  # the job's newest recorded plan (the ranks use it if it is for their world)
    snapshots_off: str = ""  # why this node's ranks take no host snapshots, as the grant recorded it


class StopArgs(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    attempt: int
    reason: str
    immediate: bool = False  # SIGKILL at once: a newer attempt needs the slots


class PrefetchArgs(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    checkpoint: Restore
    rollback: bool = False  # ranks here wait for it: a download that fails leaves them a note saying why


class EvictArgs(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    checkpoint_ids: list[str]  # empty: the whole job's cache


class SelfCheckArgs(msgspec.Struct, frozen=True, kw_only=True):
    """Run the node's self-check again: a spike's diagnosis suspects this node's hardware."""

    job_id: str
    diagnosis_id: str  # the SpikeDiagnosed that asked
    reason: str


class TellArgs(msgspec.Struct, frozen=True, kw_only=True):
    """Pass something on to the job's ranks on this node, down their links (services/agent/links.py)."""

    job_id: str
    attempt: int = -1  # a command's attempt; -1: every attempt's ranks (a plan)
    command: bytes = b""  # a command as stored (flightdeck.events.codec)
    plan: ParallelPlan | None = None


class Held(msgspec.Struct, frozen=True, kw_only=True):
    attempt: int
    ranks: tuple[SlotRef, ...]


class JobView(msgspec.Struct, frozen=True, kw_only=True):
    spec: JobSpec
    checkpoints: tuple[Restore, ...] = ()  # committed and not deleted, in commit order
    held: Held | None = None  # the attempt whose ranks this node runs
    latest: int = -1  # newest attempt granted or released: a grant for it or an older one is stale or repeated
    forks: tuple[lineage.Fork, ...] = ()  # timelines the job's rollbacks started (for a grant that chose nothing)
    plan: ParallelPlan | None = None  # the newest ReshardPlanned's
    ran: bool = False  # this node was granted ranks of it: they may have left snapshots in its memory


class LiveRank(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    attempt: int
    rank: int
    pid: int
    recorded_at: float = 0.0  # when its start was recorded (WorkersStarted): its process started before


class RejoinArgs(msgspec.Struct, frozen=True, kw_only=True):
    """This node was declared lost while its agent ran (frozen, partitioned, stalled): stop every rank it runs
    (their attempts were replaced), run the self-check, and register again."""

    reason: str  # the NodeLost's


class State(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    registered: bool = False  # its newest NodeRegistered came after its newest NodeLost
    jobs: dict[str, JobView] = {}
    ended: frozenset[str] = frozenset()
    live: dict[str, LiveRank] = {}  # "<job>/<attempt>/<rank>" -> a rank started here that has not exited


def live_key(job_id: str, attempt: int, rank: int) -> str:
    return f"{job_id}/{attempt}/{rank}"


def adopted(spec: JobSpec) -> Restore | None:
    """The other job's checkpoint a job starts from until it has one of its own (its spec's init_from, resolved
    when it was submitted)."""
    init = spec.init_from
    if init is None or not init.checkpoint_id:
        return None
    return Restore(checkpoint_id=init.checkpoint_id, step=init.checkpoint_step, manifest_sha256=init.manifest_sha256,
                   job_id=init.job, model_only=init.what == "model")


Transition = tuple[State, tuple[Output, ...]]


def _put(state: State, job_id: str, view: JobView, *outs: Output) -> Transition:
    return msgspec.structs.replace(state, jobs={**state.jobs, job_id: view}), outs


def _granted(state: State, ev: AllocationGranted) -> Transition:
    view = state.jobs.get(ev.job_id)
    if view is None:
        # Grants only follow submissions in the stream and ended jobs are dropped: nothing to run.
        return state, ()
    mine = tuple(sorted((r for r in ev.assignments if r.node == state.node), key=lambda r: r.rank))
    held = view.held
    if ev.attempt <= view.latest:
        return state, ()  # a stale or repeated grant
    view = msgspec.structs.replace(view, latest=ev.attempt)
    outs: list[Output] = []
    if held is not None:
        outs.append(Effect(STOP, StopArgs(job_id=ev.job_id, attempt=held.attempt, immediate=True,
                                          reason=f"attempt {ev.attempt} replaces it")))
    if not mine:
        return _put(state, ev.job_id, msgspec.structs.replace(view, held=None), *outs)
    restore, skips = _restore_of(view, ev)
    outs.append(Effect(SPAWN, SpawnArgs(
        job_id=ev.job_id, attempt=ev.attempt, node=state.node, ranks=list(mine), world_size=len(ev.assignments),
        master_addr=ev.master_addr, master_port=ev.master_port, spec=view.spec, restore=restore,
        grant_id=ev.event_id, skips=skips, plan=view.plan, snapshots_off=ev.snapshots_off.get(state.node, ""))))
    return _put(state, ev.job_id, msgspec.structs.replace(view, held=Held(attempt=ev.attempt, ranks=mine), ran=True),
                *outs)


def _restore_of(view: JobView, ev: AllocationGranted) -> tuple[Restore | None, list[tuple[int, int]]]:
    """What the granted attempt restores, and the batch windows it skips: the scheduler's choice, recorded in its
    request and carried by the grant (None: the job has no checkpoint of its own, so its spec's init_from, if any).
    A grant that carries no choice comes from a scheduler or resource manager older than that record (a
    service-by-service upgrade): this agent then applies the scheduler's rule to its own catalog, as agents did."""
    if ev.restore_chosen:
        point = ev.restore
        if point is None:
            return adopted(view.spec), []
        return Restore(checkpoint_id=point.checkpoint_id, step=point.step, manifest_sha256=point.manifest_sha256,
                       attempt=point.attempt, from_memory=point.from_memory), [(a, b) for a, b in point.skips]
    newest = lineage.newest(view.checkpoints, view.forks)
    if newest is None:
        return adopted(view.spec), []
    return newest, list(lineage.restore_skips(view.forks, newest.attempt, newest.timeline, newest.step))


def _released(state: State, ev: AllocationReleased) -> Transition:
    view = state.jobs.get(ev.job_id)
    if view is None:
        return state, ()
    after = msgspec.structs.replace(view, latest=max(view.latest, ev.attempt))
    if view.held is None or view.held.attempt != ev.attempt:
        return _put(state, ev.job_id, after)
    stop = Effect(STOP, StopArgs(job_id=ev.job_id, attempt=ev.attempt, reason=f"released: {ev.reason}"))
    return _put(state, ev.job_id, msgspec.structs.replace(after, held=None), stop)


def _ended(state: State, job_id: str, why: str) -> Transition:
    view = state.jobs.get(job_id)
    if view is None:
        return state, ()
    outs: list[Output] = []
    if view.held is not None:
        outs.append(Effect(STOP, StopArgs(job_id=job_id, attempt=view.held.attempt, reason=why)))
    # its cached checkpoints, and the snapshots its ranks left in this node's memory (shared memory is RAM: a job
    # that failed in 1 s with nothing committed kept its slots, issue 51)
    if view.checkpoints or view.ran:
        outs.append(Effect(EVICT, EvictArgs(job_id=job_id, checkpoint_ids=[])))
    jobs = {j: v for j, v in state.jobs.items() if j != job_id}
    return msgspec.structs.replace(state, jobs=jobs, ended=state.ended | {job_id}), tuple(outs)


def _committed(state: State, ev: CheckpointCommitted) -> Transition:
    view = state.jobs.get(ev.job_id)
    if view is None or any(c.checkpoint_id == ev.checkpoint_id for c in view.checkpoints):
        return state, ()
    entry = Restore(checkpoint_id=ev.checkpoint_id, step=ev.step, manifest_sha256=ev.manifest_sha256,
                    attempt=ev.attempt, timeline=ev.timeline, from_memory=ev.from_memory)
    after = msgspec.structs.replace(view, checkpoints=(*view.checkpoints, entry))
    if view.held is None:
        return _put(state, ev.job_id, after)
    return _put(state, ev.job_id, after, Effect(PREFETCH, PrefetchArgs(job_id=ev.job_id, checkpoint=entry)))


def _gone(state: State, ev: CheckpointDeleted | CheckpointRejected) -> Transition:
    """A deleted checkpoint leaves the catalog and the cache (the scheduler, reading the same news, never chooses
    it for a restore). One this node found bad leaves them too (its copy may be what is bad); another node's claim
    is that node's word only: the checkpoint service reads the store and deletes it if the claim holds."""
    view = state.jobs.get(ev.job_id)
    if view is None or not any(c.checkpoint_id == ev.checkpoint_id for c in view.checkpoints):
        return state, ()
    if isinstance(ev, CheckpointRejected) and ev.node != state.node:
        return state, ()
    after = msgspec.structs.replace(view, checkpoints=tuple(c for c in view.checkpoints
                                                             if c.checkpoint_id != ev.checkpoint_id))
    return _put(state, ev.job_id, after, Effect(EVICT, EvictArgs(job_id=ev.job_id,
                                                                 checkpoint_ids=[ev.checkpoint_id])))


def _rollback(state: State, ev: RollbackRequested) -> Transition:
    """Ranks here read a rollback's checkpoint from the cache: fetch it again if the copy went missing."""
    view = state.jobs[ev.job_id]
    after = msgspec.structs.replace(view, forks=lineage.forked(view.forks, ev))
    target = next((c for c in view.checkpoints if c.checkpoint_id == ev.checkpoint_id), None)
    if view.held is None or view.held.attempt != ev.attempt:
        return _put(state, ev.job_id, after)
    tell = Effect(TELL, TellArgs(job_id=ev.job_id, attempt=ev.attempt, command=codec.encode(ev)))
    if target is None:  # not committed as far as this node knows: the ranks refuse it, as they would a bad copy
        return _put(state, ev.job_id, after, tell)
    return _put(state, ev.job_id, after, tell, Effect(PREFETCH, PrefetchArgs(job_id=ev.job_id, checkpoint=target,
                                                                             rollback=True)))


def _command(state: State, ev: JobEvent) -> Transition:
    """A command for the job's ranks: the ones here hear it from this agent, in history order."""
    held = state.jobs[ev.job_id].held
    if held is None:
        return state, ()
    return state, (Effect(TELL, TellArgs(job_id=ev.job_id, attempt=held.attempt, command=codec.encode(ev))),)


def _planned(state: State, ev: ReshardPlanned) -> Transition:
    view = msgspec.structs.replace(state.jobs[ev.job_id], plan=ev.new)
    return _put(state, ev.job_id, view, Effect(TELL, TellArgs(job_id=ev.job_id, plan=ev.new)))


def _workers(state: State, ev: WorkersStarted | WorkersExited) -> Transition:
    if ev.node != state.node:
        return state, ()
    live = dict(state.live)
    if isinstance(ev, WorkersStarted):
        for rank, pid in zip(ev.ranks, ev.pids, strict=True):
            live[live_key(ev.job_id, ev.attempt, rank)] = LiveRank(job_id=ev.job_id, attempt=ev.attempt, rank=rank,
                                                                   pid=pid, recorded_at=ev.occurred_at)
    else:
        for x in ev.exits():
            live.pop(live_key(ev.job_id, ev.attempt, x.rank), None)
    return msgspec.structs.replace(state, live=live), ()


def _fleet(state: State, event: NodeRegistered | NodeLost) -> Transition:
    """A NodeLost of this node after its registration: the fleet moved on without it (it was frozen, partitioned or
    stalled past the lost deadline, and its ranks were replaced), so it fences what it ran and joins again. Without
    this an agent that resumed stayed lost for ever, its node cordoned and its slots gone (issue 51)."""
    if event.node != state.node:
        return state, ()
    if isinstance(event, NodeRegistered):
        return msgspec.structs.replace(state, registered=True), ()
    if not state.registered:  # lost before this registration (an earlier agent's): nothing of it runs here
        return state, ()
    return msgspec.structs.replace(state, registered=False), (Effect(REJOIN, RejoinArgs(reason=event.reason)),)


def transition(state: State, event: Event) -> Transition:
    match event:
        case NodeRegistered() | NodeLost():
            return _fleet(state, event)
        case JobSubmitted(job_id=job_id, spec=spec):
            if job_id in state.jobs or job_id in state.ended:  # the same submission seen again
                return state, ()
            return _put(state, job_id, JobView(spec=spec))
        case AllocationGranted():
            return _granted(state, event)
        case AllocationReleased():
            return _released(state, event)
        case JobCancelled(job_id=job_id, reason=reason):
            return _ended(state, job_id, f"cancelled: {reason}")
        case JobCompleted(job_id=job_id):
            return _ended(state, job_id, "completed")
        case JobFailed(job_id=job_id, reason=reason):
            return _ended(state, job_id, f"failed: {reason}")
        case CheckpointCommitted():
            return _committed(state, event)
        case CheckpointDeleted() | CheckpointRejected():
            return _gone(state, event)
        case RollbackRequested(job_id=job_id) if job_id in state.jobs:
            return _rollback(state, event)
        case JobEvent(job_id=job_id) if isinstance(event, COMMAND_TYPES) and job_id in state.jobs:
            return _command(state, event)
        case ReshardPlanned(job_id=job_id) if job_id in state.jobs:
            return _planned(state, event)
        case WorkersStarted() | WorkersExited():
            return _workers(state, event)
        case SpikeDiagnosed(verdict="hardware") if state.node in event.suspect_nodes:
            # Its SelfCheckPassed or SelfCheckFailed is recorded on the node; a failure cordons it (resources).
            why = f"a loss spike of {event.job_id} at step {event.step} is diagnosed as a hardware fault here"
            return state, (Effect(SELFCHECK, SelfCheckArgs(job_id=event.job_id, diagnosis_id=event.event_id,
                                                           reason=why)),)
        case _:
            return state, ()


CONTROL_TYPES = ("JobSubmitted", "AllocationGranted", "AllocationReleased", "JobCancelled", "JobCompleted",
                 "JobFailed", "CheckpointCommitted", "CheckpointDeleted", "CheckpointRejected", "WorkersStarted",
                 "WorkersExited", "RollbackRequested", "SpikeDiagnosed", "ReshardPlanned", "CheckpointRequested",
                 "StopRequested", "PauseRequested", "ResumeRequested")
FLEET_TYPES = ("NodeRegistered", "NodeLost")


def core_service(node: str, effects: dict[str, EffectHandler]) -> Service[State]:
    """The agent core of `node` wired to its effect handlers (spawner.py); replays fold it without running them."""
    missing = set(EFFECTS) - set(effects)
    if missing:
        raise ValueError(f"the node agent needs effect handlers for {sorted(missing)}")
    return Service(
        name=service_name(node),
        initial=State(node=node),
        transition=transition,
        control_subjects=(*subjects.job_types(*CONTROL_TYPES),
                          *(subjects.node(node, t) for t in FLEET_TYPES)),  # its own: is it lost?
        wants_tick=lambda state, now: False,  # nothing here waits on time: grace periods are the spawner's
        effects=effects,
    )
