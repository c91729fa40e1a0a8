"""A restart after an in-place rollback restores a checkpoint of the rolled-back timeline, never one the rollback threw
away: the scheduler chooses it once, in the restart's AllocationRequested, and the node agent starts the ranks from
the grant that carries it (once the agents chose by the same rule for themselves)."""

from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import RankLost
from flightdeck.events.job import AllocationGranted, AllocationRequested, JobSubmitted, RestorePoint, SlotRef
from flightdeck.events.lineage import forked, thrown_away
from flightdeck.services.agent import core as agentcore
from flightdeck.services.agent.core import SPAWN, SpawnArgs
from flightdeck.services.scheduler.state import State
from tests.unit.helpers import events_of
from tests.unit.test_recovery_recipes import JOB, cid, commit, landed, only_rollback, run, running, spec, spike

REFS = [SlotRef(node="a", slot=s, rank=s) for s in range(2)]


def rollback(to_step: int, attempt: int = 0) -> RollbackRequested:
    return RollbackRequested(job_id=JOB, checkpoint_id=cid(to_step), to_step=to_step, skip_from=0, skip_to=1,
                             reason="r", attempt=attempt)


def test_the_kth_rollback_of_an_attempt_starts_its_timeline_k() -> None:
    forks = forked(forked(forked((), rollback(300)), rollback(250, attempt=1)), rollback(400))
    assert [(f.attempt, f.timeline, f.to_step) for f in forks] == [(0, 1, 300), (1, 1, 250), (0, 2, 400)]
    assert thrown_away(forks, 0, 0, 350) and not thrown_away(forks, 0, 1, 350)  # redone on timeline 1
    assert thrown_away(forks, 0, 1, 450) and not thrown_away(forks, 0, 2, 450)
    assert not thrown_away(forks, 0, 0, 300) and not thrown_away(forks, 2, 0, 900)  # at the fork; another attempt


def restored_by_agent(history: list[Event]) -> SpawnArgs:
    state = agentcore.State(node="a")
    spawned: list[SpawnArgs] = []
    for ev in history:
        state, outs = agentcore.transition(state, ev)
        spawned += [o.args for o in outs if o.kind == SPAWN]  # type: ignore[union-attr]
    assert [s.attempt for s in spawned] == [0, 1]
    return spawned[1]


def restart(state: State, lost: RankLost) -> tuple[State, RestorePoint]:
    """The restart after `lost`: what its request says it restores, once the attempt runs (as JobResumed says)."""
    state, outs = run([lost], state)
    (asked,) = [e for e in events_of(outs, AllocationRequested) if e.attempt == 1]
    assert asked.restore is not None and asked.restore_chosen
    state = running(attempt=1, state=state)
    restore = state.jobs[JOB].run.restore
    assert restore is not None and restore.checkpoint_id == asked.restore.checkpoint_id
    return state, asked.restore


def test_a_restart_after_a_rollback_restores_the_rolled_back_timeline_on_scheduler_and_agent() -> None:
    state = running(spec())
    control: list[Event] = [JobSubmitted(job_id=JOB, spec=spec()), AllocationGranted(job_id=JOB, attempt=0,
                                                                                   assignments=REFS)]
    before = [commit(s) for s in (100, 200, 300, 400)]
    state, outs = run([*before, spike(450, "s1")], state)
    rb = only_rollback(outs)
    assert (rb.checkpoint_id, rb.attempt) == (cid(300), 0)
    state, _ = run([landed(rb)], state)
    # the old timeline's step 500 commits late; the redone 400 carries the skip window and timeline 1
    late, redone = commit(500), commit(400, next_batch=600, skipped=((450, 650),), timeline=1)
    state, _ = run([late, redone], state)
    assert state.jobs[JOB].newest is not None and state.jobs[JOB].newest.checkpoint_id == cid(400, 1)
    lost = RankLost(job_id=JOB, rank=1, attempt=0, reason="exited with code 3", last_seen=1.0, event_id="lost")
    state, point = restart(state, lost)
    assert (point.checkpoint_id, point.skips) == (cid(400, 1), [])  # its own data position holds the window
    agent_history: list[Event] = [*control, *before, rb, late, redone,
                                  AllocationGranted(job_id=JOB, attempt=1, assignments=REFS, restore=point,
                                                    restore_chosen=True)]
    spawned = restored_by_agent(agent_history)
    assert spawned.restore is not None and spawned.restore.checkpoint_id == cid(400, 1) and spawned.skips == []


def test_before_any_redone_commit_the_restart_restores_the_rollback_target_skipping_its_window() -> None:
    state: State = running(spec())
    state, outs = run([*(commit(s) for s in (100, 200, 300, 400)), spike(450, "s1")], state)
    rb = only_rollback(outs)
    state, _ = run([commit(500)], state)  # committed after the rollback, from the old timeline
    lost = RankLost(job_id=JOB, rank=0, attempt=0, reason="heartbeats stopped", last_seen=1.0, event_id="lost")
    state, point = restart(state, lost)
    # Trial 7 (86ea31b): the window belongs to the timeline: a restore of the target skips it, obeyed or not
    assert (point.checkpoint_id, point.skips) == (rb.checkpoint_id, [(rb.skip_from, rb.skip_to)])
    assert point.checkpoint_id == cid(300)
    commits: list[CheckpointCommitted] = [commit(s) for s in (100, 200, 300, 400)]
    history: list[Event] = [JobSubmitted(job_id=JOB, spec=spec()), AllocationGranted(job_id=JOB, attempt=0,
                                                                                    assignments=REFS),
                            *commits, rb, commit(500),
                            AllocationGranted(job_id=JOB, attempt=1, assignments=REFS, restore=point,
                                                    restore_chosen=True)]
    spawned = restored_by_agent(history)
    assert spawned.restore is not None and spawned.restore.checkpoint_id == cid(300)
    assert spawned.skips == [(rb.skip_from, rb.skip_to)]
