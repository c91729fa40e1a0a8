"""`flightdeck postmortem` as a user runs it (the CLI in a subprocess): from a history file, from a job's history on a
real broker, and the one-line errors."""

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from flightdeck.events.jetstream import JetStreamStore
from flightdeck.services.shell import broker
from flightdeck.services.tools.postmortem.synthetic import Scenario, synthesise

ROOT = Path(__file__).resolve().parents[2]
CLI = (sys.executable, "-m", "flightdeck.services.tools.console")
FIXTURE = ROOT / "tests" / "fixtures" / "histories" / "spike.fdh.jsonl"


def flightdeck(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.timeout(90)
def test_a_postmortem_from_a_history_file(tmp_path: Path) -> None:
    out = tmp_path / "pm"
    run = flightdeck("postmortem", "--from", str(FIXTURE), "--out", str(out))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert 5 <= len(lines) <= 12, run.stdout
    assert str(out / "report.html") in lines[1]
    assert "outcome: completed" in run.stdout and "goodput 61.6%" in run.stdout
    # the recording's numbers (tests/unit/test_postmortem_fixture.py checks them against its raw events)
    assert "#1 loss_spike (attempt 0): rollback; detected in 0.73 s, recovered in 1.44 s; 15 steps lost" in run.stdout
    # its diagnosis under it: the drill re-ran nothing (policy.spike_diagnosis is off), and every rank spiked
    (cause,) = [line for line in lines if line.strip().startswith("cause: ")]
    assert cause.strip().startswith("cause: undetermined: the spike over steps 30-32: skipping batches [30, 38)")
    for name in ("report.md", "report.html", "loss.png", "step_rate.png", "time.png"):
        assert (out / name).stat().st_size > 0


async def publish(url: str, scenario: Scenario) -> None:
    """The synthetic history appended to a real broker, as the services and ranks would have."""
    store = await JetStreamStore.connect(url)
    try:
        for s in synthesise(scenario):
            await store.append_bytes(s.subject, s.data, msg_id=s.msg_id)
    finally:
        await store.close()


@pytest.mark.timeout(120)
def test_a_postmortem_of_a_failed_job_read_from_the_broker(nats_server: broker.Broker, tmp_path: Path) -> None:
    sc = Scenario(steps=60, checkpoint_every=10, max_restarts=1, faults=(("crash", 23), ("hang", 38)))
    asyncio.run(publish(nats_server.url, sc))
    out = tmp_path / "pm"
    run = flightdeck("postmortem", sc.job_id, "--out", str(out), "--nats", nats_server.url,
                     "--data-dir", str(tmp_path / "nothing-imported"))
    assert run.returncode == 0, run.stderr
    assert f"broker {nats_server.url}" in run.stdout
    assert "outcome: failed" in run.stdout and "restart budget of 1 spent" in run.stdout
    assert "#1 crash (attempt 0): restart" in run.stdout and "#2 hang (attempt 1): fail" in run.stdout
    md = (out / "report.md").read_text()
    assert "## Why it failed" in md and "RankHung" in md

    missing = flightdeck("postmortem", "no-such-job", "--out", str(out), "--nats", nats_server.url,
                         "--data-dir", str(tmp_path / "nothing-imported"))
    assert missing.returncode == 2 and "no job 'no-such-job'" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(60)
def test_an_out_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.write_text("keep me")
    run = flightdeck("postmortem", "--from", str(FIXTURE), "--out", str(target))
    assert run.returncode == 1 and "is a file" in run.stderr
    assert target.read_text() == "keep me"
