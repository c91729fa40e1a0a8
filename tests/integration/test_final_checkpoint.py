"""A completed job's final checkpoint may be committed just after its JobCompleted: the checkpoint service folds
the ranks' stagings at its ticks (docs/internals.md, 5). A follower asking for the job's end gets it with that
checkpoint: `Client.wait` and `Client.events` (and with them `flightdeck watch`, `submit --wait` and the demo)
go on past JobCompleted until the final step's checkpoint is committed or failed, or until the checkpoint service
has stopped looking for it. A run of the suite under load once saw the demo count 16 commits where `status`,
a moment later, showed 17."""

import asyncio
import time
import uuid
from typing import Any

from flightdeck.client import Client
from flightdeck.events.base import JobEvent
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointFailed, DataPosition
from flightdeck.events.history import append_to_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import JobCompleted, JobSubmitted
from flightdeck.events.spec import JobSpec, ModelSpec, TrainSpec
from flightdeck.services.shell import broker as broker_mod
from tests.conftest import ensure_streams_at

SPEC = JobSpec(name="final", slots=1, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=6, checkpoint_every=3, data="synthetic"))
HANG_GUARD_S = 60.0  # a hang guard, not a speed bound


def stamped(cls: type[JobEvent], job_id: str, **fields: Any) -> JobEvent:
    return cls(job_id=job_id, event_id=uuid.uuid4().hex, occurred_at=time.time(), producer="test", **fields)


def committed(job_id: str, step: int) -> JobEvent:
    return stamped(CheckpointCommitted, job_id, checkpoint_id=f"step{step:09d}-a0", step=step, world_size=1,
                   uri=f"file:///nowhere/{job_id}/{step}", bytes=1, data=DataPosition(next_batch=step))


async def completed_without_its_final(url: str, job_id: str) -> JetStreamStore:
    """The job's history up to its JobCompleted: its step-3 checkpoint committed, the step-6 one not yet."""
    await asyncio.to_thread(ensure_streams_at, url)
    store = await JetStreamStore.connect(url)
    history = [stamped(JobSubmitted, job_id, spec=SPEC), committed(job_id, 3), stamped(JobCompleted, job_id, steps=6)]
    for event in history:
        await append_to_job(store, event)
    return store


async def test_wait_and_events_go_past_the_end_until_the_final_checkpoint_is_committed(
        nats_server: broker_mod.Broker) -> None:
    job_id = "final-000001"
    store = await completed_without_its_final(nats_server.url, job_id)
    try:
        async with await Client.connect(nats_server.url) as fd:
            waiting = asyncio.create_task(fd.wait(job_id, timeout_s=HANG_GUARD_S))

            async def collect() -> list[Any]:
                return [e async for e in fd.events(job_id, telemetry=False)]
            following = asyncio.create_task(collect())
            before = await fd.status(job_id)
            await asyncio.sleep(0.5)  # both have read the job's end by now, or will: either way they must wait
            assert before.phase == "completed" and before.final_checkpoint_pending
            assert not waiting.done() and not following.done()
            await append_to_job(store, committed(job_id, 6))
            view = await waiting
            seen = await following
    finally:
        await store.close()
    assert view.phase == "completed" and not view.final_checkpoint_pending
    assert [c.step for c in view.checkpoints] == [3, 6]
    assert [type(e).__name__ for e in seen] == ["JobSubmitted", "CheckpointCommitted", "JobCompleted",
                                                "CheckpointCommitted"]


async def test_a_final_checkpoint_that_fails_ends_the_wait_and_one_that_never_comes_is_waited_for_a_bound(
        nats_server: broker_mod.Broker) -> None:
    failed_job, silent_job = "final-000002", "final-000003"
    store = await completed_without_its_final(nats_server.url, failed_job)
    try:
        for event in (stamped(JobSubmitted, silent_job, spec=SPEC), stamped(JobCompleted, silent_job, steps=6)):
            await append_to_job(store, event)
        async with await Client.connect(nats_server.url) as fd:
            waiting = asyncio.create_task(fd.wait(failed_job, timeout_s=HANG_GUARD_S))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            await append_to_job(store, stamped(CheckpointFailed, failed_job, step=6, reason="a shard's sha256 differs",
                                               checkpoint_id="step000000006-a0"))
            failed = await waiting
            # The checkpoint service stops looking for a final set 30 s after the end (LINGER_S): so does a wait.
            silent = await fd.wait(silent_job, timeout_s=HANG_GUARD_S, final_wait_s=0.5)
            silent_events = [type(e).__name__ async for e in fd.events(silent_job, telemetry=False, final_wait_s=0.5)]
    finally:
        await store.close()
    assert failed.phase == "completed" and failed.final_failed and failed.checkpoint_failures == 1
    assert not failed.final_checkpoint_pending and [c.step for c in failed.checkpoints] == [3]
    assert silent.phase == "completed" and silent.final_checkpoint_pending and silent.checkpoints == ()
    assert silent_events == ["JobSubmitted", "JobCompleted"]
