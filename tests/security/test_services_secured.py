"""Every service, the node agent and a real 2-rank job on a broker with the generated users: each process
runs as its own user, the ranks with no credential at all (their agent publishes for them), the job completes,
nothing was denied, and no secret appears in a log line or an event."""

import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.history import append_to_job
from flightdeck.events.job import AllocationGranted, AllocationReleased, JobCompleted, JobSubmitted, WorkersStarted
from flightdeck.events.plan import ReshardPlanned
from flightdeck.events.spec import JobSpec, ModelSpec, TrainSpec
from flightdeck.events.training import StepCompleted
from flightdeck.services.shell.security import permissions
from tests.integration.lifecycle_harness import Objects, Platform
from tests.integration.test_lifecycle_services import kinds
from tests.security.secure_broker import SecureBroker, secure_broker  # noqa: F401 (the fixture)

JOB = "secure-000001"
SPEC = JobSpec(name="secure", slots=2, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=20, checkpoint_every=10, data="synthetic"))


@dataclass
class SecurePlatform(Platform):
    """The lifecycle platform with each process started as its own NATS user."""

    broker: SecureBroker | None = None
    users: dict[str, str] = field(default_factory=dict)  # process name -> user

    def process_env(self, name: str) -> dict[str, str]:
        assert self.broker is not None
        creds = self.broker.agent_env(name.removeprefix("agent-")) if name.startswith("agent-") else \
            self.broker.env(name)
        self.users[name] = creds["FLIGHTDECK_NATS_USER"]
        return {**super().process_env(name), **creds}


def read_logs(*folders: Path) -> dict[Path, str]:
    """Every process's log: services, agent and ranks."""
    return {path: path.read_text(errors="replace") for folder in folders for path in folder.glob("*.log")}


def secrets_of(b: SecureBroker, users: list[str]) -> list[str]:
    return [b.secrets.password(u) for u in users]


@pytest.mark.timeout(150)
async def test_services_and_agent_run_a_job_as_their_own_users_and_the_ranks_as_none(secure_broker: SecureBroker,  # noqa: F811
                                                                     tmp_path: Path) -> None:
    b = secure_broker
    p = SecurePlatform(b.url, tmp_path, await b.store(permissions.ADMIN), objects=Objects(str(tmp_path / "objects")),
                       broker=b)
    await p.record()
    console = await b.store(permissions.CONSOLE)
    try:
        p.start_all()
        await p.ready()
        await append_to_job(console, JobSubmitted(job_id=JOB, spec=SPEC, event_id=f"cli-{JOB}",
                                                  occurred_at=time.time(), producer="cli"))
        await p.until(lambda: bool(p.seen(JobCompleted, JOB)) and bool(p.seen(AllocationReleased, JOB)), 120,
                      "the job to complete", JOB)
        await p.until(lambda: {e.step for e in p.seen(StepCompleted, JOB, stream=subjects.TELEMETRY)} >= set(range(20)),
                      10, "every step's telemetry")
        # the job's life ends with its completion and release (the final step's checkpoint may commit after them)
        assert [k for k in kinds(p.job(JOB)) if not k.startswith("Checkpoint")][-2:] == ["JobCompleted",
                                                                                       "AllocationReleased"]
        # every service did its part under its own permissions
        for kind in (AllocationGranted, WorkersStarted, CheckpointCommitted, ReshardPlanned):
            assert p.seen(kind, JOB), kind.__name__
        assert any(s.stored.subject == subjects.clock("health") for s in p.control)
        assert set(p.users.values()) == {*(s for s in p.users if not s.startswith("agent-")), "agent-n1"}

        logs = read_logs(tmp_path, p.data / "logs")
        assert any("-r1.log" in path.name for path in logs)  # the ranks' own logs are checked too
        for path, text in logs.items():
            assert "permissions violation" not in text.lower(), f"{path.name}:\n{text[-3000:]}"
        stored = [msgspec.json.encode(s.stored.event) for s in [*p.control, *p.telemetry] if s.stored.event]
        for secret in secrets_of(b, list(p.users.values())):
            assert not any(secret in text for text in logs.values())
            assert not any(secret.encode() in data for data in stored)
    finally:
        await console.close()
        await p.close()
