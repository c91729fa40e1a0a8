"""`flightdeck verify` and `whatif` against a real nats-server: the recorded spike drill is stored back into a
fresh broker (every stream of it is whole from sequence 1, so it lands at its recorded sequences), and the verbs
read it as they read any live job (services/tools/history: job_rows). No services run."""

import asyncio
from pathlib import Path

import msgspec
import pytest
import structlog

from flightdeck.events import codec
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.history import append_to_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import JobFailed
from flightdeck.events.store import Stored
from flightdeck.services.shell import broker
from flightdeck.services.tools.console.__main__ import main as cli_main
from flightdeck.services.tools.history import fdh

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


def test_verify_passes_on_the_live_history_and_whatif_reads_it(nats_server: broker.Broker, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    asyncio.run(store_back(nats_server.url, fdh.load(FIXTURE)))
    capsys.readouterr()
    assert flightdeck(["verify", JOB, "--nats", nats_server.url, "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"broker {nats_server.url}" in out and "OK: every recorded decision reproduced" in out
    assert flightdeck(["whatif", JOB, "--nats", nats_server.url, "--data-dir", "/nonexistent",
                 "--set", "policy.spike_steps=4", "--json"]) == 0  # the drill's spike lasts 3 steps
    report = msgspec.json.decode(capsys.readouterr().out)
    assert [(c["kind"], c["decision"]["type"]) for c in report["changes"]][:2] == [
        ("vanishes", "LossSpikeDetected"), ("vanishes", "RollbackRequested")]


@pytest.mark.parametrize("verified_before", [False, True])
def test_a_forged_decision_appended_to_the_live_history_fails_verify(nats_server: broker.Broker, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str],
                                                                     verified_before: bool) -> None:
    """Also when a clean verify left its mark before the forgery: the next one goes on from it, and the forged
    decision, which claims an input the mark covers, is recorded after the mark: not one that verify checked."""
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

    if verified_before:
        assert flightdeck(["verify", JOB, "--nats", nats_server.url, "--data-dir", str(tmp_path)]) == 0
        assert (tmp_path / "verified" / f"{JOB}.mark").exists()
    asyncio.run(forge())
    capsys.readouterr()  # the store's own log lines (structlog prints to stdout by default)
    assert flightdeck(["verify", JOB, "--nats", nats_server.url, "--data-dir", str(tmp_path), "--json"]) == 1
    verdict = msgspec.json.decode(capsys.readouterr().out)
    first = verdict["divergences"][0]
    assert (first["service"], first["kind"], first["msg_id"]) == ("scheduler", "not reproduced", forged.event_id)
    if verified_before:  # the input it claims is not read again: the mark covers it
        assert first["input"] is None and "the clean verify up to seq" in first["detail"]
        return
    assert first["input"]["seq"] == int(spike) and first["input"]["type"] == "LossSpikeDetected"  # as it claims
    assert first["recorded"] == codec.to_builtins(forged) | {"job_version": first["recorded"]["job_version"]}


def test_a_second_verify_goes_on_from_the_first_and_checks_the_same(nats_server: broker.Broker, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    asyncio.run(store_back(nats_server.url, fdh.load(FIXTURE)))
    argv = ["verify", JOB, "--nats", nats_server.url, "--data-dir", str(tmp_path), "--json"]
    capsys.readouterr()
    assert flightdeck(argv) == 0
    first = msgspec.json.decode(capsys.readouterr().out)
    assert flightdeck(argv) == 0
    second = msgspec.json.decode(capsys.readouterr().out)
    assert first["resumed_from"] == 0 and second["resumed_from"] == first["horizon"]
    assert second["services"] == first["services"]  # what the mark holds, counted again, nothing re-derived twice
    assert flightdeck([*argv, "--full"]) == 0
    assert msgspec.json.decode(capsys.readouterr().out)["resumed_from"] == 0
