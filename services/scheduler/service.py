"""The scheduler as a running service: its pure core (core.py) with the stop timeout from the environment.

    FLIGHTDECK_STOP_TIMEOUT_S   seconds a stop (preemption or cancel) may take before the slots are
                                released anyway, which makes the node agents kill what is left (default 120)
"""

from collections.abc import Mapping

from flightdeck.services.core import Service
from flightdeck.services.scheduler.core import core_service
from flightdeck.services.scheduler.state import State
from flightdeck.services.shell.envconfig import float_env

STOP_TIMEOUT_ENV = "FLIGHTDECK_STOP_TIMEOUT_S"
DEFAULT_STOP_TIMEOUT_S = 120.0


def build(env: Mapping[str, str] | None = None) -> Service[State]:
    timeout = float_env(STOP_TIMEOUT_ENV, DEFAULT_STOP_TIMEOUT_S, above=0.0, at_most=86_400.0, env=env)
    return core_service(stop_timeout_s=timeout)
