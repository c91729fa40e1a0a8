"""A node agent still recording the exits of a replaced attempt is alive: at thousands of ranks one
WorkersExited per rank into one job history takes longer than EXIT_RECORD_S, and the health monitor must not
call the node lost while its agent works through them (found by the scale simulation at 2,048 ranks). An agent
that records nothing is still found lost."""

from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick
from flightdeck.events.fleet import NodeLost
from flightdeck.events.job import AllocationGranted, JobSubmitted, SlotRef, WorkersExited, WorkersStarted
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.training import Heartbeat
from flightdeck.services.health.core import NAME, core_service

SERVICE = core_service()
JOB = "job-1"


def lost_nodes(exits_at: list[float], until: float) -> list[tuple[float, str]]:
    """Ranks 0-3 of attempt 0 on n1 and n2; attempt 1 granted at t=10 on n3; n1's agent records its exits at
    `exits_at` (rank by rank), n2's agent records none. Returns (tick time, node) of each NodeLost."""
    spec = JobSpec(name="job", slots=4, policy=PolicySpec(), train=TrainSpec(steps=1000, batch_size=8))
    events: list[Event] = [
        JobSubmitted(job_id=JOB, spec=spec, event_id="submit", occurred_at=0.0),
        AllocationGranted(job_id=JOB, attempt=0, event_id="g0", occurred_at=0.0,
                          assignments=[SlotRef(node=f"n{1 + r // 2}", slot=r % 2, rank=r) for r in range(4)]),
        WorkersStarted(job_id=JOB, node="n1", attempt=0, ranks=[0, 1], pids=[1, 2], event_id="s1", occurred_at=0.1),
        WorkersStarted(job_id=JOB, node="n2", attempt=0, ranks=[2, 3], pids=[3, 4], event_id="s2", occurred_at=0.1),
        *(Heartbeat(job_id=JOB, rank=r, attempt=0, node=f"n{1 + r // 2}", step=0, interval_s=1.0, event_id=f"h{r}",
                    occurred_at=1.0) for r in range(4)),
    ]
    state = SERVICE.initial
    for ev in events:
        state, _ = SERVICE.transition(state, ev)
    tick = ClockTick(service=NAME, now=10.0, positions={}, event_id="t10", occurred_at=10.0)
    state, _ = SERVICE.transition(state, tick)
    grant = AllocationGranted(job_id=JOB, attempt=1, event_id="g1", occurred_at=10.0,
                              assignments=[SlotRef(node="n3", slot=r, rank=r) for r in range(4)])
    state, _ = SERVICE.transition(state, grant)
    found: list[tuple[float, str]] = []
    pending = [WorkersExited(job_id=JOB, node="n1", attempt=0, rank=r, exit_code=-9, event_id=f"x{r}", occurred_at=t)
               for r, t in enumerate(exits_at)]
    t = 11.0
    while t <= until:
        while pending and pending[0].occurred_at <= t:
            state, _ = SERVICE.transition(state, pending.pop(0))
        tick = ClockTick(service=NAME, now=t, positions={}, event_id=f"t{t}", occurred_at=t)
        state, outs = SERVICE.transition(state, tick)
        found += [(t, o.event.node) for o in outs if isinstance(o.event, NodeLost)]
        t += 1.0
    return found


def test_an_agent_still_recording_exits_is_not_lost() -> None:
    # n1 records rank 0's exit 8 s after the grant and rank 1's 16 s after it: slow, but working.
    found = lost_nodes([18.0, 26.0], until=40.0)
    assert [node for _, node in found] == ["n2"]  # the silent agent's node only
    assert found[0][0] > 20.0  # EXIT_RECORD_S (10 s) after the grant, once its ranks were silent as long


def test_an_agent_that_stops_recording_is_lost_a_deadline_after_its_last_record() -> None:
    found = lost_nodes([18.0], until=40.0)  # rank 1's exit never comes
    assert dict((node, t) for t, node in found) == {"n2": 21.0, "n1": 29.0}
