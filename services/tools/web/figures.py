"""What `/metrics` reports, folded from the event log: `Figures.fold(stored)` takes every stored message of the
control, telemetry and dead-letter streams in each stream's order; no I/O here (server.py reads, metrics.py renders).

Per job: its view (services/tools/history/jobview.py, what `flightdeck status` shows), rank 0's step rate, tokens
and loss, and its checkpoints' stalls and uploads. Incidents, their detect and recover times and goodput come from
`postmortem`'s own analysis of the job's history (`JobAnalysis`, set by the server), so they agree with it exactly.
Per service: decisions stored and messages dead-lettered. Per node: slots, and whether it is up and cordoned.
"""

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from flightdeck.events import subjects
from flightdeck.events.admission import Admission
from flightdeck.events.base import JobEvent, NodeEvent
from flightdeck.events.checkpoint import CheckpointStaged, ShardsUploaded
from flightdeck.events.clock import DeadLettered
from flightdeck.events.fleet import AgentAlive, NodeCordoned, NodeHeartbeat, NodeLost, NodeRegistered, NodeUncordoned
from flightdeck.events.heartbeats import RankHeartbeats
from flightdeck.events.job import JobSubmitted, SlotRef
from flightdeck.events.logs import RankOutput
from flightdeck.events.plan import ParallelPlan
from flightdeck.events.spec import JobSpec
from flightdeck.events.store import Stored
from flightdeck.events.training import StepCompleted
from flightdeck.services.tools.history import jobview
from flightdeck.services.tools.history.jobview import JobView
from flightdeck.services.tools.postmortem.describe import describe

KEEP_ENDED = 500  # ended jobs whose series stay exported (the oldest go first): a scrape stays bounded
CURVE_POINTS = 1024  # a job's loss and step-time curve is thinned to at most twice this many points
DECISIONS_KEPT = 200  # a job's newest control events the page lists
LOG_LINES_KEPT = 200  # a job's newest output lines the page shows


Point = tuple[int, float, float, dict[str, float]]  # step, loss, step time, the script's own metrics


class Curve:
    """Rank 0's (step, loss, step time, custom metrics) as it arrives, thinned on the server so a page's update stays
    small at any length or world size: every `stride`-th point is kept, and the stride doubles whenever twice
    CURVE_POINTS are held. The newest point is always shown."""

    def __init__(self) -> None:
        self.points: list[Point] = []
        self.stride, self.seen = 1, 0
        self.last: Point | None = None
        self.names: set[str] = set()  # every custom metric seen: the page plots each

    def add(self, step: int, loss: float, step_time_s: float, metrics: dict[str, float] | None = None) -> None:
        point = (step, loss, step_time_s, metrics or {})
        self.names.update(point[3])
        self.last = point
        if self.seen % self.stride == 0:
            self.points.append(point)
            if len(self.points) >= 2 * CURVE_POINTS:
                self.points = self.points[::2]
                self.stride *= 2
        self.seen += 1

    def shown(self) -> list[Point]:
        if self.last is not None and (not self.points or self.points[-1] != self.last):
            return [*self.points, self.last]
        return list(self.points)


@dataclass(frozen=True)
class IncidentRow:
    """One incident as the page lists it (postmortem's Incident; its times are seconds from the job's start)."""

    number: int
    kind: str
    trigger: str
    attempt: int
    fault_s: float
    detect_s: float  # fault to finding
    recover_s: float | None  # fault to the first step after resuming; None: not (yet)
    decision: str
    resolution: str
    diagnosis: str = ""  # a loss spike's cause as the health monitor judged it; "" for other incidents
    steps_redone: int = 0  # steps computed again because of it (postmortem's figure)
    # its evidence: (seconds from the job's start, event type, what it says) of each event of its causal chain
    evidence: tuple[tuple[float, str, str], ...] = ()


@dataclass(frozen=True)
class JobAnalysis:
    """The figures `flightdeck postmortem` computes for a job, as of its history's `control_seq`/`telemetry_seq`."""

    goodput: float  # useful training over wall time, 0..1
    parts: dict[str, float]  # the wall time split: useful, detection, restart, ... (seconds)
    control_seq: int
    telemetry_seq: int
    rows: tuple[IncidentRow, ...] = ()  # postmortem's incidents, in order
    commits: tuple[float, ...] = ()  # per committed checkpoint: its last rank's staging to the commit, stored


@dataclass
class JobFigures:
    view: JobView
    steps: int = 0  # rank 0's step completions (redone ones too): a counter
    step_time_s: float = 0.0  # rank 0's newest
    tokens_per_s: float = 0.0
    tokens: float = 0.0  # rank 0's tokens_per_s x step_time_s, summed: a counter
    loss: float = math.nan
    stalls: list[float] = field(default_factory=list)  # rank 0's checkpoint stalls: the step loop blocked
    writes: list[float] = field(default_factory=list)  # rank 0's staging writes
    uploads: list[float] = field(default_factory=list)  # per node and set: announcement to the last shard stored
    curve: Curve = field(default_factory=Curve)
    decisions: deque[tuple[float, str, str, str]] = field(default_factory=lambda: deque(maxlen=DECISIONS_KEPT))
    logs: deque[tuple[int, int, str]] = field(default_factory=lambda: deque(maxlen=LOG_LINES_KEPT))
    control_seq: int = 0  # the newest message of this job in each stream
    telemetry_seq: int = 0
    analysis: JobAnalysis | None = None
    spec: JobSpec | None = None  # as submitted (JobSubmitted)

    @property
    def plan(self) -> ParallelPlan | None:
        """The resharder's newest plan, as the job's view folded it."""
        return self.view.plan

    @property
    def placed(self) -> tuple[SlotRef, ...]:
        """Where its ranks run now: the grant of the attempt that holds them (none once released or ended)."""
        return self.view.placement if self.view.granted and not self.view.ended else ()

    @property
    def stale(self) -> bool:
        """Whether its history moved since its analysis."""
        a = self.analysis
        return a is None or (a.control_seq, a.telemetry_seq) != (self.control_seq, self.telemetry_seq)


@dataclass
class NodeFigures:
    kind: str = ""
    slots: int = 0
    spare: bool = False
    up: bool = True
    cordoned: bool = False
    free_slots: int | None = None  # as its agent last said (with `standbys`), when it runs a standby pool
    standbys: int | None = None  # warm standby ranks ready
    snapshot_held: int | None = None  # bytes its ranks' snapshots hold in its memory, as its agent last said
    seen_at: float = 0.0  # its agent's newest sign of life (registration, heartbeat, a batch of its ranks' beats)


@dataclass
class Figures:
    jobs: "OrderedDict[str, JobFigures]" = field(default_factory=OrderedDict)  # in order of first sight
    nodes: dict[str, NodeFigures] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)  # by service
    dead_letters: dict[str, int] = field(default_factory=dict)  # by service
    positions: dict[str, int] = field(default_factory=dict)  # stream -> the newest sequence folded
    forgotten: set[str] = field(default_factory=set)
    version: int = 0  # bumped by every fold: the page is pushed an update when it moved
    admission: Admission = field(default_factory=Admission)

    def fold(self, stored: Stored) -> None:
        self.positions[stored.stream] = max(self.positions.get(stored.stream, 0), stored.seq)
        self.version += 1
        ev = stored.event
        if ev is None or (stored.stream == subjects.CONTROL and self.admission.refusal(stored)):
            return  # what the services refused (events/admission.py) is no part of any job's figures
        if stored.stream == subjects.DEAD and isinstance(ev, DeadLettered):
            self.dead_letters[ev.service] = self.dead_letters.get(ev.service, 0) + 1
        elif stored.stream == subjects.CONTROL:
            if ev.producer in subjects.SERVICES and not stored.subject.startswith("fd.ctl.clock."):
                self.decisions[ev.producer] = self.decisions.get(ev.producer, 0) + 1
            if isinstance(ev, JobEvent) and ev.job_id not in self.forgotten:
                job = self._job(ev.job_id)
                ended = job.view.ended
                job.view = jobview.evolve(job.view, ev)
                job.control_seq = stored.seq
                self._record(job, ev)
                job.decisions.append((ev.occurred_at, type(ev).__name__, ev.producer, describe(ev)))
                if job.view.ended and not ended:
                    self._forget_old()
            elif isinstance(ev, NodeEvent):
                self._node(ev)
        elif stored.stream == subjects.TELEMETRY and isinstance(ev, JobEvent) and ev.job_id not in self.forgotten:
            job = self._job(ev.job_id)
            job.telemetry_seq = stored.seq
            self._telemetry(job, ev)
            if isinstance(ev, RankHeartbeats) and ev.node in self.nodes:
                self.nodes[ev.node].seen_at = max(self.nodes[ev.node].seen_at, ev.occurred_at)
        elif stored.stream == subjects.TELEMETRY and isinstance(ev, AgentAlive) and ev.node in self.nodes:
            self.nodes[ev.node].seen_at = max(self.nodes[ev.node].seen_at, ev.occurred_at)  # an idle agent's
        elif stored.stream == subjects.LOGS and isinstance(ev, RankOutput) and ev.job_id in self.jobs:
            self.jobs[ev.job_id].logs.extend((ev.attempt, ev.rank, line) for line in ev.lines)

    @staticmethod
    def _record(job: JobFigures, ev: JobEvent) -> None:
        """What the job's page shows besides its view, from the decisions that say it."""
        if isinstance(ev, JobSubmitted):
            job.spec = ev.spec

    def _job(self, job_id: str) -> JobFigures:
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = JobFigures(view=JobView(job_id=job_id))
        return job

    def _node(self, ev: NodeEvent) -> None:
        node = self.nodes.setdefault(ev.node, NodeFigures())
        if not isinstance(ev, NodeLost | NodeCordoned | NodeUncordoned):  # what its own agent says: it is alive
            node.seen_at = max(node.seen_at, ev.occurred_at)
        match ev:
            case NodeRegistered(kind=kind, slots=slots, spare=spare):
                node.kind, node.slots, node.spare, node.up = kind, slots, spare, True
                node.free_slots = node.standbys = node.snapshot_held = None
            case NodeHeartbeat(free_slots=free, standbys=standbys, snapshot_held=held):
                node.free_slots, node.standbys = free, standbys
                node.snapshot_held = held if held >= 0 else None
            case NodeLost():
                node.up = False
            case NodeCordoned():
                node.cordoned = True
            case NodeUncordoned():
                node.cordoned = False

    @staticmethod
    def _telemetry(job: JobFigures, ev: JobEvent) -> None:
        match ev:
            case StepCompleted(rank=0):
                job.view = jobview.with_step(job.view, ev)
                job.steps += 1
                job.step_time_s, job.tokens_per_s, job.loss = ev.step_time_s, ev.tokens_per_s, ev.loss
                job.curve.add(ev.step, ev.loss, ev.step_time_s, ev.metrics)
                if math.isfinite(ev.tokens_per_s) and math.isfinite(ev.step_time_s):
                    job.tokens += max(ev.tokens_per_s * ev.step_time_s, 0.0)
            case CheckpointStaged(rank=0):
                job.stalls.append(ev.stall_s)
                job.writes.append(ev.write_s)
            case ShardsUploaded(failed=""):
                job.uploads.append(ev.seconds)

    def _forget_old(self) -> None:
        ended = [j for j, f in self.jobs.items() if f.view.ended]
        for job_id in ended[:max(len(ended) - KEEP_ENDED, 0)]:
            del self.jobs[job_id]
            self.forgotten.add(job_id)  # a late event of it (a checkpoint deleted) brings back no blank job
