"""The decode path under garbage, wrong types and newer code: only UndecodableEvent (or a subclass saying
which kind of refusal) ever comes out, newer code is told apart from garbage, and `admit` refuses exactly
the values outside the bounds (naming the field)."""

import math

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flightdeck.events import codec
from flightdeck.events.base import Event
from flightdeck.events.catalog import ALL_TYPES
from flightdeck.events.checkpoint import CheckpointDeleted
from flightdeck.events.fleet import NodeRegistered
from flightdeck.events.job import AllocationGranted, SlotRef, WorkersStarted
from flightdeck.events.training import Heartbeat, StepCompleted
from tests.badinput import hostile

MANY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])
NAMES = [t.__name__ for t in ALL_TYPES]
ANY_TYPE = st.sampled_from(ALL_TYPES)


def _refused(data: bytes) -> codec.UndecodableEvent | None:
    try:
        codec.admit(data)
    except codec.UndecodableEvent as exc:
        assert str(exc), "a refusal says why"
        return exc
    return None


@MANY
@given(data=st.binary(max_size=512))
def test_random_bytes_are_refused_or_a_valid_event(data: bytes) -> None:
    try:
        event = codec.admit(data)
    except codec.UndecodableEvent:
        return
    assert isinstance(event, Event)  # random bytes can spell a tiny valid event (e.g. a bare map with a tag)


@MANY
@given(data=st.data())
def test_wrong_typed_fields_truncations_and_bit_flips_never_escape_as_other_errors(data: st.DataObject) -> None:
    cls = data.draw(ANY_TYPE)
    wire = data.draw(st.one_of(hostile.wrong_typed(cls), hostile.truncated(cls), hostile.bit_flipped(cls)))
    _refused(wire)  # refused or decoded; never TypeError, OverflowError, RecursionError, ...


@MANY
@given(data=st.data())
def test_a_future_version_is_called_newer_not_garbage(data: st.DataObject) -> None:
    cls = data.draw(ANY_TYPE)
    exc = _refused(data.draw(hostile.future(cls)))
    assert isinstance(exc, codec.UnknownSchemaVersion), exc
    assert f"{cls.__name__} schema version" in str(exc) and "upgrade" in str(exc)


@settings(max_examples=100, deadline=None)
@given(name=st.from_regex(r"\A[A-Z][A-Za-z]{2,30}\Z").filter(lambda n: n not in NAMES), version=st.integers(1, 99),
       body=st.dictionaries(st.text(max_size=8), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8), max_size=4))
def test_an_unknown_type_is_called_unknown_not_garbage(name: str, version: int, body: dict[str, object]) -> None:
    exc = _refused(msgspec.msgpack.encode({**body, "type": name, "schema_version": version}))
    assert isinstance(exc, codec.UnknownEventType) and name in str(exc)


@pytest.mark.parametrize("wire", [b"", b"\xc1", b"\x93\x01\x02\x03", msgspec.msgpack.encode({"no": "tag"}),
                                  msgspec.msgpack.encode({"type": 7}), b"\xdf\xff\xff\xff\xff"],
                         ids=["empty", "reserved", "array", "untagged", "tag-not-str", "huge-map-header"])
def test_garbage_is_plain_undecodable(wire: bytes) -> None:
    exc = _refused(wire)
    assert type(exc) is codec.UndecodableEvent, exc


@MANY
@given(data=st.data())
def test_hostile_values_are_admitted_unchanged_or_refused_naming_the_field(data: st.DataObject) -> None:
    cls = data.draw(ANY_TYPE)
    event = data.draw(hostile.events(cls))
    wire = codec.encode(event)
    try:
        back = codec.admit(wire)
    except codec.InvalidEvent as exc:
        assert "at `$." in str(exc), exc
        return
    except codec.UndecodableEvent as exc:  # e.g. a hostile schema_version above ours
        assert event.schema_version > cls.SCHEMA, exc
        return
    assert codec.encode(back) == wire
    assert back.occurred_at >= 0 and math.isfinite(back.occurred_at)


BEAT = {"job_id": "j-1", "rank": 0, "step": 1, "interval_s": 1.0}


@pytest.mark.parametrize(("event", "field"), [
    (Heartbeat(**{**BEAT, "job_id": "../../etc"}), "job_id"),  # type: ignore[arg-type]
    (Heartbeat(**{**BEAT, "job_id": "a/b"}), "job_id"),  # type: ignore[arg-type]
    (Heartbeat(**{**BEAT, "job_id": "ok\n"}), "job_id"),  # type: ignore[arg-type]
    (Heartbeat(**{**BEAT, "job_id": "x" * 129}), "job_id"),  # type: ignore[arg-type]
    (Heartbeat(**{**BEAT, "rank": -1}), "rank"),  # type: ignore[arg-type]
    (Heartbeat(**{**BEAT, "step": -5}), "step"),  # type: ignore[arg-type]
    (Heartbeat(**{**BEAT, "interval_s": math.nan}), "interval_s"),  # type: ignore[arg-type]
    (Heartbeat(**BEAT, occurred_at=math.inf), "occurred_at"),  # type: ignore[arg-type]
    (StepCompleted(job_id="j", rank=0, step=1, loss=1.0, grad_norm=1.0, lr=1.0, tokens_per_s=1.0,
                   step_time_s=-1.0), "step_time_s"),
    (NodeRegistered(node="n0", kind="cpu", slots=10**9), "slots"),
    (NodeRegistered(node="n\x000", kind="cpu", slots=1), "node"),
    (AllocationGranted(job_id="j", attempt=0, assignments=[SlotRef(node="n0", slot=0, rank=2**40)]),
     "assignments[0].rank"),
    (AllocationGranted(job_id="j", attempt=0, assignments=[], master_port=70_000), "master_port"),
    (WorkersStarted(job_id="j", node="n0", attempt=-1, ranks=[0], pids=[1]), "attempt"),
    (CheckpointDeleted(job_id="j", checkpoint_id="../../.."), "checkpoint_id"),
    (CheckpointDeleted(job_id="j", checkpoint_id=""), "checkpoint_id"),
])
def test_out_of_bounds_values_are_refused_naming_the_field(event: Event, field: str) -> None:
    exc = _refused(codec.encode(event))
    assert isinstance(exc, codec.InvalidEvent), exc
    assert f"at `$.{field}`" in str(exc), exc
    codec.decode(codec.encode(event))  # the catalog's own decode still reads it (tools may show it)


def test_a_heartbeat_before_the_first_step_is_admitted() -> None:
    """Ranks beat from start-up, before any step: the trainer sends step -1 then, and health must see it
    (a dead-lettered start-up beat would make a slow-starting rank look silent)."""
    beat = Heartbeat(**{**BEAT, "step": -1})  # type: ignore[arg-type]
    assert codec.admit(codec.encode(beat)) == beat


def test_nan_loss_is_data_not_an_error() -> None:
    """A NaN loss is what the health monitor exists to see: the bounds must let it through."""
    event = StepCompleted(job_id="j", rank=0, step=1, loss=math.nan, grad_norm=math.inf, lr=1.0, tokens_per_s=1.0,
                          step_time_s=0.1)
    back = codec.admit(codec.encode(event))
    assert isinstance(back, StepCompleted) and math.isnan(back.loss)
