"""Dead, hung and slow ranks told apart: silence is RankLost, a frozen step under live heartbeats is
RankHung after a deadline drawn from recent step times, and slow progress is neither."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events.clock import ClockTick
from flightdeck.events.findings import RankHung, RankLost
from flightdeck.events.spec import PolicySpec
from flightdeck.services.health.detectors import STARTUP_GRACE_S, Hung, Lost, RankWatch, hang_deadline, lost_deadline
from tests.unit.health_synth import Cluster, RankPlan, evidence_exists, fold, fold_pairs, of

POLICY = PolicySpec(heartbeat_interval_s=1.0, heartbeat_misses=5, hang_min_s=5.0, hang_factor=10.0)
step_times = st.floats(0.05, 2.0)


def steady(t: float) -> RankPlan:
    return RankPlan(step_time_s=lambda s: t)


@settings(max_examples=25, deadline=None)
@given(step_times, st.floats(10.0, 40.0))
def test_dead_rank_is_lost_after_the_missed_heartbeats_and_never_called_hung(step: float, dies_at: float) -> None:
    c = Cluster(policy=POLICY)
    c.start()
    c.run([steady(step), RankPlan(step_time_s=lambda s: step, dies_at=dies_at)], start=0.0, until=dies_at + 60)
    _, pairs = fold_pairs(c.events)
    found = [f for _, f in pairs]
    assert of(found, RankHung) == []
    ((tick, lost),) = [(i, f) for i, f in pairs if isinstance(f, RankLost)]
    assert isinstance(lost, RankLost) and (lost.rank, lost.attempt, lost.reason) == (1, 0, "heartbeats stopped")
    assert isinstance(tick, ClockTick)
    detected = tick.now
    assert dies_at - POLICY.heartbeat_interval_s <= lost.last_seen < dies_at
    assert lost_deadline(POLICY) < detected - lost.last_seen <= lost_deadline(POLICY) + 1.0 + 1e-9
    evidence_exists(found, c.events)


@settings(max_examples=25, deadline=None)
@given(step_times, st.integers(5, 60))
def test_hung_rank_is_found_after_its_deadline_while_its_heartbeats_go_on(step: float, at_step: int) -> None:
    c = Cluster(policy=POLICY)
    c.start()
    hung_from = at_step * step  # when its last step completed
    deadline = max(POLICY.hang_min_s, POLICY.hang_factor * step)
    c.run([steady(step), RankPlan(step_time_s=lambda s: step, hangs_at_step=at_step)], start=0.0,
          until=hung_from + deadline + 20)
    state, found = fold(c.events)
    assert of(found, RankLost) == []
    (hung,) = of(found, RankHung)
    assert isinstance(hung, RankHung) and (hung.rank, hung.step) == (1, at_step - 1)
    assert math.isclose(hung.deadline_s, deadline)
    assert deadline < hung.stalled_s <= deadline + 1.0 + 1e-9
    evidence_exists(found, c.events)
    assert not state.jobs["job-1"].ranks[1].gone  # still alive: a hang is no death


@settings(max_examples=25, deadline=None)
@given(step_times, st.floats(3.0, 9.0))
def test_slow_rank_is_neither_lost_nor_hung(step: float, slowdown: float) -> None:
    """Each slow step stays under the deadline its recent steps give, however slow the rank gets."""
    c = Cluster(policy=POLICY)
    c.start()
    slow = min(step * slowdown, POLICY.hang_min_s * 0.9)
    c.run([steady(step), RankPlan(step_time_s=lambda s: step if s < 10 else slow)], start=0.0, until=120.0)
    _, found = fold(c.events)
    assert of(found, RankLost) == [] and of(found, RankHung) == []


def test_growing_step_times_raise_the_deadline() -> None:
    """A rank that slows down step by step keeps its deadline ahead of it: factor x recent median."""
    c = Cluster(policy=POLICY)
    c.start()
    c.run([steady(1.0), RankPlan(step_time_s=lambda s: 1.0 + 0.5 * s)], start=0.0, until=200.0)
    _, found = fold(c.events)
    assert of(found, RankHung) == [] and of(found, RankLost) == []


def test_deadline_comes_from_recent_step_times_not_a_fixed_limit() -> None:
    from collections import deque
    assert hang_deadline(POLICY, deque()) == POLICY.hang_min_s
    assert hang_deadline(POLICY, deque([0.1, 0.1, 9.0])) == POLICY.hang_min_s
    assert hang_deadline(POLICY, deque([2.0, 3.0, 2.5])) == 25.0


def beat(watch: RankWatch, at: float, folded: float, eid: str, step: int = 3) -> None:
    watch.heartbeat(step, at, folded, eid)


def test_a_rank_clock_behind_by_minutes_is_not_lost() -> None:
    w = RankWatch(0)
    w.started(1000.0, 1000.0, "ws")
    for t in range(1000, 1030):
        beat(w, t - 300.0, float(t - 1), f"hb{t}")  # rank clock 300 s behind; folded at the previous tick
        assert w.judge(POLICY, float(t), paused=False) is None
    assert isinstance(w.judge(POLICY, 1036.0, paused=False), Lost)  # silence by the service's clock counts


def test_heartbeats_folded_after_a_service_outage_are_not_old() -> None:
    """Down from t=1000 to t=1060: the heartbeats of that minute are folded at the first tick after, with
    the last tick before as their fold time; the rank's own clock shows they are fresh."""
    w = RankWatch(0)
    w.started(990.0, 990.0, "ws")
    for t in range(1000, 1060):
        beat(w, float(t), 999.0, f"hb{t}")
    assert w.judge(POLICY, 1060.5, paused=False) is None
    dead = RankWatch(1)
    dead.started(990.0, 990.0, "ws")
    beat(dead, 1001.0, 999.0, "hb-last")
    lost = dead.judge(POLICY, 1060.5, paused=False)
    assert isinstance(lost, Lost) and lost.evidence == ("hb-last",) and lost.last_seen == 1001.0


def test_a_started_rank_never_heard_from_is_lost_after_a_startup_grace() -> None:
    w = RankWatch(0)
    w.started(100.0, 100.0, "ws")
    grace = STARTUP_GRACE_S
    assert POLICY.hang_min_s + lost_deadline(POLICY) < grace
    assert w.judge(POLICY, 100.0 + grace, paused=False) is None
    lost = w.judge(POLICY, 100.5 + grace, paused=False)
    assert isinstance(lost, Lost) and lost.evidence == ("ws",) and "of start" in lost.reason


def test_pause_suspends_hang_and_the_clock_restarts_on_resume() -> None:
    w = RankWatch(0)
    w.started(0.0, 0.0, "ws")
    w.step_completed(1, 0.1, 1.0, 1.0, "s1")
    for t in range(2, 60):
        beat(w, float(t), float(t), f"hb{t}", step=1)
        assert w.judge(POLICY, float(t), paused=True) is None
    w.restart_clock(60.0, 60.0, "resume")
    for t in range(60, 66):
        beat(w, float(t), float(t), f"hb{t}", step=1)
        assert w.judge(POLICY, t + 0.9, paused=False) is None  # alive, 5 s at most since the resume
    beat(w, 66.0, 66.0, "hb66", step=1)
    hung = w.judge(POLICY, 66.1, paused=False)
    assert isinstance(hung, Hung) and hung.evidence == ("resume", "hb66") and hung.step == 1
    assert hung.stalled_s == 6.0


def test_heartbeats_before_rank_started_do_not_arm_the_hang_clock() -> None:
    """Importing torch and rendezvous can take a while; the hang clock starts with RankStarted or a step."""
    w = RankWatch(0)
    w.started(0.0, 0.0, "ws")
    for t in range(1, 100):
        w.heartbeat(0, float(t), float(t), f"hb{t}")
        assert w.judge(POLICY, float(t), paused=False) is None


def test_a_rank_that_dies_after_its_last_step_is_lost_not_hung_even_when_hang_comes_first() -> None:
    """hang_min_s below the heartbeat deadline: the stall since the last step would pass the hang deadline
    before the silence passes the loss deadline, but a rank not heard from since cannot be called hung."""
    policy = PolicySpec(heartbeat_interval_s=1.0, heartbeat_misses=10, hang_min_s=2.0, hang_factor=2.0)
    w = RankWatch(0)
    w.started(0.0, 0.0, "ws")
    w.step_completed(5, 0.1, 1.0, 1.0, "s5")
    w.heartbeat(5, 1.5, 1.5, "hb")
    verdicts = [w.judge(policy, t / 2, paused=False) for t in range(3, 25)]  # up to 12 s: 10.5 s of silence
    assert verdicts[:-1] == [None] * (len(verdicts) - 1) and isinstance(verdicts[-1], Lost)
