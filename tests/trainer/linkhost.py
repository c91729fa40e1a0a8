"""The agent's end of the rank links (services/agent/links.RankLinks, the real one) on its own event loop thread,
publishing to a real broker: for tests that drive a rank's link (trainer/link.py) from ordinary threads.

    with LinkHost(url) as host:
        link = host.link(rank=0)        # connected and started
        host.call(lambda links: links.command(JOB, 0, raw))
"""

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from flightdeck.events import ranklink, subjects
from flightdeck.events.base import Event
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.services.agent.links import RankLinks
from flightdeck.trainer.link import AgentLink

JOB = "job-l"
NODE = "node-a"
T = TypeVar("T")


class LinkHost:
    def __init__(self, url: str, *, admit: Callable[[ranklink.Hello, int], Awaitable[bool]] | None = None) -> None:
        self.url, self.admit = url, admit
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="link-host", daemon=True)
        self.links: RankLinks | None = None
        self.store: JetStreamStore | None = None
        self.opened: list[AgentLink] = []

    @property
    def address(self) -> str:
        assert self.links is not None
        return self.links.address

    def args(self) -> tuple[str, ...]:
        """`python -m flightdeck.trainer`'s flags for a rank linked here."""
        return ("--agent", self.address, "--node", NODE)

    def __enter__(self) -> "LinkHost":
        self.thread.start()

        async def up() -> RankLinks:
            self.store = await JetStreamStore.connect(self.url, name="link-host")
            links = RankLinks(node=NODE, store=self.store, admit=self.admit)
            links.start()
            return links

        self.links = self.run(up())
        return self

    def __exit__(self, *exc: object) -> None:
        for link in self.opened:
            link.close(timeout=2.0)
        self.close()

    def close(self, drain_s: float = 10.0) -> None:
        """Stop the agent's end (its links close; what it holds is published for up to `drain_s`)."""
        if self.links is None:
            return
        links, self.links = self.links, None

        async def down() -> None:
            await links.close(drain_s)
            if self.store is not None:
                await self.store.close()

        self.run(down())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5.0)

    def run(self, coro: Awaitable[T], timeout: float = 60.0) -> T:
        fut: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        return fut.result(timeout)

    def call(self, fn: Callable[[RankLinks], Any]) -> Any:
        """Run `fn(links)` on the agent's loop and return what it returned."""
        async def go() -> Any:
            assert self.links is not None
            return fn(self.links)
        return self.run(go())

    def link(self, rank: int = 0, *, job_id: str = JOB, attempt: int = 0, heartbeat_s: float = 60.0) -> AgentLink:
        assert self.links is not None
        link = AgentLink(self.links.address, job_id, rank, attempt, NODE, heartbeat_s=heartbeat_s)
        link.connect(timeout=30.0)
        link.start()
        self.opened.append(link)
        return link


def read_telemetry(url: str, pattern: str) -> list[tuple[str, Event]]:
    """Every event of FD_TELEMETRY on `pattern`, in stream order, through the services' own reader (an empty
    stream is no error)."""

    async def go() -> list[tuple[str, Event]]:
        store = await JetStreamStore.connect(url, name="test-reader")
        try:
            return [(s.subject, s.event) async for batch in store.read(subjects.TELEMETRY, [pattern])
                    for s in batch if s.event is not None]
        finally:
            await store.close()

    return asyncio.run(go())
