"""Field-by-field differences between two events (as `flightdeck.services.shell.fold.comparable` gives them)."""

from typing import Any

import msgspec


def field_diff(recorded: Any, replayed: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, recorded value, replayed value) for every leaf that differs; structs compare by field."""
    if isinstance(recorded, msgspec.Struct) and type(recorded) is type(replayed):
        recorded, replayed = msgspec.structs.asdict(recorded), msgspec.structs.asdict(replayed)
    if isinstance(recorded, dict) and isinstance(replayed, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in [*recorded, *(k for k in replayed if k not in recorded)]:
            sub = f"{path}.{key}" if path else str(key)
            out += field_diff(recorded.get(key, _ABSENT), replayed.get(key, _ABSENT), sub)
        return out
    if isinstance(recorded, list | tuple) and isinstance(replayed, list | tuple) and len(recorded) == len(replayed):
        return [d for i, (a, b) in enumerate(zip(recorded, replayed, strict=True))
                for d in field_diff(a, b, f"{path}[{i}]")]
    return [] if _same(recorded, replayed) else [(path, recorded, replayed)]


def _same(a: Any, b: Any) -> bool:
    # NaN losses survive msgpack; a NaN field is the same decision when both sides hold one
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()
