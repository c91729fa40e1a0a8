"""A job's postmortem as data: the summary, its incidents, the goodput split and the timeline."""

from collections.abc import Iterable
from dataclasses import dataclass

from flightdeck.events.base import JobEvent, NodeEvent
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import LossOutlier
from flightdeck.events.job import AllocationGranted, JobCancelled, JobCompleted, JobFailed, JobResumed, JobSubmitted
from flightdeck.events.store import Stored
from flightdeck.services.tools.postmortem.describe import Mark, describe, mark
from flightdeck.services.tools.postmortem.goodput import Goodput, final_mask, goodput
from flightdeck.services.tools.postmortem.incidents import Incident, cause_chain, incidents
from flightdeck.services.tools.postmortem.scan import Scan, scan

TIMELINE_MAX = 400  # rows; beyond it checkpoint commits and deletions are left out (and counted)
QUIET = (CheckpointCommitted, CheckpointDeleted)


@dataclass(frozen=True)
class Summary:
    job_id: str
    outcome: str  # completed, failed, cancelled, or "not ended" for a job still running
    reason: str  # why it failed or was cancelled
    started_at: float  # unix seconds: the submission
    wall_s: float
    steps_planned: int
    steps_final: int  # distinct steps in the final timeline
    steps_computed: int  # rank 0's step completions, redone ones included
    attempts: int
    rollbacks: int
    world_sizes: tuple[int, ...]  # per attempt, in order
    ranks: int
    events: int  # the job's events (clock ticks and other jobs' aside)
    undecodable: int


@dataclass(frozen=True)
class Postmortem:
    summary: Summary
    incidents: list[Incident]
    goodput: Goodput
    timeline: list[Mark]
    timeline_left_out: int
    causes: list[Mark]  # a failed job's cause chain, from the first fault to the last straw
    observations: list[Mark]  # what was seen and by design not acted on (LossOutlier): a batch to look at
    scan: Scan  # the columns the plots draw


def analyse(rows: Iterable[Stored], job_id: str) -> Postmortem:
    sc = scan(rows, job_id)
    if not any(isinstance(c.event, JobEvent) for c in sc.control) and not len(sc.lead):
        raise LookupError(f"the history holds no event of job {job_id!r}")
    found = incidents(sc)
    split = goodput(sc, found)
    failed = next((c.event for c in sc.control if isinstance(c.event, JobFailed)), None)
    timeline, left_out = _timeline(sc)
    return Postmortem(summary=_summary(sc, split), incidents=found, goodput=split, timeline=timeline,
                      timeline_left_out=left_out, causes=cause_chain(sc, failed) if failed else [],
                      observations=[mark(c.event, c.known - sc.t0) for c in sc.control
                                    if isinstance(c.event, LossOutlier)], scan=sc)


def _summary(sc: Scan, split: Goodput) -> Summary:
    events = [c.event for c in sc.control]
    end = next((e for e in events if isinstance(e, JobCompleted | JobFailed | JobCancelled)), None)
    match end:
        case JobCompleted():
            outcome, reason = "completed", ""
        case JobFailed(reason=why) | JobCancelled(reason=why):
            outcome, reason = type(end).__name__.removeprefix("Job").lower(), why
        case _:
            outcome, reason = "not ended", "the history stops before the job ended"
    spec = next((e.spec for e in events if isinstance(e, JobSubmitted)), None)
    worlds = [len(e.assignments) for e in events if isinstance(e, AllocationGranted)]
    final = final_mask(sc.lead.step)
    return Summary(job_id=sc.job_id, outcome=outcome, reason=reason, started_at=sc.t0, wall_s=split.wall_s,
                   steps_planned=spec.train.steps if spec else 0, steps_final=int(final.sum()),
                   steps_computed=len(sc.lead), attempts=len(worlds),
                   rollbacks=sum(isinstance(e, RollbackRequested) for e in events), world_sizes=tuple(worlds),
                   ranks=len(sc.ranks), events=sc.events, undecodable=sc.undecodable)


def _timeline(sc: Scan) -> tuple[list[Mark], int]:
    """The job's control events, the nodes' events that touched it, and what its ranks reported beyond steps."""
    t0 = sc.t0
    nodes = {a.node for c in sc.control if isinstance(c.event, AllocationGranted) for a in c.event.assignments}
    marks = [(c.known - t0, c.event) for c in sc.control
             if isinstance(c.event, JobEvent) or (isinstance(c.event, NodeEvent) and c.event.node in nodes
                                                  and c.known >= t0)]
    telemetry = [*sc.faults, *sc.paced, *sc.rolled_back, *sc.refused, *(r for r in sc.rank_started if r.rank == 0)]
    marks += [(e.occurred_at - t0, e) for e in telemetry]
    marks.sort(key=lambda m: m[0])
    left_out = 0
    if len(marks) > TIMELINE_MAX:
        kept = [m for m in marks if not isinstance(m[1], QUIET)]
        left_out = len(marks) - len(kept)
        if len(kept) > TIMELINE_MAX:
            left_out += len(kept) - TIMELINE_MAX
            kept = kept[:TIMELINE_MAX]
        marks = kept
    return [Mark(at=at, type=type(e).__name__, event_id=e.event_id, detail=describe(e)) for at, e in marks], left_out


def resumes(pm: Postmortem) -> list[tuple[float, int, int]]:
    """(seconds, from step, attempt) of every JobResumed: where the plots mark restarts."""
    return [(c.known - pm.scan.t0, c.event.from_step, c.event.attempt) for c in pm.scan.control
            if isinstance(c.event, JobResumed)]
