"""A rank's exit is told after its last events are stored: the agent's `told` (read before the exit record goes
out) waits for the rank's link to publish what it handed over. A crash's FaultInjected once reached the broker
after the WorkersExited it caused, and `submit --wait` told the consequence before its cause."""

import asyncio
from collections.abc import Sequence

import pytest

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.store import AppendResult, MemoryStore
from flightdeck.events.training import FaultInjected
from flightdeck.services.agent.links import RankLinks
from flightdeck.trainer.link import AgentLink

JOB, NODE = "job-x", "node-x"


class HeldStore(MemoryStore):
    """Takes telemetry only once `gate` opens: a broker slow to store a rank's last events."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def append_batch(self, items: Sequence[tuple[str, Event]]) -> list[AppendResult]:
        await self.gate.wait()
        return await super().append_batch(items)


async def stored_faults(store: MemoryStore) -> list[FaultInjected]:
    out: list[FaultInjected] = []
    async for batch in store.read(subjects.TELEMETRY, [subjects.telemetry_job(JOB)]):
        out.extend(s.event for s in batch if isinstance(s.event, FaultInjected))
    return out


@pytest.mark.timeout(60)
async def test_told_returns_once_the_ranks_last_events_are_stored() -> None:
    store = HeldStore()
    links = RankLinks(node=NODE, store=store)
    links.start()
    link = AgentLink(links.address, JOB, 3, 0, NODE, heartbeat_s=60.0)
    try:
        await asyncio.to_thread(link.connect, 30.0)
        link.start()
        link.emit(FaultInjected(job_id=JOB, rank=3, node=NODE, kind="crash", step=7))
        await asyncio.to_thread(link.close, 30.0)  # handed over, and its end of the link gone: the rank exited

        told = asyncio.create_task(links.told((JOB, 0, 3), False, settle_s=30.0))
        await asyncio.sleep(0.2)
        assert not told.done() and await stored_faults(store) == []  # the fault is still on its way
        store.gate.set()
        # the exit record says what the rank was told to do, not the info lines it logged on its way out
        assert (await told)["error"] == "drill fault 'crash' injected at step 7"
        assert [f.step for f in await stored_faults(store)] == [7]  # stored before its exit can be recorded
    finally:
        store.gate.set()
        await links.close(drain_s=5.0)


@pytest.mark.timeout(60)
async def test_a_rank_without_a_link_is_told_at_once() -> None:
    links = RankLinks(node=NODE, store=MemoryStore())
    links.start()
    try:
        told = await asyncio.wait_for(links.told((JOB, 0, 1), False, settle_s=3600.0), 30.0)
        assert told["unlinked"] and told["error"] == ""
    finally:
        await links.close(drain_s=1.0)
