"""A rank that reported the job's last step is exiting, not lost: a torch process takes seconds to tear down on
a busy host (found by the crash drill, tests/e2e/test_drills.py, where heartbeats every 0.5 s are lost after 2 s
and a finished rank took ~2-3 s to exit). Only one silent for the startup grace is lost then."""

from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick
from flightdeck.events.findings import RankHung, RankLost
from flightdeck.events.job import AllocationGranted, JobSubmitted, SlotRef, WorkersStarted
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.training import Heartbeat, StepCompleted
from flightdeck.services.health.core import NAME
from flightdeck.services.health.detectors import STARTUP_GRACE_S, Lost, RankWatch
from tests.unit.health_synth import fold, of

POLICY = PolicySpec(heartbeat_interval_s=0.5, heartbeat_misses=4, hang_min_s=3.0)
STEPS = 10


def tick(at: float) -> ClockTick:
    return ClockTick(service=NAME, now=at, positions={}, event_id=f"tick-{at}", occurred_at=at)


def job_until(last: int, silent_s: float) -> list[Event]:
    """One rank steps 0..last (one step a second), then falls silent; ticks every 0.5 s for `silent_s` more."""
    env = {"job_id": "j", "rank": 0, "attempt": 0, "node": "n1"}
    spec = JobSpec(name="j", slots=1, policy=POLICY, train=TrainSpec(steps=STEPS))
    events: list[Event] = [JobSubmitted(job_id="j", spec=spec, event_id="sub", occurred_at=0.0),
                    AllocationGranted(job_id="j", attempt=0, assignments=[SlotRef(node="n1", slot=0, rank=0)],
                                      event_id="grant", occurred_at=0.0),
                    WorkersStarted(job_id="j", node="n1", attempt=0, ranks=[0], pids=[1], event_id="ws",
                                   occurred_at=0.0)]
    for step in range(last + 1):
        at = 1.0 + step
        events += [StepCompleted(step=step, loss=2.0, grad_norm=1.0, lr=1e-3, tokens_per_s=1.0, step_time_s=1.0,
                                 event_id=f"s{step}", occurred_at=at, **env),
                   Heartbeat(step=step, interval_s=0.5, event_id=f"hb{step}", occurred_at=at + 0.1, **env),
                   tick(at + 0.5)]
    end = 1.0 + last + 0.5
    events += [tick(end + 0.5 * i) for i in range(1, int(silent_s * 2) + 1)]
    return events


def test_a_rank_silent_after_the_last_step_is_neither_lost_nor_hung_while_it_exits() -> None:
    _, found = fold(job_until(STEPS - 1, silent_s=30.0))
    assert of(found, RankLost) == [] and of(found, RankHung) == []


def test_a_rank_silent_before_the_last_step_is_lost_after_the_heartbeat_deadline() -> None:
    _, found = fold(job_until(STEPS - 2, silent_s=3.0))
    (lost,) = of(found, RankLost)
    assert lost.reason == "heartbeats stopped"


def test_a_finished_rank_that_never_exits_is_lost_after_the_startup_grace() -> None:
    w = RankWatch(0)
    w.started(0.0, 0.0, "ws")
    w.step_completed(STEPS - 1, 1.0, 1.0, 1.0, "last")
    assert w.judge(POLICY, 1.0 + STARTUP_GRACE_S, paused=False, last_step=STEPS - 1) is None
    lost = w.judge(POLICY, 1.5 + STARTUP_GRACE_S, paused=False, last_step=STEPS - 1)
    assert isinstance(lost, Lost) and "no exit within" in lost.reason and lost.evidence == ("last",)
    assert w.judge(POLICY, 10.0, paused=False) is not None  # without the job's last step known: plain silence
