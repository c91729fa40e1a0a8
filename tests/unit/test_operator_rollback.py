"""An operator's rollback (RollbackAsked, `flightdeck rollback`, `Client.rollback`): the scheduler rolls a running
job back to its newest checkpoint at or before the step asked for, skipping the window asked for, with the ask as
its trigger; it starts no loss incident and spends no restart. Nothing is decided for a job with a rollback in
flight, or without such a checkpoint; a refused target is replaced by the next older one, the same window."""

from flightdeck.events.commands import RollbackRequested
from flightdeck.events.job import RollbackAsked
from tests.unit.helpers import events_of
from tests.unit.test_recovery_recipes import JOB, cid, landed, only_rollback, run, spike, with_commits
from tests.unit.test_rollback_refused import refusal


def ask(to_step: int, skip: tuple[int, int] = (0, 0), event_id: str = "ask-1") -> RollbackAsked:
    return RollbackAsked(job_id=JOB, to_step=to_step, skip_from=skip[0], skip_to=skip[1], reason="bad data shard 7",
                         event_id=event_id, producer="cli", occurred_at=9e9)


def test_an_operator_rollback_goes_to_the_newest_checkpoint_at_or_before_the_step() -> None:
    state, outs = run([ask(350, (900, 950))], with_commits(100, 200, 300, 400))
    rb = only_rollback(outs)
    assert (rb.checkpoint_id, rb.to_step, rb.skip_from, rb.skip_to, rb.trigger_id) == (cid(300), 300, 900, 950, "ask-1")
    assert rb.reason == (f"asked by cli: roll back to {cid(300)} (step 300) and skip batches [900, 950): "
                         "bad data shard 7")
    job = state.jobs[JOB]
    assert job.incident is None and job.restarts == 0 and job.attempt == 0 and job.phase == "running"
    assert cid(400) in job.abandoned  # steps the rollback throws away: never a target again
    state, outs = run([ask(450, event_id="ask-2")], state)
    assert events_of(outs) == []  # a rollback in flight: the second ask decides nothing
    state, outs = run([landed(rb), ask(450, event_id="ask-3")], state)
    again = only_rollback(outs)
    assert (again.checkpoint_id, again.skip_from, again.skip_to) == (cid(300), 0, 0)  # 400 was thrown away


def test_nothing_is_decided_without_a_checkpoint_at_or_before_the_step() -> None:
    _, outs = run([ask(50)], with_commits(100, 200))
    assert events_of(outs) == []


def test_a_refused_operator_target_falls_back_to_the_next_older_one_with_the_same_window() -> None:
    state, outs = run([ask(350, (900, 950))], with_commits(100, 200, 300, 400))
    first = only_rollback(outs)
    state, outs = run([refusal(first)], state)
    again = only_rollback(outs)
    assert (again.checkpoint_id, again.skip_from, again.skip_to, again.trigger_id) == (cid(200), 900, 950, "ask-1")
    assert f"the operator's rollback goes to {cid(200)} (step 200) instead" in again.reason
    state, outs = run([refusal(again, event_id="refused-2"), refusal(
        RollbackRequested(job_id=JOB, checkpoint_id=cid(100), to_step=100, skip_from=900, skip_to=950, reason="",
                          attempt=0), event_id="refused-3")], state)
    assert [e.checkpoint_id for e in events_of(outs) if isinstance(e, RollbackRequested)] == [cid(100)]


def test_a_loss_spike_after_an_operator_rollback_starts_its_own_incident() -> None:
    state, outs = run([ask(350, (900, 950))], with_commits(100, 200, 300, 400))
    state, _ = run([landed(only_rollback(outs))], state)
    state, outs = run([spike(380, "spike-1")], state)
    rb = only_rollback(outs)
    assert rb.trigger_id == "spike-1" and state.jobs[JOB].incident is not None
