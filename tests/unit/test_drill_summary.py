"""The demo's incident summary is the postmortem's incidents, worded for a terminal: one place derives incidents
(postmortem/incidents.py); the demo, the dashboard and /metrics only show them."""

from pathlib import Path

from flightdeck.services.tools.console.drill_summary import render
from flightdeck.services.tools.history import fdh
from flightdeck.services.tools.postmortem import analyse

HISTORIES = Path(__file__).resolve().parents[1] / "fixtures" / "histories"


def test_a_crash_is_told_as_the_postmortem_finds_it() -> None:
    pm = analyse(fdh.load(HISTORIES / "crash.fdh.jsonl"), "crash-000001")
    (i,) = pm.incidents
    at, recover = f"{i.detected_at:>6.1f}s {f'+{i.time_to_detect:.1f}s':>7}", f"+{i.time_to_recover:.1f}s"
    assert render(pm) == [
        "incidents (times from submission; + is time since the fault):",
        f"  1. crash: drill fault 'crash' injected at step 22 on rank 1 (attempt 0) at {i.fault_at:.1f}s",
        f"     detected   {at}  WorkersExited: rank 1 (attempt 0) on n1 exited with code 3",
        f"     decided    {at}  restart: restart as attempt 1 from step 15 (step000000015-a0)",
        f"     resumed    {i.recovered_at:>6.1f}s {recover:>7}  resumed at step 15",
        "     reports    WorkersExited, RankLost",
        "     cost       7 steps lost, 7 redone",
        f"  completed 40 steps; goodput {pm.goodput.goodput:.1%}",
    ]


def test_a_spike_is_told_with_its_rollback_skip_window_and_cause() -> None:
    lines = render(analyse(fdh.load(HISTORIES / "spike.fdh.jsonl"), "spike-000001"))
    text = "\n".join(lines)
    assert lines[1].startswith("  1. loss_spike: drill fault 'loss_spike' injected at step 30 on rank 0 (attempt 0)")
    assert "LossSpikeDetected: loss spike over steps 30-32" in lines[2]
    assert lines[3].endswith("rollback: roll back to step000000025-a0 (step 25), skip batches [30, 38)")
    assert lines[4].endswith("back at step 25 after 0.59 s")
    assert "     cause      undetermined: the spike over steps 30-32" in text and "  2. " not in text
