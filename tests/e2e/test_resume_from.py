"""A failed job continued by a new one (`flightdeck submit --resume-from JOB`), and a job that starts from another
job's weights alone (`[init_from] what = "model"`): the new job restores exactly the checkpoint the client chose,
both histories say so, and the continued job runs only the steps the failed one had not. Before, `resume` and
`rollback` refused a failed job and the workaround was loading its store folder by hand."""

import asyncio
import os
import subprocess
import sys

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.job import CheckpointAdopted, JobCompleted, JobFailed, JobSubmitted
from flightdeck.events.spec import FaultSpec, InitFrom
from flightdeck.events.training import RankStarted, StepCompleted
from flightdeck.services.tools.client import Client
from tests.e2e.drill_harness import drill_spec, paced
from tests.integration.lifecycle_harness import Platform
from tests.integration.test_lifecycle_services import ROOT, kinds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def test_a_failed_job_is_continued_and_another_starts_from_its_weights(drill: Platform) -> None:
    p, old = drill, "first-000001"
    p.agent("n1")
    await p.ready("n1")
    crashing = drill_spec("first", steps=40, faults=[paced(), FaultSpec(kind="crash", step=27, rank=1)],
                          max_restarts=0)
    await p.submit(crashing, old)
    await p.until(lambda: bool(p.seen(JobFailed, old)), 120, "the first job to fail", old)
    assert max(c.step for c in p.seen(CheckpointCommitted, old)) >= 10, kinds(p.job(old))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "flightdeck.services.tools.console", "submit",
                                                    "--resume-from", old, "--nats", p.url],
                                   env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    new = done.stdout.strip()
    await p.until(lambda: bool(p.seen(JobCompleted, new) or p.seen(JobFailed, new)), 180, "the continuation", new)
    assert p.seen(JobCompleted, new), kinds(p.job(new))
    (submitted,) = p.seen(JobSubmitted, new)
    # the newest commit of the failed job when the client chose: its ranks' snapshots, persisted as the job failed,
    # may commit after JobFailed (CI once saw step 25 land after it)
    chose_at = next(s.stored.seq for s in p.control if s.stored.event == submitted)
    newest = max((s.event for s in p.control if isinstance(s.stored.event, CheckpointCommitted)
                  and subjects.job_of(s.stored.subject) == old and s.stored.seq < chose_at), key=lambda c: c.step)
    assert submitted.spec.init_from == InitFrom(job=old, what="all", checkpoint_id=newest.checkpoint_id,
                                                checkpoint_step=newest.step, manifest_sha256=newest.manifest_sha256)
    assert submitted.spec.faults == [] and submitted.spec.train == crashing.train
    (adopted,) = p.seen(CheckpointAdopted, old)  # the old job's history says who went on from it
    assert (adopted.by_job, adopted.checkpoint_id, adopted.step, adopted.what) == (
        new, newest.checkpoint_id, newest.step, "all")
    started = p.seen(RankStarted, new, stream=subjects.TELEMETRY)
    assert sorted((e.rank, e.from_step, e.restored_from) for e in started) == [
        (0, newest.step, "store"), (1, newest.step, "store")]
    await p.until(lambda: any(e.step == 39 for e in p.seen(StepCompleted, new, stream=subjects.TELEMETRY)), 30,
                  "the last step's report", new)
    assert min(e.step for e in p.seen(StepCompleted, new, stream=subjects.TELEMETRY)) == newest.step

    # The weights only: a new job that starts at step 0 from the failed job's model.
    tuned = msgspec.structs.replace(drill_spec("tuned", steps=10, checkpoint_every=5),
                                    init_from=InitFrom(job=old, what="model"))
    async with await Client.connect(p.url) as fd:
        third = await fd.submit(tuned)
    await p.until(lambda: bool(p.seen(JobCompleted, third) or p.seen(JobFailed, third)), 180, "the tuned job", third)
    assert p.seen(JobCompleted, third), kinds(p.job(third))
    started = p.seen(RankStarted, third, stream=subjects.TELEMETRY)
    assert sorted((e.rank, e.from_step, e.restored_from) for e in started) == [(0, 0, "store"), (1, 0, "store")]
    await p.until(lambda: any(e.step == 0 for e in p.seen(StepCompleted, third, stream=subjects.TELEMETRY)), 30,
                  "the first step's report", third)

    def loss(job: str, step: int) -> float:
        return next(e.loss for e in p.seen(StepCompleted, job, stream=subjects.TELEMETRY) if e.step == step
                    and e.rank == 0)
    first, trained = loss(old, 0), loss(old, newest.step - 1)
    # its first loss is the trained model's, not a fresh one's (the same seed and data: a fresh one's is `first`)
    assert abs(loss(third, 0) - trained) < abs(loss(third, 0) - first), (first, trained, loss(third, 0))
    assert [a.by_job for a in p.seen(CheckpointAdopted, old)] == [new, third]
