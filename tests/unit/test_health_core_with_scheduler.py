"""The health core beside the scheduler and resources cores: a finding restarts the job once, the
restarted attempt is watched afresh, and the exits of ranks stopped on purpose are no new fault."""

from typing import Any

import msgspec

from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick
from flightdeck.events.findings import Finding, RankHung, RankLost
from flightdeck.events.job import AllocationGranted, JobResumed, WorkersExited
from flightdeck.events.training import Heartbeat, RankStarted, StepCompleted
from flightdeck.services.health.core import NAME, State
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from tests.unit.health_synth import SERVICE as HEALTH
from tests.unit.helpers import Agents, Bus, register, step, submit


def feed(bus: Bus, events: list[Event]) -> None:
    """Telemetry and ticks reach only the health core (the Bus routes control subjects); its findings
    join the log like any output, and every core reads them."""
    i = [s.name for s in bus.services].index(NAME)
    for ev in events:
        bus.states[i], outs = step(HEALTH, bus.states[i], ev)
        for n, out in enumerate(outs):
            bus.log.append(msgspec.structs.replace(out.event, event_id=f"health:{ev.event_id}:{n}",
                                                   occurred_at=ev.occurred_at, causation_id=ev.event_id,
                                                   producer=NAME))
        bus.pump()


def seconds(bus: Bus, grant: AllocationGranted, start: float, n: int, *, silent: frozenset[int] = frozenset(),
            frozen: frozenset[int] = frozenset(), first_step: int = 0) -> list[Event]:
    """`n` simulated seconds of the grant's ranks: a step and a heartbeat each per second, then a tick."""
    out: list[Event] = []
    for k in range(n):
        at = start + k
        for ref in grant.assignments:
            if ref.rank in silent:
                continue
            env: dict[str, Any] = {"job_id": grant.job_id, "rank": ref.rank, "attempt": grant.attempt, "node": ref.node}
            done = first_step + (min(k, 3) if ref.rank in frozen else k)
            if k == 0:
                out.append(RankStarted(world_size=len(grant.assignments), from_step=first_step, device="cpu",
                                       event_id=f"rs-{grant.attempt}-{ref.rank}", occurred_at=at, **env))
            if ref.rank not in frozen or k <= 3:
                out.append(StepCompleted(step=done, loss=2.0, grad_norm=1.0, lr=1e-3, tokens_per_s=1.0,
                                         step_time_s=1.0, event_id=f"s-{grant.attempt}-{ref.rank}-{k}",
                                         occurred_at=at, **env))
            out.append(Heartbeat(step=done, interval_s=1.0, event_id=f"h-{grant.attempt}-{ref.rank}-{k}",
                                 occurred_at=at, **env))
        out.append(ClockTick(service=NAME, now=at + 0.5, positions={}, event_id=f"t-{at}", occurred_at=at + 0.5))
    return out


def test_lost_then_hung_each_restart_the_job_once_and_the_new_attempt_is_watched_afresh() -> None:
    bus = Bus([scheduler(memory_wait=False), resources(), HEALTH])
    agents = Agents(bus)
    bus.publish(*(register(f"n{i}", 2) for i in range(3)))
    bus.publish(submit("job-1", slots=2, max_restarts=3))
    agents()
    grant0 = bus.last_grant("job-1")
    start = bus.clock + 1
    feed(bus, seconds(bus, grant0, start, 5))
    feed(bus, seconds(bus, grant0, start + 5, 10, silent=frozenset({1})))
    agents()
    (lost,) = bus.of(RankLost)
    assert (lost.rank, lost.attempt, lost.reason) == (1, 0, "heartbeats stopped")
    grant1 = bus.last_grant("job-1")
    assert grant1.attempt == 1 and bus.state("scheduler").jobs["job-1"].restarts == 1
    health: State = bus.state(NAME)
    assert health.jobs["job-1"].attempt == 1 and not health.jobs["job-1"].quiet

    start = bus.clock + 1  # attempt 1: rank 0 freezes at its step 3 while its heartbeats go on
    feed(bus, seconds(bus, grant1, start, 45, frozen=frozenset({0}), first_step=100))
    agents()
    (hung,) = bus.of(RankHung)
    assert (hung.rank, hung.attempt, hung.step) == (0, 1, 103) and hung.deadline_s == 30.0
    assert bus.last_grant("job-1").attempt == 2 and bus.state("scheduler").jobs["job-1"].restarts == 2
    assert [r.attempt for r in bus.of(JobResumed)] == [1, 2]
    assert len(bus.of(Finding)) == 2  # the stopped ranks' exits and silence said nothing more


def test_a_crash_is_one_fault_though_the_scheduler_and_health_both_see_the_exit() -> None:
    bus = Bus([scheduler(memory_wait=False), resources(), HEALTH])
    agents = Agents(bus)
    bus.publish(register("n0", 2), register("n1", 2), submit("job-1", slots=2, max_restarts=3))
    agents()
    grant0 = bus.last_grant("job-1")
    feed(bus, seconds(bus, grant0, bus.clock + 1, 3))
    ref = grant0.assignments[1]
    bus.publish(WorkersExited(job_id="job-1", node=ref.node, attempt=0, rank=ref.rank, exit_code=3, event_id="crash"))
    agents()
    (lost,) = bus.of(RankLost)
    assert lost.reason == "exited with code 3" and lost.evidence[0] == "crash"
    job = bus.state("scheduler").jobs["job-1"]
    assert (job.restarts, job.attempt, job.faults) == (1, 1, ("crash",))  # health's RankLost came stale
