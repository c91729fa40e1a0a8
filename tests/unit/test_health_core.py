"""The health core over job events and telemetry: whose ranks count, exits, silence, stops, non-finite
losses, ticks wanted, and findings that fire once and name inputs that exist."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flightdeck.events.clock import ClockTick
from flightdeck.events.commands import PauseRequested, ResumeRequested, RollbackRequested, StopRequested
from flightdeck.events.findings import Finding, NonFiniteLoss, RankHung, RankLost
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    JobCompleted,
    JobPreempted,
    SlotRef,
    WorkersStarted,
)
from flightdeck.events.spec import PolicySpec
from flightdeck.events.training import Heartbeat, RankFault, StepCompleted
from flightdeck.services import registry
from flightdeck.services.health import service as health_service
from flightdeck.services.health.core import INITIAL, MAX_FINDINGS_PER_TICK, NAME, snapshot, wants_tick
from flightdeck.services.health.detectors import STARTUP_GRACE_S
from tests.unit.health_synth import SERVICE, Cluster, RankPlan, evidence_exists, fold, fold_pairs, of

POLICY = PolicySpec(heartbeat_interval_s=1.0, heartbeat_misses=5, hang_min_s=5.0, hang_factor=10.0)
OK = RankPlan(step_time_s=lambda s: 0.5)


def tick(at: float) -> ClockTick:
    return ClockTick(service=NAME, now=at, positions={}, event_id=f"tick-{at}", occurred_at=at)


def running(num_ranks: int = 2, until: float = 10.0) -> Cluster:
    c = Cluster(num_ranks=num_ranks, policy=POLICY)
    c.start()
    c.run([OK] * num_ranks, start=0.0, until=until)
    return c


def test_a_non_zero_exit_is_a_lost_rank_naming_the_exit_the_fault_and_the_last_sign_of_life() -> None:
    c = running()
    fault = RankFault(job_id=c.job_id, rank=1, attempt=0, kind="exception", error_type="ValueError", message="x",
                      step=3, event_id="fault-1", occurred_at=10.1)
    c.events += [fault, tick(10.2)]  # folded at the tick, as telemetry is
    exit_ev = c.exit(1, 3, at=10.5)
    _, found = fold(c.events)
    (lost,) = found
    assert isinstance(lost, RankLost) and (lost.rank, lost.attempt, lost.reason) == (1, 0, "exited with code 3")
    assert lost.evidence == [exit_ev.event_id, "fault-1"] and lost.last_seen == 10.1
    evidence_exists(found, c.events)


@pytest.mark.parametrize("before", ["none", "stop", "preempt", "release", "completed", "stale"])
def test_exits_that_are_no_fault(before: str) -> None:
    c = running()
    if before == "stop":
        c.events.append(StopRequested(job_id=c.job_id, checkpoint=True, event_id="stop"))
    elif before == "preempt":
        c.events.append(JobPreempted(job_id=c.job_id, by_job_id="other", event_id="pre"))
    elif before == "release":
        c.events.append(AllocationReleased(job_id=c.job_id, attempt=0, event_id="rel"))
    elif before == "completed":
        c.events.append(JobCompleted(job_id=c.job_id, steps=10, event_id="done"))
    code = 0 if before == "none" else -15
    for rank in (0, 1):
        c.exit(rank, code, at=11.0, attempt=7 if before == "stale" else 0)
    c.events += [tick(t) for t in range(12, 60)]  # and the silence after it is no loss either
    state, found = fold(c.events)
    if before == "stale":  # another attempt's exits say nothing of these ranks: their silence does
        assert {(f.rank, f.reason) for f in of(found, RankLost) if isinstance(f, RankLost)} == {
            (0, "heartbeats stopped"), (1, "heartbeats stopped")} and len(found) == 2
    else:
        assert found == []
    assert (c.job_id in state.ended) == (before == "completed")


def test_silence_is_reported_once_and_the_rank_is_judged_no_more() -> None:
    c = running(until=10.0)
    c.events += [tick(t) for t in range(11, 40)]
    state, found = fold(c.events)
    assert sorted((f.rank, type(f).__name__) for f in found) == [(0, "RankLost"), (1, "RankLost")]
    evidence_exists(found, c.events)
    assert not wants_tick(state, 40.0)  # nothing left to watch


def test_no_loss_while_the_ranks_are_stopped_on_purpose() -> None:
    c = running(until=10.0)
    c.events.append(StopRequested(job_id=c.job_id, checkpoint=False, event_id="stop"))
    c.events += [tick(t) for t in range(11, 40)]
    assert fold(c.events)[1] == []


def test_stale_attempt_telemetry_does_not_keep_the_new_attempt_alive() -> None:
    c = running(until=5.0)
    refs = [SlotRef(node="n2", slot=r, rank=r) for r in range(2)]
    c.events += [AllocationGranted(job_id=c.job_id, attempt=1, assignments=refs, event_id="g1", occurred_at=5.0),
                 WorkersStarted(job_id=c.job_id, node="n2", attempt=1, ranks=[0, 1], pids=[1, 2], event_id="w1",
                                occurred_at=5.0)]
    c.run([OK, OK], start=5.0, until=5.0 + STARTUP_GRACE_S + 2)  # still attempt 0's ranks talking
    _, pairs = fold_pairs(c.events)
    assert sorted((f.rank, f.attempt) for _, f in pairs) == [(0, 1), (1, 1)]
    for tick_ev, f in pairs:
        assert isinstance(f, RankLost) and f.evidence == ["w1"] and f.never_heard
        assert f.reason.endswith("of start: it never called flightdeck.init(), or was stuck before it")
        assert f.last_seen == 5.0 and isinstance(tick_ev, ClockTick) and tick_ev.now > 5.0 + STARTUP_GRACE_S


def test_a_new_attempt_is_watched_afresh() -> None:
    c = running(until=10.0)
    c.exit(1, 1, at=10.0)
    c.attempt = 1
    c.start(at=12.0)
    c.run([OK, OK], start=12.0, until=30.0)
    c.exit(1, 1, at=30.0)
    _, found = fold(c.events)
    assert [(f.rank, f.attempt, type(f).__name__) for f in found] == [(1, 0, "RankLost"), (1, 1, "RankLost")]


def step(c: Cluster, rank: int, n: int, loss: float = 1.0, grad: float = 1.0) -> StepCompleted:
    return StepCompleted(job_id=c.job_id, rank=rank, attempt=c.attempt, step=n, loss=loss, grad_norm=grad, lr=0.1,
                         tokens_per_s=1.0, step_time_s=0.5, event_id=f"st-{rank}-{n}-{c.eid('x')}", occurred_at=9.0)


@pytest.mark.parametrize(("loss", "grad"), [(math.nan, 1.0), (math.inf, 1.0), (1.0, math.nan), (1.0, -math.inf)])
def test_non_finite_loss_or_grad_norm(loss: float, grad: float) -> None:
    c = running(until=5.0)
    bad = step(c, 1, 100, loss, grad)
    c.events += [step(c, 0, 100), bad, step(c, 0, 101, math.nan), step(c, 1, 100, math.nan, math.nan),
                 step(c, 1, 101), step(c, 0, 102), step(c, 1, 102)]
    _, found = fold(c.events)
    (nf,) = found
    assert isinstance(nf, NonFiniteLoss) and (nf.rank, nf.step, nf.evidence) == (1, 100, [bad.event_id])
    assert (math.isnan(nf.loss) if math.isnan(loss) else nf.loss == loss)
    assert (math.isnan(nf.grad_norm) if math.isnan(grad) else nf.grad_norm == grad)


def test_non_finite_episodes_from_steps_faults_and_rollbacks() -> None:
    c = running(until=5.0)
    fault = RankFault(job_id=c.job_id, rank=0, attempt=0, kind="nonfinite", error_type="NonFiniteLoss", message="",
                      step=50, event_id="nf-fault", occurred_at=9.0)
    c.events += [fault, step(c, 0, 50, math.nan), step(c, 1, 50, 1.0, math.nan)]  # one episode, three reports
    c.events += [step(c, 0, 51), step(c, 0, 52, math.nan)]  # a finite step between: a new episode
    c.events.append(RollbackRequested(job_id=c.job_id, checkpoint_id="c", to_step=40, skip_from=40, skip_to=60,
                                      reason="nan", event_id="rb"))
    c.events.append(step(c, 0, 50, math.nan))  # the same step again after the rollback: news again
    _, found = fold(c.events)
    assert [(f.step, f.evidence) for f in found if isinstance(f, NonFiniteLoss)] == [
        (50, ["nf-fault"]), (52, [c.events[-3].event_id]), (50, [c.events[-1].event_id])]
    assert all(isinstance(f, NonFiniteLoss) for f in found)


def test_pause_suspends_hang_detection_until_resume() -> None:
    c = Cluster(policy=POLICY)
    c.start()
    frozen = RankPlan(step_time_s=lambda s: 0.5, hangs_at_step=10)  # a paused rank: heartbeats, no steps
    c.run([OK, OK], start=0.0, until=4.0)
    c.events.append(PauseRequested(job_id=c.job_id, event_id="pause", occurred_at=4.0))
    c.run([frozen, frozen], start=4.0, until=60.0, first_step=8, announce=False)
    resume = ResumeRequested(job_id=c.job_id, event_id="resume", occurred_at=60.0)
    c.events.append(resume)
    c.run([frozen, frozen], start=60.0, until=70.0, first_step=10, announce=False)
    _, found = fold(c.events)
    assert {type(f) for f in found} == {RankHung}
    assert all(f.evidence[0] == "resume" and isinstance(f, RankHung) and f.stalled_s > 5.0 for f in found)


def test_wants_tick_only_while_ranks_are_watched() -> None:
    c = Cluster(policy=POLICY)
    c.start()
    submitted = fold(c.events[:1])[0]
    assert not wants_tick(submitted, 0.0)
    granted = fold(c.events[:2])[0]
    assert wants_tick(granted, 0.0)  # its start is awaited: an agent that never starts the ranks is found lost
    started = fold(c.events)[0]
    assert wants_tick(started, 0.0)
    stopping = fold([StopRequested(job_id=c.job_id, event_id="s")], snapshot(started))[0]
    assert not wants_tick(stopping, 0.0) and wants_tick(started, 0.0)
    assert not wants_tick(INITIAL, 0.0)


def test_the_sealed_initial_state_is_never_changed_by_a_fold() -> None:
    c = running(until=30.0)
    c.exit(0, 9, at=30.0)
    first = fold(c.events)[1]
    assert INITIAL.jobs == {} and INITIAL.sealed
    assert fold(c.events)[1] == first and len(first) == 1


def test_redelivered_inputs_and_a_rebuild_repeat_nothing() -> None:
    c = running(until=10.0)
    exit_ev = c.exit(1, 1, at=10.0)
    c.events += [exit_ev, tick(11.0), exit_ev]
    c.events += [tick(t) for t in range(12, 30)]
    whole = fold(c.events)[1]
    half = len(c.events) // 2
    state, first = fold(c.events[:half])
    rest = fold(c.events[half:], snapshot(state))[1]
    assert first + rest == whole
    keys = [(f.attempt, f.rank, type(f).__name__) for f in whole]
    assert len(keys) == len(set(keys)) == 2


def plan(step_time: float, dies_at: float, hangs_at: int | None) -> RankPlan:
    return RankPlan(step_time_s=lambda s: step_time, dies_at=dies_at, hangs_at_step=hangs_at)


scenario = st.builds(plan, st.floats(0.1, 1.5), st.one_of(st.just(math.inf), st.floats(3.0, 40.0)),
                     st.one_of(st.none(), st.integers(2, 40)))


@settings(max_examples=30, deadline=None)
@given(st.lists(scenario, min_size=1, max_size=4), st.floats(40.0, 80.0))
def test_any_mix_of_ranks_gives_findings_that_rest_on_real_inputs_once_each(plans: list[RankPlan],
                                                                             until: float) -> None:
    c = Cluster(num_ranks=len(plans), policy=POLICY)
    c.start()
    c.run(plans, start=0.0, until=until)
    _, found = fold(c.events)
    evidence_exists(found, c.events)
    keys = [(f.attempt, f.rank, type(f).__name__) for f in found if isinstance(f, RankLost | RankHung)]
    assert len(keys) == len(set(keys))
    for rank, p in enumerate(plans):
        mine: list[Finding] = [f for f in found if f.rank == rank]
        lost = any(isinstance(f, RankLost) for f in mine)
        assert lost == (p.dies_at + POLICY.heartbeat_misses * POLICY.heartbeat_interval_s + 1 < until) or (
            abs(p.dies_at + 5 - until) < 2)  # near the end of the run either way is fine
    assert fold(c.events)[1] == found  # the same inputs, the same findings


def test_registry_builds_the_health_service_from_its_module(monkeypatch: pytest.MonkeyPatch) -> None:
    built = registry.build("health")
    assert built.name == "health" and built.telemetry_subjects == SERVICE.telemetry_subjects
    assert "fd.tel.*.*.Heartbeat" in built.telemetry_subjects and built.tick_s == 1.0
    monkeypatch.setenv(health_service.TICK_ENV, "0.25")
    assert health_service.build().tick_s == 0.25
    for bad in ("soon", "0", "-1", "600"):
        monkeypatch.setenv(health_service.TICK_ENV, bad)
        with pytest.raises(ValueError, match=health_service.TICK_ENV):
            health_service.build()


def test_heartbeat_of_an_unknown_job_or_rank_is_ignored() -> None:
    c = running(until=3.0)
    c.events += [Heartbeat(job_id="nobody", rank=0, step=1, interval_s=1.0, event_id="x"),
                 Heartbeat(job_id=c.job_id, rank=9, step=1, interval_s=1.0, event_id="y")]
    state, found = fold(c.events)
    assert found == [] and "nobody" not in state.jobs and 9 not in state.jobs[c.job_id].ranks


def test_a_hung_collective_is_reported_a_few_ranks_per_tick_worst_first() -> None:
    c = Cluster(num_ranks=20, policy=POLICY)
    c.start()
    # Every rank stops stepping (a stuck all-reduce); rank 13 stalled a step earlier than the rest.
    plans = [RankPlan(step_time_s=lambda s: 0.5, hangs_at_step=9 if r == 13 else 10) for r in range(20)]
    c.run(plans, start=0.0, until=20.0)
    _, pairs = fold_pairs(c.events)
    per_tick: dict[str, list[int]] = {}
    for ev, f in pairs:
        assert isinstance(f, RankHung)
        per_tick.setdefault(ev.event_id, []).append(f.rank)
    first, *rest = per_tick.values()
    assert first == [13]  # its deadline passed first
    assert [len(v) for v in rest] == [MAX_FINDINGS_PER_TICK, MAX_FINDINGS_PER_TICK, 3]
    assert sorted(r for v in per_tick.values() for r in v) == list(range(20))
    stopped = c.events[: c.events.index(pairs[1][0]) + 1]
    stopped.append(StopRequested(job_id=c.job_id, checkpoint=False, event_id="stop"))
    stopped += [e for e in c.events[len(stopped) - 1:] if isinstance(e, ClockTick)]
    assert len(fold(stopped)[1]) == 1 + MAX_FINDINGS_PER_TICK  # a stop ends the reports


def test_before_its_first_step_a_rank_has_its_start_up_grace_not_the_hang_deadline() -> None:
    """Started, heard from, and not yet through its first step (a sharded model's set-up under load): no hang at
    step -1 before the start-up grace, however short hang_min_s; after it, found hung. A rank that has stepped has
    only the hang deadline (5 s here)."""
    c = Cluster(policy=POLICY)
    c.start()
    starting = RankPlan(step_time_s=lambda s: 0.5, hangs_at_step=0)
    c.run([starting, starting], start=0.0, until=STARTUP_GRACE_S - 1)
    _, found = fold(c.events)
    assert found == []
    c.run([starting, starting], start=STARTUP_GRACE_S - 1, until=STARTUP_GRACE_S + 3, announce=False)
    _, found = fold(c.events)
    assert sorted((f.rank, f.step) for f in found if isinstance(f, RankHung)) == [(0, -1), (1, -1)]
    assert all(isinstance(f, RankHung) and f.deadline_s == STARTUP_GRACE_S for f in found), found

    stepped = Cluster(policy=POLICY)
    stepped.start()
    stuck = RankPlan(step_time_s=lambda s: 0.5, hangs_at_step=1)
    stepped.run([stuck, stuck], start=0.0, until=8.0)
    _, found = fold(stepped.events)
    assert sorted((f.rank, f.step) for f in found if isinstance(f, RankHung)) == [(0, 0), (1, 0)]
