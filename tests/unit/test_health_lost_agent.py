"""A node agent that is gone is told by the exits it fails to record (services/health/agents.py): the shape of
the lost-agent drill (tests/e2e/test_drills_elastic.py), where the peer rank fails at once, the job is restarted
on both nodes, and nothing on the dead node records the old rank's exit or starts the new one."""

from typing import Any

from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick
from flightdeck.events.fleet import NodeLost
from flightdeck.events.job import AllocationGranted, JobSubmitted, SlotRef, WorkersExited, WorkersStarted
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.training import Heartbeat
from flightdeck.services.core import Emit
from flightdeck.services.health.agents import EXIT_RECORD_S
from flightdeck.services.health.core import NAME
from tests.unit.health_synth import SERVICE

POLICY = PolicySpec(heartbeat_interval_s=0.5, heartbeat_misses=4, hang_min_s=3.0)
GRANT1_AT = 10.2


def tick(at: float) -> ClockTick:
    return ClockTick(service=NAME, now=at, positions={}, event_id=f"tick-{at:.1f}", occurred_at=at)


def beat(attempt: int, rank: int, node: str, at: float) -> Heartbeat:
    return Heartbeat(job_id="j", rank=rank, attempt=attempt, node=node, step=3, interval_s=0.5,
                     event_id=f"hb-{attempt}-{rank}-{at:.1f}", occurred_at=at)


def grant(attempt: int, nodes: list[str], at: float) -> AllocationGranted:
    refs = [SlotRef(node=n, slot=0, rank=r) for r, n in enumerate(nodes)]
    return AllocationGranted(job_id="j", attempt=attempt, assignments=refs, event_id=f"grant-{attempt}", occurred_at=at)


def started(attempt: int, rank: int, node: str, at: float) -> WorkersStarted:
    return WorkersStarted(job_id="j", node=node, attempt=attempt, ranks=[rank], pids=[100 + rank],
                          event_id=f"ws-{attempt}-{node}", occurred_at=at)


def drill(*, old_exit_recorded: bool = False, n2_starts_new: bool = False, old_rank_talks: bool = False,
          until: float = 30.0) -> list[Event]:
    spec = JobSpec(name="j", slots=2, policy=POLICY, train=TrainSpec(steps=1000))
    events: list[Event] = [JobSubmitted(job_id="j", spec=spec, event_id="sub", occurred_at=0.0),
                           grant(0, ["n1", "n2"], 0.0), started(0, 0, "n1", 0.1), started(0, 1, "n2", 0.1)]
    timed: list[tuple[float, Event]] = []
    for k in range(1, 20):  # both ranks talk until the agent of n2 is killed at t=10 (its rank dies with it)
        timed += [(k / 2, beat(0, 0, "n1", k / 2)), (k / 2, beat(0, 1, "n2", k / 2))]
    exited0 = WorkersExited(job_id="j", node="n1", attempt=0, rank=0, exit_code=1, event_id="exit-0-0",
                            occurred_at=10.1)
    timed += [(10.1, exited0), (GRANT1_AT, grant(1, ["n1", "n2"], GRANT1_AT)), (10.3, started(1, 0, "n1", 10.3))]
    if old_exit_recorded:
        timed.append((10.4, WorkersExited(job_id="j", node="n2", attempt=0, rank=1, exit_code=-9, event_id="exit-0-1",
                                          occurred_at=10.4)))
    if n2_starts_new:
        timed.append((10.5, started(1, 1, "n2", 10.5)))
    t = 10.5
    while t < until:
        timed.append((t, beat(1, 0, "n1", t)))
        if old_rank_talks:
            timed.append((t, beat(0, 1, "n2", t)))
        t += 0.5
    timed += [(k / 2 + 0.25, tick(k / 2 + 0.25)) for k in range(0, int(until * 2))]
    return events + [ev for _, ev in sorted(timed, key=lambda p: p[0])]


def fold(events: list[Event], kinds: tuple[type, ...] = (NodeLost,)) -> list[tuple[Event, Emit]]:
    """(input, output) for each output of one of `kinds` the health core decides over `events`."""
    state: Any = SERVICE.initial
    out = []
    for ev in events:
        state, outs = SERVICE.transition(state, ev)
        out += [(ev, o) for o in outs if isinstance(o, Emit) and isinstance(o.event, kinds)]
    return out


def test_an_agent_that_neither_records_the_old_exit_nor_starts_the_new_rank_is_lost_once() -> None:
    found = fold(drill())
    ((at, emit),) = found
    lost = emit.event
    assert isinstance(lost, NodeLost) and lost.node == "n2" and emit.subject == "fd.ctl.node.n2.NodeLost"
    assert isinstance(at, ClockTick) and GRANT1_AT + EXIT_RECORD_S < at.now <= GRANT1_AT + EXIT_RECORD_S + 0.5
    assert "rank 1 of j (attempt 0)" in lost.reason and "ws-0-n2" in lost.reason and "grant-1" in lost.reason


def test_the_same_history_folds_to_the_same_finding() -> None:
    assert [e.event for _, e in fold(drill())] == [e.event for _, e in fold(drill())]


def test_an_agent_that_records_the_kill_is_not_lost() -> None:
    assert fold(drill(old_exit_recorded=True)) == []


def test_an_agent_that_starts_the_new_attempt_is_not_lost() -> None:
    assert fold(drill(n2_starts_new=True)) == []


def test_a_node_whose_old_rank_still_talks_is_not_lost() -> None:
    assert fold(drill(old_rank_talks=True)) == []
