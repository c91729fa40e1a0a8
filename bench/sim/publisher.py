"""Pipelined JetStream publishes for many simulated ranks sharing one connection, with the trainer's rule for
a broker that falls behind: heartbeats and step reports are droppable (the next one supersedes them), facts
such as RankStarted are not. Counts what it published, dropped, and how long acks took."""

import asyncio
import time
from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.api import PubAck

from flightdeck.events import codec
from flightdeck.events.base import Event

MAX_PENDING = 3000  # unacknowledged publishes per connection before droppable events are dropped


@dataclass
class Counters:
    published: int = 0  # acknowledged by the broker
    entries: int = 0  # rank heartbeats carried (a batch carries many, a Heartbeat one)
    dropped: int = 0
    failed: int = 0
    ack_s_sum: float = 0.0
    ack_s_max: float = 0.0

    def snapshot(self) -> dict[str, float]:
        return {"published": self.published, "entries": self.entries, "dropped": self.dropped,
                "failed": self.failed, "ack_s_sum": self.ack_s_sum, "ack_s_max": self.ack_s_max}


@dataclass
class Publisher:
    js: JetStreamContext
    counters: Counters = field(default_factory=Counters)
    pending: int = 0

    async def publish(self, subject: str, event: Event, *, entries: int = 0, droppable: bool = True) -> None:
        if droppable and self.pending >= MAX_PENDING:
            self.counters.dropped += 1
            return
        sent = time.monotonic()
        self.pending += 1
        try:
            fut = await self.js.publish_async(subject, codec.encode(event), headers={"Nats-Msg-Id": event.event_id})
        except Exception:  # the connection is down or stalled: counted, as the trainer's backlog would hold it
            self.pending -= 1
            self.counters.failed += 1
            return
        fut.add_done_callback(lambda f: self._acked(f, sent, entries))

    def _acked(self, fut: "asyncio.Future[PubAck]", sent: float, entries: int) -> None:
        self.pending -= 1
        c = self.counters
        if fut.cancelled() or fut.exception() is not None:
            c.failed += 1
            return
        took = time.monotonic() - sent
        c.published += 1
        c.entries += entries
        c.ack_s_sum += took
        c.ack_s_max = max(c.ack_s_max, took)
