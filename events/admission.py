"""Admission: which stored control events a reader folds. One rule for every reader, so the services' cores, their
replays (`verify`, `whatif`), the client's views, `status`, `replay` and the dashboard all fold the same events.

An event is admitted when it decodes, stands under its own subject (the grammar of events/subjects.py: a job
event names the job of its subject, a node event its node, ...) and, on a job's versioned subjects
(`fd.ctl.job.<job>.<type>`), carries a `job_version` above every one admitted of that job so far. Versions only
grow in a history (appends are fenced: events/history.py), so an unnumbered event (0) or a repeated one can only
be forged or replayed: refused, like an event under another job's subject, instead of stalling the history.
A version that jumps ahead is admitted: it is a gap (lost messages), which `check_contiguous` reports.
"""

from flightdeck.events import subjects
from flightdeck.events.base import Event, JobEvent, NodeEvent, RankEvent
from flightdeck.events.clock import ClockTick, CoreConfigured, DeadLettered
from flightdeck.events.codec import type_name
from flightdeck.events.store import Stored


def mismatch(subject: str, event: Event) -> str:
    """Why `event` may not stand under `subject` by the subject grammar (events/subjects.py), or ""."""
    parts = subject.split(".")
    name = type_name(event)
    head, n = parts[:3], len(parts)
    if head == _JOB and n == 5:
        ok = isinstance(event, JobEvent) and event.job_id == parts[3] and name == parts[4]
    elif head == _JOB and n == 7 and parts[4] == "node":  # subjects.job_node
        ok = (isinstance(event, JobEvent) and event.job_id == parts[3] and name in subjects.NODE_RECORDS
              and getattr(event, "node", None) == parts[5] and name == parts[6])
    elif head == _NODE and n == 5:
        ok = isinstance(event, NodeEvent) and event.node == parts[3] and name == parts[4]
    elif head == _CLOCK and n == 4:
        ok = isinstance(event, ClockTick | CoreConfigured) and event.service == parts[3]
    elif head[:2] == _TEL and n == 5 and parts[2] == subjects.FLEET:  # subjects.fleet_telemetry
        ok = isinstance(event, NodeEvent) and event.node == parts[3] and name == parts[4]
    elif head[:2] == _TEL and n == 5:
        ok = (isinstance(event, RankEvent) and event.job_id == parts[2] and str(event.rank) == parts[3]
              and name == parts[4])
    elif head[:2] == _DEAD and n == 3:
        ok = isinstance(event, DeadLettered) and event.service == parts[2]
    else:
        return f"subject {subject!r} is outside the Flightdeck subject grammar"
    return "" if ok else f"a {name} (job/node/rank/service fields as sent) may not stand under {subject!r}"


_JOB, _NODE, _CLOCK = ["fd", "ctl", "job"], ["fd", "ctl", "node"], ["fd", "ctl", "clock"]
_TEL, _DEAD = ["fd", "tel"], ["fd", "dead"]


def versioned(subject: str) -> bool:
    """Whether `subject` is one of a job's numbered subjects (`fd.ctl.job.<job>.<type>`), inside its fence."""
    return subject.startswith("fd.ctl.job.") and subject.count(".") == 4


class Admission:
    """The admission rule with what it needs to remember: the newest `job_version` admitted per job. Feed it every
    control event a reader sees, in stream order (a reader of some types only sees fewer versions, never an order
    that differs)."""

    def __init__(self) -> None:
        self.versions: dict[str, int] = {}

    def refusal(self, stored: Stored) -> str:
        """Why `stored` is not folded ("" when it is admitted, and then remembered)."""
        event = stored.event
        if event is None:
            return f"undecodable: {stored.error}"
        if why := mismatch(stored.subject, event):
            return f"invalid: {why}"
        if versioned(stored.subject):
            assert isinstance(event, JobEvent)  # mismatch checked it
            newest = self.versions.get(event.job_id, 0)
            if event.job_version <= newest:
                what = "no job_version" if event.job_version < 1 else f"job_version {event.job_version}"
                return (f"invalid: a {type_name(event)} with {what} where job {event.job_id}'s history is at "
                        f"version {newest}: only an append through the job's fence numbers it (forged or replayed?)")
            self.versions[event.job_id] = event.job_version
        return ""

    def admitted(self, rows: list[Stored]) -> list[Stored]:
        """The rows this rule admits, in order."""
        return [s for s in rows if not self.refusal(s)]


def admitted_events(rows: list[Stored]) -> list[Event]:
    """The events of `rows` a fresh reader folds, in order."""
    return [s.event for s in Admission().admitted(rows) if s.event is not None]
