"""`flightdeck verify`: every core re-folds a job's recorded inputs; each recorded decision must come back.

Per service, `services.shell.fold.replay` folds the recorded inputs (clock ticks and the telemetry they recorded
included) up to the job's last event. Every output about the job must equal the recorded one with its msg id
(`services.shell.fold.comparable`), none may be missing from the history and none may be recorded that the replay
does not make. Effects are not run: the outcome a recorded effect left (CheckpointCommitted or CheckpointFailed
for a commit) must belong to an effect the replay asks for on the same input, or the effect must have been
dead-lettered live. Inputs the live shell dead-lettered must be the ones the replay refuses.
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flightdeck.events import subjects
from flightdeck.events.archive import HistoryArchived
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointFailed, CheckpointScrubbed
from flightdeck.events.clock import DeadLettered
from flightdeck.events.store import EventStore, Stored
from flightdeck.services.archiver.core import ARCHIVE, Ask
from flightdeck.services.checkpoints.core import COMMIT, SCRUB
from flightdeck.services.checkpoints.state import CommitArgs, ScrubArgs
from flightdeck.services.core import Effect, Service
from flightdeck.services.shell.deadletter import FOLDED_ANYWAY, GIVEN_UP
from flightdeck.services.shell.fold import Folder, Step, comparable, recorded_fields, replay, same_decision
from flightdeck.services.tools.audit import cores
from flightdeck.services.tools.audit.cores import settings_notes, unrecorded_settings
from flightdeck.services.tools.audit.diff import field_diff
from flightdeck.services.tools.audit.resume import Resume

# a service's live dead letters: (input stream, input seq, cause) -> the input's subject
Letters = dict[tuple[str, int, str], str]


class NoSuchJob(LookupError):
    """The store holds no control event of the job."""


@dataclass(frozen=True, slots=True)
class Divergence:
    """One place where the replay and the history disagree. `position` is the FD_CONTROL sequence at which the
    replay folded `input` (telemetry is folded at the tick that recorded it), which orders divergences."""

    service: str
    kind: str  # "differs", "not recorded", "not reproduced", "effect", "dead letter"
    position: int
    input: Stored | None
    msg_id: str = ""
    recorded: Event | None = None
    replayed: Event | None = None
    detail: str = ""
    held: frozenset[str] | None = None  # the fields the recorded copy holds (fold.recorded_fields)

    def fields(self) -> list[tuple[str, Any, Any]]:
        """(field, recorded, replayed) for every field that differs."""
        if self.recorded is None or self.replayed is None:
            return []
        return field_diff(comparable(self.recorded, self.held), comparable(self.replayed, self.held))


@dataclass(slots=True)
class ServiceCheck:
    service: str
    control_inputs: int = 0
    telemetry_inputs: int = 0
    decisions: int = 0  # recorded decisions about the job reproduced exactly
    effects: int = 0  # effects about the job whose recorded outcome was checked
    skipped: int = 0  # inputs the server gave up on live, skipped as the live service did
    dead_live: set[tuple[str, int]] = field(default_factory=set)
    dead_replay: set[tuple[str, int]] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Verdict:
    job_id: str
    horizon: int  # FD_CONTROL sequence of the job's last event: inputs after it are not folded
    checks: list[ServiceCheck]
    divergences: list[Divergence]  # in the order the replay met them
    notes: list[str]
    folders: dict[str, Folder[Any]] = field(default_factory=dict)  # each core's state at the horizon
    resumed_from: int = 0  # the horizon of the clean verify this one went on from (audit/resume.py); 0: none
    fleet: bool = True  # whether fleet decisions were checked

    @property
    def ok(self) -> bool:
        return not self.divergences


@dataclass(frozen=True, slots=True)
class History:
    """What verify reads once: control up to the horizon, the job's telemetry, the dead letters."""

    job_id: str
    horizon: int
    control: list[Stored]
    telemetry: list[Stored]
    dead: list[Stored]

    def find(self, stream: str, seq: int) -> Stored | None:
        rows = self.control if stream == subjects.CONTROL else self.telemetry
        return next((s for s in rows if s.seq == seq), None)


async def read_history(store: EventStore, job_id: str, checked: int = 0) -> History:
    """`checked`: the horizon of a clean verify this one goes on from (the store may hold only what came after it,
    and nothing of the job)."""
    last = await store.last(subjects.CONTROL, subjects.job_all(job_id))
    if last is None and not checked:
        raise NoSuchJob(job_id)
    horizon = max(last.seq if last is not None else 0, checked)
    out: dict[str, list[Stored]] = {subjects.CONTROL: [], subjects.TELEMETRY: [], subjects.DEAD: []}
    for stream, filters, until in ((subjects.CONTROL, [], horizon),
                                   (subjects.TELEMETRY, [subjects.telemetry_job(job_id)], 0),
                                   (subjects.DEAD, [], 0)):
        async for batch in store.read(stream, filters, until_seq=until):
            out[stream] += batch
    return History(job_id, horizon, out[subjects.CONTROL], out[subjects.TELEMETRY], out[subjects.DEAD])


async def verify(store: EventStore, job_id: str, services: Sequence[Service[Any]] | None = None, *,
                 resume: Resume | None = None) -> Verdict:
    """Re-fold `job_id`'s recorded inputs through `services` (default: every audited core) and compare. With
    `resume` (a clean verify's mark: audit/resume.py), each core goes on from the state it reached there, and only
    the decisions of later inputs are checked; `store` then needs to hold only what came after it."""
    history = await read_history(store, job_id, resume.mark.horizon if resume is not None else 0)
    scope = cores.Scope(job_id, history.control)
    checks: list[ServiceCheck] = []
    found: list[Divergence] = []
    folders: dict[str, Folder[Any]] = {}
    if resume is not None:  # the cores that verify ran, their recorded settings folded into their states
        scope.fleet = scope.fleet and resume.mark.fleet
        chosen = [folder.service for folder in resume.folders.values()]
    else:
        chosen = unrecorded_settings(list(services) if services is not None else cores.cores(), history.control)
    for service in chosen:
        folder = resume.folders[service.name] if resume is not None else Folder(service)
        after = (folder.control_seq, folder.telemetry_seq)
        steps = [s async for s in _positioned(replay(service, store, until=history.horizon, folder=folder))]
        check, divergences = _compare(service.name, steps, history, scope, after,
                                      resume.mark.horizon if resume is not None else 0)
        if resume is not None:
            _add_earlier(check, resume, service.name)
        checks.append(check)
        folders[service.name] = folder
        found += divergences
    notes = [
        "checkpoints: its decisions (retention deletes, which sets to commit) are re-derived; whether an upload "
        "succeeded is I/O, so each recorded commit outcome is checked against the commit the replay asks for",
        "node agents: not re-derived; their cores only ask for I/O (spawn, stop), and the WorkersStarted / "
        "WorkersExited they record are inputs to every other core",
    ]
    notes += settings_notes(chosen, history.control)
    if not scope.fleet:
        notes.append("fleet decisions (node subjects) not checked: the history holds other jobs, whose telemetry "
                     "a job's history does not keep")
    if resume is not None:
        notes.append(f"resumed from the clean verify up to FD_CONTROL seq {resume.mark.horizon}: decisions of inputs "
                     "up to it were re-derived then, those after it now (--full re-derives all)")
    found.sort(key=lambda d: d.position)  # stable: within one input, the service order and output order stay
    return Verdict(job_id, history.horizon, checks, found, notes, folders,
                   resume.mark.horizon if resume is not None else 0, scope.fleet)


def _add_earlier(check: ServiceCheck, resume: Resume, name: str) -> None:
    """What the verify the mark records checked, added to what this one did."""
    earlier = next(c for c in resume.mark.cores if c.service == name)
    check.control_inputs += earlier.control_inputs
    check.telemetry_inputs += earlier.telemetry_inputs
    check.decisions += earlier.decisions
    check.effects += earlier.effects


def _unchecked(s: Stored, name: str, after: tuple[int, int], checked: int) -> bool:
    where = cores.index_of(s.msg_id, name)
    if where is None or _later(where[0], where[1], after):
        return True
    return s.seq > checked and not isinstance(s.event, CheckpointScrubbed | HistoryArchived)


def _later(stream: str, seq: int, after: tuple[int, int]) -> bool:
    """Whether an input is past the state a fold started from (FD_CONTROL, FD_TELEMETRY positions)."""
    return seq > (after[0] if stream == subjects.CONTROL else after[1])


async def _positioned(steps: Any) -> Any:
    """(position, step): telemetry steps come before the tick that folds them and take its sequence."""
    pending: list[Step] = []
    async for step in steps:
        if step.input.stream == subjects.CONTROL:
            for t in pending:
                yield step.input.seq, t
            pending = []
            yield step.input.seq, step
        else:
            pending.append(step)


def _compare(name: str, steps: list[tuple[int, Step]], history: History, scope: cores.Scope,
             after: tuple[int, int] = (0, 0), checked: int = 0) -> tuple[ServiceCheck, list[Divergence]]:
    """`after`: the positions the fold started from; `checked`: the horizon of the clean verify it went on from.
    The decisions of inputs up to `after` it checked (recorded by `checked`, or it would not have been clean); one
    recorded since for such an input is not reproduced, unless a detached effect's outcome, which may come late."""
    check = ServiceCheck(name)
    recorded = {s.msg_id: s for s in history.control if cores.is_decision(s, name) and scope.covers(s.subject)
                and _unchecked(s, name, after, checked)}
    by_input: dict[tuple[str, int], list[tuple[int, Stored]]] = defaultdict(list)
    for s in recorded.values():
        if (where := cores.index_of(s.msg_id, name)) is not None:
            by_input[where[:2]].append((where[2], s))
    letters = {k: v for k, v in _letters(name, history).items() if _later(k[0], k[1], after)}
    folded_at: dict[tuple[str, int], int] = {}
    out: list[Divergence] = []
    for pos, step in steps:
        inp = step.input
        key = (inp.stream, inp.seq)
        folded_at[key] = pos
        if inp.stream == subjects.CONTROL:
            check.control_inputs += 1
        else:
            check.telemetry_inputs += 1
        if step.error and _relevant(inp.subject, scope):
            check.dead_replay.add(key)
        for o in step.outputs:
            if not scope.covers(o.subject):
                continue
            rec = recorded.pop(o.msg_id, None)
            if rec is None:
                out.append(Divergence(name, "not recorded", pos, inp, o.msg_id, replayed=o.event,
                                      detail="the replay decides this; the history does not hold it"))
            elif rec.subject != o.subject or rec.event is None or not same_decision(rec, o.event):
                out.append(Divergence(name, "differs", pos, inp, o.msg_id, rec.event, o.event,
                                      detail=f"recorded at seq {rec.seq} under {rec.subject}",
                                      held=recorded_fields(rec)))
            else:
                check.decisions += 1
        outcomes = sorted((i, s) for i, s in by_input.get(key, []) if i >= len(step.outputs) and s.msg_id in recorded)
        out += _effects(name, pos, step, [s for _, s in outcomes], letters, recorded, check, scope)
    for mid, rec in recorded.items():
        where = cores.index_of(mid, name)
        cause = history.find(where[0], where[1]) if where else None
        pos = folded_at.get(where[:2], rec.seq) if where else rec.seq
        why = "" if where else " (its msg id is not one the shell stamps)"
        if where and not _later(where[0], where[1], after):
            why = f" (for an input the clean verify up to seq {checked} covered: its decisions were all recorded then)"
        out.append(Divergence(name, "not reproduced", pos, cause, mid, recorded=rec.event,
                              detail=f"recorded at seq {rec.seq}; the replay does not decide it{why}"))
    check.dead_live = {(st, sq) for (st, sq, cause), subject in letters.items()
                       if cause == "input" and _relevant(subject, scope)}
    check.skipped = sum(1 for (_, _, cause) in letters if cause in (GIVEN_UP, FOLDED_ANYWAY))
    for stream, seq in sorted(check.dead_live ^ check.dead_replay, key=lambda k: folded_at.get(k, k[1])):
        live = (stream, seq) in check.dead_live
        out.append(Divergence(name, "dead letter", folded_at.get((stream, seq), seq), history.find(stream, seq),
                              detail="dead-lettered live, folded by the replay" if live
                              else "folded live, refused by the replay"))
    return check, out


def _effects(name: str, pos: int, step: Step, outcomes: list[Stored], letters: Letters,
             recorded: dict[str, Stored], check: ServiceCheck, scope: cores.Scope) -> list[Divergence]:
    """Each effect about the job must have left its recorded outcome (or a dead letter saying it failed)."""
    out: list[Divergence] = []
    inp = step.input
    pending = list(outcomes)
    for n, effect in enumerate(step.effects):
        job = getattr(effect.args, "job_id", scope.job_id)
        if job != scope.job_id:
            continue
        if (inp.stream, inp.seq, f"effect{n}") in letters or not _leaves_outcome(effect):
            check.effects += 1
            continue
        if effect.kind in DETACHED:  # an outcome it may never have left (a crash cut the run short)
            found = next((s for s in pending if _outcome_of(effect, s.event)), None)
            if found is not None:
                pending.remove(found)
                recorded.pop(found.msg_id)
            check.effects += 1
            continue
        got = pending.pop(0) if pending else None
        if got is not None and _outcome_of(effect, got.event):
            recorded.pop(got.msg_id)
            check.effects += 1
            continue
        if got is not None:
            recorded.pop(got.msg_id)
        out.append(Divergence(name, "effect", pos, inp, got.msg_id if got else "", got.event if got else None,
                              detail=f"the replay asks for {_describe(effect)}; recorded outcome: "
                              + (f"{type(got.event).__name__} {getattr(got.event, 'checkpoint_id', '')}" if got
                                 else "none")))
    return out


def _leaves_outcome(effect: Effect) -> bool:
    return effect.kind in (COMMIT, SCRUB, ARCHIVE)  # a delete records nothing when it works


DETACHED = (SCRUB, ARCHIVE)  # an archive with nothing new to store records nothing either


def _outcome_of(effect: Effect, event: Event | None) -> bool:
    args = effect.args
    if isinstance(args, ScrubArgs):
        return isinstance(event, CheckpointScrubbed) and event.checkpoint_id == args.checkpoint_id
    if isinstance(args, Ask):
        return isinstance(event, HistoryArchived) and (event.stream, event.first_seq, event.final) == \
            (args.stream, max(args.from_seq, 1), args.final)
    if not isinstance(args, CommitArgs):
        return False
    if isinstance(event, CheckpointCommitted):
        return event.checkpoint_id == args.checkpoint_id and event.step == args.step
    return isinstance(event, CheckpointFailed) and event.step == args.step


def _describe(effect: Effect) -> str:
    cid = getattr(effect.args, "checkpoint_id", "")
    return f"effect {effect.kind!r}" + (f" of {cid}" if cid else "")


def _letters(name: str, history: History) -> Letters:
    """The service's live dead letters: (input stream, input seq, cause) -> the input's subject. The cause is
    "input" (refused), "effect<n>" (its n-th effect failed) or the server giving up on it (deadletter.py)."""
    out: Letters = {}
    for s in history.dead:
        ev = s.event
        if not isinstance(ev, DeadLettered) or ev.service != name:
            continue
        cause = ev.event_id.rsplit(":", 1)[-1]
        if ev.stream == subjects.CONTROL and ev.seq > history.horizon:
            continue
        out[(ev.stream, ev.seq, cause)] = ev.subject
    return out


def _relevant(subject: str, scope: cores.Scope) -> bool:
    return scope.covers(subject) or subjects.job_of(subject) == scope.job_id
