"""The recorded spike drill (tests/fixtures/histories/spike.fdh.jsonl, written by tests/fixtures/record_drill.py)
is replay-complete: loaded into an in-memory store at its recorded sequences, the pure cores folded over it decide
exactly what the live services recorded, output for output (what `flightdeck verify` will check)."""

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from flightdeck.events import codec, subjects
from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import LossSpikeDetected
from flightdeck.events.store import MemoryStore, Stored
from flightdeck.services.core import Service
from flightdeck.services.health.core import core_service as health
from flightdeck.services.resharder.core import core_service as resharder
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from flightdeck.services.shell.fold import replay, same_decision

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "histories" / "spike.fdh.jsonl"


def records() -> list[dict[str, Any]]:
    return [json.loads(line) for line in FIXTURE.read_bytes().splitlines()]


async def loaded() -> tuple[MemoryStore, list[Stored]]:
    store = MemoryStore()
    rows = []
    for r in records():
        result = await store.append_bytes(r["subject"], base64.b64decode(r["data"]), msg_id=r["msg_id"])
        assert (result.stream, result.seq, result.duplicate) == (r["stream"], r["seq"], False), r
    for stream in subjects.STREAM_SUBJECTS:
        async for batch in store.read(stream):
            rows += batch
    return store, rows


def test_the_fixture_is_small_whole_and_decodes() -> None:
    assert FIXTURE.stat().st_size < 2_000_000
    rows = records()
    for stream in subjects.STREAM_SUBJECTS:
        seqs = [r["seq"] for r in rows if r["stream"] == stream]
        assert seqs == list(range(1, len(seqs) + 1)), stream  # nothing missing, in order
    events = [codec.decode(base64.b64decode(r["data"])) for r in rows]
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("JobCompleted") == 1 and kinds.count("RollbackRequested") == 1
    assert kinds.index("LossSpikeDetected") < kinds.index("RollbackRequested") < kinds.index("JobCompleted")


@pytest.mark.parametrize("service", [scheduler(), health(), resources(), resharder()], ids=lambda s: s.name)
async def test_replaying_the_recorded_inputs_decides_what_was_recorded(service: Service[Any]) -> None:
    store, rows = await loaded()
    stored = {s.msg_id: s for s in rows  # its decisions; its clock ticks are inputs the shell recorded
              if s.stream == subjects.CONTROL and s.event is not None and s.event.producer == service.name
              and not isinstance(s.event, ClockTick | CoreConfigured)}
    recorded = {mid: s.event for mid, s in stored.items()}
    assert recorded, f"{service.name} recorded nothing"
    replayed = {out.msg_id: out.event async for step in replay(service, store) for out in step.outputs}
    assert set(replayed) == set(recorded)
    for mid in recorded:
        assert same_decision(stored[mid], replayed[mid]), mid  # over the fields it was recorded with


async def test_the_rollback_names_the_spike_and_a_committed_checkpoint_before_it() -> None:
    _, rows = await loaded()
    events = [s.event for s in rows if s.event is not None]
    (spike,) = [e for e in events if isinstance(e, LossSpikeDetected)]
    (rollback,) = [e for e in events if isinstance(e, RollbackRequested)]
    commits = {e.checkpoint_id: e.step for e in events if isinstance(e, CheckpointCommitted)}
    assert rollback.trigger_id == spike.event_id == rollback.causation_id
    assert commits[rollback.checkpoint_id] == rollback.to_step < spike.step <= rollback.skip_from + 2
