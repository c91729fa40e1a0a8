"""Two hosts that share nothing but the broker, the object store and the rendezvous address: agents n1 and n2 each
in their own network namespace (tests/e2e/hosts.py), each with its own data dir, staging and checkpoint cache;
the broker and moto's S3 listen on the bridge between them; the services run outside both. A 2-rank job
checkpoints (each agent stores its own rank's shards in S3; the checkpoint service reads them back there), loses
n2 (SIGKILL of its agent; its rank dies with it), shrinks to n1, restores from S3 and completes; `flightdeck
verify` re-derives every decision. Skipped, saying why, where network namespaces cannot be made."""

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted, ShardsUploaded
from flightdeck.events.fleet import NodeLost
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import AllocationRequested, JobCompleted, JobFailed, JobResumed
from flightdeck.services.shell import broker as broker_mod
from tests.e2e.drill_harness import HEALTH_TICK_S, assert_verified, export, kill_agent_mid_run, lost_node_spec
from tests.e2e.hosts import Hosts, isolated_hosts, unavailable
from tests.integration.lifecycle_harness import SERVICES, Objects, Platform
from tests.integration.s3_fixture import moto_server
from tests.integration.test_lifecycle_services import ROOT, kinds

pytestmark = [pytest.mark.slow]
JOB = "twohosts-000001"


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"no isolated hosts here: {reason}")
    with isolated_hosts(["n1", "n2"]) as made:
        yield made


@dataclass
class HostsPlatform(Platform):
    """The lifecycle harness, with each agent started inside its host's network namespace."""

    hosts: Hosts | None = None

    def _start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        host = self.hosts.hosts.get(name.removeprefix("agent-")) if self.hosts and name.startswith("agent-") else None
        if host is None:
            return super()._start(name, args)
        env = {**self.process_env(name), "GLOO_SOCKET_IFNAME": host.ifname}
        with open(self.root / f"{name}.log", "ab") as out:
            proc = subprocess.Popen([*host.exec_prefix(), sys.executable, *args], cwd=ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def host_agent(self, node: str) -> None:
        assert self.hosts is not None
        self.agent(node, "--slots", "1", "--grace-s", "2", "--address", self.hosts.hosts[node].ip,
                   "--data-dir", str(self.root / f"data-{node}"))


@dataclass(frozen=True)
class HostsObjects(Objects):
    @property
    def env(self) -> dict[str, str]:
        return {**super().env, "FLIGHTDECK_HEALTH_TICK_S": HEALTH_TICK_S}


@pytest.fixture
async def platform(hosts: Hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[HostsPlatform]:
    broker = broker_mod.start(tmp_path / "nats", host=hosts.gateway)
    try:
        with moto_server(monkeypatch, hosts.gateway) as s3:
            store = await JetStreamStore.connect(broker.url, name="multihost-test")
            p = HostsPlatform(broker.url, tmp_path, store, objects=HostsObjects(f"s3://{s3.bucket}",
                                                                                endpoint=s3.endpoint), hosts=hosts)
            await p.record()
            try:
                for name in SERVICES:
                    p.service(name)
                yield p
            finally:
                await p.close()
    finally:
        broker.stop()


@pytest.mark.timeout(240)
async def test_two_hosts_sharing_nothing_lose_one_and_the_job_restores_from_s3_on_the_other(
        platform: HostsPlatform, hosts: Hosts) -> None:
    p = platform
    p.host_agent("n1")
    p.host_agent("n2")
    await p.ready("n1")
    await p.ready("n2")
    await p.submit(lost_node_spec(), JOB)
    await kill_agent_mid_run(p, JOB)
    await p.until(lambda: bool(p.seen(JobCompleted, JOB)) or bool(p.seen(JobFailed, JOB)), 180, "the job to end", JOB)
    assert p.seen(JobCompleted, JOB), kinds(p.job(JOB))
    assert [e.node for e in p.seen(NodeLost)] == ["n2"]
    assert any(e.slots == 1 and "shrink" in e.reason for e in p.seen(AllocationRequested, JOB))

    final = p.seen(JobResumed, JOB)[-1]
    commits = {e.checkpoint_id: e for e in p.seen(CheckpointCommitted, JOB)}
    restored = commits[final.checkpoint_id]
    assert (final.world_size, restored.world_size) == (1, 2)  # saved by two hosts, loaded by one
    # each host stored its own rank's shards: the checkpoint service read no host's disk
    reports = [e for e in p.seen(ShardsUploaded, JOB, stream=subjects.TELEMETRY)
               if (e.attempt, e.step, e.timeline) == (restored.attempt, restored.step, restored.timeline)]
    # (a set persisted from memory after the loss holds the survivor's replica alone: n2's memory went with it)
    expected = [("n1", (0,), "")] if restored.from_memory else [("n1", (0,), ""), ("n2", (1,), "")]
    assert sorted((e.node, tuple(e.ranks), e.failed) for e in reports) == expected
    # What retention left in S3: the `keep_checkpoints` (3) highest steps, as a restart ranks them, whatever the
    # restore point (a restore from memory near the end leaves older ones of both hosts among them); those after the
    # loss n1's alone. The final one can commit after JobCompleted (its manifest is written before its record).
    await p.until(lambda: any(e.attempt == final.attempt and e.step == 40 for e in p.seen(CheckpointCommitted, JOB)),
                  60, "the final checkpoint's commit", JOB)
    recorded = p.seen(CheckpointCommitted, JOB)
    newest = sorted(e.checkpoint_id for e in sorted(recorded, key=lambda e: e.step)[-3:])  # stable: ties by commit

    async def retained() -> bool:
        return await p.objects.manifests(JOB) == newest

    await p.eventually(retained, 60, f"retention to leave {newest}")
    after = [e for e in recorded if e.attempt == final.attempt]
    assert after and all(e.world_size == 1 for e in after), [(e.checkpoint_id, e.world_size) for e in after]
    # each host staged only its own rank's files, on its own disk
    for node, rank in (("n1", 0), ("n2", 1)):
        staged = {f.name for f in (p.root / f"data-{node}" / "staging" / JOB).rglob("*.distcp")}
        assert staged and all(name.startswith(f"__{rank}_") for name in staged), (node, sorted(staged))
    assert not (p.root / "data").exists()  # no agent used the harness's shared default data dir
    await export(p, JOB, p.root / f"{JOB}.history.jsonl")
    await assert_verified(p, JOB)
