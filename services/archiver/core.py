"""The archiver's pure core: when each job's telemetry and output are copied to the object store, so its history
outlives the streams' age-out. It asks for a segment of each stream every `every_s` while the job runs and a
final one once it has ended; each segment's record (HistoryArchived) moves the job's position on.

Why it works this way: docs/internals.md, "9. The whole history".
"""

from collections.abc import Callable, Mapping

import msgspec

from flightdeck.events import subjects
from flightdeck.events.archive import HistoryArchived
from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.job import JobCancelled, JobCompleted, JobFailed, JobSubmitted
from flightdeck.events.store import EventStore
from flightdeck.services.core import Effect, EffectHandler, Output, Service
from flightdeck.services.shell.objects.segments import ARCHIVED

NAME = "archiver"
ARCHIVE = "archive"
CONTROL_TYPES = ("JobSubmitted", "JobCompleted", "JobFailed", "JobCancelled", "HistoryArchived")
# An ended job's ranks and agents may still be sending their last lines and steps: its final segment waits this long,
# and its read then goes on until the job's messages have stopped coming for FINAL_QUIET_S, FINAL_READ_MAX_S at most
# (service.py); a final ask is repeated only once that read must have ended (FINAL_WAIT_S), so no two overlap.
SETTLE_S = 10.0
FINAL_QUIET_S = 5.0
FINAL_READ_MAX_S = 120.0
FINAL_WAIT_S = FINAL_READ_MAX_S + 30.0


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """What the core decides with: recorded by the shell as CoreConfigured and folded from it."""

    every_s: float = 300.0  # a running job's new telemetry and output are archived at least this often
    # a final ask whose record has not come is asked again after this (at least every_s); 0 in histories recorded
    # before the final read waited for quiet: every_s then
    final_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.every_s > 0:
            raise ValueError(f"archiver settings: every_s must be positive, got {self.every_s}")


class Ask(msgspec.Struct, frozen=True, kw_only=True):
    """One segment to store: the job's messages in `stream` from `from_seq` (0: from the job's start) to the
    stream's end when it is read. `submitted_at` tells whether what had aged out may have been the job's."""

    job_id: str
    stream: str
    from_seq: int
    final: bool
    submitted_at: float


class Position(msgspec.Struct, frozen=True, kw_only=True):
    next_seq: int = 0  # the first sequence not archived yet; 0: nothing archived yet
    asked_at: float = float("-inf")
    done: bool = False  # its final segment is recorded


class Job(msgspec.Struct, frozen=True, kw_only=True):
    submitted_at: float
    ended_at: float = 0.0  # 0: running
    streams: dict[str, Position] = {}


class State(msgspec.Struct, frozen=True, kw_only=True):
    settings: Settings = Settings()
    jobs: dict[str, Job] = {}
    done: frozenset[str] = frozenset()  # jobs whose final segments are all recorded


def _position(job: Job, stream: str) -> Position:
    return job.streams.get(stream, Position())


def _with(state: State, job_id: str, job: Job) -> State:
    return msgspec.structs.replace(state, jobs={**state.jobs, job_id: job})


def _archived(state: State, ev: HistoryArchived) -> State:
    job = state.jobs.get(ev.job_id)
    if job is None:
        return state
    was = _position(job, ev.stream)
    pos = msgspec.structs.replace(was, next_seq=max(was.next_seq, ev.last_seq + 1), done=was.done or ev.final)
    job = msgspec.structs.replace(job, streams={**job.streams, ev.stream: pos})
    if all(_position(job, s).done for s in ARCHIVED):
        jobs = {k: v for k, v in state.jobs.items() if k != ev.job_id}
        return msgspec.structs.replace(state, jobs=jobs, done=state.done | {ev.job_id})
    return _with(state, ev.job_id, job)


def _due(state: State, now: float) -> tuple[State, list[Output]]:
    """A segment of each stream of each job whose last ask is `every_s` old (one in flight at a time, asked again
    if its record never came), and the final one once an ended job has settled."""
    every = state.settings.every_s
    out: list[Output] = []
    for job_id, job in sorted(state.jobs.items()):
        final = bool(job.ended_at) and now >= job.ended_at + SETTLE_S
        streams = dict(job.streams)
        again = max(every, state.settings.final_wait_s) if final else every
        for stream in ARCHIVED:
            pos = _position(job, stream)
            if pos.done or now - pos.asked_at < again or (job.ended_at and not final):
                continue
            out.append(Effect(ARCHIVE, Ask(job_id=job_id, stream=stream, from_seq=pos.next_seq, final=final,
                                           submitted_at=job.submitted_at)))
            streams[stream] = msgspec.structs.replace(pos, asked_at=now)
        if streams != job.streams:
            state = _with(state, job_id, msgspec.structs.replace(job, streams=streams))
    return state, out


def transition(state: State, ev: Event) -> tuple[State, list[Output]]:
    match ev:
        case CoreConfigured(service=service) if service == NAME:
            return msgspec.structs.replace(state, settings=msgspec.convert(ev.settings, Settings)), []
        case JobSubmitted() if ev.job_id not in state.jobs and ev.job_id not in state.done:
            new = Job(submitted_at=ev.occurred_at, streams={s: Position(asked_at=ev.occurred_at) for s in ARCHIVED})
            return _with(state, ev.job_id, new), []
        case JobCompleted() | JobFailed() | JobCancelled():
            job = state.jobs.get(ev.job_id)
            if job is None or job.ended_at:
                return state, []
            # asked at its end: the final ask comes SETTLE_S later, not an ordinary one before it
            streams = {s: msgspec.structs.replace(p, asked_at=float("-inf")) for s, p in job.streams.items()}
            return _with(state, ev.job_id, msgspec.structs.replace(job, ended_at=ev.occurred_at, streams=streams)), []
        case HistoryArchived():
            return _archived(state, ev), []
        case ClockTick(now=now):
            return _due(state, now)
    return state, []


def wants_tick(state: State, now: float) -> bool:
    return bool(state.jobs)


def core_service(effects: Mapping[str, EffectHandler], *, every_s: float = Settings().every_s, tick_s: float = 5.0,
                 bind: Callable[[EventStore], None] | None = None) -> Service[State]:
    settings = Settings(every_s=every_s, final_wait_s=FINAL_WAIT_S)
    return Service(
        name=NAME,
        initial=State(settings=settings),
        transition=transition,
        control_subjects=subjects.job_types(*CONTROL_TYPES),
        tick_s=tick_s,
        wants_tick=wants_tick,
        effects=effects,
        bind=bind,
        detached=frozenset({ARCHIVE}),  # a read of a busy stream may take a while: the inputs go on meanwhile
        settings=msgspec.structs.asdict(settings),
    )
