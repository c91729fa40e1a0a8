"""The allocation ledger: one holder per slot, idempotent releases, and no double booking through the
resources core under any sequence of requests, releases, cordons, node losses and re-registrations."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events.base import Event
from flightdeck.events.fleet import NodeCordoned, NodeLost, NodeRegistered, NodeUncordoned, SelfCheckFailed
from flightdeck.events.job import (
    AllocationDenied,
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    JobCancelled,
    JobCompleted,
    JobFailed,
    SlotRef,
)
from flightdeck.services.resources import ledger
from flightdeck.services.resources.core import State, core_service
from tests.unit.helpers import step


def refs(node: str, *slots: int) -> list[SlotRef]:
    return [SlotRef(node=node, slot=s, rank=i) for i, s in enumerate(slots)]


def test_book_then_release_frees_exactly_that_job() -> None:
    led = ledger.book(ledger.Ledger(), "a", 0, refs("n1", 0, 1))
    led = ledger.book(led, "b", 3, refs("n1", 2))
    assert ledger.free_slots(led, "n1", 4) == (3,)
    assert ledger.holder(led, "n1", 2) == "b"
    led = ledger.release(led, "a")
    assert ledger.free_slots(led, "n1", 4) == (0, 1, 3)
    assert ledger.release(led, "a") == led  # idempotent


def test_a_release_for_another_attempt_frees_nothing() -> None:
    led = ledger.book(ledger.Ledger(), "a", 2, refs("n1", 0))
    assert ledger.release(led, "a", attempt=1) == led
    assert ledger.release(led, "a", attempt=2) == ledger.Ledger()


def test_booking_a_held_slot_is_refused() -> None:
    led = ledger.book(ledger.Ledger(), "a", 0, refs("n1", 0))
    with pytest.raises(AssertionError, match="held by a"):
        ledger.book(led, "b", 0, refs("n1", 0))
    with pytest.raises(AssertionError, match="already holds"):
        ledger.book(led, "a", 1, refs("n1", 1))


NODES = ["n0", "n1", "n2", "n3"]
JOBS = ["j0", "j1", "j2", "j3", "j4"]

operations = st.one_of(
    st.builds(lambda n, s, sp: NodeRegistered(node=n, kind="gpu", slots=s, spare=sp, address=f"10.0.0.{n[1]}"),
              st.sampled_from(NODES), st.integers(0, 6), st.booleans()),
    st.builds(lambda n: NodeCordoned(node=n, reason="drain"), st.sampled_from(NODES)),
    st.builds(lambda n: NodeUncordoned(node=n), st.sampled_from(NODES)),
    st.builds(lambda n: SelfCheckFailed(node=n, reason="matmul mismatch"), st.sampled_from(NODES)),
    st.builds(lambda n: NodeLost(node=n, reason="no heartbeat"), st.sampled_from(NODES)),
    st.builds(lambda j, s, a, sp, tp: AllocationRequested(job_id=j, slots=s * tp, attempt=a, use_spares=sp, tp=tp),
              st.sampled_from(JOBS), st.integers(1, 5), st.integers(0, 3), st.booleans(), st.sampled_from([1, 2])),
    st.builds(lambda j, a: AllocationReleased(job_id=j, attempt=a), st.sampled_from(JOBS), st.integers(0, 3)),
    st.builds(lambda j, t: t(job_id=j), st.sampled_from(JOBS),
              st.sampled_from([lambda **k: JobCompleted(steps=1, **k), lambda **k: JobFailed(reason="x", **k),
                               lambda **k: JobCancelled(**k)])),
)


@settings(max_examples=400, deadline=None)
@given(ops=st.lists(operations, max_size=60))
def test_the_resources_core_never_double_books(ops: list[Event]) -> None:
    """A model of what is held, built only from the core's outputs and the release rules, must never see
    a slot held twice; each grant is a whole gang on usable nodes, its TP groups inside one node."""
    service = core_service()
    state: State = service.initial
    held: dict[str, tuple[int, list[SlotRef]]] = {}  # job -> (attempt, slots), from grants
    fleet: dict[str, NodeRegistered] = {}
    cordoned: set[str] = set()
    lost: set[str] = set()
    for op in ops:
        state, outs = step(service, state, op)
        match op:
            case NodeRegistered():
                fleet[op.node] = op
                lost.discard(op.node)
            case NodeCordoned() | SelfCheckFailed():
                cordoned.add(op.node)
            case NodeUncordoned():
                cordoned.discard(op.node)
            case NodeLost():
                lost.add(op.node)
                cordoned.add(op.node)
            case AllocationReleased() if op.job_id in held and held[op.job_id][0] == op.attempt:
                del held[op.job_id]
            case JobCompleted() | JobFailed() | JobCancelled():
                held.pop(op.job_id, None)
            case AllocationRequested():
                (answer,) = [o.event for o in outs]
                assert answer.attempt == op.attempt
                if op.job_id in held and held[op.job_id][0] < op.attempt:
                    del held[op.job_id]  # a job runs one attempt at a time: a newer one replaces the older
                if isinstance(answer, AllocationGranted):
                    if op.job_id not in held:
                        nodes = {r.node for r in answer.assignments}
                        for n in nodes:
                            assert n in fleet and n not in cordoned and n not in lost
                            assert op.use_spares or not fleet[n].spare
                        assert all(r.slot < fleet[r.node].slots for r in answer.assignments)
                        for g in range(op.slots // op.tp):
                            assert len({r.node for r in answer.assignments if r.rank // op.tp == g}) == 1
                        rank0 = next(r for r in answer.assignments if r.rank == 0)
                        assert answer.master_addr == fleet[rank0.node].address
                    held[op.job_id] = (op.attempt, list(answer.assignments))
                    assert sorted(r.rank for r in answer.assignments) == list(range(op.slots))
                else:
                    assert isinstance(answer, AllocationDenied) and answer.reason
        taken = [(r.node, r.slot) for _, rs in held.values() for r in rs]
        assert len(taken) == len(set(taken)), "a slot is held twice"
        assert {j: a.attempt for j, a in state.ledger.allocations.items()} == {j: a for j, (a, _) in held.items()}
        index = {(n, s): j for n, slots in state.ledger.taken.items() for s, j in slots.items()}
        assert index == {(r.node, r.slot): j for j, (_, rs) in held.items() for r in rs}
