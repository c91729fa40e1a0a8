"""Users' own training scripts, end to end: each example under examples/ (plain PyTorch DDP, a Hugging Face
Transformers causal LM, an FSDP2 model) runs as an entrypoint job on a real broker with every service and a
node agent, through every drill fault: a loss spike (rolled back, its batches skipped), a crashed rank and a
hung one (restarted from the newest checkpoint), and a preemption (SIGTERM: a checkpoint, then a resume
from exactly it). The drill fixture checks that `flightdeck verify` re-derives every decision.

Run by tests/e2e/test_user_code.py."""

from pathlib import Path

import msgspec

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointStaged
from flightdeck.events.commands import RollbackRequested, StopRequested
from flightdeck.events.findings import LossSpikeDetected, RankHung
from flightdeck.events.job import JobCompleted, JobFailed, JobPreempted, JobResumed
from flightdeck.events.nodelocal import STOPPED_EXIT
from flightdeck.events.plan import ReshardPlanned
from flightdeck.events.spec import FaultSpec, JobSpec, ModelSpec, TrainSpec, parse_spec
from flightdeck.events.training import FaultInjected, RolledBack
from tests.e2e.drill_harness import DRILL_POLICY, wait_lineage
from tests.integration.lifecycle_harness import Platform
from tests.integration.test_lifecycle_services import kinds

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS, SPIKE_AT, CRASH_AT, HANG_AT = 80, 25, 40, 50


def drilled(example: str) -> JobSpec:
    """The example's own job spec with the drill: a spike and a crash in attempt 0, a hang in attempt 1, and
    every attempt paced (0.1 s a step on rank 0) so checkpoints are committed before each fault."""
    spec = parse_spec((EXAMPLES / example / "job.toml").read_bytes())
    faults = [FaultSpec(kind="slow", step=0, rank=0, seconds=0.1, attempt=a) for a in range(4)]
    faults += [FaultSpec(kind="loss_spike", step=SPIKE_AT, rank=0), FaultSpec(kind="crash", step=CRASH_AT, rank=1),
               FaultSpec(kind="hang", step=HANG_AT, rank=0, attempt=1)]
    # Six seconds of silence make a rank lost, not the drill policy's two: on CI's loaded box an FSDP2 rank's
    # heartbeat thread went unheard for over two seconds during a rollback's DCP load, and was taken for dead.
    policy = msgspec.structs.replace(DRILL_POLICY, spike_window=10, heartbeat_misses=12)
    return msgspec.structs.replace(spec, train=TrainSpec(steps=STEPS, checkpoint_every=5), policy=policy,
                                   faults=faults)


# What an example's node preloads (the agent's --preload, as its README says): its heavy imports are done once in
# the node's fork server, not again in every rank of every attempt.
PRELOAD = {"hf_causal_lm": "transformers.models.gpt2.modeling_gpt2"}


HIGH = JobSpec(name="high", priority=90, slots=2, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=10, checkpoint_every=5, data="synthetic"))


async def survives_every_drill_fault(drill: Platform, example: str) -> None:
    p, job = drill, f"{example.replace('_', '-')}-000001"
    p.agent("n1", "--grace-s", "5", *(("--preload", PRELOAD[example]) if example in PRELOAD else ()))
    await p.ready("n1")
    await p.submit(await p.objects.ship(drilled(example), EXAMPLES / example), job)  # its folder, as submit ships it

    # attempt 0: the spike is found and rolled back past, then rank 1 crashes
    await p.until(lambda: bool(p.seen(JobResumed, job)), 180, "the crash's restart", job)
    (spike,) = [e for e in p.seen(FaultInjected, job, stream=subjects.TELEMETRY) if e.kind == "loss_spike"]
    assert p.seen(LossSpikeDetected, job), kinds(p.job(job))
    (rollback,) = p.seen(RollbackRequested, job)
    assert rollback.to_step < SPIKE_AT <= rollback.skip_from + 2 and rollback.skip_to > SPIKE_AT
    await p.until(lambda: any(e.rank == 0 for e in p.seen(RolledBack, job, stream=subjects.TELEMETRY)), 30,
                  "rank 0's RolledBack (telemetry trails the history)", job)
    (rolled,) = [e for e in p.seen(RolledBack, job, stream=subjects.TELEMETRY) if e.rank == 0]
    assert rolled.to_step == rollback.to_step and spike.attempt == 0
    assert {(e.attempt, e.rank): e.exit_code for e in p.rank_exits(job)}[(0, 1)] == 3
    if example == "fsdp2":  # its device mesh came from the plan the resharder recorded, not the fallback
        assert p.seen(ReshardPlanned, job)
        first = (p.data / "logs" / f"{job}-a0-r0.log").read_text()
        assert "parallel plan" in first and "recorded=True" in first, first[-2000:]

    # attempt 1 hangs; attempt 2 is preempted by a higher-priority job once it has committed a checkpoint
    await p.until(lambda: len(p.seen(JobResumed, job)) >= 2, 120, "the hang's restart", job)
    assert [e for e in p.seen(RankHung, job) if e.attempt == 1], kinds(p.job(job))
    await p.until(lambda: any(e.attempt == 2 for e in p.seen(CheckpointCommitted, job)), 120,
                  "a commit in attempt 2", job)
    await p.submit(HIGH, "high-000001")
    await p.until(lambda: bool(p.seen(JobCompleted, job)) or bool(p.seen(JobFailed, job)), 240, "the end", job)
    assert p.seen(JobCompleted, job), kinds(p.job(job))
    (preempted,) = p.seen(JobPreempted, job)
    assert preempted.by_job_id == "high-000001"
    assert any(e.checkpoint for e in p.seen(StopRequested, job))
    # the preempted attempt saved on SIGTERM and the next one resumed from exactly that checkpoint
    final = max(e.step for e in p.seen(CheckpointStaged, job, stream=subjects.TELEMETRY) if e.attempt == 2)
    resumed = p.seen(JobResumed, job)[-1]
    assert (resumed.attempt, resumed.from_step) == (3, final)
    assert {e.exit_code for e in p.rank_exits(job) if e.attempt == 2} == {STOPPED_EXIT}  # saved, then stopped
    assert await wait_lineage(p, job, STEPS) == []
    # one rollback in all: the poisoned batches were skipped, so the redone steps never spiked again
    assert len(p.seen(RollbackRequested, job)) == 1
