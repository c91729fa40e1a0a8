"""The wire codec: every catalog type survives msgpack for any valid value (NaN and Inf included); bytes
from newer code or no code at all are refused with UnknownSchemaVersion / UndecodableEvent, never guessed."""

import math
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import inspect as mi

from flightdeck.events import codec
from flightdeck.events.base import Event
from flightdeck.events.catalog import ALL_TYPES
from flightdeck.events.training import StepCompleted

INT64 = (-(2**63), 2**63 - 1)  # what msgpack carries as a signed integer


def _ints(t: mi.IntType) -> st.SearchStrategy[int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else INT64[0])
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else INT64[1])
    return st.integers(lo, hi)


def _floats(t: mi.FloatType) -> st.SearchStrategy[float]:
    bounded = any(b is not None for b in (t.ge, t.gt, t.le, t.lt))
    return st.floats(min_value=t.ge if t.ge is not None else t.gt, max_value=t.le if t.le is not None else t.lt,
                     exclude_min=t.gt is not None, exclude_max=t.lt is not None,
                     allow_nan=not bounded, allow_infinity=not bounded)


def strategy(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values of a msgspec type that its decoder accepts: constraints (patterns, bounds) respected."""
    match t:
        case mi.IntType():
            return _ints(t)
        case mi.FloatType():
            return _floats(t)
        case mi.StrType(pattern=str() as pattern):
            longest = t.max_length
            return st.from_regex(pattern, fullmatch=True).filter(lambda v: longest is None or len(v) <= longest)
        case mi.StrType():
            return st.text(min_size=t.min_length or 0, max_size=t.max_length or 40)
        case mi.BoolType():
            return st.booleans()
        case mi.BytesType():
            return st.binary(max_size=64)
        case mi.NoneType():
            return st.none()
        case mi.LiteralType():
            return st.sampled_from(t.values)
        case mi.ListType():
            return st.lists(strategy(t.item_type), min_size=t.min_length or 0, max_size=4)
        case mi.TupleType():
            return st.tuples(*(strategy(i) for i in t.item_types))
        case mi.DictType():
            return st.dictionaries(strategy(t.key_type), strategy(t.value_type), max_size=4)
        case mi.UnionType():
            return st.one_of(*(strategy(u) for u in t.types))
        case mi.StructType():
            return structs(t.cls)
    raise AssertionError(f"no strategy for {t!r}: teach tests/unit/test_codec.py this type")


def structs(cls: type[Any]) -> st.SearchStrategy[Any]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    fields = {f.name: strategy(f.type) for f in info.fields}
    if issubclass(cls, Event):
        fields["schema_version"] = st.integers(1, cls.SCHEMA)  # newer versions are refused on purpose
    return st.builds(cls, **fields)


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_type_round_trips(cls: type[Event], data: st.DataObject) -> None:
    event = data.draw(structs(cls))
    wire = codec.encode(event)
    back = codec.decode(wire)
    assert type(back) is cls
    assert codec.encode(back) == wire  # byte-identical: NaN payloads and -0.0 compare equal this way
    assert msgspec.msgpack.decode(wire)["type"] == cls.__name__


@settings(max_examples=200, deadline=None)
@given(loss=st.floats(allow_nan=True, allow_infinity=True))
def test_nan_and_inf_losses_survive(loss: float) -> None:
    event = StepCompleted(job_id="j", rank=0, step=1, loss=loss, grad_norm=float("inf"), lr=1e-3,
                          tokens_per_s=1.0, step_time_s=0.1)
    back = codec.decode(codec.encode(event))
    assert isinstance(back, StepCompleted)
    assert (math.isnan(back.loss) and math.isnan(loss)) or back.loss == loss
    assert back.grad_norm == math.inf


def test_every_tag_is_its_class_name_and_unique() -> None:
    names = [cls.__name__ for cls in ALL_TYPES]
    assert len(set(names)) == len(names)
    assert all(msgspec.inspect.type_info(cls).tag == cls.__name__ for cls in ALL_TYPES)  # type: ignore[attr-defined]


def test_a_newer_schema_version_is_refused() -> None:
    wire = codec.encode(StepCompleted(job_id="j", rank=0, step=1, loss=1.0, grad_norm=1.0, lr=1.0, tokens_per_s=1.0,
                                      step_time_s=1.0, schema_version=StepCompleted.SCHEMA + 1))
    with pytest.raises(codec.UnknownSchemaVersion, match=r"StepCompleted schema version 4 is newer than 3"):
        codec.decode(wire)
    assert issubclass(codec.UnknownSchemaVersion, codec.UndecodableEvent)


def _valid() -> dict[str, Any]:
    return msgspec.to_builtins(StepCompleted(job_id="j", rank=0, step=1, loss=1.0, grad_norm=1.0, lr=1.0,
                                             tokens_per_s=1.0, step_time_s=1.0))  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("wire", "why"),
    [
        (b"", "empty"),
        (b"\xc1", "reserved byte"),
        (b"\x93\x01\x02\x03", "an array, not a map"),
        (msgspec.msgpack.encode({"no": "tag"}), "no type tag"),
        (msgspec.msgpack.encode({"type": "NoSuchEvent", "job_id": "j"}), "unknown tag"),
        (msgspec.msgpack.encode({k: v for k, v in _valid().items() if k != "step"}), "missing field"),
        (msgspec.msgpack.encode({**_valid(), "step": "one"}), "wrong type"),
        (msgspec.msgpack.encode(_valid())[:-3], "truncated"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_malformed_bytes_are_undecodable(wire: bytes, why: str) -> None:
    with pytest.raises(codec.UndecodableEvent) as info:
        codec.decode(wire)
    assert str(info.value), f"{why}: the error says why"
