"""An agent that dies running no ranks is found by its silence (issue 51, case 5).

Tried on 6ade4e9: an agent killed while idle was never declared lost; a job granted to it waited 120 s in `placing`
(the start grace), was moved, and was charged a restart it did not cause. An idle agent now sends an AgentAlive
every few seconds on telemetry (here every 0.5 s, lost after 3 s); here n2's agent is SIGKILLed idle: its node is
declared lost naming that, and a job submitted afterwards is granted n1 alone, once. Started again, the agent
registers, passes its self-check and has the loss cordon lifted."""

import os
import signal
from pathlib import Path

import pytest

from flightdeck.events import subjects
from flightdeck.events.fleet import AgentAlive, NodeLost, NodeRegistered, NodeUncordoned, SelfCheckPassed
from flightdeck.events.job import AllocationGranted, JobCompleted, JobFailed
from flightdeck.events.spec import JobSpec, ModelSpec, TrainSpec
from flightdeck.services.shell import broker as broker_mod
from tests.integration.lifecycle_harness import Objects, local_objects, open_platform
from tests.integration.test_lifecycle_services import Cluster, kinds

__all__ = ["local_objects"]  # fixtures

SPEC = JobSpec(name="after", slots=2, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=20, checkpoint_every=10, data="synthetic"))


@pytest.mark.timeout(240)
async def test_an_agent_that_dies_idle_is_declared_lost_and_no_job_waits_on_it(
        nats_server: broker_mod.Broker, tmp_path: Path, local_objects: Objects,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLIGHTDECK_IDLE_BEAT_S", "0.5")
    monkeypatch.setenv("FLIGHTDECK_HEALTH_IDLE_LOST_S", "3")
    job = "after-000001"
    p = await open_platform(nats_server.url, tmp_path, local_objects)
    try:
        p.start_all()  # the services and n1
        Cluster.agent(p, "n2", "--objects", local_objects.url, "--data-dir", str(tmp_path / "n2-data"))
        await p.ready("n1")
        await p.ready("n2")
        await p.until(lambda: any(e.node == "n2" for e in p.seen(AgentAlive, stream=subjects.TELEMETRY)), 30,
                      "n2's first sign of life")
        os.kill(p.procs["agent-n2"].pid, signal.SIGKILL)
        await p.until(lambda: any(e.node == "n2" for e in p.seen(NodeLost)), 60, "n2 to be declared lost")
        (lost,) = [e for e in p.seen(NodeLost) if e.node == "n2"]
        assert "running no ranks" in lost.reason and "3s" in lost.reason, lost.reason
        assert not any(e.node == "n1" for e in p.seen(NodeLost))  # its live peer, idle too, beats on

        await p.submit(SPEC, job)
        await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 150, "the end", job)
        assert p.seen(JobCompleted, job), kinds(p.job(job))
        (grant,) = p.seen(AllocationGranted, job)  # one grant, and never the lost node
        assert {ref.node for ref in grant.assignments} == {"n1"}

        Cluster.agent(p, "n2", "--objects", local_objects.url, "--data-dir", str(tmp_path / "n2-data"))
        await p.until(lambda: any(e.node == "n2" for e in p.seen(NodeUncordoned)), 60, "n2's cordon lifted")
        n2 = [type(s.stored.event).__name__ for s in p.control
              if isinstance(s.stored.event, NodeRegistered | SelfCheckPassed | NodeLost | NodeUncordoned)
              and s.stored.event.node == "n2"]
        assert n2 == ["NodeRegistered", "SelfCheckPassed", "NodeLost", "NodeRegistered", "SelfCheckPassed",
                      "NodeUncordoned"], n2
    finally:
        await p.close()
