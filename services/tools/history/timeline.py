"""A job's history folded for a person: its state at a cut (console/jobview.py's JobView) and the timeline
of what mattered (phase changes, faults, findings, decisions, checkpoints, reshards, rollbacks).

Pure: rows in, values out. Times are relative to the job's submission.
"""

import bisect
from typing import Any

import msgspec

from flightdeck.events import codec, subjects
from flightdeck.events.admission import Admission
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointFailed, CheckpointPending
from flightdeck.events.commands import (
    CheckpointRequested,
    PauseRequested,
    ResumeRequested,
    RollbackRequested,
    StopRequested,
)
from flightdeck.events.findings import Finding
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
    JobPreempted,
    JobResumed,
    JobSubmitted,
    WorkersExited,
)
from flightdeck.events.plan import ReshardPlanned
from flightdeck.events.store import Stored
from flightdeck.events.training import FaultInjected, RankFault, RolledBack, StepCompleted
from flightdeck.services.tools.history import jobview
from flightdeck.services.tools.history.jobview import JobView
from flightdeck.services.tools.history.library import History
from flightdeck.services.tools.history.until import Cut, submitted_at

_KINDS: dict[type[Event], str] = {
    JobSubmitted: "decision", AllocationRequested: "decision", AllocationGranted: "decision",
    AllocationDenied: "decision", AllocationReleased: "decision", JobResumed: "decision", JobPreempted: "decision",
    StopRequested: "decision", CheckpointRequested: "decision", PauseRequested: "decision",
    ResumeRequested: "decision", CancelRequested: "decision",
    JobCompleted: "end", JobFailed: "end", JobCancelled: "end",
    CheckpointCommitted: "checkpoint", CheckpointFailed: "checkpoint", CheckpointPending: "checkpoint",
    ReshardPlanned: "reshard", RollbackRequested: "rollback", RolledBack: "rollback",
    RankFault: "fault", FaultInjected: "fault", WorkersExited: "fault",
    NodeLost: "finding", NodeCordoned: "node", NodeUncordoned: "node", SelfCheckFailed: "node",
}
_TELEMETRY_KINDS = frozenset({RolledBack, RankFault, FaultInjected})
# Fields too big or too internal for one line; --json has the whole event
_HIDDEN = frozenset({"type", "event_id", "occurred_at", "causation_id", "producer", "schema_version", "job_id",
                     "job_version", "spec", "data", "shards", "evidence", "assignments", "pids", "uri",
                     "manifest_sha256"})
MAX_VALUE = 60


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One line of the timeline: `kind` is phase, decision, finding, fault, checkpoint, reshard, rollback,
    node or end; `offset_s` is seconds after submission; `seq` and `stream` say where it is recorded."""

    seq: int
    stream: str
    offset_s: float
    kind: str
    type: str
    summary: str
    event_id: str = ""


def job_view_at(history: History, cut: Cut) -> JobView:
    """The job as a person sees it after the cut: its control history folded, plus the newest step reported."""
    view = JobView(job_id=history.job_id)
    for s in history.job_control():  # admitted ones only
        if s.seq > cut.control_seq:
            break
        if s.event is not None:
            view = jobview.evolve(view, s.event)
    return jobview.with_step(view, newest_step(history, cut.telemetry_seq))


def newest_step(history: History, telemetry_seq: int) -> StepCompleted | None:
    """The job's newest StepCompleted at or before `telemetry_seq` (searched from the cut backwards)."""
    rows = history.stream(subjects.TELEMETRY)
    prefix = f"fd.tel.{history.job_id}."
    for i in range(bisect.bisect_right(rows, telemetry_seq, key=lambda s: s.seq) - 1, -1, -1):
        s = rows[i]
        if isinstance(s.event, StepCompleted) and s.subject.startswith(prefix):
            return s.event
    return None


def timeline(history: History, cut: Cut) -> list[Entry]:
    """What mattered up to the cut, control and telemetry interleaved by time (each stream in its order)."""
    base = submitted_at(history)
    control = _control_entries(history, cut, base)
    telemetry = _telemetry_entries(history, cut, base)
    merged: list[Entry] = []
    i = j = 0
    while i < len(control) or j < len(telemetry):
        if j >= len(telemetry) or (i < len(control) and control[i].offset_s <= telemetry[j].offset_s):
            merged.append(control[i])
            i += 1
        else:
            merged.append(telemetry[j])
            j += 1
    return merged


def _control_entries(history: History, cut: Cut, base: float) -> list[Entry]:
    out: list[Entry] = []
    view = JobView(job_id=history.job_id)
    nodes: set[str] = set()
    prefix = f"fd.ctl.job.{history.job_id}."
    admission = Admission()  # what the services folded, and only that
    for s in history.stream(subjects.CONTROL):
        if s.seq > cut.control_seq:
            break
        event = s.event
        if event is None or admission.refusal(s):
            continue
        if s.subject.startswith(prefix):
            before = view.phase
            view = jobview.evolve(view, event)
            if isinstance(event, AllocationGranted):
                nodes |= {ref.node for ref in event.assignments}
            if _kind(event):
                out.append(_entry(s, event, base))
            if view.phase != before:
                why = f" ({view.reason})" if view.reason else ""
                out.append(Entry(seq=s.seq, stream=s.stream, offset_s=event.occurred_at - base, kind="phase",
                                 type="Phase", summary=f"{before} -> {view.phase}{why}", event_id=event.event_id))
        elif s.subject.startswith("fd.ctl.node.") and getattr(event, "node", None) in nodes and _kind(event):
            out.append(_entry(s, event, base))
    return out


def _telemetry_entries(history: History, cut: Cut, base: float) -> list[Entry]:
    out: list[Entry] = []
    seen: set[tuple[Any, ...]] = set()
    prefix = f"fd.tel.{history.job_id}."
    for s in history.stream(subjects.TELEMETRY):
        if s.seq > cut.telemetry_seq:
            break
        event = s.event
        # steps and heartbeats are most of telemetry and never on the timeline: one set lookup rules them out
        if type(event) not in _TELEMETRY_KINDS or not s.subject.startswith(prefix):
            continue
        assert event is not None
        if isinstance(event, RolledBack):  # every rank reports the same rollback: one line says it
            key: tuple[Any, ...] = ("rolledback", event.attempt, event.checkpoint_id, event.skip_from)
            if key in seen:
                continue
            seen.add(key)
        out.append(_entry(s, event, base))
    return out


def _kind(event: Event) -> str:
    if isinstance(event, Finding):
        return "finding"
    if isinstance(event, WorkersExited) and not event.is_fault():
        return ""
    return _KINDS.get(type(event), "")


def _entry(s: Stored, event: Event, base: float) -> Entry:
    return Entry(seq=s.seq, stream=s.stream, offset_s=event.occurred_at - base, kind=_kind(event),
                 type=codec.type_name(event), summary=summary(event), event_id=event.event_id)


def summary(event: Event) -> str:
    """The event's own fields as `key=value`, big ones left out."""
    fields = codec.to_builtins(event)
    parts = []
    for key, value in fields.items():
        if key in _HIDDEN or value in ("", [], {}, None):
            continue
        parts.append(f"{key}={_short(value)}")
    if isinstance(event, JobSubmitted):
        parts = [f"name={event.spec.name}", f"slots={event.spec.slots}", f"steps={event.spec.train.steps}",
                 f"priority={event.spec.priority}"]
    if isinstance(event, AllocationGranted):
        parts.append(f"ranks={len(event.assignments)} nodes={','.join(sorted({a.node for a in event.assignments}))}")
    return " ".join(parts)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = value if isinstance(value, str) else codec.to_json(value).decode()
    if isinstance(value, str) and (not value or any(c.isspace() for c in value)):
        text = codec.to_json(value).decode()
    return text if len(text) <= MAX_VALUE else text[: MAX_VALUE - 1] + "…"
