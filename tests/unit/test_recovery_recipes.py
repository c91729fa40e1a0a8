"""Loss spikes and non-finite losses through the scheduler core alone: which checkpoint a rollback names,
which batches it skips, when a spike widens the skip or fails the job, and which findings change nothing."""

import msgspec

from flightdeck.events import subjects
from flightdeck.events.base import Event, JobEvent
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, DataPosition
from flightdeck.events.clock import ClockTick
from flightdeck.events.codec import encode
from flightdeck.events.commands import PauseRequested, RollbackRequested, StopRequested
from flightdeck.events.findings import LossSpikeDetected, NonFiniteLoss, RankLost
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    CancelRequested,
    JobFailed,
    JobSubmitted,
    SlotRef,
    WorkersExited,
    WorkersStarted,
)
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.store import Stored, decoded
from flightdeck.events.training import RolledBack
from flightdeck.services.core import Emit
from flightdeck.services.scheduler.core import core_service
from flightdeck.services.scheduler.state import State
from flightdeck.services.shell.fold import Folder
from tests.unit.helpers import decided, events_of, fold, phases, register, subject_of

SVC = core_service(stop_timeout_s=30.0, landing_timeout_s=60.0)
JOB = "j-1"


def spec(*, back: int = 100, skip: int = 199, every: int = 100, max_restarts: int = 3,
         most: float = 1.0) -> JobSpec:
    """`skip`: batches skipped past the finding's own (one for a one-step finding: 200 in all by default); `most`:
    policy.max_skip_fraction."""
    return JobSpec(name="j", slots=2, train=TrainSpec(steps=10_000, checkpoint_every=every),
                   policy=PolicySpec(rollback_steps_back=back, rollback_skip_batches=skip, max_restarts=max_restarts,
                                     max_skip_fraction=most))


def run(events: list[Event], state: State | None = None) -> tuple[State, list[Emit]]:
    return fold(SVC, events, state)


def running(job_spec: JobSpec | None = None, attempt: int = 0, state: State | None = None) -> State:
    refs = [SlotRef(node="a", slot=s, rank=s) for s in range(2)]
    events: list[Event] = [register("a", 4), JobSubmitted(job_id=JOB, spec=job_spec or spec())] if state is None else []
    state, _ = run([*events, AllocationGranted(job_id=JOB, attempt=attempt, assignments=refs),
                    WorkersStarted(job_id=JOB, node="a", attempt=attempt, ranks=[0, 1], pids=[1, 2])], state)
    assert state.jobs[JOB].phase == "running" and state.jobs[JOB].attempt == attempt
    return state


def cid(step: int, timeline: int = 0) -> str:
    return f"step{step:09d}-a0" + (f"-t{timeline}" if timeline else "")


def commit(step: int, next_batch: int | None = None, skipped: tuple[tuple[int, int], ...] = (),
           timeline: int = 0) -> CheckpointCommitted:
    """Attempt 0's checkpoint of `step`, staged after `timeline` rollbacks."""
    data = DataPosition(next_batch=step if next_batch is None else next_batch, skipped=list(skipped))
    return CheckpointCommitted(job_id=JOB, checkpoint_id=cid(step, timeline), step=step, world_size=2, uri="u",
                               bytes=1, data=data, occurred_at=float(step), timeline=timeline)


def spike(step: int, event_id: str, attempt: int = 0, at: float = 1000.0) -> LossSpikeDetected:
    return LossSpikeDetected(job_id=JOB, rank=0, attempt=attempt, step=step, loss=9.0, baseline=2.0, mad=0.1, z=47.2,
                             threshold=6.0, event_id=event_id, occurred_at=at, evidence=[f"s-{step}"])


def landed(rb: RollbackRequested, attempt: int = 0) -> RolledBack:
    return RolledBack(job_id=JOB, rank=0, attempt=attempt, checkpoint_id=rb.checkpoint_id, to_step=rb.to_step,
                      skip_from=rb.skip_from, skip_to=rb.skip_to, occurred_at=9e9)  # a rank's clock moves nothing


def with_commits(*steps: int, job_spec: JobSpec | None = None) -> State:
    state, _ = run([commit(s) for s in steps], running(job_spec))
    return state


def only_rollback(outs: list[Emit]) -> RollbackRequested:
    (rb,) = events_of(outs)
    assert isinstance(rb, RollbackRequested), outs
    return rb


def test_a_spike_rolls_back_to_the_newest_checkpoint_old_enough_and_skips_from_the_spiking_batch() -> None:
    state, outs = run([spike(450, "spike-1")], with_commits(100, 200, 300, 400))
    rb = only_rollback(outs)
    assert (rb.checkpoint_id, rb.to_step, rb.skip_from, rb.skip_to, rb.trigger_id) == (cid(300), 300, 450, 650,
                                                                                       "spike-1")
    assert rb.reason.startswith("loss spike at step 450: 9 against a median of 2 (robust z 47.2 > 6)")
    assert "roll back to step000000300-a0 (step 300) and skip batches [450, 650)" in rb.reason
    assert rb.reason.endswith("(finding spike-1)")
    job = state.jobs[JOB]
    assert job.phase == "running" and job.restarts == 0 and job.attempt == 0  # a rollback is no restart
    assert job.abandoned == {cid(400)}  # its steps are thrown away: never a rollback target again


def test_a_spike_over_several_steps_rolls_back_to_before_its_onset_and_skips_the_batches_that_carried_it() -> None:
    """A v2 finding names the excursion's steps: a checkpoint after its onset already holds the spike's updates."""
    ev = msgspec.structs.replace(spike(405, "s"), onset=398, score=7.5, threshold=7.5, losses=[9.0] * 8,
                                 schema_version=2)
    _, outs = run([ev], with_commits(300, 400, job_spec=spec(back=0, skip=0)))
    rb = only_rollback(outs)
    assert (rb.checkpoint_id, rb.to_step, rb.skip_from, rb.skip_to) == (cid(300), 300, 398, 406)
    assert rb.reason.startswith("loss spike over steps 398-405: 9 against a median of 2, evidence 7.5 >= 7.5")


def test_a_rollback_past_max_skip_fraction_pauses_the_job_and_asks_the_operator_once() -> None:
    """policy.max_skip_fraction 0.03 of 10,000 steps: 300 batches. The first spike's 200 fit; widening the skip to
    405 for a second one would pass it, so the job is paused with a reason that says what to do, and no skip."""
    state, outs = run([spike(450, "s1")], with_commits(100, 200, 300, 400, job_spec=spec(most=0.03)))
    first = only_rollback(outs)
    state, outs = run([landed(first), spike(455, "s2")], state)
    (paused,) = events_of(outs)
    assert isinstance(paused, PauseRequested) and paused.job_id == JOB
    assert "would skip 405 batches in all, 4.0% of the run's 10000, past policy.max_skip_fraction 0.03" in paused.reason
    assert f"flightdeck rollback {JOB} --to-step 300 --skip 450:855, then flightdeck resume {JOB}" in paused.reason
    assert paused.reason.endswith("(finding s2)")
    job = state.jobs[JOB]
    assert job.asked_for == "s2" and job.run.skips == ((450, 650),) and job.incident is not None
    assert job.incident.triggers == ("s1",)  # asking is no spike of the incident: the operator decides
    _, outs = run([spike(455, "s2")], state)
    assert outs == []  # the same finding read again asks nothing more


def test_without_a_checkpoint_that_old_the_oldest_before_the_spike_is_taken() -> None:
    _, outs = run([spike(350, "s")], with_commits(300, 400))
    rb = only_rollback(outs)
    assert (rb.checkpoint_id, rb.skip_from, rb.skip_to) == (cid(300), 350, 550)
    assert "no checkpoint is 100 steps older than the spike (policy.rollback_steps_back)" in rb.reason


def test_a_spike_before_any_checkpoint_fails_the_job_with_advice() -> None:
    state, outs = run([commit(400), spike(30, "early")], running(spec(every=25)))  # 400 is after the spike
    stop, failed, released = decided(outs)
    assert phases(outs) == [(JOB, "failed", failed.reason)]
    assert isinstance(stop, StopRequested) and not stop.checkpoint
    assert isinstance(failed, JobFailed) and failed.causes == ["early"]
    assert "nothing to roll back to" in failed.reason and "train.checkpoint_every is 25" in failed.reason
    assert released == AllocationReleased(job_id=JOB, attempt=0, reason="failed", restarts=0, kind="ended")
    assert state.ended == {JOB: "failed"}


def test_a_non_finite_loss_rolls_back_like_a_spike() -> None:
    nan = NonFiniteLoss(job_id=JOB, rank=1, attempt=0, step=250, loss=float("nan"), grad_norm=float("inf"),
                        event_id="nan-1", occurred_at=1000.0)
    _, outs = run([nan], with_commits(100, 200))
    rb = only_rollback(outs)
    assert (rb.checkpoint_id, rb.skip_from, rb.skip_to, rb.trigger_id) == (cid(100), 250, 450, "nan-1")
    assert rb.reason.startswith("non-finite loss at step 250 on rank 1 (loss nan, grad norm inf)")


def test_findings_about_thrown_away_steps_are_ignored_until_the_rollback_lands() -> None:
    state, outs = run([spike(450, "s1", at=1000.0)], with_commits(100, 200, 300, 400))
    rb = only_rollback(outs)
    assert SVC.wants_tick(state, 1001.0)  # RolledBack is telemetry: folded at the scheduler's own ticks
    state, outs = run([spike(470, "stale", at=1001.0), commit(500)], state)  # the old steps, still running
    assert outs == [] and state.jobs[JOB].abandoned == {cid(400), cid(500)}
    state, outs = run([landed(rb)], state)
    assert outs == [] and state.now == 1001.0 and not SVC.wants_tick(state, 1002.0)
    state, outs = run([commit(600, next_batch=800, skipped=((450, 650),))], state)  # redone steps, window skipped
    assert cid(600) not in state.jobs[JOB].abandoned


def test_a_rollback_that_never_lands_stops_holding_findings_back_after_the_timeout() -> None:
    state, _ = run([spike(450, "s1", at=1000.0)], with_commits(300))
    _, outs = run([spike(460, "s2", at=1059.0)], state)
    assert outs == []
    _, outs = run([spike(460, "s2", at=1060.0)], state)
    assert isinstance(only_rollback(outs), RollbackRequested)


def test_a_second_spike_in_the_window_widens_the_skip_and_a_third_fails_the_job() -> None:
    state, outs = run([spike(450, "s1")], with_commits(100, 200, 300, 400))
    first = only_rollback(outs)
    state, outs = run([landed(first), spike(455, "s2")], state)
    second = only_rollback(outs)
    # Step 455 after the rollback read batch 655 (steps 300..449 read 300..449, then the window was jumped).
    assert (second.checkpoint_id, second.skip_from, second.skip_to) == (cid(300), 450, 855)
    assert "spike 2 around step 450, so the skip is widened" in second.reason
    state, outs = run([landed(second), spike(520, "s3")], state)
    stop, failed, _ = decided(outs)
    assert isinstance(stop, StopRequested) and isinstance(failed, JobFailed)
    assert failed.causes == ["s1", "s2", "s3"]
    assert failed.reason.startswith("loss spiked 3 times around step 450 despite rollbacks (steps 450, 455, 520;")
    assert "data or learning-rate problem" in failed.reason
    assert state.ended == {JOB: "failed"}


def test_a_spike_past_the_incident_starts_afresh_from_a_checkpoint_that_skipped_the_old_window() -> None:
    state, outs = run([spike(450, "s1")], with_commits(100, 200, 300, 400))
    state, _ = run([landed(only_rollback(outs))], state)
    after = [commit(s, next_batch=s + 200, skipped=((450, 650),), timeline=1) for s in (500, 600, 700, 800)]
    state, outs = run([*after, spike(900, "s2")], state)  # past 450 + max(back, every): a new incident
    rb = only_rollback(outs)
    assert (rb.checkpoint_id, rb.to_step, rb.skip_from, rb.skip_to) == (cid(800, 1), 800, 1100, 1300)
    incident = state.jobs[JOB].incident
    assert incident is not None and incident.triggers == ("s2",) and incident.steps == (900,)


def test_a_thrown_away_checkpoint_is_never_a_target_and_a_deleted_one_is_forgotten() -> None:
    state, outs = run([spike(450, "s1")], with_commits(100, 300, 400))
    state, _ = run([landed(only_rollback(outs))], state)
    state, outs = run([CheckpointDeleted(job_id=JOB, checkpoint_id=cid(300)), spike(600, "s2")], state)
    rb = only_rollback(outs)  # 400 saw the spiking batches; 300 is gone: 100 is what is left
    assert rb.checkpoint_id == cid(100) and state.jobs[JOB].abandoned == {cid(400)}


def test_findings_of_another_attempt_or_a_stopping_job_change_nothing() -> None:
    state = with_commits(100, 300)
    lost = RankLost(job_id=JOB, rank=1, attempt=0, reason="heartbeats stopped", last_seen=1.0, event_id="lost")
    restarted, _ = run([lost], state)
    restarted = running(attempt=1, state=restarted)
    _, outs = run([spike(450, "old", attempt=0)], restarted)
    assert outs == []
    stopping, _ = run([CancelRequested(job_id=JOB)], state)
    assert stopping.jobs[JOB].phase == "stopping"
    _, outs = run([spike(450, "late")], stopping)
    assert outs == []


def test_rollbacks_do_not_spend_the_restart_budget() -> None:
    state, outs = run([spike(450, "s1")], with_commits(100, 300, job_spec=spec(max_restarts=0)))
    state, _ = run([landed(only_rollback(outs)), spike(455, "s2")], state)
    assert state.jobs[JOB].restarts == 0 and len(state.jobs[JOB].run.skips) == 2
    _, outs = run([RankLost(job_id=JOB, rank=1, attempt=0, reason="gone", last_seen=1.0, event_id="lost")], state)
    failed = next(e for e in events_of(outs) if isinstance(e, JobFailed))
    assert failed.reason.endswith("restart budget of 0 spent") and failed.causes == ["lost"]


def test_the_same_finding_read_twice_decides_once() -> None:
    state, outs = run([spike(450, "s1")], with_commits(300))
    rb = only_rollback(outs)
    _, outs = run([landed(rb), spike(450, "s1")], state)
    assert outs == []


def test_the_shell_s_fold_reads_rolled_back_where_the_scheduler_s_own_tick_put_it() -> None:
    """Through services.shell.fold.Folder, as live and in replays: RolledBack is read from FD_TELEMETRY on the
    scheduler's telemetry subjects, only when one of its ticks comes back, and ends the rollback's flight."""
    folder = Folder(SVC)
    control: list[Event] = [register("a", 4), JobSubmitted(job_id=JOB, spec=spec()),
                            AllocationGranted(job_id=JOB, attempt=0,
                                              assignments=[SlotRef(node="a", slot=s, rank=s) for s in range(2)]),
                            WorkersStarted(job_id=JOB, node="a", attempt=0, ranks=[0, 1], pids=[1, 2]),
                            commit(300), spike(450, "s1", at=1000.0)]
    decided: list[Event] = []

    versions = iter(range(1, 100))

    def feed(ev: Event, telemetry: list[Stored] | None = None) -> None:
        seq = folder.control_seq + 1
        if isinstance(ev, JobEvent):  # numbered, as the job's history numbers it
            ev = msgspec.structs.replace(ev, job_version=next(versions))
        stored = decoded(subjects.CONTROL, seq, subject_of(ev), encode(ev), ev.event_id or f"in:{seq}")
        for done in folder.apply(stored, telemetry or []):
            assert done.error == "", done.error
            decided.extend(o.event for o in done.outputs)

    for ev in control:
        feed(ev)
    rb = decided[-1]
    assert isinstance(rb, RollbackRequested)
    before = len(decided)
    back = landed(rb)
    subject = subjects.telemetry(JOB, 0, "RolledBack")
    assert any(subjects.matches(f, subject) for f in SVC.telemetry_subjects)
    feed(spike(470, "stale", at=1001.0))
    feed(ClockTick(service="scheduler", now=1002.0, positions={subjects.TELEMETRY: 7}, event_id="tick"),
         [decoded(subjects.TELEMETRY, 7, subject, encode(back), "rb-landed")])
    assert folder.telemetry_seq == 7 and len(decided) == before  # the stale spike and the landing decide nothing
    feed(spike(455, "s2", at=1003.0))
    widened = decided[-1]
    assert isinstance(widened, RollbackRequested) and widened.trigger_id == "s2" and widened.skip_from == 450
    assert widened.causation_id == "s2"  # the shell names the trigger as the cause, too


def test_a_crash_before_the_ranks_obey_a_rollback_keeps_its_skip_window_in_the_restart() -> None:
    """Trial 7 (86ea31b): the restart after a crash restored the rollback's checkpoint without its skip window."""
    state = with_commits(300, 400)
    state, outs = run([spike(450, "s1")], state)
    rb = only_rollback(outs)
    refs = [SlotRef(node="a", slot=s, rank=s) for s in range(2)]
    crash = WorkersExited(job_id=JOB, node="a", attempt=0, rank=1, exit_code=3, cause="crash")
    state, _ = run([crash, AllocationGranted(job_id=JOB, attempt=1, assignments=refs)], state)
    job = state.jobs[JOB]
    assert job.attempt == 1 and job.run.restore is not None and job.run.restore.checkpoint_id == rb.checkpoint_id
    assert job.run.skips == ((rb.skip_from, rb.skip_to),)  # the scheduler's batch arithmetic counts it, as the ranks do
