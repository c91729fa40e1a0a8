"""Hostile values for every place input enters: wrong types, extremes, traversal strings, broken msgpack.

`events(cls)` draws catalog events whose fields are either sane (anchored to a running job, so the
input reaches deep into a core) or hostile; `wire(cls)` draws the bytes a careless or malicious
publisher could put on a subject: wrong-typed fields, truncated or random msgpack, future versions.
"""

import functools
from typing import Any

import msgspec
from hypothesis import strategies as st
from msgspec import inspect as mi

from flightdeck.events import codec
from flightdeck.events.base import Event
from flightdeck.events.catalog import ALL_TYPES
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec

JOB, NODE, RANK, ATTEMPT = "j-1", "n0", 0, 0
SANE: dict[str, Any] = {"job_id": JOB, "node": NODE, "rank": RANK, "attempt": ATTEMPT, "service": "health",
                        "schema_version": 1, "job_version": 0, "checkpoint_id": "step000000010-a0"}

HOSTILE_INTS = [-1, -(2**63), 2**31, 10**9, 10**18, 2**63 - 1]
HOSTILE_FLOATS = [float("nan"), float("inf"), float("-inf"), -1.0, 1e308, -1e308]
HOSTILE_STRS = ["", "..", "../../etc", "/", "a/b", "/etc/passwd", "a\x00b", "x" * 5000, "\u202egnp.exe",
                "\uff4a\uff4f\uff42",  # fullwidth "job": looks like a name, is not one
                "a.b.c", "*", ">", "a b", "ok\n", "\ufffd"]


def _sane(t: mi.Type) -> st.SearchStrategy[Any]:
    match t:
        case mi.IntType():
            return st.integers(t.ge if t.ge is not None else 0, min(t.le if t.le is not None else 50, 50))
        case mi.FloatType():
            lo = t.ge if t.ge is not None else (t.gt if t.gt is not None else 0.0)
            return st.floats(lo, max(lo, 10.0), exclude_min=t.gt is not None and lo == t.gt) | st.just(max(lo, 1.0))
        case mi.StrType(pattern=str() as pattern):
            return st.from_regex(pattern, fullmatch=True).filter(lambda s: len(s) < 64)
        case mi.StrType():
            return st.text("abc-_0123", min_size=1, max_size=12)
        case mi.BoolType():
            return st.booleans()
        case mi.BytesType():
            return st.binary(max_size=16)
        case mi.NoneType():
            return st.none()
        case mi.LiteralType():
            return st.sampled_from(t.values)
        case mi.ListType():
            return st.lists(_sane(t.item_type), max_size=3)
        case mi.TupleType():
            return st.tuples(*(_sane(i) for i in t.item_types))
        case mi.DictType():
            return st.dictionaries(_sane(t.key_type), _sane(t.value_type), max_size=3)
        case mi.UnionType():
            return st.one_of(*(_sane(u) for u in t.types))
        case mi.StructType():
            return _struct(t.cls, _sane)
    raise AssertionError(f"no sane strategy for {t!r}")


def _hostile(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values the type admits structurally but a service must not take at face value."""
    match t:
        case mi.IntType():
            return st.sampled_from(HOSTILE_INTS) | st.integers(-(2**63), 2**63 - 1)
        case mi.FloatType():
            return st.sampled_from(HOSTILE_FLOATS) | st.floats()
        case mi.StrType():
            return st.sampled_from(HOSTILE_STRS) | st.text(max_size=40)
        case mi.ListType():
            # long lists of one value: cheap to draw, costly to fold if a core is quadratic in them
            return st.lists(_sane(t.item_type), max_size=3) | _sane(t.item_type).map(lambda v: [v] * 2_000)
        case mi.StructType():
            return _struct(t.cls, lambda f: _hostile(f) | _sane(f))
    return _sane(t)


SPECS = [JobSpec(name="fuzz", slots=2), JobSpec(name="big", slots=65_536, train=TrainSpec(batch_size=65_536)),
         JobSpec(name="x", policy=PolicySpec(max_restarts=0, min_slots=1))]


def _struct(cls: type[Any], leaf: Any) -> st.SearchStrategy[Any]:
    if cls is JobSpec:  # specs carry their own bounds (tests/badinput/test_spec_hostile.py); drawing them is slow
        return st.sampled_from(SPECS)
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for f in info.fields:
        anchored = st.just(SANE[f.name]) if f.name in SANE else _sane(f.type)
        fields[f.name] = anchored | leaf(f.type) if leaf is not _sane else anchored
    return st.builds(cls, **fields)


@functools.cache
def sane(cls: type[Event]) -> st.SearchStrategy[Event]:
    return _struct(cls, _sane)


@functools.cache
def events(cls: type[Event]) -> st.SearchStrategy[Event]:
    """`cls` instances with each field sane or hostile (at least one of them, usually)."""
    return _struct(cls, lambda t: _hostile(t))


def subject_for(event: Event) -> str:
    """The subject the event's own fields name (no token checks: a hostile id lands where it says)."""
    name = type(event).__name__
    if hasattr(event, "rank") and name in ("StepCompleted", "Heartbeat", "RankFault", "FaultInjected", "RolledBack",
                                          "RankStarted", "CheckpointStaged"):
        return f"fd.tel.{event.job_id}.{event.rank}.{name}"  # type: ignore[attr-defined]
    if hasattr(event, "job_id"):
        return f"fd.ctl.job.{event.job_id}.{name}"  # type: ignore[attr-defined]
    if name == "ClockTick":
        return f"fd.ctl.clock.{event.service}"  # type: ignore[attr-defined]
    if name == "DeadLettered":
        return f"fd.dead.{event.service}"  # type: ignore[attr-defined]
    return f"fd.ctl.node.{event.node}.{name}"  # type: ignore[attr-defined]


WRONG_TYPES: list[Any] = ["one", 1, -1, 2**64 - 1, 1.5, float("nan"), None, True, [], [1, 2], {}, {"a": 1}, b"\xff",
                          "x" * 70_000, list(range(5000))]


def _builtins(event: Event) -> dict[str, Any]:
    out = msgspec.to_builtins(event)
    assert isinstance(out, dict)
    return out


@st.composite
def wrong_typed(draw: st.DrawFn, cls: type[Event]) -> bytes:
    """A valid event of `cls` with one field (or the tag, or the version) replaced by a value of the wrong type."""
    body = _builtins(draw(sane(cls)))
    key = draw(st.sampled_from(sorted(body)))
    value = draw(st.sampled_from(WRONG_TYPES).filter(lambda v: type(v) is not type(body[key])))
    return msgspec.msgpack.encode({**body, key: value})


@st.composite
def truncated(draw: st.DrawFn, cls: type[Event]) -> bytes:
    wire = codec.encode(draw(sane(cls)))
    return wire[: draw(st.integers(0, len(wire) - 1))]


@st.composite
def bit_flipped(draw: st.DrawFn, cls: type[Event]) -> bytes:
    wire = bytearray(codec.encode(draw(sane(cls))))
    i = draw(st.integers(0, len(wire) - 1))
    wire[i] ^= 1 << draw(st.integers(0, 7))
    return bytes(wire)


@st.composite
def future(draw: st.DrawFn, cls: type[Event]) -> bytes:
    """What newer code might write: a higher schema version, maybe a new field, maybe a changed one."""
    body = _builtins(draw(sane(cls)))
    body["schema_version"] = cls.SCHEMA + draw(st.integers(1, 1000))
    if draw(st.booleans()):
        body["added_in_v2"] = draw(st.text(max_size=8))
    if draw(st.booleans()):
        key = draw(st.sampled_from(sorted(k for k in body if k not in ("type", "schema_version"))))
        body[key] = {"changed": "shape"}
    return msgspec.msgpack.encode(body)


def wire(cls: type[Event]) -> st.SearchStrategy[bytes]:
    """Bytes a publisher might put on `cls`'s subject that a reader must refuse."""
    return st.one_of(wrong_typed(cls), truncated(cls), st.binary(max_size=256))


TYPES = ALL_TYPES
