"""Where a replay stops: `--until SEQ|TIME`, resolved against a history into a control-stream cut.

    --until 57                    FD_CONTROL stream sequence 57 (as `flightdeck events` and `replay` print)
    --until 90s / 2m / 1h30m / 1.5h   that long after the job was submitted
    --until 2026-05-01T12:00:00Z  an ISO timestamp (without a zone: UTC)

Telemetry is cut where the control stream says: at a sequence, up to the newest telemetry position a
recorded ClockTick at or before it holds (the interleaving the services themselves folded); at a time,
by the events' own times.
"""

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from flightdeck.events import subjects
from flightdeck.events.clock import ClockTick
from flightdeck.events.job import JobSubmitted
from flightdeck.events.store import Stored
from flightdeck.services.tools.history.library import History

_DURATION = re.compile(r"^(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m)?(?:(?P<s>\d+(?:\.\d+)?)s)?$")


class BadUntil(ValueError):
    """An --until that is neither a sequence, a duration nor a timestamp."""


@dataclass(frozen=True, slots=True)
class Until:
    """What the user asked for: exactly one of a stream sequence, seconds after submission, or a time."""

    seq: int | None = None
    after_s: float | None = None
    at: float | None = None


@dataclass(frozen=True, slots=True)
class Cut:
    """A resolved stop: control rows with seq <= `control_seq`, telemetry rows with seq <= `telemetry_seq`,
    `at` the time of the cut (None: the whole history)."""

    control_seq: int
    telemetry_seq: int
    at: float | None


def parse_until(text: str) -> Until:
    text = text.strip()
    if text.isdigit():
        return Until(seq=int(text))
    match = _DURATION.match(text)
    if match and any(match.groupdict().values()):
        parts = {k: float(v) for k, v in match.groupdict().items() if v}
        return Until(after_s=parts.get("h", 0.0) * 3600 + parts.get("m", 0.0) * 60 + parts.get("s", 0.0))
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise BadUntil(f"--until {text!r}: give a stream sequence (57), a time after submission (90s, 2m, 1h30m) "
                       "or an ISO timestamp (2026-05-01T12:00:00Z)") from None
    return Until(at=(when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp())


def submitted_at(history: History) -> float:
    """When the job was submitted (else its first recorded event's time)."""
    control = history.job_control()
    for s in control:
        if isinstance(s.event, JobSubmitted):
            return s.event.occurred_at
    return next((s.event.occurred_at for s in control if s.event is not None), 0.0)


def tick_position(rows: list[Stored], control_seq: int) -> int:
    """The newest telemetry position any recorded ClockTick at or before `control_seq` holds."""
    position = 0
    for s in rows:
        if s.seq > control_seq:
            break
        if isinstance(s.event, ClockTick):
            position = max(position, s.event.positions.get(subjects.TELEMETRY, 0))
    return position


def resolve(history: History, until: Until | None) -> Cut:
    control = history.stream(subjects.CONTROL)
    telemetry = history.stream(subjects.TELEMETRY)
    last_control = control[-1].seq if control else 0
    last_telemetry = telemetry[-1].seq if telemetry else 0
    if until is None:
        return Cut(last_control, last_telemetry, None)
    if until.seq is not None:
        seq = min(until.seq, last_control)
        at = max((s.event.occurred_at for s in control if s.seq <= seq and s.event is not None), default=None)
        return Cut(seq, tick_position(control, seq), at)
    at = submitted_at(history) + until.after_s if until.after_s is not None else until.at
    assert at is not None
    # Decisions carry their input's time, so times are not sorted in a stream: stop before the first event
    # that happened after the cut, keeping the stream a prefix (a replay folds prefixes).
    return Cut(_prefix(control, at), _prefix(telemetry, at), at)


def _prefix(rows: list[Stored], at: float) -> int:
    seq = 0
    for s in rows:
        if s.event is not None and s.event.occurred_at > at:
            break
        seq = s.seq
    return seq
