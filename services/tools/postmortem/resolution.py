"""How an incident's decision played out: a restart to the new attempt's first step, a rollback to the first step
after the ranks restored, or the job's failure; with the steps thrown away and how many were computed again."""

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.commands import RollbackRequested, StopRequested
from flightdeck.events.findings import InexactRestore
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    JobFailed,
    JobResumed,
    WorkersStarted,
)
from flightdeck.events.plan import ReshardPlanned, described
from flightdeck.services.tools.postmortem.describe import Mark, describe, mark
from flightdeck.services.tools.postmortem.scan import Control, Scan

SKEW_S = 1.0  # a rank's clock may run this far ahead of the services' and still have caused what they saw
FOLLOW_UPS = (AllocationRequested, AllocationGranted, ReshardPlanned, WorkersStarted, JobResumed)


@dataclass
class Outcome:
    decision: str
    detail: str
    resolution: str
    restart_end: float
    restore_end: float
    recovered_at: float | None
    limit: float  # the chain follows causation up to here
    controls: list[Control] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    rollback_to: int | None = None
    skip: tuple[int, int] | None = None
    lost: int = 0
    redone: int = 0


def resolve(sc: Scan, decisions: list[Control], attempt: int, fault_at: float, detected: float) -> Outcome:
    """The outcome of the scheduler's `decisions` about a fault of `attempt` detected at `detected`."""
    events = [d.event for d in decisions]
    failed = next((d for d in decisions if isinstance(d.event, JobFailed)), None)
    rollback = next((e for e in events if isinstance(e, RollbackRequested)), None)
    if failed is not None:
        return _failed(sc, attempt, failed)
    if rollback is not None:
        return _rolled_back(sc, attempt, rollback, fault_at, detected)
    if any(isinstance(e, AllocationReleased | AllocationRequested | StopRequested) for e in events):
        return _restarted(sc, attempt, detected)
    what = "reported; the policy takes no action on it" if events == [] else \
        ", ".join(type(e).__name__ for e in events)
    return Outcome("none", what, "no action", detected, detected, None, detected)


def _distinct(steps: npt.NDArray[np.int64], lo: int, hi: int) -> int:
    return int(np.unique(steps[(steps >= lo) & (steps <= hi)]).size)


def _failed(sc: Scan, attempt: int, failed: Control) -> Outcome:
    t0, lead = sc.t0, sc.lead
    ev = failed.event
    assert isinstance(ev, JobFailed)
    at = failed.known - t0
    mine = lead.step[(lead.attempt == attempt) & (lead.end <= failed.known + SKEW_S)]
    commits = [c.event.step for c in sc.control if isinstance(c.event, CheckpointCommitted)
               and c.known <= failed.known]
    lost = int(mine.max()) + 1 - max((s for s in commits if s <= mine.max() + 1), default=0) if mine.size else 0
    return Outcome("fail", ev.reason, "the job failed", at, at, None, at, lost=max(lost, 0))


def _rolled_back(sc: Scan, attempt: int, rb: RollbackRequested, fault_at: float, detected: float) -> Outcome:
    t0, lead = sc.t0, sc.lead
    detail = describe(rb)
    landed = [r for r in sc.rolled_back if r.attempt == attempt and r.checkpoint_id == rb.checkpoint_id
              and (r.skip_from, r.skip_to) == (rb.skip_from, rb.skip_to) and r.occurred_at - t0 >= fault_at]
    common = {"rollback_to": rb.to_step, "skip": (rb.skip_from, rb.skip_to)}
    if not landed:
        return Outcome("rollback", detail, "the ranks never reported the rollback", detected, detected, None,
                        detected, **common)  # type: ignore[arg-type]
    first = min(landed, key=lambda r: r.occurred_at)
    same = lead.attempt == attempt
    before = same & (lead.end <= first.occurred_at)
    after = np.flatnonzero(same & (lead.end > first.occurred_at))
    thrown = int(lead.step[before].max()) if before.any() else rb.to_step - 1
    restart_end = max(detected, float(lead.end[before].max()) - t0 if before.any() else detected)
    marks = [mark(first, first.occurred_at - t0)]
    if after.size:
        i = after[0]
        recovered, restore_end = float(lead.end[i]) - t0, float(lead.end[i] - lead.took[i]) - t0
        marks.append(_step_mark(sc, i, "first step after the rollback"))
        resolution = f"back at step {rb.to_step} after {first.occurred_at - t0 - detected:.2f} s"
    else:
        recovered, restore_end, resolution = None, first.occurred_at - t0, "no step after the rollback"
    lost = max(thrown - rb.to_step + 1, 0)
    redone = _distinct(lead.step[after], rb.to_step, thrown) if after.size else 0
    return Outcome("rollback", detail, resolution, restart_end, max(restore_end, restart_end), recovered,
                    recovered if recovered is not None else restore_end, marks=marks, lost=lost, redone=redone,
                    **common)  # type: ignore[arg-type]


def _restarted(sc: Scan, attempt: int, detected: float) -> Outcome:
    t0, lead, new = sc.t0, sc.lead, attempt + 1
    grants = {c.event.event_id for c in sc.control if isinstance(c.event, AllocationGranted) and c.event.attempt == new}
    # the plan for the new grant carries no attempt of its own: it is the grant's consequence
    ctl = [c for c in sc.control if isinstance(c.event, FOLLOW_UPS) and (getattr(c.event, "attempt", -1) == new or (
        isinstance(c.event, ReshardPlanned) and c.event.causation_id in grants))]
    old_world = _world(sc.control, attempt)
    replanned = next((c.event for c in ctl if isinstance(c.event, ReshardPlanned)), None)
    resumed = next((c for c in ctl if isinstance(c.event, JobResumed)), None)
    started = [c.known - t0 for c in ctl if isinstance(c.event, WorkersStarted)]
    firsts = np.flatnonzero(lead.attempt == new)
    old = lead.step[lead.attempt == attempt]
    decision, detail = "restart", f"restart as attempt {new}"
    if resumed is not None:
        ev = resumed.event
        assert isinstance(ev, JobResumed)
        if old_world and ev.world_size != old_world:
            decision, detail = "restart + reshard", f"{detail} on {ev.world_size} ranks (was {old_world})"
        if replanned is not None and replanned.old is not None and \
                (replanned.new.tp, replanned.new.pp) != (replanned.old.tp, replanned.old.pp):  # more than DP changed
            decision, detail = "restart + reshard", f"{detail}, laid out {described(replanned.new)}"
        detail += f" from step {ev.from_step}" + (f" ({ev.checkpoint_id})" if ev.checkpoint_id else "")
        ranks = [r for r in sc.rank_started if r.attempt == new]
        memory = sum(1 for r in ranks if r.restored_from == "memory")
        if memory:
            detail += (", loaded from the nodes' memory" if memory == len(ranks) else
                       f", {memory} of {len(ranks)} ranks loaded from their nodes' memory")
        inexact = next((c.event for c in sc.control if isinstance(c.event, InexactRestore) and c.event.attempt == new),
                       None)
        if inexact is not None:  # never silent: from here the run is not what it would have been
            detail += f"; not guaranteed bitwise the uninterrupted run: {inexact.reason}"
        from_step = ev.from_step
    else:
        from_step = int(old.max()) + 1 if old.size else 0
    restart_end = max([detected, *started[-1:]])
    marks = [mark(r, r.occurred_at - t0) for r in sc.rank_started if r.attempt == new and r.rank == 0][:1]
    if firsts.size:
        i = firsts[0]
        recovered, restore_end = float(lead.end[i]) - t0, float(lead.end[i] - lead.took[i]) - t0
        marks.append(_step_mark(sc, i, "first step after the restart"))
        resolution = f"resumed at step {int(lead.step[i])}"
    else:
        recovered, restore_end = None, restart_end
        resolution = "never resumed" + ("" if resumed is None else " (ranks started, no step)")
    thrown = int(old.max()) if old.size else from_step - 1
    lost = max(thrown - from_step + 1, 0)
    later = lead.step[lead.attempt > attempt]
    return Outcome(decision, detail, resolution, restart_end, max(restore_end, restart_end), recovered,
                    recovered if recovered is not None else restart_end, controls=ctl, marks=marks, lost=lost,
                    redone=_distinct(later, from_step, thrown))


def _world(control: Sequence[Control], attempt: int) -> int:
    return next((len(c.event.assignments) for c in control if isinstance(c.event, AllocationGranted)
                 and c.event.attempt == attempt), 0)


def _step_mark(sc: Scan, i: int, what: str) -> Mark:
    lead = sc.lead
    return Mark(at=float(lead.end[i]) - sc.t0, type="StepCompleted", event_id="",
                detail=f"rank 0 step {int(lead.step[i])}, loss {float(lead.loss[i]):.4g}: {what}")
