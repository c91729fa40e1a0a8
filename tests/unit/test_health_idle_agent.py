"""An agent that runs no ranks sends an AgentAlive every few seconds (services/agent/alive.py); when they stop, the
health monitor declares its node lost at the idle deadline (services/health/agents.idle_silent). Issue 51: an agent
that died idle was found only when a job granted to it waited out the start grace (120 s in `placing`)."""

from typing import Any

from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.fleet import AgentAlive, NodeLost
from flightdeck.events.heartbeats import RankHeartbeats
from flightdeck.services.core import Emit
from flightdeck.services.health.core import NAME, core_service, wants_tick

LIVE = core_service(idle_lost_s=30.0)
CONFIGURED = CoreConfigured(service=NAME, settings=dict(LIVE.settings), occurred_at=0.0)
OLD = CoreConfigured(service=NAME, settings=dict(LIVE.unrecorded or {}), occurred_at=0.0)


def alive(node: str, at: float) -> AgentAlive:
    return AgentAlive(node=node, interval_s=5.0, event_id=f"alive-{node}-{at:g}", occurred_at=at,
                      producer=f"agent-{node}")


def tick(at: float, recovered_at: float = 0.0) -> ClockTick:
    return ClockTick(service=NAME, now=at, positions={}, recovered_at=recovered_at, event_id=f"t-{at:g}",
                     occurred_at=at)


def fold(events: list[Event]) -> tuple[Any, list[tuple[float, NodeLost]]]:
    state: Any = LIVE.initial
    out = []
    for ev in events:
        state, outs = LIVE.transition(state, ev)
        out += [(ev.now, o.event) for o in outs  # type: ignore[attr-defined]
                if isinstance(o, Emit) and isinstance(o.event, NodeLost)]
    return state, out


def beats_until(node: str, until: float) -> list[Event]:
    return [alive(node, t) for t in range(0, int(until) + 1, 5)]


def ticks(until: float) -> list[Event]:
    return [tick(t + 0.5) for t in range(0, int(until))]


def merged(*streams: list[Event]) -> list[Event]:
    return sorted((ev for s in streams for ev in s), key=lambda e: e.occurred_at)


def test_an_idle_agent_that_stops_is_lost_once_at_the_deadline_and_its_busy_peer_is_not() -> None:
    events = [CONFIGURED, *merged(beats_until("n1", 20), beats_until("n2", 100), ticks(100))]
    _, lost = fold(events)
    ((at, finding),) = lost
    assert finding.node == "n1" and "running no ranks" in finding.reason and "30s" in finding.reason
    assert 20 + 30 < at <= 20 + 31  # its last beat at 20 s, lost at the first tick past the deadline


def test_an_agent_running_ranks_is_watched_by_its_batches_not_by_the_idle_deadline() -> None:
    batches = [RankHeartbeats(job_id="j", rank=0, attempt=0, node="n1", interval_s=0.5, beats=[],
                              event_id="b-1", occurred_at=21.0)]
    _, lost = fold([CONFIGURED, *merged(beats_until("n1", 20), batches, ticks(100))])
    assert lost == []  # it runs ranks from 21 s: the job's own watch (agents.silent) judges its silence


def test_it_comes_back_and_is_watched_again() -> None:
    back = [alive("n1", 70.0), alive("n1", 75.0)]
    _, lost = fold([CONFIGURED, *merged(beats_until("n1", 20), back, ticks(130))])
    assert [at for at, _ in lost] == [50.5, 105.5]  # lost past 50, back at 70, silent again from 75


def test_a_broker_outage_counts_silence_from_its_end() -> None:
    outage = [tick(t + 0.5, recovered_at=40.0) for t in range(40, 100)]
    _, lost = fold([CONFIGURED, *merged(beats_until("n1", 20), [tick(t + 0.5) for t in range(40)], outage)])
    ((at, _),) = lost
    assert 40 + 30 < at <= 40 + 31


def test_histories_recorded_before_watch_no_idle_agent() -> None:
    _, lost = fold([OLD, *merged(beats_until("n1", 20), ticks(100))])
    assert lost == []


def test_an_idle_fleet_ticks_once_a_deadline_not_once_a_second() -> None:
    state, _ = fold([CONFIGURED, alive("n1", 0.0), tick(0.5)])
    assert not wants_tick(state, 10.0) and not wants_tick(state, 29.9)
    assert wants_tick(state, 30.5)  # a deadline since the last tick: it folds what n1 sent since, or finds it lost
    state, lost = fold([CONFIGURED, alive("n1", 0.0), tick(0.5), tick(31.0)])
    assert [f.node for _, f in lost] == ["n1"]
    assert not wants_tick(state, 60.9) and wants_tick(state, 61.0)  # told once; the fleet is looked at again
    state, _ = fold([CONFIGURED, alive("n1", 0.0), tick(0.5), alive("n1", 5.0), tick(6.0)])
    assert not wants_tick(state, 35.0) and wants_tick(state, 35.1)  # n1's silence since 5 s reaches the deadline
