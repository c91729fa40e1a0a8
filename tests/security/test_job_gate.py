"""Per-job broker identities with no server reload: the job gate (services/shell/security/gate.py) answers
nats-server's auth callout. A job has no user in the server's config; its ranks connect once it is granted, may
publish only their own job's telemetry (never another job's, never the control stream), are refused before the
grant and after the job ends, and an identity in use stops working when it expires after the end. The static
users (services, agents, console) bypass the gate. A real nats-server running the rendered config."""

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest

from events import codec, subjects
from events.fleet import NodeRegistered
from events.history import append_to_job
from events.job import AllocationGranted, JobCompleted, SlotRef
from services.shell.security import natsjwt, permissions
from services.shell.security.credentials import client_options
from services.shell.security.gate import Gate
from services.shell.security.passwords import job_password
from tests.security.secure_broker import CONNECT_TIMEOUT_S, SecureBroker, provision
from tests.security.test_broker_permissions import accepted, denied, heartbeat, stop

JOB, OTHER = "alpha-000001", "beta-000002"
TTL_S = 2.0
pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def gated(tmp_path: Path) -> AsyncIterator[SecureBroker]:
    b = SecureBroker(tmp_path / "gated-nats", gate=True)
    b.start()
    halt = asyncio.Event()
    task: asyncio.Task[None] | None = None
    try:
        await asyncio.to_thread(provision, b)
        gate = Gate(job_key=b.secrets.job_key(), issuer_seed=b.secrets.issuer_seed(), ttl_s=TTL_S)
        ready = asyncio.Event()
        task = asyncio.create_task(gate.run(b.url, client_options(b.env(permissions.GATE)), halt, ready))
        await asyncio.wait_for(ready.wait(), 30)
        yield b
    finally:
        halt.set()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        b.stop()


async def record(b: SecureBroker, *events: AllocationGranted | JobCompleted | NodeRegistered) -> None:
    store = await b.store(permissions.ADMIN)
    try:
        for ev in events:
            if isinstance(ev, NodeRegistered):
                await store.append(subjects.node(ev.node, "NodeRegistered"), ev)
            else:
                await append_to_job(store, ev)
    finally:
        await store.close()


def granted(job_id: str) -> AllocationGranted:
    return AllocationGranted(job_id=job_id, attempt=0, assignments=[SlotRef(node="n1", slot=0, rank=0)],
                             master_addr="127.0.0.1", master_port=29500, event_id=f"grant-{job_id}",
                             occurred_at=time.time(), producer="resources")


async def refused(b: SecureBroker, user: str) -> None:
    """Connecting as `user` ends in the server's Authorization Violation (fails the test if it lets the user in)."""
    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        nc = await b.raw(user)
        await nc.close()


async def test_a_granted_job_connects_and_publishes_only_its_own_telemetry(gated: SecureBroker) -> None:
    await refused(gated, permissions.job_user(JOB))  # not granted yet: no identity
    node = NodeRegistered(node="n1", kind="cpu", slots=1, event_id="reg-n1", occurred_at=time.time())
    await record(gated, node, granted(JOB))
    await gated.wait_user(permissions.job_user(JOB), within=15)  # the gate folds the grant shortly
    errors: list[str] = []
    nc = await gated.raw(permissions.job_user(JOB), errors)
    try:
        assert await accepted(nc, subjects.telemetry(JOB, 0, "Heartbeat"), codec.encode(heartbeat(JOB)))
        assert await denied(nc, errors, subjects.telemetry(OTHER, 0, "Heartbeat"), codec.encode(heartbeat(OTHER)))
        assert await denied(nc, errors, subjects.job(JOB, "StopRequested"), codec.encode(stop(JOB)))
        assert await denied(nc, errors, subjects.job(OTHER, "JobCompleted"))
        assert await denied(nc, errors, f"$JS.API.STREAM.PURGE.{subjects.TELEMETRY}")
        assert await denied(nc, errors, permissions.AUTH_REQUESTS)  # nor forge requests to the gate
        # Trial 4 (86ea31b): a job re-pointed the scheduler's durable at its own history; nor any agent's
        for name in ("service-scheduler", "service-agent-n1"):
            create = f"$JS.API.CONSUMER.CREATE.{subjects.CONTROL}.{name}.{subjects.job_all(JOB)}"
            assert await denied(nc, errors, create), create
    finally:
        await nc.close()
    await refused(gated, permissions.job_user(OTHER))  # another job, never granted
    # the static users bypass the gate
    for user in (permissions.CONSOLE, "scheduler", permissions.agent_user("n1")):
        nc = await gated.raw(user)
        await nc.close()


async def test_a_wrong_password_or_a_made_up_user_is_refused(gated: SecureBroker) -> None:
    await record(gated, granted(JOB))
    await gated.wait_user(permissions.job_user(JOB), within=15)  # the gate folds the grant shortly
    wrong = {**gated.env(permissions.job_user(JOB))}
    await asyncio.to_thread(Path(wrong["FLIGHTDECK_NATS_PASSWORD_FILE"]).write_text, "not-the-password\n")
    for user in (permissions.job_user(JOB), "mallory", "job-"):
        env = {**wrong, "FLIGHTDECK_NATS_USER": user}
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(gated.url, allow_reconnect=False, connect_timeout=CONNECT_TIMEOUT_S,
                                   **client_options(env))


def test_the_gates_decisions_say_why() -> None:
    gate = Gate(job_key="k" * 32, issuer_seed=natsjwt.new_account_seed(), ttl_s=60)
    gate.jobs.live.add(JOB)
    gate.jobs.ended.add(OTHER)

    def ask(user: str, password: str) -> str:
        return gate.decide({"nats": {"user_nkey": "UABC", "connect_opts": {"user": user, "pass": password}}},
                           now=1000.0).error

    assert ask("mallory", "x") == "unknown user 'mallory': only a job's ranks are admitted here"
    assert ask(permissions.job_user(JOB), "x") == f"wrong password for 'job-{JOB}'"
    assert ask(permissions.job_user(OTHER), job_password("k" * 32, OTHER)) == \
        f"job {OTHER} has ended: its identity is revoked"
    assert ask("job-gamma-3", job_password("k" * 32, "gamma-3")) == "job gamma-3 is not running (no grant yet)"
    ok = gate.decide({"nats": {"user_nkey": "UABC", "connect_opts": {"user": f"job-{JOB}",
                                                                     "pass": job_password("k" * 32, JOB)}}}, 1000.0)
    claims = natsjwt.decode(ok.user_jwt)
    assert (claims["sub"], claims["exp"], claims["aud"]) == ("UABC", 1060, "$G")
    assert claims["nats"]["pub"]["allow"] == list(permissions.job(JOB).publish)
    denied_creates = [d for d in claims["nats"]["pub"]["deny"] if ".CONSUMER.CREATE." in d]
    assert all(f".{permissions.durable(s)}" in " ".join(denied_creates) for s in subjects.SERVICES)


async def test_a_jobs_identity_stops_working_after_the_job_ends(gated: SecureBroker) -> None:
    await record(gated, granted(JOB))
    await gated.wait_user(permissions.job_user(JOB), within=15)  # the gate folds the grant shortly
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    nc = await nats.connect(gated.url, allow_reconnect=True, max_reconnect_attempts=3, reconnect_time_wait=0.2,
                            closed_cb=on_closed, **gated.options(permissions.job_user(JOB)))
    try:
        await record(gated, JobCompleted(job_id=JOB, steps=10, event_id=f"done-{JOB}", occurred_at=time.time(),
                                         producer="scheduler"))
        # a new connection is refused at once; the one in use ends when its identity expires (TTL_S), and its
        # reconnects are refused: nats-py gives up and closes
        deadline = time.monotonic() + 15
        while True:
            try:
                late = await gated.raw(permissions.job_user(JOB))
                await late.close()
            except Exception:
                break
            assert time.monotonic() < deadline, "the gate still admits an ended job"
            await asyncio.sleep(0.1)
        await asyncio.wait_for(closed.wait(), TTL_S + 30)
        assert nc.is_closed
    finally:
        if not nc.is_closed:
            await nc.close()
