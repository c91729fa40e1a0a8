"""A service's state snapshots on the real broker (services/shell/snapshots.py): a service SIGKILLed mid-stream comes
back from its newest snapshot, folds only what came after it, and still answers every input exactly once; a clean
stop leaves a snapshot of everything it folded."""

import json
import os
import signal
from pathlib import Path

import msgspec
import pytest

from events import subjects
from services.shell import broker as broker_mod
from services.shell import snapshots
from tests.integration.runtime_helpers import (
    assert_exactly_once,
    bus_at,
    eventually,
    read_all,
    spawn_service,
    submissions,
)
from tests.integration.test_runtime import answered

pytestmark = pytest.mark.timeout(120)


def rebuilds(log: Path) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("event") == "rebuilt" and e.get("service") == "toy"]


async def test_a_killed_service_restarts_from_its_snapshot_and_answers_every_input_exactly_once(
        nats_server: broker_mod.Broker, tmp_path: Path) -> None:
    inputs = submissions(1200)
    log = tmp_path / "toy.log"
    async with bus_at(nats_server.url) as bus:
        proc = spawn_service("toy", nats_server.url, log, FLIGHTDECK_STATE_SNAPSHOT_EVERY="100")
        try:
            await bus.store.append_batch(inputs)
            await eventually(lambda: answered(bus, "j400"), 40, "some answers")
            await eventually(lambda: bus.store.last(subjects.STATE, snapshots.head_subject("toy")), 20, "a snapshot")
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(10) == -signal.SIGKILL
            assert not await answered(bus, "j1199"), "the kill came too late to test anything"
            proc = spawn_service("toy", nats_server.url, log, FLIGHTDECK_STATE_SNAPSHOT_EVERY="100")
            await eventually(lambda: answered(bus, "j1199"), 40, "the last answer after the restart")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
        assert_exactly_once(await read_all(bus.store, subjects.CONTROL), inputs)
        head = await bus.store.last(subjects.STATE, snapshots.head_subject("toy"))
        assert head is not None
        last = msgspec.msgpack.decode(head.data, type=snapshots.Head)
    first, second = rebuilds(log)
    assert first["from_snapshot"] == 0
    assert 0 < int(second["from_snapshot"]) <= int(second["until_seq"])  # type: ignore[call-overload]
    assert last.control_seq == int(json.loads(
        [ln for ln in log.read_text().splitlines() if '"event": "stopped"' in ln][-1])["control_seq"])
