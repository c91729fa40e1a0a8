"""The scheduler as a running service: its pure core (core.py) with the stop timeout from the environment.

    FLIGHTDECK_STOP_TIMEOUT_S   seconds a stop (preemption or cancel) may take before the slots are
                                released anyway, which makes the node agents kill what is left (default 120)
"""

import os

from services.core import Service
from services.scheduler.core import core_service
from services.scheduler.state import State

STOP_TIMEOUT_ENV = "FLIGHTDECK_STOP_TIMEOUT_S"
DEFAULT_STOP_TIMEOUT_S = 120.0


def build() -> Service[State]:
    raw = os.environ.get(STOP_TIMEOUT_ENV, "")
    try:
        timeout = float(raw) if raw else DEFAULT_STOP_TIMEOUT_S
    except ValueError:
        raise ValueError(f"${STOP_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if timeout <= 0:
        raise ValueError(f"${STOP_TIMEOUT_ENV} must be positive, got {raw!r}")
    return core_service(stop_timeout_s=timeout)
