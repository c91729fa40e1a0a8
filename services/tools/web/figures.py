"""What `/metrics` reports, folded from the event log: `Figures.fold(stored)` takes every stored message of the
control, telemetry and dead-letter streams in each stream's order; no I/O here (server.py reads, metrics.py renders).

Per job: its view (services/tools/history/jobview.py, what `flightdeck status` shows), rank 0's step rate, tokens
and loss, and its checkpoints' stalls and uploads. Incidents, their detect and recover times and goodput come from
`postmortem`'s own analysis of the job's history (`JobAnalysis`, set by the server), so they agree with it exactly.
Per service: decisions stored and messages dead-lettered. Per node: slots, and whether it is up and cordoned.
"""

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from events import subjects
from events.base import JobEvent, NodeEvent
from events.checkpoint import CheckpointStaged, ShardsUploaded
from events.clock import DeadLettered
from events.fleet import NodeCordoned, NodeLost, NodeRegistered, NodeUncordoned
from events.store import Stored
from events.training import StepCompleted
from services.tools.history import jobview
from services.tools.history.jobview import JobView

KEEP_ENDED = 500  # ended jobs whose series stay exported (the oldest go first): a scrape stays bounded


@dataclass(frozen=True)
class JobAnalysis:
    """The figures `flightdeck postmortem` computes for a job, as of its history's `control_seq`/`telemetry_seq`."""

    incidents: tuple[tuple[str, float, float | None], ...]  # (kind, seconds to detect, seconds to recover or None)
    goodput: float  # useful training over wall time, 0..1
    parts: dict[str, float]  # the wall time split: useful, detection, restart, ... (seconds)
    control_seq: int
    telemetry_seq: int


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
    control_seq: int = 0  # the newest message of this job in each stream
    telemetry_seq: int = 0
    analysis: JobAnalysis | None = None

    @property
    def stale(self) -> bool:
        """Whether its history moved since its analysis."""
        a = self.analysis
        return a is None or (a.control_seq, a.telemetry_seq) != (self.control_seq, self.telemetry_seq)


@dataclass
class NodeFigures:
    kind: str = ""
    slots: int = 0
    up: bool = True
    cordoned: bool = False


@dataclass
class Figures:
    jobs: "OrderedDict[str, JobFigures]" = field(default_factory=OrderedDict)  # in order of first sight
    nodes: dict[str, NodeFigures] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)  # by service
    dead_letters: dict[str, int] = field(default_factory=dict)  # by service
    positions: dict[str, int] = field(default_factory=dict)  # stream -> the newest sequence folded
    forgotten: set[str] = field(default_factory=set)

    def fold(self, stored: Stored) -> None:
        self.positions[stored.stream] = max(self.positions.get(stored.stream, 0), stored.seq)
        ev = stored.event
        if ev is None:
            return
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
                if job.view.ended and not ended:
                    self._forget_old()
            elif isinstance(ev, NodeEvent):
                self._node(ev)
        elif stored.stream == subjects.TELEMETRY and isinstance(ev, JobEvent) and ev.job_id not in self.forgotten:
            job = self._job(ev.job_id)
            job.telemetry_seq = stored.seq
            self._telemetry(job, ev)

    def _job(self, job_id: str) -> JobFigures:
        job = self.jobs.get(job_id)
        if job is None:
            job = self.jobs[job_id] = JobFigures(view=JobView(job_id=job_id))
        return job

    def _node(self, ev: NodeEvent) -> None:
        node = self.nodes.setdefault(ev.node, NodeFigures())
        match ev:
            case NodeRegistered(kind=kind, slots=slots):
                node.kind, node.slots, node.up = kind, slots, True
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
