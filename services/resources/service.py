"""The resource manager as a running service: its pure core (core.py) with the MASTER_PORT range from
the environment.

    FLIGHTDECK_MASTER_PORT_BASE   first port a job's rank 0 may listen on for the rendezvous (default 29500)
    FLIGHTDECK_MASTER_PORT_SPAN   how many ports from there (default 1000)
"""

import os

from services.core import Service
from services.resources.core import Ports, State, core_service

PORT_BASE_ENV = "FLIGHTDECK_MASTER_PORT_BASE"
PORT_SPAN_ENV = "FLIGHTDECK_MASTER_PORT_SPAN"


def _int_env(name: str, default: int, low: int, high: int) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise ValueError(f"${name} must be between {low} and {high}, got {value}")
    return value


def ports_from_env() -> Ports:
    base = _int_env(PORT_BASE_ENV, Ports().base, 1024, 65535)
    span = _int_env(PORT_SPAN_ENV, Ports().span, 1, 65536 - base)
    return Ports(base=base, span=span)


def build() -> Service[State]:
    return core_service(ports=ports_from_env())
