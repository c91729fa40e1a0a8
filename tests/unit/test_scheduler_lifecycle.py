"""A job's life through the scheduler core alone, with hand-built inputs: queue, place, run, end, cancel."""

from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted, DataPosition
from flightdeck.events.clock import ClockTick
from flightdeck.events.commands import StopRequested
from flightdeck.events.job import (
    AllocationDenied,
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    CancelRequested,
    JobCancelled,
    JobCompleted,
    JobQueued,
    JobResumed,
    RankExit,
    SlotRef,
    WorkersExited,
    WorkersStarted,
)
from flightdeck.events.spec import snapshot_bytes
from flightdeck.services.core import Emit
from flightdeck.services.scheduler.core import core_service
from flightdeck.services.scheduler.state import State
from tests.unit.helpers import decided, fold, phases, register, submit

SVC = core_service(stop_timeout_s=30.0)


def grant(job: str, node: str, slots: int, attempt: int = 0) -> AllocationGranted:
    return AllocationGranted(job_id=job, attempt=attempt, master_port=29501,
                             assignments=[SlotRef(node=node, slot=s, rank=s) for s in range(slots)])


def started(job: str, node: str, ranks: list[int], attempt: int = 0) -> WorkersStarted:
    return WorkersStarted(job_id=job, node=node, attempt=attempt, ranks=ranks, pids=ranks)


def exited(job: str, rank: int, code: int = 0, attempt: int = 0, node: str = "a") -> WorkersExited:
    return WorkersExited(job_id=job, node=node, attempt=attempt, rank=rank, exit_code=code)


def types(outs: list[Emit]) -> list[str]:
    return [type(e).__name__ for e in decided(outs)]


def run(events: list[Event], state: State | None = None) -> tuple[State, list[Emit]]:
    return fold(SVC, events, state)


def running(job: str = "j-1", slots: int = 2) -> State:
    state, _ = run([register("a", 4), submit(job, slots=slots), grant(job, "a", slots),
                    started(job, "a", list(range(slots)))])
    assert state.jobs[job].phase == "running"
    return state


def test_a_submitted_job_is_queued_and_asked_for_once_it_fits() -> None:
    state, outs = run([submit("j-1", slots=2)])
    assert decided(outs) == [JobQueued(job_id="j-1", priority=50, reason="submitted")]
    assert phases(outs) == [("j-1", "queued", "")]
    assert state.jobs["j-1"].phase == "queued" and state.queue == ("j-1",)
    state, outs = run([register("a", 1)], state)
    assert outs == []  # one slot is not two: nobody starts with part of its gang
    state, outs = run([register("b", 1)], state)
    snapshot = snapshot_bytes(submit("j-1", slots=2).spec)  # one rank's state, for the node's snapshot memory
    assert decided(outs) == [AllocationRequested(job_id="j-1", slots=2, attempt=0, snapshot_bytes=snapshot,
                                                 restore_chosen=True)]
    assert state.jobs["j-1"].phase == "placing" and state.queue == ()


def test_the_happy_path_ends_in_completed_and_released() -> None:
    state, outs = run([register("a", 4), submit("j-1", slots=2, steps=40), grant("j-1", "a", 2),
                       started("j-1", "a", [0]), started("j-1", "a", [1])])
    assert types(outs) == ["JobQueued", "AllocationRequested"]  # a first attempt resumes nothing
    # one record per input that moved it: its submission found room, so it was placing by the input's end
    assert [p for _, p, _ in phases(outs)] == ["placing", "running"]
    assert state.jobs["j-1"].phase == "running"
    state, outs = run([exited("j-1", 0)], state)
    assert outs == []
    state, outs = run([exited("j-1", 1)], state)
    assert decided(outs) == [JobCompleted(job_id="j-1", steps=40),
                               AllocationReleased(job_id="j-1", attempt=0, reason="completed", restarts=0,
                                                      kind="ended")]
    assert phases(outs) == [("j-1", "completed", "")]
    assert state.ended == {"j-1": "completed"} and state.jobs == {}
    again, outs = run([exited("j-1", 1), CancelRequested(job_id="j-1"), submit("j-1")], state)
    assert outs == [] and again.jobs == {}  # an ended job stays ended, and a repeated submission is the same one


def test_reading_its_own_outputs_back_changes_nothing() -> None:
    state, outs = run([register("a", 4), submit("j-1", slots=2)])
    again, more = run([o.event for o in outs], state)
    assert more == [] and again.jobs == state.jobs and again.queue == state.queue


def test_a_denial_requeues_and_retries_only_after_capacity_changes() -> None:
    state, _ = run([register("a", 4), submit("j-1", slots=2), submit("k-1", slots=1)])
    assert state.jobs["k-1"].phase == "placing"
    state, outs = run([AllocationDenied(job_id="j-1", attempt=0, reason="tp groups")], state)
    assert decided(outs) == [JobQueued(job_id="j-1", priority=50, reason="allocation denied: tp groups")]
    assert phases(outs) == [("j-1", "queued", "allocation denied: tp groups")]
    state, outs = run([grant("k-1", "a", 1), submit("m-1", slots=1)], state)
    assert types(outs) == ["JobQueued"]  # j waits at the head for a change, and nobody passes it
    state, outs = run([register("b", 2)], state)
    snapshot = snapshot_bytes(submit("j-1", slots=2).spec)
    assert decided(outs) == [AllocationRequested(job_id="j-1", slots=2, attempt=0, snapshot_bytes=snapshot,
                                                 restore_chosen=True),
                               AllocationRequested(job_id="m-1", slots=1, attempt=0, snapshot_bytes=snapshot,
                                                   restore_chosen=True)]


def test_cancel_while_queued_ends_at_once_and_releases_nothing() -> None:
    state, outs = run([submit("j-1"), CancelRequested(job_id="j-1", reason="typo")])
    assert decided(outs)[-1] == JobCancelled(job_id="j-1", reason="typo")
    assert types(outs) == ["JobQueued", "JobCancelled"] and state.ended == {"j-1": "cancelled"}
    assert phases(outs) == [("j-1", "queued", ""), ("j-1", "cancelled", "typo")]


def test_cancel_while_running_stops_the_ranks_first() -> None:
    state, outs = run([CancelRequested(job_id="j-1", reason="done with it")], running())
    assert decided(outs) == [StopRequested(job_id="j-1", checkpoint=False, reason="cancelled: done with it")]
    assert phases(outs) == [("j-1", "stopping", "done with it")]
    assert state.jobs["j-1"].phase == "stopping"
    state, outs = run([CancelRequested(job_id="j-1"), exited("j-1", 0)], state)
    assert outs == []
    state, outs = run([exited("j-1", 1, code=-15)], state)
    assert decided(outs) == [JobCancelled(job_id="j-1", reason="done with it"),
                               AllocationReleased(job_id="j-1", attempt=0, reason="cancelled", restarts=0,
                                                      kind="ended")]


def test_cancel_while_the_allocation_is_asked_for_waits_for_the_answer() -> None:
    state, _ = run([register("a", 4), submit("j-1", slots=2), submit("k-1", slots=2),
                    CancelRequested(job_id="j-1"), CancelRequested(job_id="k-1")])
    state, outs = run([grant("j-1", "a", 2)], state)
    assert types(outs) == ["JobCancelled", "AllocationReleased"]
    state, outs = run([AllocationDenied(job_id="k-1", attempt=0, reason="gone")], state)
    assert types(outs) == ["JobCancelled"]
    assert state.ended == {"j-1": "cancelled", "k-1": "cancelled"}


def test_a_restart_resumes_from_the_newest_committed_checkpoint() -> None:
    data = DataPosition(next_batch=0)
    ckpts = [CheckpointCommitted(job_id="j-1", checkpoint_id=f"c{s}", step=s, world_size=2, uri="u", bytes=1,
                                 data=data, occurred_at=float(s)) for s in (10, 30, 20)]
    state, _ = run([*ckpts, CheckpointDeleted(job_id="j-1", checkpoint_id="c20")], running())
    state, outs = run([exited("j-1", 1, code=1)], state)
    assert types(outs) == ["StopRequested", "AllocationReleased", "AllocationRequested"]
    state, outs = run([grant("j-1", "a", 2, attempt=1), started("j-1", "a", [0, 1], attempt=1)], state)
    assert decided(outs) == [JobResumed(job_id="j-1", attempt=1, from_step=30, checkpoint_id="c30", world_size=2)]


def test_events_of_an_older_attempt_change_nothing() -> None:
    state, _ = run([exited("j-1", 0, code=1)], running())
    assert state.jobs["j-1"].attempt == 1
    later, outs = run([exited("j-1", 1, code=1), started("j-1", "a", [0]), grant("j-1", "a", 2)], state)
    assert decided(outs) == [AllocationReleased(job_id="j-1", attempt=0, reason="stale grant", kind="stale")]
    assert later.jobs["j-1"].restarts == 1


def test_a_stop_that_outlasts_its_deadline_ends_anyway() -> None:
    state = running()
    assert not SVC.wants_tick(state, 0.0)
    state, _ = run([CancelRequested(job_id="j-1", occurred_at=100.0)], state)
    assert SVC.wants_tick(state, 100.0)
    state, outs = run([ClockTick(service="scheduler", now=129.0, positions={})], state)
    assert outs == []
    state, outs = run([ClockTick(service="scheduler", now=130.0, positions={})], state)
    assert types(outs) == ["JobCancelled", "AllocationReleased"] and not SVC.wants_tick(state, 130.0)


def test_ranks_their_agent_stopped_while_shutting_down_restart_free_from_the_checkpoint_they_saved() -> None:
    """Trial 6 (86ea31b): `flightdeck down` then `up` mid-job cost a restart of the budget and redid 25 steps
    although the step-150 checkpoint the stopped ranks saved committed just after `up`."""
    state, _ = run([CheckpointCommitted(job_id="j-1", checkpoint_id="c125", step=125, world_size=2, uri="u", bytes=1,
                                        data=DataPosition(next_batch=125), attempt=0)], running())
    drained = WorkersExited(job_id="j-1", node="a", attempt=0, rank=0, exit_code=-15, planned=True,
                            others=[RankExit(rank=1, exit_code=-15, planned=True)])
    state, outs = run([drained], state)
    released = [e for e in decided(outs) if isinstance(e, AllocationReleased)]
    assert [(r.restarts, "not counted against the restart budget" in r.reason) for r in released] == [(0, True)]
    (queued,) = [e for e in decided(outs) if isinstance(e, JobQueued)]
    assert "the checkpoint the stopped ranks saved" in queued.reason
    assert not [e for e in decided(outs) if isinstance(e, AllocationRequested)]  # it waits for that save
    job = state.jobs["j-1"]
    assert job.restarts == 0 and job.attempt == 1
    state, outs = run([CheckpointCommitted(job_id="j-1", checkpoint_id="c150", step=150, world_size=2, uri="u",
                                           bytes=1, data=DataPosition(next_batch=150), attempt=0)], state)
    (ask,) = [e for e in decided(outs) if isinstance(e, AllocationRequested)]
    assert ask.attempt == 1 and "c150" in ask.reason
    state, outs = run([grant("j-1", "a", 2, attempt=1), started("j-1", "a", [0, 1], attempt=1)], state)
    (resumed,) = [e for e in decided(outs) if isinstance(e, JobResumed)]
    assert (resumed.from_step, resumed.checkpoint_id) == (150, "c150")


def test_a_crash_s_restart_is_counted_in_the_release_that_the_views_read() -> None:
    state, outs = run([exited("j-1", 1, code=3)], running())
    (released,) = [e for e in decided(outs) if isinstance(e, AllocationReleased)]
    assert released.restarts == 1 and state.jobs["j-1"].restarts == 1
