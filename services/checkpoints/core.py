"""The checkpoint service's pure core: which checkpoints to commit and which to delete.

Why it works this way: docs/internals.md, "5. Checkpoints".
"""

from collections.abc import Sequence

import msgspec
from msgspec.structs import replace

from flightdeck.events import subjects
from flightdeck.events.base import Event, JobEvent
from flightdeck.events.checkpoint import (
    CheckpointCommitted,
    CheckpointDeleted,
    CheckpointFailed,
    CheckpointPending,
    CheckpointRefused,
    CheckpointRejected,
    CheckpointScrubbed,
    CheckpointStaged,
    ShardsUploaded,
    checkpoint_id,
)
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.fleet import NodeLost, NodeRegistered
from flightdeck.events.job import (
    AllocationGranted,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobResumed,
    JobSubmitted,
    WorkersExited,
)
from flightdeck.events.lineage import forked, thrown_away
from flightdeck.events.training import RankStarted, RolledBack
from flightdeck.services.checkpoints import incidents, settle
from flightdeck.services.checkpoints.scrubs import SCRUB, add_claim, answered, claims_due, next_scrub, scrub_due
from flightdeck.services.checkpoints.state import (
    NOTHING_DUE,
    Claim,
    Committed,
    DeleteArgs,
    Due,
    Hold,
    JobState,
    Settings,
    Staging,
    State,
)
from flightdeck.services.core import Effect, EffectHandler, Emit, Output, Service

SERVICE = "checkpoints"
COMMIT = "commit"
DELETE = "delete"
THROWN_AWAY = "thrown away by a rollback"  # CheckpointDeleted.reason, beside the default "retention"
REJECTED = "rejected: found bad on restore"  # ... and a checkpoint a node agent found bad (Settings.claims "trust")
# ... and one a node claimed bad that the service's own read of the store found bad too (Settings.claims "verify")
CONFIRMED = "found bad on restore by a node, and by the checkpoint service's read of the store"
SCRUBBED_BAD = "found bad by a scrub of the store"  # ... and one the scrubber found bad (CheckpointScrubbed)
FAILING_AFTER = 3  # a job's sets the store refused in a row that make an incident (CheckpointsFailing)
LINGER_S = 30.0  # after a completion, the longest the service ticks unasked for the final step's set (a later
# upload report still brings a tick of its own: Service.prompt_types)


def retention(job: JobState, by_step: bool = True) -> tuple[JobState, tuple[str, ...]]:
    """Doom every live checkpoint that is neither among the newest `keep` good ones a rollback left standing, nor
    held, nor older than a held one (a restore not yet confirmed may have to fall back past its target). A rejected
    checkpoint does not count as one of them: the last good one is always kept. One a node claimed bad and the
    service has not read back yet is kept but not counted either: if the read confirms the claim, what a restore
    falls back to is still there. Newest: by step (`by_step`, Settings.retention), else in commit order."""
    live = [c for c in job.committed if c.checkpoint_id not in job.doomed]
    standing = [c for c in live if not thrown_away(job.forks, c.attempt, c.timeline, c.step)
                and c.checkpoint_id not in job.bad and c.checkpoint_id not in job.doubted]
    if by_step:
        standing.sort(key=lambda c: c.step)  # stable: equal steps stay in commit order, as lineage.newest takes them
    held = [c.step for c in live if c.checkpoint_id in job.holds]
    keep = {c.checkpoint_id for c in standing[-job.keep:]} | set(job.holds) | job.doubted
    if held:
        keep |= {c.checkpoint_id for c in standing if c.step <= max(held)}
    doomed = tuple(c.checkpoint_id for c in live if c.checkpoint_id not in keep)
    if not doomed:
        return job, ()
    return replace(job, doomed=job.doomed | set(doomed)), doomed


def _open_set(job: JobState, ev: CheckpointStaged | ShardsUploaded) -> Staging | None:
    """The set `ev` adds to, None when `ev` is stale or out of range (ended job, older attempt, a set already
    handed on or thrown away by a rollback, a world size that disagrees)."""
    at = (ev.attempt, ev.timeline, ev.step)
    if (job.ended and not (job.completed and ev.attempt == job.attempt)) or ev.attempt < job.attempt \
            or at in job.handed or thrown_away(job.forks, *at) or ev.node in job.fenced.get(ev.attempt, ()):
        return None  # a fenced node's late write: its ranks of that attempt were replaced (Settings.fence)
    if ev.world_size < 1 or not 0 <= ev.rank < ev.world_size or ev.step < 0:
        return None
    if isinstance(ev, CheckpointStaged) and ev.from_memory and (ev.timeline, ev.step) < job.memory_handed.get(
            ev.attempt, (-1, -1)):
        return None  # superseded: a newer set of its attempt from memory was handed over (supersede.py)
    current = job.staging.get(at) or Staging(world_size=ev.world_size, ranks={})
    return current if current.world_size == ev.world_size else None


def _stage(job: JobState, ev: CheckpointStaged | ShardsUploaded, agents_store: bool,
           announce: bool = False, lost: frozenset[str] = frozenset(), supersede: str = "no") -> tuple[JobState, Due]:
    """Fold a staging or an agent's report; `agents_store` False: the "staging" protocol (Settings.shards_from);
    `announce`: say CheckpointPending when the last rank stages (Settings.announce_pending); `supersede`:
    Settings.supersede."""
    at = (ev.attempt, ev.timeline, ev.step)
    cid = checkpoint_id(ev.attempt, ev.step, ev.timeline)
    current = _open_set(job, ev)
    if current is None:
        return job, NOTHING_DUE
    pending: CheckpointPending | None = None
    if isinstance(ev, CheckpointStaged):
        if any(s.from_memory != ev.from_memory for s in current.ranks.values()):
            return job, NOTHING_DUE  # one set is one format: a snapshot's never joins a rank's own (nor the reverse)
        if announce and agents_store and ev.rank not in current.ranks and len(current.ranks) + 1 == current.world_size:
            nodes = sorted({s.node for s in current.ranks.values()} | {ev.node})
            pending = CheckpointPending(job_id=ev.job_id, checkpoint_id=cid, attempt=ev.attempt, step=ev.step,
                                        timeline=ev.timeline, world_size=ev.world_size, nodes=nodes)
        # a rank that stages the same set again rewrote its files: its agent stores them again, and its
        # newest announcement is the one the store must match
        current = replace(current, ranks={**current.ranks, ev.rank: ev},
                          stored=current.stored - {ev.rank} if agents_store else frozenset(current.ranks) | {ev.rank})
    elif not agents_store:
        return job, NOTHING_DUE
    elif ev.failed:
        failed = CheckpointFailed(job_id=ev.job_id, step=ev.step, checkpoint_id=cid, store=True, schema_version=2,
                                  reason=f"{cid}: node {ev.node or '?'} could not store its ranks' shards: {ev.failed}")
        final = -1 if ev.step == job.final else job.final
        return settle.unpark(replace(settle.dropped(job, at), final=final), ev.job_id, ev.attempt, lost, supersede,
                             Due(failed=failed, failed_id=cid))
    else:
        # agents store what they read staged, so a report follows its ranks' stagings in the stream; the commit
        # reads the store back, so a report that raced a rank's second staging cannot commit a stale shard
        current = replace(current, stored=current.stored | (set(ev.ranks) & set(current.ranks)))
    staging = {k: v for k, v in job.staging.items() if k[0] >= ev.attempt}  # a newer attempt drops older sets
    job = replace(job, attempt=ev.attempt, staging={**staging, at: current})
    if len(current.ranks) < current.world_size or len(current.stored) < current.world_size:
        settled = settle.survivors(job, ev.job_id, at, current, lost, supersede)
        return settled if settled is not None else (job, NOTHING_DUE if pending is None else Due(pending=pending))
    return settle.hand_over(job, ev.job_id, at, current, ev.occurred_at, supersede)


def _fence(job: JobState, node: str) -> JobState:
    """`node` was declared lost: the job's attempts whose ranks it ran are fenced from it (Settings.fence), and
    what it staged of their open sets without storing it leaves them (it never will: survivors settle them)."""
    attempts = {a for a, placed in job.placement.items() if a >= job.attempt and node in placed.values()}
    if not attempts:
        return job
    staging = {}
    for at, s in job.staging.items():
        if at[0] in attempts:
            s = replace(s, ranks={r: x for r, x in s.ranks.items() if x.node != node or r in s.stored})
        if s.ranks:
            staging[at] = s
    fenced = {a: nodes for a, nodes in job.fenced.items() if a >= job.attempt}
    fenced |= {a: fenced.get(a, frozenset()) | {node} for a in attempts}
    return replace(job, staging=staging, fenced=fenced)


def _node_lost(state: State, node: str) -> tuple[State, Sequence[Output]]:
    """Sets waiting on ranks of a node now lost are settled by the survivors' snapshots alone, or fail."""
    state = replace(state, lost=state.lost | {node})
    outs: list[Output] = []
    jobs = dict(state.jobs)
    for job_id, job in state.jobs.items():
        if state.settings.fence == "lost":
            job = _fence(job, node)
        jobs[job_id], dues = settle.settle(job, job_id, state.lost, state.settings.supersede)
        outs += [o for due in dues for o in _outputs(job_id, jobs[job_id], due)]
    return replace(state, jobs=jobs), outs


def _exited(job: JobState, job_id: str, ev: WorkersExited, lost: frozenset[str],
            supersede: str) -> tuple[JobState, list[Output]]:
    """Ranks whose agent staged no snapshot as they ended, or none newer than a step: sets waiting on them settle."""
    none = frozenset(x.rank for x in ev.exits() if x.persisted == "none")
    upto = {x.rank: x.persisted_at for x in ev.exits() if x.persisted == "staged" and x.persisted_at is not None}
    if not (none or upto) or ev.attempt < job.attempt:
        return job, []
    job = replace(job, staged_none={a: r for a, r in job.staged_none.items() if a >= job.attempt}
                  | {ev.attempt: job.staged_none.get(ev.attempt, frozenset()) | none},
                  staged_upto={a: r for a, r in job.staged_upto.items() if a >= job.attempt}
                  | {ev.attempt: {**job.staged_upto.get(ev.attempt, {}), **upto}})
    job, dues = settle.settle(job, job_id, lost, supersede)
    return job, [o for due in dues for o in _outputs(job_id, job, due)]


def _new_attempt(job: JobState, attempt: int) -> JobState:
    if attempt <= job.attempt:
        return job
    return replace(job, attempt=attempt, staging={k: v for k, v in job.staging.items() if k[0] >= attempt})


def _release(job: JobState, ev: RolledBack | RankStarted) -> JobState:
    holds = dict(job.holds)
    for cid, hold in job.holds.items():
        in_process = isinstance(ev, RolledBack) and hold.attempt == -1 and ev.checkpoint_id == cid
        restarted = isinstance(ev, RankStarted) and hold.attempt == ev.attempt
        if in_process or restarted:
            hold = replace(hold, ranks=hold.ranks | {ev.rank})
            holds[cid] = hold
            if len(hold.ranks) >= hold.world_size:
                del holds[cid]
    return replace(job, holds=holds)


def _world_size_of(job: JobState, cid: str) -> int:
    return next((c.world_size for c in job.committed if c.checkpoint_id == cid), 1)


def _evolve_job(job: JobState, ev: Event, settings: Settings, lost: frozenset[str]) -> tuple[JobState, Due]:
    findings: tuple[JobEvent, ...] = ()
    match ev:
        case CheckpointFailed() if settings.failing_after > 0:  # its own, read back: the store's incidents
            job, findings = incidents.failed(job, ev, settings.failing_after)
            return job, Due(findings=findings)
        case CheckpointFailed():  # no longer being committed (all that histories from before keep of it)
            return replace(job, committing={k: v for k, v in job.committing.items() if k != ev.checkpoint_id}), \
                NOTHING_DUE
        case CheckpointStaged() | ShardsUploaded():
            return _stage(job, ev, settings.shards_from == "agents", settings.announce_pending == "yes", lost,
                          settings.supersede)
        case AllocationGranted():  # where each rank runs: a lost node's ranks leave no snapshot (settle.survivors)
            placement = {a: p for a, p in job.placement.items() if a >= job.attempt}
            return replace(job, placement={**placement, ev.attempt: {s.rank: s.node for s in ev.assignments}}), \
                NOTHING_DUE
        case CheckpointCommitted():
            if any(c.checkpoint_id == ev.checkpoint_id for c in job.committed) or ev.checkpoint_id in job.doomed:
                return job, NOTHING_DUE
            c = Committed(checkpoint_id=ev.checkpoint_id, step=ev.step, world_size=ev.world_size, attempt=ev.attempt,
                          timeline=ev.timeline, bytes=ev.bytes, manifest_sha256=ev.manifest_sha256,
                          verified_at=ev.occurred_at)
            job = replace(job, committed=(*job.committed, c),
                          committing={k: v for k, v in job.committing.items() if k != ev.checkpoint_id})
            if settings.failing_after > 0:
                job, findings = incidents.committed(job, ev, amend=settings.final_late == "amended")
        case CheckpointDeleted():
            return replace(job, committed=tuple(c for c in job.committed if c.checkpoint_id != ev.checkpoint_id),
                           doomed=job.doomed - {ev.checkpoint_id}, doubted=job.doubted - {ev.checkpoint_id}), \
                NOTHING_DUE
        case CheckpointRejected() | CheckpointRefused():  # one node's claim: not held, read back (transition)
            holds = {k: v for k, v in job.holds.items() if k != ev.checkpoint_id}
            if settings.claims == "trust":
                job = replace(job, bad={**job.bad, ev.checkpoint_id: REJECTED}, holds=holds)
            elif any(c.checkpoint_id == ev.checkpoint_id for c in job.committed):
                job = replace(job, doubted=job.doubted | {ev.checkpoint_id}, holds=holds)
        case CheckpointScrubbed():
            found = next((c for c in job.committed if c.checkpoint_id == ev.checkpoint_id), None)
            if found is None or ev.checkpoint_id in job.doomed:  # deleted while it was read: nothing to learn
                return job, NOTHING_DUE
            checked = replace(found, verified_at=ev.occurred_at)
            job = replace(job, committed=tuple(checked if c is found else c for c in job.committed),
                          doubted=job.doubted - {ev.checkpoint_id} if ev.claim_node else job.doubted)
            if not ev.cause and not ev.claim_node:
                return job, NOTHING_DUE
            if ev.cause:  # else a claim read back intact: it counts among the kept again (retention below)
                job = replace(job, bad={**job.bad, ev.checkpoint_id: CONFIRMED if ev.claim_node else SCRUBBED_BAD})
        case JobSubmitted():
            return replace(job, keep=ev.spec.policy.keep_checkpoints, every=ev.spec.train.checkpoint_every), NOTHING_DUE
        case RollbackRequested():
            # what it throws away is deleted now (retention below), and a staging of it is never committed
            hold = Hold(world_size=_world_size_of(job, ev.checkpoint_id))
            forks = forked(job.forks, ev)
            staging = {k: v for k, v in job.staging.items() if not thrown_away(forks, *k)}
            job = replace(job, holds={**job.holds, ev.checkpoint_id: hold}, forks=forks, staging=staging)
        case JobResumed() if ev.checkpoint_id:
            hold = Hold(world_size=ev.world_size, attempt=ev.attempt)
            return replace(_new_attempt(job, ev.attempt), holds={**job.holds, ev.checkpoint_id: hold}), NOTHING_DUE
        case RankStarted():
            job = _release(_new_attempt(job, ev.attempt), ev)
        case RolledBack():
            job = _release(job, ev)
        case JobCompleted():
            handed = any(a == job.attempt and step == ev.steps for a, _, step in job.handed)
            due = job.every > 0 and ev.steps % job.every == 0 and not handed
            job = replace(job, ended=True, completed=True, final=ev.steps if due else -1, ended_at=ev.occurred_at,
                          staging={k: v for k, v in job.staging.items() if k[0] == job.attempt}, holds={})
            if settings.failing_after > 0:
                job, findings = incidents.completed(job, ev)
        case JobFailed() | JobCancelled():
            job = replace(job, ended=True, staging={}, holds={})
        case _:
            return job, NOTHING_DUE
    job, doomed = retention(job, settings.retention == "steps")
    return job, Due(doomed=doomed, findings=findings)


def transition(state: State, ev: Event) -> tuple[State, Sequence[Output]]:
    match ev:
        case CoreConfigured(service=service) if service == SERVICE:
            return replace(state, settings=msgspec.convert(ev.settings, Settings)), ()
        case ClockTick(now=now):
            state, outs = next_scrub(state, now)
            return _lingered(state, now, outs)
        case NodeLost(node=node):
            return _node_lost(state, node)
        case NodeRegistered(node=node) if node in state.lost:
            return replace(state, lost=state.lost - {node}), ()
        case WorkersExited(job_id=exited_job) if state.settings.settle_on_exits == "yes" and exited_job in state.jobs:
            job, outs = _exited(state.jobs[exited_job], exited_job, ev, state.lost, state.settings.supersede)
            return replace(state, jobs={**state.jobs, exited_job: job}), outs
        case WorkersExited():
            return state, ()
        case CheckpointRejected() | CheckpointRefused() if state.settings.claims == "verify":
            state = add_claim(state, Claim(job_id=ev.job_id, checkpoint_id=ev.checkpoint_id, node=ev.node,
                                           cause=ev.cause))
    job_id = getattr(ev, "job_id", None)
    if not isinstance(job_id, str):
        return state, ()
    job, due = _evolve_job(state.jobs.get(job_id, JobState()), ev, state.settings, state.lost)
    state = replace(state, jobs={**state.jobs, job_id: job})
    if isinstance(ev, CheckpointScrubbed) and state.scrub is not None \
            and (state.scrub.job_id, state.scrub.checkpoint_id) == (job_id, ev.checkpoint_id):
        state = replace(state, scrub=None)
    if isinstance(ev, CheckpointScrubbed) and ev.claim_node:
        state = answered(state, job_id, ev.checkpoint_id)
    return state, _outputs(job_id, job, due)


def _lingered(state: State, now: float, outs: Sequence[Output]) -> tuple[State, Sequence[Output]]:
    """At a tick: completed jobs whose final set never came to be handed over in time (incidents.lingered)."""
    if state.settings.failing_after <= 0:
        return state, outs
    jobs, found = dict(state.jobs), list[JobEvent]()
    for job_id, job in state.jobs.items():
        jobs[job_id], more = incidents.lingered(job, job_id, now, LINGER_S)
        found += more
    if not found:
        return state, outs
    return replace(state, jobs=jobs), (*outs, *(Emit(subjects.job(e.job_id, type(e).__name__), e) for e in found))


def _outputs(job_id: str, job: JobState, due: Due) -> list[Output]:
    out: list[Output] = [Emit(subjects.job(job_id, type(e).__name__), e) for e in due.findings]
    if due.pending is not None:
        out.append(Emit(subjects.job(job_id, "CheckpointPending"), due.pending))
    if due.commit is not None:
        out.append(Effect(COMMIT, due.commit))
    if due.failed is not None:  # and whatever of it was stored before the failure goes
        out.append(Emit(subjects.job(job_id, "CheckpointFailed"), due.failed))
        out.append(Effect(DELETE, DeleteArgs(job_id=job_id, checkpoint_ids=[due.failed_id])))
    if due.doomed:
        subject = subjects.job(job_id, "CheckpointDeleted")
        thrown = {c.checkpoint_id for c in job.committed if thrown_away(job.forks, c.attempt, c.timeline, c.step)}
        out.extend(Emit(subject, CheckpointDeleted(job_id=job_id, checkpoint_id=cid,
                                                   reason=_why_deleted(job, cid, thrown)))
                   for cid in due.doomed)
        out.append(Effect(DELETE, DeleteArgs(job_id=job_id, checkpoint_ids=list(due.doomed))))
    return out


def _why_deleted(job: JobState, checkpoint_id: str, thrown: set[str]) -> str:
    if checkpoint_id in job.bad:
        return job.bad[checkpoint_id]
    return THROWN_AWAY if checkpoint_id in thrown else "retention"


def wants_tick(state: State, now: float) -> bool:
    """Telemetry (stagings) is folded only at ticks, so tick while any job may still stage, or a completed
    job's final set has not been read yet, or a scrub or a claim's read is due (ticks are recorded inputs, so
    reading the clock here is safe)."""
    unsaid = state.settings.failing_after > 0  # a final set that never came is said to be unsaved at a tick
    return any(not job.ended or (job.final >= 0 and (now - job.ended_at < LINGER_S or (unsaid and not job.final_state)))
               for job in state.jobs.values()) \
        or scrub_due(state, now) is not None or claims_due(state, now)


CONTROL_TYPES = (
    "JobSubmitted", "JobResumed", "RollbackRequested", "AllocationGranted",
    "CheckpointCommitted", "CheckpointDeleted", "CheckpointRejected", "CheckpointScrubbed", "CheckpointFailed",
    "JobCompleted", "JobFailed",
    "JobCancelled", "WorkersExited",
)
FLEET_TYPES = ("NodeLost", "NodeRegistered")
TELEMETRY_TYPES = ("CheckpointStaged", "ShardsUploaded", "RolledBack", "RankStarted", "CheckpointRefused")


def core_service(effects: dict[str, EffectHandler], *, scrub_every_s: float = 0.0,
                 scrub_mb_s: float = Settings().scrub_mb_s) -> Service[State]:
    """The checkpoint service's core wired to its effect handlers ("commit", "delete", and "scrub" when
    `scrub_every_s` > 0; see uploader.py and scrubber.py)."""
    settings = Settings(scrub_every_s=scrub_every_s, scrub_mb_s=scrub_mb_s, shards_from="agents",
                        announce_pending="yes", settle_on_exits="yes", supersede="parked", retention="steps",
                        claims="verify", failing_after=FAILING_AFTER, fence="lost", final_late="amended")
    missing = {COMMIT, DELETE, SCRUB} - set(effects)  # a claim's read runs even with scheduled scrubs off
    if missing:
        raise ValueError(f"the checkpoint service needs effect handlers for {sorted(missing)}")
    return Service(
        name=SERVICE,
        initial=State(settings=settings),
        transition=transition,
        control_subjects=(*subjects.job_types(*CONTROL_TYPES), *(f"fd.ctl.node.*.{t}" for t in FLEET_TYPES)),
        telemetry_subjects=tuple(f"fd.tel.*.*.{t}" for t in TELEMETRY_TYPES),
        tick_s=1.0,
        prompt_types=frozenset({"CheckpointStaged", "ShardsUploaded"}),  # a set's pending and commit, at once
        wants_tick=wants_tick,
        effects=effects,
        detached=frozenset({SCRUB}),
        settings=msgspec.structs.asdict(settings),
        unrecorded=msgspec.structs.asdict(replace(settings, shards_from="staging", announce_pending="no",
                                                  settle_on_exits="no", supersede="no", retention="commits",
                                                  claims="trust", failing_after=0, fence="none",
                                                  final_late="kept")),
    )
