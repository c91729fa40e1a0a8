"""A rollback whose checkpoint a rank refuses (issue 16): the scheduler decides it again without that checkpoint,
same skip, no restart and no new spike; with none good left the job fails once. The checkpoint service stops
holding it, deletes it as rejected, and keeps everything older than a target whose restore is not confirmed."""

from msgspec.structs import replace

from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointDeleted, CheckpointRefused
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.job import JobFailed, JobSubmitted
from flightdeck.services.checkpoints import core as ckpt
from flightdeck.services.core import Emit, Output
from tests.unit.helpers import events_of
from tests.unit.test_recovery_recipes import (
    JOB,
    cid,
    commit,
    landed,
    only_rollback,
    run,
    spec,
    spike,
    with_commits,
)


def refusal(rb: RollbackRequested, *, rank: int = 1, event_id: str = "refused-1") -> CheckpointRefused:
    return CheckpointRefused(job_id=JOB, rank=rank, attempt=rb.attempt, node="n1", checkpoint_id=rb.checkpoint_id,
                             to_step=rb.to_step, cause="shard __1_0.distcp has sha256 fc61, the manifest says bd00",
                             event_id=event_id, occurred_at=9e9)


def test_a_refused_rollback_is_decided_again_from_the_next_good_checkpoint_with_the_same_skip() -> None:
    state, outs = run([spike(450, "spike-1")], with_commits(100, 200, 300, 400))
    first = only_rollback(outs)
    state, outs = run([refusal(first)], state)
    again = only_rollback(outs)
    assert (again.checkpoint_id, again.to_step) == (cid(200), 200)
    assert (again.skip_from, again.skip_to, again.trigger_id) == (first.skip_from, first.skip_to, "spike-1")
    assert again.reason.startswith(f"checkpoint {cid(300)} (step 300) is bad on n1 (rank 1): shard __1_0.distcp")
    assert f"roll back to {cid(200)} (step 200) instead" in again.reason and "[450, 650) as planned" in again.reason
    job = state.jobs[JOB]
    assert job.phase == "running" and job.restarts == 0 and job.attempt == 0
    assert cid(300) not in {c.checkpoint_id for c in job.checkpoints}  # never a target (nor a restore) again
    assert job.incident is not None and job.incident.triggers == ("spike-1",)  # not a second spike
    assert job.run.rollback is not None and job.run.rollback.checkpoint_id == cid(200)

    state, outs = run([refusal(first, rank=0, event_id="refused-2")], state)  # another rank's word: nothing new
    assert events_of(outs) == []
    state, outs = run([landed(again)], state)
    assert state.jobs[JOB].run.rollback is not None and state.jobs[JOB].run.rollback.landed


def test_with_no_good_checkpoint_before_the_spike_the_job_fails_once_naming_the_bad_one() -> None:
    state, outs = run([spike(250, "spike-1")], with_commits(100, 200, 300))
    first = only_rollback(outs)
    assert first.checkpoint_id == cid(100)
    state, outs = run([refusal(first)], state)
    failed = [e for e in events_of(outs) if isinstance(e, JobFailed)]
    assert len(failed) == 1 and state.ended == {JOB: "failed"}
    assert failed[0].reason.startswith(f"checkpoint {cid(100)} (step 100) is bad on n1 (rank 1)")
    assert "no good checkpoint is left to roll back to for the loss spike at step 250" in failed[0].reason
    assert failed[0].causes == ["spike-1", "refused-1"]


def test_a_refusal_of_a_checkpoint_no_rollback_is_waiting_for_only_drops_it() -> None:
    state = with_commits(100, 200, 300)
    state, outs = run([CheckpointRefused(job_id=JOB, rank=0, attempt=0, checkpoint_id=cid(200), to_step=200,
                                         cause="gone", event_id="r")], state)
    assert events_of(outs) == []
    assert [c.step for c in state.jobs[JOB].checkpoints] == [100, 300]
    _, outs = run([spike(350, "s")], state)
    assert only_rollback(outs).checkpoint_id == cid(100)  # 200 would be the target: it is bad


# -- the checkpoint service ----------------------------------------------------------------------------------

def fold_ckpt(events: list[Event]) -> tuple[ckpt.JobState, list[Output]]:
    state, outs = ckpt.State(), list[Output]()
    for ev in events:
        state, out = ckpt.transition(state, ev)
        outs.extend(out)
    return state.jobs[JOB], outs


def deleted(outs: list[Output]) -> list[tuple[str, str]]:
    return [(o.event.checkpoint_id, o.event.reason) for o in outs
            if isinstance(o, Emit) and isinstance(o.event, CheckpointDeleted)]


def rollback(step: int) -> RollbackRequested:
    return RollbackRequested(job_id=JOB, checkpoint_id=cid(step), to_step=step, skip_from=450, skip_to=650,
                             reason="spike", attempt=0)


def test_the_checkpoint_service_keeps_what_is_older_than_an_unconfirmed_target_and_deletes_a_refused_one() -> None:
    keep_two = spec()
    keep_two = replace(keep_two, policy=replace(keep_two.policy, keep_checkpoints=2))
    before = [JobSubmitted(job_id=JOB, spec=keep_two), commit(100), commit(200), commit(300), rollback(300)]
    job, outs = fold_ckpt(before)
    assert deleted(outs) == [(cid(100), "retention")] and set(job.holds) == {cid(300)}

    # The new timeline commits before the ranks' RolledBack arrive: 200 stays while 300's restore is unconfirmed.
    after = [*before, commit(310, timeline=1), commit(320, timeline=1)]
    job, outs = fold_ckpt(after)
    assert deleted(outs) == [(cid(100), "retention")]
    job, outs = fold_ckpt([*after, landed(rollback(300)), replace(landed(rollback(300)), rank=1)])
    assert deleted(outs) == [(cid(100), "retention"), (cid(200), "retention"), (cid(300), "retention")]

    job, outs = fold_ckpt([*before, refusal(rollback(300))])  # refused: deleted as such, and no longer held
    assert deleted(outs) == [(cid(100), "retention"), (cid(300), ckpt.REJECTED)]
    assert job.holds == {} and cid(300) in job.bad
