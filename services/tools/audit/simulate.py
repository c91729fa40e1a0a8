"""All audited cores folded together over a job's recorded inputs, their decisions about the job fed back.

Why it works this way: docs/internals.md, "8. Operator tools".
"""

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from flightdeck.events import codec, subjects
from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick, DeadLettered
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.job import JobSubmitted, WorkersStarted
from flightdeck.events.spec import JobSpec
from flightdeck.events.store import Stored
from flightdeck.events.training import RolledBack
from flightdeck.services.core import Service
from flightdeck.services.shell.deadletter import GIVEN_UP
from flightdeck.services.shell.fold import Folder, comparable, recorded_fields, same_decision
from flightdeck.services.tools.audit import cores
from flightdeck.services.tools.audit.diff import field_diff

Position = tuple[int, int, int]  # (recorded FD_CONTROL seq, depth of new decisions after it, order)


@dataclass(frozen=True, slots=True)
class Change:
    """A decision about the job that the simulation makes differently: "vanishes", "appears" or "differs"."""

    kind: str
    service: str
    position: Position
    trigger: Stored | None  # the input it was (or would have been) decided on
    recorded: Stored | None = None
    simulated: Event | None = None

    @property
    def event(self) -> Event:
        chosen = self.simulated if self.simulated is not None else self.recorded.event if self.recorded else None
        assert chosen is not None
        return chosen

    def fields(self) -> list[tuple[str, Any, Any]]:
        if self.kind != "differs" or self.recorded is None or self.recorded.event is None or self.simulated is None:
            return []
        held = recorded_fields(self.recorded)
        return field_diff(comparable(self.recorded.event, held), comparable(self.simulated, held))


# A decision's fields that say under which settings it was made, not what it decided: a finding's threshold and its
# score against it, a reason's words (which quote them).
RESTATED = frozenset({"threshold", "score", "reason"})


@dataclass(slots=True)
class Outcome:
    job_id: str
    changes: list[Change] = field(default_factory=list)
    kept: int = 0  # decisions about the job made exactly as recorded
    # decisions made as recorded but for the words that restate the settings they were made under (RESTATED): the
    # same decision, not a change ("decisions that change" once listed a rollback that differed in its threshold)
    restated: list[Change] = field(default_factory=list)
    dropped: list[Stored] = field(default_factory=list)  # recorded inputs that follow from a gone event
    timeline: list[Stored] = field(default_factory=list)  # the job's control history as simulated, in order


class Simulation:
    def __init__(self, job_id: str, rows: Sequence[Stored], spec: JobSpec | None,
                 services: Sequence[Service[Any]] | None = None) -> None:
        self.job_id = job_id
        self.control = [s for s in rows if s.stream == subjects.CONTROL]
        # a history written before its services recorded their settings replays with the settings they ran with
        self.services = list(services) if services is not None else cores.unrecorded_settings(cores.cores(),
                                                                                               self.control)
        self.folders = {s.name: Folder(s) for s in self.services}
        last = max((s.seq for s in self.control if subjects.job_of(s.subject) == job_id), default=0)
        self.horizon = last
        self.telemetry = [s for s in rows if s.stream == subjects.TELEMETRY]
        self.tel_rows = {sv.name: [t for t in self.telemetry if any(subjects.matches(p, t.subject)
                                                                    for p in sv.telemetry_subjects)]
                         for sv in self.services}
        self.tel_next = dict.fromkeys(self.tel_rows, 0)
        self.given_up = _given_up(rows)
        self.spec = spec
        self.managed = {s.event.event_id: s for s in self.control if self._managed(s) and s.event is not None}
        self.pending = {s.msg_id: s for s in self.managed.values()}  # recorded decisions not yet decided again
        self.placed: set[str] = set()
        self.gone_ids: set[str] = set()
        self.gone_attempts: set[int] = set()
        self.gone_rollbacks: set[tuple[str, int, int, int]] = set()
        self.out = Outcome(job_id)
        self.queue: list[tuple[Position, int, Stored]] = []
        self.order = 0
        self.sim_seq = 0
        self.new_ids = 0

    def _managed(self, s: Stored) -> bool:
        """A decision about the job that a simulated core makes (and so must make again to stand)."""
        ev = s.event
        return (ev is not None and ev.producer in self.folders and not isinstance(ev, ClockTick)
                and type(ev).__name__ not in cores.EFFECT_OUTCOMES and subjects.job_of(s.subject) == self.job_id)

    def _push(self, pos: Position, stored: Stored) -> None:
        self.order += 1
        heapq.heappush(self.queue, (pos, self.order, stored))

    def run(self) -> Outcome:
        for s in self.control:
            if s.seq <= self.horizon and not self._managed(s):
                self._push((s.seq, 0, 0), self._rewritten(s))
        while self.queue:
            pos, _, stored = heapq.heappop(self.queue)
            self._feed(pos, stored)
        for rec in self.pending.values():  # their cause never came (it is gone): so are they
            cause = _cause(rec, self.control, self.telemetry)
            self._vanish(rec, (rec.seq, 0, 0), cause)
        self.out.changes.sort(key=lambda c: c.position)
        return self.out

    def _rewritten(self, s: Stored) -> Stored:
        """The job's JobSubmitted carries the changed spec; everything else as recorded."""
        ev = s.event
        if self.spec is None or not isinstance(ev, JobSubmitted) or ev.job_id != self.job_id:
            return s
        changed = msgspec.structs.replace(ev, spec=self.spec)
        return Stored(s.stream, s.seq, s.subject, codec.encode(changed), s.msg_id, changed)

    def _gone(self, ev: Event | None) -> bool:
        if ev is None or getattr(ev, "job_id", None) != self.job_id:
            return False
        cause = self.managed.get(ev.causation_id)
        if ev.causation_id in self.gone_ids or (cause is not None and ev.causation_id not in self.placed):
            return True
        if isinstance(ev, RolledBack) and _rollback_key(ev) in self.gone_rollbacks:
            return True
        attempt = getattr(ev, "attempt", None)
        return isinstance(attempt, int) and attempt in self.gone_attempts and not isinstance(ev, WorkersStarted)

    def _feed(self, pos: Position, stored: Stored) -> None:
        ev = stored.event
        recorded = pos[1] == 0
        if recorded and not self._managed(stored) and self._gone(ev):
            assert ev is not None
            self.gone_ids.add(ev.event_id)
            if isinstance(ev, WorkersStarted):
                self.gone_attempts.add(ev.attempt)
            self.out.dropped.append(stored)
            return
        if subjects.job_of(stored.subject) == self.job_id:
            self.out.timeline.append(stored)
        self.sim_seq += 1
        fed = Stored(stored.stream, self.sim_seq, stored.subject, stored.data, stored.msg_id, stored.event)
        for service in self.services:
            folder = self.folders[service.name]
            if stored.seq in self.given_up.get(service.name, ()) and recorded:
                continue
            if not any(subjects.matches(p, stored.subject) for p in (*service.control_subjects, folder.clock_subject)):
                continue
            position = folder.tick_position(fed)
            due = self._due(service, folder, position) if position is not None else []
            for step in folder.apply(fed, due):
                self._decided(service.name, pos, stored if step.input is fed else step.input, step.outputs, recorded)

    def _due(self, service: Service[Any], folder: Folder[Any], position: int) -> list[Stored]:
        """The service's telemetry up to the tick's recorded position, less what followed from a gone event."""
        rows, start = self.tel_rows[service.name], self.tel_next[service.name]
        end = start
        while end < len(rows) and rows[end].seq <= position:
            end += 1
        self.tel_next[service.name] = end
        due = []
        for t in rows[start:end]:
            if t.seq <= folder.telemetry_seq:
                continue
            if self._gone(t.event):
                assert t.event is not None
                if t.event.event_id not in self.gone_ids:
                    self.gone_ids.add(t.event.event_id)
                    self.out.dropped.append(t)
                continue
            due.append(t)
        return due

    def _decided(self, name: str, pos: Position, cause: Stored, outputs: Sequence[Any], recorded_cause: bool) -> None:
        known = recorded_cause or cause.stream == subjects.TELEMETRY
        for i, o in enumerate(outputs):
            if subjects.job_of(o.subject) != self.job_id:
                continue  # other jobs and the fleet are taken as recorded
            if known:
                mid = f"{name}:{cause.stream}:{cause.seq}:{i}"
            else:
                self.new_ids += 1
                mid = f"{name}:whatif:{self.new_ids}:{i}"
            rec = self.pending.pop(mid, None) if known else None
            event = msgspec.structs.replace(o.event, event_id=mid, causation_id=cause.event.event_id
                                            if cause.event is not None else "")
            if rec is not None and rec.event is not None:
                event = msgspec.structs.replace(event, job_version=getattr(rec.event, "job_version", 0))
                at = max((rec.seq, 0, 0), (pos[0], pos[1] + 1, 0))
                same = rec.subject == o.subject and same_decision(rec, event)
                if same:
                    self.out.kept += 1
                    self._place(at, rec)
                    continue
                if type(rec.event) is type(event):
                    change = Change("differs", name, pos, cause, rec, event)
                    restates = {f for f, _, _ in change.fields()} <= RESTATED
                    (self.out.restated if restates else self.out.changes).append(change)
                else:  # another decision under the same output index: one gone, another made
                    self.out.changes.append(Change("vanishes", name, pos, cause, rec, None))
                    self.out.changes.append(Change("appears", name, pos, cause, None, event))
                self._place(at, Stored(rec.stream, rec.seq, o.subject, codec.encode(event), mid, event))
            else:
                self.out.changes.append(Change("appears", name, pos, cause, None, event))
                self._place((pos[0], pos[1] + 1, i), Stored(subjects.CONTROL, pos[0], o.subject,
                                                            codec.encode(event), mid, event))
        if known:
            prefix = f"{name}:{cause.stream}:{cause.seq}:"
            for mid in [m for m in self.pending if m.startswith(prefix)]:
                self._vanish(self.pending.pop(mid), pos, cause)

    def _place(self, pos: Position, stored: Stored) -> None:
        assert stored.event is not None
        self.placed.add(stored.event.event_id)
        self._push(pos, stored)

    def _vanish(self, rec: Stored, pos: Position, cause: Stored | None) -> None:
        ev = rec.event
        assert ev is not None
        self.gone_ids.add(ev.event_id)
        if isinstance(ev, RollbackRequested):
            self.gone_rollbacks.add(_rollback_key(ev))
        self.out.changes.append(Change("vanishes", ev.producer, pos, cause, rec, None))
        # what was decided on it can no longer be: gone with it, now, so inputs that followed from them go too
        for mid in [m for m, r in self.pending.items() if r.event is not None and r.event.causation_id == ev.event_id]:
            self._vanish(self.pending.pop(mid), pos, rec)


def simulate(job_id: str, rows: Sequence[Stored], spec: JobSpec | None = None,
             services: Sequence[Service[Any]] | None = None) -> Outcome:
    """Fold `rows` (a job's history) through every audited core together, the job's spec replaced by `spec`."""
    return Simulation(job_id, rows, spec, services).run()


def submitted_spec(rows: Sequence[Stored], job_id: str) -> JobSpec:
    for s in rows:
        if isinstance(s.event, JobSubmitted) and s.event.job_id == job_id:
            return s.event.spec
    raise LookupError(f"the history holds no JobSubmitted of {job_id}")


def _rollback_key(ev: RollbackRequested | RolledBack) -> tuple[str, int, int, int]:
    """What a rank's RolledBack repeats of the RollbackRequested it carried out."""
    return ev.checkpoint_id, ev.to_step, ev.skip_from, ev.skip_to


def _given_up(rows: Sequence[Stored]) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for s in rows:
        ev = s.event
        if isinstance(ev, DeadLettered) and ev.stream == subjects.CONTROL and ev.event_id.endswith(f":{GIVEN_UP}"):
            out.setdefault(ev.service, set()).add(ev.seq)
    return out


def _cause(rec: Stored, control: Sequence[Stored], telemetry: Sequence[Stored]) -> Stored | None:
    where = cores.index_of(rec.msg_id, rec.event.producer if rec.event is not None else "")
    if where is None:
        return None
    rows = control if where[0] == subjects.CONTROL else telemetry
    return next((s for s in rows if s.seq == where[1]), None)
