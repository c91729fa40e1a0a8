"""The health monitor as a running service: its pure core (core.py) with the tick from the environment.

    FLIGHTDECK_HEALTH_TICK_S   seconds between the recorded clock ticks that fold telemetry and judge
                               silence and hangs (default 1.0)
"""

import os

from services.core import Service
from services.health.core import State, core_service

TICK_ENV = "FLIGHTDECK_HEALTH_TICK_S"
DEFAULT_TICK_S = 1.0


def build() -> Service[State]:
    raw = os.environ.get(TICK_ENV, "")
    try:
        tick_s = float(raw) if raw else DEFAULT_TICK_S
    except ValueError:
        raise ValueError(f"${TICK_ENV} must be a number of seconds, got {raw!r}") from None
    if not 0 < tick_s <= 60:
        raise ValueError(f"${TICK_ENV} must be above 0 and at most 60 seconds, got {raw!r}")
    return core_service(tick_s=tick_s)
