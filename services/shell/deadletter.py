"""Dead letters: a message a service could not use, kept on `fd.dead.<service>` with the reason.

Their msg ids derive from the input's stream position, so a redelivered poison message is recorded once.
"""

import json
import time
from dataclasses import dataclass

from flightdeck.events import subjects
from flightdeck.events.clock import DeadLettered
from flightdeck.events.store import EventStore, Stored

GIVEN_UP = "max_deliver"  # the server stopped delivering an input the service never folded
FOLDED_ANYWAY = "max_deliver_folded"  # ... one the service did fold, but whose acks never arrived


@dataclass(frozen=True, slots=True)
class Letter:
    subject: str
    event: DeadLettered
    msg_id: str


def letter(service: str, stored: Stored, reason: str, *, cause: str = "input") -> Letter:
    """The DeadLettered record for `stored`. `cause` tells apart several letters about one input
    (the input itself, an effect it asked for, running out of deliveries)."""
    mid = f"{service}:dead:{stored.stream}:{stored.seq}:{cause}"
    event = DeadLettered(
        service=service, stream=stored.stream, seq=stored.seq, subject=stored.subject, reason=reason,
        payload=stored.data, event_id=mid, occurred_at=time.time(), producer=service,
        causation_id=stored.event.event_id if stored.event is not None else "",
    )
    return Letter(subjects.dead(service), event, mid)


@dataclass(frozen=True, slots=True)
class MaxDeliveries:
    """What the server's MAX_DELIVERIES advisory says: the message at `stream_seq` was delivered
    `deliveries` times without an ack and will not be delivered again."""

    stream: str
    consumer: str
    stream_seq: int
    deliveries: int


def advisory_subject(stream: str, consumer: str) -> str:
    return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"


def parse_advisory(data: bytes) -> MaxDeliveries:
    body = json.loads(data)
    return MaxDeliveries(str(body["stream"]), str(body["consumer"]), int(body["stream_seq"]), int(body["deliveries"]))


async def given_up(store: EventStore, service: str) -> set[int]:
    """FD_CONTROL sequences the server gave up delivering to `service` before it folded them. The live
    service never folded them, so a replay must skip them too."""
    seqs: set[int] = set()
    async for batch in store.read(subjects.DEAD, [subjects.dead(service)]):
        for stored in batch:
            ev = stored.event
            if isinstance(ev, DeadLettered) and ev.stream == subjects.CONTROL and ev.event_id.endswith(f":{GIVEN_UP}"):
                seqs.add(ev.seq)
    return seqs
