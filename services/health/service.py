"""The health monitor as a running service: its pure core (core.py) with the tick from the environment.

    FLIGHTDECK_HEALTH_TICK_S   seconds between the recorded clock ticks that fold telemetry and judge
                               silence and hangs (default 1.0)
    FLIGHTDECK_HEALTH_IDLE_LOST_S
                               seconds an agent that runs no ranks may send no sign of life (AgentAlive) before
                               its node is declared lost (default 30)
"""

from collections.abc import Mapping

from flightdeck.services.core import Service
from flightdeck.services.health.core import IDLE_LOST_S, State, core_service
from flightdeck.services.shell.envconfig import float_env

TICK_ENV = "FLIGHTDECK_HEALTH_TICK_S"
IDLE_LOST_ENV = "FLIGHTDECK_HEALTH_IDLE_LOST_S"
DEFAULT_TICK_S = 1.0


def build(env: Mapping[str, str] | None = None) -> Service[State]:
    return core_service(tick_s=float_env(TICK_ENV, DEFAULT_TICK_S, above=0.0, at_most=60.0, env=env),
                        idle_lost_s=float_env(IDLE_LOST_ENV, IDLE_LOST_S, above=0.0, at_most=3600.0, env=env))
