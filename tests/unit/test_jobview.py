"""JobView: a job's control history folded into what `flightdeck status` shows, with the histories made by
the real scheduler and resource cores (tests/unit/helpers.Bus) rather than written by hand."""

from typing import get_args

from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, DataPosition
from flightdeck.events.commands import PauseRequested, ResumeRequested, RollbackRequested
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    CancelRequested,
    JobFailed,
    JobPhase,
    JobPhaseChanged,
    JobQueued,
    JobSubmitted,
    SlotRef,
    WorkersExited,
    WorkersStarted,
)
from flightdeck.events.plan import ParallelPlan, ReshardPlanned
from flightdeck.events.spec import EntrypointSpec, JobSpec, ParallelSpec
from flightdeck.events.training import StepCompleted
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from flightdeck.services.scheduler.state import Phase
from flightdeck.services.tools.console.status import as_json, details
from flightdeck.services.tools.history import jobview
from flightdeck.services.tools.history.jobview import PHASES, JobView
from flightdeck.services.tools.postmortem.describe import describe
from flightdeck.services.tools.web.figures import Figures, JobFigures
from flightdeck.services.tools.web.metrics import Live, exposition
from flightdeck.services.tools.web.page import job_detail
from tests.unit.helpers import Agents, Bus, register, submit


def cluster(nodes: int = 2, slots: int = 2) -> tuple[Bus, Agents]:
    b = Bus([scheduler(memory_wait=False), resources()])
    b.publish(*(register(f"n{i}", slots) for i in range(nodes)))
    return b, Agents(b)


def view(b: Bus, job_id: str) -> JobView:
    return jobview.fold(job_id, [e for e in b.log if getattr(e, "job_id", None) == job_id])


def before_phases(b: Bus, job_id: str) -> list[Event]:
    """`job_id`'s history as a scheduler that recorded no phases (before JobPhaseChanged) wrote it."""
    return [e for e in b.log if getattr(e, "job_id", None) == job_id and not isinstance(e, JobPhaseChanged)]


def committed(job_id: str, step: int, attempt: int = 0) -> CheckpointCommitted:
    return CheckpointCommitted(job_id=job_id, checkpoint_id=f"step{step:09d}-a{attempt}", step=step, world_size=2,
                               uri=f"file:///objects/checkpoints/{job_id}/step{step:09d}-a{attempt}/MANIFEST.json",
                               bytes=1000 * step, data=DataPosition(next_batch=step))


def scheduler_phase(b: Bus, job_id: str) -> str:
    state = b.state("scheduler")
    return state.jobs[job_id].phase if job_id in state.jobs else state.ended[job_id]


def test_a_submitted_job_the_scheduler_has_not_answered_is_submitted() -> None:
    v = jobview.fold("j-1", [submit("j-1", slots=2, steps=120, max_restarts=2)])
    assert (v.phase, v.name, v.slots, v.steps, v.max_restarts, v.world_size, v.step) == ("submitted", "j", 2, 120, 2,
                                                                                         0, None)
    assert v.last_checkpoint is None and not v.ended


def test_the_drill_queued_placing_running_recovering_running_completed() -> None:
    b, agents = cluster(nodes=0)
    b.publish(submit("drill-1", slots=2, steps=120))
    assert view(b, "drill-1").phase == "queued"  # no node yet: it waits
    b.publish(register("n0", 2))
    assert view(b, "drill-1").phase == "placing"  # asked for and granted; no worker started yet
    agents()
    v = view(b, "drill-1")
    assert (v.phase, v.world_size, v.attempt, v.restarts) == ("running", 2, 0, 0)
    b.publish(committed("drill-1", 20), committed("drill-1", 40))
    grant = b.last_grant("drill-1")
    b.publish(WorkersExited(job_id="drill-1", node="n0", attempt=0, rank=1, exit_code=1))
    v = view(b, "drill-1")
    assert v.restarts == 1 and v.reason == v.last_fault == "rank 1 exited with code 1; restart 1 of 3"
    assert v.phase == "recovering" == scheduler_phase(b, "drill-1")
    agents.running.pop("drill-1", None)
    agents()
    v = view(b, "drill-1")
    assert (v.phase, v.attempt, v.restarts, v.resumed_from_step, v.world_size) == ("running", 1, 1, 40, 2)
    assert v.reason == "" and v.last_fault.startswith("rank 1 exited")
    assert b.last_grant("drill-1") != grant
    b.exit_workers(b.last_grant("drill-1"))
    v = view(b, "drill-1")
    assert (v.phase, v.reason, v.world_size) == ("completed", "", 2)
    assert v.ended and v.ended_at > v.submitted_at
    assert v.last_checkpoint is not None and v.last_checkpoint.step == 40


def test_the_newest_step_comes_from_telemetry_and_a_view_changes_nothing_after_the_end() -> None:
    b, agents = cluster()
    b.publish(submit("j-1", slots=2))
    agents()
    b.exit_workers(b.last_grant("j-1"))
    history = [e for e in b.log if getattr(e, "job_id", None) == "j-1"]
    late: list[Event] = [CancelRequested(job_id="j-1"), JobQueued(job_id="j-1", priority=9, reason="late")]
    step = StepCompleted(job_id="j-1", rank=0, step=99, loss=1.5, grad_norm=1.0, lr=0.003, tokens_per_s=1.0,
                         step_time_s=0.1)
    v = jobview.fold("j-1", [*history, *late], step)
    assert (v.phase, v.priority, v.cancel_requested, v.step, v.steps_done, v.loss) == (
        "completed", 50, False, 99, 100, 1.5)


def test_checkpoints_deleted_by_retention_are_kept_in_the_list_and_marked() -> None:
    events: list[Event] = [submit("j-1"), committed("j-1", 20), committed("j-1", 40), committed("j-1", 60),
                           committed("j-1", 40),  # the same commit read twice
                           CheckpointDeleted(job_id="j-1", checkpoint_id="step000000020-a0"),
                           CheckpointDeleted(job_id="j-1", checkpoint_id="step000000060-a0", reason="corrupt")]
    v = jobview.fold("j-1", events)
    assert [(c.step, c.deleted, c.deleted_reason) for c in v.checkpoints] == [
        (20, True, "retention"), (40, False, ""), (60, True, "corrupt")]
    assert v.last_checkpoint is not None and v.last_checkpoint.checkpoint_id == "step000000040-a0"
    assert v.last_checkpoint.bytes == 40_000 and v.last_checkpoint.uri.endswith("step000000040-a0/MANIFEST.json")


def test_a_preempted_job_is_stopping_then_preempted_then_runs_again_without_counting_a_restart() -> None:
    b, agents = cluster(nodes=1)
    b.publish(submit("low-1", slots=2, priority=10))
    agents()
    b.publish(submit("high-1", slots=2, priority=90))
    v = view(b, "low-1")
    assert (v.phase, v.preempted_by) == ("stopping", "high-1") == (scheduler_phase(b, "low-1"), "high-1")
    agents()  # the low job's ranks obey the stop; the high job gets its slots
    assert view(b, "low-1").phase == "preempted" == scheduler_phase(b, "low-1")
    assert view(b, "high-1").phase == "running"
    b.exit_workers(b.last_grant("high-1"))
    agents()
    v = view(b, "low-1")
    assert (v.phase, v.restarts, v.attempt) == ("running", 0, 1)


def test_cancel_while_running_is_stopping_until_the_ranks_are_gone() -> None:
    b, agents = cluster()
    b.publish(submit("j-1", slots=2))
    agents()
    b.publish(CancelRequested(job_id="j-1", reason="wrong data"))
    v = view(b, "j-1")
    assert (v.phase, v.cancel_requested) == ("stopping", True)
    agents()
    v = view(b, "j-1")
    assert (v.phase, v.reason) == ("cancelled", "wrong data")


def test_cancel_while_queued_ends_it_at_once() -> None:
    b, _ = cluster(nodes=0)
    b.publish(submit("j-1", slots=2), CancelRequested(job_id="j-1"))
    assert view(b, "j-1").phase == "cancelled"


def test_a_spent_restart_budget_fails_the_job_with_the_scheduler_reason() -> None:
    b, agents = cluster()
    b.publish(submit("j-1", slots=2, max_restarts=0))
    agents()
    b.publish(WorkersExited(job_id="j-1", node="n0", attempt=0, rank=0, exit_code=-9))
    v = view(b, "j-1")
    assert v.phase == "failed" and v.restarts == 0
    assert v.reason == "rank 0 was killed by signal 9; restart budget of 0 spent"


def test_rollbacks_are_counted_and_a_stale_release_is_no_restart() -> None:
    events: list[Event] = [submit("j-1", slots=1)]
    v = jobview.fold("j-1", [*events, RollbackRequested(job_id="j-1", checkpoint_id="c", to_step=1, skip_from=2,
                                                        skip_to=3, reason="spike")])
    assert v.rollbacks == 1
    b, agents = cluster()
    b.publish(submit("j-1", slots=2))
    agents()
    stale = AllocationReleased(job_id="j-1", attempt=0, reason=jobview.STALE_GRANT)
    v = jobview.fold("j-1", [*(e for e in b.log if getattr(e, "job_id", None) == "j-1"), stale])
    assert (v.phase, v.restarts) == ("running", 0)


def test_a_pause_is_a_phase_of_its_own_with_its_reason_in_full_until_a_resume_or_the_attempt_s_end() -> None:
    b, agents = cluster()
    b.publish(submit("j-1", slots=2))
    agents()
    why = "loss spike over steps 40-42: ... paused for the operator; to roll back anyway: flightdeck rollback j-1 ..."
    b.publish(PauseRequested(job_id="j-1", reason=why, producer="scheduler"))
    v = view(b, "j-1")
    assert (v.phase, v.paused, v.reason) == ("paused", why, "")  # not "running": its ranks stopped stepping
    assert b.of(JobPhaseChanged, "j-1")[-1].phase == "paused"  # as the scheduler recorded it
    assert f"\npaused:      {why}\n" in details(v, now=v.updated_at)  # not cut to a headline: it says what to do
    b.publish(PauseRequested(job_id="j-1", producer="cli"))
    assert view(b, "j-1").paused == why  # a second pause changes nothing
    b.publish(ResumeRequested(job_id="j-1"))
    assert (view(b, "j-1").phase, view(b, "j-1").paused) == ("running", "")
    b.publish(PauseRequested(job_id="j-1", producer="cli"))
    assert view(b, "j-1").paused == "paused by cli"
    b.publish(WorkersExited(job_id="j-1", node="n0", attempt=0, rank=0, exit_code=1))
    v = view(b, "j-1")
    assert (v.phase, v.paused, v.attempt) == ("recovering", "", 1)  # a new attempt's ranks start unpaused
    agents()
    b.publish(PauseRequested(job_id="j-1", producer="cli"), CancelRequested(job_id="j-1", reason="enough"))
    assert (view(b, "j-1").phase, view(b, "j-1").reason) == ("stopping", "enough")


def test_a_history_recorded_before_phases_were_reads_a_pause_from_the_commands() -> None:
    b, agents = cluster()
    b.publish(submit("j-1", slots=2))
    agents()
    why = "loss spike over steps 40-42: ... paused for the operator; to roll back anyway: flightdeck rollback j-1 ..."
    paused = PauseRequested(job_id="j-1", reason=why, producer="scheduler")
    history = before_phases(b, "j-1")
    v = jobview.fold("j-1", [*history, paused])
    assert (v.phase, v.paused, v.recorded) == ("paused", why, False)
    resumed = jobview.fold("j-1", [*history, paused, ResumeRequested(job_id="j-1")])
    assert (resumed.phase, resumed.paused) == ("running", "")
    stopping = jobview.fold("j-1", [*history, paused, CancelRequested(job_id="j-1")])
    assert stopping.phase == "stopping"
    by_hand = jobview.fold("j-1", [*history, PauseRequested(job_id="j-1", producer="cli")])
    assert by_hand.paused == "paused by cli"
    released = AllocationReleased(job_id="j-1", attempt=0, reason="restart")
    restarted = jobview.fold("j-1", [*history, paused, released])
    assert (restarted.phase, restarted.paused) == ("recovering", "")  # a new attempt's ranks start unpaused


def test_a_view_reads_its_phase_from_the_record_not_from_the_commands() -> None:
    """A pause nobody recorded (the scheduler has not read it yet) is no phase: the view waits for the record."""
    b, agents = cluster()
    b.publish(submit("j-1", slots=2))
    agents()
    history = [e for e in b.log if getattr(e, "job_id", None) == "j-1"]
    v = jobview.fold("j-1", [*history, PauseRequested(job_id="j-1", producer="cli")])
    assert (v.phase, v.paused, v.recorded) == ("running", "", True)


def test_every_phase_a_view_can_be_in_is_a_metrics_phase() -> None:
    # "placing" once was missing: every gauge 0
    assert set(PHASES) == {*get_args(JobPhase), "submitted"} >= {*get_args(Phase), "paused"}
    for phase in PHASES:
        figures = Figures()
        figures.jobs["j-1"] = JobFigures(view=JobView(job_id="j-1", phase=phase))  # type: ignore[arg-type]
        scraped = exposition(figures, Live(), now=0.0).decode()
        assert f'flightdeck_job_phase{{job_id="j-1",phase="{phase}"}} 1.0' in scraped


def test_a_history_without_its_submission_still_folds() -> None:
    v = jobview.fold("x-1", [JobQueued(job_id="x-1", priority=5, reason="seeded")])
    assert (v.phase, v.priority, v.name, v.reason) == ("queued", 5, "", "seeded")


def test_restarts_shown_are_the_scheduler_s_own_figure() -> None:
    """Trial 6 (86ea31b): status and the dashboard said "restarts 3 of 3" where the scheduler had spent 2: the view
    counted every release, free ones too (a bad checkpoint's, a drain's). Releases now carry the figure."""
    b, agents = cluster(nodes=1)
    b.publish(submit("free-1", slots=2, steps=120))
    agents()
    b.publish(WorkersExited(job_id="free-1", node="n0", attempt=0, rank=0, exit_code=-15, planned=True))
    v = view(b, "free-1")
    assert v.phase == "recovering" and v.restarts == 0 == b.state("scheduler").jobs["free-1"].restarts
    old = [AllocationReleased(job_id="old-1", attempt=0, reason="rank 0 exited with code 1")]  # no figure recorded
    assert jobview.fold("old-1", [submit("old-1"), *old]).restarts == 1


def test_a_crash_reason_is_shown_on_one_line_never_as_the_log_lines_the_rank_printed_last() -> None:
    logs = "\n".join(f"2026-11-28 10:50:{s} [info     ] bus.connected server=nats://x" for s in range(10, 15))
    b, agents = cluster()
    b.publish(submit("j-1", slots=2, max_restarts=1))
    agents()
    b.publish(WorkersExited(job_id="j-1", node="n0", attempt=0, rank=1, exit_code=3, cause=logs))
    v = view(b, "j-1")
    assert (v.phase, v.reason, v.last_fault) == ("recovering", "rank 1 exited with code 3; restart 1 of 1",
                                                 "rank 1 exited with code 3; restart 1 of 1")
    assert as_json(v, now=v.updated_at)["last_fault"] == "rank 1 exited with code 3; restart 1 of 1"
    agents()
    b.publish(WorkersExited(job_id="j-1", node="n0", attempt=1, rank=0, exit_code=3, cause=logs,
                            error="RuntimeError: boom"))
    v = view(b, "j-1")
    assert (v.phase, v.reason) == ("failed", "rank 0 exited with code 3: RuntimeError: boom; restart budget of 1 spent")
    (failed,) = [e for e in b.log if isinstance(e, JobFailed)]
    assert describe(failed) == v.reason
    (released,) = [e for e in b.log if isinstance(e, AllocationReleased) and e.attempt == 0]
    assert released.reason.count("bus.connected") == 5  # the record quotes what the rank printed; views leave it out


def test_a_grow_back_is_no_fault_and_spends_no_restart_as_the_scheduler_records_it() -> None:
    """A shrunk job stopped to grow back was shown as a restart after a fault ("last fault: grow back ..."): the view
    read every release outside a stop as one. The scheduler now records why it released (AllocationReleased.kind)."""
    b, agents = cluster()
    b.publish(submit("j-1", slots=2))
    agents()
    history = before_phases(b, "j-1")  # the kinds of release as views read them before phases were recorded
    grow = AllocationReleased(job_id="j-1", attempt=0, reason="grow back to 2 slots from 1: the slots are free again",
                              restarts=0, kind="grow")
    v = jobview.fold("j-1", [*history, grow])
    assert (v.phase, v.restarts, v.last_fault) == ("recovering", 0, "")
    assert v.reason.startswith("grow back to 2 slots")
    fault = AllocationReleased(job_id="j-1", attempt=0, reason="rank 0 exited with code 1; restart 1 of 3",
                               restarts=1, kind="fault")
    v = jobview.fold("j-1", [*history, fault])
    assert (v.phase, v.restarts, v.last_fault) == ("recovering", 1, "rank 0 exited with code 1; restart 1 of 3")
    ended = AllocationReleased(job_id="j-1", attempt=0, reason="failed", restarts=1, kind="ended")
    assert jobview.fold("j-1", [*history, ended]).phase == "running"  # the job's end event says how it ended


def test_the_planned_layout_and_each_rank_s_place_in_it_come_from_the_resharder_s_record() -> None:
    spec = JobSpec(name="tppp", slots=4, parallel=ParallelSpec(tp=2, pp=2),
                   entrypoint=EntrypointSpec(command=["python", "train.py"]))
    refs = [SlotRef(node=f"n{1 + r // 2}", slot=r % 2, rank=r) for r in range(4)]
    plan = ParallelPlan(world_size=4, dp=1, tp=2, pp=2, micro_batches=8, memory_per_gpu_gb=0.25)
    history: list[Event] = [JobSubmitted(job_id="j", spec=spec), AllocationRequested(job_id="j", attempt=0, slots=4),
                            AllocationGranted(job_id="j", attempt=0, assignments=refs),
                            ReshardPlanned(job_id="j", old=None, new=plan, reason="first grant"),
                            WorkersStarted(job_id="j", attempt=0, node="n1", ranks=[0, 1], pids=[10, 11]),
                            WorkersStarted(job_id="j", attempt=0, node="n2", ranks=[2, 3], pids=[12, 13])]
    v = JobView(job_id="j")
    for event in history:
        v = jobview.evolve(v, event)
    assert v.plan == plan and v.placement == tuple(refs)
    said = dict(line.split(": ", 1) for line in details(v, 0.0).splitlines())
    assert said["layout"].strip() == ("TP 2 x PP 2 x DP 1 on 4 ranks, 8 micro-batches (pipeline bubble 12%), "
                                      "0.25 GB planned per rank")
    assert said["ranks"].strip() == ("0 on n1 (pp 0, dp 0, tp 0); 1 on n1 (pp 0, dp 0, tp 1); "
                                     "2 on n2 (pp 1, dp 0, tp 0); 3 on n2 (pp 1, dp 0, tp 1)")
    assert as_json(v, 0.0)["plan"]["tp"] == 2
    figures = Figures()
    figures.jobs["j"] = JobFigures(view=v)
    shown = job_detail(figures.jobs["j"], 0.0)
    assert [(r["rank"], r["node"], r["pp"], r["dp"], r["tp"]) for r in shown["layout"]] == [
        (0, "n1", 0, 0, 0), (1, "n1", 0, 0, 1), (2, "n2", 1, 0, 0), (3, "n2", 1, 0, 1)]
    assert shown["plan"]["described"] == said["layout"].strip() and shown["plan"]["bubble"] == 1 / 8
