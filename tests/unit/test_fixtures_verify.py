"""Every history shipped under tests/fixtures/histories/ verifies with the code as it is now.

The recorded drills are the fixtures of the replay, postmortem, verify and what-if tests. A core change that alters
what a service decides makes `flightdeck verify` fail on a history recorded before it (correctly: the code changed),
and then the tests built on that history no longer describe what the code does. This test makes such a change
visible at once: when it fails, re-record the drill it names with the current code,

    .venv/bin/python tests/fixtures/record_drill.py <drill>     # -> tests/fixtures/histories/<drill>.fdh.jsonl

and update the numbers the fixture tests pin (tests/unit/test_postmortem_fixture.py checks them against the raw
events of the file; tests/integration/test_postmortem_cli.py prints them).
"""

from pathlib import Path

import pytest

from flightdeck.services.tools.audit.verify import verify
from flightdeck.services.tools.console.verify_cmd import report
from flightdeck.services.tools.history import library
from tests.e2e.drill_harness import DRILL_SPECS

HISTORIES = Path(__file__).resolve().parents[1] / "fixtures" / "histories"
SHIPPED = sorted(HISTORIES.glob("*.fdh.jsonl"))


def test_each_shipped_history_is_one_drill_that_record_drill_can_record_again() -> None:
    """One file per drill, named as record_drill.py writes it: no second recording of a drill beside the first."""
    assert sorted(p.name for p in HISTORIES.iterdir()) == [p.name for p in SHIPPED]
    drills = [p.name.removesuffix(".fdh.jsonl") for p in SHIPPED]
    assert set(drills) <= set(DRILL_SPECS), drills
    assert {"spike", "crash"} <= set(drills)  # the fixtures of the replay, postmortem, verify and what-if tests


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name.removesuffix(".fdh.jsonl"))
async def test_every_shipped_history_verifies_with_the_current_cores(path: Path) -> None:
    drill = path.name.removesuffix(".fdh.jsonl")
    history = library.file_history(path)
    assert history.job_id == f"{drill}-000001", "record_drill.py names the drill's only job <drill>-000001"
    verdict = await verify(history.store, history.job_id)
    assert verdict.ok, (
        f"{path.name} no longer verifies: a core decides differently from what was recorded. Re-record it with "
        f"`.venv/bin/python tests/fixtures/record_drill.py {drill}` and update the numbers the fixture tests pin.\n"
        + "\n".join(report(verdict, history.source)))
    decided = {c.service: c.decisions for c in verdict.checks}
    assert set(decided) == {"scheduler", "health", "resources", "resharder", "checkpoints"}
    assert all(decided.values()), decided  # every core had something of the job's to reproduce
