"""The real control plane a simulation runs against: the shipped nats-server config, services as their own
processes (`python -m flightdeck.services NAME`), a fleet of simulated nodes registered as their agents would, and the
job submitted as `flightdeck submit` does."""

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flightdeck.events import subjects
from flightdeck.events.fleet import NodeRegistered, SelfCheckPassed
from flightdeck.events.history import append_to_job
from flightdeck.events.job import JobSubmitted
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.store import EventStore
from flightdeck.services.shell import broker as broker_mod

ROOT = Path(__file__).resolve().parents[2]
SLOTS_PER_NODE = 8


@dataclass
class Platform:
    broker: broker_mod.Broker
    root: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.broker.stop()


def start_broker(root: Path) -> Platform:
    """nats-server with infra/nats/server.conf (sync_interval: always), its store under `root`."""
    return Platform(broker_mod.start(root / "nats"), root)


def start_services(platform: Platform, names: tuple[str, ...], **env: str) -> None:
    for name in names:
        log = open(platform.root / f"{name}.log", "ab")
        platform.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "flightdeck.services", name, "--nats", platform.broker.url], cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()


def node_names(num_ranks: int) -> list[str]:
    return [f"sim{i:05d}" for i in range(-(-num_ranks // SLOTS_PER_NODE))]


async def register_fleet(store: EventStore, nodes: list[str]) -> None:
    """What each node agent records when it starts: NodeRegistered, then its self-check passing."""
    for name in nodes:
        producer = f"agent-{name}"
        now = time.time()
        for ev in (NodeRegistered(node=name, kind="gpu", slots=SLOTS_PER_NODE, devices=["sim"] * SLOTS_PER_NODE,
                                  event_id=f"{producer}:registered:1", occurred_at=now, producer=producer),
                   SelfCheckPassed(node=name, seconds=0.0, detail="simulated", event_id=f"{producer}:selfcheck:1",
                                   occurred_at=now, producer=producer)):
            await store.append(subjects.node(name, type(ev).__name__), ev, msg_id=ev.event_id)


async def submit(store: EventStore, job_id: str, num_ranks: int, policy: PolicySpec) -> None:
    spec = JobSpec(name="sim", slots=num_ranks, policy=policy,
                   train=TrainSpec(steps=100_000_000, batch_size=max(num_ranks, 8), checkpoint_every=100_000_000))
    ev = JobSubmitted(job_id=job_id, spec=spec, event_id=f"cli-{job_id}", occurred_at=time.time(), producer="cli")
    await append_to_job(store, ev, msg_id=ev.event_id)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
