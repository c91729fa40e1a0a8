"""The postmortem of the recorded spike drill (tests/fixtures/histories/spike.fdh.jsonl): one incident, with
numbers checked against the raw recorded events, badput that adds up, and a report that stands alone."""

import base64
import math
import re
from pathlib import Path
from typing import TypeVar

import pytest

from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.clock import ClockTick
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import LossSpikeDetected
from flightdeck.events.job import AllocationGranted, JobCompleted, JobSubmitted
from flightdeck.events.store import Stored
from flightdeck.events.training import FaultInjected, RolledBack, StepCompleted
from flightdeck.services.tools.history import fdh
from flightdeck.services.tools.postmortem import Postmortem, analyse, write_report

E = TypeVar("E", bound=Event)
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "histories" / "spike.fdh.jsonl"
JOB = "spike-000001"


@pytest.fixture(scope="module")
def rows() -> list[Stored]:
    return fdh.load(FIXTURE)


@pytest.fixture(scope="module")
def pm(rows: list[Stored]) -> Postmortem:
    return analyse(rows, JOB)


def one(rows: list[Stored], cls: type) -> Stored:
    (found,) = [s for s in rows if isinstance(s.event, cls)]
    return found


def the(rows: list[Stored], cls: type[E]) -> E:
    """The one recorded event of type `cls`."""
    event = one(rows, cls).event
    assert isinstance(event, cls)
    return event


def test_the_spike_is_one_incident_with_the_recorded_numbers(rows: list[Stored], pm: Postmortem) -> None:
    submitted = the(rows, JobSubmitted)
    spike = one(rows, LossSpikeDetected)
    rollback = one(rows, RollbackRequested).event
    (fault,) = [s.event for s in rows if isinstance(s.event, FaultInjected) and s.event.kind == "loss_spike"]
    assert isinstance(rollback, RollbackRequested) and isinstance(spike.event, LossSpikeDetected)
    # the finding was stored after the health monitor's tick that folded the spiking step, not at the step's time
    tick = max((s for s in rows if isinstance(s.event, ClockTick) and s.seq < spike.seq), key=lambda s: s.seq)
    assert isinstance(tick.event, ClockTick) and tick.event.service == "health"
    first_back = min((s.event for s in rows if isinstance(s.event, RolledBack)), key=lambda e: e.occurred_at)
    redone = min((s.event for s in rows if isinstance(s.event, StepCompleted) and s.event.rank == 0
                  and s.event.occurred_at > first_back.occurred_at), key=lambda e: e.occurred_at)
    thrown = [s.event.step for s in rows if isinstance(s.event, StepCompleted) and s.event.rank == 0
              and s.event.occurred_at < first_back.occurred_at and s.event.step >= rollback.to_step]

    (inc,) = pm.incidents
    assert (inc.kind, inc.decision, inc.attempt) == ("loss_spike", "rollback", 0)
    assert inc.fault_step == spike.event.onset == 30 and spike.event.step == 32  # found over steps 30-32
    assert (inc.rollback_to, inc.skip) == (25, (30, 38)) == (rollback.to_step, (rollback.skip_from, rollback.skip_to))
    assert inc.fault_at == pytest.approx(fault.occurred_at - submitted.occurred_at)
    assert inc.time_to_detect == pytest.approx(tick.event.now - fault.occurred_at)
    assert inc.time_to_detect == pytest.approx(0.7324, abs=1e-3)  # this recording's numbers, pinned
    assert inc.time_to_recover == pytest.approx(redone.occurred_at - fault.occurred_at)
    assert inc.time_to_recover == pytest.approx(1.4427, abs=1e-3)
    assert redone.step == rollback.to_step
    assert inc.steps_lost == len(set(thrown)) == max(thrown) - rollback.to_step + 1 == 15
    assert inc.steps_redone == 15


def test_the_causal_chain_runs_from_the_fault_to_the_first_redone_step(rows: list[Stored], pm: Postmortem) -> None:
    (inc,) = pm.incidents
    kinds = [m.type for m in inc.chain]
    # the spike's 3 steps; the rollback's deletions of the checkpoints it threw away (their number varies by recording)
    assert [k for k in kinds if k != "CheckpointDeleted"] == [
        "FaultInjected", "StepCompleted", "StepCompleted", "StepCompleted", "LossSpikeDetected", "RollbackRequested",
        "RolledBack", "StepCompleted", "SpikeDiagnosed"]  # the diagnosis once the skip held past the incident
    assert "CheckpointDeleted" in kinds[kinds.index("RollbackRequested"):kinds.index("RolledBack")]
    # the finding and the decision by their recorded ids (the health monitor's id names the spiking step's telemetry
    # sequence, the scheduler's the finding's control sequence)
    spike = one(rows, LossSpikeDetected)
    assert inc.chain[4].event_id == the(rows, LossSpikeDetected).event_id == "health:FD_TELEMETRY:94:0"
    assert inc.chain[5].event_id == the(rows, RollbackRequested).event_id == f"scheduler:FD_CONTROL:{spike.seq}:0" \
        == "scheduler:FD_CONTROL:54:0"
    assert [m.at for m in inc.chain] == sorted(m.at for m in inc.chain)
    assert "spike over steps 30-32" in inc.trigger


def test_the_badput_parts_add_up_to_the_wall_time(rows: list[Stored], pm: Postmortem) -> None:
    g = pm.goodput
    wall = the(rows, JobCompleted).occurred_at - the(rows, JobSubmitted).occurred_at
    assert g.wall_s == pytest.approx(wall)
    assert math.fsum(g.parts.values()) == pytest.approx(g.wall_s, rel=1e-12)
    assert all(v >= 0 for v in g.parts.values())
    inc = pm.incidents[0]
    assert g.parts["detection"] == pytest.approx(inc.time_to_detect)
    assert g.parts["redone"] > 0 and g.parts["checkpoint_stall"] > 0 and g.parts["startup"] > 1
    steps = sorted((s.event for s in rows if isinstance(s.event, StepCompleted) and s.event.rank == 0),
                   key=lambda e: e.occurred_at)
    useful = sum(e.step_time_s for e in steps)
    assert g.parts["useful"] + g.parts["redone"] <= useful + 1e-9  # rank 0's step time, less what a fault window took
    # useful: the last completion of each of the 60 steps, less what of one overlaps the spike's detection window
    last = {e.step: e for e in steps}
    kept = sum(e.step_time_s for e in last.values())
    assert len(last) == 60 and kept - max(e.step_time_s for e in steps) <= g.parts["useful"] <= kept + 1e-6
    # startup: the grant (stored before any clock tick, so dated by itself) until rank 0's first step began
    granted = one(rows, AllocationGranted)
    assert not any(isinstance(s.event, ClockTick) and s.seq < granted.seq for s in rows)
    assert g.parts["startup"] == pytest.approx(steps[0].occurred_at - steps[0].step_time_s
                                               - the(rows, AllocationGranted).occurred_at, abs=1e-4)
    assert g.goodput == pytest.approx(g.parts["useful"] / wall)
    assert g.goodput == pytest.approx(0.6159, abs=1e-3)  # this recording's number, pinned (its start-up took 2.0 s)


def test_summary_and_timeline(rows: list[Stored], pm: Postmortem) -> None:
    s = pm.summary
    assert (s.outcome, s.steps_planned, s.steps_final, s.steps_computed, s.rollbacks) == ("completed", 60, 60, 75, 1)
    assert s.world_sizes == (2,) and s.ranks == 2
    commits = sum(isinstance(r.event, CheckpointCommitted) for r in rows)
    assert sum(m.type == "CheckpointCommitted" for m in pm.timeline) == commits
    types = [m.type for m in pm.timeline]
    assert types.index("LossSpikeDetected") < types.index("RollbackRequested") < types.index("JobCompleted")
    assert pm.causes == []


def test_the_report_files_exist_and_the_html_carries_its_images(pm: Postmortem, tmp_path: Path) -> None:
    paths = write_report(pm, tmp_path / "out")
    assert set(paths) == {"report.md", "report.html", "loss.png", "step_rate.png", "time.png"}
    for name in ("loss.png", "step_rate.png", "time.png"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["report.md"].read_text()
    assert "![loss curve](loss.png)" in md and "| 1 | drill fault 'loss_spike'" in md
    page = paths["report.html"].read_text()
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(images) == 3
    assert base64.b64decode(images[0]) == paths["loss.png"].read_bytes()
    assert "src='loss.png'" not in page and "health:FD_TELEMETRY:94:0" in page
