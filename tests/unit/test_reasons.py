"""A reason on one line: a restart's quoted rank output (many lines) is left out, the fault and the decision stay."""

from flightdeck.events.job import WorkersExited
from flightdeck.services.scheduler.policy import fault_reason
from flightdeck.services.tools.history.reasons import headline


def test_a_restart_quoting_many_lines_of_output_keeps_the_fault_and_the_decision() -> None:
    output = "\n".join(f"2026-11-26 07:47:5{i} [info] checkpoint staged step={i}0; path=/x" for i in range(5))
    exited = WorkersExited(job_id="j", node="n", attempt=0, rank=1, exit_code=3, cause=output)
    reason = f"{fault_reason(exited)}; restart 1 of 3"  # as scheduler/policy.py after_fault words it
    assert "\n" in reason
    assert headline(reason) == "rank 1 exited with code 3; restart 1 of 3"


def test_a_reason_on_one_line_is_kept_whole() -> None:
    reason = "rank 0 hung at step 119: no progress for 3s (deadline 3s); restart 2 of 3"
    assert headline(reason) == reason
    assert headline("") == ""


def test_quoted_output_without_a_decision_keeps_only_the_fault() -> None:
    assert headline("rank 1 exited with code 3: Traceback (most recent call last):\n  ValueError: x") == \
        "rank 1 exited with code 3"
