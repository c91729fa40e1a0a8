"""The grow-back drill, end to end on CPU: the lost-node drill (two one-slot agents, n2 killed with SIGKILL, the job
shrinks 2 -> 1 and carries on), then a new node n3 joins; at the next checkpoint boundary the job grows back to its
2 ranks (stopped without a new checkpoint, released, re-requested, resumed from the commit just made) and completes.
No step is lost on the way and every step trains on the same global batch, whatever the world size."""

import time

import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.commands import StopRequested
from flightdeck.events.fleet import NodeLost
from flightdeck.events.job import (
    AllocationGranted,
    AllocationRequested,
    JobCompleted,
    JobFailed,
    JobQueued,
    JobResumed,
    WorkersStarted,
)
from flightdeck.events.plan import ReshardPlanned
from flightdeck.events.training import RankStarted, StepCompleted
from tests.e2e.drill_harness import (
    GROW_STEPS,
    grow_back_spec,
    join_node,
    kill_agent_mid_run,
    start_two_nodes,
    wait_lineage,
)
from tests.integration.lifecycle_harness import Platform
from tests.integration.test_lifecycle_services import kinds

pytestmark = [pytest.mark.slow]

STANDBY = ("--standby", "1")


def global_tokens(p: Platform, job_id: str) -> dict[tuple[int, int], int]:
    """(attempt, step) -> tokens all the ranks together trained on, for the steps every rank of the attempt
    reported (each reports its own share as tokens_per_s x step_time_s; a killed rank's last reports are lost)."""
    world = {e.attempt: e.world_size for e in p.seen(RankStarted, job_id, stream=subjects.TELEMETRY)}
    tokens: dict[tuple[int, int], int] = {}
    ranks: dict[tuple[int, int], set[int]] = {}
    for e in p.seen(StepCompleted, job_id, stream=subjects.TELEMETRY):
        key = (e.attempt, e.step)
        tokens[key] = tokens.get(key, 0) + round(e.tokens_per_s * e.step_time_s)
        ranks.setdefault(key, set()).add(e.rank)
    return {key: n for key, n in tokens.items() if len(ranks[key]) == world[key[0]]}


@pytest.mark.timeout(200)
async def test_a_shrunk_job_grows_back_when_a_node_joins_and_completes(drill: Platform) -> None:
    p, job, spec = drill, "growback-000001", grow_back_spec()
    # With warm standbys, as a fleet runs: the restarts onto the node left and onto the joined node take them.
    await start_two_nodes(p, *STANDBY)
    await p.submit(spec, job)
    killed = await kill_agent_mid_run(p, job) + time.time() - time.monotonic()  # as a wall-clock time
    # Shrunk: n2 found lost, the job resumed on n1 alone. Only now does n3 start (earlier, the restart would
    # have had two slots and not shrunk at all).
    await p.until(lambda: any(e.world_size == 1 for e in p.seen(JobResumed, job)), 90, "the job to shrink", job)
    (lost,) = p.seen(NodeLost)
    assert lost.node == "n2" and lost.occurred_at > killed
    join_node(p, "n3", *STANDBY)
    await p.ready("n3", within=90)
    await p.until(lambda: bool(p.seen(JobCompleted, job)) or bool(p.seen(JobFailed, job)), 120,
                  "the job to end", job)
    assert p.seen(JobCompleted, job), kinds(p.job(job))

    asks = [(e.attempt, e.slots, e.reason) for e in p.seen(AllocationRequested, job)]
    shrink = [a for a in asks if a[1] == 1]
    grow = [a for a in asks if a[1] == 2 and a[2].startswith("grow back")]
    assert shrink and "shrink" in shrink[0][2] and grow and grow[0][0] > shrink[0][0], asks
    resumed = p.seen(JobResumed, job)
    small = next(e for e in resumed if e.world_size == 1)
    final = resumed[-1]
    assert final.world_size == 2 and final.attempt == grow[0][0] and small.attempt == shrink[0][0]
    # Grown at a checkpoint boundary: stopped without a new checkpoint at the commit that triggered it, restored
    # from the newest one the lone rank made (it trains on until it reads the stop, and may commit once more).
    (stop,) = [e for e in p.seen(StopRequested, job) if e.reason.startswith("grow back")]
    commits = {e.checkpoint_id: e for e in p.seen(CheckpointCommitted, job)}
    trigger = next(c for c in commits.values() if f"restore {c.checkpoint_id} " in stop.reason)
    assert not stop.checkpoint and trigger.attempt == small.attempt and trigger.world_size == 1, stop
    assert any(e.reason == "grow back" for e in p.seen(JobQueued, job))
    restored = commits[final.checkpoint_id]
    assert restored.attempt == small.attempt and restored.world_size == 1 and restored.step >= trigger.step
    assert final.from_step == restored.step
    (granted,) = [e for e in p.seen(AllocationGranted, job) if e.attempt == final.attempt]
    assert sorted(a.node for a in granted.assignments) == ["n1", "n3"]
    assert sorted(e.node for e in p.seen(WorkersStarted, job) if e.attempt == final.attempt) == ["n1", "n3"]
    ranks = {(e.rank, e.world_size, e.from_step) for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY)
             if e.attempt == final.attempt}
    assert ranks == {(0, 2, final.from_step), (1, 2, final.from_step)}

    # Resharded both ways, the global batch the same in every plan and in what the ranks trained on.
    sizes = [(e.old.world_size if e.old else 0, e.new.world_size) for e in p.seen(ReshardPlanned, job)]
    assert sizes[-2:] == [(2, 1), (1, 2)], sizes
    for plan in [pl for e in p.seen(ReshardPlanned, job) for pl in (e.old, e.new) if pl is not None]:
        assert plan.dp * plan.micro_batch_size * plan.micro_batches * plan.grad_accum == spec.train.batch_size, plan
    assert await wait_lineage(p, job, GROW_STEPS) == []
    per_step = global_tokens(p, job)
    expected = spec.train.batch_size * spec.model.seq_len
    for attempt in (0, small.attempt, final.attempt):
        got = {step: tokens for (a, step), tokens in per_step.items() if a == attempt}
        assert len(got) >= 5 and set(got.values()) == {expected}, (attempt, got)
