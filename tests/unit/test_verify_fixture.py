"""`verify` over a recorded spike drill: every core reproduces every recorded decision; a tampered history
(a decision's field changed, a decision removed, a forged one injected, two inputs swapped) fails at the right
first divergence."""

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import structlog

from flightdeck.events import codec, subjects
from flightdeck.events.base import Event
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import LossOutlier, LossSpikeDetected
from flightdeck.events.job import JobFailed
from flightdeck.events.store import Stored
from flightdeck.events.training import StepCompleted
from flightdeck.services.tools.audit.verify import Verdict, verify
from flightdeck.services.tools.console.__main__ import main as cli_main
from flightdeck.services.tools.history import fdh
from flightdeck.services.tools.history.library import History

# The spike drill as recorded by tests/fixtures/record_drill.py spike (tests/unit/test_fixtures_verify.py keeps it
# verifying with the current cores).
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "histories" / "spike.fdh.jsonl"
JOB = "spike-000001"


def flightdeck(argv: list[str]) -> int:
    try:
        return cli_main(argv)
    finally:
        structlog.reset_defaults()  # main() points logs at this test's captured stderr, which pytest then closes


def rows() -> list[Stored]:
    return fdh.load(FIXTURE)


def rewrite(stored: Stored, event: Event, **where: str) -> Stored:
    """`stored` carrying `event` instead (same stream and sequence; subject and msg id as given or kept)."""
    return Stored(stored.stream, stored.seq, where.get("subject", stored.subject), codec.encode(event),
                  where.get("msg_id", stored.msg_id), event)


def only(recorded: list[Stored], kind: type[Event]) -> Stored:
    (found,) = [s for s in recorded if isinstance(s.event, kind)]
    return found


async def verified(recorded: list[Stored]) -> Verdict:
    return await verify(History(job_id=JOB, rows=recorded, source="test").store, JOB)


async def test_every_core_reproduces_every_recorded_decision() -> None:
    verdict = await verified(rows())
    assert verdict.ok, verdict.divergences[:3]
    checked = {c.service: c for c in verdict.checks}
    assert set(checked) == {"scheduler", "health", "resources", "resharder", "checkpoints"}
    # what the live run decided about the job: JobQueued, AllocationRequested, RollbackRequested, JobCompleted,
    # AllocationReleased; one spike and its diagnosis; one grant; one plan; the checkpoints staged and the retention
    # deletes decided (commits and deletes carried out as effects): this recording's numbers
    assert [checked[n].decisions for n in ("scheduler", "health", "resources", "resharder", "checkpoints")] == \
        [5, 2, 1, 1, 23]
    assert checked["checkpoints"].effects == 23
    assert checked["health"].telemetry_inputs > 100 and checked["scheduler"].telemetry_inputs == 2  # RolledBack x2
    assert all(not c.dead_live and not c.dead_replay for c in verdict.checks)


async def test_a_changed_decision_field_is_the_first_divergence() -> None:
    recorded = rows()
    at = recorded.index(only(recorded, RollbackRequested))
    original = recorded[at].event
    assert isinstance(original, RollbackRequested)
    recorded[at] = rewrite(recorded[at], msgspec.structs.replace(original, to_step=original.to_step - 5))
    verdict = await verified(recorded)
    first = verdict.divergences[0]
    assert (first.service, first.kind, first.msg_id) == ("scheduler", "differs", recorded[at].msg_id)
    assert first.input is not None and isinstance(first.input.event, LossSpikeDetected)  # the trigger
    assert first.position == first.input.seq
    assert first.fields() == [("to_step", original.to_step - 5, original.to_step)]


async def test_a_removed_decision_is_missing_where_it_was_decided() -> None:
    recorded = rows()
    spike = only(recorded, LossSpikeDetected)
    recorded.remove(spike)
    verdict = await verified(recorded)
    first = verdict.divergences[0]
    assert (first.service, first.kind, first.msg_id) == ("health", "not recorded", spike.msg_id)
    assert first.input is not None and isinstance(first.input.event, StepCompleted) and first.input.event.step == 32
    assert first.position < spike.seq  # the tick that folded the spiking step, before the finding was stored
    assert first.replayed is not None and first.fields() == []
    # and what rested on it is now unexplained: the rollback the scheduler recorded is not reproduced
    assert any(d.service == "scheduler" and d.kind == "not reproduced" and isinstance(d.recorded, RollbackRequested)
               for d in verdict.divergences)


async def test_an_injected_forged_decision_is_not_reproduced() -> None:
    recorded = rows()
    last = max(s.seq for s in recorded if s.stream == subjects.CONTROL)
    spike = only(recorded, LossSpikeDetected)  # the input the forged decision claims to answer
    forged = JobFailed(job_id=JOB, reason="forged", event_id=f"scheduler:FD_CONTROL:{spike.seq}:2",
                       producer="scheduler", occurred_at=1.0, causation_id="x")
    row = Stored(subjects.CONTROL, last + 1, subjects.job(JOB, "JobFailed"), codec.encode(forged), forged.event_id,
                 forged)
    at = max(i for i, s in enumerate(recorded) if s.stream == subjects.CONTROL) + 1
    recorded.insert(at, row)
    verdict = await verified(recorded)
    assert verdict.horizon == last + 1
    first = verdict.divergences[0]
    assert (first.service, first.kind, first.msg_id) == ("scheduler", "not reproduced", forged.event_id)
    assert first.recorded == forged and first.input is not None and first.input.seq == spike.seq == 54


async def test_two_swapped_inputs_leave_the_finding_they_led_to_unexplained() -> None:
    """Step 30's loss (the spike's onset) read before step 29's: the replay sees the run go back a step, which
    starts the excursion over, so the spike completed at step 32 is never re-derived; the shorter excursion ends
    at step 34 as a lone loss far out instead, a LossOutlier the history does not hold. Both at the same position."""
    recorded = rows()
    firsts: dict[int, int] = {}  # the rollback redoes steps 25.. in the same attempt: take the first timeline's
    for i, s in enumerate(recorded):
        if isinstance(s.event, StepCompleted) and s.event.rank == 0:
            firsts.setdefault(s.event.step, i)
    i29, i30 = firsts[29], firsts[30]
    a, b = recorded[i29], recorded[i30]
    assert a.subject == b.subject
    recorded[i29] = Stored(a.stream, a.seq, b.subject, b.data, b.msg_id, b.event)  # step 30 now comes first
    recorded[i30] = Stored(b.stream, b.seq, a.subject, a.data, a.msg_id, a.event)
    verdict = await verified(recorded)
    at = verdict.divergences[0].position
    first = [d for d in verdict.divergences if d.position == at]
    spike = only(recorded, LossSpikeDetected)
    assert [(d.service, d.kind) for d in first] == [("health", "not recorded"), ("health", "not reproduced")]
    shown, lost = first
    assert lost.recorded == spike.event and lost.input is not None and isinstance(lost.input.event, StepCompleted)
    assert lost.input.event.step == 32
    assert isinstance(shown.replayed, LossOutlier) and shown.input is not None
    assert isinstance(shown.input.event, StepCompleted) and shown.input.event.step == 34


@pytest.mark.parametrize("tamper", [
    lambda e: msgspec.structs.replace(e, reason=e.reason + " "),
    lambda e: msgspec.structs.replace(e, producer="health"),
], ids=["reason", "producer"])
async def test_any_field_of_a_decision_counts(tamper: Callable[[RollbackRequested], Event]) -> None:
    recorded = rows()
    at = recorded.index(only(recorded, RollbackRequested))
    recorded[at] = rewrite(recorded[at], tamper(recorded[at].event))  # type: ignore[arg-type]
    assert not (await verified(recorded)).ok


def test_the_cli_exits_0_on_the_fixture_and_1_on_a_tampered_copy(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert flightdeck(["verify", "--from", str(FIXTURE)]) == 0
    assert "OK: every recorded decision reproduced" in capsys.readouterr().out
    recorded = rows()
    at = recorded.index(only(recorded, RollbackRequested))
    original = recorded[at].event
    assert isinstance(original, RollbackRequested)
    recorded[at] = rewrite(recorded[at], msgspec.structs.replace(original, skip_to=original.skip_to + 1))
    tampered = tmp_path / "tampered.fdh"
    fdh.write(tampered, fdh.dump(recorded, job_id=JOB))
    assert flightdeck(["verify", "--from", str(tampered)]) == 1
    out = capsys.readouterr().out
    assert "first divergence (scheduler, differs)" in out
    assert f"field skip_to: recorded {original.skip_to + 1}, replayed {original.skip_to}" in out
