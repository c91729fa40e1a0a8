"""A set persisted from memory, once handed over, supersedes its attempt's older sets from memory
(services/checkpoints/core.py, Settings.supersede): an agent stages both slots of each rank, and the older set's
commit, landing first, ended a restart's wait with the steps between redone (bench/vs_peers.py, a lost node: the
survivor's snapshot of the last boundary at 47 and its cadence's at 40; the restart restored 40)."""

import msgspec

from flightdeck.events.checkpoint import CheckpointStaged, checkpoint_id
from flightdeck.events.fleet import NodeLost
from flightdeck.services.checkpoints import core

from .test_checkpoint_core import LIVE, _granted, commits, run, staged, stored


def memory(rank: int, step: int, *, attempt: int = 0, timeline: int = 0) -> CheckpointStaged:
    return msgspec.structs.replace(staged(rank, step, 2, attempt=attempt, timeline=timeline), from_memory=True,
                                   replicated=True, node="a" if rank == 0 else "b")


def test_after_a_lost_node_only_the_survivors_newest_set_commits() -> None:
    placed, lost = _granted(0, {0: "a", 1: "b"}), NodeLost(node="b", reason="its agent went silent")
    state, outs = run([placed, memory(0, 47), memory(0, 40)])
    assert commits(outs) == []
    state, decided = core.transition(state, lost)
    assert [c.checkpoint_id for c in commits([list(decided)])] == [checkpoint_id(0, 47)]
    _, later = run([memory(0, 40), memory(0, 30)], state)  # a late staging of an older slot: never committed
    assert commits(later) == []
    _, outs = run([memory(0, 50)], state)  # a newer one still commits
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 50)]


def test_when_every_rank_staged_both_slots_the_newest_set_commits_and_the_older_never() -> None:
    placed = _granted(0, {0: "a", 1: "a"})
    _, outs = run([placed, memory(0, 23), memory(0, 20), memory(1, 23), memory(1, 20)])
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 23)]
    # the older set's uploads finish first: it waits on the newer one, which holds the same ranks, and never commits
    slots = [memory(0, 23), memory(0, 20), memory(1, 23), memory(1, 20)]
    _, outs = run([placed, *slots, *(stored(s) for s in slots[::-1])], reports=False)
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 23)]
    # a rollback's newer timeline supersedes a higher step of the old one; another attempt's sets are its own
    _, outs = run([placed, memory(0, 12, timeline=1), memory(1, 12, timeline=1), memory(0, 20), memory(1, 20),
                   memory(0, 8, attempt=1), memory(1, 8, attempt=1)])
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 12, 1), checkpoint_id(1, 8)]


def test_histories_recorded_before_commit_every_set_as_they_did() -> None:
    before = msgspec.structs.replace(LIVE, settings=msgspec.structs.replace(LIVE.settings, supersede="no"))
    placed, lost = _granted(0, {0: "a", 1: "b"}), NodeLost(node="b", reason="its agent went silent")
    state, _ = run([placed, memory(0, 47), memory(0, 40)], before)
    _, decided = core.transition(state, lost)
    assert [c.checkpoint_id for c in commits([list(decided)])] == [checkpoint_id(0, 40), checkpoint_id(0, 47)]
