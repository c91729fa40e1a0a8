"""How a service's shell reads FD_CONTROL: its durable consumer's name, filters and redelivery policy."""

import os
from collections.abc import Sequence
from dataclasses import dataclass

from flightdeck.events import subjects


@dataclass(frozen=True)
class ConsumerPolicy:
    """How the durable consumer redelivers. `backoff[0]` is the ack wait: how long an input a crashed
    process held waits before it comes back. After `max_deliver` deliveries without an ack the server
    gives up on an input and the shell dead-letters it from the advisory."""

    max_deliver: int = 5
    backoff: tuple[float, ...] = (2.0, 10.0, 30.0, 60.0)
    fetch_s: float = 0.5

    @classmethod
    def from_env(cls) -> "ConsumerPolicy":
        """$FLIGHTDECK_MAX_DELIVER and $FLIGHTDECK_BACKOFF_S ("2,10,30") override the defaults."""
        default = cls()
        backoff = os.environ.get("FLIGHTDECK_BACKOFF_S")
        return cls(max_deliver=int(os.environ.get("FLIGHTDECK_MAX_DELIVER", default.max_deliver)),
                   backoff=tuple(float(b) for b in backoff.split(",")) if backoff else default.backoff)


def consumer_name(service: str) -> str:
    return f"service-{subjects.token(service)}"


def filters(patterns: Sequence[str]) -> list[str]:
    """The patterns without duplicates or ones another pattern covers (the server refuses overlapping filters)."""
    unique = list(dict.fromkeys(patterns))
    return [p for p in unique if not any(q != p and subjects.matches(q, p) for q in unique)]
