"""Synthetic job histories for benchmarks and property tests: the events a real run of the platform records
(steps, heartbeats and checkpoints of N ranks, the services' clock ticks, and each drill fault's detection,
decision and recovery with the same causation links the services write), at any length.

    rows = synthesise(Scenario(ranks=8, steps=100_000, faults=(("crash", 5_000), ("spike", 40_000))))

Faults: "crash" (a rank exits 17; restart from the newest commit), "hang" (steps stop, heartbeats go on;
RankHung after `hang_s`; restart), "spike" (loss x1.15 for three steps; rollback to the newest commit before
it, skipping `skip` batches). A restart beyond `max_restarts` fails the job with every fault as its causes.
"""

import math
import random
from dataclasses import dataclass

import msgspec

from flightdeck.events import codec, subjects
from flightdeck.events.base import Event, JobEvent, RankEvent
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, CheckpointStaged, DataPosition
from flightdeck.events.clock import ClockTick
from flightdeck.events.commands import RollbackRequested, StopRequested
from flightdeck.events.findings import LossSpikeDetected, RankHung, RankLost
from flightdeck.events.fleet import NodeRegistered, SelfCheckPassed
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    JobCompleted,
    JobFailed,
    JobQueued,
    JobResumed,
    JobSubmitted,
    SlotRef,
    WorkersExited,
    WorkersStarted,
)
from flightdeck.events.plan import ParallelPlan, ReshardPlanned
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.store import Stored
from flightdeck.events.training import FaultInjected, Heartbeat, RankStarted, RolledBack, StepCompleted

NODE = "n1"
KEEP = 3  # committed checkpoints kept by retention


@dataclass(frozen=True)
class Scenario:
    job_id: str = "synth-000001"
    ranks: int = 2
    steps: int = 200
    step_s: float = 0.1
    checkpoint_every: int = 10
    heartbeat_s: float = 1.0
    tick_s: float = 0.5  # the health monitor's clock
    queued_s: float = 0.0
    startup_s: float = 4.0
    stall_s: float = 0.002
    hang_s: float = 3.0
    obey_steps: int = 3  # steps the ranks still run after a rollback is requested
    skip: int = 5
    max_restarts: int = 3
    faults: tuple[tuple[str, int], ...] = ()  # (kind, step), each fires once
    seed: int = 0
    start: float = 1_800_000_000.0


class _Log:
    def __init__(self, sc: Scenario) -> None:
        self.sc, self.t, self.rows = sc, sc.start, list[Stored]()
        self.seqs = {subjects.CONTROL: 0, subjects.TELEMETRY: 0}
        self.version, self.n = 0, 0
        self.next_tick = sc.start

    def _put(self, stream: str, subject: str, ev: Event) -> Event:
        self.seqs[stream] += 1
        self.rows.append(Stored(stream, self.seqs[stream], subject, codec.encode(ev), ev.event_id, ev))
        return ev

    def ctl(self, ev: JobEvent, producer: str, cause: Event | None = None, at: float | None = None) -> JobEvent:
        self.version, self.n = self.version + 1, self.n + 1
        ev = msgspec.structs.replace(ev, event_id=f"{producer}:{self.n}", producer=producer,
                                     causation_id=cause.event_id if cause else "", job_version=self.version,
                                     occurred_at=self.t if at is None else at)
        self._put(subjects.CONTROL, subjects.job(self.sc.job_id, type(ev).__name__), ev)
        return ev

    def tel(self, ev: RankEvent, at: float) -> RankEvent:
        self.n += 1
        ev = msgspec.structs.replace(ev, event_id=f"r{ev.rank}:{self.n}", producer="trainer", occurred_at=at)
        self._put(subjects.TELEMETRY, subjects.telemetry(self.sc.job_id, ev.rank, type(ev).__name__), ev)
        return ev

    def raw(self, subject: str, ev: Event) -> None:
        self._put(subjects.CONTROL, subject, ev)

    def ticks(self) -> None:
        """The health monitor's recorded clock up to now."""
        while self.next_tick <= self.t:
            self.n += 1
            self.raw(subjects.clock("health"), ClockTick(event_id=f"tick:{self.n}", occurred_at=self.next_tick,
                                                         service="health", now=self.next_tick,
                                                         positions={subjects.TELEMETRY: self.seqs[subjects.TELEMETRY]}))
            self.next_tick += self.sc.tick_s


def synthesise(sc: Scenario) -> list[Stored]:
    return _Run(sc).run()


class _Run:
    def __init__(self, sc: Scenario) -> None:
        self.sc, self.log, self.rng = sc, _Log(sc), random.Random(sc.seed)
        self.job = sc.job_id
        self.pending = sorted(sc.faults, key=lambda f: f[1])
        self.commits: list[CheckpointCommitted] = []
        self.triggers: list[str] = []
        self.attempt = self.restarts = 0
        self.next_beat = sc.start
        self.last_steps: dict[int, StepCompleted] = {}
        self.skips: list[tuple[int, int]] = []

    def run(self) -> list[Stored]:
        sc, log = self.sc, self.log
        log.raw(subjects.node(NODE, "NodeRegistered"), NodeRegistered(event_id="reg", node=NODE, kind="cpu",
                                                                      slots=sc.ranks, occurred_at=log.t))
        log.raw(subjects.node(NODE, "SelfCheckPassed"), SelfCheckPassed(event_id="check", node=NODE, seconds=1.0,
                                                                        occurred_at=log.t))
        spec = JobSpec(name=self.job.rsplit("-", 1)[0], slots=sc.ranks,
                       train=TrainSpec(steps=sc.steps, checkpoint_every=sc.checkpoint_every),
                       policy=PolicySpec(max_restarts=sc.max_restarts))
        submitted = log.ctl(JobSubmitted(job_id=self.job, spec=spec), "cli")
        log.ctl(JobQueued(job_id=self.job, priority=50, reason="submitted"), "scheduler", submitted)
        request = log.ctl(AllocationRequested(job_id=self.job, slots=sc.ranks, attempt=0), "scheduler", submitted)
        log.t += sc.queued_s
        step = 0
        self.start_attempt(request, step)
        while (outcome := self.train(step)) is not None:
            if isinstance(outcome, int):  # rolled back in place
                step = outcome
                continue
            step = self.commits[-1].step if self.commits else 0
            self.start_attempt(outcome, step)
        return log.rows

    def start_attempt(self, request: JobEvent, step: int) -> None:
        sc, log, a = self.sc, self.log, self.attempt
        grant = log.ctl(AllocationGranted(job_id=self.job, attempt=a, assignments=[
            SlotRef(node=NODE, slot=r, rank=r) for r in range(sc.ranks)]), "resources", request)
        log.ctl(ReshardPlanned(job_id=self.job, old=None, new=ParallelPlan(world_size=sc.ranks, dp=sc.ranks),
                               reason=f"grant (attempt {a})"), "resharder", grant)
        started = log.ctl(WorkersStarted(job_id=self.job, node=NODE, attempt=a, ranks=list(range(sc.ranks)),
                                         pids=[1000 + r for r in range(sc.ranks)]), f"agent-{NODE}", grant)
        if a > 0:
            ckpt = self.commits[-1].checkpoint_id if self.commits else ""
            log.ctl(JobResumed(job_id=self.job, attempt=a, from_step=step, checkpoint_id=ckpt,
                               world_size=sc.ranks), "scheduler", started)
        log.t += sc.startup_s
        log.ticks()
        for r in range(sc.ranks):
            log.tel(RankStarted(job_id=self.job, rank=r, attempt=a, node=NODE, world_size=sc.ranks,
                                from_step=step, device="cpu"), log.t)

    def loss(self, step: int, rank: int) -> float:
        return 1.0 + 4.5 * math.exp(-step / max(self.sc.steps / 3, 1)) + self.rng.gauss(0.0, 0.02) + 0.01 * rank

    def heartbeats(self, step: int) -> None:
        sc, log = self.sc, self.log
        while self.next_beat <= log.t:
            for r in range(sc.ranks):
                log.tel(Heartbeat(job_id=self.job, rank=r, attempt=self.attempt, node=NODE, step=step,
                                  interval_s=sc.heartbeat_s), self.next_beat)
            self.next_beat += sc.heartbeat_s

    def one_step(self, step: int, factor: float = 1.0) -> None:
        sc, log = self.sc, self.log
        took = sc.step_s * (1.0 + 0.1 * self.rng.random())
        log.t += took
        for r in range(sc.ranks):
            self.last_steps[r] = log.tel(StepCompleted(  # type: ignore[assignment]
                job_id=self.job, rank=r, attempt=self.attempt, node=NODE, step=step,
                loss=self.loss(step, r) * factor, grad_norm=1.0, lr=3e-3, tokens_per_s=1e4, step_time_s=took), log.t)
        self.heartbeats(step)
        log.ticks()
        if (step + 1) % sc.checkpoint_every == 0:
            self.checkpoint(step + 1)

    def checkpoint(self, step: int) -> None:
        sc, log = self.sc, self.log
        position = DataPosition(next_batch=step, skipped=list(self.skips))
        staged = [log.tel(CheckpointStaged(job_id=self.job, rank=r, attempt=self.attempt, node=NODE, step=step,
                                           world_size=sc.ranks, staging_dir=f"/staging/{step}", shards=[],
                                           data=position, stall_s=sc.stall_s * (1 + r), write_s=0.05),
                          log.t + 0.05) for r in range(sc.ranks)]
        log.t += sc.stall_s * sc.ranks
        commit = log.ctl(CheckpointCommitted(job_id=self.job, checkpoint_id=f"step{step:09d}-a{self.attempt}",
                                             step=step, world_size=sc.ranks, uri=f"file:///ckpt/{step}", bytes=10**6,
                                             data=position), "checkpoints", staged[0], at=log.t + 0.1)
        assert isinstance(commit, CheckpointCommitted)
        self.commits.append(commit)
        for old in self.commits[:-KEEP]:
            log.ctl(CheckpointDeleted(job_id=self.job, checkpoint_id=old.checkpoint_id), "checkpoints", commit,
                    at=log.t + 0.1)
        self.commits = self.commits[-KEEP:]

    def train(self, step: int) -> JobEvent | int | None:
        """Steps until the end (None), a restart (the new AllocationRequested) or a rollback (its step)."""
        sc = self.sc
        while step < sc.steps:
            if self.pending and self.pending[0][1] == step:
                kind, _ = self.pending.pop(0)
                if kind == "spike":
                    return self.spike(step)
                return self.crash(step) if kind == "crash" else self.hang(step)
            self.one_step(step)
            step += 1
        self.complete()
        return None

    def complete(self) -> None:
        log, last = self.log, None
        log.t += 1.0
        for r in range(self.sc.ranks):
            last = log.ctl(WorkersExited(job_id=self.job, node=NODE, attempt=self.attempt, rank=r, exit_code=0),
                           f"agent-{NODE}")
        log.ctl(JobCompleted(job_id=self.job, steps=self.sc.steps), "scheduler", last)
        log.ctl(AllocationReleased(job_id=self.job, attempt=self.attempt, reason="completed"), "scheduler", last)

    def fault(self, kind: str, step: int, rank: int) -> None:
        self.log.tel(FaultInjected(job_id=self.job, rank=rank, attempt=self.attempt, node=NODE, kind=kind,  # type: ignore[arg-type]
                                   step=step), self.log.t)

    def crash(self, step: int) -> JobEvent | None:
        log, rank = self.log, sc_rank(self.sc)
        self.fault("crash", step, rank)
        log.t += 0.05
        exited = log.ctl(WorkersExited(job_id=self.job, node=NODE, attempt=self.attempt, rank=rank, exit_code=17),
                         f"agent-{NODE}")
        return self.restart(exited, f"rank {rank} exited with code 17", stale=RankLost(
            job_id=self.job, rank=rank, attempt=self.attempt, evidence=[exited.event_id],
            reason="exited with code 17", last_seen=log.t))

    def hang(self, step: int) -> JobEvent | None:
        sc, log, rank = self.sc, self.log, sc_rank(self.sc)
        self.fault("hang", step, rank)
        stalled_from = log.t
        log.t += sc.hang_s
        self.heartbeats(step - 1)
        log.ticks()
        last = self.last_steps.get(rank)
        hung = log.ctl(RankHung(job_id=self.job, rank=rank, attempt=self.attempt, step=step - 1,
                                stalled_s=log.t - stalled_from, deadline_s=sc.hang_s,
                                evidence=[last.event_id] if last else []), "health")
        return self.restart(hung, f"rank {rank} hung at step {step - 1}")

    def restart(self, trigger: JobEvent, why: str, stale: JobEvent | None = None) -> JobEvent | None:
        sc, log, a = self.sc, self.log, self.attempt
        self.triggers.append(trigger.event_id)
        if self.restarts >= sc.max_restarts:
            log.ctl(JobFailed(job_id=self.job, reason=f"{why}; restart budget of {sc.max_restarts} spent",
                              causes=list(self.triggers)), "scheduler", trigger)
            log.ctl(AllocationReleased(job_id=self.job, attempt=a, reason="failed"), "scheduler", trigger)
            return None
        self.restarts += 1
        reason = f"{why}; restart {self.restarts} of {sc.max_restarts}"
        log.ctl(StopRequested(job_id=self.job, checkpoint=False, reason=reason), "scheduler", trigger)
        log.ctl(AllocationReleased(job_id=self.job, attempt=a, reason=reason), "scheduler", trigger)
        request = log.ctl(AllocationRequested(job_id=self.job, slots=sc.ranks, attempt=a + 1, use_spares=True),
                          "scheduler", trigger)
        log.t += 0.3
        log.ticks()
        if stale is not None:
            log.ctl(stale, "health")
        for r in range(sc.ranks):
            if r != getattr(trigger, "rank", -1):
                log.ctl(WorkersExited(job_id=self.job, node=NODE, attempt=a, rank=r, exit_code=-15), f"agent-{NODE}")
        self.attempt += 1
        self.skips = []
        return request

    def spike(self, step: int) -> int:
        sc, log = self.sc, self.log
        self.fault("loss_spike", step, 0)
        for s in range(step, min(step + sc.obey_steps, sc.steps)):  # a run never trains past its last step
            self.one_step(s, factor=1.15 if s < step + 3 else 1.0)
            if s == step:
                evidence = self.last_steps[0]
                log.next_tick = min(log.next_tick, log.t)
                log.ticks()
                finding = log.ctl(LossSpikeDetected(
                    job_id=self.job, rank=0, attempt=self.attempt, evidence=[evidence.event_id], step=step,
                    loss=evidence.loss, baseline=evidence.loss / 1.15, mad=0.02, z=8.0, threshold=6.0),
                    "health", evidence, at=evidence.occurred_at)
                target = max((c for c in self.commits if c.step < step), key=lambda c: c.step, default=None)
                to_step = target.step if target else 0
                cid = target.checkpoint_id if target else ""
                rollback = (to_step, cid, step, step + sc.skip)
                log.ctl(RollbackRequested(job_id=self.job, checkpoint_id=cid, to_step=to_step, skip_from=step,
                                          skip_to=step + sc.skip, reason="loss spike", trigger_id=finding.event_id),
                        "scheduler", finding, at=evidence.occurred_at)
        to_step, cid, a, b = rollback
        log.t += 0.2
        self.skips.append((a, b))
        self.commits = [c for c in self.commits if c.step <= to_step]  # the thrown-away steps' commits
        for r in range(sc.ranks):
            log.tel(RolledBack(job_id=self.job, rank=r, attempt=self.attempt, node=NODE, checkpoint_id=cid,
                               to_step=to_step, skip_from=a, skip_to=b), log.t)
        self.pending = [f for f in self.pending if not (f[0] == "spike" and f[1] < step + sc.obey_steps)]
        return to_step


def sc_rank(sc: Scenario) -> int:
    """The rank a crash or hang hits: the last one (rank 0 reports the loss)."""
    return sc.ranks - 1
