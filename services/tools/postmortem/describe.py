"""One line about an event, and the marks that causal chains and the timeline of a postmortem are made of."""

from dataclasses import dataclass

from flightdeck.events.base import Event
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
)
from flightdeck.events.commands import (
    CheckpointRequested,
    PauseRequested,
    ResumeRequested,
    RollbackRequested,
    StopRequested,
)
from flightdeck.events.findings import (
    InexactRestore,
    LossOutlier,
    LossSpikeDetected,
    NonFiniteLoss,
    RankHung,
    RankLost,
    SpikeDiagnosed,
    StragglerDetected,
    diagnosis_summary,
    nonfinite_summary,
    outlier_summary,
    spike_summary,
)
from flightdeck.events.fleet import NodeCordoned, NodeLost, NodeUncordoned, SelfCheckFailed
from flightdeck.events.job import (
    AllocationDenied,
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    CancelRequested,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobPhaseChanged,
    JobPreempted,
    JobQueued,
    JobResumed,
    JobSubmitted,
    WorkersExited,
    WorkersStarted,
)
from flightdeck.events.plan import ReshardPlanned
from flightdeck.events.training import FaultInjected, Heartbeat, RankFault, RankStarted, RolledBack, StepCompleted
from flightdeck.services.tools.history.reasons import headline


def describe(ev: Event) -> str:
    match ev:
        case FaultInjected():
            return f"drill fault '{ev.kind}' injected at step {ev.step} on rank {ev.rank}"
        case RankFault():
            return f"rank {ev.rank} {ev.kind} fault at step {ev.step}: {ev.error_type}: {ev.message[:100]}"
        case StepCompleted():
            return f"rank {ev.rank} step {ev.step}, loss {ev.loss:.4g}, {ev.step_time_s:.3g} s"
        case Heartbeat():
            return f"rank {ev.rank} alive at step {ev.step}"
        case RankStarted():
            return f"rank {ev.rank} of attempt {ev.attempt} up from step {ev.from_step} ({ev.world_size} ranks)"
        case RolledBack():
            return f"rank {ev.rank} restored {ev.checkpoint_id}, at step {ev.to_step}, skipping batches " \
                   f"[{ev.skip_from}, {ev.skip_to})"
        case CheckpointStaged():
            return f"rank {ev.rank} staged step {ev.step} (stall {ev.stall_s * 1e3:.1f} ms)"
        case ShardsUploaded(failed=failed) if failed:
            return f"{ev.node} could not store step {ev.step} of ranks {_ranks(ev.ranks)}: {failed[:200]}"
        case ShardsUploaded():
            return f"{ev.node} stored step {ev.step} of ranks {_ranks(ev.ranks)} in the object store: {ev.bytes} " \
                   f"bytes in {ev.seconds:.2f} s"
        case WorkersExited(others=others):
            also = f", and ranks {_ranks([x.rank for x in others])} with it" if others else ""
            return f"rank {ev.rank} (attempt {ev.attempt}) on {ev.node} exited with code {ev.exit_code}{also}" + (
                f": {ev.error}" if ev.error else "")
        case CheckpointRejected():
            return f"checkpoint {ev.checkpoint_id} (step {ev.step}) rejected by {ev.node} for attempt {ev.attempt}, " \
                   f"never loaded: {ev.cause[:200]}"
        case CheckpointScrubbed(cause=cause) if cause:
            return f"checkpoint {ev.checkpoint_id} (step {ev.step}) found bad by a scrub of the store: {cause[:200]}"
        case CheckpointScrubbed():
            return f"checkpoint {ev.checkpoint_id} (step {ev.step}) scrubbed: {ev.bytes} bytes match its manifest"
        case CheckpointRefused():
            return f"checkpoint {ev.checkpoint_id} (step {ev.to_step}) refused by rank {ev.rank} on {ev.node} for a " \
                   f"rollback, never loaded: {ev.cause[:200]}"
        case WorkersStarted():
            return f"attempt {ev.attempt}: ranks {', '.join(map(str, ev.ranks))} started on {ev.node}"
        case RankLost():
            return f"rank {ev.rank} lost: {ev.reason}"
        case RankHung():
            return f"rank {ev.rank} hung at step {ev.step}: no progress for {ev.stalled_s:.1f} s " \
                   f"(deadline {ev.deadline_s:.1f} s)"
        case LossSpikeDetected():
            return spike_summary(ev)
        case SpikeDiagnosed():
            return diagnosis_summary(ev)
        case NonFiniteLoss():
            return nonfinite_summary(ev)
        case LossOutlier():
            return outlier_summary(ev)
        case InexactRestore():
            return f"restored at step {ev.step}, not guaranteed bitwise the uninterrupted run from there: {ev.reason}"
        case StragglerDetected():
            return f"rank {ev.rank} straggling: {ev.step_time_s:.3g} s a step, {ev.factor:.1f}x its peers' " \
                   f"{ev.peer_median_s:.3g} s"
        case RollbackRequested():
            return f"roll back to {ev.checkpoint_id} (step {ev.to_step}), skip batches [{ev.skip_from}, {ev.skip_to})"
        case StopRequested() | PauseRequested() | ResumeRequested() | CheckpointRequested() | CancelRequested():
            return headline(ev.reason)
        case JobSubmitted():
            train = ev.spec.train
            return f"{ev.spec.slots} slots, {train.steps} steps, checkpoint every {train.checkpoint_every}"
        case JobQueued():
            return f"priority {ev.priority}: {ev.reason}"
        case AllocationRequested():
            return f"{ev.slots} slots for attempt {ev.attempt}" + (f": {ev.reason}" if ev.reason else "")
        case AllocationGranted():
            nodes = sorted({a.node for a in ev.assignments})
            return f"attempt {ev.attempt}: {len(ev.assignments)} slots on {', '.join(nodes)}"
        case AllocationDenied():
            return f"attempt {ev.attempt}: {ev.reason}"
        case AllocationReleased():
            return f"attempt {ev.attempt}: {headline(ev.reason)}"
        case ReshardPlanned():
            old = f"{ev.old.world_size} ranks" if ev.old else "none"
            return f"{old} -> {ev.new.world_size} ranks (dp {ev.new.dp}, tp {ev.new.tp}, pp {ev.new.pp}): {ev.reason}"
        case JobResumed():
            return f"attempt {ev.attempt} on {ev.world_size} ranks from step {ev.from_step}" + (
                f" ({ev.checkpoint_id})" if ev.checkpoint_id else "")
        case JobPhaseChanged():
            return f"{ev.phase} (attempt {ev.attempt}, {ev.restarts} restart(s) spent)" + (
                f": {headline(ev.reason)}" if ev.reason else "")
        case JobPreempted():
            return f"by {ev.by_job_id}" + (f": {ev.reason}" if ev.reason else "")
        case JobCompleted():
            return f"{ev.steps} steps"
        case JobFailed():
            return headline(ev.reason)
        case JobCancelled():
            return ev.reason
        case CheckpointCommitted():
            return f"{ev.checkpoint_id} (step {ev.step}, {ev.bytes / 1e6:.1f} MB)"
        case CheckpointFailed():
            return f"step {ev.step}: {ev.reason}"
        case CheckpointPending():
            return f"{ev.checkpoint_id} (step {ev.step}) staged by all {ev.world_size} ranks: its commit is on its way"
        case CheckpointDeleted():
            return f"{ev.checkpoint_id} ({ev.reason})"
        case NodeLost() | NodeCordoned() | SelfCheckFailed():
            return f"{ev.node}: {ev.reason}"
        case NodeUncordoned():
            return f"{ev.node}" + (f": {ev.reason}" if ev.reason else "")
    return ""


@dataclass(frozen=True, slots=True)
class Mark:
    """One event of a causal chain or of the timeline."""

    at: float  # seconds from the job's start
    type: str
    event_id: str
    detail: str


def mark(ev: Event, at: float) -> Mark:
    return Mark(at=at, type=type(ev).__name__, event_id=ev.event_id, detail=describe(ev))


def _ranks(ranks: list[int]) -> str:
    """0-3, 8 rather than 0, 1, 2, 3, 8: a node's report may cover many ranks."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
