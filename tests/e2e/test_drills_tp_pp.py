"""The plan runs, end to end on CPU, through every drill fault: examples/tp_pp (tensor-parallel blocks, a two-stage
1F1B pipeline) as a 4-rank job on two nodes of two slots, laid out TP 2 x PP 2 as its spec asks. A loss spike is
rolled back; node n2's agent is killed with SIGKILL; the resharder plans TP 2 x PP 1 for the 2 ranks left (its
reason says why), the ranks build that layout from run.plan, and DCP reshards the 4 ranks' checkpoint into it; then
a rank crashes, and one hangs. The job completes with `verify` clean (the drill fixture), and the steps redone after
the shrink have the losses the 4 ranks had: the same run in another layout. The built-in trainer, asked for the
same layout with no script, goes through the lost node the same way."""

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import LossSpikeDetected, RankHung
from flightdeck.events.fleet import NodeLost
from flightdeck.events.job import AllocationReleased, JobCompleted, JobFailed, JobResumed, WorkersExited
from flightdeck.events.plan import ReshardPlanned
from flightdeck.events.spec import FaultSpec, ParallelSpec, TrainSpec, parse_spec
from flightdeck.events.training import RolledBack, StepCompleted
from flightdeck.services.tools.postmortem.analysis import analyse
from tests.e2e.drill_harness import DRILL_POLICY, drill_spec, fleet, history, kill_agent_mid_run, paced, wait_lineage
from tests.e2e.user_drill import EXAMPLES
from tests.integration.lifecycle_harness import Platform
from tests.integration.test_lifecycle_services import kinds

pytestmark = [pytest.mark.slow]
# n2 is killed mid-way between the checkpoints at 20 and 25: killed once step 24 was seen, the step-25 checkpoint
# could commit first (a CI run did), and no step would be redone to compare across the layouts
STEPS, SPIKE_AT, KILL_AFTER, CRASH_AT, HANG_AT = 44, 14, 21, 30, 36


@pytest.mark.timeout(300)
async def test_a_tp_pp_job_survives_a_spike_a_lost_node_a_crash_and_a_hang_replanned_for_the_ranks_left(
        drill: Platform) -> None:
    p, job = drill, "tp-pp-000001"
    for node in ("n1", "n2"):
        p.agent(node, "--slots", "2", "--grace-s", "2",
                *(("--data-dir", str(p.root / f"data-{node}")) if node != "n1" else ()))
        await p.ready(node)
    spec = parse_spec((EXAMPLES / "tp_pp" / "job.toml").read_bytes())
    # heartbeats as the example's own policy keeps them (4 ranks on 2 cores: a pipeline's rank is quiet for a while)
    policy = msgspec.structs.replace(DRILL_POLICY, heartbeat_misses=12, min_slots=2, spike_window=10)
    faults = [FaultSpec(kind="slow", step=0, rank=0, seconds=0.1, attempt=a) for a in range(4)]
    faults += [FaultSpec(kind="loss_spike", step=SPIKE_AT, rank=0, attempt=0),
               FaultSpec(kind="crash", step=CRASH_AT, rank=1, attempt=1),
               FaultSpec(kind="hang", step=HANG_AT, rank=0, attempt=2)]
    spec = msgspec.structs.replace(spec, train=TrainSpec(steps=STEPS, batch_size=8, checkpoint_every=5),
                                   policy=policy, faults=faults)
    await p.submit(await p.objects.ship(spec, EXAMPLES / "tp_pp"), job)
    await p.until(lambda: any(e.rank == 0 for e in p.seen(RolledBack, job, stream=subjects.TELEMETRY)), 120,
                  "the spike's rollback", job)
    await kill_agent_mid_run(p, job, "n2", after_step=KILL_AFTER)
    await p.until(lambda: bool(p.seen(JobCompleted, job)) or bool(p.seen(JobFailed, job)), 240, "the job to end", job)
    assert p.seen(JobCompleted, job), kinds(p.job(job))
    assert p.seen(LossSpikeDetected, job) and len(p.seen(RollbackRequested, job)) == 1
    assert [e.node for e in p.seen(NodeLost)] == ["n2"]
    ended = {(e.attempt, x.rank): (x.exit_code, x.error) for e in p.seen(WorkersExited, job) for x in e.exits()}
    assert ended[(1, 1)] == (3, f"drill fault 'crash' injected at step {CRASH_AT}")  # the crash, as it was told
    # the hang (rank 0, and its peer waiting on it); n2's loss may strand n1's ranks in a collective too, found
    # hung beside the node's loss: one fault, one restart
    assert 2 in {e.attempt for e in p.seen(RankHung, job)} and 1 not in {e.attempt for e in p.seen(RankHung, job)}
    assert [e.attempt for e in p.seen(AllocationReleased, job) if e.kind == "fault"] == [0, 1, 2]

    first, *_, shrink = p.seen(ReshardPlanned, job)
    assert (first.new.world_size, first.new.tp, first.new.pp, first.new.dp) == (4, 2, 2, 1)
    assert (shrink.new.world_size, shrink.new.tp, shrink.new.pp, shrink.new.dp) == (2, 2, 1, 1)
    assert shrink.reason.startswith("shrink: world 4 -> 2") and "nearest to the asked TP 2 x PP 2" in shrink.reason
    resumed = {e.attempt: e for e in p.seen(JobResumed, job)}
    assert sorted(resumed) == [1, 2, 3] and {e.world_size for e in resumed.values()} == {2}
    commits = {e.checkpoint_id: e for e in p.seen(CheckpointCommitted, job)}
    shrunk = resumed[1]
    assert commits[shrunk.checkpoint_id].world_size == 4  # saved by 4, loaded by 2
    logs = (p.data / "logs" / f"{job}-a3-r0.log").read_text()
    assert f"done at step {STEPS} as TP 2 x PP 1 x DP 1" in logs, logs[-2000:]

    # the steps both layouts ran have the same losses: the checkpoint was resharded, not reinitialised
    losses: dict[int, dict[int, float]] = {}
    for e in p.seen(StepCompleted, job, stream=subjects.TELEMETRY):
        if e.rank == 0:
            losses.setdefault(e.attempt, {})[e.step] = e.loss
    before, after = losses[0], losses[1]  # attempt 0's after its rollback: the later report of a step is kept
    redone = sorted(set(before) & set(after))
    assert redone and redone[0] == shrunk.from_step, (sorted(before), sorted(after))
    for step in redone:
        assert after[step] == pytest.approx(before[step], rel=1e-5), step
    assert await wait_lineage(p, job, STEPS) == []
    # the postmortem tells the node's loss as a restart that changed the layout, the new plan in its chain
    recorded = sorted([*await fleet(p.store), *await history(p.store, job)], key=lambda s: (s.stream, s.seq))
    pm = analyse(recorded, job)  # each stream in its order, the fleet's events among the job's as stored
    (lost,) = [i for i in pm.incidents if i.kind == "node_lost"]
    assert lost.decision == "restart + reshard", (lost.decision, lost.decision_detail)
    assert "on 2 ranks (was 4)" in lost.decision_detail and "laid out TP 2 x PP 1 x DP 1" in lost.decision_detail
    assert any(m.type == "ReshardPlanned" and "(dp 1, tp 2, pp 1)" in m.detail for m in lost.chain), "\n".join(
        f"{m.type}: {m.detail[:100]}" for m in lost.chain)


@pytest.mark.timeout(240)
async def test_the_built_in_trainer_laid_out_tp_pp_loses_a_node_and_goes_on_as_tp_2(drill: Platform) -> None:
    """The built-in trainer asked for TP 2 x PP 2 (no script): n2's agent killed, it is replanned TP 2 x PP 1 for the
    2 ranks left and completes; the redone steps have the gradient norms the 4 ranks had."""
    p, job = drill, "builtin-tp-pp-000001"
    for node in ("n1", "n2"):
        p.agent(node, "--slots", "2", "--grace-s", "2",
                *(("--data-dir", str(p.root / f"data-{node}")) if node != "n1" else ()))
        await p.ready(node)
    spec = drill_spec("builtin-tp-pp", slots=4, steps=30, faults=[paced()], min_slots=2, heartbeat_misses=12)
    spec = msgspec.structs.replace(spec, parallel=ParallelSpec(tp=2, pp=2))
    await p.submit(spec, job)
    await kill_agent_mid_run(p, job, "n2", after_step=11)  # 4 steps before the checkpoint at 15
    await p.until(lambda: bool(p.seen(JobCompleted, job)) or bool(p.seen(JobFailed, job)), 180, "the job to end", job)
    assert p.seen(JobCompleted, job), kinds(p.job(job))
    first, *_, shrink = p.seen(ReshardPlanned, job)
    assert (first.new.world_size, first.new.tp, first.new.pp) == (4, 2, 2)
    assert (shrink.new.world_size, shrink.new.tp, shrink.new.pp) == (2, 2, 1)
    (resumed,) = p.seen(JobResumed, job)
    assert resumed.world_size == 2
    norms: dict[int, dict[int, float]] = {}
    for e in p.seen(StepCompleted, job, stream=subjects.TELEMETRY):
        if e.rank == 0:
            norms.setdefault(e.attempt, {})[e.step] = e.grad_norm
    redone = sorted(set(norms[0]) & set(norms[1]))
    assert redone and redone[0] == resumed.from_step, (sorted(norms[0]), sorted(norms[1]))
    for step in redone:  # the checkpoint (or snapshot) was resharded into the new layout, not reinitialised
        assert norms[1][step] == pytest.approx(norms[0][step], rel=1e-5), step
    assert await wait_lineage(p, job, 30) == []
