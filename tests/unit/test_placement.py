"""Placement: gang all-or-nothing, fewest nodes, best fit, TP groups inside a node, spares only when allowed."""

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events.job import SlotRef
from flightdeck.services.resources.placement import Candidate, Unplaceable, place


def node(name: str, free: int, *, spare: bool = False, offset: int = 0) -> Candidate:
    return Candidate(node=name, free=tuple(range(offset, offset + free)), spare=spare)


def nodes_of(refs: tuple[SlotRef, ...]) -> list[str]:
    return sorted({r.node for r in refs})


def test_a_job_that_fits_one_node_goes_to_the_fullest_node_that_fits() -> None:
    refs = place([node("a", 8), node("b", 3), node("c", 4)], 3)
    assert not isinstance(refs, Unplaceable)
    assert nodes_of(refs) == ["b"]
    assert [(r.slot, r.rank) for r in refs] == [(0, 0), (1, 1), (2, 2)]


def test_a_job_too_big_for_any_node_spans_the_fewest_nodes() -> None:
    refs = place([node("a", 2), node("b", 4), node("c", 4), node("d", 1)], 7)
    assert not isinstance(refs, Unplaceable)
    assert nodes_of(refs) == ["b", "c"]
    assert [r.node for r in refs if r.rank < 4] == ["b"] * 4  # ranks numbered node by node, rank 0 first


def test_the_last_node_of_a_spanning_job_is_chosen_best_fit() -> None:
    refs = place([node("a", 8), node("b", 6), node("c", 2)], 10)
    assert not isinstance(refs, Unplaceable)
    assert nodes_of(refs) == ["a", "c"]  # 8 + 2 leaves b's 6-slot hole whole


def test_tensor_parallel_groups_never_span_nodes() -> None:
    # Two nodes with 3 free slots each hold 6 ranks, but only one TP group of 2 apiece.
    assert isinstance(place([node("a", 3), node("b", 3)], 6, tp=2), Unplaceable)
    refs = place([node("a", 3), node("b", 3), node("c", 2)], 6, tp=2)
    assert not isinstance(refs, Unplaceable)
    for g in range(3):
        assert len({r.node for r in refs if r.rank // 2 == g}) == 1


def test_slots_must_split_into_tp_groups() -> None:
    result = place([node("a", 8)], 6, tp=4)
    assert isinstance(result, Unplaceable) and "groups of 4" in result.reason


def test_spares_are_used_only_when_allowed_and_needed() -> None:
    fleet = [node("a", 2), node("s", 4, spare=True)]
    assert isinstance(place(fleet, 3), Unplaceable)
    refs = place(fleet, 3, use_spares=True)
    assert not isinstance(refs, Unplaceable) and nodes_of(refs) == ["s"]
    refs = place(fleet, 2, use_spares=True)
    assert not isinstance(refs, Unplaceable) and nodes_of(refs) == ["a"]  # a regular node first


def test_the_denial_says_what_is_missing() -> None:
    result = place([node("a", 2), node("s", 4, spare=True)], 3)
    assert isinstance(result, Unplaceable)
    assert "2 free slots on 1 nodes" in result.reason and "spares excluded" in result.reason


fleets = st.lists(st.tuples(st.integers(0, 8), st.booleans()), min_size=1, max_size=6).map(
    lambda spec: [node(f"n{i}", free, spare=spare, offset=i % 3) for i, (free, spare) in enumerate(spec)])


@settings(max_examples=300, deadline=None)
@given(fleet=fleets, slots=st.integers(1, 24), tp=st.sampled_from([1, 1, 2, 4]), use_spares=st.booleans())
def test_placement_properties(fleet: list[Candidate], slots: int, tp: int, use_spares: bool) -> None:
    pool = [c for c in fleet if use_spares or not c.spare]
    regular = [c for c in fleet if not c.spare]
    result = place(fleet, slots, tp=tp, use_spares=use_spares)
    groups_room = sum(len(c.free) // tp for c in pool)
    if slots % tp or groups_room < slots // tp:
        assert isinstance(result, Unplaceable)
        return
    assert not isinstance(result, Unplaceable)
    # gang: exactly `slots` distinct free slots, ranks 0..slots-1
    assert sorted(r.rank for r in result) == list(range(slots))
    assert len({(r.node, r.slot) for r in result}) == slots
    free = {c.node: set(c.free) for c in pool}
    assert all(r.node in free and r.slot in free[r.node] for r in result)
    # tensor-parallel groups stay inside one node
    for g in range(slots // tp):
        assert len({r.node for r in result if r.rank // tp == g}) == 1
    # spares only when the regular nodes cannot take it
    fits_regular = sum(len(c.free) // tp for c in regular) >= slots // tp
    used_spare = any(c.spare for c in fleet if c.node in {r.node for r in result})
    assert not (used_spare and fits_regular)
    # fewest nodes: no smaller set of nodes from the pool it drew on has room (brute force)
    drawn = regular if fits_regular else pool
    count = len({r.node for r in result})
    for k in range(1, count):
        assert all(sum(len(c.free) // tp for c in subset) < slots // tp for subset in combinations(drawn, k))
    # best fit on one node: the fitting node with the fewest free slots
    if count == 1:
        fitting = [c for c in drawn if len(c.free) // tp >= slots // tp]
        assert len(next(c for c in drawn if c.node == result[0].node).free) == min(len(c.free) for c in fitting)
