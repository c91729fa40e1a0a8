"""Wire codec: msgpack through msgspec with reused typed decoders; JSON only for people.

`decode` reads what the catalog types say. `admit` is what every reader of the store uses: it also holds
the bytes to the bounds the services rely on (ids that become subject tokens, folder names and object
keys; counts that size loops and allocations; finite times), checked in C by a second decoder over
"bounded" shadows of the catalog types. Refusals say which kind they are: `UnknownEventType` and
`UnknownSchemaVersion` (written by newer code), `InvalidEvent` (well-formed but out of bounds), or plain
`UndecodableEvent` (not an event at all).
"""

import types
import typing
from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta

from flightdeck.events.base import Event
from flightdeck.events.catalog import ALL_TYPES, BY_NAME
from flightdeck.events.job import JobSubmitted
from flightdeck.events.logs import MAX_LINE, MAX_LINES
from flightdeck.events.spec import InvalidSpec, check

AnyEvent = Union[ALL_TYPES]  # type: ignore[valid-type]  # noqa: UP007 (a tuple unpacks only into Union)


class UndecodableEvent(ValueError):
    """Bytes that are not a known, valid event: wrong type, missing fields, unknown tag."""


class UnknownSchemaVersion(UndecodableEvent):
    """An event written by newer code than this; refusing beats silently dropping its new fields."""


class UnknownEventType(UndecodableEvent):
    """A well-formed event whose type this code does not know: most likely written by newer code."""


class InvalidEvent(UndecodableEvent):
    """A well-formed event with a value outside the bounds every reader relies on (see `BOUNDS`)."""


MAX_SLOTS = 65_536  # the most slots a job may ask for (flightdeck.events.spec) or a node may offer; ranks are below it
_TOKEN = r"[A-Za-z0-9_-]"  # the subject-token grammar (flightdeck.events.subjects): no dots, slashes, spaces or NULs
Token = Annotated[str, Meta(pattern=rf"^{_TOKEN}{{1,128}}\Z")]
OptionalToken = Annotated[str, Meta(pattern=rf"^{_TOKEN}{{0,128}}\Z")]
Count = Annotated[int, Meta(ge=0)]
Rank = Annotated[int, Meta(ge=0, lt=MAX_SLOTS)]
Slots = Annotated[int, Meta(ge=0, le=MAX_SLOTS)]
UnixTime = Annotated[float, Meta(ge=0.0, le=1e11)]  # finite: NaN and Inf fail the bounds
Seconds = Annotated[float, Meta(ge=0.0, le=1e9)]
Ref = Annotated[str, Meta(max_length=1024)]
Step = Annotated[int, Meta(ge=-1)]  # -1: no step completed yet (a rank's heartbeats before its first step)

MAX_CAUSE = 4096  # WorkersExited.cause: a start failure or the last lines a rank printed
MAX_METRICS = 64  # custom metrics in one StepCompleted (trainer API `report`)
MetricName = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_./-]{0,63}\Z")]

# Field name -> the bounded type readers may rely on. Ids land in subjects, cache folders and object keys
# (a checkpoint id of "../.." would have the node agent evict outside its cache); slot counts size loops
# (a node announcing 10**9 slots stalled placement for minutes); times feed deadlines.
BOUNDS: dict[str, Any] = {
    "job_id": Token, "by_job_id": Token, "service": Token, "checkpoint_id": Token, "node": Token,
    "event_id": Ref, "causation_id": Ref, "producer": Ref, "trigger_id": Ref,
    "schema_version": Annotated[int, Meta(ge=1)], "job_version": Count, "attempt": Count, "seq": Count,
    "rank": Rank, "slot": Rank, "slots": Slots, "world_size": Slots, "free_slots": Slots,
    "tp": Annotated[int, Meta(ge=1, le=MAX_SLOTS)], "master_port": Annotated[int, Meta(ge=0, le=65_535)],
    "step": Step, "steps": Count, "from_step": Count, "to_step": Count, "skip_from": Count, "skip_to": Count,
    "next_batch": Count, "bytes": Count, "size": Count, "priority": Count, "timeline": Count,
    "ranks": Annotated[list[Rank], Meta(max_length=MAX_SLOTS)],
    "pids": Annotated[list[Count], Meta(max_length=MAX_SLOTS)],
    "nodes": Annotated[list[Token], Meta(max_length=MAX_SLOTS)],
    "skipped": list[tuple[Count, Count]], "positions": dict[Token, Count],
    "occurred_at": UnixTime, "now": UnixTime, "recovered_at": UnixTime,
    "interval_s": Annotated[float, Meta(gt=0.0, le=86_400.0)], "step_time_s": Seconds, "stall_s": Seconds,
    "write_s": Seconds, "seconds": Seconds, "memory_gb": Seconds,
    "manifest_sha256": Annotated[str, Meta(pattern=r"^(?:[0-9a-f]{64})?\Z")],
    "metrics": Annotated[dict[MetricName, float], Meta(max_length=MAX_METRICS)],
    "cause": Annotated[str, Meta(max_length=MAX_CAUSE)],
    "first_line": Count, "dropped": Count,
    "lines": Annotated[list[Annotated[str, Meta(max_length=MAX_LINE + 64)]], Meta(max_length=MAX_LINES)],
}
# Field name -> the most items a list of nested structs may hold (its items keep their own BOUNDS).
LENGTHS: dict[str, int] = {"beats": MAX_SLOTS, "others": MAX_SLOTS}  # a node agent's batch: one entry per rank at most
_OPTIONAL = {Token: OptionalToken}  # a field whose default is "" may stay empty ("no checkpoint", "no node")


def _bounded_type(tp: Any, shadows: dict[type, type]) -> Any:
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return _shadow(tp, shadows)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return list[_bounded_type(args[0], shadows)]  # type: ignore[misc]
    if origin is Union or origin is types.UnionType:
        return Union[tuple(_bounded_type(a, shadows) for a in args)]  # noqa: UP007
    return tp


def _shadow(cls: type[msgspec.Struct], shadows: dict[type, type]) -> type:
    """A struct with `cls`'s fields and tag whose types carry the BOUNDS; decoded only to validate."""
    if cls in shadows:
        return shadows[cls]
    hints = typing.get_type_hints(cls, include_extras=True)
    fields: list[tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(cls):
        bound = BOUNDS.get(f.name)
        tp = _bounded_type(hints[f.name], shadows) if bound is None else bound
        if f.name in LENGTHS:
            tp = Annotated[tp, Meta(max_length=LENGTHS[f.name])]
        if bound is not None and f.default == "":
            tp = _OPTIONAL.get(bound, tp)
        fields.append((f.name, tp, msgspec.field(default=None)))  # presence was checked by the real decoder
    info = cls.__struct_config__
    shadow = msgspec.defstruct(f"Bounded{cls.__name__}", fields, kw_only=True, frozen=True,
                               tag_field=info.tag_field, tag=info.tag)
    shadows[cls] = shadow
    return shadow


_shadows: dict[type, type] = {}
_BOUNDED = tuple(_shadow(t, _shadows) for t in ALL_TYPES)


class _Peek(msgspec.Struct):
    """Just enough of any map to tell newer code from garbage."""

    type: str = ""
    schema_version: int = 1


# msgspec raises UnicodeDecodeError, not DecodeError, for a tag that is not UTF-8 (one flipped bit does it)
_BAD_BYTES = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError)
_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Event] = msgspec.msgpack.Decoder(AnyEvent)
_bounded: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Union[_BOUNDED])  # noqa: UP007
_peek = msgspec.msgpack.Decoder(_Peek)
_json_encoder = msgspec.json.Encoder()


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def _newer(data: bytes) -> UndecodableEvent | None:
    """Why bytes that failed to decode look written by newer code (an unknown tag, a higher version), or None."""
    try:
        peek = _peek.decode(data)
    except _BAD_BYTES:
        return None
    cls = BY_NAME.get(peek.type)
    if cls is None:
        if peek.type and peek.schema_version >= 1:
            return UnknownEventType(f"unknown event type {peek.type[:64]!r} (schema version {peek.schema_version}): "
                                    "written by newer code, or not a Flightdeck event; upgrade this service if newer")
        return None
    if peek.schema_version > cls.SCHEMA:
        return _too_new(cls, peek.schema_version)
    return None


def _too_new(cls: type[Event], version: int) -> UnknownSchemaVersion:
    return UnknownSchemaVersion(f"{cls.__name__} schema version {version} is newer than {cls.SCHEMA}, "
                                "the newest this code reads; upgrade this service")


def decode(data: bytes) -> Event:
    """Decode one event, or raise `UndecodableEvent` (or a subclass) saying why."""
    try:
        event = _decoder.decode(data)
    except _BAD_BYTES as exc:
        # a newer version may have changed a field's shape: say so rather than "wrong type"
        raise _newer(data) or UndecodableEvent(str(exc)) from None
    if event.schema_version > type(event).SCHEMA:
        raise _too_new(type(event), event.schema_version)
    return event


def admit(data: bytes) -> Event:
    """Decode an input a service will act on: `decode`, then the BOUNDS (`InvalidEvent` names the field)."""
    event = decode(data)
    try:
        _bounded.decode(data)
    except _BAD_BYTES as exc:
        raise InvalidEvent(f"{type(event).__name__} out of bounds: {exc}") from None
    if isinstance(event, JobSubmitted):  # a submission that bypassed `flightdeck submit` meets the same rules
        try:
            check(event.spec)
        except InvalidSpec as exc:
            raise InvalidEvent(f"JobSubmitted carries a spec no rank could run: {exc}") from None
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
