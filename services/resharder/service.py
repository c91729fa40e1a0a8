"""The resharder as a running service: its pure core (core.py); nothing to configure."""

from services.core import Service
from services.resharder.core import State, core_service


def build() -> Service[State]:
    return core_service()
