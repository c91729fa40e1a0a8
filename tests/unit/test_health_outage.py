"""Silence across a broker outage the service saw (ClockTick.recovered_at): ranks cannot publish while the broker is
away, and a rank whose publish was in flight when it went resends its backlog only once that publish times out
(2 s), after the broker is back. Health counts silence on its own clock from no earlier than the recovery a tick
reports, so such a rank is not lost; one that really died is still found, one deadline after the recovery."""

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick
from flightdeck.events.findings import RankLost
from flightdeck.events.job import AllocationGranted, JobSubmitted, SlotRef, WorkersStarted
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.training import Heartbeat
from flightdeck.services.core import Emit
from flightdeck.services.health.core import NAME
from flightdeck.services.health.detectors import lost_deadline
from tests.unit.health_synth import SERVICE

POLICY = PolicySpec(heartbeat_interval_s=0.5, heartbeat_misses=4, hang_min_s=3.0)  # the drills': lost after 2 s
DEADLINE = lost_deadline(POLICY)


def beat(rank: int, at: float) -> Heartbeat:
    return Heartbeat(job_id="j", rank=rank, attempt=0, node="n1", step=3, interval_s=0.5,
                     event_id=f"hb-{rank}-{at:.2f}", occurred_at=at)


def outage(down_at: float, back_at: float, rank1_back: float | None, *, recorded: bool, until: float = 30.0,
           ) -> list[Event]:
    """Two ranks beating every 0.5 s; the broker gone over [down_at, back_at): no ticks, nothing stored. Rank 0's
    backlog lands as the broker returns, rank 1's at `rank1_back` (None: it died with the outage). Ticks resume
    after it, reporting the recovery when `recorded`. Telemetry stored before a tick is folded before it."""
    spec = JobSpec(name="j", slots=2, policy=POLICY, train=TrainSpec(steps=10_000))
    head: list[Event] = [
        JobSubmitted(job_id="j", spec=spec, event_id="sub", occurred_at=0.0),
        AllocationGranted(job_id="j", attempt=0, assignments=[SlotRef(node="n1", slot=r, rank=r) for r in (0, 1)],
                          event_id="grant", occurred_at=0.0),
        WorkersStarted(job_id="j", node="n1", attempt=0, ranks=[0, 1], pids=[10, 11], event_id="ws", occurred_at=0.1)]
    stored: list[tuple[float, Event]] = []  # (when the broker stored it, event)
    for k in range(1, int(until * 2)):
        at = k / 2
        stored.append((max(at, back_at) if at >= down_at else at, beat(0, at)))
        if rank1_back is None and at >= down_at:
            continue
        stored.append((max(at, rank1_back or at) if at >= down_at else at, beat(1, at)))
    ticks = [(t, ClockTick(service=NAME, now=t, positions={}, event_id=f"tick-{t:.2f}", occurred_at=t,
                           recovered_at=back_at if recorded and t >= back_at else 0.0))
             for k in range(int(until * 2)) if not down_at <= (t := k / 2 + 0.25) < back_at]
    timeline = sorted([(at, 0, ev) for at, ev in stored] + [(at, 1, ev) for at, ev in ticks], key=lambda p: p[:2])
    return head + [ev for _, _, ev in timeline]


def lost(events: list[Event]) -> list[tuple[float, int]]:
    """(tick time, rank) of every RankLost the health core decides over `events`."""
    state: Any = SERVICE.initial
    found = []
    for ev in events:
        state, outs = SERVICE.transition(state, ev)
        found += [(ev.now, o.event.rank) for o in outs
                  if isinstance(o, Emit) and isinstance(o.event, RankLost) and isinstance(ev, ClockTick)]
    return found


def test_a_rank_whose_backlog_lands_late_after_a_recorded_outage_is_not_lost() -> None:
    # The chaos drill's shape: broker killed at 10, back at 11.5; rank 1's publish in flight at 10 times out at 12,
    # so its backlog lands at 12.2. Unrecorded, health finds it silent since its 9.5 beat at the first tick back.
    assert lost(outage(10.0, 11.5, 12.2, recorded=False)) == [(11.75, 1)]
    assert lost(outage(10.0, 11.5, 12.2, recorded=True)) == []


def test_a_rank_that_died_in_the_outage_is_found_one_deadline_after_the_recovery() -> None:
    assert lost(outage(10.0, 11.5, None, recorded=True)) == [(13.75, 1)]  # the first tick past 11.5 + 2 s
    assert lost(outage(10.0, 11.5, None, recorded=False)) == [(11.75, 1)]  # silent since 10 on both clocks


@settings(max_examples=40, deadline=None)
@given(st.floats(5.0, 15.0), st.floats(0.1, 8.0), st.one_of(st.none(), st.floats(0.0, 3.0)))
def test_a_recorded_recovery_only_defers_silence_by_at_most_one_deadline(down_at: float, down_s: float,
                                                                          late: float | None) -> None:
    back_at = down_at + down_s
    rank1_back = None if late is None else back_at + late
    recorded, unrecorded = lost(outage(down_at, back_at, rank1_back, recorded=True)), \
        lost(outage(down_at, back_at, rank1_back, recorded=False))
    assert all(at - back_at > DEADLINE for at, _ in recorded)  # nothing judged silent within a deadline of it
    assert {r for _, r in recorded} <= {r for _, r in unrecorded}  # never a finding the plain rule would not make
    if late is not None and late <= DEADLINE:
        assert recorded == []  # back within a deadline of the recovery: alive
    if late is None:
        assert [r for _, r in recorded] == [1]
        (at, _), = recorded
        assert at <= back_at + DEADLINE + 0.5 + 1e-9  # found at the first tick past the deferred deadline
