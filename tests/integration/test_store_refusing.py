"""A store that refuses a job's checkpoints is an incident, and a job never ends "completed" silently without its
final state (issue 51, case 3).

Tried on 6ade4e9: the store on a 4 MiB filesystem failed 34 uploads, each with a clear ENOSPC line in a log, and
nothing else said so; a crash restored step 50, and the job ended "completed 600/600" with its newest checkpoint
at step 50. Here the job's folder in the store is a file, so every write under it fails (as a full or read-only
store refuses them): after three failed sets in a row the checkpoint service records CheckpointsFailing, the job
trains on with the risk as its phase's reason (policy.on_checkpoint_failures "continue"), and once it completes,
FinalStateUnsaved; `flightdeck status` says both."""

import asyncio
import subprocess
from pathlib import Path

import pytest

from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointFailed, CheckpointsFailing, FinalStateUnsaved
from flightdeck.events.job import JobCompleted, JobFailed, JobPhaseChanged
from flightdeck.events.spec import JobSpec, ModelSpec, TrainSpec
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.tools.audit.settle import verify_live
from tests.integration.lifecycle_harness import Objects, local_objects, open_platform
from tests.integration.test_lifecycle_services import kinds
from tests.integration.test_postmortem_cli import CLI

__all__ = ["local_objects"]  # fixtures

SPEC = JobSpec(name="full", slots=2, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=60, checkpoint_every=10, data="synthetic", snapshot_every=0))


@pytest.mark.timeout(240)
async def test_a_store_that_refuses_a_jobs_checkpoints_is_an_incident_and_its_unsaved_end_is_said(
        nats_server: broker_mod.Broker, tmp_path: Path, local_objects: Objects) -> None:
    job = "full-000001"
    blocked = Path(local_objects.url) / "checkpoints" / job  # a file where the job's folder would be
    blocked.parent.mkdir(parents=True)
    blocked.write_bytes(b"")
    p = await open_platform(nats_server.url, tmp_path, local_objects)
    try:
        p.start_all()
        await p.ready()
        await p.submit(SPEC, job)
        await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 150, "the end", job)
        assert p.seen(JobCompleted, job), kinds(p.job(job))
        await p.until(lambda: bool(p.seen(FinalStateUnsaved, job)), 60, "the final state's verdict", job)

        failed = p.seen(CheckpointFailed, job)
        assert [e.step for e in failed] == [10, 20, 30, 40, 50, 60] and all(e.store for e in failed), failed
        assert p.seen(CheckpointCommitted, job) == []
        (failing,) = p.seen(CheckpointsFailing, job)  # once, at the third
        assert (failing.failures, failing.first_step, failing.step, failing.newest_step) == (3, 10, 30, -1)
        history = p.job(job)
        assert history.index(failing) > history.index(failed[2])
        risky = [e.reason for e in p.seen(JobPhaseChanged, job) if e.phase == "running" and e.reason]
        assert risky and "the store refused 3 in a row since step 10" in risky[0], risky
        assert "training on at that risk" in risky[0]
        (unsaved,) = p.seen(FinalStateUnsaved, job)
        assert (unsaved.step, unsaved.newest_step) == (60, -1) and "no state of it is saved" in unsaved.reason

        run = await asyncio.to_thread(subprocess.run, [*CLI, "status", job, "--nats", p.url],
                                      capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert "completed" in run.stdout and "NOT SAVED" in run.stdout and "REFUSING" in run.stdout, run.stdout
        assert (await verify_live(p.store, job)).ok
    finally:
        await p.close()
