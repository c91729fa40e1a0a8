"""No single witness judges a checkpoint (issue 51, case 1): a node that cannot read the object store rejected
checkpoints 175, 150 and 125 in turn, each was taken out of the catalog and deleted on its word, and the job failed
with "no good checkpoint is left to restore", its healthy node never tried. Now a node's claim (CheckpointRejected)
takes nothing out: the restart is free and waits for the checkpoint service's own read of the store; read back
intact, the checkpoint stays the restore point and the claiming node is cordoned by the resource manager, so the
restart lands elsewhere; read back bad, the restart falls back past it, or the job fails once none is left.

The scheduler and the resource manager run together over one log (tests/unit/helpers.Bus); the checkpoint
service's commits, reads and deletions are published as it would record them."""

from msgspec.structs import replace

from flightdeck.events.checkpoint import (
    CheckpointCommitted,
    CheckpointDeleted,
    CheckpointRejected,
    CheckpointScrubbed,
    DataPosition,
)
from flightdeck.events.clock import ClockTick
from flightdeck.events.fleet import NodeCordoned
from flightdeck.events.job import AllocationGranted, AllocationRequested, JobFailed, JobQueued
from flightdeck.services.checkpoints.core import CONFIRMED, checkpoint_id
from flightdeck.services.resources.core import BLIND_CORDON
from flightdeck.services.resources.core import core_service as resources_core
from flightdeck.services.scheduler.core import core_service as scheduler_core
from flightdeck.services.scheduler.state import Settings
from tests.unit.helpers import Bus, register, submit

JOB = "llm-000001"
CAUSE = "checkpoint llm-000001/{cid} has no manifest: it was never committed or was deleted"


def committed(step: int) -> CheckpointCommitted:
    return CheckpointCommitted(job_id=JOB, checkpoint_id=checkpoint_id(0, step), step=step, world_size=2, uri="u",
                               bytes=1, data=DataPosition(next_batch=step), manifest_sha256=f"m{step}")


def rejected(grant: AllocationGranted, node: str, step: int) -> CheckpointRejected:
    cid = checkpoint_id(0, step)
    return CheckpointRejected(job_id=JOB, checkpoint_id=cid, step=step, attempt=grant.attempt, node=node,
                              cause=CAUSE.format(cid=cid))


def read_back(step: int, node: str, cause: str = "") -> CheckpointScrubbed:
    cid = checkpoint_id(0, step)
    return CheckpointScrubbed(job_id=JOB, checkpoint_id=cid, step=step, bytes=10, seconds=0.1, cause=cause,
                              claim_node=node, claim_cause=CAUSE.format(cid=cid), schema_version=2)


def platform() -> tuple[Bus, AllocationGranted]:
    """n1 and n2 with two slots each; the job ran attempt 0 on n1, committed 125, 150 and 175, then n1 went away
    (lost, as when its agent froze) and the restart (attempt 1) was granted on n2, restoring 175."""
    bus = Bus([scheduler_core(memory_wait=False), resources_core()])
    bus.publish(register("n1", 2), register("n2", 2), submit(JOB, slots=2))
    first = bus.last_grant(JOB)
    assert {r.node for r in first.assignments} == {"n1"}
    bus.start_workers(first)
    bus.publish(committed(125), committed(150), committed(175))
    bus.publish(NodeCordoned(node="n1", reason="lost: its agent stopped beating"))  # as resources records a loss
    bus.exit_workers(first, code=-9)
    grant = bus.last_grant(JOB)
    assert grant.attempt == 1 and {r.node for r in grant.assignments} == {"n2"}
    assert grant.restore is not None and grant.restore.checkpoint_id == checkpoint_id(0, 175)
    return bus, grant


def refuse(bus: Bus, grant: AllocationGranted, node: str, step: int) -> None:
    """n2's agent cannot read the restore point: it records the claim, then its ranks' exits (nothing started)."""
    bus.publish(rejected(grant, node, step))
    bus.exit_workers(grant, code=70)


def requests(bus: Bus) -> list[AllocationRequested]:
    return bus.of(AllocationRequested, JOB)


def test_a_claim_takes_nothing_out_and_the_restart_waits_for_the_services_read() -> None:
    bus, grant = platform()
    asked = len(requests(bus))
    refuse(bus, grant, "n2", 175)
    assert len(requests(bus)) == asked  # no restart decided on one node's word
    (queued,) = [q for q in bus.of(JobQueued, JOB) if "read checkpoint" in q.reason]
    assert checkpoint_id(0, 175) in queued.reason and "one node's failed read does not make it bad" in queued.reason
    job = bus.state("scheduler").jobs[JOB]
    assert [c.step for c in job.checkpoints] == [125, 150, 175] and job.restarts == 1  # the crash's; this one free


def test_read_back_intact_the_node_is_cordoned_and_the_same_checkpoint_restored_elsewhere() -> None:
    bus, grant = platform()
    refuse(bus, grant, "n2", 175)
    bus.publish(NodeCordoned(node="n1", reason="x"))  # n1 stays out: the restart can go nowhere yet
    bus.publish(read_back(175, "n2"))
    (cordon,) = [c for c in bus.of(NodeCordoned) if c.node == "n2"]
    assert cordon.reason.startswith(BLIND_CORDON) and checkpoint_id(0, 175) in cordon.reason
    assert "read back intact" in cordon.reason and "has no manifest" in cordon.reason
    ask = requests(bus)[-1]
    assert ask.attempt == 2 and ask.restore is not None and ask.restore.checkpoint_id == checkpoint_id(0, 175)
    assert "read back intact" in ask.reason and "node n2" in ask.reason
    assert bus.last_grant(JOB).attempt == 1  # denied: n1 and n2 are both cordoned, nothing placed on n2 again
    assert bus.state("scheduler").jobs[JOB].restarts == 1
    assert not bus.of(JobFailed, JOB) and not bus.of(CheckpointDeleted, JOB)


def test_read_back_bad_the_restart_falls_back_and_with_none_left_the_job_fails_once() -> None:
    bus, grant = platform()
    for step, fallback in ((175, 150), (150, 125)):
        refuse(bus, grant, "n2", step)
        bus.publish(read_back(step, "n2", cause=f"shard '__0_0.distcp' of {checkpoint_id(0, step)} is missing"))
        ask = requests(bus)[-1]
        assert ask.restore is not None and ask.restore.checkpoint_id == checkpoint_id(0, fallback), ask
        assert "found it bad too" in ask.reason
        bus.publish(CheckpointDeleted(job_id=JOB, checkpoint_id=checkpoint_id(0, step), reason=CONFIRMED))
        grant = bus.last_grant(JOB)
    refuse(bus, grant, "n2", 125)
    bus.publish(read_back(125, "n2", cause="shard missing"))
    (failed,) = bus.of(JobFailed, JOB)
    assert "no good checkpoint is left to restore" in failed.reason and checkpoint_id(0, 125) in failed.reason
    assert {e.event_id for e in bus.of(CheckpointRejected, JOB)} <= set(failed.causes)
    assert bus.state("scheduler").ended[JOB] == "failed"


def test_a_read_that_never_comes_sets_the_checkpoint_aside_without_deleting_it() -> None:
    bus, grant = platform()
    refuse(bus, grant, "n2", 175)
    asked = len(requests(bus))
    job = bus.state("scheduler").jobs[JOB]
    assert job.waits_for == f"read:{checkpoint_id(0, 175)}"
    bus.publish(ClockTick(service="scheduler", now=job.wait_until - 1, positions={}))
    assert len(requests(bus)) == asked
    bus.publish(ClockTick(service="scheduler", now=job.wait_until, positions={}))
    ask = requests(bus)[-1]
    assert ask.restore is not None and ask.restore.checkpoint_id == checkpoint_id(0, 150)
    assert "set aside, not deleted" in ask.reason
    assert not bus.of(CheckpointDeleted, JOB)


def test_histories_recorded_before_take_the_claim_as_the_verdict() -> None:
    """Settings.claims "trust": the rejected checkpoint leaves the catalog at once and the restart falls back."""
    bus = Bus([scheduler_core(memory_wait=False), resources_core()])
    bus.states[0] = replace(bus.states[0], settings=replace(bus.states[0].settings, claims="trust"))
    assert Settings().claims == "trust"
    bus.publish(register("n1", 2), register("n2", 2), submit(JOB, slots=2))
    first = bus.last_grant(JOB)
    bus.start_workers(first)
    bus.publish(committed(150), committed(175))
    bus.exit_workers(first, code=-9)
    grant = bus.last_grant(JOB)
    refuse(bus, grant, grant.assignments[0].node, 175)
    ask = requests(bus)[-1]
    assert ask.restore is not None and ask.restore.checkpoint_id == checkpoint_id(0, 150)


def test_with_nothing_else_left_an_unread_claim_fails_the_job_rather_than_train_from_scratch() -> None:
    bus = Bus([scheduler_core(memory_wait=False), resources_core()])
    bus.publish(register("n1", 2), register("n2", 2), submit(JOB, slots=2))
    first = bus.last_grant(JOB)
    bus.start_workers(first)
    bus.publish(committed(175))
    bus.exit_workers(first, code=-9)
    refuse(bus, bus.last_grant(JOB), "n2", 175)
    job = bus.state("scheduler").jobs[JOB]
    bus.publish(ClockTick(service="scheduler", now=job.wait_until, positions={}))
    (failed,) = bus.of(JobFailed, JOB)
    assert "did not read checkpoint" in failed.reason and "stays in the store, not deleted" in failed.reason
    assert all(a.restore is not None for a in requests(bus) if a.attempt > 0)  # never asked to start from scratch
