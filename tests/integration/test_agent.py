"""The node agent as a process: its ranks die with it, a SIGTERM drains them, a restarted agent records
what its predecessor lost, and a node whose self-check fails is cordoned and gets no work."""

import asyncio
import shutil
import signal
import time

import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointRejected, CheckpointScrubbed, DataPosition
from flightdeck.events.fleet import NodeCordoned, NodeRegistered, SelfCheckFailed
from flightdeck.events.heartbeats import RankHeartbeats
from flightdeck.events.history import append_to_job
from flightdeck.events.job import (
    AllocationGranted,
    AllocationRequested,
    JobCompleted,
    JobFailed,
    JobQueued,
    WorkersExited,
    WorkersStarted,
)
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.training import Heartbeat, StepCompleted
from flightdeck.services.agent.spawner import START_FAILED_EXIT
from flightdeck.services.checkpoints.core import core_service as checkpoints_core
from flightdeck.services.checkpoints.uploader import handlers as checkpoint_handlers
from flightdeck.services.shell.objects.local import LocalStore
from flightdeck.services.shell.runtime import run_service
from tests.integration.test_lifecycle_services import ENDLESS, TINY, Cluster, cluster, exits, gone

__all__ = ["cluster"]  # the fixture, shared with the lifecycle tests


async def running(c: Cluster, job_id: str, attempt: int = 0) -> list[int]:
    """Wait until the job's ranks of `attempt` have trained a few steps; their pids."""
    await c.until(lambda: len([e for e in c.seen(StepCompleted, job_id, stream=subjects.TELEMETRY)
                               if e.attempt == attempt]) >= 4, 60, f"attempt {attempt} to train", job_id)
    (started,) = [e for e in c.seen(WorkersStarted, job_id) if e.attempt == attempt]
    return list(started.pids)


@pytest.mark.timeout(150)
async def test_ranks_die_with_a_killed_agent_and_its_successor_records_them(cluster: Cluster) -> None:
    c = cluster
    agent = c.agent()
    await c.ready()
    await c.submit(ENDLESS, "endless-000002")
    pids = await running(c, "endless-000002")
    killed = time.monotonic()
    agent.send_signal(signal.SIGKILL)
    await c.until(lambda: all(gone(pid) for pid in pids), 60, "the ranks to die with their agent")
    died_s = time.monotonic() - killed
    assert exits(c, "endless-000002", 0) == {}  # nobody was left to see them go
    c.agent()  # the same node comes back
    await c.until(lambda: len(exits(c, "endless-000002", 0)) == 2, 60, "the lost ranks to be recorded",
                  "endless-000002")
    assert exits(c, "endless-000002", 0) == {0: -signal.SIGKILL, 1: -signal.SIGKILL}
    pids_1 = await running(c, "endless-000002", attempt=1)  # the scheduler restarted it on the returned node
    assert not set(pids_1) & set(pids)
    registrations = [e for e in c.seen(NodeRegistered) if e.node == "n1"]
    assert len(registrations) == 2
    print(f"\nranks gone {died_s:.2f}s after the agent's SIGKILL")
    await c.cancel("endless-000002")


@pytest.mark.timeout(180)
async def test_a_terminated_agent_stops_its_ranks_and_records_their_exits_first(cluster: Cluster) -> None:
    c = cluster
    # A drain is checkpoint, then exit (torch's teardown alone took up to 11 s on the loaded CI box): the grace
    # here is generous so that the test asserts the drain, not how fast a loaded box drains.
    agent = c.agent("n1", "--grace-s", "90")
    await c.ready()
    await c.submit(ENDLESS, "endless-000003")
    pids = await running(c, "endless-000003")
    agent.send_signal(signal.SIGTERM)
    await c.until(lambda: agent.poll() is not None, 120, "the agent to stop")
    assert agent.returncode == 0
    await c.until(lambda: len(exits(c, "endless-000003", 0)) == 2, 60, "the recorder to read the exits")
    # Recorded as killed by SIGTERM (they checkpoint and exit 0 on it): not as having finished the job.
    assert exits(c, "endless-000003", 0) == {0: -signal.SIGTERM, 1: -signal.SIGTERM}
    # ... and as planned: the platform stopped them, so their restart costs the job nothing (trial 6, 86ea31b)
    assert all(x.planned for e in c.seen(WorkersExited, "endless-000003") for x in e.exits())
    assert all(gone(pid) for pid in pids)
    assert list((c.data / "staging" / "endless-000003").glob("step-*")), "the ranks checkpointed on SIGTERM"


@pytest.mark.timeout(90)
async def test_a_node_whose_self_check_fails_is_cordoned_and_gets_no_work(cluster: Cluster) -> None:
    c = cluster
    c.agent("n2", "--selfcheck-timeout-s", "0.01")
    await c.until(lambda: any(e.node == "n2" for e in c.seen(NodeCordoned)), 60, "the node to be cordoned")
    (failed,) = [e for e in c.seen(SelfCheckFailed) if e.node == "n2"]
    assert "did not finish" in failed.reason
    kinds = [type(s.event).__name__ for s in c.control if s.stored.subject.startswith("fd.ctl.node.n2.")]
    assert kinds == ["NodeRegistered", "SelfCheckFailed", "NodeCordoned"]
    await c.submit(TINY, "tiny-000002")
    await c.until(lambda: bool(c.seen(JobQueued, "tiny-000002")), 60, "the job to queue")
    await asyncio.sleep(1.0)  # give the scheduler time to (wrongly) ask for slots
    assert c.seen(AllocationRequested, "tiny-000002") == [] and c.seen(AllocationGranted, "tiny-000002") == []
    assert c.seen(WorkersExited, "tiny-000002") == []
    assert c.procs["agent-n2"].poll() is None, "a cordoned node's agent keeps running (an operator may uncordon it)"


@pytest.mark.timeout(90)
async def test_an_agent_set_up_wrong_says_what_to_change(cluster: Cluster) -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine may have a GPU")
    proc = cluster.agent("n3", "--device", "cuda")
    proc.wait(60)
    assert proc.returncode == 2
    assert "nvidia-smi lists no GPU" in (cluster.root / "agent-n3.log").read_text()
    proc = cluster.agent("bad.name")
    proc.wait(60)
    assert proc.returncode == 2
    assert "'bad.name' cannot be a subject token" in (cluster.root / "agent-bad.name.log").read_text()
    proc = cluster.agent("n5", "--preload", "transformers,not a module")
    proc.wait(60)
    assert proc.returncode == 2
    assert "--preload 'not a module' is not a module name" in (cluster.root / "agent-n5.log").read_text()


@pytest.mark.timeout(90)
async def test_a_checkpoint_that_cannot_be_verified_is_never_loaded(cluster: Cluster) -> None:
    """Committed (as far as the log says) but absent from the object store: the agent starts no rank, records the
    checkpoint as rejected and the ranks as not started; the checkpoint service reads the store itself and finds
    no manifest either, so with no other checkpoint the job fails at once, naming it, instead of spending its
    restarts on the same missing checkpoint."""
    c = cluster
    stop = asyncio.Event()
    checkpoints = asyncio.create_task(run_service(
        checkpoints_core(checkpoint_handlers(LocalStore(c.data / "objects"))), c.url, stop_event=stop))
    try:
        spec = JobSpec(name="lost", slots=2, model=TINY.model, train=TINY.train, policy=PolicySpec(max_restarts=1))
        await c.submit(spec, "lost-000001")
        await c.until(lambda: bool(c.seen(JobQueued, "lost-000001")), 60, "the job to queue")
        await append_to_job(c.store, CheckpointCommitted(
            job_id="lost-000001", checkpoint_id="step000000010-a0", step=10, world_size=2, uri="file:///nowhere",
            bytes=1, data=DataPosition(next_batch=10), event_id="test-commit", producer="test"))
        c.agent()
        await c.until(lambda: bool(c.seen(JobFailed, "lost-000001")), 60, "the job to fail", "lost-000001")
        # the job fails at attempt 0's first exit; the agent records the other right after it
        await c.until(lambda: len(exits(c, "lost-000001", 0)) == 2, 60, "attempt 0's second exit", "lost-000001")
        assert exits(c, "lost-000001", 0) == {0: START_FAILED_EXIT, 1: START_FAILED_EXIT}
        assert exits(c, "lost-000001", 1) == {}
        (rejected,) = c.seen(CheckpointRejected, "lost-000001")
        assert (rejected.checkpoint_id, rejected.attempt) == ("step000000010-a0", 0)
        assert "never committed" in rejected.cause
        (failed,) = c.seen(JobFailed, "lost-000001")
        assert "no good checkpoint is left" in failed.reason and rejected.event_id in failed.causes
        assert c.seen(WorkersStarted, "lost-000001") == []
        assert not (c.data / "cache" / "lost-000001" / "step000000010-a0").exists()
        (read,) = c.seen(CheckpointScrubbed, "lost-000001")
        assert read.claim_node == "n1" and "no manifest" in read.cause, read
    finally:
        stop.set()
        await checkpoints


@pytest.mark.timeout(150)
async def test_with_rank0_step_reports_only_rank_0_reports_steps_and_the_agent_carries_the_rest(
        cluster: Cluster) -> None:
    """The fleet setting (`--step-reports rank0`): one StepCompleted per step from rank 0, the other ranks'
    steps and step times in the agent's RankHeartbeats batches; the job completes as usual."""
    c = cluster
    c.agent("n1", "--step-reports", "rank0")
    await c.ready()
    # beats 4x a second over 80 steps: the job lasts several beats even on a quiet box
    spec = JobSpec(name="tiny", slots=2, model=TINY.model,
                   train=TrainSpec(steps=80, checkpoint_every=40, data="synthetic"),
                   policy=PolicySpec(heartbeat_interval_s=0.25))
    await c.submit(spec, "tiny-000005")
    await c.until(lambda: bool(c.seen(JobCompleted, "tiny-000005")), 120, "the job to complete", "tiny-000005")
    steps = c.seen(StepCompleted, "tiny-000005", stream=subjects.TELEMETRY)
    assert {e.rank for e in steps} == {0} and sorted(e.step for e in steps) == list(range(80))
    batches = c.seen(RankHeartbeats, "tiny-000005", stream=subjects.TELEMETRY)
    assert batches and all(e.producer == "agent-n1" and e.node == "n1" for e in batches)
    # the subject rank is the lowest relayed so far (the agent holds the attempt from its lowest rank here, 0); a
    # batch with no beat in it is the agent's own liveness while it runs the ranks (services/agent/beats.hold)
    assert all(e.rank <= min(b.rank for b in e.beats) for e in batches if e.beats) and batches[-1].rank == 0
    assert {e.rank for e in batches} == {0}
    rank1 = [b for e in batches for b in e.beats if b.rank == 1]
    assert rank1 and any(b.step > 0 and b.step_time_s > 0 for b in rank1)
    assert c.seen(Heartbeat, "tiny-000005", stream=subjects.TELEMETRY) == []


@pytest.mark.timeout(60)
async def test_heartbeat_settings_that_cannot_work_are_refused(cluster: Cluster) -> None:
    proc = cluster.agent("n4", "--heartbeats", "rank", "--step-reports", "rank0")
    proc.wait(45)
    assert proc.returncode == 2
    assert "--step-reports rank0 needs --heartbeats node" in (cluster.root / "agent-n4.log").read_text()
