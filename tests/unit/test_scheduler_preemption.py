"""Preemption: the documented victim rule (policy.choose_victims) and the stop / release / re-queue / resume
choreography through the scheduler and resources cores."""

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events.checkpoint import CheckpointCommitted, DataPosition
from flightdeck.events.commands import StopRequested
from flightdeck.events.job import AllocationRequested, JobPreempted, JobQueued, JobResumed
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from flightdeck.services.scheduler.policy import Victim, choose_victims
from tests.unit.helpers import Agents, Bus, register, submit


def v(job: str, priority: int, slots: int, lost: float = 0.0, order: int = 0) -> Victim:
    return Victim(job_id=job, priority=priority, work_lost_s=lost, slots=slots, order=order)


def test_lowest_priority_goes_first() -> None:
    assert choose_victims([v("a", 30, 2), v("b", 10, 2), v("c", 20, 2)], 2, priority=50) == ("b",)


def test_within_a_priority_the_least_work_lost_then_the_fewest_slots() -> None:
    cands = [v("a", 10, 2, lost=50.0), v("b", 10, 2, lost=5.0), v("c", 10, 1, lost=5.0)]
    assert choose_victims(cands, 1, priority=50) == ("c",)
    assert choose_victims(cands, 2, priority=50) == ("b",)  # c alone is not enough, then c is not needed


def test_victims_that_are_not_needed_are_given_back_most_costly_first() -> None:
    assert choose_victims([v("small", 10, 1), v("big", 20, 4)], 4, priority=50) == ("big",)
    # a, b, c are taken (6 slots for 4); giving back b first keeps the cheaper a, not b
    assert choose_victims([v("a", 10, 1), v("b", 20, 2), v("c", 30, 3)], 4, priority=50) == ("a", "c")


def test_equal_or_higher_priority_is_never_preempted() -> None:
    assert choose_victims([v("eq", 50, 8), v("hi", 60, 8)], 1, priority=50) == ()
    assert choose_victims([v("lo", 10, 1), v("eq", 50, 8)], 2, priority=50) == ()  # 1 slot is not 2


victims = st.lists(st.builds(v, st.text("abcdefgh", min_size=1, max_size=3), st.integers(0, 5),
                             st.integers(0, 4), st.floats(0, 100), st.integers(0, 20)),
                   max_size=7, unique_by=lambda x: x.job_id)


@settings(max_examples=400, deadline=None)
@given(cands=victims, need=st.integers(1, 12), priority=st.integers(0, 6))
def test_the_victim_set_is_lower_priority_sufficient_minimal_and_from_the_lowest_level(
        cands: list[Victim], need: int, priority: int) -> None:
    chosen = choose_victims(cands, need, priority)
    by_id = {c.job_id: c for c in cands}
    eligible = [c for c in cands if c.priority < priority]
    if sum(c.slots for c in eligible) < need:
        assert chosen == ()
        return
    picked = [by_id[j] for j in chosen]
    assert all(c.priority < priority for c in picked)
    freed = sum(c.slots for c in picked)
    assert freed >= need
    assert all(freed - c.slots < need for c in picked), "a victim that was not needed"
    # the highest priority touched is the lowest level whose jobs (with all below it) can cover the need
    level = min(p for p in {c.priority for c in eligible} if sum(c.slots for c in eligible if c.priority <= p) >= need)
    assert max(c.priority for c in picked) == level
    # and no set of the same size drawn only from strictly lower levels would do
    lower = [c for c in eligible if c.priority < level]
    assert all(sum(c.slots for c in s) < need for k in range(1, len(lower) + 1) for s in combinations(lower, k))


def cluster() -> tuple[Bus, Agents]:
    b = Bus([scheduler(), resources()])
    b.publish(register("a", 4))
    return b, Agents(b)


def test_a_preempted_job_stops_with_a_checkpoint_requeues_and_resumes_from_it() -> None:
    b, agents = cluster()
    b.publish(submit("old-1", slots=2, priority=10), submit("peer-1", slots=2, priority=50))
    agents()
    b.publish(CheckpointCommitted(job_id="old-1", checkpoint_id="old-1-s40", step=40, world_size=2, uri="u",
                                  bytes=1, data=DataPosition(next_batch=40)))
    b.publish(submit("urgent-1", slots=2, priority=50))  # peer-1 has equal priority: never a victim
    assert [(s.job_id, s.checkpoint, s.reason) for s in b.of(StopRequested)] == [
        ("old-1", True, "preempted by urgent-1")]
    assert [(p.job_id, p.by_job_id) for p in b.of(JobPreempted)] == [("old-1", "urgent-1")]
    assert [e.job_id for e in b.of(AllocationRequested)] == ["old-1", "peer-1"]  # nothing until old-1 is out
    agents()  # old-1's ranks checkpoint and exit 0
    assert [q.reason for q in b.of(JobQueued, "old-1")] == ["submitted", "preempted"]
    assert [(e.job_id, e.attempt) for e in b.of(AllocationRequested)][-1] == ("urgent-1", 0)
    agents()
    agents.finish("urgent-1")
    agents()
    assert [(e.job_id, e.attempt) for e in b.of(AllocationRequested)][-1] == ("old-1", 1)
    (resumed,) = b.of(JobResumed, "old-1")
    assert (resumed.attempt, resumed.from_step, resumed.checkpoint_id, resumed.world_size) == (1, 40, "old-1-s40", 2)


def test_stops_in_flight_count_so_no_extra_victims_are_taken() -> None:
    b, agents = cluster()
    b.publish(submit("x-1", slots=2, priority=10), submit("y-1", slots=2, priority=20))
    agents()
    b.publish(submit("z-1", slots=2, priority=90), submit("w-1", slots=1, priority=5))
    b.publish(CheckpointCommitted(job_id="y-1", checkpoint_id="c", step=1, world_size=2, uri="u", bytes=1,
                                  data=DataPosition(next_batch=1)))
    assert [p.job_id for p in b.of(JobPreempted)] == ["x-1"]


def test_least_work_lost_is_preferred_at_equal_priority() -> None:
    b, agents = cluster()
    b.publish(submit("p-1", slots=2, priority=10), submit("q-1", slots=2, priority=10))
    agents()
    b.publish(CheckpointCommitted(job_id="q-1", checkpoint_id="c", step=5, world_size=2, uri="u", bytes=1,
                                  data=DataPosition(next_batch=5)))
    b.publish(submit("r-1", slots=2, priority=90))
    assert [p.job_id for p in b.of(JobPreempted)] == ["q-1"]  # q-1 saved its work more recently
