"""Preemption end to end on one 2-slot node: a high-priority job stops a running low-priority one, which
saves a final checkpoint on the way out; the high job runs to completion; the low job comes back and
resumes from exactly that checkpoint, then completes."""

import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointStaged
from flightdeck.events.commands import StopRequested
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    JobCompleted,
    JobPreempted,
    JobQueued,
    JobResumed,
    JobSubmitted,
    WorkersStarted,
)
from flightdeck.events.nodelocal import STOPPED_EXIT
from flightdeck.events.spec import FaultSpec, JobSpec, ModelSpec, TrainSpec
from flightdeck.events.training import RankStarted, StepCompleted
from flightdeck.services.checkpoints.core import checkpoint_id
from tests.integration.lifecycle_harness import Objects, Platform, local_objects, platform
from tests.integration.test_lifecycle_services import exits, kinds, phases

__all__ = ["local_objects", "platform"]  # fixtures

LOW, HIGH = "low-000001", "high-000001"
TINY = ModelSpec(d_model=32)
# 0.05 s per step in attempt 0 only (drill faults name their attempt): long enough to be caught running
LOW_SPEC = JobSpec(name="low", priority=10, slots=2, model=TINY,
                   train=TrainSpec(steps=200, checkpoint_every=15, data="synthetic"),
                   faults=[FaultSpec(kind="slow", step=0, rank=0, seconds=0.05)])
HIGH_SPEC = JobSpec(name="high", priority=90, slots=2, model=TINY,
                    train=TrainSpec(steps=30, checkpoint_every=10, data="synthetic"))


@pytest.fixture
def objects(local_objects: Objects) -> Objects:
    """One store is enough here (test_job_checkpoints.py runs the commit path on both)."""
    return local_objects


def first_index(c: Platform, kind: type, job_id: str, attempt: int | None = None) -> int:
    """Position in the control stream (as recorded) of the first `kind` event of the job (and attempt)."""
    return next(i for i, s in enumerate(c.control)
                if isinstance(s.stored.event, kind) and subjects.job_of(s.stored.subject) == job_id
                and (attempt is None or getattr(s.stored.event, "attempt", None) == attempt))


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_preempted_job_checkpoints_yields_and_resumes_from_that_checkpoint(platform: Platform) -> None:
    c = platform
    await c.submit(LOW_SPEC, LOW)
    await c.until(lambda: bool(c.seen(CheckpointCommitted, LOW)), 90, "the low job's first commit", LOW)
    first = c.seen(CheckpointCommitted, LOW)[0].step
    await c.until(lambda: any(e.step > first + 2 for e in c.seen(StepCompleted, LOW, stream=subjects.TELEMETRY)), 30,
                  "the low job to run past its checkpoint", LOW)

    await c.submit(HIGH_SPEC, HIGH)
    await c.until(lambda: bool(c.seen(JobCompleted, HIGH)), 120, "the high job to complete", HIGH)
    (stop,) = c.seen(StopRequested, LOW)
    assert stop.checkpoint is True and HIGH in stop.reason
    (preempted,) = c.seen(JobPreempted, LOW)
    assert preempted.by_job_id == HIGH
    assert exits(c, LOW, 0) == {0: STOPPED_EXIT, 1: STOPPED_EXIT}  # both ranks saved and left on their own
    # The high job got the slots only after the low job's were given back.
    assert first_index(c, AllocationReleased, LOW) < first_index(c, AllocationGranted, HIGH)
    assert "preempted" in [e.reason for e in c.seen(JobQueued, LOW)]

    # The preemption checkpoint: the last set attempt 0 staged, past the one taken before the high job came.
    final = max(e.step for e in c.seen(CheckpointStaged, LOW, stream=subjects.TELEMETRY) if e.attempt == 0)
    assert final > first
    trained = {e.step for e in c.seen(StepCompleted, LOW, stream=subjects.TELEMETRY) if e.attempt == 0}
    assert max(trained) == final - 1  # it stopped at the boundary it checkpointed, and trained no further
    await c.until(lambda: bool(c.seen(JobCompleted, LOW)), 120, "the low job to resume and complete", LOW)
    assert final in {e.step for e in c.seen(CheckpointCommitted, LOW)}
    (resumed,) = c.seen(JobResumed, LOW)
    assert (resumed.attempt, resumed.from_step, resumed.checkpoint_id) == (1, final, checkpoint_id(0, final))
    started = [e for e in c.seen(RankStarted, LOW, stream=subjects.TELEMETRY) if e.attempt == 1]
    assert sorted(e.rank for e in started) == [0, 1] and {e.from_step for e in started} == {final}
    assert [e.attempt for e in c.seen(WorkersStarted, LOW)] == [0, 1]
    assert first_index(c, JobCompleted, HIGH) < first_index(c, WorkersStarted, LOW, attempt=1)
    assert exits(c, LOW, 1) == {0: 0, 1: 0}

    def resumed_steps() -> list[int]:
        return sorted({e.step for e in c.seen(StepCompleted, LOW, stream=subjects.TELEMETRY) if e.attempt == 1})

    # no step before the checkpoint is trained again, and none after it is skipped
    await c.until(lambda: resumed_steps() == list(range(final, LOW_SPEC.train.steps)), 60, "attempt 1's steps")
    high_submitted = c.first_at(JobSubmitted, HIGH)
    at = {"low_released": c.first_at(AllocationReleased, LOW),
          "high_first_step": c.first_at(StepCompleted, HIGH, subjects.TELEMETRY),
          "high_completed": c.first_at(JobCompleted, HIGH), "low_resumed": c.first_at(JobResumed, LOW)}
    print(f"\nlow job checkpointed at {first}, preempted at step {final}; seconds after the high job's submission:",
          {k: round(v - high_submitted, 2) for k, v in at.items()})
    # JobCompleted and the release that follows it are two appends: read the history once both are in
    await c.until(lambda: kinds(c.job(LOW))[-1:] == ["AllocationReleased"] and "JobCompleted" in kinds(c.job(LOW))
                  and phases(c.job(LOW))[-1:] == ["completed"], 60, "the low job's end, release and record")
    history = kinds(c.job(LOW))
    assert history.count("JobCompleted") == 1 and history[-2:] == ["JobCompleted", "AllocationReleased"]
    recorded = phases(c.job(LOW))  # as the scheduler recorded it: stopped for the high job, waited, ran again
    stop = recorded.index("stopping")
    assert recorded[stop - 1:stop + 3] == ["running", "stopping", "preempted", "placing"], recorded
