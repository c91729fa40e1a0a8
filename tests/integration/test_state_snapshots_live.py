"""A service's state snapshots on the real broker (services/shell/snapshots.py): a service SIGKILLed mid-stream comes
back from its newest snapshot, folds only what came after it, and still answers every input exactly once; a clean
stop leaves a snapshot of everything it folded."""

import json
from pathlib import Path

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell import snapshots
from tests.integration.runtime_helpers import bus_at, kill_mid_stream_and_restart, submissions

pytestmark = pytest.mark.timeout(120)


def rebuilds(log: Path) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("event") == "rebuilt" and e.get("service") == "toy"]


async def test_a_killed_service_restarts_from_its_snapshot_and_answers_every_input_exactly_once(
        nats_server: broker_mod.Broker, tmp_path: Path) -> None:
    inputs = submissions(1200)
    log = tmp_path / "toy.log"
    async with bus_at(nats_server.url) as bus:
        await kill_mid_stream_and_restart(
            bus, nats_server.url, log, inputs, kill_after="j400", FLIGHTDECK_STATE_SNAPSHOT_EVERY="100",
            before_kill=lambda: bus.store.last(subjects.STATE, snapshots.head_subject("toy")))
        head = await bus.store.last(subjects.STATE, snapshots.head_subject("toy"))
        assert head is not None
        last = msgspec.msgpack.decode(head.data, type=snapshots.Head)
    first, second = rebuilds(log)
    assert first["from_snapshot"] == 0
    assert 0 < int(second["from_snapshot"]) <= int(second["until_seq"])  # type: ignore[call-overload]
    assert last.control_seq == int(json.loads(
        [ln for ln in log.read_text().splitlines() if '"event": "stopped"' in ln][-1])["control_seq"])
