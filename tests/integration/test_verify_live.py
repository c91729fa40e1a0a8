"""`flightdeck verify` and `whatif` against a real nats-server: the recorded spike drill is stored back into a
fresh broker (every stream of it is whole from sequence 1, so it lands at its recorded sequences), and the verbs
read it as they read any live job (services/tools/history: job_rows). No services run."""

import asyncio
from pathlib import Path

import msgspec
import pytest
import structlog

from events import codec
from events.commands import RollbackRequested
from events.history import append_to_job
from events.jetstream import JetStreamStore
from events.job import JobFailed
from events.store import Stored
from services.shell import broker
from services.tools.console.__main__ import main as cli_main
from services.tools.history import fdh

pytestmark = pytest.mark.timeout(60)
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "histories" / "spike.fdh.jsonl"
JOB = "spike-000001"


def flightdeck(argv: list[str]) -> int:
    try:
        return cli_main(argv)
    finally:
        structlog.reset_defaults()  # main() points logs at this test's captured stderr, which pytest then closes


async def store_back(url: str, rows: list[Stored]) -> None:
    store = await JetStreamStore.connect(url)
    try:
        for s in rows:
            result = await store.append_bytes(s.subject, s.data, msg_id=s.msg_id)
            assert (result.stream, result.seq) == (s.stream, s.seq), (s.stream, s.seq)
    finally:
        await store.close()


def test_verify_passes_on_the_live_history_and_whatif_reads_it(nats_server: broker.Broker,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    asyncio.run(store_back(nats_server.url, fdh.load(FIXTURE)))
    capsys.readouterr()
    assert flightdeck(["verify", JOB, "--nats", nats_server.url, "--data-dir", "/nonexistent"]) == 0
    out = capsys.readouterr().out
    assert f"broker {nats_server.url}" in out and "OK: every recorded decision reproduced" in out
    assert flightdeck(["whatif", JOB, "--nats", nats_server.url, "--data-dir", "/nonexistent",
                 "--set", "policy.spike_steps=4", "--json"]) == 0  # the drill's spike lasts 3 steps
    report = msgspec.json.decode(capsys.readouterr().out)
    assert [(c["kind"], c["decision"]["type"]) for c in report["changes"]][:2] == [
        ("vanishes", "LossSpikeDetected"), ("vanishes", "RollbackRequested")]


def test_a_forged_decision_appended_to_the_live_history_fails_verify(nats_server: broker.Broker,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    rows = fdh.load(FIXTURE)
    asyncio.run(store_back(nats_server.url, rows))
    (rollback,) = [s for s in rows if isinstance(s.event, RollbackRequested)]
    spike = rollback.msg_id.split(":")[2]  # the scheduler decided the rollback on the spike finding
    assert rollback.event is not None
    forged = JobFailed(job_id=JOB, reason="forged after the fact", event_id=f"scheduler:FD_CONTROL:{spike}:1",
                       producer="scheduler", occurred_at=rollback.event.occurred_at,
                       causation_id=rollback.event.causation_id)

    async def forge() -> None:
        store = await JetStreamStore.connect(nats_server.url)
        try:
            await append_to_job(store, forged, msg_id=forged.event_id)  # numbered: one every reader admits
        finally:
            await store.close()

    asyncio.run(forge())
    capsys.readouterr()  # the store's own log lines (structlog prints to stdout by default)
    assert flightdeck(["verify", JOB, "--nats", nats_server.url, "--data-dir", "/nonexistent", "--json"]) == 1
    verdict = msgspec.json.decode(capsys.readouterr().out)
    first = verdict["divergences"][0]
    assert (first["service"], first["kind"], first["msg_id"]) == ("scheduler", "not reproduced", forged.event_id)
    assert first["input"]["seq"] == int(spike) and first["input"]["type"] == "LossSpikeDetected"  # as it claims
    assert first["recorded"] == codec.to_builtins(forged) | {"job_version": first["recorded"]["job_version"]}
