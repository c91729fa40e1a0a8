"""What a what-if starts from: the recorded job's wall and useful time, and what each recovery cost.

Wall and useful time are the postmortem's (services/tools/postmortem/goodput.py, the one definition of goodput),
so both verbs report the same recorded goodput. A recovery (a rollback, or a restart as a new attempt) costs the
time from the last step before it until training first passes that step again, less one step: detection, stop,
restore or restart, and the redone steps.
"""

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointStaged
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.job import AllocationRequested, JobCancelled, JobCompleted, JobFailed, JobResumed, JobSubmitted
from flightdeck.events.store import Stored
from flightdeck.events.training import RolledBack, StepCompleted
from flightdeck.services.tools.postmortem.analysis import analyse


@dataclass(frozen=True, slots=True)
class Incident:
    kind: str  # "rollback" or "restart"
    decision_id: str  # the RollbackRequested, or the AllocationRequested of the new attempt
    at: float
    fault_step: int  # the newest step done before the decision
    restore_step: int  # where training went on from
    lost_s: float  # last step before it -> first step past fault_step again, less one step time
    regained: bool  # training did pass fault_step again within the history


@dataclass(frozen=True, slots=True)
class Measured:
    start: float
    end: float
    outcome: str  # "completed", "failed", "cancelled" or "running"
    steps: int  # the spec's train.steps
    done: int  # steps of the final run (train.steps when completed)
    step_s: float  # median step time (rank 0)
    stall_s: float  # median checkpoint stall (rank 0)
    checkpoint_every: int
    incidents: list[Incident]
    commits: list[tuple[float, int]]  # (time, step) of every committed checkpoint
    wall_s: float  # submission to the end, as the postmortem splits it
    useful_s: float  # rank 0 computing steps that stand in the final timeline (the postmortem's "useful")

    def goodput(self, wall_s: float | None = None, useful_s: float | None = None) -> float:
        wall = self.wall_s if wall_s is None else wall_s
        return (self.useful_s if useful_s is None else useful_s) / wall if wall > 0 else 0.0


def measure(rows: Sequence[Stored], job_id: str) -> Measured:
    events = [s.event for s in rows if s.event is not None and getattr(s.event, "job_id", None) == job_id]
    submitted = next(e for e in events if isinstance(e, JobSubmitted))
    steps = sorted((e for e in events if isinstance(e, StepCompleted) and e.rank == 0), key=lambda e: e.occurred_at)
    ended = next((e for e in events if isinstance(e, JobCompleted | JobFailed | JobCancelled)), None)
    outcome = ("completed" if isinstance(ended, JobCompleted) else "failed" if isinstance(ended, JobFailed)
               else "cancelled" if isinstance(ended, JobCancelled) else "running")
    last = max((e.occurred_at for e in events), default=submitted.occurred_at)
    end = ended.occurred_at if ended is not None else last
    commits = sorted((e.occurred_at, e.step) for e in events if isinstance(e, CheckpointCommitted))
    stalls = [e.stall_s for e in events if isinstance(e, CheckpointStaged) and e.rank == 0]
    done = submitted.spec.train.steps if outcome == "completed" else max((s.step + 1 for s in steps), default=0)
    split = analyse(rows, job_id).goodput
    return Measured(
        start=submitted.occurred_at, end=end, outcome=outcome, steps=submitted.spec.train.steps, done=done,
        step_s=statistics.median(s.step_time_s for s in steps) if steps else 0.0,
        stall_s=statistics.median(stalls) if stalls else 0.0, checkpoint_every=submitted.spec.train.checkpoint_every,
        incidents=_incidents(events, steps), commits=commits, wall_s=split.wall_s, useful_s=split.parts["useful"],
    )


def _incidents(events: Sequence[object], steps: list[StepCompleted]) -> list[Incident]:
    resumed = {e.attempt: e.from_step for e in events if isinstance(e, JobResumed)}
    landed = [e for e in events if isinstance(e, RolledBack)]
    step_s = statistics.median(s.step_time_s for s in steps) if steps else 0.0
    out: list[Incident] = []
    for e in events:
        if isinstance(e, RollbackRequested):
            # in place: the ranks go on until they carry it out; the old timeline ends where the first rank did
            done = next((r.occurred_at for r in landed if r.occurred_at >= e.occurred_at
                         and (r.checkpoint_id, r.to_step) == (e.checkpoint_id, e.to_step)), None)
            if done is None:
                continue
            old = [s for s in steps if s.occurred_at <= done]
            new = [s for s in steps if s.occurred_at > done]
            kind, restore = "rollback", e.to_step
        elif isinstance(e, AllocationRequested) and e.attempt > 0:
            old = [s for s in steps if s.attempt < e.attempt]
            new = [s for s in steps if s.attempt >= e.attempt]
            kind, restore = "restart", resumed.get(e.attempt, 0)
        else:
            continue
        if not old:
            continue
        last = max(old, key=lambda s: (s.step, s.occurred_at))
        after = next((s for s in new if s.step > last.step), None)
        lost = (after.occurred_at - last.occurred_at - step_s) if after is not None else 0.0
        out.append(Incident(kind, e.event_id, e.occurred_at, last.step, restore, max(lost, 0.0), after is not None))
    return out
