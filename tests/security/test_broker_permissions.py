"""The generated users on a real nats-server: what a service's and an agent's credential can and cannot do, and
that a rank, which holds none, cannot connect at all. A denied publish surfaces in nats-py as a timeout plus a
"permissions violation" error."""

import asyncio
import time

import nats
import nats.errors
import pytest

from flightdeck.events import subjects
from flightdeck.events.commands import StopRequested
from flightdeck.events.history import append_to_job
from flightdeck.events.job import JobQueued
from flightdeck.events.training import Heartbeat
from flightdeck.services.shell.security import permissions
from flightdeck.services.shell.security.credentials import client_options, rank_env
from tests.security.secure_broker import CONNECT_TIMEOUT_S, SecureBroker, secure_broker  # noqa: F401 (the fixture)

JOB, OTHER = "alpha-000001", "beta-000002"
pytestmark = pytest.mark.timeout(60)


def heartbeat(job_id: str, rank: int = 0) -> Heartbeat:
    return Heartbeat(job_id=job_id, rank=rank, step=1, interval_s=1.0, event_id=f"hb-{job_id}-{time.time_ns()}",
                     occurred_at=time.time(), producer="trainer")


def stop(job_id: str) -> StopRequested:
    return StopRequested(job_id=job_id, reason="forged", event_id=f"stop-{time.time_ns()}", occurred_at=time.time(),
                         producer="scheduler")


async def denied(nc: nats.NATS, errors: list[str], subject: str, data: bytes = b"x") -> bool:
    """Publish and report whether the broker refused it with a permissions error (it answers a refused
    publish with -ERR before the PONG of the flush that follows)."""
    await nc.publish(subject, data)
    await nc.flush(timeout=2)
    for _ in range(50):
        if any("permissions violation" in e.lower() and subject.lower() in e.lower() for e in errors):
            return True
        await asyncio.sleep(0.02)
    return False


async def accepted(nc: nats.NATS, subject: str, data: bytes = b"x") -> bool:
    """Publish through JetStream: the stream's ack says it was stored."""
    ack = await nc.jetstream(timeout=2.0).publish(subject, data)
    return ack.seq > 0


@pytest.fixture
def broker(secure_broker: SecureBroker) -> SecureBroker:  # noqa: F811
    return secure_broker


async def test_only_the_scheduler_publishes_scheduling_decisions(broker: SecureBroker) -> None:
    scheduler = await broker.store("scheduler")
    try:
        queued = JobQueued(job_id=JOB, priority=50, event_id="q1", occurred_at=time.time(), producer="scheduler")
        result = await append_to_job(scheduler, queued, msg_id="q1")
        assert result.seq > 0
    finally:
        await scheduler.close()
    for user in ("health", "resources", "checkpoints", "resharder", permissions.agent_user("n1"), permissions.AGENT,
                 permissions.CONSOLE):
        errors: list[str] = []
        nc = await broker.raw(user, errors)
        try:
            for decision in ("StopRequested", "JobCompleted", "AllocationRequested", "RollbackRequested"):
                assert await denied(nc, errors, subjects.job(JOB, decision)), (user, decision)
            assert await denied(nc, errors, subjects.clock("scheduler")), user
        finally:
            await nc.close()


async def test_a_service_cannot_touch_another_services_decisions_or_consumer(broker: SecureBroker) -> None:
    errors: list[str] = []
    await broker.wait_user("health")  # the fixture's reload (new job users) may still be under way
    nc = await broker.raw("health", errors)
    try:
        assert await denied(nc, errors, subjects.job(JOB, "AllocationGranted"))  # the resource manager's
        assert await denied(nc, errors, subjects.job(JOB, "CheckpointCommitted"))  # the checkpoint service's
        assert await denied(nc, errors, subjects.node("n1", "NodeRegistered"))  # the agent's
        assert await denied(nc, errors, subjects.dead("scheduler"))
        assert await denied(nc, errors, f"$JS.API.CONSUMER.DELETE.{subjects.CONTROL}.service-scheduler")
        assert await accepted(nc, subjects.job(JOB, "RankLost"), b"not an event, but allowed")
    finally:
        await nc.close()


async def test_an_agent_acts_only_for_its_node_and_a_wrong_password_is_refused(broker: SecureBroker) -> None:
    errors: list[str] = []
    await broker.wait_user(permissions.agent_user("n1"))
    nc = await broker.raw(permissions.agent_user("n1"), errors)
    try:
        assert await accepted(nc, subjects.node("n1", "NodeHeartbeat"))
        assert await accepted(nc, subjects.job_node(JOB, "n1", "WorkersStarted"))  # its node's records of any job
        assert await denied(nc, errors, subjects.node("n2", "NodeRegistered"))
        assert await denied(nc, errors, subjects.job_node(JOB, "n2", "WorkersExited"))  # never another node's
        assert await denied(nc, errors, subjects.clock("agent-n2"))
    finally:
        await nc.close()
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(broker.url, user="scheduler", password="guess", allow_reconnect=False,
                           max_reconnect_attempts=0, connect_timeout=CONNECT_TIMEOUT_S)


async def test_a_rank_that_connects_to_the_broker_itself_is_refused(secure_broker: SecureBroker) -> None:  # noqa: F811
    """What the agent gives a rank holds no credential (security/credentials.rank_env): with it, a user's code that
    opens a broker connection of its own is refused; it can reach the platform only through its agent."""
    env = rank_env({**secure_broker.agent_env(), "PATH": "/bin"})
    assert client_options(env) == {}
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(secure_broker.url, allow_reconnect=False, max_reconnect_attempts=0,
                           connect_timeout=CONNECT_TIMEOUT_S, **client_options(env))
