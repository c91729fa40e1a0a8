"""`whatif` over the recorded drills: the recorded settings change nothing; a higher spike threshold removes the
spike drill's rollback; no restart budget fails the crash drill at its crash; bad --set keys and values are
refused with a message naming them."""

from pathlib import Path

import pytest
import structlog

from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import LossOutlier, LossSpikeDetected, SpikeDiagnosed
from flightdeck.events.job import AllocationRequested, JobCompleted, JobFailed, JobSubmitted
from flightdeck.events.training import RolledBack
from flightdeck.services.tools.audit import settings
from flightdeck.services.tools.audit.whatif import whatif
from flightdeck.services.tools.console.__main__ import main as cli_main
from flightdeck.services.tools.console.whatif_cmd import report
from flightdeck.services.tools.history import fdh
from flightdeck.services.tools.postmortem.analysis import analyse

HISTORIES = Path(__file__).resolve().parents[1] / "fixtures" / "histories"
SPIKE, CRASH = HISTORIES / "spike.fdh.jsonl", HISTORIES / "crash.fdh.jsonl"


def flightdeck(argv: list[str]) -> int:
    try:
        return cli_main(argv)
    finally:
        structlog.reset_defaults()  # main() points logs at this test's captured stderr, which pytest then closes


@pytest.mark.parametrize(("path", "job"), [(SPIKE, "spike-000001"), (CRASH, "crash-000001")], ids=["spike", "crash"])
def test_the_recorded_settings_change_nothing(path: Path, job: str) -> None:
    w = whatif(fdh.load(path), job, {})
    assert w.changes == [] and w.outcome.dropped == [] and w.settings == {}
    assert w.outcome.kept >= 10  # every decision about the job, made again where it was recorded
    assert w.wall_s == w.measured.wall_s and w.goodput == w.measured.goodput() > 0 and w.ends == "completed"


@pytest.mark.parametrize(("path", "job"), [(SPIKE, "spike-000001"), (CRASH, "crash-000001")], ids=["spike", "crash"])
def test_whatif_and_the_postmortem_report_the_same_recorded_goodput(path: Path, job: str) -> None:
    rows = fdh.load(path)
    split = analyse(rows, job).goodput
    measured = whatif(rows, job, {}).measured
    assert (measured.wall_s, measured.useful_s, measured.goodput()) == (split.wall_s, split.parts["useful"],
                                                                        split.goodput)


def test_more_spike_steps_than_the_spike_lasted_remove_the_rollback_and_save_its_measured_cost() -> None:
    rows = fdh.load(SPIKE)
    (spike,) = [s for s in rows if isinstance(s.event, LossSpikeDetected)]
    w = whatif(rows, "spike-000001", {"policy.spike_steps": 4})  # the drill poisons 3 batches
    assert w.settings == {"policy.spike_steps": (3, 4)}
    assert [(c.kind, type(c.event)) for c in w.changes][:2] == [("vanishes", LossSpikeDetected),
                                                               ("vanishes", RollbackRequested)]
    # retention keeps other checkpoints, no spike is left to diagnose, and the excursion that ended short of a
    # spike is shown as a loss outlier instead; nothing else
    assert {c.service for c in w.changes[2:]} == {"checkpoints", "health"}
    assert [(c.kind, type(c.event)) for c in w.changes[2:] if c.service == "health"] == [
        ("appears", LossOutlier), ("vanishes", SpikeDiagnosed)]
    trigger = w.changes[0].trigger  # the telemetry of the step that completed the spike
    assert trigger is not None and spike.msg_id == f"health:{trigger.stream}:{trigger.seq}:0"
    assert {type(s.event) for s in w.outcome.dropped} == {RolledBack}  # the ranks' rollback did not happen
    (saved,) = w.estimates
    (rollback,) = w.measured.incidents
    assert saved.seconds == -rollback.lost_s < 0 and "unknown" in saved.note  # the spike left in: cost unknown
    assert w.wall_s < w.measured.wall_s and w.goodput > w.measured.goodput()


def test_another_threshold_that_still_finds_the_spike_changes_no_decision() -> None:
    """The same finding and the same rollback, restating the new threshold in their words, are no "decisions that
    change" (they were listed as two)."""
    for z in (3, 8):
        w = whatif(fdh.load(SPIKE), "spike-000001", {"policy.spike_z": z})
        assert [type(c.event).__name__ for c in w.outcome.restated][:2] == ["LossSpikeDetected", "RollbackRequested"]
        assert not [c for c in w.changes if isinstance(c.event, LossSpikeDetected | RollbackRequested)], z
        assert ("threshold", 7.5, {3: 4.5, 8: 19.5}[z]) in w.outcome.restated[0].fields()  # 3 steps of z - 1.5
    assert w.changes == [] and w.estimates == [] and w.wall_s == w.measured.wall_s  # z 8: nothing changes
    out = "\n".join(report(w, "file"))
    assert "no decision changes: all 32 decisions about the job are made as recorded, 2 of them restating the " \
           "changed setting in their words (reason, score, threshold)" in out


def test_no_restart_budget_fails_the_crash_drill_at_its_crash() -> None:
    w = whatif(fdh.load(CRASH), "crash-000001", {"policy.max_restarts": 0})
    appeared = [type(c.event) for c in w.changes if c.kind == "appears"]
    vanished = [type(c.event) for c in w.changes if c.kind == "vanishes"]
    assert JobFailed in appeared and JobCompleted in vanished and AllocationRequested in vanished
    first = w.changes[0]
    assert first.trigger is not None and first.trigger.event is not None
    assert type(first.trigger.event).__name__ == "WorkersExited"  # the crash itself
    assert w.ends.startswith("failed") and w.wall_s < w.measured.wall_s and w.useful_s < w.measured.useful_s
    assert any(type(s.event).__name__ == "WorkersStarted" for s in w.outcome.dropped)  # attempt 1 never starts


def test_a_longer_checkpoint_interval_is_estimated_from_the_recorded_incidents() -> None:
    w = whatif(fdh.load(SPIKE), "spike-000001", {"train.checkpoint_every": 10})
    # no core decides when ranks checkpoint; the spike's diagnosis waits as long as the scheduler's incident lasts
    assert {(c.service, type(c.event)) for c in w.changes} <= {("health", SpikeDiagnosed)}
    assert {c.event.verdict for c in w.changes if isinstance(c.event, SpikeDiagnosed)} <= {"undetermined"}
    assert any("restores step 20 instead of 25" in e.what and e.seconds > 0 for e in w.estimates)
    assert any("checkpoint_every is the trainer's" in c for c in w.caveats)


@pytest.mark.parametrize(("item", "says"), [
    ("policy.spike_zz=3", "unknown setting 'policy.spike_zz' (did you mean policy.spike_z"),
    ("spike_z=3", "did you mean policy.spike_z"),
    ("model.n_layer=4", "not a setting a what-if can replay"),
    ("policy.spike_z=abc", "Expected `float`, got `str`"),
    ("policy.spike_z=-1", "Expected `float` > 0.0"),
    ("policy.min_slots=9", "must not exceed slots"),
    ("policy.spike_z", "write KEY=VALUE"),
])
def test_bad_settings_are_refused_naming_them(item: str, says: str) -> None:
    spec = next(s.event.spec for s in fdh.load(SPIKE) if isinstance(s.event, JobSubmitted))
    with pytest.raises(settings.BadSetting, match=None) as err:
        settings.apply(spec, settings.parse([item]))
    assert says in str(err.value)


def test_the_cli_refuses_an_unknown_key_and_reports_a_what_if(capsys: pytest.CaptureFixture[str]) -> None:
    assert flightdeck(["whatif", "--from", str(SPIKE), "--set", "policy.nope=1"]) == 2
    assert "unknown setting 'policy.nope'" in capsys.readouterr().err
    assert flightdeck(["whatif", "--from", str(SPIKE), "--set", "policy.spike_steps=4"]) == 0
    out = capsys.readouterr().out
    assert "VANISHES scheduler   RollbackRequested" in out and "what a what-if can and cannot know" in out


def test_a_history_without_recorded_settings_says_the_what_if_used_the_defaults() -> None:
    w = whatif(fdh.load(CRASH), "crash-000001", {})  # recorded before the services recorded their settings
    assert "scheduler: no settings recorded in this history: replayed with the defaults " \
           "(stop_timeout_s=120.0, landing_timeout_s=120.0, memory_wait=no, phases=no, restores=granted, " \
           "claims=trust, agent_faults=charged)" in w.caveats
