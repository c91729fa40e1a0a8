"""A node lost before it started the ranks granted to it costs the job no restart (issue 51, case 5): an agent that
died idle was granted a job's ranks, the job waited in `placing` until the health monitor found the agent never
started them, and the restart was charged to the job's budget, though the job ran nothing there. A node lost
while the job's ranks ran on it is still charged: the job was running there."""

from flightdeck.events.fleet import NodeLost
from flightdeck.events.job import AllocationReleased, JobFailed
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
