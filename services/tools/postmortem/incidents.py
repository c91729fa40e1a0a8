"""Incidents: each fault walked to its detection, the decision taken on it, and how it resolved.

Why it works this way: docs/internals.md, "8. Operator tools".
"""

from collections import defaultdict
from dataclasses import dataclass, field, replace

from flightdeck.events.base import Event, JobEvent
from flightdeck.events.commands import StopRequested
from flightdeck.events.findings import (
    Finding,
    InexactRestore,
    LossOutlier,
    LossSpikeDetected,
    NonFiniteLoss,
    RankHung,
    RankLost,
    SpikeDiagnosed,
    StragglerDetected,
    diagnosis_summary,
    spike_onset,
)
from flightdeck.events.fleet import NodeLost
from flightdeck.events.job import (
    AllocationGranted,
    CancelRequested,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobPreempted,
    WorkersExited,
)
from flightdeck.events.training import FaultInjected, RankFault
from flightdeck.services.tools.postmortem.describe import Mark, describe, mark
from flightdeck.services.tools.postmortem.resolution import SKEW_S, resolve
from flightdeck.services.tools.postmortem.scan import Control, Scan, find

ENDED = (JobCompleted, JobFailed, JobCancelled)
STOPPING = (StopRequested, JobPreempted, CancelRequested)


@dataclass(frozen=True, slots=True)
class Incident:
    number: int
    kind: str  # crash, hang, loss_spike, nonfinite, lost, exit, node_lost, straggler
    trigger: str  # what happened, in words
    attempt: int
    fault_at: float
    detected_at: float
    decision: str  # restart, restart + reshard, rollback, fail, none
    decision_detail: str
    resolution: str
    restart_end: float  # detected_at .. restart_end: deciding, stopping, re-placing, spawning (a rollback: until
    restore_end: float  # the ranks obey); restart_end .. restore_end: rank start-up and checkpoint restore
    recovered_at: float | None  # the end of the first step after resuming
    fault_step: int | None
    rollback_to: int | None
    skip: tuple[int, int] | None
    steps_lost: int  # steps completed after the restore point, thrown away
    steps_redone: int  # how many of those were computed again
    chain: tuple[Mark, ...]
    related: tuple[Mark, ...] = ()  # other reports of the same fault
    diagnosis: str = ""  # a loss spike's cause, as the health monitor judged it (SpikeDiagnosed)

    @property
    def time_to_detect(self) -> float:
        return self.detected_at - self.fault_at

    @property
    def time_to_recover(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.fault_at


@dataclass
class _Draft:
    trigger: Control
    attempt: int
    decisions: list[Control]
    related: list[Control] = field(default_factory=list)


def _is_trigger(ev: Event) -> bool:
    # about an incident's recovery, or an observation nothing was done about (LossOutlier): not a fault of its own
    if isinstance(ev, SpikeDiagnosed | InexactRestore | LossOutlier):
        return False
    return isinstance(ev, Finding | NodeLost) or (isinstance(ev, WorkersExited) and ev.is_fault())


def _drafts(sc: Scan, caused: dict[str, list[Control]]) -> list[_Draft]:
    drafts: list[_Draft] = []
    attempt, stopping, ended = 0, set[int](), False
    for c in sc.control:
        ev = c.event
        if isinstance(ev, AllocationGranted):
            attempt = ev.attempt
        elif isinstance(ev, STOPPING):  # exits after a stop are the stop's doing, not faults
            stopping.add(attempt)
        elif isinstance(ev, ENDED):
            ended = True
        if not _is_trigger(ev):
            continue
        at = getattr(ev, "attempt", attempt)
        decisions = [d for d in caused.get(ev.event_id, []) if isinstance(d.event, JobEvent)
                     and d.event.producer == "scheduler"]
        host = next((d for d in reversed(drafts) if d.attempt == at), None)
        if isinstance(ev, WorkersExited) and at in stopping and host is not None:
            # the exits an incident's stop brought, and what the scheduler then decided (the restart waits for
            # them), belong to that incident: counted apart, a hang was two incidents when the restart came on
            # the hung rank's exit
            host.related.append(c)
            host.decisions += decisions
            continue
        if decisions:
            drafts.append(_Draft(c, at, decisions))
            continue
        if host is not None:
            host.related.append(c)
        elif not ended and at not in stopping and not isinstance(ev, NodeLost):
            drafts.append(_Draft(c, at, []))
    return drafts


def incidents(sc: Scan) -> list[Incident]:
    caused: dict[str, list[Control]] = defaultdict(list)
    for c in sc.control:
        caused[c.event.causation_id].append(c)
    drafts = _drafts(sc, caused)
    wanted = [i for d in drafts for i in getattr(d.trigger.event, "evidence", [])]
    failed = next((c for c in sc.control if isinstance(c.event, JobFailed)), None)
    if failed is not None:
        wanted += failed.event.causes  # type: ignore[attr-defined]
    found = find(sc, wanted)
    used: set[str] = set()
    diagnoses = {c.event.finding_id: c for c in sc.control if isinstance(c.event, SpikeDiagnosed)}
    out: list[Incident] = []
    for number, draft in enumerate(drafts, start=1):
        previous = max((i.detected_at for i in out if i.attempt == draft.attempt), default=float("-inf"))
        incident = _incident(sc, number, draft, caused, found, used, previous)
        judged = diagnoses.get(draft.trigger.event.event_id)
        if judged is not None:
            assert isinstance(judged.event, SpikeDiagnosed)
            incident = replace(incident, diagnosis=diagnosis_summary(judged.event),
                               chain=(*incident.chain, mark(judged.event, judged.known - sc.t0)))
        out.append(incident)
    return out


def _fault(sc: Scan, draft: _Draft, used: set[str], after: float) -> list[FaultInjected | RankFault]:
    """The incident's fault first, then the other rank faults of its window (a peer's collective failing after
    the crash): every one of them is spent on this incident."""
    t0, ev = sc.t0, draft.trigger.event
    upper = draft.trigger.known + SKEW_S
    candidates = [f for f in sc.faults if f.attempt == draft.attempt and f.event_id not in used
                  and after < f.occurred_at - t0 and f.occurred_at <= upper]
    rank = getattr(ev, "rank", None)
    mine = [f for f in candidates if f.rank == rank]
    if not candidates:
        return []
    chosen = (mine or candidates)[0]
    used.update(f.event_id for f in candidates)
    return [chosen, *(f for f in candidates if f is not chosen)]


def _inferred_fault_at(ev: Event, known: float) -> float:
    match ev:
        case RankHung():
            return known - ev.stalled_s
        case RankLost() if ev.last_seen > 0 and ev.reason.startswith("heartbeats"):
            return ev.last_seen
        case LossSpikeDetected() | NonFiniteLoss() | StragglerDetected() | WorkersExited() | NodeLost():
            return ev.occurred_at
    return known


def _kind(ev: Event, fault: FaultInjected | RankFault | None) -> str:
    if isinstance(fault, FaultInjected):
        return fault.kind
    match ev:
        case LossSpikeDetected():
            return "loss_spike"
        case NonFiniteLoss():
            return "nonfinite"
        case RankHung():
            return "hang"
        case RankLost():
            return "lost"
        case StragglerDetected():
            return "straggler"
        case NodeLost():
            return "node_lost"
    return "crash" if isinstance(fault, RankFault) else "exit"


def _incident(sc: Scan, number: int, draft: _Draft, caused: dict[str, list[Control]], found: dict[str, Event],
              used: set[str], previous: float) -> Incident:
    t0, trig = sc.t0, draft.trigger.event
    detected = draft.trigger.known - t0
    spent = _fault(sc, draft, used, previous)
    fault, others = (spent[0], spent[1:]) if spent else (None, [])
    fault_at = min(detected, (fault.occurred_at if fault else _inferred_fault_at(trig, draft.trigger.known)) - t0)
    what = describe(trig)
    trigger = f"{describe(fault)} -> {what}" if fault is not None else what
    chain: list[tuple[float, Mark]] = []
    if fault is not None:
        chain.append((0, mark(fault, fault.occurred_at - t0)))
    for eid in getattr(trig, "evidence", []):
        if eid in found and eid != (fault.event_id if fault else ""):
            chain.append((1, mark(found[eid], found[eid].occurred_at - t0)))
    chain.append((2, mark(trig, detected)))
    outcome = resolve(sc, draft.decisions, draft.attempt, fault_at, detected)
    limit = outcome.limit + t0
    seen = {trig.event_id}
    frontier = [d for d in draft.decisions]
    while frontier:  # what the decision caused, up to the incident's resolution
        c = frontier.pop(0)
        if c.event.event_id in seen or c.known > limit or not isinstance(c.event, JobEvent):
            continue
        seen.add(c.event.event_id)
        chain.append((3, mark(c.event, c.known - t0)))
        frontier += caused.get(c.event.event_id, [])
    for c in outcome.controls:
        if c.event.event_id not in seen:
            seen.add(c.event.event_id)
            chain.append((3, mark(c.event, c.known - t0)))
    chain += [(4, m) for m in outcome.marks]
    kind = _kind(trig, fault)
    node = _node_found_lost(sc, trig, draft.attempt, limit)
    if node is not None:  # a lost rank whose node is then found lost: the node's loss is the incident
        kind, trigger = "node_lost", f"{trigger}; {describe(node.event)}"
        chain.append((2, mark(node.event, node.known - t0)))
    chain.sort(key=lambda pair: (pair[1].at, pair[0]))
    return Incident(number=number, kind=kind, trigger=trigger, attempt=draft.attempt,
                    fault_at=fault_at, detected_at=detected, decision=outcome.decision,
                    decision_detail=outcome.detail, resolution=outcome.resolution,
                    restart_end=outcome.restart_end, restore_end=outcome.restore_end,
                    recovered_at=outcome.recovered_at, fault_step=_fault_step(trig, fault),
                    rollback_to=outcome.rollback_to, skip=outcome.skip, steps_lost=outcome.lost,
                    steps_redone=outcome.redone, chain=tuple(m for _, m in chain),
                    related=tuple(sorted([*(mark(c.event, c.known - t0) for c in draft.related),
                                          *(mark(f, f.occurred_at - t0) for f in others)],
                                         key=lambda m: m.at)))


def _node_found_lost(sc: Scan, trig: Event, attempt: int, until: float) -> Control | None:
    """The NodeLost, known by `until`, of the node a silent rank (RankLost) ran on in `attempt`: health's rank
    deadline may pass before the node's, and the restart then follows the rank's finding."""
    if not isinstance(trig, RankLost) or not trig.reason.startswith("heartbeats"):
        return None
    grants = [c.event for c in sc.control if isinstance(c.event, AllocationGranted) and c.event.attempt == attempt]
    nodes = {ref.node for g in grants for ref in g.assignments if ref.rank == trig.rank}
    return next((c for c in sc.control if isinstance(c.event, NodeLost) and c.event.node in nodes
                 and c.known <= until), None)


def _fault_step(ev: Event, fault: FaultInjected | RankFault | None) -> int | None:
    if fault is not None:
        return fault.step
    if isinstance(ev, LossSpikeDetected):
        return spike_onset(ev)  # the first step whose loss carried the spike, as the finding recorded it
    step = getattr(ev, "step", None)
    return step if isinstance(step, int) else None


def cause_chain(sc: Scan, failed: JobFailed) -> list[Mark]:
    """The events a JobFailed names as its causes, in its order (first fault to last straw)."""
    found = find(sc, failed.causes)
    known = {c.event.event_id: c.known for c in sc.control}
    out = []
    for eid in failed.causes:
        ev = found.get(eid)
        if ev is None:
            out.append(Mark(at=float("nan"), type="?", event_id=eid, detail="not in this history"))
        else:
            out.append(mark(ev, known.get(eid, ev.occurred_at) - sc.t0))
    return out
