"""A spike's cause, end to end on CPU with policy.spike_diagnosis: its rollback trains the spike's batches again
from the checkpoint before skipping them, and the health monitor records a verdict (SpikeDiagnosed) for each kind
of cause injected: a poisoned batch (data), a learning rate too high from a step on (optimisation), and one rank's
parameters corrupted once, as a faulty device would leave them (hardware, naming its node)."""

import asyncio
import math

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import LossSpikeDetected, SpikeDiagnosed
from flightdeck.events.fleet import SelfCheckFailed, SelfCheckPassed
from flightdeck.events.job import JobCompleted, JobFailed, WorkersStarted
from flightdeck.events.spec import FaultSpec
from flightdeck.events.training import RolledBack, SpikeReplayed
from tests.e2e.drill_harness import (
    SPIKE_AT,
    assert_verified,
    drill_spec,
    fleet,
    paced,
    spike_spec,
    start_two_nodes,
)
from tests.integration.lifecycle_harness import Platform
from tests.integration.test_lifecycle_services import kinds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]
AT = 30  # where each cause is injected


async def ended(p: Platform, job: str) -> None:
    await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 170, "the job to end", job)


async def diagnosed(p: Platform, job: str) -> SpikeDiagnosed:
    await p.until(lambda: bool(p.seen(SpikeDiagnosed, job)), 30, "the spike's diagnosis", job)
    verdicts = p.seen(SpikeDiagnosed, job)
    assert len(verdicts) == 1, [(v.verdict, v.reason) for v in verdicts]
    return verdicts[0]


async def test_a_poisoned_batch_is_diagnosed_as_data(drill: Platform) -> None:
    p, job = drill, "spike-000001"
    p.agent("n1", "--grace-s", "2")
    await p.ready("n1")
    spec = spike_spec()
    spec = msgspec.structs.replace(spec, policy=msgspec.structs.replace(spec.policy, spike_diagnosis=True))
    await p.submit(spec, job)
    await ended(p, job)
    assert p.seen(JobCompleted, job), kinds(p.job(job))
    (spike,) = p.seen(LossSpikeDetected, job)
    (rollback,) = p.seen(RollbackRequested, job)
    assert rollback.replay and rollback.trigger_id == spike.event_id
    replays = p.seen(SpikeReplayed, job, stream=subjects.TELEMETRY)
    assert sorted(e.rank for e in replays) == [0, 1] and {e.from_step for e in replays} == {rollback.to_step}
    # The re-run's losses over the poisoned steps are the spike's own: training is deterministic on CPU.
    (replay0,) = [e for e in replays if e.rank == 0]
    again = replay0.losses[spike.onset - rollback.to_step: spike.step - rollback.to_step + 1]
    assert again == spike.losses[-len(again):]
    # Each rank reports its re-run before its rollback lands, and lands once.
    rolled = {e.rank: e for e in p.seen(RolledBack, job, stream=subjects.TELEMETRY)}
    assert sorted(rolled) == [0, 1] and all(e.occurred_at <= rolled[e.rank].occurred_at for e in replays)
    verdict = await diagnosed(p, job)
    assert (verdict.verdict, verdict.finding_id, verdict.replayed, verdict.reproduced) == (
        "data", spike.event_id, True, True)
    assert verdict.onset == SPIKE_AT and verdict.diverged_rank == -1 and verdict.recurred_at == -1
    assert f"batches [{rollback.skip_from}, {rollback.skip_to})" in verdict.reason
    await assert_verified(p, job)


async def test_a_learning_rate_too_high_is_diagnosed_as_optimisation(drill: Platform) -> None:
    p, job = drill, "highlr-000001"
    p.agent("n1", "--grace-s", "2")
    await p.ready("n1")
    await p.submit(drill_spec("highlr", steps=60, spike_window=10, spike_diagnosis=True,
                              faults=[paced(), FaultSpec(kind="high_lr", step=AT, rank=0)]), job)
    await ended(p, job)
    spikes = p.seen(LossSpikeDetected, job)
    assert len(spikes) >= 2, kinds(p.job(job))
    first, again = spikes[0], spikes[1]
    assert first.onset >= AT and again.onset >= AT  # at the same point after the skip, on other batches
    rollbacks = p.seen(RollbackRequested, job)
    assert [r.replay for r in rollbacks] == [True] + [False] * (len(rollbacks) - 1)  # diagnosed once
    verdict = await diagnosed(p, job)
    assert (verdict.verdict, verdict.finding_id, verdict.recurred_at) == ("optimisation", first.event_id, again.step)
    assert verdict.replayed and verdict.reproduced  # deterministic: the same batches spiked again too
    assert again.event_id in verdict.evidence and "train.lr" in verdict.reason
    await assert_verified(p, job)


async def test_one_ranks_corrupted_parameters_are_diagnosed_as_hardware_on_its_node(drill: Platform) -> None:
    p, job = drill, "sdc-000001"
    await start_two_nodes(p)
    await p.submit(drill_spec("sdc", steps=60, spike_window=10, spike_diagnosis=True,
                              faults=[paced(), FaultSpec(kind="corrupt", step=AT, rank=0)]), job)
    await ended(p, job)
    assert p.seen(JobCompleted, job), kinds(p.job(job))
    spike = p.seen(LossSpikeDetected, job)[0]
    verdict = await diagnosed(p, job)
    (node,) = [e.node for e in p.seen(WorkersStarted, job) if e.attempt == 0 and 0 in e.ranks]
    assert (verdict.verdict, verdict.finding_id, verdict.diverged_rank) == ("hardware", spike.event_id, 0)
    assert verdict.replayed and not verdict.reproduced and verdict.suspect_nodes == [node]
    assert all(math.isfinite(x) and x < spike.loss / 2 for x in verdict.replay_losses)
    assert node in verdict.reason and "self-check" in verdict.reason
    # The suspect node's agent runs its self-check again and records the verdict on the node (a failure cordons it).
    async def rechecked() -> list[SelfCheckPassed | SelfCheckFailed]:
        return [s.event for s in await fleet(p.store) if isinstance(s.event, SelfCheckPassed | SelfCheckFailed)
                and s.event.causation_id == verdict.event_id]
    for _ in range(120):
        if await rechecked():
            break
        await asyncio.sleep(0.5)
    (again,) = await rechecked()
    assert isinstance(again, SelfCheckPassed) and again.node == node and "diagnosed as a hardware fault" in again.detail
    await assert_verified(p, job)
