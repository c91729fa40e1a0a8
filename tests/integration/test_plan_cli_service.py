"""The plan `flightdeck plan` prints, as the running resharder service records it: `services.resharder.service`
under the real shell on a real nats-server appends ReshardPlanned into the job's history on a first grant
and a shrink, and nothing for an identical re-grant."""

import asyncio

import pytest
from flightdeck.events import subjects
from flightdeck.events.fleet import NodeRegistered
from flightdeck.events.history import append_to_job, read_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import AllocationGranted, JobSubmitted, SlotRef
from flightdeck.events.plan import ReshardPlanned
from flightdeck.events.spec import JobSpec
from flightdeck.services.resharder.service import build
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.runtime import run_service

pytestmark = pytest.mark.timeout(60)


def grant(attempt: int, nodes: list[str]) -> AllocationGranted:
    return AllocationGranted(job_id="tiny-1", attempt=attempt, event_id=f"res-{attempt}", occurred_at=10.0 + attempt,
                             assignments=[SlotRef(node=n, slot=0, rank=r) for r, n in enumerate(nodes)])


async def plans(store: JetStreamStore, count: int) -> list[ReshardPlanned]:
    for _ in range(150):
        found = [s.event for s in await read_job(store, "tiny-1") if isinstance(s.event, ReshardPlanned)]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.1)
    raise AssertionError(f"fewer than {count} ReshardPlanned after 15 s")


async def test_the_running_service_plans_a_first_grant_and_a_shrink_once_each(nats_server: broker_mod.Broker) -> None:
    store = await JetStreamStore.connect(nats_server.url, name="resharder-test")
    stop = asyncio.Event()
    task = asyncio.create_task(run_service(build(), nats_server.url, stop_event=stop))
    try:
        for node in ("n0", "n1"):
            await store.append(subjects.node(node, "NodeRegistered"), NodeRegistered(
                node=node, kind="cpu", slots=1, devices=["cpu"], memory_gb=8.0, event_id=f"agent-{node}"))
        await append_to_job(store, JobSubmitted(job_id="tiny-1", spec=JobSpec(name="tiny", slots=2),
                                                event_id="cli-tiny-1", occurred_at=1.0))
        await append_to_job(store, grant(0, ["n0", "n1"]))
        (first,) = await plans(store, 1)
        await append_to_job(store, grant(1, ["n1", "n0"]))  # the same world on the same kind of slots
        await append_to_job(store, grant(2, ["n0"]))  # n1 lost
        await plans(store, 2)
        await asyncio.sleep(0.5)  # time enough for a stray third to land; the history below is checked whole
        history = await read_job(store, "tiny-1")  # checks the versions are contiguous
        found = [s.event for s in history if isinstance(s.event, ReshardPlanned)]
        assert len(found) == 2
        assert first.old is None and first.new.world_size == 2 and first.causation_id == "res-0"
        assert first.producer == "resharder" and first.occurred_at == 10.0
        assert found[1].old == first.new and found[1].new.world_size == 1 and found[1].causation_id == "res-2"
        assert found[1].new.micro_batch_size * found[1].new.grad_accum == 8  # the global batch, on one rank
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await store.close()
