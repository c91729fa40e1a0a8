"""No restart is spent where one cannot help (policy.fail_fast): the trainer API refused the script's call, or an
attempt failed before its first step exactly as the one before it did (the same error, an exit 0 that never called
flightdeck.init(), no sign of life since the start). Everything else keeps its retries: a failure after a step, a
different error, a signal from outside. Before, an import error burned the whole restart budget, and a script that
never called init() took 4 x startup_grace_s (8 minutes) to fail, its reason never saying why."""

import msgspec

from flightdeck.events.base import Event
from flightdeck.events.findings import RankLost
from flightdeck.events.job import AllocationReleased, JobCompleted, JobFailed, RankExit, WorkersExited, exits_record
from flightdeck.services.core import Emit
from flightdeck.services.scheduler.state import State
from tests.unit.helpers import events_of, register, submit
from tests.unit.test_scheduler_lifecycle import grant, run, started

IMPORT = "ModuleNotFoundError: No module named 'nope'"


def attempt(state: State | None, attempt: int, job: str = "j-1") -> State:
    """The job's `attempt` granted on node a and started (the first one submitted too)."""
    first: list[Event] = [register("a", 4), submit(job, slots=2, max_restarts=3)] if state is None else []
    state, _ = run([*first, grant(job, "a", 2, attempt), started(job, "a", [0, 1], attempt)], state)
    assert state.jobs[job].phase == "running" and state.jobs[job].attempt == attempt
    return state


def dies(attempt: int, exit_code: int = 1, **told: object) -> WorkersExited:
    """Both ranks of node a exit, the same way."""
    exits = [RankExit(rank=r, exit_code=exit_code, cause="Traceback (most recent call last):\n  ...", **told)
             for r in (0, 1)]
    return exits_record(exits, job_id="j-1", node="a", attempt=attempt, event_id=f"x{attempt}", occurred_at=1.0)


def failure(outs: list[Emit]) -> JobFailed | None:
    return next((e for e in events_of(outs) if isinstance(e, JobFailed)), None)


def spent(outs: list[Emit]) -> int:
    """The restarts the job's final release says it spent (an ended job leaves the scheduler's state)."""
    (release,) = [e for e in events_of(outs) if isinstance(e, AllocationReleased)]
    return release.restarts


def test_the_same_error_before_the_first_step_twice_fails_the_job_without_spending_the_rest() -> None:
    state = attempt(None, 0)
    state, outs = run([dies(0, error=IMPORT, early=True)], state)
    assert failure(outs) is None and state.jobs["j-1"].restarts == 1  # the first time may be the node's
    assert state.jobs["j-1"].early_failure == f"exit 1: {IMPORT}"
    state = attempt(state, 1)
    state, outs = run([dies(1, error=IMPORT, early=True)], state)
    failed = failure(outs)
    assert failed is not None and "j-1" not in state.jobs and spent(outs) == 1
    assert failed.reason == (f"rank 0 exited with code 1 (with rank 1 on a): {IMPORT}; not restarted: attempt 0 "
                             "failed the same way before its first step, so a restart cannot fix it")
    assert failed.causes == ["x0", "x1"]


def test_a_different_error_a_failure_after_a_step_or_a_signal_keeps_the_retries() -> None:
    cases: list[tuple[dict[str, object], dict[str, object], int]] = [
        ({"error": IMPORT, "early": True}, {"error": "NameError: name 'x' is not defined", "early": True}, 1),
        ({"error": IMPORT, "early": True}, {"error": IMPORT, "early": False}, 1),  # it trained: not the code
        ({"error": IMPORT, "early": False}, {"error": IMPORT, "early": True}, 1),
        ({"early": True}, {"early": True}, -9),  # killed from outside, twice: a retry may land elsewhere
        ({"early": True}, {"early": True}, 75),  # a SIGTERM from outside (STOPPED_EXIT)
    ]
    for first, second, code in cases:
        state = attempt(None, 0)
        state, _ = run([dies(0, code, **first)], state)
        state = attempt(state, 1)
        state, outs = run([dies(1, code, **second)], state)
        assert failure(outs) is None and state.jobs["j-1"].restarts == 2, (first, second, code)


def test_fail_fast_off_spends_the_budget_as_before() -> None:
    state = attempt(None, 0)
    job = state.jobs["j-1"]
    policy = msgspec.structs.replace(job.spec.policy, fail_fast=False)
    state = msgspec.structs.replace(state, jobs={**state.jobs, "j-1": msgspec.structs.replace(
        job, spec=msgspec.structs.replace(job.spec, policy=policy))})
    for n in range(3):
        state, outs = run([dies(n, error=IMPORT, early=True, usage=True)], state)
        assert failure(outs) is None
        state = attempt(state, n + 1)
    state, outs = run([dies(3, error=IMPORT, early=True)], state)
    failed = failure(outs)
    assert failed is not None and failed.reason.endswith("restart budget of 3 spent")


def test_the_api_refusing_the_script_s_call_fails_at_once() -> None:
    state = attempt(None, 0)
    said = "TypeError: report(loss=...) takes a number or a one-element tensor, got str"
    state, outs = run([dies(0, error=said, early=True, usage=True)], state)
    failed = failure(outs)
    assert failed is not None and spent(outs) == 0
    assert failed.reason == (f"rank 0 exited with code 1 (with rank 1 on a): {said}; not restarted: the trainer API "
                             "refused the script's call, and a restart runs the same code")


def test_an_exit_0_that_never_called_init_is_a_fault_not_a_completion() -> None:
    state = attempt(None, 0)
    state, outs = run([dies(0, 0, early=True, unlinked=True)], state)
    assert not any(isinstance(e, JobCompleted) for e in events_of(outs))
    assert state.jobs["j-1"].phase == "recovering" and state.jobs["j-1"].restarts == 1
    state = attempt(state, 1)
    state, outs = run([dies(1, 0, early=True, unlinked=True)], state)
    failed = failure(outs)
    assert failed is not None and failed.reason.startswith(
        "rank 0 exited with code 0 without calling flightdeck.init() (with rank 1 on a): Traceback")
    assert "attempt 0 failed the same way before its first step" in failed.reason


def test_a_rank_never_heard_from_since_its_start_twice_fails_the_job() -> None:
    def silent(n: int) -> RankLost:
        return RankLost(job_id="j-1", rank=0, attempt=n, reason="no heartbeat within 121s of start: it never called "
                        "flightdeck.init(), or was stuck before it", last_seen=0.0, never_heard=True,
                        event_id=f"l{n}")
    state = attempt(None, 0)
    state, outs = run([silent(0)], state)
    assert failure(outs) is None and state.jobs["j-1"].restarts == 1
    state = attempt(state, 1)
    state, outs = run([silent(1)], state)
    failed = failure(outs)
    assert failed is not None and spent(outs) == 1
    assert failed.reason.startswith("rank 0 lost: no heartbeat within 121s of start: it never called flightdeck.init()")
    assert failed.reason.endswith("not restarted: attempt 0 failed the same way before its first step, so a restart "
                                  "cannot fix it")
    # A rank that went silent after it was heard from is lost as before: retried.
    state = attempt(None, 0)
    state, _ = run([silent(0)], state)
    state = attempt(state, 1)
    lost = RankLost(job_id="j-1", rank=0, attempt=1, reason="heartbeats stopped", last_seen=3.0, event_id="l1")
    state, outs = run([lost], state)
    assert failure(outs) is None and state.jobs["j-1"].restarts == 2
