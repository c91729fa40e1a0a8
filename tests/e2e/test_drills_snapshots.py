"""Lose no work: a rank's host snapshots live in its node's shared memory (events/snapshot.py), its agent persists
the newest when the rank is gone without finishing (a crash, a hang killed), the restart waits for that set, and
the restarted ranks load it from memory. Checkpoints every 50 steps: only the snapshots can make the redo small."""

from collections.abc import Callable

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointStaged
from flightdeck.events.job import JobCompleted, JobQueued, JobResumed, WorkersExited
from flightdeck.events.spec import FaultSpec, JobSpec
from flightdeck.events.training import FaultInjected, RankStarted, StepCompleted
from tests.e2e.drill_harness import drill_spec, paced, wait_lineage
from tests.e2e.test_drills import run_to_end
from tests.integration.lifecycle_harness import Platform
from tests.integration.test_lifecycle_services import kinds

pytestmark = [pytest.mark.slow]


def every_step(spec: JobSpec) -> JobSpec:
    """A snapshot at every step, whatever it costs (train.snapshot_max_overhead 1): the redo is then one step."""
    return msgspec.structs.replace(spec, train=msgspec.structs.replace(spec.train, snapshot_max_overhead=1.0))


def spaced(spec: JobSpec) -> JobSpec:
    """A snapshot every 10th step (whatever it costs: the spacing stays 10): a failure between two redoes at most
    the step in flight only through the snapshot of its last boundary taken after it (trainer/lastboundary.py)."""
    return msgspec.structs.replace(spec, train=msgspec.structs.replace(spec.train, snapshot_every=10,
                                                                      snapshot_max_overhead=1.0))


async def _redone_from_memory(p: Platform, job: str, fault: str) -> None:
    await run_to_end(p, job, 170)
    assert p.seen(JobCompleted, job), kinds(p.job(job))
    (fired,) = [e for e in p.seen(FaultInjected, job, stream=subjects.TELEMETRY) if e.kind == fault]
    persisted = [e for e in p.seen(CheckpointStaged, job, stream=subjects.TELEMETRY) if e.from_memory]
    assert {e.rank for e in persisted} == {0, 1} and {e.attempt for e in persisted} == {0}
    assert {e.producer for e in persisted} == {"agent-n1"}  # the agent, after its ranks were gone
    # ... and their exit records say so (a restart's memory wait ends at once when none was staged)
    assert {x.rank: x.persisted for e in p.seen(WorkersExited, job) if e.attempt == 0 for x in e.exits()} == {
        0: "staged", 1: "staged"}
    # (each rank's good slots are staged, newest first: a set commits at a step every rank holds)
    (resumed,) = p.seen(JobResumed, job)
    (commit,) = [e for e in p.seen(CheckpointCommitted, job) if e.checkpoint_id == resumed.checkpoint_id]
    assert commit.from_memory and commit.attempt == 0 and resumed.from_step == commit.step
    assert commit.step >= fired.step - 1  # at most one step redone (the one in flight)
    assert any("snapshots in memory" in e.reason for e in p.seen(JobQueued, job))
    started = [e for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY) if e.attempt == 1]
    assert sorted((e.rank, e.from_step, e.restored_from) for e in started) == [(0, commit.step, "memory"),
                                                                               (1, commit.step, "memory")]
    assert await wait_lineage(p, job, 40) == []


async def _one_node_drill(p: Platform, job: str, fault: FaultSpec, cadence: Callable[[JobSpec], JobSpec]) -> None:
    p.agent("n1", "--grace-s", "2")
    await p.ready("n1")
    name = job.split("-")[0]
    await p.submit(cadence(drill_spec(name, steps=40, checkpoint_every=50, faults=[paced(), fault])), job)
    await _redone_from_memory(p, job, fault.kind)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("cadence", [every_step, spaced], ids=["every-step", "every-10th"])
async def test_a_crash_redoes_at_most_the_step_in_flight_restored_from_memory(
        drill: Platform, cadence: Callable[[JobSpec], JobSpec]) -> None:
    """Every 10th step: the crashed rank's newest snapshot is of step 20, the survivor's (of its last boundary, once
    the crash broke its all-reduce) of 27; its exit says so, and the survivor's full replica commits alone."""
    await _one_node_drill(drill, "snapcrash-000001", FaultSpec(kind="crash", step=27, rank=1), cadence)


@pytest.mark.timeout(200)
async def test_a_hung_rank_killed_leaves_its_snapshot_and_the_job_redoes_at_most_one_step(drill: Platform) -> None:
    """Snapshots every 10th step, the hang at 23: both ranks snapshot boundary 23 after the fault, the hung one as
    its SIGTERM ends the drill's hang, the other stuck in the step's all-reduce (its SIGTERM watcher)."""
    await _one_node_drill(drill, "snaphang-000001", FaultSpec(kind="hang", step=23, rank=0), spaced)


@pytest.mark.timeout(240)
async def test_a_lost_node_under_data_parallelism_restores_the_survivors_replica_from_memory(drill: Platform) -> None:
    """n2's agent is SIGKILLed (its rank dies with it, and its memory): rank 0's snapshot on n1 is a full replica,
    so the set of it alone commits once n2 is known lost, and the job resumes from it on n1, loaded from memory.
    Snapshots every 10th step: rank 0 snapshots its last boundary once the lost rank breaks its all-reduce."""
    from flightdeck.events.fleet import NodeLost
    from flightdeck.events.training import StepCompleted
    from tests.e2e.drill_harness import kill_agent_mid_run, start_two_nodes

    p, job = drill, "lostmem-000001"
    await start_two_nodes(p)
    await p.submit(spaced(drill_spec("lostmem", slots=2, steps=80, checkpoint_every=100, faults=[paced()],
                                         min_slots=1)), job)
    await kill_agent_mid_run(p, job, after_step=44)  # between snapshots (40, 50)
    await run_to_end(p, job, 200)
    assert p.seen(JobCompleted, job), kinds(p.job(job))
    assert [e.node for e in p.seen(NodeLost)] == ["n2"]
    persisted = [e for e in p.seen(CheckpointStaged, job, stream=subjects.TELEMETRY) if e.from_memory]
    assert {(e.rank, e.node, e.replicated) for e in persisted} == {(0, "n1", True)}
    resumed = p.seen(JobResumed, job)[-1]
    (commit,) = [e for e in p.seen(CheckpointCommitted, job) if e.checkpoint_id == resumed.checkpoint_id]
    assert commit.from_memory and resumed.from_step == commit.step
    done = max(e.step for e in p.seen(StepCompleted, job, stream=subjects.TELEMETRY)
               if e.attempt == commit.attempt and e.rank == 0)
    assert commit.step >= done  # the step in flight at most is redone
    started = [e for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY) if e.attempt == resumed.attempt]
    assert [(e.rank, e.node, e.restored_from) for e in started] == [(0, "n1", "memory")]
    assert await wait_lineage(p, job, 80) == []


@pytest.mark.timeout(200)
async def test_a_node_without_room_for_the_snapshots_runs_its_ranks_without_them_and_says_why(drill: Platform) -> None:
    """The agent caps its snapshot memory at 1 KiB (`--snapshot-memory`): every grant finds no room there, says so,
    and the ranks record SnapshotsOff with that reason; a crash then restores from the store, as before snapshots."""
    from flightdeck.events.fleet import NodeRegistered
    from flightdeck.events.job import AllocationGranted
    from flightdeck.events.training import SnapshotsOff

    p, job = drill, "snaproom-000001"
    p.agent("n1", "--grace-s", "2", "--snapshot-memory", "1K")
    await p.ready("n1")
    await p.submit(drill_spec("snaproom", steps=30, checkpoint_every=10,
                              faults=[paced(), FaultSpec(kind="crash", step=17, rank=1)]), job)
    await run_to_end(p, job, 150)
    assert p.seen(JobCompleted, job), kinds(p.job(job))
    assert [e.snapshot_bytes for e in p.seen(NodeRegistered) if e.node == "n1"] == [1024]
    grants = p.seen(AllocationGranted, job)
    assert [g.attempt for g in grants] == [0, 1]
    assert all(list(g.snapshots_off) == ["n1"] and "snapshot memory" in g.snapshots_off["n1"] for g in grants)
    off = p.seen(SnapshotsOff, job, stream=subjects.TELEMETRY)
    assert sorted((e.attempt, e.rank) for e in off) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {e.reason for e in off} == {grants[0].snapshots_off["n1"]}
    assert [e for e in p.seen(CheckpointStaged, job, stream=subjects.TELEMETRY) if e.from_memory] == []
    started = [e for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY) if e.attempt == 1]
    assert {(e.from_step, e.restored_from) for e in started} == {(10, "store")}
    assert await wait_lineage(p, job, 30) == []


@pytest.mark.timeout(240)
async def test_an_agent_killed_with_its_ranks_persists_their_snapshots_when_it_comes_back(drill: Platform) -> None:
    """n1's agent is SIGKILLed mid-run, its ranks with it, before it could persist anything; restarted on the same
    host, it finds the ranks it never saw exit, stages their snapshots from the node's memory (under ids of its own:
    an earlier agent may have begun), records the exits, and the job resumes from that set, from memory."""
    from tests.e2e.drill_harness import kill_agent_mid_run

    p, job = drill, "snapagent-000001"
    p.agent("n1", "--grace-s", "2")
    await p.ready("n1")
    # The node is lost after 10 s of silence, not the drills' 2: the restarted agent must be back first, and in a
    # loaded suite run its start took longer than 2 s, the node was declared lost, and its staged set fenced
    spec = drill_spec("snapagent", steps=60, checkpoint_every=100, faults=[paced()], heartbeat_misses=20)
    await p.submit(every_step(spec), job)
    await kill_agent_mid_run(p, job, node="n1", after_step=25)
    p.agent("n1", "--grace-s", "2")
    await run_to_end(p, job, 200)
    assert p.seen(JobCompleted, job), kinds(p.job(job))
    persisted = [e for e in p.seen(CheckpointStaged, job, stream=subjects.TELEMETRY) if e.from_memory]
    assert {(e.rank, e.attempt) for e in persisted} == {(0, 0), (1, 0)}, p.logs()
    assert all(e.event_id.count(":") == 7 for e in persisted)  # the restarted agent's own ids
    resumed = p.seen(JobResumed, job)[-1]
    (commit,) = [e for e in p.seen(CheckpointCommitted, job) if e.checkpoint_id == resumed.checkpoint_id]
    assert commit.from_memory and commit.attempt == 0 and resumed.from_step == commit.step
    done = max(e.step for e in p.seen(StepCompleted, job, stream=subjects.TELEMETRY) if e.attempt == 0)
    assert commit.step >= done  # the step in flight at most is redone
    started = [e for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY) if e.attempt == resumed.attempt]
    assert sorted((e.rank, e.restored_from) for e in started) == [(0, "memory"), (1, "memory")], \
        [line for line in p.logs().splitlines() if "memory" in line or "manifest" in line][-20:]
    assert await wait_lineage(p, job, 60) == []
