"""A node declared lost is fenced from the attempts whose ranks it ran (services/checkpoints/core.py, Settings.fence):
what it stages or stores for them afterwards is refused. The nemesis froze an agent 8 s (SIGSTOP) while its ranks
trained on; resumed, it shipped the set they had staged at step 89 before it read its node's loss, the checkpoint
service (which had seen no newer attempt yet) committed it, and the rejoin's fence killed the ranks before their
reports of steps 70-89 were relayed: the restart restored a state whose last 20 steps no record holds (issue 51)."""

import msgspec

from flightdeck.events.checkpoint import CheckpointStaged, checkpoint_id
from flightdeck.events.fleet import NodeLost, NodeRegistered
from flightdeck.services.checkpoints import core

from .test_checkpoint_core import LIVE, _granted, commits, run, staged, stored

LOST = NodeLost(node="n1", reason="no heartbeat for 5 s")
BACK = NodeRegistered(node="n1", kind="cpu", slots=2)


def memory(rank: int, step: int, *, attempt: int = 0, node: str = "", replicated: bool = True) -> CheckpointStaged:
    return msgspec.structs.replace(staged(rank, step, 2, attempt=attempt), from_memory=True, replicated=replicated,
                                   node=node or f"n{rank}")


def test_what_a_lost_node_ships_for_its_replaced_ranks_is_never_committed() -> None:
    placed = _granted(0, {0: "n0", 1: "n1"})
    state, outs = run([placed, staged(0, 80, 2), LOST, staged(1, 80, 2)])
    assert commits(outs) == []
    # back and registered again: still not for the attempt it ran when it was lost
    _, outs = run([BACK, staged(0, 90, 2), staged(1, 90, 2)], state)
    assert commits(outs) == []
    # the next attempt, placed on it again after it came back, commits as any
    _, outs = run([BACK, _granted(1, {0: "n0", 1: "n1"}), staged(0, 95, 2, attempt=1), staged(1, 95, 2, attempt=1)],
                  state)
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(1, 95)]


def test_what_it_stored_before_it_was_lost_still_counts() -> None:
    placed = _granted(0, {0: "n0", 1: "n1"})
    _, outs = run([placed, staged(1, 80, 2), LOST, staged(0, 80, 2)])
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 80)]


def test_what_it_staged_and_never_stored_leaves_the_set_to_the_survivors() -> None:
    """Its snapshot of rank 1 was staged, its upload never came: the survivor's full replica settles the set at once
    (rather than wait on an upload that will be refused)."""
    placed = _granted(0, {0: "n0", 1: "n1"})
    state, outs = run([placed, memory(1, 80)], reports=False)
    state, more = run([memory(0, 80)], state)
    assert commits(outs + more) == []
    state, decided = core.transition(state, LOST)
    (commit,) = commits([list(decided)])
    assert commit.checkpoint_id == checkpoint_id(0, 80) and [r.rank for r in commit.ranks] == [0]
    # sharded, it can never be whole: it fails rather than hold the restart's wait up
    state, _ = run([placed, memory(1, 80, replicated=False)], reports=False)
    state, _ = run([memory(0, 80, replicated=False)], state)
    state, decided = core.transition(state, LOST)
    assert commits([list(decided)]) == []
    assert [type(o.event).__name__ for o in decided if hasattr(o, "event")] == ["CheckpointFailed"]


def test_histories_recorded_before_commit_the_late_set_as_they_did() -> None:
    before = msgspec.structs.replace(LIVE, settings=msgspec.structs.replace(LIVE.settings, fence="none"))
    _, outs = run([_granted(0, {0: "n0", 1: "n1"}), staged(0, 80, 2), LOST, staged(1, 80, 2)], before)
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 80)]
    assert stored(staged(1, 80, 2)).node == "n1"
