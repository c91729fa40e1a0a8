"""Settings read from the environment by the service shells, each checked with a message naming the variable.
`env` defaults to the process environment; an audit passes {} to build cores with their defaults."""

import os
from collections.abc import Mapping


def float_env(name: str, default: float, *, above: float, at_most: float,
              env: Mapping[str, str] | None = None) -> float:
    """`$name` as a number in (above, at_most], or `default` when unset or empty."""
    raw = (os.environ if env is None else env).get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"${name} must be a number, got {raw!r}") from None
    if not above < value <= at_most:
        raise ValueError(f"${name} must be above {above:g} and at most {at_most:g}, got {raw!r}")
    return value


def int_env(name: str, default: int, low: int, high: int, env: Mapping[str, str] | None = None) -> int:
    """`$name` as an integer in [low, high], or `default` when unset or empty."""
    raw = (os.environ if env is None else env).get(name, "")
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise ValueError(f"${name} must be between {low} and {high}, got {value}")
    return value
