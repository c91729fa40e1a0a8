"""A job as a person asks about it: its control history folded into one frozen `JobView`.

Why it works this way: docs/internals.md, "8. Operator tools".
"""

from collections.abc import Iterable
from typing import Literal, get_args

import msgspec

from flightdeck.events.base import Event
from flightdeck.events.checkpoint import (
    CheckpointCommitted,
    CheckpointDeleted,
    CheckpointFailed,
    CheckpointRejected,
    CheckpointScrubbed,
)
from flightdeck.events.commands import PauseRequested, ResumeRequested, RollbackRequested
from flightdeck.events.findings import SpikeDiagnosed, diagnosis_summary
from flightdeck.events.job import (
    AllocationDenied,
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    CancelRequested,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobPreempted,
    JobQueued,
    JobResumed,
    JobSubmitted,
    SlotRef,
    WorkersStarted,
)
from flightdeck.events.plan import ParallelPlan, ReshardPlanned
from flightdeck.events.training import StepCompleted
from flightdeck.services.scheduler.state import Phase
from flightdeck.services.tools.history.reasons import headline

# "paused": running, with its ranks told to stop stepping (a PauseRequested, a person's or the scheduler's asking the
# operator) and not resumed since
ViewPhase = Phase | Literal["submitted", "paused"]
PHASES: tuple[str, ...] = ("submitted", *get_args(Phase), "paused")
ENDED: frozenset[str] = frozenset({"completed", "failed", "cancelled"})
STALE_GRANT = "stale grant"  # the scheduler's reason for giving back slots nobody waits for
# How long past JobCompleted a follower waits for the final checkpoint: the checkpoint service stops ticking for
# it 30 s after the completion (services/checkpoints/core.py LINGER_S), so it never comes later than that.
FINAL_WAIT_S = 60.0


class CheckpointEntry(msgspec.Struct, frozen=True, kw_only=True):
    checkpoint_id: str
    step: int
    world_size: int
    bytes: int
    uri: str
    committed_at: float
    deleted: bool = False
    deleted_reason: str = ""
    verified_at: float = 0.0  # when its stored bytes last matched the manifest: the commit, then each scrub
    bad: str = ""  # why it was found bad (a restore's rejection, a scrub's finding), "" while none was


class JobView(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    name: str = ""
    phase: ViewPhase = "submitted"
    priority: int = 0
    slots: int = 0  # what the spec asks for
    world_size: int = 0  # ranks granted to the current attempt (0 while none are)
    steps: int = 0  # the spec's total
    checkpoint_every: int = 0  # the spec's; a checkpoint is due at the last step when it divides `steps`
    step: int | None = None  # the newest step a rank reported (from telemetry), numbered from 0
    loss: float | None = None
    metrics: dict[str, float] = {}  # the script's own figures in that report (trainer API `report(..., **metrics)`)
    attempt: int = 0
    restarts: int = 0  # restarts after faults, as the scheduler counts them (preemptions are not)
    max_restarts: int = 0
    rollbacks: int = 0
    spike_cause: str = ""  # the newest loss spike's diagnosis (SpikeDiagnosed), in words
    checkpoint_failures: int = 0
    final_failed: bool = False  # a checkpoint of the last step failed
    # Why the job is in its phase (waiting, recovering, stopping or ended; "" while it runs), on one line: the output a
    # decision quotes is left out (reasons.headline) unless it is the error itself; `flightdeck logs` shows it all.
    reason: str = ""
    last_fault: str = ""  # the scheduler's words for the newest restart after a fault, on one line as `reason`
    preempted_by: str = ""
    cancel_requested: bool = False
    paused: str = ""  # why the ranks are paused (a person's pause, or the scheduler asking the operator); "" if not
    resumed_from_step: int | None = None
    submitted_at: float = 0.0
    running_since: float = 0.0
    updated_at: float = 0.0  # the newest control event's time
    ended_at: float = 0.0
    version: int = 0  # the newest job_version folded
    granted: frozenset[int] = frozenset()  # ranks of the current attempt
    placement: tuple[SlotRef, ...] = ()  # the current attempt's grant: each rank's node and slot, by rank
    plan: ParallelPlan | None = None  # the resharder's newest plan (ReshardPlanned): the layout the ranks build
    started: frozenset[int] = frozenset()  # ranks of the current attempt whose workers started
    checkpoints: tuple[CheckpointEntry, ...] = ()  # committed, in commit order

    @property
    def ended(self) -> bool:
        return self.phase in ENDED

    @property
    def final_checkpoint_pending(self) -> bool:
        """Completed, with a checkpoint due at the last step that is neither committed nor failed yet. It can land
        after JobCompleted: the checkpoint service folds the ranks' stagings at its ticks (docs/internals.md, 5),
        so a follower that wants the job's end with its final checkpoint waits for it (`FINAL_WAIT_S`)."""
        if self.phase != "completed" or self.checkpoint_every <= 0 or self.steps % self.checkpoint_every:
            return False
        return not self.final_failed and not any(c.step == self.steps for c in self.checkpoints)

    @property
    def steps_done(self) -> int | None:
        """Steps done as of the newest report: steps are numbered from 0, so step i done means i + 1."""
        return None if self.step is None else self.step + 1

    @property
    def last_checkpoint(self) -> CheckpointEntry | None:
        """The newest committed checkpoint that still exists."""
        kept = [c for c in self.checkpoints if not c.deleted]
        return max(kept, key=lambda c: (c.step, c.committed_at)) if kept else None


def _replace(view: JobView, **changes: object) -> JobView:
    return msgspec.structs.replace(view, **changes)


def _checkpoints(view: JobView, event: Event, at: float) -> JobView:
    match event:
        case CheckpointCommitted():
            entry = CheckpointEntry(checkpoint_id=event.checkpoint_id, step=event.step, world_size=event.world_size,
                                    bytes=event.bytes, uri=event.uri, committed_at=at, verified_at=at)
            if any(c.checkpoint_id == entry.checkpoint_id for c in view.checkpoints):
                return view
            return _replace(view, checkpoints=(*view.checkpoints, entry))
        case CheckpointDeleted(checkpoint_id=cid, reason=reason):
            return _replace(view, checkpoints=tuple(
                msgspec.structs.replace(c, deleted=True, deleted_reason=reason) if c.checkpoint_id == cid else c
                for c in view.checkpoints))
        case CheckpointScrubbed(checkpoint_id=cid, cause=cause):
            return _replace(view, checkpoints=tuple(
                msgspec.structs.replace(c, verified_at=at, bad=cause or c.bad) if c.checkpoint_id == cid else c
                for c in view.checkpoints))
        case CheckpointRejected(checkpoint_id=cid, cause=cause):
            return _replace(view, checkpoints=tuple(
                msgspec.structs.replace(c, bad=f"rejected on restore by {event.node}: {cause}")
                if c.checkpoint_id == cid else c for c in view.checkpoints))
        case CheckpointFailed(step=step):
            return _replace(view, checkpoint_failures=view.checkpoint_failures + 1,
                            final_failed=view.final_failed or step == view.steps)
    return view


def evolve(view: JobView, event: Event) -> JobView:
    """`view` after one event of its job's control history."""
    at = event.occurred_at
    view = _replace(view, updated_at=max(view.updated_at, at), version=getattr(event, "job_version", 0) or view.version)
    if isinstance(event, CheckpointCommitted | CheckpointDeleted | CheckpointScrubbed | CheckpointRejected
                  | CheckpointFailed):
        return _checkpoints(view, event, at)  # a job's checkpoints outlive it: kept, scrubbed, deleted, its last failed
    if view.ended:
        return view  # the scheduler changes nothing once a job has ended; neither do we
    match event:
        case JobSubmitted(spec=spec):
            return _replace(view, name=spec.name, priority=spec.priority, slots=spec.slots, steps=spec.train.steps,
                            checkpoint_every=spec.train.checkpoint_every, max_restarts=spec.policy.max_restarts,
                            submitted_at=at)
        case JobQueued(reason=reason):
            phase: ViewPhase = "preempted" if reason == "preempted" else (
                "recovering" if view.phase == "recovering" else "queued")
            return _replace(view, phase=phase, priority=event.priority, reason="" if reason == "submitted" else reason)
        case AllocationRequested(attempt=attempt):
            recovering = view.phase == "recovering"
            return _replace(view, phase="recovering" if recovering else "placing", attempt=attempt,
                            reason=view.reason if recovering else "", granted=frozenset(), started=frozenset(),
                            placement=(), world_size=0)
        case AllocationGranted(attempt=attempt) if attempt == view.attempt:
            ranks = frozenset(ref.rank for ref in event.assignments)
            placement = tuple(sorted(event.assignments, key=lambda ref: ref.rank))
            return _replace(view, granted=ranks, world_size=len(ranks), placement=placement)
        case AllocationDenied(attempt=attempt, reason=reason) if attempt == view.attempt:
            return _replace(view, reason=f"allocation denied: {reason}")
        case WorkersStarted(attempt=attempt) if attempt == view.attempt and view.granted:
            view = _replace(view, started=view.started | (frozenset(event.ranks) & view.granted))
            if view.phase in ("placing", "recovering") and view.granted <= view.started:
                return _replace(view, phase="running", running_since=at, reason="")
            return view
        case JobPreempted(by_job_id=by, reason=reason):
            return _replace(view, phase="stopping", paused="", preempted_by=by, reason=f"preempted by {by}: {reason}")
        case CancelRequested(reason=reason):
            phase = "stopping" if view.phase in ("running", "paused", "stopping") else view.phase
            return _replace(view, phase=phase, cancel_requested=True, reason=reason or "cancel requested")
        case AllocationReleased(attempt=attempt, reason=reason) if attempt == view.attempt and reason != STALE_GRANT:
            return _released(view, reason, event.restarts, event.kind)
        case JobResumed(from_step=from_step):
            return _replace(view, resumed_from_step=from_step)
        case ReshardPlanned(new=plan):
            return _replace(view, plan=plan)
        case RollbackRequested():
            return _replace(view, rollbacks=view.rollbacks + 1)
        case SpikeDiagnosed():
            return _replace(view, spike_cause=diagnosis_summary(event))
        case PauseRequested(reason=reason):
            return _replace(view, paused=reason or f"paused by {event.producer or 'a person'}",
                            phase="paused" if view.phase == "running" else view.phase)
        case ResumeRequested():
            return _replace(view, paused="", phase="running" if view.phase == "paused" else view.phase)
        case JobCompleted():
            return _end(view, "completed", "", at)
        case JobFailed(reason=reason):
            return _end(view, "failed", reason, at)
        case JobCancelled(reason=reason):
            return _end(view, "cancelled", reason, at)
    return view


def _released(view: JobView, reason: str, spent: int, kind: str) -> JobView:
    cleared = _replace(view, granted=frozenset(), started=frozenset(), placement=(), world_size=0, running_since=0.0,
                       paused="", attempt=view.attempt + 1)
    said = headline(reason)
    match kind:
        case "fault":  # a restart after a fault: the restarts it spent are the scheduler's figure (some are free)
            return _replace(cleared, phase="recovering", restarts=spent, reason=said, last_fault=said)
        case "grow":  # a shrunk job stopped to grow back: no fault, and no restart spent by it
            return _replace(cleared, phase="recovering", reason=said, restarts=max(spent, view.restarts))
        case "preempt":
            return cleared  # its JobQueued("preempted") follows
        case "ended" | "stale":
            return view  # the job's end says how it ended; a stale grant was never the attempt's
    # A record from before releases said why: a release outside a stop is a restart after a fault, and the restarts
    # it spent are the scheduler's figure when recorded (a bad checkpoint's or a drain's restart is free).
    if view.phase == "stopping":
        return cleared  # a preemption's stop is done; its JobQueued("preempted") follows
    restarts = spent if spent >= 0 else view.restarts + 1
    return _replace(cleared, phase="recovering", restarts=restarts, reason=said, last_fault=said)


def _end(view: JobView, phase: ViewPhase, reason: str, at: float) -> JobView:
    why = "" if phase == "completed" else headline(reason) or view.reason
    # world_size stays: how many ranks the job last ran with is worth showing after it ended
    return _replace(view, phase=phase, reason=why, ended_at=at, granted=frozenset(), started=frozenset())


def with_step(view: JobView, step: StepCompleted | None) -> JobView:
    """`view` with the newest step a rank reported (telemetry is not in the control history)."""
    if step is None:
        return view
    return _replace(view, step=step.step, loss=step.loss, metrics=dict(step.metrics))


def fold(job_id: str, events: Iterable[Event], step: StepCompleted | None = None) -> JobView:
    """The view of `job_id` after its control history `events` (in order) and its newest reported step."""
    view = JobView(job_id=job_id)
    for event in events:
        view = evolve(view, event)
    return with_step(view, step)
