"""A restarted service rebuilds from a position it can trust. After a broker SIGKILL, the broker's reply that
creates a service's consumer answered a stale ack floor (246 where the consumer said 258 a moment later:
shared/FACTS.md); a scheduler rebuilt only to it, left ~80 inputs out of its state and stranded a job (trial 2,
86ea31b). Here a fake of the broker's JetStream API gives those stale answers; everything else is real."""

import asyncio
import dataclasses
from typing import Any

import pytest
from nats.js.api import ConsumerInfo, SequenceInfo

from flightdeck.events import subjects
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import JobQueued
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.connection import Connection
from flightdeck.services.shell.runtime import ConsumerPolicy, Shell, consumer_name
from tests.integration import toy_service
from tests.integration.runtime_helpers import bus_at, eventually, read_all, submissions
from tests.integration.test_runtime import start, stop_service

pytestmark = pytest.mark.timeout(90)


class StaleReplies:
    """The broker's JetStream API, except that consumer positions come back as they were at `floor` (what a
    consumer's state on disk said before a broker crash) in the creating reply and, with `info_too`, in the first
    consumer_info as well: stale while the server recovers, current once the consumer delivers."""

    def __init__(self, js: Any, floor: int, *, info_too: bool) -> None:
        self._js, self._floor, self._info_too = js, floor, info_too

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    def _stale(self, info: ConsumerInfo) -> ConsumerInfo:
        return dataclasses.replace(info, ack_floor=SequenceInfo(consumer_seq=0, stream_seq=self._floor))

    async def add_consumer(self, *args: Any, **kwargs: Any) -> ConsumerInfo:
        return self._stale(await self._js.add_consumer(*args, **kwargs))

    async def consumer_info(self, *args: Any, **kwargs: Any) -> ConsumerInfo:
        info = await self._js.consumer_info(*args, **kwargs)
        stale, self._info_too = self._info_too, False
        return self._stale(info) if stale else info


async def priorities(store: JetStreamStore, prefix: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for s in await read_all(store, subjects.CONTROL, ("fd.ctl.job.*.JobQueued",)):
        assert isinstance(s.event, JobQueued)
        if s.event.job_id.startswith(prefix):
            out.setdefault(s.event.job_id, []).append(s.event.priority)
    return out


@pytest.mark.parametrize("ticks", [True, False], ids=["ticking", "silent"])
async def test_a_stale_consumer_position_is_caught_up_never_acted_on(nats_server: broker_mod.Broker,
                                                                       ticks: bool) -> None:
    # The toy numbers each JobQueued by how many submissions it has folded: an input left out of a rebuild shows
    # as a wrong number, one folded twice as a second JobQueued.
    service = toy_service.build() if ticks else dataclasses.replace(toy_service.build(),
                                                                    wants_tick=lambda state, now: False)
    async with bus_at(nats_server.url) as bus:
        first = submissions(10, "a")
        seqs = [r.seq for r in await bus.store.append_batch(first)]
        task, stop = start(lambda: service, nats_server.url)
        await eventually(lambda: _all_queued(bus.store, "a", 10), 30, "the first ten answered")
        await stop_service(task, stop)
        await bus.store.append_batch(submissions(5, "b"))

        store = await JetStreamStore.connect(nats_server.url, name="stale-shell")
        store.js = StaleReplies(store.js, seqs[2], info_too=not ticks)  # type: ignore[assignment]
        halt = asyncio.Event()
        shell = Shell(service, store, Connection(service.name), ConsumerPolicy(), halt)
        running = asyncio.create_task(shell.run())
        try:
            await eventually(lambda: _all_queued(bus.store, "b", 5), 30, "the five submitted while it was down")
        finally:
            halt.set()
            await asyncio.wait_for(running, 30)
            await store.close()
        assert await priorities(bus.store, "a") == {f"a{i}": [i + 1] for i in range(10)}  # none answered again
        assert await priorities(bus.store, "b") == {f"b{i}": [11 + i] for i in range(5)}  # state had all ten
        info = await bus.js.consumer_info(subjects.CONTROL, consumer_name(service.name))
        assert info.num_pending == 0 and info.num_ack_pending == 0


async def _all_queued(store: JetStreamStore, prefix: str, n: int) -> bool:
    return len(await priorities(store, prefix)) == n
