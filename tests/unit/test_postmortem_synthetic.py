"""Postmortems of synthetic histories (services/tools/postmortem/synthetic.py): goodput accounting as a property over
random runs, a run without incidents, and a failed job's cause chain."""

import dataclasses
import math
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flightdeck.events import codec, subjects
from flightdeck.events.job import AllocationReleased, JobFailed, WorkersExited
from flightdeck.events.store import decoded
from flightdeck.events.training import StepCompleted
from flightdeck.services.tools.postmortem import analyse, write_report
from flightdeck.services.tools.postmortem.goodput import BADPUT, PARTS
from flightdeck.services.tools.postmortem.plots import loss_figure
from flightdeck.services.tools.postmortem.report import Heading, Para, Table, markdown
from flightdeck.services.tools.postmortem.synthetic import Scenario, synthesise

EVERY = 10


def faults(kinds: list[str], max_step: int) -> st.SearchStrategy[tuple[tuple[str, int], ...]]:
    pairs = st.tuples(st.sampled_from(kinds), st.integers(min_value=1, max_value=max_step))
    return st.lists(pairs, max_size=4, unique_by=lambda f: f[1]).map(tuple)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ranks=st.integers(1, 3), steps=st.integers(20, 90), budget=st.integers(0, 3),
       chosen=faults(["crash", "hang", "spike"], 120), queued=st.floats(0.0, 5.0), seed=st.integers(0, 9))
@example(ranks=1, steps=20, budget=0, chosen=(("spike", 18),), queued=0.0, seed=0)  # a spike in the last steps
def test_the_parts_always_add_up_to_the_wall_time(ranks: int, steps: int, budget: int,
                                                  chosen: tuple[tuple[str, int], ...], queued: float,
                                                  seed: int) -> None:
    sc = Scenario(ranks=ranks, steps=steps, checkpoint_every=EVERY, max_restarts=budget, faults=chosen,
                  queued_s=queued, seed=seed)
    pm = analyse(synthesise(sc), sc.job_id)
    g = pm.goodput
    assert set(g.parts) == set(PARTS)
    assert math.fsum(g.parts.values()) == pytest.approx(g.wall_s, rel=1e-12, abs=1e-9)
    assert all(v >= 0 for v in g.parts.values())
    assert 0.0 <= g.goodput <= 1.0
    assert g.parts["useful"] + math.fsum(g.parts[p] for p in BADPUT) == pytest.approx(g.wall_s)
    lead = pm.scan.lead
    # rank 0's step time, less what fault windows took; times near 1.8e9 s round to ~2e-7 s when shifted to 0
    assert g.parts["useful"] + g.parts["redone"] <= float(lead.took.sum()) + 1e-6 * len(lead)
    assert g.parts["queued"] == pytest.approx(queued, abs=1e-6)
    assert len(pm.incidents) <= len(chosen)
    assert pm.summary.outcome in ("completed", "failed")
    if pm.summary.outcome == "completed":
        assert pm.summary.steps_final == steps
    for inc in pm.incidents:
        assert 0.0 <= inc.time_to_detect
        assert inc.time_to_recover is None or inc.time_to_recover >= inc.time_to_detect


@settings(max_examples=12, deadline=None)
@given(steps=st.lists(st.integers(1, 150), min_size=1, max_size=3, unique=True),
       kinds=st.lists(st.sampled_from(["crash", "hang"]), min_size=3, max_size=3))
def test_each_restart_is_an_incident_with_the_steps_since_the_last_checkpoint_lost_and_redone(
        steps: list[int], kinds: list[str]) -> None:
    chosen = tuple(zip(kinds, sorted(steps), strict=False))
    sc = Scenario(steps=160, checkpoint_every=EVERY, max_restarts=len(chosen), faults=chosen)
    pm = analyse(synthesise(sc), sc.job_id)
    assert pm.summary.outcome == "completed"
    assert [(i.kind, i.fault_step, i.decision) for i in pm.incidents] == [(k, s, "restart") for k, s in chosen]
    for n, (inc, (kind, step)) in enumerate(zip(pm.incidents, chosen, strict=True)):
        assert inc.attempt == n
        assert inc.steps_lost == inc.steps_redone == step - step // EVERY * EVERY
        assert inc.time_to_detect == pytest.approx(sc.hang_s if kind == "hang" else 0.05, abs=1e-6)
        assert inc.time_to_recover is not None and inc.time_to_recover > sc.startup_s
        assert [m.type for m in inc.chain][-2:] == ["RankStarted", "StepCompleted"]
    assert pm.goodput.parts["detection"] == pytest.approx(sum(i.time_to_detect for i in pm.incidents))


def test_a_spike_rolls_back_and_the_thrown_away_steps_are_redone() -> None:
    sc = Scenario(steps=100, checkpoint_every=EVERY, faults=(("spike", 44),), obey_steps=4, skip=7)
    pm = analyse(synthesise(sc), sc.job_id)
    (inc,) = pm.incidents
    assert (inc.kind, inc.decision, inc.fault_step, inc.rollback_to, inc.skip) == ("loss_spike", "rollback", 44, 40,
                                                                                  (44, 51))
    assert inc.steps_lost == inc.steps_redone == 44 + 4 - 40
    assert pm.summary.steps_computed - pm.summary.steps_final == 8
    assert pm.goodput.parts["redone"] > 0


def test_a_history_without_incidents(tmp_path: Path) -> None:
    sc = Scenario(steps=50, checkpoint_every=EVERY)
    pm = analyse(synthesise(sc), sc.job_id)
    assert pm.incidents == [] and pm.causes == []
    g = pm.goodput
    for part in ("detection", "restart", "restore", "redone"):
        assert g.parts[part] == 0.0
    assert g.parts["useful"] == pytest.approx(float(pm.scan.lead.took.sum()), abs=1e-6 * len(pm.scan.lead))
    assert g.parts["startup"] == pytest.approx(sc.startup_s)
    assert pm.summary.steps_final == pm.summary.steps_computed == 50
    md = write_report(pm, tmp_path)["report.md"].read_text()
    assert "None: no fault was injected or reported" in md


def test_a_failed_job_shows_its_cause_chain(tmp_path: Path) -> None:
    sc = Scenario(steps=100, checkpoint_every=EVERY, max_restarts=1, faults=(("crash", 23), ("crash", 47)))
    rows = synthesise(sc)
    pm = analyse(rows, sc.job_id)
    (failed,) = [s.event for s in rows if isinstance(s.event, JobFailed)]
    exits = [s.event.event_id for s in rows if isinstance(s.event, WorkersExited) and s.event.exit_code == 17]
    assert pm.summary.outcome == "failed" and "restart budget of 1 spent" in pm.summary.reason
    assert [m.event_id for m in pm.causes] == failed.causes == exits
    assert [m.type for m in pm.causes] == ["WorkersExited", "WorkersExited"]
    assert [i.decision for i in pm.incidents] == ["restart", "fail"]
    last = pm.incidents[-1]
    assert last.recovered_at is None and last.steps_lost == 47 - 40 and last.steps_redone == 0
    assert pm.goodput.wall_s == pytest.approx(last.detected_at)
    md = write_report(pm, tmp_path)["report.md"].read_text()
    assert "## Why it failed" in md
    assert all(eid in md for eid in failed.causes)


def test_the_exits_a_hangs_stop_brings_and_the_restart_that_waited_for_them_are_the_hangs_incident() -> None:
    """The scheduler may decide the restart on the stopped ranks' exits rather than on the RankHung itself (it
    waits for them): those exits, their attempt being stopped, are the hang's, not an incident of their own (the
    demo's /metrics once counted an "exit" beside the hang)."""
    sc = Scenario(ranks=2, steps=60, checkpoint_every=EVERY, max_restarts=2, faults=(("hang", 30),))
    rows = synthesise(sc)
    exit_row = next(r for r in rows if isinstance(r.event, WorkersExited) and r.event.exit_code != 0)
    assert isinstance(exit_row.event, WorkersExited)
    control = [r for r in rows if r.stream == subjects.CONTROL]
    waited = AllocationReleased(job_id=sc.job_id, attempt=exit_row.event.attempt, reason="the stopped ranks exited",
                                producer="scheduler", causation_id=exit_row.event.event_id, event_id="late-release",
                                occurred_at=exit_row.event.occurred_at + 0.1, job_version=10_000)
    late = decoded(subjects.CONTROL, control[-1].seq + 1, subjects.job(sc.job_id, "AllocationReleased"),
                   codec.encode(waited), "late-release")
    pm = analyse([*rows, late], sc.job_id)
    assert [i.kind for i in pm.incidents] == ["hang"]


def test_the_loss_plot_is_on_a_log_axis_and_draws_nothing_past_the_last_step() -> None:
    """A x10 spike flattened a linear axis's curve; the skip window (batch indices) was shaded on the step axis
    from the spiking step, past the run's last step when the spike came late."""
    sc = Scenario(steps=100, checkpoint_every=EVERY, faults=(("spike", 97),), obey_steps=1, skip=7)
    pm = analyse(synthesise(sc), sc.job_id)
    (inc,) = pm.incidents
    assert inc.skip == (97, 104)
    (ax,) = loss_figure(pm).axes
    assert ax.get_yscale() == "log"
    assert all(patch.get_x() + patch.get_width() <= 100 for patch in ax.patches)  # no span past the last step
    assert [t.get_text() for t in ax.texts if "skips" in t.get_text()] == ["skips batches [97, 104)"]


def test_report_md_shows_what_a_job_chose_literally_never_as_html() -> None:
    md = markdown([Heading(2, "job <b>x</b>"), Para("<img src=x onerror=alert(1)>"),
                   Table(("what",), [("<script>alert(1)</script> | & more",)])])
    assert "<" not in md and ">" not in md
    assert "&lt;script&gt;alert(1)&lt;/script&gt; \\| &amp; more" in md and "job &lt;b&gt;x&lt;/b&gt;" in md


def test_the_script_s_own_metrics_have_a_table_in_the_report(tmp_path: Path) -> None:
    sc = Scenario(steps=20, checkpoint_every=EVERY)
    rows = [dataclasses.replace(r, event=msgspec.structs.replace(r.event, metrics={"acc": r.event.step / 10}))
            if isinstance(r.event, StepCompleted) and r.event.rank == 0 else r for r in synthesise(sc)]
    md = write_report(analyse(rows, sc.job_id), tmp_path)["report.md"].read_text()
    assert "## The script's own metrics (rank 0)" in md
    assert "| acc | 20 | 0 | 1.9 | 0 | 1.9 |" in md
    plain = write_report(analyse(synthesise(sc), sc.job_id), tmp_path / "plain")["report.md"].read_text()
    assert "own metrics" not in plain  # none reported: no section
