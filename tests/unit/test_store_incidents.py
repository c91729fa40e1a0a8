"""The scheduler applies the job's policy when the store refuses its checkpoints (issue 51, case 3): on 6ade4e9 a
full store failed 34 uploads and nothing but log lines said so. "continue" trains on with the risk as its running
phase's reason until the store recovers; "pause" pauses the job and asks the operator."""

from msgspec.structs import replace

from flightdeck.events.checkpoint import CheckpointsFailing, CheckpointsRecovered, FinalStateSaved, FinalStateUnsaved
from flightdeck.events.commands import PauseRequested
from flightdeck.events.job import JobPhaseChanged, JobSubmitted
from flightdeck.services.resources.core import core_service as resources_core
from flightdeck.services.scheduler.core import core_service as scheduler_core
from flightdeck.services.tools.console import status
from flightdeck.services.tools.history import jobview
from tests.unit.helpers import Bus, register, spec

JOB = "llm-000001"
FAILING = CheckpointsFailing(job_id=JOB, failures=3, first_step=60, step=80, newest_step=50,
                             reason="node n1 could not store its ranks' shards: No space left on device")


def running(policy: str) -> Bus:
    bus = Bus([scheduler_core(memory_wait=False), resources_core()])
    job_spec = spec("llm", slots=2)
    job_spec = replace(job_spec, policy=replace(job_spec.policy, on_checkpoint_failures=policy))
    bus.publish(register("n1", 2), JobSubmitted(job_id=JOB, spec=job_spec))
    bus.start_workers(bus.last_grant(JOB))
    return bus


def phases(bus: Bus) -> list[tuple[str, str]]:
    return [(e.phase, e.reason) for e in bus.of(JobPhaseChanged, JOB)]


def test_continue_trains_on_with_the_risk_named_until_the_store_recovers() -> None:
    bus = running("continue")
    bus.publish(FAILING)
    phase, reason = phases(bus)[-1]
    assert phase == "running" and "the store refused 3 in a row since step 60" in reason
    assert "No space left on device" in reason and "the newest saved step is 50" in reason
    assert "training on at that risk" in reason and not bus.of(PauseRequested, JOB)
    bus.publish(CheckpointsRecovered(job_id=JOB, step=90, failures=4))
    assert phases(bus)[-1] == ("running", "")


def test_pause_pauses_the_job_and_asks_the_operator() -> None:
    bus = running("pause")
    bus.publish(FAILING)
    (asked,) = bus.of(PauseRequested, JOB)
    assert "the newest saved step is 50" in asked.reason and f"flightdeck resume {JOB}" in asked.reason
    assert phases(bus)[-1] == ("paused", asked.reason)
    bus.publish(FAILING)  # said again: asked once
    assert len(bus.of(PauseRequested, JOB)) == 1


def test_status_reads_the_incident_and_the_unsaved_end_from_the_record() -> None:
    """The job view (status, the dashboard, /metrics) shows what the checkpoint service recorded, as recorded."""
    job_spec = replace(spec("llm", slots=2, steps=60), train=replace(spec("llm").train, steps=60, checkpoint_every=10))
    history = [JobSubmitted(job_id=JOB, spec=job_spec), FAILING]
    view = jobview.fold(JOB, history)
    assert "since step 60" in view.store_failing and "No space left on device" in view.store_failing
    assert jobview.fold(JOB, [*history, CheckpointsRecovered(job_id=JOB, step=90, failures=3)]).store_failing == ""
    done = [*history, JobPhaseChanged(job_id=JOB, phase="completed", attempt=0, restarts=0, reason=""),
            FinalStateUnsaved(job_id=JOB, step=60, newest_step=50, reason="its final checkpoint failed: ENOSPC; "
                                                                          "the newest saved state is step 50")]
    view = jobview.fold(JOB, done)
    assert view.phase == "completed" and "the newest saved state is step 50" in view.final_unsaved
    assert not view.final_checkpoint_pending  # nothing more to wait for: the verdict is in
    assert "NOT SAVED" in status.details(view, now=0.0)
    # its final set committed after all (it came late): the service's FinalStateSaved ends the finding
    amended = jobview.fold(JOB, [*done, FinalStateSaved(job_id=JOB, step=60, checkpoint_id="step000000060-a0")])
    assert amended.final_unsaved == "" and "NOT SAVED" not in status.details(amended, now=0.0)
