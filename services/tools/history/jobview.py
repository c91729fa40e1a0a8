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
    CheckpointsFailing,
    CheckpointsRecovered,
    FinalStateSaved,
    FinalStateUnsaved,
)
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import InexactRestore, LossOutlier, SpikeDiagnosed, diagnosis_summary, outlier_summary
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    CancelRequested,
    JobPhase,
    JobPhaseChanged,
    JobPreempted,
    JobQueued,
    JobResumed,
    JobSubmitted,
    SlotRef,
    WorkersStarted,
)
from flightdeck.events.plan import ParallelPlan, ReshardPlanned
from flightdeck.events.training import StepCompleted
from flightdeck.services.tools.history import inferred
from flightdeck.services.tools.history.inferred import STALE_GRANT
from flightdeck.services.tools.history.reasons import headline

# A job's phase as the scheduler records it (events.job.JobPhase), or "submitted" before its first record
ViewPhase = JobPhase | Literal["submitted"]
PHASES: tuple[str, ...] = ("submitted", *get_args(JobPhase))
ENDED: frozenset[str] = frozenset({"completed", "failed", "cancelled"})
# How long past JobCompleted a follower waits for the final checkpoint: the checkpoint service stops ticking for
# it 30 s after the completion (services/checkpoints/core.py LINGER_S), so it never comes later than that.
FINAL_WAIT_S = 60.0
OUTLIERS_SHOWN = 3  # a view names the newest lone bad losses; the postmortem lists them all


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
    inexact: str = ""  # where and why the run first parted from the uninterrupted one, bitwise (InexactRestore)
    outliers: tuple[str, ...] = ()  # the newest OUTLIERS_SHOWN lone bad losses, in words (LossOutlier)
    outliers_seen: int = 0
    checkpoint_failures: int = 0
    final_failed: bool = False  # a checkpoint of the last step failed
    store_failing: str = ""  # the store refuses its checkpoints (CheckpointsFailing, until CheckpointsRecovered)
    final_unsaved: str = ""  # completed without its final state stored, and why (FinalStateUnsaved)
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
    recorded: bool = False  # the scheduler recorded the job's phases (JobPhaseChanged): read, never inferred

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
        return not self.final_failed and not self.final_unsaved and not any(c.step == self.steps
                                                                             for c in self.checkpoints)

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
        case CheckpointScrubbed(checkpoint_id=cid, cause=cause):  # a claim's read decides the claim, either way
            return _replace(view, checkpoints=tuple(
                msgspec.structs.replace(c, verified_at=at, bad=cause or ("" if event.claim_node else c.bad))
                if c.checkpoint_id == cid else c for c in view.checkpoints))
        case CheckpointRejected(checkpoint_id=cid, cause=cause):
            return _replace(view, checkpoints=tuple(
                msgspec.structs.replace(c, bad=f"rejected on restore by {event.node}: {cause}")
                if c.checkpoint_id == cid else c for c in view.checkpoints))
        case CheckpointFailed(step=step):
            return _replace(view, checkpoint_failures=view.checkpoint_failures + 1,
                            final_failed=view.final_failed or step == view.steps)
        case CheckpointsFailing():
            saved = f"the newest saved step is {event.newest_step}" if event.newest_step >= 0 else "no step is saved"
            return _replace(view, store_failing=f"{event.failures} in a row since step {event.first_step} "
                                                f"({event.reason}); {saved}")
        case CheckpointsRecovered():
            return _replace(view, store_failing="")
        case FinalStateUnsaved(reason=why):
            return _replace(view, final_unsaved=why)
        case FinalStateSaved():  # it committed after all
            return _replace(view, final_unsaved="")
    return view


def evolve(view: JobView, event: Event) -> JobView:
    """`view` after one event of its job's control history."""
    at = event.occurred_at
    view = _replace(view, updated_at=max(view.updated_at, at), version=getattr(event, "job_version", 0) or view.version)
    if isinstance(event, CheckpointCommitted | CheckpointDeleted | CheckpointScrubbed | CheckpointRejected
                  | CheckpointFailed | CheckpointsFailing | CheckpointsRecovered | FinalStateUnsaved
                  | FinalStateSaved):
        return _checkpoints(view, event, at)  # a job's checkpoints outlive it: kept, scrubbed, deleted, its last failed
    if view.ended:
        return view  # the scheduler changes nothing once a job has ended; neither do we
    if isinstance(event, JobPhaseChanged):
        return _recorded(view, event, at)
    after = _facts(view, event, at)
    # A history the scheduler recorded no phases in (before JobPhaseChanged): its phase is read from its decisions.
    return after if view.recorded else inferred.phase(view, after, event, at)


def _recorded(view: JobView, ev: JobPhaseChanged, at: float) -> JobView:
    """The scheduler's record of the job's phase: what the view says, as it says it."""
    phase = ev.phase
    paused = ev.reason if phase == "paused" else ""
    reason = "" if phase in ("completed", "paused", "running") else headline(ev.reason)
    if phase in ("running", "paused"):
        since = view.running_since if view.phase in ("running", "paused") else at
    else:
        since = view.running_since if phase == "stopping" else 0.0
    view = _replace(view, phase=phase, reason=reason, paused=paused, restarts=ev.restarts, attempt=ev.attempt,
                    running_since=since, recorded=True)
    return _replace(view, ended_at=at, granted=frozenset(), started=frozenset()) if view.ended else view


def _facts(view: JobView, event: Event, at: float) -> JobView:
    """`view` after one of its job's decisions, in everything but its phase (recorded, or read by `inferred`)."""
    match event:
        case JobSubmitted(spec=spec):
            return _replace(view, name=spec.name, priority=spec.priority, slots=spec.slots, steps=spec.train.steps,
                            checkpoint_every=spec.train.checkpoint_every, max_restarts=spec.policy.max_restarts,
                            submitted_at=at)
        case JobQueued():
            return _replace(view, priority=event.priority)
        case AllocationRequested(attempt=attempt):
            return _replace(view, attempt=attempt, granted=frozenset(), started=frozenset(), placement=(),
                            world_size=0)
        case AllocationGranted(attempt=attempt) if attempt == view.attempt:
            ranks = frozenset(ref.rank for ref in event.assignments)
            placement = tuple(sorted(event.assignments, key=lambda ref: ref.rank))
            return _replace(view, granted=ranks, world_size=len(ranks), placement=placement)
        case WorkersStarted(attempt=attempt) if attempt == view.attempt and view.granted:
            return _replace(view, started=view.started | (frozenset(event.ranks) & view.granted))
        case JobPreempted(by_job_id=by):
            return _replace(view, preempted_by=by)
        case CancelRequested():
            return _replace(view, cancel_requested=True)
        case AllocationReleased(attempt=attempt, reason=reason, kind=kind) \
                if attempt == view.attempt and reason != STALE_GRANT and kind not in ("ended", "stale"):
            # The attempt is over: the next one's number, as the scheduler's record of the phase says too
            fault = headline(reason) if kind == "fault" else view.last_fault
            return _replace(view, granted=frozenset(), started=frozenset(), placement=(), world_size=0,
                            attempt=view.attempt + 1, last_fault=fault)
        case JobResumed(from_step=from_step):
            return _replace(view, resumed_from_step=from_step)
        case ReshardPlanned(new=plan):
            return _replace(view, plan=plan)
        case RollbackRequested():
            return _replace(view, rollbacks=view.rollbacks + 1)
        case SpikeDiagnosed():
            return _replace(view, spike_cause=diagnosis_summary(event))
        case LossOutlier():
            return _replace(view, outliers=(*view.outliers, outlier_summary(event))[-OUTLIERS_SHOWN:],
                            outliers_seen=view.outliers_seen + 1)
        case InexactRestore(step=step, reason=why) if not view.inexact:
            return _replace(view, inexact=f"from step {step} not guaranteed bitwise the uninterrupted run: {why}")
    return view


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
