"""Admission through the scheduler and resources cores together: priority, FIFO, gang, no backfill."""

from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    JobCompleted,
    JobPreempted,
    JobQueued,
    JobSubmitted,
)
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from tests.unit.helpers import Agents, Bus, register, submit


def bus(*nodes: tuple[str, int]) -> tuple[Bus, Agents]:
    b = Bus([scheduler(), resources()])
    b.publish(*(register(n, s) for n, s in nodes))
    return b, Agents(b)


def requested(b: Bus) -> list[str]:
    return [e.job_id for e in b.of(AllocationRequested)]


def test_higher_priority_first_then_first_come_first_served() -> None:
    b, agents = bus(("a", 2))
    b.publish(submit("first-1", slots=2, priority=50))
    agents()
    b.publish(submit("low-1", slots=2, priority=10), submit("mid-1", slots=2, priority=50),
              submit("mid-2", slots=2, priority=50), submit("top-1", slots=2, priority=90))
    agents()  # top-1 preempts first-1 (50 < 90), which goes back to the queue in its old place
    while agents.running:
        agents.finish(sorted(agents.running)[0])
        agents()
    assert requested(b) == ["first-1", "top-1", "first-1", "mid-1", "mid-2", "low-1"]
    assert [e.job_id for e in b.of(JobCompleted)] == ["top-1", "first-1", "mid-1", "mid-2", "low-1"]


def test_no_backfill_a_small_job_waits_behind_a_blocked_head() -> None:
    b, agents = bus(("a", 4))
    b.publish(submit("big-1", slots=3, priority=90))
    agents()
    b.publish(submit("wide-1", slots=2, priority=80), submit("tiny-1", slots=1, priority=10))
    assert requested(b) == ["big-1"]  # tiny-1 fits the free slot, but would jump wide-1
    agents.finish("big-1")
    agents()
    assert requested(b) == ["big-1", "wide-1", "tiny-1"]


def test_a_job_larger_than_the_fleet_does_not_block_the_queue() -> None:
    b, agents = bus(("a", 2))
    b.publish(submit("huge-1", slots=3, priority=90), submit("ok-1", slots=2, priority=10))
    agents()
    assert requested(b) == ["ok-1"]
    b.publish(register("b", 2))
    agents()  # now huge-1 can fit: it preempts ok-1 and takes the slots
    assert requested(b) == ["ok-1", "huge-1"]
    assert b.of(JobPreempted)[0].by_job_id == "huge-1"


@st.composite
def workloads(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    return draw(st.lists(st.one_of(
        st.tuples(st.just("submit"), st.integers(0, 3), st.integers(1, 4)),
        st.tuples(st.just("finish"), st.integers(0, 7), st.just(0)),
    ), max_size=25))


@settings(max_examples=120, deadline=None)
@given(actions=workloads())
def test_admission_follows_priority_then_submission_order_and_gangs(actions: list[tuple[str, int, int]]) -> None:
    """Every AllocationRequested goes to the best waiting job (highest priority, then earliest submitted),
    asks for all of its slots, and the grant holds exactly that many; capacity is never oversubscribed."""
    b, agents = bus(("a", 2), ("b", 2))
    jobs: list[str] = []
    for kind, x, y in actions:
        if kind == "submit":
            job = f"j{len(jobs)}-1"
            jobs.append(job)
            b.publish(submit(job, slots=y, priority=x * 10))
        elif agents.running:
            agents.finish(sorted(agents.running)[x % len(agents.running)])
        agents()
    key = {e.job_id: (-e.spec.priority, i) for i, e in enumerate(b.of(JobSubmitted))}
    slots = {e.job_id: e.spec.slots for e in b.of(JobSubmitted)}
    waiting: set[str] = set()
    holding: dict[str, int] = {}
    for ev in b.log:
        if isinstance(ev, JobQueued):
            waiting.add(ev.job_id)
        elif isinstance(ev, AllocationRequested):
            assert ev.job_id == min(waiting, key=key.__getitem__), "a job passed a better one"
            assert ev.slots == slots[ev.job_id]
            waiting.discard(ev.job_id)
        elif isinstance(ev, AllocationGranted):
            assert len(ev.assignments) == slots[ev.job_id]
            holding[ev.job_id] = len(ev.assignments)
            assert sum(holding.values()) <= 4
        elif isinstance(ev, AllocationReleased | JobCompleted):
            holding.pop(ev.job_id, None)
