"""What the chaos and nemesis runs count as a lost step and as a decision taken twice (tests/chaos/checks.py)."""

from types import SimpleNamespace
from typing import Any

from flightdeck.events.base import Event
from flightdeck.events.job import (
    AllocationDenied,
    AllocationGranted,
    AllocationRequested,
    JobResumed,
    SlotRef,
    WorkersExited,
)
from flightdeck.events.training import StepCompleted
from tests.chaos.checks import lineage, repeated_decisions

J = "j"


def rows(events: list[Event]) -> list[Any]:
    return [SimpleNamespace(event=e) for e in events]


def step(attempt: int, rank: int, s: int) -> StepCompleted:
    return StepCompleted(job_id=J, rank=rank, attempt=attempt, node="n1", step=s, loss=1.0, grad_norm=1.0, lr=0.1,
                         tokens_per_s=1.0, step_time_s=0.1)


def run(exit_code: int, *, peer_reports_3: bool = True) -> list[int]:
    """Two ranks; rank 1 reports steps 0-2 and exits with `exit_code`, rank 0 reports 0-2 (and 3); attempt 1
    resumes at 4 (a survivor's snapshot of its boundary) and runs to the end (6)."""
    grant = [AllocationGranted(job_id=J, attempt=a, assignments=[SlotRef(node="n1", slot=r, rank=r) for r in (0, 1)])
             for a in (0, 1)]
    control = [*grant, WorkersExited(job_id=J, node="n1", attempt=0, rank=1, exit_code=exit_code),
               JobResumed(job_id=J, attempt=1, from_step=4, checkpoint_id="c", world_size=2)]
    telemetry = [step(0, r, s) for s in range(3) for r in (0, 1)]
    telemetry += [step(0, 0, 3)] if peer_reports_3 else []
    telemetry += [step(1, r, s) for s in (4, 5) for r in (0, 1)]
    return lineage(rows(control), rows(telemetry), 6)[0]


def test_a_step_a_killed_rank_trained_but_never_reported_is_not_lost() -> None:
    assert run(-9) == []  # SIGKILLed after the collective of step 3, before its report went out


def test_a_step_no_rank_reported_or_a_rank_that_exited_on_its_own_did_not_is_lost() -> None:
    assert run(-9, peer_reports_3=False) == [3]
    assert run(3) == [3]  # a crash by its own hand reports what it did first (its link is flushed on the way out)


def test_a_request_asked_again_after_its_denial_is_a_new_decision_and_one_asked_twice_is_not() -> None:
    """The nemesis (seed 6): the only node was cordoned for a failed read, attempt 4's request was denied, and asked
    again once the node was back: two requests of one attempt, the second a decision of its own."""
    def ask(n: int) -> AllocationRequested:
        return AllocationRequested(job_id=J, slots=2, attempt=4, event_id=f"scheduler:FD_CONTROL:{n}:0")

    denied = AllocationDenied(job_id=J, attempt=4, reason="needs 2 groups of 1 slot(s)", event_id="resources:1")
    assert repeated_decisions(rows([ask(1), denied, ask(2)])) == []
    assert repeated_decisions(rows([ask(1), ask(2)])) == ["('AllocationRequested', 'j', 4, 0) decided 2 times"]
