"""The Python client (`flightdeck.client`) against a real platform: a job submitted through it is followed as typed
catalog events in the order they were recorded until it ends, `wait` returns the ended view, `history` reads back
the same control events; a cancel through it ends a queued job; an unknown job, a command to a job that is not
running and an unreachable broker each raise ClientError naming what to do, appending nothing."""

import re
import sys
from pathlib import Path

import pytest

from flightdeck.client import Client, ClientError
from flightdeck.events.base import JobEvent
from flightdeck.events.commands import PauseRequested
from flightdeck.events.job import (
    AllocationReleased,
    CancelRequested,
    JobCancelled,
    JobCompleted,
    JobPhaseChanged,
    JobSubmitted,
    WorkersStarted,
)
from flightdeck.events.spec import JobSpec, ModelSpec, TrainSpec
from flightdeck.events.training import StepCompleted
from flightdeck.services.shell import broker as broker_mod
from tests.integration.lifecycle_harness import Objects, local_objects, open_platform

__all__ = ["local_objects"]  # fixture

SPEC = JobSpec(name="client", slots=2, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=12, checkpoint_every=6, data="synthetic"))
HUGE = JobSpec(name="huge", slots=64, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=12, batch_size=64, data="synthetic"))
UNRUNNABLE = JobSpec(name="bad", slots=4, model=ModelSpec(d_model=32), train=TrainSpec(batch_size=2))


@pytest.mark.timeout(240)
async def test_a_job_submitted_through_the_client_is_followed_to_its_end(
        nats_server: broker_mod.Broker, tmp_path: Path, local_objects: Objects) -> None:
    p = await open_platform(nats_server.url, tmp_path, local_objects)
    try:
        p.start_all()
        await p.ready("n1")
        async with await Client.connect(nats_server.url) as fd:
            job = await fd.submit(SPEC)
            assert job.startswith("client-")
            seen = [e async for e in fd.events(job)]
            view = await fd.wait(job, timeout_s=30)
            history = await fd.history(job)
            queued = await fd.submit(HUGE)  # more slots than the fleet has: it waits in the queue
            before = await fd.cancel(queued, "not needed")
            cancelled = await fd.wait(queued, timeout_s=60)
            with pytest.raises(ClientError, match=r"train.batch_size \(2\) must be at least slots \(4\)") as bad:
                await fd.submit(UNRUNNABLE)
            with pytest.raises(ClientError, match="only a running job's ranks take commands"):
                await fd.pause(job)
            with pytest.raises(ClientError, match="no job 'nope-000000'") as missing:
                await fd.status("nope-000000")
            listed = [v.job_id for v in await fd.jobs()]
        assert isinstance(seen[0], JobSubmitted) and isinstance(seen[-1], JobEvent)
        control = [e for e in seen if isinstance(e, JobEvent) and not isinstance(e, StepCompleted)
                   and e.job_version > 0]
        assert [e.job_version for e in control] == list(range(1, len(control) + 1))  # in recorded order, none twice
        assert control == [e for e in history if isinstance(e, JobEvent)
                           and 0 < e.job_version <= control[-1].job_version]  # node records are not numbered
        assert any(isinstance(e, WorkersStarted) for e in seen)
        assert sorted({e.step for e in seen if isinstance(e, StepCompleted)}) == list(range(12))
        # the follow ended at the end: the scheduler's JobCompleted (and the release with it), then its record
        assert [type(e) for e in control[-3:]] == [JobCompleted, AllocationReleased, JobPhaseChanged], control[-3:]
        assert control[-3] in history and control[-1].phase == "completed"  # type: ignore[attr-defined]
        assert (view.phase, view.steps_done) == ("completed", 12)
        assert before.phase in ("submitted", "queued"), before.phase  # what the cancel was sent against
        assert cancelled.phase == "cancelled" and [e.reason for e in p.seen(CancelRequested, queued)] == ["not needed"]
        assert p.seen(JobCancelled, queued) and not p.seen(PauseRequested, job)
        assert missing.value.code == 2 and bad.value.code == 2 and listed == [job, queued]  # nothing of "bad"
    finally:
        await p.close()


async def test_an_unreachable_broker_is_one_clear_error() -> None:
    with pytest.raises(ClientError, match=re.escape("cannot reach the broker at nats://127.0.0.1:1")):
        await Client.connect("nats://127.0.0.1:1")


def test_the_client_does_not_import_torch() -> None:
    import subprocess
    code = "import sys, flightdeck.client; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
