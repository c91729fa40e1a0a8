"""The parallel plan Flightdeck recorded for this attempt's world size: the resharder's newest ReshardPlanned in
the job's history, read when a script first asks for `run.plan`.

The resharder plans from the same grant that starts the ranks, so its event may land a moment after they
start: the read waits for a plan of this world size (the resharder records one only when the plan changes,
so the newest one of this size is this attempt's). Without a resharder it gives up after PLAN_WAIT_S and the
script gets plain data parallelism, the same on every rank."""

import asyncio
import threading
import uuid
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from events import codec, subjects
from events.plan import ParallelPlan, ReshardPlanned
from trainer import bus

PLAN_WAIT_S = 30.0


def recorded_plan(url: str, job_id: str, world_size: int, log: Any,
                  wait_s: float = PLAN_WAIT_S) -> ParallelPlan | None:
    """The newest recorded plan of the job if it is for `world_size`, waiting up to `wait_s` for one; else None."""
    found: list[ParallelPlan | None] = [None]

    def run() -> None:
        found[0] = asyncio.run(_read(url, job_id, world_size, log, wait_s))

    # A thread of its own: the caller's thread may already run an event loop (a notebook, an async trainer).
    reader = threading.Thread(target=run, name="plan-reader", daemon=True)
    reader.start()
    reader.join(wait_s + 10.0)
    return found[0]


async def _read(url: str, job_id: str, world_size: int, log: Any, wait_s: float) -> ParallelPlan | None:
    newest: list[ParallelPlan] = []
    ready = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        try:
            ev = codec.decode(msg.data)
        except codec.UndecodableEvent:
            ev = None
        if isinstance(ev, ReshardPlanned):
            newest[:] = [ev.new]
        if msg.metadata.num_pending == 0 and newest and newest[0].world_size == world_size:
            ready.set()

    try:
        nc = await asyncio.wait_for(bus.connect(url, f"fd-plan-{job_id}", log), wait_s)
    except TimeoutError:
        log.warning("plan.broker_unreachable", wait_s=wait_s)
        return None
    try:
        # Named, with the job's history as its one filter: what a job's ranks may read (security/permissions.py).
        config = ConsumerConfig(name=f"plan-{uuid.uuid4().hex}", ack_policy=AckPolicy.NONE,
                                deliver_policy=DeliverPolicy.ALL, inactive_threshold=10.0, mem_storage=True,
                                num_replicas=1)
        sub = await nc.jetstream().subscribe(subjects.job_all(job_id), stream=subjects.CONTROL, config=config,
                                             cb=on_msg)
        try:
            await asyncio.wait_for(ready.wait(), wait_s)
        except TimeoutError:
            log.warning("plan.none_recorded", world_size=world_size, wait_s=wait_s,
                        newest=newest[0].world_size if newest else None)
        await sub.unsubscribe()
    finally:
        await bus.close_quietly(nc, 1.0)
    return newest[0] if newest and newest[0].world_size == world_size else None
