"""Every service and the node agent SIGKILLed during one running job and started again, each at a moment it has
work: health while heartbeats flow, checkpoints while a checkpoint is staged, and scheduler, resharder and resources
all down when the node agent is killed with its ranks, so the job's restart is decided, granted and spawned by
restarted processes. The job completes, the cores replay to the recorded decisions, no step is lost or reported
twice, and no decision is taken twice."""

import asyncio

import pytest

from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointStaged
from flightdeck.events.fleet import SelfCheckPassed
from flightdeck.events.job import AllocationGranted
from tests.chaos.harness import Chaos, chaos_spec, progress, rank_pids, restart, sigkill, step_reached
from tests.e2e.drill_harness import wait_lineage
from tests.integration.test_lifecycle_services import gone

pytestmark = [pytest.mark.chaos, pytest.mark.slow]
STEPS = 120
# A 4 s heartbeat deadline, not the drills' 2 s: this drill restarts six processes (five importing the platform,
# the agent spawning torch ranks) on a box that runs other test files too, and a rank starved past 2 s then was
# called lost (a third attempt, seen once in CI). Health stays down longer than the deadline all the same.
LOST_DEADLINE_S = 4.0
HEALTH_DOWN_S = 5.0


def staged_uncommitted(c: Chaos, job_id: str) -> int | None:
    """A step every rank of attempt 0 has staged that no CheckpointCommitted names yet."""
    p = c.platform
    staged: dict[int, set[int]] = {}
    for e in p.seen(CheckpointStaged, job_id, stream=subjects.TELEMETRY):
        if e.attempt == 0:
            staged.setdefault(e.step, set()).add(e.rank)
    committed = {e.step for e in p.seen(CheckpointCommitted, job_id)}
    return next((s for s, ranks in sorted(staged.items()) if len(ranks) == 2 and s not in committed), None)


@pytest.mark.timeout(240)
async def test_every_service_and_the_agent_killed_and_restarted_mid_job(chaos: Chaos) -> None:
    c, job = chaos, "chaos-svc-000001"
    p = c.platform
    p.agent("n1", "--grace-s", "2")
    await p.ready("n1")
    spec = chaos_spec("chaos-svc", STEPS, heartbeat_misses=8)
    assert spec.policy.heartbeat_interval_s * spec.policy.heartbeat_misses == LOST_DEADLINE_S
    await p.submit(spec, job)
    faults: list[str] = []

    await step_reached(p, job, 0, 3)
    await sigkill(p, "health")  # down past the heartbeat deadline: the restart must not call the ranks lost
    await asyncio.sleep(HEALTH_DOWN_S)
    await restart(p, "health")
    faults.append(f"SIGKILL health (down {HEALTH_DOWN_S:g} s)")

    await progress(p, job, 0, 3)
    await sigkill(p, "checkpoints")  # a checkpoint gets staged while it is down: committed after its restart
    await p.until(lambda: staged_uncommitted(c, job) is not None, 30, "a checkpoint staged while checkpoints is down")
    pending = staged_uncommitted(c, job)
    await restart(p, "checkpoints")
    await p.until(lambda: any(e.step == pending for e in p.seen(CheckpointCommitted, job)), 30,
                  f"the checkpoint of step {pending} to be committed after the restart", job)
    faults.append("SIGKILL checkpoints with a checkpoint staged")

    # Scheduler and resharder down, then the node agent SIGKILLed (its ranks die with it) and resources down too:
    # the restart of the job is decided, granted and spawned by restarted processes.
    await sigkill(p, "scheduler")
    await sigkill(p, "resharder")
    ranks = rank_pids(p, job, 0)
    await sigkill(p, "agent-n1")
    await p.until(lambda: all(gone(pid) for pid in ranks.values()), 30, "the ranks to die with their agent")
    await sigkill(p, "resources")
    await restart(p, "scheduler")
    p.agent("n1", "--grace-s", "2")  # the same node back: it records its lost ranks, registers, self-checks
    await p.until(lambda: len([e for e in p.seen(SelfCheckPassed) if e.node == "n1"]) == 2, 90,
                  "the restarted agent to pass its self-check")
    await restart(p, "resources")
    await p.until(lambda: any(e.attempt > 0 for e in p.seen(AllocationGranted, job)), 60,
                  "the restarted resources to grant the next attempt", job)
    await restart(p, "resharder")
    faults += ["SIGKILL scheduler", "SIGKILL resharder", "SIGKILL node agent with its ranks", "SIGKILL resources"]

    outcome = await c.outcome(job, STEPS, "services", faults)
    assert await wait_lineage(p, job, STEPS) == []
    assert outcome.held, outcome
    assert outcome.attempts == 2, outcome  # the one restart the dead ranks called for, no spurious one
    assert {e.exit_code for e in p.rank_exits(job) if e.attempt == 0} == {-9}  # recorded by the new agent
