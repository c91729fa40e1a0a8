"""Service names and how to build each one.

A built-in service `NAME` is `services.NAME.service:build()` once that module exists; until then it
is a core that folds and decides nothing, so the shell still runs (and `flightdeck up` has its five
processes). `$FLIGHTDECK_EXTRA_SERVICES` ("name=module:function,...") adds more, e.g. test services.
"""

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.services.core import Emit, Service

BUILTIN = subjects.SERVICES
EXTRA_ENV = "FLIGHTDECK_EXTRA_SERVICES"


class UnknownService(ValueError):
    pass


def _nothing(state: None, event: Event) -> tuple[None, list[Emit]]:
    return state, []


def idle(name: str) -> Service[None]:
    """A core with no logic yet: reads only its own clock, never asks for a tick."""
    return Service(name=name, initial=None, transition=_nothing,
                   control_subjects=(), wants_tick=lambda state, now: False)


def _extra() -> dict[str, str]:
    found: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in os.environ.get(EXTRA_ENV, "").split(","))):
        name, sep, target = entry.partition("=")
        if not sep or ":" not in target:
            raise UnknownService(f"{EXTRA_ENV} entry {entry!r} must look like name=package.module:function")
        found[name.strip()] = target.strip()
    return found


def names() -> list[str]:
    return [*BUILTIN, *(n for n in _extra() if n not in BUILTIN)]


def _load(target: str) -> Callable[..., Service[Any]]:
    module, _, attr = target.partition(":")
    factory = getattr(importlib.import_module(module), attr, None)
    if not callable(factory):
        raise UnknownService(f"{target!r} names no function that builds a service")
    return factory


def build(name: str, env: Mapping[str, str] | None = None) -> Service[Any]:
    """The service called `name`, built fresh with its settings from `env` (default: the process environment);
    `env={}` gives a built-in service's defaults, as an audit wants them (the recorded settings come from the log)."""
    extra = _extra()
    if name in extra:
        service = _load(extra[name])()
    elif name in BUILTIN:
        module = f"flightdeck.services.{name}.service"
        try:
            service = _load(f"{module}:build")(env)
        except ModuleNotFoundError as exc:
            if exc.name not in (module, f"flightdeck.services.{name}"):
                raise  # the module exists but something it imports does not: a real error
            service = idle(name)
    else:
        raise UnknownService(f"no service called {name!r}: choose one of {', '.join(names())}")
    if service.name != name:
        raise UnknownService(f"the factory for {name!r} built a service called {service.name!r}")
    return service
