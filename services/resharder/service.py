"""The resharder as a running service: its pure core (core.py); nothing to configure."""

from collections.abc import Mapping

from flightdeck.services.core import Service
from flightdeck.services.resharder.core import State, core_service


def build(env: Mapping[str, str] | None = None) -> Service[State]:
    return core_service()  # no setting: `env` is taken like every service's build takes it
