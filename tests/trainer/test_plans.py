"""`run.plan` is what the resharder recorded for the rank's world size (trainer/plans.py), read from the job's
history on a real broker: the newest ReshardPlanned of that size, waited for when it lands after the ranks
start, and None (plain data parallelism) when none of that size is recorded."""

import asyncio
import time

import pytest
import structlog

from events.history import append_to_job
from events.jetstream import JetStreamStore
from events.job import JobSubmitted
from events.plan import ParallelPlan, ReshardPlanned
from events.spec import JobSpec
from services.shell import broker as broker_mod
from trainer.plans import recorded_plan

pytestmark = pytest.mark.timeout(90)
LOG = structlog.get_logger("test")
TWO = ParallelPlan(world_size=2, dp=2, micro_batches=2)
FOUR = ParallelPlan(world_size=4, dp=2, tp=2)
ONE = ParallelPlan(world_size=1, dp=1)


async def record(url: str, job_id: str, *plans: ParallelPlan, submit: bool = True) -> None:
    store = await JetStreamStore.connect(url, name="plans-test")
    try:
        if submit:
            await append_to_job(store, JobSubmitted(job_id=job_id, spec=JobSpec(name="p", slots=2),
                                                    event_id=f"submit-{job_id}"))
        old: ParallelPlan | None = None
        for new in plans:
            await append_to_job(store, ReshardPlanned(job_id=job_id, old=old, new=new, reason="test",
                                                      event_id=f"plan-{job_id}-{time.time_ns()}"))
            old = new
    finally:
        await store.close()


def test_the_newest_plan_of_the_ranks_world_size_is_theirs(nats_server: broker_mod.Broker) -> None:
    asyncio.run(record(nats_server.url, "plans-000001", FOUR, ONE, TWO))
    assert recorded_plan(nats_server.url, "plans-000001", 2, LOG, wait_s=20) == TWO


def test_a_plan_recorded_after_the_ranks_started_is_waited_for(nats_server: broker_mod.Broker) -> None:
    asyncio.run(record(nats_server.url, "plans-000002", FOUR))  # the previous attempt's, another world size

    async def late() -> None:
        await asyncio.sleep(1.0)
        await record(nats_server.url, "plans-000002", TWO, submit=False)

    async def both() -> ParallelPlan | None:
        writer = asyncio.create_task(late())
        plan = await asyncio.to_thread(recorded_plan, nats_server.url, "plans-000002", 2, LOG, 30)
        await writer
        return plan

    assert asyncio.run(both()) == TWO


def test_no_plan_of_this_size_gives_none_after_the_wait(nats_server: broker_mod.Broker) -> None:
    asyncio.run(record(nats_server.url, "plans-000003", FOUR))
    assert recorded_plan(nats_server.url, "plans-000003", 2, LOG, wait_s=2) is None
