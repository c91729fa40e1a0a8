"""Wire codec: msgpack through msgspec with one reused typed decoder; JSON only for people."""

from typing import Any, Union

import msgspec

from events.base import Event
from events.catalog import ALL_TYPES

AnyEvent = Union[ALL_TYPES]  # type: ignore[valid-type]  # noqa: UP007 (a tuple unpacks only into Union)


class UndecodableEvent(ValueError):
    """Bytes that are not a known, valid event: wrong type, missing fields, unknown tag."""


class UnknownSchemaVersion(UndecodableEvent):
    """An event written by newer code than this; refusing beats silently dropping its new fields."""


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Event] = msgspec.msgpack.Decoder(AnyEvent)
_json_encoder = msgspec.json.Encoder()


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes) -> Event:
    """Decode one event, or raise `UndecodableEvent` saying why."""
    try:
        event = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise UndecodableEvent(str(exc)) from None
    if event.schema_version > type(event).SCHEMA:
        raise UnknownSchemaVersion(
            f"{type(event).__name__} schema version {event.schema_version} is newer than "
            f"{type(event).SCHEMA}, the newest this code reads; upgrade this service"
        )
    return event


def type_name(event: Event) -> str:
    return type(event).__name__


def to_builtins(event: Event) -> dict[str, Any]:
    """A dict for human-facing JSON output, with the type first. NaN/Inf become strings, not null."""
    out: dict[str, Any] = {"type": type_name(event)}
    for key, value in msgspec.structs.asdict(event).items():
        out[key] = msgspec.to_builtins(value, str_keys=True)
    return _finite(out)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return repr(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def to_json(obj: Any) -> bytes:
    return _json_encoder.encode(_finite(obj))
