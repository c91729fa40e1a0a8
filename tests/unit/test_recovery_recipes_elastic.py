"""Shrinking to fewer slots when a lost node leaves no room, growing back at the next checkpoint once it
returns, and stragglers recorded or replaced: the scheduler and resources cores over one log."""

from flightdeck.events.checkpoint import CheckpointCommitted, DataPosition
from flightdeck.events.commands import StopRequested
from flightdeck.events.findings import RankLost, StragglerDetected
from flightdeck.events.fleet import NodeLost, NodeUncordoned
from flightdeck.events.job import (
    AllocationDenied,
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    CancelRequested,
    JobPhaseChanged,
    JobQueued,
    JobResumed,
    JobSubmitted,
    SlotRef,
    WorkersStarted,
)
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec, snapshot_bytes
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from flightdeck.services.scheduler.recipes import pick_world
from tests.unit.helpers import Agents, Bus, fold, phases, register
from tests.unit.helpers import decided as decisions


def submitted(job_id: str, *, slots: int = 4, min_slots: int = 2, batch: int = 8, priority: int = 50,
              replace: bool = False) -> JobSubmitted:
    policy = PolicySpec(min_slots=min_slots, replace_stragglers=replace)
    return JobSubmitted(job_id=job_id, spec=JobSpec(name=job_id.split("-")[0], slots=slots, priority=priority,
                                                    train=TrainSpec(batch_size=batch), policy=policy))


def commit(job_id: str, step: int) -> CheckpointCommitted:
    return CheckpointCommitted(job_id=job_id, checkpoint_id=f"step{step:09d}-a1", step=step, world_size=2, uri="u",
                               bytes=1, data=DataPosition(next_batch=step))


def decided(b: Bus, since: int) -> list[object]:
    return [e for e in b.log[since:] if e.producer == "scheduler" and not isinstance(e, JobPhaseChanged)]


def shrunk() -> tuple[Bus, Agents]:
    """job-1 wants 4 slots and may run on 2; it ran on n0 and n1, and n1 was lost with no spare to replace it."""
    b = Bus([scheduler(), resources()])
    agents = Agents(b)
    b.publish(register("n0", 2), register("n1", 2), submitted("job-1"))
    agents()
    b.publish(NodeLost(node="n1", reason="psu", event_id="lost-n1"))
    agents()
    return b, agents


def test_a_job_shrinks_to_what_is_left_when_a_lost_node_has_no_replacement() -> None:
    b, _ = shrunk()
    asks = b.of(AllocationRequested, "job-1")
    assert [(a.slots, a.attempt, a.use_spares) for a in asks] == [(4, 0, False), (2, 1, True)]
    assert asks[0].reason == ""
    assert asks[1].reason == ("shrink to 2 of 4 slots: the usable nodes hold 2 slots; policy.min_slots is 2 "
                              "(after fault lost-n1)")
    job = b.state("scheduler").jobs["job-1"]
    assert job.phase == "running" and job.size == 2 and job.restarts == 1
    assert {r.node for r in b.last_grant("job-1").assignments} == {"n0"}
    (resumed,) = b.of(JobResumed, "job-1")
    assert resumed.world_size == 2


def test_without_min_slots_the_job_waits_for_its_whole_gang() -> None:
    b = Bus([scheduler(), resources()])
    agents = Agents(b)
    b.publish(register("n0", 2), register("n1", 2), submitted("job-1", min_slots=0))
    agents()
    b.publish(NodeLost(node="n1", reason="psu"))
    agents()
    assert [a.slots for a in b.of(AllocationRequested, "job-1")] == [4]
    assert b.state("scheduler").jobs["job-1"].phase == "recovering"


def test_the_shrunk_size_prefers_one_that_divides_the_global_batch() -> None:
    assert pick_world(2, 7, 8) == 4 and pick_world(3, 3, 8) == 3 and pick_world(5, 7, 8) == 7
    assert pick_world(2, 6, 12) == 6 and pick_world(1, 5, 7) == 1


def test_a_denied_full_gang_shrinks_at_once_and_a_denied_shrink_waits_for_capacity() -> None:
    refs = [SlotRef(node="a", slot=s, rank=s) for s in range(4)]
    lost = RankLost(job_id="job-1", rank=3, attempt=0, reason="heartbeats stopped", last_seen=1.0, event_id="f")
    state, outs = fold(scheduler(), [register("a", 4), submitted("job-1"),
                                     AllocationGranted(job_id="job-1", attempt=0, assignments=refs),
                                     WorkersStarted(job_id="job-1", node="a", attempt=0, ranks=[0, 1, 2, 3], pids=[1]),
                                     lost])
    assert decisions(outs)[-1] == AllocationRequested(job_id="job-1", slots=4, attempt=1, use_spares=True,
                                                      snapshot_bytes=snapshot_bytes(submitted("job-1").spec),
                                                      restore_chosen=True)
    state, outs = fold(scheduler(), [AllocationDenied(job_id="job-1", attempt=1, reason="tp groups")], state)
    queued, ask = decisions(outs)
    assert phases(outs) == [("job-1", "recovering", "allocation denied: tp groups")]
    assert queued == JobQueued(job_id="job-1", priority=50, reason="allocation denied: tp groups")
    assert (ask.slots, ask.attempt, ask.use_spares) == (2, 1, True)  # 3 fits, but 2 divides the batch of 8
    assert ask.reason.startswith("shrink to 2 of 4 slots: an allocation of 4 slots was denied at this capacity")
    state, outs = fold(scheduler(), [AllocationDenied(job_id="job-1", attempt=1, reason="still no")], state)
    assert [type(e).__name__ for e in decisions(outs)] == ["JobQueued"]  # nothing smaller is allowed: wait
    _, outs = fold(scheduler(), [register("b", 2)], state)
    assert [(e.slots, e.attempt) for e in decisions(outs)] == [(4, 1)]  # capacity changed: the whole gang first


def test_growing_back_waits_for_the_node_then_for_the_next_checkpoint() -> None:
    b, agents = shrunk()
    before = len(b.log)
    b.publish(commit("job-1", 50))
    assert decided(b, before) == []  # nowhere to grow to yet
    b.publish(register("n1", 2), NodeUncordoned(node="n1", reason="repaired"))
    agents()
    assert b.state("scheduler").jobs["job-1"].size == 2  # not before a checkpoint: that would lose work
    before = len(b.log)
    b.publish(commit("job-1", 75))
    (stop,) = decided(b, before)
    assert isinstance(stop, StopRequested) and not stop.checkpoint
    assert stop.reason == ("grow back to 4 slots from 2: the slots are free again; restore step000000075-a1 "
                           "(step 75)")
    agents()  # the ranks obey the stop and exit 0
    released = b.of(AllocationReleased, "job-1")[-1]
    assert released.attempt == 1 and released.reason.startswith("grow back to 4 slots")
    assert b.of(JobQueued, "job-1")[-1].reason == "grow back"
    ask = b.of(AllocationRequested, "job-1")[-1]
    assert (ask.slots, ask.attempt, ask.use_spares, ask.reason) == (4, 2, False, "grow back")
    job = b.state("scheduler").jobs["job-1"]
    assert job.phase == "running" and job.size == 4 and job.restarts == 1  # growing is no fault
    resumed = b.of(JobResumed, "job-1")[-1]
    assert (resumed.attempt, resumed.world_size, resumed.checkpoint_id) == (2, 4, "step000000075-a1")


def test_no_growing_into_slots_a_waiting_job_of_the_same_priority_could_use() -> None:
    b, agents = shrunk()
    b.publish(register("n1", 2), NodeUncordoned(node="n1"))
    agents()
    b.publish(submitted("other-1", slots=3, min_slots=0))
    assert b.state("scheduler").queue == ("other-1",)
    before = len(b.log)
    b.publish(commit("job-1", 50))
    assert decided(b, before) == []


def test_a_straggler_is_only_recorded_unless_the_policy_replaces_it() -> None:
    for replace in (False, True):
        b = Bus([scheduler(), resources()])
        agents = Agents(b)
        b.publish(register("n0", 2), register("spare", 2, spare=True), submitted("job-1", slots=2, replace=replace))
        agents()
        before, state = len(b.log), b.state("scheduler")
        b.publish(StragglerDetected(job_id="job-1", rank=1, attempt=0, step_time_s=0.9, peer_median_s=0.3,
                                    factor=3.0, event_id="slow"))
        agents()
        if not replace:
            assert decided(b, before) == [] and b.state("scheduler").jobs == state.jobs
            continue
        stop = b.of(StopRequested, "job-1")[0]
        assert stop.reason.startswith("rank 1 straggler replaced: steps take 0.9s against a peer median of 0.3s")
        ask = b.of(AllocationRequested, "job-1")[-1]
        assert (ask.attempt, ask.use_spares) == (1, True)
        assert b.state("scheduler").jobs["job-1"].faults == ("slow",)


def test_a_straggler_of_a_stopping_job_is_not_counted_as_gone() -> None:
    b = Bus([scheduler(), resources()])
    b.publish(register("n0", 2), submitted("job-1", slots=2, replace=True))
    b.start_workers(b.last_grant("job-1"))
    b.publish(CancelRequested(job_id="job-1"))
    b.publish(StragglerDetected(job_id="job-1", rank=1, attempt=0, step_time_s=0.9, peer_median_s=0.3, factor=3.0))
    job = b.state("scheduler").jobs["job-1"]
    assert job.phase == "stopping" and job.run.exited == frozenset()
