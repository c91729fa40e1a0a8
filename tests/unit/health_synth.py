"""Synthetic telemetry for the health monitor's tests: a job's ranks in simulated time, and folding it.

`Cluster` writes what a real run records, in the order the health service would fold it: control
events, each rank's telemetry (StepCompleted, Heartbeat), and the service's ClockTicks. Each rank is
told how to behave per simulated second (`step_time_s`, `dies_at`, `hangs_at_step`, `skew_s`).
"""

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick
from flightdeck.events.findings import Finding
from flightdeck.events.job import AllocationGranted, JobSubmitted, SlotRef, WorkersExited, WorkersStarted
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.training import Heartbeat, RankStarted, StepCompleted
from flightdeck.services.core import Emit
from flightdeck.services.health.core import NAME, State, core_service

SERVICE = core_service()


def steady_second(job_id: str, num_ranks: int, second: int) -> list[Heartbeat | StepCompleted]:
    """One simulated second of a healthy job at 1 Hz: a StepCompleted and a Heartbeat from every rank, 8 to a node."""
    out: list[Heartbeat | StepCompleted] = []
    for rank in range(num_ranks):
        env: dict[str, Any] = {"job_id": job_id, "rank": rank, "attempt": 0, "node": f"n{rank // 8}"}
        at = second + rank / num_ranks
        out.append(StepCompleted(step=second, loss=2.0 - second * 1e-3 + rank * 1e-7, grad_norm=1.0, lr=1e-3,
                                 tokens_per_s=1e5, step_time_s=0.9 + (rank % 7) * 0.01, event_id=f"s{second}-{rank}",
                                 occurred_at=at, **env))
        out.append(Heartbeat(step=second, interval_s=1.0, event_id=f"h{second}-{rank}", occurred_at=at, **env))
    return out


def loss_curve(step: int, *, a: float = 2.0, b: float = 1.0, tau: float = 300.0) -> float:
    return b + a * math.exp(-step / tau)


@dataclass
class RankPlan:
    step_time_s: Callable[[int], float] = lambda step: 0.5
    dies_at: float = math.inf  # simulated time the process vanishes (no more telemetry)
    hangs_at_step: int | None = None  # completes steps before it, then heartbeats with a frozen step
    skew_s: float = 0.0  # the rank's clock minus true time


@dataclass
class Cluster:
    job_id: str = "job-1"
    policy: PolicySpec = field(default_factory=PolicySpec)
    num_ranks: int = 2
    attempt: int = 0
    loss: Callable[[int, int], float] = lambda rank, step: loss_curve(step)
    events: list[Event] = field(default_factory=list)
    _n: int = 0

    def eid(self, kind: str) -> str:
        self._n += 1
        return f"{kind}-{self._n}"

    def start(self, at: float = 0.0) -> None:
        spec = JobSpec(name="job", slots=self.num_ranks, policy=self.policy,
                       train=TrainSpec(steps=1_000_000, batch_size=max(8, self.num_ranks)))
        refs = [SlotRef(node="n1", slot=r, rank=r) for r in range(self.num_ranks)]
        self.events += [
            JobSubmitted(job_id=self.job_id, spec=spec, event_id=self.eid("submit"), occurred_at=at),
            AllocationGranted(job_id=self.job_id, attempt=self.attempt, assignments=refs,
                              event_id=self.eid("grant"), occurred_at=at),
            WorkersStarted(job_id=self.job_id, node="n1", attempt=self.attempt, ranks=list(range(self.num_ranks)),
                           pids=list(range(100, 100 + self.num_ranks)), event_id=self.eid("started"), occurred_at=at),
        ]

    def exit(self, rank: int, code: int, at: float, attempt: int | None = None) -> WorkersExited:
        ev = WorkersExited(job_id=self.job_id, node="n1", attempt=self.attempt if attempt is None else attempt,
                           rank=rank, exit_code=code, event_id=self.eid("exit"), occurred_at=at)
        self.events.append(ev)
        return ev

    def run(self, plans: Sequence[RankPlan], *, start: float, until: float, tick_s: float = 1.0,
            first_step: int = 0, announce: bool = True) -> None:
        """Simulate ranks from `start` to `until`: telemetry merged in time order, a tick every `tick_s`.
        With `announce` each rank begins with RankStarted (a fresh process), else it goes on as it was."""
        queue: list[tuple[float, int, int, Event]] = []  # (true time, order, kind, event)
        order = 0

        def push(t: float, ev: Event) -> None:
            nonlocal order
            order += 1
            heapq.heappush(queue, (t, order, 0, ev))

        interval = self.policy.heartbeat_interval_s
        for rank, plan in enumerate(plans):
            env: dict[str, Any] = {"job_id": self.job_id, "rank": rank, "attempt": self.attempt, "node": "n1"}
            if announce and start < plan.dies_at:
                push(start, RankStarted(world_size=len(plans), from_step=first_step, device="cpu",
                                        event_id=self.eid("rs"), occurred_at=start + plan.skew_s, **env))
            t, step, done = start, first_step, first_step - 1
            beat = start
            while True:
                hung = plan.hangs_at_step is not None and step >= plan.hangs_at_step
                next_step = math.inf if hung else t + plan.step_time_s(step)
                if min(next_step, beat) >= min(until, plan.dies_at):
                    break
                if beat <= next_step:
                    push(beat, Heartbeat(step=done, interval_s=interval, event_id=self.eid("hb"),
                                         occurred_at=beat + plan.skew_s, **env))
                    beat += interval
                    continue
                t = next_step
                push(t, StepCompleted(step=step, loss=self.loss(rank, step), grad_norm=1.0, lr=1e-3, tokens_per_s=1.0,
                                      step_time_s=plan.step_time_s(step), event_id=self.eid("step"),
                                      occurred_at=t + plan.skew_s, **env))
                done, step = step, step + 1
        tick = start + tick_s
        while tick <= until:
            heapq.heappush(queue, (tick, 0, 1, ClockTick(service=NAME, now=tick, positions={},
                                                          event_id=self.eid("tick"), occurred_at=tick)))
            tick += tick_s
        while queue:
            self.events.append(heapq.heappop(queue)[3])


def fold_pairs(events: Iterable[Event], state: State | None = None) -> tuple[State, list[tuple[Event, Finding]]]:
    """Fold through the health core as the shell does (evolve, then decide); each finding with its input."""
    current = SERVICE.initial if state is None else state
    found: list[tuple[Event, Finding]] = []
    for ev in events:
        current, outs = SERVICE.transition(current, ev)
        for out in outs:
            assert isinstance(out, Emit) and isinstance(out.event, Finding), out
            assert out.subject == f"fd.ctl.job.{out.event.job_id}.{type(out.event).__name__}", out
            assert (out.event.event_id, out.event.occurred_at, out.event.producer) == ("", 0.0, ""), out
            found.append((ev, out.event))
    return current, found


def fold(events: Iterable[Event], state: State | None = None) -> tuple[State, list[Finding]]:
    current, pairs = fold_pairs(events, state)
    return current, [f for _, f in pairs]


def evidence_exists(findings: Iterable[Finding], inputs: Iterable[Event]) -> None:
    ids = {ev.event_id for ev in inputs}
    for f in findings:
        assert f.evidence, f
        assert set(f.evidence) <= ids, (f, set(f.evidence) - ids)


def of(findings: Iterable[Finding], kind: type[Finding]) -> list[Finding]:
    return [f for f in findings if isinstance(f, kind)]
