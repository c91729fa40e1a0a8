"""The agent's sign of life while it runs no ranks: an AgentAlive every IDLE_BEAT_S on telemetry (while it runs
ranks, their heartbeat batches are its sign of life). The health monitor declares the node lost when they stop, so
an agent that dies idle is found within its deadline, not when a job granted to it waits out the start grace
(issue 51: 120 s in `placing`, then moved and charged a restart)."""

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable

import structlog

from flightdeck.events import subjects
from flightdeck.events.fleet import AgentAlive
from flightdeck.events.store import EventStore
from flightdeck.services.agent.inventory import AgentError
from flightdeck.services.shell.connection import TRANSIENT
from flightdeck.services.shell.envconfig import float_env

log = structlog.get_logger("flightdeck.agent")
IDLE_BEAT_ENV = "FLIGHTDECK_IDLE_BEAT_S"
IDLE_BEAT_S = 5.0  # the health monitor's idle deadline is six of these (services/health/core.IDLE_LOST_S)


def beat_interval() -> float:
    """$FLIGHTDECK_IDLE_BEAT_S, checked: an agent started with a bad one says so before it registers."""
    try:
        return float_env(IDLE_BEAT_ENV, IDLE_BEAT_S, above=0.0, at_most=60.0)
    except ValueError as exc:
        raise AgentError(f"{exc}: give the seconds between an idle agent's beats") from None


class Alive:
    def __init__(self, store: EventStore, node: str, producer: str, busy: Callable[[], int],
                 interval_s: float = IDLE_BEAT_S) -> None:
        self.store, self.node, self.producer, self.busy, self.interval_s = store, node, producer, busy, interval_s
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self._beat())

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _beat(self) -> None:
        subject = subjects.fleet_telemetry(self.node, "AgentAlive")
        while True:
            if not self.busy():
                ev = AgentAlive(node=self.node, interval_s=self.interval_s, occurred_at=time.time(),
                                producer=self.producer, event_id=f"{self.producer}:alive:{uuid.uuid4().hex[:12]}")
                try:
                    await self.store.append(subject, ev, msg_id=ev.event_id)
                except TRANSIENT as exc:  # the broker is away: the monitor counts silence from its return
                    log.warning("sign of life not sent; the next one follows", error=repr(exc))
            await asyncio.sleep(self.interval_s)
