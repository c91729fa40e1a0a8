"""The plan `flightdeck plan` prints, as the running resharder service records it: `services.resharder.service`
under the real shell on a real nats-server appends ReshardPlanned into the job's history on a first grant
and a shrink, and nothing for an identical re-grant."""

import asyncio
import time

import pytest

from flightdeck.events import subjects
from flightdeck.events.fleet import NodeRegistered
from flightdeck.events.history import append_to_job, read_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import AllocationGranted, JobSubmitted, SlotRef
from flightdeck.events.plan import ReshardPlanned
from flightdeck.events.spec import EntrypointSpec, JobSpec
from flightdeck.events.training import ModelRegistered
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


async def test_the_running_service_replans_when_the_script_reports_its_model(nats_server: broker_mod.Broker) -> None:
    """A script's ModelRegistered is telemetry: the service ticks after a grant to fold it (prompted by its arrival),
    and records the plan for the script's own model and batch."""
    store = await JetStreamStore.connect(nats_server.url, name="resharder-test")
    stop = asyncio.Event()
    task = asyncio.create_task(run_service(build(), nats_server.url, stop_event=stop))
    job = "tiny-1"
    try:
        await store.append(subjects.node("n0", "NodeRegistered"), NodeRegistered(
            node="n0", kind="cpu", slots=2, devices=["cpu"] * 2, memory_gb=32.0, event_id="agent-n0"))
        script = JobSpec(name="tiny", slots=2, entrypoint=EntrypointSpec(command=["python", "train.py"]))
        await append_to_job(store, JobSubmitted(job_id=job, spec=script, event_id="cli-tiny-1", occurred_at=1.0))
        now = time.time()
        await append_to_job(store, AllocationGranted(job_id=job, attempt=0, event_id="res-0", occurred_at=now,
                                                     assignments=[SlotRef(node="n0", slot=s, rank=s) for s in (0, 1)]))
        (first,) = await plans(store, 1)
        await store.append(subjects.telemetry(job, 0, "ModelRegistered"), ModelRegistered(
            job_id=job, rank=0, attempt=0, event_id="rank0-model", occurred_at=now + 1, params=124_000_000,
            trainable=124_000_000, param_bytes=496_000_000, layers=12, heads=12, hidden=768, vocab=50_257,
            seq_len=512, micro_batch=4, grad_accum=2, world_size=2, source="config"))
        _, registered = await plans(store, 2)
        assert registered.old == first.new and registered.producer == "resharder"
        assert registered.reason.startswith("the model the script registered: 124M parameters (from its config: 12 "
                                            "layers, 12 heads, hidden 768, sequence 512), 16 sequences a step")
        assert registered.new.micro_batch_size * registered.new.grad_accum * registered.new.dp == 16
        assert registered.new.memory_per_gpu_gb > 1.0  # 124M parameters with Adam: ~2 GB, not the defaults' 3 MB
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await store.close()
