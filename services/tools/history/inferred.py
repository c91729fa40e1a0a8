"""A job's phase read from its decisions, for histories the scheduler recorded no phases in (recorded before
JobPhaseChanged). Histories recorded since are read from that record alone (jobview.py): nothing here runs for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from flightdeck.events.base import Event
from flightdeck.events.commands import PauseRequested, ResumeRequested
from flightdeck.events.job import (
    AllocationDenied,
    AllocationReleased,
    AllocationRequested,
    CancelRequested,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobPhase,
    JobPreempted,
    JobQueued,
    WorkersStarted,
)
from flightdeck.services.tools.history.reasons import headline

if TYPE_CHECKING:  # jobview imports this module: its JobView is a type here only
    from flightdeck.services.tools.history.jobview import JobView

STALE_GRANT = "stale grant"  # the scheduler's reason for giving back slots nobody waits for


def phase(before: JobView, after: JobView, event: Event, at: float) -> JobView:
    """`after` (the view after `event` in all but its phase) with the phase `event` implies, read from `before`."""
    def put(**changes: object) -> JobView:
        return msgspec.structs.replace(after, **changes)

    match event:
        case JobQueued(reason=reason):
            now: JobPhase = "preempted" if reason == "preempted" else (
                "recovering" if before.phase == "recovering" else "queued")
            return put(phase=now, reason="" if reason == "submitted" else reason)
        case AllocationRequested():
            recovering = before.phase == "recovering"
            return put(phase="recovering" if recovering else "placing", reason=before.reason if recovering else "")
        case AllocationDenied(attempt=attempt, reason=reason) if attempt == before.attempt:
            return put(reason=f"allocation denied: {reason}")
        case WorkersStarted() if before.phase in ("placing", "recovering") and after.granted \
                and after.granted <= after.started:
            return put(phase="running", running_since=at, reason="")
        case JobPreempted(by_job_id=by, reason=reason):
            return put(phase="stopping", paused="", reason=f"preempted by {by}: {reason}")
        case CancelRequested(reason=reason):
            return put(phase="stopping" if before.phase in ("running", "paused", "stopping") else before.phase,
                       reason=reason or "cancel requested")
        case AllocationReleased(attempt=attempt, reason=reason) if attempt == before.attempt and reason != STALE_GRANT:
            return _released(before, after, event)
        case PauseRequested(reason=reason):
            return put(paused=reason or f"paused by {event.producer or 'a person'}",
                       phase="paused" if before.phase == "running" else before.phase)
        case ResumeRequested():
            return put(paused="", phase="running" if before.phase == "paused" else before.phase)
        case JobCompleted():
            return _end(after, "completed", "", at)
        case JobFailed(reason=reason):
            return _end(after, "failed", reason, at)
        case JobCancelled(reason=reason):
            return _end(after, "cancelled", reason, at)
    return after


def _released(before: JobView, after: JobView, ev: AllocationReleased) -> JobView:
    said = headline(ev.reason)
    cleared = msgspec.structs.replace(after, running_since=0.0, paused="")
    match ev.kind:
        case "fault":  # a restart after a fault: the restarts it spent are the scheduler's figure (some are free)
            return msgspec.structs.replace(cleared, phase="recovering", restarts=ev.restarts, reason=said)
        case "grow":  # a shrunk job stopped to grow back: no fault, and no restart spent by it
            return msgspec.structs.replace(cleared, phase="recovering", reason=said,
                                           restarts=max(ev.restarts, before.restarts))
        case "preempt":
            return cleared  # its JobQueued("preempted") follows
        case "ended" | "stale":
            return after  # the job's end says how it ended; a stale grant was never the attempt's
    # A record from before releases said why: a release outside a stop is a restart after a fault, and the restarts
    # it spent are the scheduler's figure when recorded (a bad checkpoint's or a drain's restart is free).
    if before.phase == "stopping":
        return cleared  # a preemption's stop is done; its JobQueued("preempted") follows
    restarts = ev.restarts if ev.restarts >= 0 else before.restarts + 1
    return msgspec.structs.replace(cleared, phase="recovering", restarts=restarts, reason=said, last_fault=said)


def _end(view: JobView, phase: JobPhase, reason: str, at: float) -> JobView:
    why = "" if phase == "completed" else headline(reason) or view.reason
    # world_size stays: how many ranks the job last ran with is worth showing after it ended
    return msgspec.structs.replace(view, phase=phase, reason=why, ended_at=at, granted=frozenset(),
                                   started=frozenset())
