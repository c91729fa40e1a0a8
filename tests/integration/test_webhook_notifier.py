"""examples/webhook_notifier as a process of its own against a real broker and a real HTTP endpoint: it posts one
signed webhook per JobFailed and LossSpikeDetected of any job and nothing for other events, retries what the
endpoint could not take yet, skips what it refuses, and resumes after a restart without a gap or a repeat."""

import asyncio
import hashlib
import hmac
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from flightdeck.events.base import JobEvent
from flightdeck.events.findings import LossSpikeDetected, RankLost
from flightdeck.events.history import append_to_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import JobCompleted, JobFailed
from flightdeck.services.shell import broker as broker_mod
from tests.conftest import ensure_streams_at

ROOT = Path(__file__).resolve().parents[2]
NOTIFIER = ROOT / "examples" / "webhook_notifier" / "notifier.py"
SECRET = b"s3cret-for-the-test"


@dataclass
class Hook:
    """The receiving end: records every request; answers 503 to the first try of a delivery id in `flaky`, 400 to
    those in `refuse`, 200 otherwise."""

    url: str = ""
    got: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    flaky: set[str] = field(default_factory=set)
    refuse: set[str] = field(default_factory=set)

    async def handle(self, request: web.Request) -> web.Response:
        data = await request.read()
        self.got.append((dict(request.headers), data))
        delivery = request.headers.get("X-Flightdeck-Delivery", "")
        if delivery in self.flaky:
            self.flaky.discard(delivery)
            return web.Response(status=503)
        return web.Response(status=400 if delivery in self.refuse else 200)

    def ids(self) -> list[str]:
        return [h["X-Flightdeck-Delivery"] for h, _ in self.got]


@pytest.fixture
async def hook() -> AsyncIterator[Hook]:
    h = Hook()
    app = web.Application()
    app.router.add_post("/hook", h.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    h.url = f"http://127.0.0.1:{port}/hook"
    try:
        yield h
    finally:
        await runner.cleanup()


def start(url: str, hook_url: str, tmp: Path, *extra: str) -> subprocess.Popen[bytes]:
    (tmp / "secret").write_bytes(SECRET + b"\n")
    log = open(tmp / "notifier.log", "ab")
    return subprocess.Popen([sys.executable, str(NOTIFIER), "--nats", url, "--url", hook_url, "--secret-file",
                             str(tmp / "secret"), "--state", str(tmp / "state.json"), *extra],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def until(what: str, check: object, tmp: Path, within: float = 60.0) -> None:
    for _ in range(int(within / 0.05)):
        if check():  # type: ignore[operator]
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; notifier log:\n{(tmp / 'notifier.log').read_text()}")


def stopped(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(30)


def event(cls: type[JobEvent], job_id: str, n: int, **fields: object) -> JobEvent:
    return cls(job_id=job_id, event_id=f"{job_id}-{cls.__name__}-{n}", occurred_at=1_800_000_000.0 + n,
               producer="test", **fields)


def spike(job_id: str, n: int, loss: float = 9.5) -> JobEvent:
    return event(LossSpikeDetected, job_id, n, rank=0, attempt=0, step=30, loss=loss, baseline=2.0, mad=0.1, z=75.0,
                 threshold=6.0)


async def test_posts_signed_webhooks_retries_skips_refusals_and_resumes_after_a_restart(
        nats_server: broker_mod.Broker, hook: Hook, tmp_path: Path) -> None:
    await asyncio.to_thread(ensure_streams_at, nats_server.url)
    store = await JetStreamStore.connect(nats_server.url)
    started: list[subprocess.Popen[bytes]] = []
    try:
        # Before the notifier's first start: not posted (a first start follows from then on).
        await append_to_job(store, event(JobFailed, "before-000001", 1, reason="long ago"))
        proc = start(nats_server.url, hook.url, tmp_path)
        started.append(proc)
        await until("the notifier's first state", (tmp_path / "state.json").exists, tmp_path)

        first = spike("run-000001", 2)
        hook.flaky.add(first.event_id)  # 503 on its first try: posted again
        refused = event(JobFailed, "bad-000001", 3, reason="refused by the endpoint")
        hook.refuse.add(refused.event_id)  # 400: posted once, then skipped
        failed = event(JobFailed, "run-000001", 4, reason="rank 1 exited with code 17; restart budget spent")
        for e in (first, event(RankLost, "run-000001", 5, rank=1, attempt=0, reason="exited with code 17",
                               last_seen=1.0), refused, event(JobCompleted, "ok-000001", 6, steps=10), failed):
            await append_to_job(store, e)
        await until("the JobFailed after a retry and a refusal", lambda: failed.event_id in hook.ids(), tmp_path)
        assert hook.ids() == [first.event_id, first.event_id, refused.event_id, failed.event_id]

        # Every try is signed over its own timestamp and the exact body; the body is the catalog event.
        for headers, data in hook.got:
            mac = hmac.new(SECRET, headers["X-Flightdeck-Timestamp"].encode() + b"." + data, hashlib.sha256)
            assert headers["X-Flightdeck-Signature"] == "sha256=" + mac.hexdigest()
        sent = json.loads(hook.got[-1][1])
        assert sent["type"] == "JobFailed" == hook.got[-1][0]["X-Flightdeck-Event"]
        assert sent["id"] == failed.event_id and sent["job_id"] == "run-000001"
        assert sent["summary"] == "run-000001 failed: rank 1 exited with code 17; restart budget spent"
        assert sent["event"]["reason"] == failed.reason and sent["event"]["type"] == "JobFailed"
        assert sent["event"]["job_version"] == 3  # third in its history (spike, RankLost, this), as stored
        spiked = json.loads(hook.got[0][1])
        assert spiked["summary"] == ("run-000001: loss spike at step 30: 9.5 against a median of 2 "
                                     "(75.0 deviations, threshold 6)")

        # Stopped, events come meanwhile (one with a NaN loss), started again: each posted once, nothing before.
        assert await asyncio.to_thread(stopped, proc) == 0
        later = [spike("run-000002", 7, loss=math.nan), event(JobFailed, "run-000002", 8, reason="no progress")]
        for e in later:
            await append_to_job(store, e)
        proc = start(nats_server.url, hook.url, tmp_path)
        started.append(proc)
        await until("the events from while it was down", lambda: later[-1].event_id in hook.ids(), tmp_path)
        assert hook.ids()[4:] == [e.event_id for e in later]
        assert json.loads(hook.got[4][1])["event"]["loss"] is None  # NaN has no JSON: null, as the contract says
        assert await asyncio.to_thread(stopped, proc) == 0
        assert len(hook.got) == 6
    finally:
        await store.close()
        for p in started:  # a failed assertion must not leave a notifier behind
            p.kill()
            p.wait()


@pytest.mark.parametrize(("args", "says"), [
    (["--url", "ftp://x/hook"], "give an http:// or https:// URL"),
    (["--secret-file", "/nonexistent/secret"], "--secret-file /nonexistent/secret: No such file"),
    (["--on", "JobFailed,NoSuchEvent"], "no event type NoSuchEvent in the catalog"),
])
def test_bad_settings_are_refused_with_a_reason(tmp_path: Path, args: list[str], says: str) -> None:
    (tmp_path / "secret").write_text("x\n")
    base = {"--url": "http://127.0.0.1:9/hook", "--secret-file": str(tmp_path / "secret")}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = [part for pair in base.items() for part in pair]
    done = subprocess.run([sys.executable, str(NOTIFIER), *argv, "--nats", "nats://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and says in done.stderr, done.stderr


def test_an_empty_secret_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    done = subprocess.run([sys.executable, str(NOTIFIER), "--url", "http://127.0.0.1:9/hook", "--secret-file",
                           str(tmp_path / "empty")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "is empty" in done.stderr, done.stderr


async def test_a_telemetry_type_is_refused_not_followed(nats_server: broker_mod.Broker, tmp_path: Path) -> None:
    await asyncio.to_thread(ensure_streams_at, nats_server.url)
    proc = start(nats_server.url, "http://127.0.0.1:9/hook", tmp_path, "--on", "JobFailed,StepCompleted")
    try:
        assert await asyncio.to_thread(proc.wait, 60) == 2
    finally:
        proc.kill()
        proc.wait()
    assert "StepCompleted is not a job's or a node's control event" in (tmp_path / "notifier.log").read_text()
