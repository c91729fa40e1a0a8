"""Random traffic through the scheduler and resources cores: whatever happens, the two agree on who holds
which slots, the queue holds exactly the waiting jobs in order, and every decision is recorded once."""

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events import subjects
from flightdeck.events.codec import encode
from flightdeck.events.fleet import NodeLost
from flightdeck.events.job import AllocationRequested, JobCancelled, JobCompleted, JobFailed, JobSubmitted
from flightdeck.events.store import decoded
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from flightdeck.services.scheduler.state import WAITING, State
from flightdeck.services.scheduler.tx import queue_key
from flightdeck.services.shell.fold import Folder, comparable
from tests.unit.helpers import Agents, Bus, Fleet, register, subject_of, submit

ACTIONS = st.lists(st.tuples(st.sampled_from(["submit", "submit", "finish", "crash", "cancel", "lose", "add",
                                              "uncordon", "tick"]),
                             st.integers(0, 9), st.integers(1, 4)), max_size=30)


def check(state: State, b: Bus) -> None:
    waiting = [j for j in state.jobs.values() if not j.run.requested and not j.run.assignments]
    assert sorted(state.queue) == sorted(j.job_id for j in waiting)
    assert list(state.queue) == sorted(state.queue, key=lambda j: queue_key(state.jobs[j]))
    assert all(state.jobs[j].phase in WAITING for j in state.queue)
    assert not set(state.jobs) & set(state.ended)
    ledger = b.state("resources").ledger.allocations
    held = {j.job_id: (j.attempt, sorted((r.node, r.slot) for r in j.run.assignments))
            for j in state.jobs.values() if j.run.assignments}
    assert held == {j: (a.attempt, sorted((r.node, r.slot) for r in a.assignments)) for j, a in ledger.items()}
    slots = [(r.node, r.slot) for j in state.jobs.values() for r in j.run.assignments]
    assert len(slots) == len(set(slots))


@settings(max_examples=150, deadline=None)
@given(actions=ACTIONS)
def test_scheduler_and_resources_agree_under_random_traffic(actions: list[tuple[str, int, int]]) -> None:
    b = Bus([scheduler(stop_timeout_s=5.0, memory_wait=False), resources()])
    agents = Agents(b)
    b.publish(register("n0", 2), register("n1", 2), register("spare", 2, spare=True))
    fleet = Fleet(b, agents, nodes=3)
    for kind, x, y in actions:
        if kind == "submit":
            b.publish(submit(f"j{len(b.of(JobSubmitted))}-1", slots=y, priority=x * 10, max_restarts=x % 3))
        else:
            fleet.act(kind, x, y)
        agents()
        check(b.state("scheduler"), b)
    # Then plenty of room and well-behaved ranks: every job must get to an end (no job is stuck).
    b.publish(register("big", 8))
    for _ in range(4 * len(b.of(JobSubmitted)) + 1):
        if agents.running:
            agents.finish(sorted(agents.running)[0])
        agents()
    assert b.state("scheduler").jobs == {}
    ends = [e.job_id for e in b.log if isinstance(e, JobCompleted | JobFailed | JobCancelled)]
    assert len(ends) == len(set(ends)), "a job ended twice"
    asks = [(e.job_id, e.attempt) for e in b.of(AllocationRequested)]
    assert len(asks) - len(set(asks)) <= sum(1 for e in b.log if type(e).__name__ == "AllocationDenied")


def test_states_survive_a_snapshot_round_trip() -> None:
    """A state is all data: it survives msgpack unchanged."""
    b = Bus([scheduler(memory_wait=False), resources()])
    agents = Agents(b)
    b.publish(register("n0", 4), submit("a-1", slots=2), submit("b-1", slots=4, priority=90))
    agents()
    for state in b.states:
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=type(state)) == state


def test_the_shell_s_fold_replays_the_same_decisions() -> None:
    """Feed the recorded log, encoded and decoded as on the wire, through flightdeck.services.shell.fold.Folder: the
    subject grammar holds for every output and each service decides again exactly what it decided."""
    b = Bus([scheduler(memory_wait=False), resources()])
    agents = Agents(b)
    b.publish(register("n0", 2), register("n1", 2), submit("a-1", slots=2, priority=10), submit("b-1", slots=2))
    agents()
    b.publish(submit("c-1", slots=4, priority=90), NodeLost(node="n1", reason="psu"))
    agents()
    for index, service in enumerate(b.services):
        folder = Folder(service)
        filters = (*service.control_subjects, folder.clock_subject)
        replayed, recorded = [], []
        for seq, ev in enumerate(b.log, start=1):
            subject = subject_of(ev)
            if not any(subjects.matches(f, subject) for f in filters):
                continue
            stored = decoded(subjects.CONTROL, seq, subject, encode(ev), ev.event_id)
            for done in folder.apply(stored):
                assert done.error == "", done.error
                replayed.extend(comparable(o.event) for o in done.outputs)
            recorded.extend(comparable(e) for e in b.log
                            if e.producer == service.name and e.causation_id == ev.event_id)
        assert replayed and len(replayed) == len(recorded)
        for mine, theirs in zip(replayed, recorded, strict=True):
            mine.pop("event_id"), theirs.pop("event_id")  # the Bus numbers messages its own way
            assert mine == theirs
        assert folder.state == b.states[index]
