"""The permission tables against the catalog, a recorded drill history and the shipped config (no broker
needed, except `nats-server -t` to parse the shipped file)."""

import base64
import json
import os
import stat
import subprocess
import warnings
from pathlib import Path

import pytest

from flightdeck.events import codec, subjects
from flightdeck.events.base import JobEvent
from flightdeck.events.catalog import ALL_TYPES
from flightdeck.events.clock import ClockTick, CoreConfigured, DeadLettered
from flightdeck.services.registry import BUILTIN
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.security import permissions, render
from flightdeck.services.shell.security.__main__ import SHIPPED, rendered, shipped
from flightdeck.services.shell.security.credentials import (
    PASSWORD_FILE,
    USER,
    CredentialsError,
    check_url,
    client_options,
    rank_env,
)
from flightdeck.services.shell.security.passwords import SecretsDir

ROOT = Path(__file__).resolve().parents[2]
HISTORY = ROOT / "tests" / "fixtures" / "histories" / "spike.fdh.jsonl"
# RankOutput: on FD_LOGS; RankHeartbeats, ShardsUploaded: from agents
TELEMETRY_TYPES = {"StepCompleted", "Heartbeat", "RankFault", "FaultInjected", "RolledBack", "RankStarted",
                   "ModelRegistered", "CheckpointStaged", "CheckpointRefused", "RankHeartbeats", "ShardsUploaded",
                   "SpikeReplayed", "RankOutput", "SnapshotsOff", "AgentAlive"}


def producer_perms(producer: str) -> permissions.Permissions:
    """The user a recorded producer runs as: a service, `agent-<node>`, or the CLI's `console`."""
    if producer == "cli":
        return permissions.console()
    if producer.startswith("agent-"):
        return permissions.agent(producer.removeprefix("agent-"))
    return permissions.service(producer)


def test_every_control_type_has_an_author_and_scheduling_decisions_have_one() -> None:
    authored = {t for types in (*permissions.JOB_TYPES.values(), *permissions.NODE_TYPES.values()) for t in types}
    shell_records = {ClockTick.__name__, CoreConfigured.__name__, DeadLettered.__name__}  # a service's own subjects
    control = {t.__name__ for t in ALL_TYPES} - TELEMETRY_TYPES - shell_records
    assert control == authored
    for role, types in permissions.JOB_TYPES.items():
        if role != "scheduler":
            assert not set(types) & set(permissions.SCHEDULER_DECISIONS), role
    # a command both a person and the scheduler give (a pause, when a rollback is left to the operator)
    assert set(permissions.JOB_TYPES["scheduler"]) - set(permissions.SCHEDULER_DECISIONS) == {"PauseRequested"}
    users = permissions.fleet(("n1",))
    for decision in permissions.SCHEDULER_DECISIONS:
        may = [u.user for u in users if u.may_publish(subjects.job("j-000001", decision))]
        assert may == ["admin", "scheduler"], decision


def test_a_recorded_drill_history_passes_its_producers_permissions_and_no_one_elses() -> None:
    checked = 0
    for line in HISTORY.read_text().splitlines():
        record = json.loads(line)
        event = codec.decode(base64.b64decode(record["data"]))
        subject = record["subject"]
        if record["stream"] == subjects.TELEMETRY:
            # an agent publishes its ranks' telemetry (they hold no credential; services/agent/links.py checks each
            # event against the rank that sent it), their heartbeats in one batch per node, the shards it shipped
            assert permissions.agent("n1").may_publish(subject), subject
            assert not any(permissions.service(s).may_publish(subject) for s in BUILTIN), subject
        elif record["stream"] == subjects.CONTROL:
            if type(event).__name__ in subjects.NODE_RECORDS and isinstance(event, JobEvent):
                # recorded before node records left the version fence: where its agent stores it today
                subject = subjects.job_node(event.job_id, event.node, type(event).__name__)  # type: ignore[attr-defined]
            assert producer_perms(event.producer).may_publish(subject), (event.producer, subject)
            others = [s for s in BUILTIN if s != event.producer]
            assert not any(permissions.service(s).may_publish(subject) for s in others
                           if type(event).__name__ != "NodeCordoned"), subject
        checked += 1
    assert checked > 300


def test_the_shipped_config_is_the_rendered_one_and_the_server_accepts_it(tmp_path: Path) -> None:
    assert SHIPPED.read_text() == shipped(), \
        "run `python -m flightdeck.services.shell.security shipped` after changing permissions"
    conf = tmp_path / "server.conf"
    conf.write_text(broker_mod.CONFIG.read_text() + f'\ninclude "{SHIPPED.name}"\n')
    (tmp_path / SHIPPED.name).write_text(SHIPPED.read_text())
    env = {**os.environ, **{render.env_var(u.user): "a-password" for u in permissions.fleet()}}
    out = subprocess.run([broker_mod.binary(), "-t", "-c", str(conf)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr + out.stdout


def test_rendered_users_are_unique_and_a_job_has_none(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="twice"):
        render.render([permissions.agent("n1"), permissions.agent("n1")], render.from_environment)
    users = {u.user for u in permissions.fleet(("n1", "n2"))}
    assert users == {"admin", "console", *BUILTIN, "agent", "agent-n1", "agent-n2"}
    secrets = SecretsDir(tmp_path / "s")
    pw = secrets.password("scheduler")
    assert secrets.password("scheduler") == pw  # kept, not regenerated
    assert stat.S_IMODE(secrets.password_file("scheduler").stat().st_mode) == 0o600


def test_credentials_come_from_files_and_never_from_urls(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret-value\n")
    env = {USER: "health", PASSWORD_FILE: str(pw)}
    opts = client_options(env)
    assert opts == {"user": "health", "password": "s3cret-value", "inbox_prefix": "_INBOX.health"}
    assert client_options({}) == {}
    with pytest.raises(CredentialsError, match=PASSWORD_FILE):
        client_options({USER: "health"})
    with pytest.raises(CredentialsError, match="not a readable file"):
        client_options({USER: "health", PASSWORD_FILE: str(tmp_path / "missing")})
    with pytest.raises(CredentialsError) as refused:
        check_url("nats://health:s3cret-value@10.0.0.1:4222")
    assert "s3cret-value" not in str(refused.value)
    check_url("nats://a:4222,nats://b:4222")


def test_ranks_get_no_broker_address_and_no_credential_at_all(tmp_path: Path) -> None:
    """A rank's only link to the platform is its agent: the agent's broker identity, certificates and the broker's
    address all stay with the agent (services/agent/launch.rank_base_env)."""
    secrets = SecretsDir(tmp_path / "s")
    agent_pw = secrets.password("agent-n1")
    env = {"PATH": "/bin", USER: "agent-n1", PASSWORD_FILE: str(secrets.password_file("agent-n1")),
           "FLIGHTDECK_NATS_TLS_CA": "/etc/ca.pem",
           "FLIGHTDECK_NATS_URL": "nats://10.0.0.1:4222", "FLIGHTDECK_NATS_RANK_TLS_CERT": "/etc/rank.pem"}
    assert rank_env(dict(env)) == {"PATH": "/bin"}
    assert not any(agent_pw in v for v in rank_env(dict(env)).values())


def test_an_agent_publishes_its_ranks_telemetry_and_heartbeat_batches_and_no_other_telemetry() -> None:
    for agent in (permissions.agent("n1"), permissions.agent(None)):
        assert agent.may_publish(subjects.telemetry("a-000001", 0, "RankHeartbeats"))
        assert agent.may_publish(subjects.telemetry("b-000002", 8, "RankHeartbeats"))
        for relayed in ("Heartbeat", "StepCompleted", "RankFault", "CheckpointStaged", "RankStarted"):
            assert agent.may_publish(subjects.telemetry("a-000001", 0, relayed)), relayed
        for other in ("SpikeDiagnosed", "LossSpikeDetected", "JobCompleted", "RollbackRequested"):
            assert not agent.may_publish(subjects.telemetry("a-000001", 0, other)), other


def test_an_agent_says_it_is_alive_for_its_own_node_only() -> None:
    n1 = permissions.agent("n1")
    assert n1.may_publish(subjects.fleet_telemetry("n1", "AgentAlive"))
    assert not n1.may_publish(subjects.fleet_telemetry("n2", "AgentAlive"))  # its silence is n2's to keep
    assert not n1.may_publish(subjects.fleet_telemetry("n1", "NodeLost"))
    assert permissions.agent(None).may_publish(subjects.fleet_telemetry("n7", "AgentAlive"))
    for service in subjects.SERVICES:
        assert not permissions.service(service).may_publish(subjects.fleet_telemetry("n1", "AgentAlive")), service


def test_generated_passwords_are_256_random_bits_hashed_at_the_cheapest_bcrypt_cost(tmp_path: Path) -> None:
    """The server runs bcrypt on every connect; for a 256-bit random secret the work factor buys nothing, so the
    config holds cost-4 hashes that still verify the password (crypt(3) re-derives the same hash)."""
    with warnings.catch_warnings():  # deprecated module (gone in 3.13): imported where used, as passwords.bcrypt does
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

    secrets = SecretsDir(tmp_path / "s")
    password = secrets.password("scheduler")
    assert len(base64.urlsafe_b64decode(password + "=" * (-len(password) % 4))) == 32
    text = rendered(secrets, ())
    hashes = [line.split('password: "')[1].split('"')[0] for line in text.splitlines() if "$2b$" in line]
    assert hashes and all(h.startswith("$2b$04$") for h in hashes)
    assert any(crypt.crypt(password, h) == h for h in hashes)
    assert not any(crypt.crypt(password + "x", h) == h for h in hashes)
