"""A restart a node's agent caused costs the job no restart (issue 51, cases 4 and 5): an agent that died idle was
granted a job's ranks, the job waited in `placing` until the health monitor found the agent never started them,
and the restart was charged to the job's budget, though the job ran nothing there; an agent SIGKILLed while it
shipped a checkpoint took its ranks with it, and that restart was charged too. A node lost while the job's ranks
ran on it, and a rank killed by itself, are still charged: the job was running there."""

from flightdeck.events.fleet import NodeLost
from flightdeck.events.job import AllocationReleased, JobFailed, RankExit, exits_record
from flightdeck.services.resources.core import core_service as resources_core
from flightdeck.services.scheduler.core import core_service as scheduler_core
from tests.unit.helpers import Bus, register, submit

JOB = "llm-000001"


def platform() -> Bus:
    bus = Bus([scheduler_core(memory_wait=False), resources_core()])
    bus.publish(register("n1", 2), register("n2", 2), register("n3", 2), submit(JOB, slots=2, max_restarts=1))
    return bus


def test_a_node_lost_before_it_started_the_ranks_is_not_charged() -> None:
    bus = platform()
    for n in range(3):  # more losses than the budget: none of them the job's doing
        grant = bus.last_grant(JOB)
        (node,) = {r.node for r in grant.assignments}
        bus.publish(NodeLost(node=node, reason="its agent never started the ranks granted to it"))
        (released,) = [e for e in bus.of(AllocationReleased, JOB) if e.attempt == grant.attempt]
        assert "lost before it started ranks [0, 1]" in released.reason, released.reason
        assert "not counted against the restart budget" in released.reason
        if n < 2:
            assert bus.last_grant(JOB).attempt == grant.attempt + 1
    assert bus.state("scheduler").jobs[JOB].restarts == 0 and not bus.of(JobFailed, JOB)


def test_a_node_lost_while_the_ranks_ran_there_is_charged() -> None:
    bus = platform()
    grant = bus.last_grant(JOB)
    bus.start_workers(grant)
    (node,) = {r.node for r in grant.assignments}
    bus.publish(NodeLost(node=node, reason="its agent has sent no heartbeat batch for 5s"))
    (released,) = [e for e in bus.of(AllocationReleased, JOB) if e.attempt == grant.attempt]
    assert "restart 1 of 1" in released.reason, released.reason
    assert bus.state("scheduler").jobs[JOB].restarts == 1


def test_ranks_that_died_with_their_agent_are_not_charged() -> None:
    """The next agent on the node records them `orphaned` (services/agent/main.py reconcile)."""
    bus = platform()
    for _ in range(3):
        grant = bus.last_grant(JOB)
        bus.start_workers(grant)
        (node,) = {r.node for r in grant.assignments}
        exits = [RankExit(rank=r.rank, exit_code=-9, orphaned=True) for r in grant.assignments]
        bus.publish(exits_record(exits, job_id=JOB, node=node, attempt=grant.attempt, event_id="", occurred_at=0.0))
        (released,) = [e for e in bus.of(AllocationReleased, JOB) if e.attempt == grant.attempt]
        assert "died with their node agent" in released.reason and "not counted against" in released.reason
    assert bus.state("scheduler").jobs[JOB].restarts == 0 and not bus.of(JobFailed, JOB)
    grant = bus.last_grant(JOB)
    bus.start_workers(grant)
    bus.exit_workers(grant, code=-9, ranks=[0])  # killed by itself, its agent alive: the job's, charged
    assert bus.state("scheduler").jobs[JOB].restarts == 1
