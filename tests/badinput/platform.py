"""Every service the platform runs, in-process on one real broker, through the real shell (`run_service`):
scheduler, health, resources, resharder, checkpoints (on a local object store) and the node agent core of
`n0` with its real spawner. A fleet node `n1` (no agent) and one granted job `j-...` with started ranks give
the cores something in flight, and make health and checkpoints tick (they fold telemetry at ticks)."""

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flightdeck.events import subjects
from flightdeck.events.fleet import NodeRegistered, SelfCheckPassed
from flightdeck.events.history import append_to_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import AllocationGranted, JobSubmitted, WorkersStarted
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.store import Stored
from flightdeck.services.agent.core import core_service as agent
from flightdeck.services.agent.launch import Launch, Paths
from flightdeck.services.agent.spawner import Spawner
from flightdeck.services.checkpoints import uploader
from flightdeck.services.checkpoints.core import core_service as checkpoints
from flightdeck.services.core import Service
from flightdeck.services.health.core import core_service as health
from flightdeck.services.resharder.core import core_service as resharder
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from flightdeck.services.shell.objects.local import LocalStore
from flightdeck.services.shell.runtime import ConsumerPolicy, consumer_name, run_service
from tests.integration.runtime_helpers import eventually, read_all

SPEC = JobSpec(name="fuzz", slots=2, train=TrainSpec(steps=10_000),
               policy=PolicySpec(heartbeat_interval_s=60.0, hang_min_s=600.0))
POLICY = ConsumerPolicy(max_deliver=5, backoff=(2.0, 5.0), fetch_s=0.2)


@dataclass
class Platform:
    store: JetStreamStore
    services: dict[str, Service[Any]]
    tasks: dict[str, asyncio.Task[None]]
    job: str

    def alive(self) -> dict[str, str]:
        """Services whose shell has ended, and why (empty when all run)."""
        return {n: repr(t.exception() if not t.cancelled() else "cancelled") for n, t in self.tasks.items() if t.done()}

    async def idle(self, name: str) -> bool:
        """The service's durable consumer has nothing pending and nothing unacknowledged."""
        info = await self.store.js.consumer_info(subjects.CONTROL, consumer_name(self.services[name].name))
        return info.num_pending == 0 and info.num_ack_pending == 0

    async def settled(self, within: float = 30.0) -> None:
        """Every service has finished every control input so far (and is still running)."""
        async def done() -> bool:
            assert not self.alive(), f"a service stopped: {self.alive()}"
            return all([await self.idle(n) for n in self.services])
        await eventually(done, within, "every service to finish its control inputs")

    async def control(self) -> list[Stored]:
        return await read_all(self.store, subjects.CONTROL)


def build(tmp: Path, url: str, store: JetStreamStore) -> dict[str, Service[Any]]:
    spawner = Spawner(node="n0", producer="agent-n0", store=store, objects=LocalStore(tmp / "objects"),
                      paths=Paths(tmp / "agent"), launch=Launch(device="cpu", grace_s=1.0))
    return {
        "scheduler": scheduler(), "health": health(tick_s=0.3), "resources": resources(), "resharder": resharder(),
        "checkpoints": checkpoints(uploader.handlers(LocalStore(tmp / "objects"))),
        "agent": agent("n0", spawner.handlers()),
    }


@asynccontextmanager
async def platform(tmp: Path, url: str) -> AsyncIterator[Platform]:
    store = await JetStreamStore.connect(url, name="badinput-test")
    stop = asyncio.Event()
    services = build(tmp, url, store)
    tasks = {n: asyncio.create_task(run_service(s, url, stop_event=stop, policy=POLICY)) for n, s in services.items()}
    job = f"fuzz-{uuid.uuid4().hex[:6]}"
    p = Platform(store, services, tasks, job)
    try:
        for ev in (NodeRegistered(node="n1", kind="cpu", slots=4, event_id="reg-n1", occurred_at=1.0),
                   SelfCheckPassed(node="n1", seconds=0.1, event_id="ok-n1", occurred_at=1.0)):
            await store.append(subjects.node("n1", type(ev).__name__), ev)
        await append_to_job(store, JobSubmitted(job_id=job, spec=SPEC, event_id=f"sub-{job}", occurred_at=2.0,
                                                producer="cli"))

        async def granted() -> bool:
            return await store.last(subjects.CONTROL, subjects.job(job, "AllocationGranted")) is not None
        await eventually(granted, 30, "the job's grant")
        grant = (await store.last(subjects.CONTROL, subjects.job(job, "AllocationGranted")))
        assert grant is not None and isinstance(grant.event, AllocationGranted)
        await append_to_job(store, WorkersStarted(job_id=job, node="n1", attempt=grant.event.attempt, ranks=[0, 1],
                                                  pids=[0, 0], event_id=f"start-{job}", occurred_at=3.0,
                                                  producer="agent-n1"))
        yield p
    finally:
        stop.set()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await store.close()
