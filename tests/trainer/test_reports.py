"""The Emitter: steps handed to the publisher in batches, everything else at once and in order."""

import math
import time
from pathlib import Path

import pytest

from flightdeck.events.base import RankEvent
from flightdeck.events.training import RankFault, StepCompleted
from flightdeck.trainer.reports import Emitter
from tests.trainer import ranks

ENV = {"job_id": "j", "rank": 1, "attempt": 0, "node": "n"}


class ListPublisher:
    """Hand-written fake of the telemetry publisher: remembers what it was given."""

    def __init__(self) -> None:
        self.events: list[RankEvent] = []
        self.step = -99
        self.step_time_s = -1.0
        self.closed = False

    def emit(self, event: RankEvent) -> None:
        self.events.append(event)

    def beat_now(self) -> None:
        pass

    def set_step(self, step: int, step_time_s: float = 0.0) -> None:
        self.step, self.step_time_s = step, step_time_s

    def close(self, timeout: float = 5.0) -> None:
        self.closed = True


def step(i: int) -> StepCompleted:
    return StepCompleted(step=i, loss=1.0, grad_norm=1.0, lr=1e-3, tokens_per_s=1.0, step_time_s=0.1, **ENV)


def test_steps_wait_for_the_batch_and_other_events_flush_them_in_order(tmp_path: Path) -> None:
    pub = ListPublisher()
    em = Emitter(pub, ENV, tmp_path / "events.jsonl", batch_s=60.0)
    em.emit(step(0))
    em.emit(step(1))
    assert pub.events == []  # held: a step alone does not wake the publisher
    em.emit(RankFault(kind="exception", error_type="E", message="m", step=1, **ENV))
    assert [type(e).__name__ for e in pub.events] == ["StepCompleted", "StepCompleted", "RankFault"]
    assert all(e.event_id and e.occurred_at and e.producer == "trainer" for e in pub.events)
    em.emit(step(2))
    em.close()
    assert [getattr(e, "step", None) for e in pub.events][-1] == 2 and pub.closed
    logged = ranks.events(tmp_path / "events.jsonl")
    assert [e["event_id"] for e in logged] == [e.event_id for e in pub.events]  # the log saw every event at once


def test_a_step_after_the_batch_interval_goes_out_with_those_held() -> None:
    pub = ListPublisher()
    em = Emitter(pub, ENV, batch_s=0.05)
    em.emit(step(0))
    time.sleep(0.06)
    em.emit(step(1))
    assert [e.step for e in pub.events if isinstance(e, StepCompleted)] == [0, 1]
    em.emit(step(2))
    em.set_step(2)
    assert len(pub.events) == 2 and pub.step == 2  # the heartbeat's step is never held back
    em.flush()
    assert len(pub.events) == 3


def test_without_steps_to_bus_steps_reach_only_the_log_and_their_time_rides_the_heartbeat(tmp_path: Path) -> None:
    pub = ListPublisher()
    em = Emitter(pub, ENV, tmp_path / "events.jsonl", batch_s=0.0, steps_to_bus=False)
    em.emit(step(0))
    em.set_step(0, 0.1)
    em.emit(RankFault(kind="exception", error_type="E", message="m", step=0, **ENV))
    em.close()
    assert [type(e).__name__ for e in pub.events] == ["RankFault"]  # a fault still goes to the bus
    assert (pub.step, pub.step_time_s) == (0, 0.1)
    assert [e["type"] for e in ranks.events(tmp_path / "events.jsonl")] == ["StepCompleted", "RankFault"]


def test_a_step_reported_before_its_work_is_done_is_timed_whole(tmp_path: Path) -> None:
    """A script that reports and then works on (an optimizer step, logging) had its steps timed up to the report:
    an ETA of "4 ms" on the dashboard, step-time axes of 0."""
    run, _ = ranks.offline_run(tmp_path, {}, steps=4, every=100)
    try:
        work = []  # how long each step's work after its report took, as measured here
        for step in run.steps():
            run.report(step, 1.0, **({"lr": 0.5, "tokens": 100} if step == 2 else {}))
            before = time.perf_counter()
            time.sleep(0.2)  # the step's work, after its report
            work.append(time.perf_counter() - before)
        run.report(3, 2.0)  # a late report of a step that has ended: sent as it comes
    finally:
        run.close()
    logged = ranks.events(tmp_path / "events.jsonl", "StepCompleted")
    reports = [(e["step"], e["loss"], e["step_time_s"]) for e in logged]
    assert [(s, loss) for s, loss, _ in reports] == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0), (3, 2.0)]
    # each step's reported time covers the work done after its report: from the step's start to its end
    assert all(reported >= done for (_, _, reported), done in zip(reports[:4], work, strict=True)), (reports, work)
    # lr and tokens a script does not report are recorded as not reported (NaN), never as a made-up 0
    given = [(e["lr"], e["tokens_per_s"]) for e in logged]
    assert all(math.isnan(float(lr)) and math.isnan(float(tps)) for n, (lr, tps) in enumerate(given) if n != 2), given
    assert given[2][0] == 0.5 and float(given[2][1]) == pytest.approx(100 / reports[2][2])


def test_a_gradient_norm_not_reported_is_recorded_as_unknown_never_as_0(tmp_path: Path) -> None:
    """Issue 52, finding 4: a script that reported no gradient norm showed 0.0, so a comparison of gradient norms
    between two runs of user scripts checked nothing, silently."""
    run, _ = ranks.offline_run(tmp_path, {}, steps=3, every=100)
    try:
        for step in run.steps():
            run.report(step, 1.0, **({"grad_norm": 0.0} if step == 1 else {"grad_norm": 2.5} if step == 2 else {}))
    finally:
        run.close()
    logged = ranks.events(tmp_path / "events.jsonl", "StepCompleted")
    assert [(e["step"], e["grad_norm"], e["schema_version"]) for e in logged] == [(0, None, 3), (1, 0.0, 1),
                                                                                   (2, 2.5, 1)]
    assert not ranks.events(tmp_path / "events.jsonl", "RankFault")  # unknown is not non-finite
