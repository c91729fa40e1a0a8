"""One pass over a job's history rows: rank 0's steps as columns, and the few events a postmortem reads.

Times. Telemetry carries its rank's clock (`occurred_at`). A service's decision carries its input's
`occurred_at` (the shell stamps it so replays are exact), which can be well before the decision was made:
a finding folded at the health monitor's tick bears the time of the step it judged. A control event is
therefore dated `known` = the later of its `occurred_at` and the newest recorded clock tick stored before it
in FD_CONTROL: the tick's `now` is a service's clock when it took the tick, so the event was stored after it.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from flightdeck.events import subjects
from flightdeck.events.admission import Admission
from flightdeck.events.base import Event, JobEvent, NodeEvent
from flightdeck.events.checkpoint import CheckpointRefused, CheckpointStaged
from flightdeck.events.clock import ClockTick
from flightdeck.events.job import JobSubmitted
from flightdeck.events.store import Stored
from flightdeck.events.training import FaultInjected, Heartbeat, RankFault, RankStarted, RolledBack, StepCompleted

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Control:
    """A control event of the job (or of a node), with the time it is known to have been stored by."""

    known: float
    seq: int
    event: Event


@dataclass(frozen=True)
class Steps:
    """Rank 0's StepCompleted reports as columns, in order of completion time."""

    step: Ints
    end: Floats  # occurred_at: when the step finished
    took: Floats  # step_time_s: the step's own time (a checkpoint stall or a pause before it is not in it)
    loss: Floats
    attempt: Ints

    @property
    def start(self) -> Floats:
        return self.end - self.took

    def __len__(self) -> int:
        return len(self.step)


@dataclass
class Scan:
    job_id: str
    control: list[Control] = field(default_factory=list)  # the job's control events and node events, stream order
    faults: list[FaultInjected | RankFault] = field(default_factory=list)  # drill faults (not "slow") and rank faults
    paced: list[FaultInjected] = field(default_factory=list)  # "slow" drill faults: pacing, not an incident
    rolled_back: list[RolledBack] = field(default_factory=list)
    refused: list[CheckpointRefused] = field(default_factory=list)  # rollbacks' checkpoints ranks found bad
    rank_started: list[RankStarted] = field(default_factory=list)
    staged: list[CheckpointStaged] = field(default_factory=list)
    telemetry: list[Event] = field(default_factory=list)  # every step and heartbeat, to resolve evidence ids
    counts: dict[str, int] = field(default_factory=dict)  # the job's events by type (clock ticks aside)
    ranks: set[int] = field(default_factory=set)
    ticks: int = 0
    undecodable: int = 0
    lead: Steps = field(default_factory=lambda: _columns([], [], [], [], []))

    @property
    def t0(self) -> float:
        """The job's start: its submission, else its first event."""
        submitted = [c.known for c in self.control if isinstance(c.event, JobSubmitted)]
        if submitted:
            return submitted[0]
        firsts = [c.known for c in self.control if isinstance(c.event, JobEvent)][:1]
        if len(self.lead):
            firsts.append(float(self.lead.start[0]))
        return min(firsts, default=0.0)

    @property
    def events(self) -> int:
        return sum(self.counts.values())


def _columns(step: list[int], end: list[float], took: list[float], loss: list[float], attempt: list[int]) -> Steps:
    order = np.argsort(np.asarray(end, dtype=np.float64), kind="stable")
    return Steps(step=np.asarray(step, dtype=np.int64)[order], end=np.asarray(end, dtype=np.float64)[order],
                 took=np.asarray(took, dtype=np.float64)[order], loss=np.asarray(loss, dtype=np.float64)[order],
                 attempt=np.asarray(attempt, dtype=np.int64)[order])


def scan(rows: Iterable[Stored], job_id: str) -> Scan:
    """Read `rows` once. FD_CONTROL rows must come in stream order (each stream's rows in order; the streams
    may come one after another or interleaved)."""
    out = Scan(job_id=job_id)
    counts = out.counts
    step: list[int] = []
    attempt: list[int] = []
    end: list[float] = []
    took: list[float] = []
    loss: list[float] = []
    telemetry, ranks = out.telemetry, out.ranks
    newest_tick = 0.0
    admission = Admission()
    for s in rows:
        ev = s.event
        if ev is None:
            out.undecodable += 1
            continue
        cls = ev.__class__
        if cls is StepCompleted:  # nine in ten rows: the cheapest path first
            if ev.job_id != job_id:  # type: ignore[attr-defined]
                continue
            telemetry.append(ev)
            rank = ev.rank  # type: ignore[attr-defined]
            if rank == 0:
                step.append(ev.step)  # type: ignore[attr-defined]
                end.append(ev.occurred_at)
                took.append(ev.step_time_s)  # type: ignore[attr-defined]
                loss.append(ev.loss)  # type: ignore[attr-defined]
                attempt.append(ev.attempt)  # type: ignore[attr-defined]
            elif rank not in ranks:
                ranks.add(rank)
            counts["StepCompleted"] = counts.get("StepCompleted", 0) + 1
            continue
        if cls is Heartbeat:
            if ev.job_id == job_id:  # type: ignore[attr-defined]
                telemetry.append(ev)
                counts["Heartbeat"] = counts.get("Heartbeat", 0) + 1
            continue
        if cls is ClockTick:
            out.ticks += 1
            if ev.now > newest_tick:  # type: ignore[attr-defined]
                newest_tick = ev.now  # type: ignore[attr-defined]
            continue
        if isinstance(ev, JobEvent):
            if ev.job_id != job_id:
                continue
        elif not isinstance(ev, NodeEvent):
            continue
        if s.stream == subjects.CONTROL and admission.refusal(s):  # what the services refused is no part of it
            continue
        if isinstance(ev, JobEvent):
            counts[cls.__name__] = counts.get(cls.__name__, 0) + 1
        if s.stream == subjects.CONTROL:
            out.control.append(Control(known=max(ev.occurred_at, newest_tick), seq=s.seq, event=ev))
            continue
        match ev:
            case FaultInjected(kind="slow"):
                out.paced.append(ev)
            case FaultInjected() | RankFault():
                out.faults.append(ev)
            case RolledBack():
                out.rolled_back.append(ev)
            case CheckpointRefused():
                out.refused.append(ev)
            case RankStarted():
                out.rank_started.append(ev)
                ranks.add(ev.rank)
            case CheckpointStaged():
                out.staged.append(ev)
    if step:
        ranks.add(0)
    out.lead = _columns(step, end, took, loss, attempt)
    out.faults.sort(key=lambda e: e.occurred_at)
    return out


def find(scan_: Scan, ids: Iterable[str]) -> dict[str, Event]:
    """The events with these ids among the job's control events, notable telemetry and steps/heartbeats."""
    wanted = set(ids)
    found: dict[str, Event] = {}
    if not wanted:
        return found
    for c in scan_.control:
        if c.event.event_id in wanted:
            found[c.event.event_id] = c.event
    groups: list[Sequence[Event]] = [scan_.faults, scan_.rolled_back, scan_.refused, scan_.rank_started,
                                     scan_.staged, scan_.paced]
    if wanted - found.keys():
        groups.append(scan_.telemetry)
    for group in groups:
        for e in group:
            if e.event_id in wanted:
                found[e.event_id] = e
    return found
