"""`flightdeck pause`, `checkpoint`, `rollback` and `resume` against a real platform: the ranks stop stepping on a
pause, checkpoint on request at the step they stand at, roll back while paused, go on after a resume and complete;
a job that is not running, a pause of a paused job and a resume of a running one are told so, and nothing is
appended."""

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.commands import CheckpointRequested, PauseRequested, ResumeRequested, RollbackRequested
from flightdeck.events.job import JobCompleted, RollbackAsked
from flightdeck.events.spec import FaultSpec, JobSpec, ModelSpec, TrainSpec
from flightdeck.events.training import RolledBack, StepCompleted
from flightdeck.services.shell import broker as broker_mod
from tests.integration.lifecycle_harness import Objects, local_objects, open_platform
from tests.integration.test_postmortem_cli import CLI

__all__ = ["local_objects"]  # fixture

# No checkpoint of its own (every 1000 steps of 100): the only commit is the one asked for. Paced at 0.5 s a step so
# the pause lands mid-run: two CLI calls, each a fresh interpreter, took over 20 s together in a loaded suite run, so
# the pause gets 50 s; every later command is sent while the ranks are paused, so no pace can race them.
SPEC = JobSpec(name="commanded", slots=2, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=100, checkpoint_every=1000, data="synthetic"),
               faults=[FaultSpec(kind="slow", step=0, rank=0, seconds=0.5)])


async def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(subprocess.run, [*CLI, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(420)
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

        await p.until(lambda: len(steps()) >= 2, 90, "a few steps", job)
        early = await cli("resume", job, "--nats", p.url)  # a running job is not paused: nothing to resume
        assert early.returncode == 1 and f"{job} is running, not paused; nothing sent" in early.stderr, early.stderr
        done = await cli("pause", job, "--nats", p.url)
        assert done.returncode == 0 and "PauseRequested sent" in done.stdout, done.stdout + done.stderr
        done = await cli("checkpoint", job, "--json", "--nats", p.url)  # what a script reads
        assert done.returncode == 0 and json.loads(done.stdout) == {"job_id": job, "sent": "CheckpointRequested"}, \
            done.stdout + done.stderr
        again = await cli("pause", job, "--nats", p.url)
        assert again.returncode == 1 and f"{job} is paused already (pause by the user)" in again.stderr, again.stderr
        shown = await cli("status", job, "--json", "--nats", p.url)
        assert json.loads(shown.stdout)["phase"] == "paused", shown.stdout + shown.stderr
        await p.until(lambda: bool(p.seen(CheckpointCommitted, job)), 60, "the requested checkpoint", job)
        (commit,) = p.seen(CheckpointCommitted, job)
        assert commit.step == max(steps()) + 1 < SPEC.train.steps  # taken where the paused ranks stand

        # an operator's rollback to that checkpoint, skipping a window of batches: the scheduler decides it, and the
        # paused ranks obey it
        back = await cli("rollback", job, "--to-step", str(commit.step + 1000), "--skip", "1000:1003", "--nats", p.url)
        assert back.returncode == 0 and f"rollback to {commit.checkpoint_id} asked" in back.stdout, back.stderr
        await p.until(lambda: bool(p.seen(RolledBack, job, stream=subjects.TELEMETRY)), 60, "the ranks to roll back",
                      job)
        assert max(steps()) + 1 == commit.step  # still paused: not a step since the pause
        done = await cli("resume", job, "--nats", p.url)
        assert done.returncode == 0, done.stderr
        (asked,) = p.seen(RollbackAsked, job)
        (decided,) = p.seen(RollbackRequested, job)
        assert (decided.checkpoint_id, decided.to_step, decided.skip_from, decided.skip_to, decided.trigger_id) == \
               (commit.checkpoint_id, commit.step, 1000, 1003, asked.event_id)
        assert decided.reason.startswith(f"asked by cli: roll back to {commit.checkpoint_id} (step {commit.step}) "
                                         "and skip batches [1000, 1003)")
        assert {(e.checkpoint_id, e.skip_from, e.skip_to) for e in p.seen(RolledBack, job, stream=subjects.TELEMETRY)} \
               == {(commit.checkpoint_id, 1000, 1003)}
        await p.until(lambda: bool(p.seen(JobCompleted, job)), 180, "the job to complete", job)
        kinds = [type(e).__name__ for e in p.job(job) if isinstance(e, PauseRequested | CheckpointRequested
                                                                    | ResumeRequested)]
        assert kinds == ["PauseRequested", "CheckpointRequested", "ResumeRequested"]  # the refused ones: not sent
        assert all(e.producer == "cli" for e in p.seen(PauseRequested, job))

        late = await cli("pause", job, "--nats", p.url)
        assert late.returncode == 1 and "is completed: only a running job's ranks take commands" in late.stderr
        assert len(p.seen(PauseRequested, job)) == 1
        late = await cli("rollback", job, "--to-step", "5", "--nats", p.url)
        assert late.returncode == 1 and "is completed: only a running job rolls back" in late.stderr
        bad = await cli("rollback", job, "--to-step", "5", "--skip", "9:3", "--nats", p.url)
        assert bad.returncode == 2 and "is not FROM:TO" not in bad.stderr and "0 <= FROM < TO" in bad.stderr
        assert len(p.seen(RollbackAsked, job)) == 1
    finally:
        await p.close()
