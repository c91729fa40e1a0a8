"""Recovery: a fault restarts the job on fresh slots (spares allowed) until policy.max_restarts restarts
are spent; the next fault fails it with the chain of fault events as causes."""

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events import spec as spec_mod
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, DataPosition
from flightdeck.events.commands import StopRequested
from flightdeck.events.findings import RankHung, RankLost
from flightdeck.events.fleet import NodeLost
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    JobFailed,
    JobResumed,
    WorkersExited,
)
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from tests.unit.helpers import Agents, Bus, register, submit

KINDS = ("exit", "signal", "lost", "hung", "node")


def cluster(nodes: int = 6) -> tuple[Bus, Agents]:
    b = Bus([scheduler(memory_wait=False), resources()])
    b.publish(*(register(f"n{i}", 2) for i in range(nodes)), register("spare", 2, spare=True))
    return b, Agents(b)


def fault(kind: str, grant: AllocationGranted, event_id: str) -> Event:
    job, attempt = grant.job_id, grant.attempt
    rank0 = next(r for r in grant.assignments if r.rank == 0)
    match kind:
        case "exit" | "signal":
            return WorkersExited(job_id=job, node=rank0.node, attempt=attempt, rank=0,
                                 exit_code=1 if kind == "exit" else -9, event_id=event_id)
        case "lost":
            return RankLost(job_id=job, rank=1, attempt=attempt, reason="heartbeats stopped", last_seen=1.0,
                            event_id=event_id)
        case "hung":
            return RankHung(job_id=job, rank=1, attempt=attempt, step=7, stalled_s=60.0, deadline_s=30.0,
                            event_id=event_id)
    return NodeLost(node=rank0.node, reason="power", event_id=event_id)


@settings(max_examples=60, deadline=None)
@given(budget=st.integers(0, 4), kinds=st.lists(st.sampled_from(KINDS), min_size=5, max_size=5))
def test_exactly_max_restarts_restarts_then_failed_with_the_cause_chain(budget: int, kinds: list[str]) -> None:
    b, agents = cluster()
    b.publish(submit("job-1", slots=2, max_restarts=budget))
    agents()
    causes = []
    for n in range(budget + 1):
        grant = b.last_grant("job-1")
        assert grant.attempt == n
        causes.append(f"fault-{n}")
        before = len(b.log)
        b.publish(fault(kinds[n], grant, causes[-1]))
        decided = [e for e in b.log[before:] if e.producer == "scheduler"]
        released = [e for e in decided if isinstance(e, AllocationReleased)]
        assert [r.attempt for r in released] == [n]
        stops = [e for e in decided if isinstance(e, StopRequested)]
        assert all(not s.checkpoint for s in stops)
        assert len(stops) == (0 if kinds[n] == "node" else 1)  # a node lost with both ranks leaves no survivor
        if stops:
            assert decided.index(stops[0]) < decided.index(released[0])  # survivors are told before the release
        agents()
    (failed,) = b.of(JobFailed)
    assert failed.causes == causes
    assert f"restart budget of {budget} spent" in failed.reason
    requests = b.of(AllocationRequested, "job-1")
    assert [r.attempt for r in requests] == list(range(budget + 1))
    assert [r.use_spares for r in requests] == [False] + [True] * budget
    assert [r.attempt for r in b.of(JobResumed)] == list(range(1, budget + 1))
    assert b.state("scheduler").ended == {"job-1": "failed"}
    assert b.state("resources").ledger.allocations == {}


def test_a_second_symptom_of_the_same_fault_is_not_a_second_fault() -> None:
    b, agents = cluster()
    b.publish(submit("job-1", slots=2, max_restarts=1))
    agents()
    grant = b.last_grant("job-1")
    b.publish(fault("exit", grant, "first"), fault("lost", grant, "echo"), fault("hung", grant, "again"))
    agents()
    assert b.state("scheduler").jobs["job-1"].restarts == 1
    assert b.state("scheduler").jobs["job-1"].faults == ("first",)
    assert b.state("scheduler").jobs["job-1"].phase == "running"


def test_a_lost_node_restarts_only_its_jobs_and_the_replacement_may_take_a_spare() -> None:
    b, agents = cluster(nodes=2)
    b.publish(submit("a-1", slots=2), submit("b-1", slots=2))
    agents()
    node_of_a = b.last_grant("a-1").assignments[0].node
    b.publish(NodeLost(node=node_of_a, reason="psu"))
    agents()
    assert b.state("scheduler").jobs["b-1"].restarts == 0
    regrant = b.last_grant("a-1")
    assert regrant.attempt == 1 and {r.node for r in regrant.assignments} == {"spare"}
    assert b.state("scheduler").jobs["a-1"].phase == "running"
    assert b.state("scheduler").nodes[node_of_a].lost


def test_without_a_spare_the_restart_waits_for_capacity() -> None:
    b = Bus([scheduler(memory_wait=False), resources()])
    b.publish(register("n0", 2), register("n1", 2))
    agents = Agents(b)
    b.publish(submit("a-1", slots=2))
    agents()
    b.publish(NodeLost(node=b.last_grant("a-1").assignments[0].node, reason="psu"))
    agents()
    job = b.state("scheduler").jobs["a-1"]
    assert job.phase == "running" and job.attempt == 1  # the other node took it
    b.publish(NodeLost(node=b.last_grant("a-1").assignments[0].node, reason="psu"))
    job = b.state("scheduler").jobs["a-1"]
    assert job.phase == "recovering" and b.state("scheduler").queue == ("a-1",)
    b.publish(register("n2", 2))
    agents()
    assert b.state("scheduler").jobs["a-1"].phase == "running"
    assert b.last_grant("a-1").assignments[0].node == "n2"


def test_reasons_say_what_happened() -> None:
    b, agents = cluster()
    b.publish(submit("job-1", slots=2, max_restarts=0))
    agents()
    b.publish(fault("hung", b.last_grant("job-1"), "h"))
    (failed,) = b.of(JobFailed)
    assert failed.reason == ("rank 1 hung at step 7: no progress for 60s (deadline 30s); restart budget of 0 spent")
    assert failed.causes == ["h"]


def test_a_request_says_how_large_a_ranks_snapshot_is_by_the_spec_then_by_the_newest_checkpoint() -> None:
    """The resource manager accounts snapshot memory by what the scheduler asks with: the built-in trainer's state
    as its spec gives it until a checkpoint records what one rank staged, then that."""
    b, agents = cluster()
    sub = submit("job-1", slots=2)
    b.publish(sub)
    agents()
    (first,) = b.of(AllocationRequested, "job-1")
    assert first.snapshot_bytes == spec_mod.snapshot_bytes(sub.spec) > 0
    b.publish(CheckpointCommitted(job_id="job-1", checkpoint_id="step-10-a0", step=10, world_size=2, uri="file:///x",
                                  bytes=9000, data=DataPosition(next_batch=10), rank_bytes=7000))
    b.publish(fault("exit", b.last_grant("job-1"), "fault-0"))
    agents()
    assert [r.snapshot_bytes for r in b.of(AllocationRequested, "job-1")] == [first.snapshot_bytes, 7000]
    off = msgspec.structs.replace(sub.spec, train=msgspec.structs.replace(sub.spec.train, snapshot_every=0))
    assert spec_mod.snapshot_bytes(off) == 0
