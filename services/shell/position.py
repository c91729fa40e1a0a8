"""Where a restarted service may rebuild to, silently: the rules the shell (runtime.py) and the fault explorer
(services/tools/explore) share. Every input up to the position was folded and its outputs stored before."""

from flightdeck.events import subjects
from flightdeck.events.clock import ClockTick
from flightdeck.events.store import Stored


def rebuild_until(service: str, reply_floor: int, info_floor: int, last_tick: Stored | None) -> int:
    """The highest of the consumer-creating reply's ack floor (stale after a broker restart: shared/FACTS.md), the
    consumer's info read again, and what this service's own last tick recorded it had folded and stored."""
    ticked = 0
    if last_tick is not None and isinstance(last_tick.event, ClockTick) and last_tick.event.service == service:
        ticked = last_tick.event.positions.get(subjects.CONTROL, 0)
    return max(reply_floor, info_floor, ticked)


def caught_up_until(first_seq: int, floor_now: int) -> int:
    """At the first delivery after a start (`first_seq`): the consumer acked everything up to `floor_now`, read
    while it delivers; inputs between that and `first_seq` were given up (max_deliver), not done."""
    return min(first_seq - 1, floor_now)
