"""The demo's incident summary: each injected fault matched to its detection, decision and resumed training."""

from flightdeck.events.base import Event
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import LossSpikeDetected, RankHung, RankLost, SpikeDiagnosed
from flightdeck.events.job import AllocationRequested, JobCompleted, JobResumed, JobSubmitted, WorkersExited
from flightdeck.events.spec import JobSpec
from flightdeck.events.training import FaultInjected, RolledBack, StepCompleted
from flightdeck.services.tools.console.drill_summary import incidents, render

J = "demo-1"


def step(attempt: int, n: int, at: float) -> StepCompleted:
    return StepCompleted(job_id=J, rank=0, attempt=attempt, step=n, loss=2.0, grad_norm=1.0, lr=0.1,
                         tokens_per_s=1.0, step_time_s=0.1, occurred_at=at)


def history() -> list[Event]:
    return [
        JobSubmitted(job_id=J, spec=JobSpec(name="demo"), occurred_at=100.0),
        FaultInjected(job_id=J, rank=0, kind="slow", step=0, occurred_at=101.0),
        FaultInjected(job_id=J, rank=0, kind="loss_spike", step=40, occurred_at=110.0),
        LossSpikeDetected(job_id=J, rank=0, attempt=0, step=40, loss=9.0, baseline=3.0, mad=0.1, z=40.0,
                          threshold=6.0, occurred_at=110.5),
        RollbackRequested(job_id=J, checkpoint_id="step000000030-a0", to_step=30, skip_from=40, skip_to=45,
                          reason="spike", occurred_at=110.5),
        step(0, 44, 111.0),  # still on the thrown-away timeline
        RolledBack(job_id=J, rank=0, checkpoint_id="step000000030-a0", to_step=30, skip_from=40, skip_to=45,
                   timeline=1, occurred_at=112.0),
        step(0, 30, 112.5),
        SpikeDiagnosed(job_id=J, rank=0, attempt=0, finding_id="f", step=40, onset=40, verdict="data", reason="why",
                       replayed=True, reproduced=True, replay_s=1.25, occurred_at=115.0),
        FaultInjected(job_id=J, rank=1, kind="crash", step=90, occurred_at=120.0),
        WorkersExited(job_id=J, node="n", attempt=0, rank=1, exit_code=3, occurred_at=120.2),
        AllocationRequested(job_id=J, slots=2, attempt=1, occurred_at=120.2),
        RankLost(job_id=J, rank=1, attempt=0, reason="exited with code 3", last_seen=120.0, occurred_at=121.0),
        JobResumed(job_id=J, attempt=1, from_step=80, checkpoint_id="step000000080-a0-t1", world_size=2,
                   occurred_at=121.5),
        step(1, 80, 126.0),
        FaultInjected(job_id=J, rank=0, attempt=1, kind="hang", step=120, occurred_at=130.0),
        RankHung(job_id=J, rank=0, attempt=1, step=119, stalled_s=3.2, deadline_s=3.0, occurred_at=133.5),
        AllocationRequested(job_id=J, slots=2, attempt=2, occurred_at=133.5),
        step(2, 120, 140.0),
        JobCompleted(job_id=J, steps=160, occurred_at=150.0),
    ]


def test_each_fault_gets_its_detection_decision_and_resumption() -> None:
    events = history()
    base, found = incidents(reversed(events))  # the order the readers delivered them in does not matter
    assert base == 100.0
    assert [(i.kind, i.action) for i in found] == [("loss_spike", "rollback"), ("crash", "restart"),
                                                    ("hang", "restart")]
    spike, crash, hang = found
    assert spike.detected is not None and spike.detected.text == "LossSpikeDetected on rank 0 at step 40"
    assert spike.resumed is not None and spike.resumed.at == 12.5  # the redone step 30, not step 44 before it
    assert spike.findings == ("LossSpikeDetected",) and spike.cause == "data (re-run 1.2 s): why"
    assert crash.detected is not None and crash.detected.text == "rank 1 exited with code 3"
    assert crash.findings == ("RankLost",)
    assert crash.resumed is not None and crash.resumed.text.endswith("from step000000080-a0-t1")
    assert hang.findings == ("RankHung",) and hang.decision is not None and hang.decision.at == 33.5
    lines = render(events)
    assert lines[-1] == "  completed 160 steps at 50.0s"
    assert "skip batches [40, 45)" in "\n".join(lines)
    assert "     cause      data (re-run 1.2 s): why" in lines


def test_a_fault_nothing_noticed_shows_dashes() -> None:
    events: list[Event] = [JobSubmitted(job_id=J, spec=JobSpec(name="demo"), occurred_at=1.0),
                           FaultInjected(job_id=J, rank=0, kind="crash", step=3, occurred_at=2.0)]
    assert render(events)[2:] == ["     detected   -", "     decided    -", "     resumed    -"]
