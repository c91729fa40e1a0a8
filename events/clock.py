"""Time and bookkeeping records written by the service shell itself."""

from flightdeck.events.base import Event


class ClockTick(Event, frozen=True, kw_only=True):
    """Time entering a service's core. `positions` holds the last stream sequence the service had
    folded from each input stream when the tick was taken, so a replay interleaves exactly as live."""

    service: str
    now: float
    positions: dict[str, int]
    # When the broker last answered this service again after an outage it saw (0: none seen): ranks could not
    # publish meanwhile, so their silence before then is no evidence (the health monitor counts it from here).
    recovered_at: float = 0.0


class CoreConfigured(Event, frozen=True, kw_only=True):
    """The settings a service's core runs with, recorded by its shell at every start on its clock subject. A core
    folds its own like any input, so a replay anywhere decides with the settings the live service had."""

    service: str
    settings: dict[str, float | int | str]


class DeadLettered(Event, frozen=True, kw_only=True):
    """A message a service could not use: kept with the reason, never silently dropped."""

    service: str
    stream: str
    seq: int
    subject: str
    reason: str
    payload: bytes
