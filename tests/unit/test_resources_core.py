"""The resources core, input by input: grants, denials, cordons, releases and MASTER_PORT."""

import zlib

from flightdeck.events.fleet import (
    NodeCordoned,
    NodeLost,
    NodeRegistered,
    NodeUncordoned,
    SelfCheckFailed,
    SelfCheckPassed,
)
from flightdeck.events.job import (
    AllocationDenied,
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    JobCompleted,
)
from flightdeck.services.resources import core as rcore
from flightdeck.services.resources import ledger
from flightdeck.services.resources.core import Settings, State, core_service, master_port
from tests.unit.helpers import events_of, fold, step

SVC = core_service()


def fleet(*nodes: tuple[str, int]) -> State:
    state, outs = fold(SVC, [NodeRegistered(node=n, kind="gpu", slots=s, address=f"10.0.0.{i}")
                             for i, (n, s) in enumerate(nodes)])
    assert outs == []
    return state


def ask(state: State, job: str, slots: int, attempt: int = 0, **kw: object) -> tuple[State, object]:
    state, outs = step(SVC, state, AllocationRequested(job_id=job, slots=slots, attempt=attempt, **kw))
    (answer,) = events_of(outs)
    return state, answer


def test_a_grant_names_rank_zero_s_node_and_a_port_derived_from_job_and_attempt() -> None:
    _, grant = ask(fleet(("a", 2), ("b", 4)), "job-1", 3)
    assert isinstance(grant, AllocationGranted)
    assert [(r.node, r.slot, r.rank) for r in grant.assignments] == [("b", 0, 0), ("b", 1, 1), ("b", 2, 2)]
    assert grant.master_addr == "10.0.0.1"
    assert grant.master_port == 29500 + zlib.crc32(b"job-1:0") % 1000
    assert master_port("job-1", 1, Settings(base=40000, span=10)) in range(40000, 40010)
    assert master_port("job-1", 0, Settings()) == grant.master_port  # stable: no per-process salt


def test_a_denial_says_why_and_books_nothing() -> None:
    state, answer = ask(fleet(("a", 2)), "big", 3)
    assert isinstance(answer, AllocationDenied) and "1 nodes" in answer.reason
    assert state.ledger.allocations == {}


def test_cordoned_and_lost_nodes_take_no_new_work_until_uncordoned() -> None:
    state = fleet(("a", 2), ("b", 2))
    state, outs = fold(SVC, [NodeCordoned(node="a", reason="drain")], state)
    state, grant = ask(state, "j", 2)
    assert isinstance(grant, AllocationGranted) and {r.node for r in grant.assignments} == {"b"}
    state, outs = fold(SVC, [NodeLost(node="b", reason="gone")], state)
    assert events_of(outs) == [NodeCordoned(node="b", reason="lost: gone")]
    assert state.ledger.allocations["j"].attempt == 0  # its slots stay booked until released
    state, _ = fold(SVC, [NodeRegistered(node="b", kind="gpu", slots=2)], state)
    assert state.nodes["b"].cordoned and not state.nodes["b"].lost  # back, but cordoned until someone says so
    state, answer = ask(state, "k", 1)
    assert isinstance(answer, AllocationDenied)
    state, _ = fold(SVC, [NodeUncordoned(node="a")], state)
    state, answer = ask(state, "k", 1)
    assert isinstance(answer, AllocationGranted) and answer.assignments[0].node == "a"


def test_a_failed_self_check_is_recorded_as_a_cordon_once() -> None:
    state, outs = fold(SVC, [SelfCheckFailed(node="a", reason="nan in matmul")], fleet(("a", 1)))
    assert events_of(outs) == [NodeCordoned(node="a", reason="self-check failed: nan in matmul")]
    state, outs = fold(SVC, [SelfCheckFailed(node="a", reason="again"), NodeLost(node="a", reason="x")], state)
    assert outs == []
    state, outs = fold(SVC, [NodeCordoned(node="a", reason="self-check failed: nan in matmul")], state)
    assert outs == [] and state.nodes["a"].lost  # reading its own cordon back changes nothing


def test_releases_free_only_the_attempt_that_holds_and_job_ends_free_everything() -> None:
    state, _ = ask(fleet(("a", 2)), "j", 2, attempt=1)
    state, _ = fold(SVC, [AllocationReleased(job_id="j", attempt=0)], state)
    assert "j" in state.ledger.allocations
    state, _ = fold(SVC, [AllocationReleased(job_id="j", attempt=1), AllocationReleased(job_id="j", attempt=1)], state)
    assert state.ledger.allocations == {} and state.ledger.taken == {}
    state, _ = ask(state, "j", 2, attempt=2)
    state, _ = fold(SVC, [JobCompleted(job_id="j", steps=5)], state)
    assert state.ledger.allocations == {}


def test_asking_again_gets_the_same_answer_and_a_newer_attempt_replaces_the_old() -> None:
    state, first = ask(fleet(("a", 4)), "j", 2)
    state, again = ask(state, "j", 2)
    assert again == first
    state, newer = ask(state, "j", 4, attempt=1)
    assert isinstance(newer, AllocationGranted) and len(newer.assignments) == 4
    assert newer.master_port == master_port("j", 1, Settings())
    state, stale = ask(state, "j", 2, attempt=0)
    assert isinstance(stale, AllocationDenied) and "stale" in stale.reason


def test_spares_serve_only_requests_that_allow_them() -> None:
    state, _ = fold(SVC, [NodeRegistered(node="a", kind="gpu", slots=1),
                          NodeRegistered(node="s", kind="gpu", slots=2, spare=True)])
    state, answer = ask(state, "j", 2)
    assert isinstance(answer, AllocationDenied)
    state, answer = ask(state, "j", 2, attempt=1, use_spares=True)
    assert isinstance(answer, AllocationGranted) and {r.node for r in answer.assignments} == {"s"}


def test_tp_groups_are_honoured_from_the_request() -> None:
    _, answer = ask(fleet(("a", 3), ("b", 3)), "j", 4, tp=2)
    assert isinstance(answer, AllocationGranted)
    _, answer = ask(fleet(("a", 3), ("b", 3)), "j", 6, tp=2)
    assert isinstance(answer, AllocationDenied)


def test_the_service_reads_what_it_needs_and_never_ticks() -> None:
    assert "fd.ctl.job.*.AllocationRequested" in SVC.control_subjects
    assert "fd.ctl.node.*.NodeLost" in SVC.control_subjects
    assert SVC.name == "resources" and not SVC.wants_tick(SVC.initial, 0.0)
    state, answer = ask(fleet(("a", 1)), "j", 1)
    state, outs = fold(SVC, [answer], state)  # its own grant read back
    assert outs == []


def test_two_live_jobs_with_rank_zero_on_one_node_never_share_a_port() -> None:
    """Ports hash into a small range here, so the jobs' own places collide: the later grant takes the next free
    port, a released job's port is free again, and with the whole range held the job keeps its own place."""
    svc = core_service(ports=Settings(base=40000, span=2))
    state, _ = fold(svc, [NodeRegistered(node="a", kind="gpu", slots=4, address="10.0.0.1")])
    granted: dict[str, int] = {}
    for job in ("j1", "j2", "j3"):
        state, outs = step(svc, state, AllocationRequested(job_id=job, slots=1, attempt=0))
        (grant,) = events_of(outs, AllocationGranted)
        granted[job] = grant.master_port
    assert {granted["j1"], granted["j2"]} == {40000, 40001}  # whatever their own places: never the same
    assert granted["j3"] == master_port("j3", 0, Settings(base=40000, span=2))  # the range is full
    state, _ = step(svc, state, AllocationReleased(job_id="j1", attempt=0, reason="done"))
    state, outs = step(svc, state, AllocationRequested(job_id="j1", slots=1, attempt=1))
    (again,) = events_of(outs, AllocationGranted)
    assert again.master_port != granted["j2"]
    state, outs = step(svc, state, AllocationRequested(job_id="j1", slots=1, attempt=1))  # asked again
    assert events_of(outs, AllocationGranted)[0].master_port == again.master_port


def test_a_lost_node_that_registers_again_and_passes_its_self_check_is_uncordoned_an_operators_cordon_stays() -> None:
    state = rcore.State()
    for ev in (NodeRegistered(node="n1", kind="cpu", slots=2), NodeRegistered(node="n2", kind="cpu", slots=2)):
        state, _ = rcore.transition(state, ev)
    state, outs = rcore.transition(state, NodeLost(node="n1", reason="its agent fell silent"))
    assert [type(o.event).__name__ for o in outs] == ["NodeCordoned"]
    state, _ = rcore.transition(state, NodeCordoned(node="n2", reason="maintenance", producer="cli"))
    state, outs = rcore.transition(state, NodeLost(node="n2", reason="its agent fell silent"))
    assert outs == ()  # already cordoned by the operator: that cordon is the one kept
    for node in ("n1", "n2"):
        state, _ = rcore.transition(state, NodeRegistered(node=node, kind="cpu", slots=2))
        state, outs = rcore.transition(state, SelfCheckPassed(node=node, seconds=1.0))
        if node == "n1":
            [emit] = outs
            assert isinstance(emit.event, NodeUncordoned) and emit.subject == "fd.ctl.node.n1.NodeUncordoned"
            assert emit.event.reason == ("registered again after it was lost: its agent fell silent; "
                                         "its self-check passed")
        else:
            assert outs == ()
    assert not state.nodes["n1"].cordoned and not state.nodes["n1"].lost
    assert state.nodes["n2"].cordoned and state.nodes["n2"].cordon_reason == "maintenance"
    _, again = rcore.transition(state, SelfCheckPassed(node="n1", seconds=1.0))
    assert again == ()  # nothing to lift twice


GIB = 2**30


def test_snapshot_memory_is_accounted_at_grant_time_and_a_node_without_room_runs_its_ranks_without() -> None:
    """Each rank takes two snapshots and a margin of its node's snapshot memory (events/snapshot.rank_need); a grant
    that would overfill a node says so for that node, and its ranks take none. Released allocations give it back."""
    state, _ = fold(SVC, [NodeRegistered(node="a", kind="cpu", slots=4, snapshot_bytes=10 * GIB),
                          NodeRegistered(node="b", kind="cpu", slots=4, snapshot_bytes=-1)])
    need = 2 * 1 * GIB * 1.25  # one rank of a job whose snapshot is 1 GiB
    state, first = ask(state, "one", 3, snapshot_bytes=GIB)  # 3 x 2.5 GiB = 7.5 of a's 10
    assert isinstance(first, AllocationGranted) and {r.node for r in first.assignments} == {"a"}
    assert first.snapshots_off == {} and state.ledger.allocations["one"].snapshot_need == need
    state, second = ask(state, "two", 1, snapshot_bytes=GIB)  # the last slot: 7.5 + 2.5 fits exactly
    assert isinstance(second, AllocationGranted) and second.snapshots_off == {}
    state, _ = fold(SVC, [JobCompleted(job_id="two", steps=1)], state)
    state, third = ask(state, "three", 1, snapshot_bytes=2 * GIB)  # 7.5 + 5 > 10: a has the slot, not the room
    assert isinstance(third, AllocationGranted) and [r.node for r in third.assignments] == ["a"]
    assert list(third.snapshots_off) == ["a"]
    assert "7.50 GiB of it held for other ranks" in third.snapshots_off["a"] and "5.00 GiB" in third.snapshots_off["a"]
    # Asked again, the same answer; ranks without snapshots hold none of the node's memory.
    state, again = ask(state, "three", 1, snapshot_bytes=2 * GIB)
    assert again == third
    assert ledger.snapshot_used(state.ledger, "a") == 3 * need
    # A node that never reported its snapshot memory is not accounted; a job of unknown size takes none of it.
    state, fourth = ask(state, "four", 4, snapshot_bytes=100 * GIB)
    assert isinstance(fourth, AllocationGranted) and {r.node for r in fourth.assignments} == {"b"}
    assert fourth.snapshots_off == {}
    state, _ = fold(SVC, [JobCompleted(job_id="one", steps=1), JobCompleted(job_id="three", steps=1)], state)
    state, fifth = ask(state, "five", 4, snapshot_bytes=0)
    assert isinstance(fifth, AllocationGranted) and fifth.snapshots_off == {}
    assert ledger.snapshot_used(state.ledger, "a") == 0


def test_a_denial_names_the_nodes_placement_could_not_use_and_why() -> None:
    """Issue 51: a job whose node was lost sat in `recovering` for 10 minutes saying "0 free slots on 0 nodes"."""
    state = fleet(("a", 2), ("b", 2), ("c", 2))
    state, _ = step(SVC, state, NodeLost(node="a", reason="its agent has sent no heartbeat batch for 5s"))
    state, _ = step(SVC, state, NodeCordoned(node="b", reason="store: it could not read checkpoint step30"))
    _, denied = ask(state, "job-1", 4)
    assert isinstance(denied, AllocationDenied)
    assert denied.reason == ("needs 4 groups of 1 slot(s); the usable nodes have room for 2 (2 free slots on 1 nodes, "
                             "spares excluded); not usable: a (lost: its agent has sent no heartbeat batch for 5s), "
                             "b (store: it could not read checkpoint step30)")
    before = State(settings=Settings())  # a history recorded before: the counts alone, as it was decided
    for ev in [NodeRegistered(node="a", kind="gpu", slots=2), NodeLost(node="a", reason="silent")]:
        before, _ = step(SVC, before, ev)
    _, old = step(SVC, before, AllocationRequested(job_id="job-1", slots=4, attempt=0))
    (old_denial,) = events_of(old)
    assert isinstance(old_denial, AllocationDenied) and "not usable" not in old_denial.reason


def test_a_node_whose_reported_writes_the_store_does_not_hold_is_cordoned_until_it_comes_back_fixed() -> None:
    """Its agent wrote to another store (a wrong mount or bucket) and reported the shards stored; the checkpoint
    service's read of the store contradicts it (the nemesis: every checkpoint of a blind agent failed, counted as the
    store's fault). Twice since it registered, and the node is the suspect; registered again with a passed
    self-check, it is usable again."""
    from flightdeck.events.checkpoint import CheckpointFailed

    def contradicted(n: int) -> CheckpointFailed:
        return CheckpointFailed(job_id="job-1", step=10 * n, checkpoint_id=f"c{n}", store=True, node="a",
                                reason=f"c{n}: shard 'r0.bin' of rank 0 (stored by node a) is not in the store, though "
                                       "its agent reported it stored")

    state = fleet(("a", 2), ("b", 2))
    state, outs = step(SVC, state, contradicted(1))
    assert events_of(outs) == []  # one may be a write lost in flight
    state, outs = step(SVC, state, contradicted(2))
    (cordon,) = events_of(outs)
    assert isinstance(cordon, NodeCordoned) and cordon.node == "a"
    assert cordon.reason.startswith("store: its agent reported shards stored that the store does not hold, 2 times")
    state, outs = step(SVC, state, contradicted(3))
    assert events_of(outs) == []  # cordoned once
    state, _ = step(SVC, state, NodeRegistered(node="a", kind="gpu", slots=2))
    state, outs = step(SVC, state, SelfCheckPassed(node="a", seconds=1.0))
    assert [type(e).__name__ for e in events_of(outs)] == ["NodeUncordoned"]
    state, outs = step(SVC, state, contradicted(4))
    assert events_of(outs) == []  # counted afresh since it registered
    before = State(settings=Settings())  # a history recorded before: the node's word was not judged
    for ev in [NodeRegistered(node="a", kind="gpu", slots=2), contradicted(1), contradicted(2)]:
        before, outs = step(SVC, before, ev)
        assert events_of(outs) == []
