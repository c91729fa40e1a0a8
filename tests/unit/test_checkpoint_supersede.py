"""A set persisted from memory, once handed over, supersedes its attempt's older sets from memory
(services/checkpoints/core.py, Settings.supersede): an agent stages both slots of each rank, and the older set's
commit, landing first, ended a restart's wait with the steps between redone (bench/vs_peers.py, a lost node: the
survivor's snapshot of the last boundary at 47 and its cadence's at 40; the restart restored 40)."""

import msgspec

from flightdeck.events.checkpoint import CheckpointStaged, checkpoint_id
from flightdeck.events.fleet import NodeLost
from flightdeck.services.checkpoints import core

from .test_checkpoint_core import JOB, LIVE, _granted, commits, run, staged, stored


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


def test_after_a_crash_the_survivors_newest_replica_commits_without_the_rank_whose_exit_says_it_staged_older() -> None:
    """Rank 1 crashed (no snapshot of its last boundary: the process is gone) and its agent staged its slots at 20
    and 10; rank 0, whose all-reduce broke, snapshotted its boundary at 27 and its agent staged 27 and 20. Rank 1's
    exit says the newest it staged: no set of 27 can hold it, so rank 0's full replica settles 27, and 20 is
    superseded. A sharded 27 could never be whole: it fails, and the complete 20 commits."""
    from flightdeck.events.job import RankExit, WorkersExited

    def exited(at: tuple[int, int] | None) -> WorkersExited:
        return WorkersExited(job_id=JOB, node="a", attempt=0, rank=1, exit_code=3, persisted="staged",
                             persisted_at=at, others=[])

    placed = _granted(0, {0: "a", 1: "a"})
    crashed = [memory(1, 20), memory(1, 10), exited((0, 20))]
    _, outs = run([placed, *crashed, memory(0, 27), memory(0, 20)])
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 27)]
    (commit,) = commits(outs)
    assert [r.rank for r in commit.ranks] == [0] and commit.world_size == 2
    # an exit that does not say how far it staged (an older agent): the complete set at 20, as before
    _, outs = run([placed, memory(1, 20), memory(1, 10), exited(None), memory(0, 27), memory(0, 20)])
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 20)]
    # sharded: rank 0's 27 fails at once and does not hold 20 up
    sharded = [msgspec.structs.replace(e, replicated=False) if isinstance(e, CheckpointStaged) else e
               for e in [*crashed, memory(0, 27), memory(0, 20)]]
    _, outs = run([placed, *sharded])
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 20)]
    assert RankExit(rank=1, exit_code=3).persisted_at is None


def failures(outs: list[list[core.Output]]) -> list[str]:
    from flightdeck.events.checkpoint import CheckpointFailed
    return [o.event.checkpoint_id for step in outs for o in step
            if isinstance(o, core.Emit) and isinstance(o.event, CheckpointFailed)]


def test_a_set_a_newer_one_superseded_commits_when_the_newer_ones_shards_cannot_be_stored() -> None:
    """Both slots of both ranks staged; the older set's uploads finish first and it waits on the newer one (parked);
    then the store refuses the newer set's shards. The older one commits with the failure, not nothing: a restart
    from the store's newest checkpoint would redo everything since."""
    placed = _granted(0, {0: "a", 1: "a"})
    slots = [memory(0, 23), memory(0, 20), memory(1, 23), memory(1, 20)]
    older_stored = [stored(s) for s in slots if s.step == 20]
    newer_fails = stored(memory(1, 23), failed="the store said 503")
    state, outs = run([placed, *slots, *older_stored, stored(memory(0, 23)), newer_fails], reports=False)
    assert failures(outs) == [checkpoint_id(0, 23)]
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 20)]
    assert outs[-1] and {type(o).__name__ for o in outs[-1]} >= {"Emit", "Effect"}  # both decided on the failure
    _, later = run([stored(memory(0, 20))], state, reports=False)  # handed over once
    assert commits(later) == []
    # histories recorded with supersede "yes" (before parking): the older set was dropped, as they ran
    before = msgspec.structs.replace(LIVE, settings=msgspec.structs.replace(LIVE.settings, supersede="yes"))
    _, outs = run([placed, *slots, *older_stored, stored(memory(0, 23)), newer_fails], before, reports=False)
    assert failures(outs) == [checkpoint_id(0, 23)] and commits(outs) == []


def test_a_parked_set_is_dropped_once_the_newer_one_is_handed_over() -> None:
    placed = _granted(0, {0: "a", 1: "a"})
    slots = [memory(0, 23), memory(0, 20), memory(1, 23), memory(1, 20)]
    state, outs = run([placed, *slots, *(stored(s) for s in slots[::-1])], reports=False)
    assert [c.checkpoint_id for c in commits(outs)] == [checkpoint_id(0, 23)]
    assert not any(k[2] == 20 for k in state.jobs[JOB].staging)
    # a late failure report of the newer set's node, after its commit was asked: the older stays dropped
    _, later = run([stored(memory(1, 23), failed="late"), stored(memory(0, 20))], state, reports=False)
    assert commits(later) == []

