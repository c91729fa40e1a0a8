"""Self-healing drills, end to end on CPU: a real broker, every service and a node agent as processes, two real
trainer ranks, and a drill fault. Each drill checks the recovery the platform makes by itself; the drill fixture
keeps each job's whole history as `<tmp>/<job>.history.jsonl` (tests/e2e/drill_harness.py)."""

import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted
from flightdeck.events.findings import RankHung, RankLost
from flightdeck.events.heartbeats import RankHeartbeats
from flightdeck.events.job import AllocationGranted, JobCompleted, JobFailed, JobResumed, WorkersExited
from flightdeck.events.nodelocal import STOPPED_EXIT
from flightdeck.events.spec import FaultSpec
from flightdeck.events.training import FaultInjected, Heartbeat, RankFault, RankStarted
from tests.e2e.drill_harness import CRASH_AT, crash_spec, drill_spec, lineage_gaps, wait_lineage
from tests.integration.lifecycle_harness import Platform
from tests.integration.test_lifecycle_services import kinds

pytestmark = [pytest.mark.slow]


def restore_point(p: Platform, job_id: str, attempt: int) -> tuple[int, str]:
    """The step and id of the newest checkpoint committed before `attempt` was granted (0 and "" if none): what
    the attempt must resume from."""
    history = p.job(job_id)
    grant = next(i for i, e in enumerate(history) if isinstance(e, AllocationGranted) and e.attempt == attempt)
    deleted = {e.checkpoint_id for e in history[:grant] if isinstance(e, CheckpointDeleted)}
    commits = [e for e in history[:grant] if isinstance(e, CheckpointCommitted) and e.checkpoint_id not in deleted]
    newest = max(commits, key=lambda c: c.step, default=None)
    return (newest.step, newest.checkpoint_id) if newest else (0, "")


async def run_to_end(p: Platform, job_id: str, within: float = 150.0) -> None:
    """Until the job ends, and every stream's follower has read as far (what a drill then reads is all there)."""
    await p.until(lambda: bool(p.seen(JobCompleted, job_id)) or bool(p.seen(JobFailed, job_id)), within,
                  "the job to end", job_id)
    await p.caught_up()


@pytest.mark.timeout(180)
async def test_a_crashed_rank_is_restarted_from_the_newest_checkpoint(drill: Platform) -> None:
    p, job = drill, "crash-000001"
    p.agent("n1", "--grace-s", "2")
    await p.ready("n1")
    await p.submit(crash_spec(), job)
    await run_to_end(p, job)
    assert p.seen(JobCompleted, job), kinds(p.job(job))
    exits = {(e.attempt, e.rank): e.exit_code for e in p.rank_exits(job)}
    assert exits[(0, 1)] == 3 and exits[(1, 0)] == exits[(1, 1)] == 0
    # The survivor's collective broke when rank 1 died: it stops with the job, saying so, and is not failed (its
    # exit is 75 or the stop's signal, never 1; no RankFault of its own; no traceback in its log).
    assert exits[(0, 0)] in (STOPPED_EXIT, -15, -9), exits
    assert not [e for e in p.seen(RankFault, job, stream=subjects.TELEMETRY) if e.rank == 0]
    assert "Traceback" not in (p.data / "logs" / f"{job}-a0-r0.log").read_text()
    (resumed,) = p.seen(JobResumed, job)
    assert (resumed.attempt, (resumed.from_step, resumed.checkpoint_id)) == (1, restore_point(p, job, 1))
    assert 0 < resumed.from_step <= CRASH_AT  # paced: commits landed before the crash
    started = p.seen(RankStarted, job, stream=subjects.TELEMETRY)
    assert {e.from_step for e in started if e.attempt == 1} == {resumed.from_step}
    assert await wait_lineage(p, job, 40) == []


@pytest.mark.timeout(180)
async def test_a_hung_rank_is_found_by_its_frozen_step_and_the_job_restarts(drill: Platform) -> None:
    p, job = drill, "hang-000001"
    p.agent("n1", "--grace-s", "2")
    await p.ready("n1")
    await p.submit(drill_spec("hang", steps=40, faults=[FaultSpec(kind="hang", step=18, rank=0)]), job)
    await run_to_end(p, job)
    assert p.seen(JobCompleted, job), kinds(p.job(job))
    history = kinds(p.job(job))
    hung = [e for e in p.seen(RankHung, job) if e.attempt == 0]
    assert hung and not [e for e in p.seen(RankLost, job) if e.attempt == 0], history
    after = [k for k in history[history.index("RankHung"):] if k != "RankHung"]  # a stuck collective stalls both
    assert after[:2] == ["StopRequested", "AllocationReleased"], history
    (fault,) = [e for e in p.seen(FaultInjected, job, stream=subjects.TELEMETRY) if e.kind == "hang"]
    # rank 0's heartbeats, relayed by its agent in per-node batches: alive, and frozen after its step 17
    beats = [b for e in p.seen(RankHeartbeats, job, stream=subjects.TELEMETRY) if e.attempt == 0
             for b in e.beats if b.rank == 0 and b.occurred_at > fault.occurred_at]
    assert len(beats) >= 3 and {b.step for b in beats} == {17}, beats
    assert not [e for e in p.seen(Heartbeat, job, stream=subjects.TELEMETRY) if e.attempt == 0]  # none of its own
    assert all(e.step == 17 and e.stalled_s > e.deadline_s >= 3.0 for e in hung), hung
    assert {e.rank for e in p.rank_exits(job) if e.attempt == 0} == {0, 1}
    (resumed,) = p.seen(JobResumed, job)
    assert resumed.attempt == 1 and (resumed.from_step, resumed.checkpoint_id) == restore_point(p, job, 1)
    assert await wait_lineage(p, job, 40) == []


@pytest.mark.timeout(180)
async def test_a_job_whose_every_restart_crashes_fails_naming_each_fault_in_order(drill: Platform) -> None:
    p, job = drill, "doomed-000001"
    p.agent("n1", "--grace-s", "2")
    await p.ready("n1")
    faults = [FaultSpec(kind="crash", step=3, rank=1, attempt=a) for a in range(3)]
    await p.submit(drill_spec("doomed", steps=20, faults=faults, max_restarts=2), job)
    await run_to_end(p, job)
    (failed,) = p.seen(JobFailed, job)
    assert not p.seen(JobCompleted, job)
    assert [e.attempt for e in p.seen(AllocationGranted, job)] == [0, 1, 2]
    by_id = {e.event_id: e for e in p.job(job)}
    causes = [by_id[c] for c in failed.causes]
    assert [c.attempt for c in causes] == [0, 1, 2], failed.causes  # one per attempt, first to last
    # each attempt's cause is an exit or a loss of that attempt, and rank 1's crash (exit 3, or its silence when that
    # was found first) is recorded in every attempt. Which rank heads the cause is a race since ranks exit through
    # their agent's link: rank 0's collective fails the moment rank 1 is gone, and its exit 1 can be reaped first.
    assert all(isinstance(c, WorkersExited | RankLost) for c in causes), causes
    for a in (0, 1, 2):
        exits = [x for e in p.seen(WorkersExited, job) if e.attempt == a for x in e.exits()]
        lost = [e for e in p.seen(RankLost, job) if e.attempt == a and e.rank == 1]
        assert any(x.rank == 1 and x.exit_code == 3 for x in exits) or lost, (a, exits)
    assert "restart" in failed.reason or "budget" in failed.reason or "max_restarts" in failed.reason, failed.reason
    assert lineage_gaps(p, job, 20) != []  # it never finished
