"""`flightdeck pause`, `checkpoint` and `resume` against a real platform: the ranks stop stepping on a pause,
checkpoint on request at the step they stand at, go on after a resume and complete; a job that is not running is
told so, and nothing is appended."""

import asyncio
import subprocess
from pathlib import Path

import pytest

from events import subjects
from events.checkpoint import CheckpointCommitted
from events.commands import CheckpointRequested, PauseRequested, ResumeRequested
from events.job import JobCompleted
from events.spec import FaultSpec, JobSpec, ModelSpec, TrainSpec
from events.training import StepCompleted
from services.shell import broker as broker_mod
from tests.integration.lifecycle_harness import Objects, local_objects, open_platform
from tests.integration.test_postmortem_cli import CLI

__all__ = ["local_objects"]  # fixture

# No checkpoint of its own (every 1000 steps of 60): the only commit is the one asked for. Paced at 0.2 s a step.
SPEC = JobSpec(name="commanded", slots=2, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=60, checkpoint_every=1000, data="synthetic"),
               faults=[FaultSpec(kind="slow", step=0, rank=0, seconds=0.2)])


async def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(subprocess.run, [*CLI, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(240)
async def test_pause_checkpoint_resume_are_obeyed_in_order(
        nats_server: broker_mod.Broker, tmp_path: Path, local_objects: Objects) -> None:
    job = "commanded-000001"
    p = await open_platform(nats_server.url, tmp_path, local_objects)
    try:
        p.start_all()
        await p.ready("n1")
        await p.submit(SPEC, job)

        def steps() -> list[int]:
            return [e.step for e in p.seen(StepCompleted, job, stream=subjects.TELEMETRY) if e.rank == 0]

        await p.until(lambda: len(steps()) >= 5, 90, "a few steps", job)
        for verb in ("pause", "checkpoint"):
            done = await cli(verb, job, "--nats", p.url)
            assert done.returncode == 0 and "sent" in done.stdout, done.stdout + done.stderr
        await p.until(lambda: bool(p.seen(CheckpointCommitted, job)), 60, "the requested checkpoint", job)
        (commit,) = p.seen(CheckpointCommitted, job)
        assert commit.step == max(steps()) + 1 < SPEC.train.steps  # taken where the paused ranks stand

        done = await cli("resume", job, "--nats", p.url)
        assert done.returncode == 0, done.stderr
        await p.until(lambda: bool(p.seen(JobCompleted, job)), 90, "the job to complete", job)
        kinds = [type(e).__name__ for e in p.job(job) if isinstance(e, PauseRequested | CheckpointRequested
                                                                    | ResumeRequested)]
        assert kinds == ["PauseRequested", "CheckpointRequested", "ResumeRequested"]
        assert all(e.producer == "cli" for e in p.seen(PauseRequested, job))

        late = await cli("pause", job, "--nats", p.url)
        assert late.returncode == 1 and "is completed: only a running job's ranks take commands" in late.stderr
        assert len(p.seen(PauseRequested, job)) == 1
    finally:
        await p.close()
