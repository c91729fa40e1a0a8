"""Which cores an audit re-runs, and which recorded messages are decisions about one job.

The cores are the built-in services with their default settings, whatever this machine's environment says:
the settings a live service ran with are in the log (CoreConfigured, recorded at every start), and its core
folds them as it replays. Their effects are never run: replays read the recorded outcomes.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.store import Stored
from flightdeck.services import registry
from flightdeck.services.core import Service

# Events the checkpoint service's "commit" effect records: the outcome of I/O (upload, verify), not a decision
# a core can re-derive, so replays take them as recorded inputs.
EFFECT_OUTCOMES = frozenset({"CheckpointCommitted", "CheckpointFailed"})


def cores() -> list[Service[Any]]:
    return [registry.build(name, env={}) for name in registry.BUILTIN]


def index_of(msg_id: str, service: str) -> tuple[str, int, int] | None:
    """(input stream, input seq, output index) of a shell-stamped msg id `service:stream:seq:index`, else None."""
    parts = msg_id.split(":")
    if len(parts) != 4 or parts[0] != service or not parts[2].isdigit() or not parts[3].isdigit():
        return None
    return parts[1], int(parts[2]), int(parts[3])


def job_ids(rows: Sequence[Stored]) -> set[str]:
    return {j for s in rows if s.stream == subjects.CONTROL and (j := subjects.job_of(s.subject))}


class Scope:
    """Which decisions are about `job_id`: those on its history, and fleet decisions (node subjects) when the
    history holds no other job. With other jobs present their telemetry is missing (a job's history keeps
    only its own), so fleet decisions that may rest on it cannot be re-derived here."""

    def __init__(self, job_id: str, rows: Sequence[Stored]) -> None:
        self.job_id = job_id
        self.fleet = job_ids(rows) <= {job_id}

    def covers(self, subject: str) -> bool:
        if subject.startswith("fd.ctl.node."):
            return self.fleet
        return subjects.job_of(subject) == self.job_id


def is_decision(stored: Stored, service: str) -> bool:
    """A message recorded as `service`'s output (its ticks and settings are inputs it records). Whatever its msg id:
    one that is not the shell's `service:stream:seq:index` can never be reproduced, which is the point."""
    ev: Event | None = stored.event
    return (ev is not None and ev.producer == service and stored.stream == subjects.CONTROL
            and not isinstance(ev, ClockTick | CoreConfigured))


# Services added after histories were first recorded: one that left no trace in a history (no settings, tick or
# decision of its own) did not run when it was written, and is not replayed over it.
ADDED_LATER = frozenset({"archiver"})


def unrecorded_settings(services: list[Service[Any]], control: Sequence[Stored]) -> list[Service[Any]]:
    """Each core whose settings the history never recorded (it was written before services recorded them) starts
    from the settings its services then ran with, where those differ from today's defaults (`Service.unrecorded`).
    A core of ADDED_LATER that left no trace in the history is left out."""
    recorded = {s.event.service for s in control if isinstance(s.event, CoreConfigured)}
    traced = recorded | {s.event.producer for s in control if s.event is not None}
    out: list[Service[Any]] = []
    for s in services:
        if s.name in ADDED_LATER and s.name not in traced:
            continue
        if s.unrecorded is not None and s.name not in recorded:
            initial, _ = s.transition(s.initial, CoreConfigured(service=s.name, settings=dict(s.unrecorded)))
            s = dataclasses.replace(s, initial=initial, settings=s.unrecorded)
        out.append(s)
    return out


def settings_notes(services: Sequence[Service[Any]], control: Sequence[Stored]) -> list[str]:
    """Which cores replayed with the settings they started from, for want of a recorded CoreConfigured (a history
    written before services recorded them): their defaults, not this machine's environment."""
    recorded = {s.event.service for s in control if isinstance(s.event, CoreConfigured)}
    return [f"{s.name}: no settings recorded in this history: replayed with the defaults "
            f"({', '.join(f'{k}={v}' for k, v in s.settings.items())})"
            for s in services if s.settings and s.name not in recorded]
