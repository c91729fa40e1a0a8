"""Verify needs nothing from the auditor's machine: its cores start from their defaults, whatever this process's
environment says, and take the live settings from the recorded CoreConfigured; a history recorded before services
recorded them verifies with the defaults and says so."""

from pathlib import Path

import pytest

from flightdeck.events import codec
from flightdeck.events.clock import CoreConfigured
from flightdeck.events.fleet import NodeRegistered
from flightdeck.events.job import AllocationGranted, AllocationRequested
from flightdeck.services import registry
from flightdeck.services.resources.core import Settings, master_port
from flightdeck.services.tools.audit.cores import cores
from flightdeck.services.tools.audit.verify import verify
from flightdeck.services.tools.history import fdh
from flightdeck.services.tools.history.library import History
from tests.unit.helpers import Bus

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "histories" / "crash.fdh.jsonl"  # recorded before
# the services recorded their settings (CoreConfigured)


async def test_an_old_history_verifies_with_the_defaults_whatever_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLIGHTDECK_STOP_TIMEOUT_S", "1")
    monkeypatch.setenv("FLIGHTDECK_MASTER_PORT_BASE", "50000")
    history = History(job_id="crash-000001", rows=fdh.load(FIXTURE), source="crash")
    verdict = await verify(history.store, history.job_id)
    assert verdict.ok, verdict.divergences[:1]
    said = [n for n in verdict.notes if "no settings recorded" in n]
    assert said == [
        "scheduler: no settings recorded in this history: replayed with the defaults "
        "(stop_timeout_s=120.0, landing_timeout_s=120.0, memory_wait=no, phases=no, restores=granted, claims=trust, "
        "agent_faults=charged)",
        "resources: no settings recorded in this history: replayed with the defaults (base=29500, span=1000, "
        "denials=counts, writers=trusted)",
        "checkpoints: no settings recorded in this history: replayed with the defaults "
        "(scrub_every_s=86400.0, scrub_mb_s=64.0, shards_from=staging, announce_pending=no, settle_on_exits=no, "
        "supersede=no, retention=commits, claims=trust, failing_after=0, fence=none, final_late=kept)",
        "health: no settings recorded in this history: replayed with the defaults (tick_s=1.0, stopping=unwatched, "
        "stranded=judged, idle_lost_s=0.0)",
    ]
    assert [s.settings for s in cores()][:2] == [{"stop_timeout_s": 120.0, "landing_timeout_s": 120.0,
                                                 "memory_wait": "promised", "phases": "yes",
                                                 "restores": "requested", "claims": "verify",
                                                 "agent_faults": "free"},
                                                {"base": 29500, "span": 1000, "denials": "named",
                                                 "writers": "judged"}]


def test_a_core_with_its_defaults_decides_like_the_live_one_once_it_folds_the_recorded_settings() -> None:
    live = registry.build("resources", env={"FLIGHTDECK_MASTER_PORT_BASE": "40000", "FLIGHTDECK_MASTER_PORT_SPAN": "7"})
    audit = registry.build("resources", env={})
    inputs = [NodeRegistered(node="n1", kind="cpu", slots=2), AllocationRequested(job_id="j-1", slots=2, attempt=0)]
    configured = CoreConfigured(service="resources", settings=dict(live.settings))

    def grant(service: object, events: list[object]) -> AllocationGranted:
        b = Bus([service])  # type: ignore[list-item]
        b.publish(*events)  # type: ignore[arg-type]
        (g,) = b.of(AllocationGranted)
        return g

    assert grant(live, inputs).master_port == master_port("j-1", 0, Settings(base=40000, span=7))
    assert grant(audit, [configured, *inputs]) == grant(live, [configured, *inputs])
    assert grant(audit, inputs).master_port == master_port("j-1", 0, Settings())  # without the record: the defaults


def test_settings_a_core_cannot_run_with_are_refused() -> None:
    audit = registry.build("scheduler", env={})
    with pytest.raises(ValueError, match="must be positive"):
        audit.transition(audit.initial, CoreConfigured(service="scheduler", settings={"stop_timeout_s": -1.0}))


@pytest.mark.parametrize("name", registry.BUILTIN)
def test_every_cores_settings_travel_as_a_recorded_core_configured_and_fold_back(name: str) -> None:
    """What a shell records at start must decode (else its CoreConfigured is dead-lettered and a replay folds the
    defaults), and folding it back must be accepted by the core, for the live settings and the unrecorded ones."""
    svc = registry.build(name, env={})
    for settings in (svc.settings, svc.unrecorded or svc.settings):
        recorded = CoreConfigured(service=svc.name, settings=dict(settings), event_id="c", occurred_at=1.0)
        back = codec.admit(codec.encode(recorded))
        assert back == recorded
        svc.transition(svc.initial, back)
