"""A job completes only when its ranks ran every step. A SIGTERM that no part of the platform sent (an eviction, a
node shutting down) or a script that leaves run.steps() early ends in a restart, never in JobCompleted."""

import os
import signal
from pathlib import Path

import msgspec
import pytest

from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.job import JobCompleted, JobFailed, JobResumed, WorkersStarted
from flightdeck.events.nodelocal import STOPPED_EXIT
from flightdeck.events.spec import EntrypointSpec, JobSpec, TrainSpec
from flightdeck.events.training import StepCompleted
from tests.e2e.drill_harness import DRILL_POLICY, drill_spec, paced
from tests.integration.lifecycle_harness import Platform
from tests.integration.test_agent import running
from tests.integration.test_lifecycle_services import exits, kinds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
STEPS = 200


async def test_one_rank_s_sigterm_from_outside_restarts_the_job_and_every_step_runs(drill: Platform) -> None:
    """Trial 1 (86ea31b): `kill -TERM` of rank 1 at step ~62 of 300: every rank saved and exited 0, and the
    scheduler recorded JobCompleted with 80 of 300 steps done."""
    p, job = drill, "evicted-000001"
    p.agent("n1")
    await p.ready("n1")
    await p.submit(drill_spec("evicted", steps=STEPS, faults=[paced(0.05)]), job)  # ~10 s: the SIGTERM lands mid-run
    pids = await running(p, job)
    os.kill(pids[1], signal.SIGTERM)  # what an eviction sends: nobody in the platform asked for it
    await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 200, "the job to end", job)
    # Both saved at the agreed step, then left. The first to exit ends the attempt, and a rank still tearing down
    # its process group when its slot is granted again is killed by the agent (the checkpoint is already written).
    first = p.rank_exits(job)[0]  # in the order recorded
    assert first.attempt == 0 and first.exit_code == STOPPED_EXIT
    assert set(exits(p, job, 0).values()) <= {STOPPED_EXIT, -signal.SIGKILL}
    history = kinds(p.job(job))
    assert history.count("JobResumed") == 1 and history.index("JobResumed") < history.index("JobCompleted")
    (resumed,) = p.seen(JobResumed, job)
    saved = max(e.step for e in p.seen(CheckpointCommitted, job) if e.attempt == 0)
    assert resumed.attempt == 1 and resumed.from_step == saved > 0  # from the checkpoint the SIGTERM wrote
    done = max(e.step for e in p.seen(StepCompleted, job, stream="FD_TELEMETRY") if e.attempt == 0)
    assert done + 1 - resumed.from_step <= 1  # issue 34: a SIGTERM redoes at most the step it interrupted
    assert exits(p, job, 1) == {0: 0, 1: 0}
    steps = {e.step for e in p.seen(StepCompleted, job, stream="FD_TELEMETRY") if e.rank == 0}
    assert steps == set(range(STEPS))


async def test_a_script_that_leaves_the_loop_early_is_not_completed(drill: Platform, tmp_path: Path) -> None:
    p, job = drill, "early-000001"
    script = tmp_path / "train.py"
    script.write_text(
        "import flightdeck\n"
        "run = flightdeck.init()\n"
        "for step in run.steps():\n"
        "    run.report(step, 1.0)\n"
        "    if step == 3:\n"
        "        break  # the job asked for 20 steps\n")
    spec = JobSpec(name="early", slots=1, train=TrainSpec(steps=20, checkpoint_every=50),
                   entrypoint=EntrypointSpec(command=["python", str(script)]),
                   policy=msgspec.structs.replace(DRILL_POLICY, max_restarts=1))
    p.agent("n1", "--slots", "1")
    await p.ready("n1")
    await p.submit(spec, job)
    await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 200, "the job to end", job)
    assert not p.seen(JobCompleted, job), kinds(p.job(job))
    (failed,) = p.seen(JobFailed, job)
    assert "stopped before its last step" in failed.reason
    assert [e.attempt for e in p.seen(WorkersStarted, job)] == [0, 1]
    assert exits(p, job, 0) == {0: STOPPED_EXIT} and exits(p, job, 1) == {0: STOPPED_EXIT}
