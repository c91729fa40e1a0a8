"""The resource manager as a running service: its pure core (core.py) with the MASTER_PORT range from
the environment.

    FLIGHTDECK_MASTER_PORT_BASE   first port a job's rank 0 may listen on for the rendezvous (default 29500)
    FLIGHTDECK_MASTER_PORT_SPAN   how many ports from there (default 1000)
"""

from collections.abc import Mapping

from flightdeck.services.core import Service
from flightdeck.services.resources.core import Settings, State, core_service
from flightdeck.services.shell.envconfig import int_env

PORT_BASE_ENV = "FLIGHTDECK_MASTER_PORT_BASE"
PORT_SPAN_ENV = "FLIGHTDECK_MASTER_PORT_SPAN"


def ports_from_env(env: Mapping[str, str] | None = None) -> Settings:
    base = int_env(PORT_BASE_ENV, Settings().base, 1024, 65535, env)
    span = int_env(PORT_SPAN_ENV, Settings().span, 1, 65536 - base, env)
    return Settings(base=base, span=span)


def build(env: Mapping[str, str] | None = None) -> Service[State]:
    return core_service(ports=ports_from_env(env))
