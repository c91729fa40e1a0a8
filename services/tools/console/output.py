"""How the CLI shows stored events: one human line each, or one JSON object per line."""

import json
from typing import Any

from flightdeck.events import codec
from flightdeck.events.store import Stored

# Envelope fields every event has; a human line leaves them out (`--json` keeps them).
_ENVELOPE = frozenset({"type", "event_id", "occurred_at", "causation_id", "producer", "schema_version",
                       "job_id", "job_version"})
_STREAM_TAGS = {"FD_CONTROL": "ctl", "FD_TELEMETRY": "tel", "FD_DEAD": "dead"}
MAX_VALUE_CHARS = 80


def json_line(stored: Stored) -> str:
    """`seq`, `stream`, `subject`, then the event's own fields (`type` and `occurred_at` among them); an event's
    field of one of those three names comes as `event_<name>` (HistoryArchived's `stream`, the stream it archived,
    had replaced the stream it is stored in)."""
    head: dict[str, Any] = {"seq": stored.seq, "stream": stored.stream, "subject": stored.subject}
    if stored.event is None:
        body: dict[str, Any] = {"type": None, "occurred_at": None, "error": stored.error}
    else:
        body = codec.to_builtins(stored.event)
    return codec.to_json({**head, **{f"event_{k}" if k in head else k: v for k, v in body.items()}}).decode()


def human_line(stored: Stored, base: float, *, show_stream: bool = False, show_job: bool = False) -> str:
    """`seq  +relative-time  Type  key=value ...`; `base` is the time the first line is measured from."""
    seq = f"{_STREAM_TAGS.get(stored.stream, stored.stream)} {stored.seq:>5}" if show_stream else f"{stored.seq:>6}"
    event = stored.event
    if event is None:
        return f"{seq}  {'?':>10}  {'<undecodable>':<22} {stored.subject}: {stored.error}"
    fields = codec.to_builtins(event)
    keys = [k for k in fields if k not in _ENVELOPE and fields[k] not in ("", [], {})]
    if show_job and "job_id" in fields:
        keys.insert(0, "job_id")
    text = " ".join(f"{k}={_value(fields[k])}" for k in keys)
    return f"{seq}  {relative(event.occurred_at - base):>10}  {fields['type']:<22} {text}".rstrip()


def relative(seconds: float) -> str:
    if seconds < 0:
        return f"-{relative(-seconds)[1:]}"
    if seconds < 100:
        return f"+{seconds:.3f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"+{hours}:{minutes:02}:{secs:02}" if hours else f"+{minutes}m{secs:02}s"


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, str) and value and not any(c.isspace() for c in value) and '"' not in value:
        return value
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"
