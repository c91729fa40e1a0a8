"""The lost-node drill, end to end on CPU: two node agents (n1, n2, one CPU slot each, each with its own data dir
as on two hosts), a 2-rank job that may shrink to one (policy.min_slots = 1), and agent n2 killed with SIGKILL
mid-run (its rank dies with it, PR_SET_PDEATHSIG). With no spare the job must shrink to the node left: n2 is
found lost, the job is resharded 2 -> 1, resumes from a committed checkpoint on one rank and completes."""

import time

import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.fleet import NodeLost
from flightdeck.events.job import AllocationRequested, JobCompleted, JobFailed, JobResumed
from flightdeck.events.plan import ReshardPlanned
from flightdeck.events.training import RankStarted
from tests.e2e.drill_harness import kill_agent_mid_run, lost_node_spec, start_two_nodes, wait_lineage
from tests.integration.lifecycle_harness import Platform
from tests.integration.test_lifecycle_services import kinds

pytestmark = [pytest.mark.slow]
STEPS = 40


@pytest.mark.timeout(200)
async def test_a_lost_node_shrinks_the_job_to_the_node_left_and_it_completes(drill: Platform) -> None:
    p, job = drill, "lostnode-000001"
    await start_two_nodes(p)
    await p.submit(lost_node_spec(), job)
    assert lost_node_spec().train.steps == STEPS
    killed = await kill_agent_mid_run(p, job) + time.time() - time.monotonic()  # as a wall-clock time
    await p.until(lambda: bool(p.seen(JobCompleted, job)) or bool(p.seen(JobFailed, job)), 150,
                  "the job to end", job)
    assert p.seen(JobCompleted, job), kinds(p.job(job))
    (lost,) = p.seen(NodeLost)
    assert lost.node == "n2" and lost.producer == "health" and lost.occurred_at > killed
    shrink = [e for e in p.seen(AllocationRequested, job) if e.slots == 1]
    assert shrink and "shrink" in shrink[0].reason, [(e.slots, e.reason) for e in p.seen(AllocationRequested, job)]
    plans = [e for e in p.seen(ReshardPlanned, job)]
    assert [(e.old.world_size if e.old else 0, e.new.world_size) for e in plans][-1] == (2, 1), plans
    final = p.seen(JobResumed, job)[-1]
    assert final.world_size == 1 and final.attempt == shrink[0].attempt
    commits = {e.checkpoint_id: e for e in p.seen(CheckpointCommitted, job)}
    assert final.checkpoint_id in commits and commits[final.checkpoint_id].world_size == 2  # saved by 2, loaded by 1
    assert final.from_step == commits[final.checkpoint_id].step >= 5
    ranks = {(e.rank, e.world_size, e.from_step) for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY)
             if e.attempt == final.attempt}
    assert ranks == {(0, 1, final.from_step)}
    assert await wait_lineage(p, job, STEPS) == []
