"""A service records the settings its core runs with (CoreConfigured on its clock subject) at every start, and a
core built anywhere, with its defaults, decides from the log exactly as the live one did: the real resources
service runs with a MASTER_PORT range from its environment, is restarted with another, and a replay by a core
that never saw either environment gives every grant the port the live service gave it."""

import signal
from pathlib import Path

import pytest

from flightdeck.events import subjects
from flightdeck.events.clock import CoreConfigured
from flightdeck.events.fleet import NodeRegistered
from flightdeck.events.history import append_to_job
from flightdeck.events.job import AllocationGranted, AllocationRequested
from flightdeck.services import registry
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.fold import comparable, replay
from tests.integration.runtime_helpers import bus_at, eventually, read_all, spawn_service

pytestmark = pytest.mark.timeout(120)
JOB = "ports-000001"


async def grants(store: object) -> list[AllocationGranted]:
    return [s.event for s in await read_all(store, subjects.CONTROL, (subjects.job(JOB, "AllocationGranted"),))
            if isinstance(s.event, AllocationGranted)]


async def settings_recorded(store: object) -> list[CoreConfigured]:
    return [s.event for s in await read_all(store, subjects.CONTROL, (subjects.clock("resources"),))
            if isinstance(s.event, CoreConfigured)]


async def test_a_replay_anywhere_uses_the_settings_the_live_service_recorded(
        nats_server: broker_mod.Broker, tmp_path: Path) -> None:
    log = tmp_path / "resources.log"
    ranges = [("40000", "10"), ("41000", "5")]
    async with bus_at(nats_server.url) as bus:
        await bus.store.append(subjects.node("n1", "NodeRegistered"),
                               NodeRegistered(node="n1", kind="cpu", slots=2, address="127.0.0.1"))
        for attempt, (base, span) in enumerate(ranges):
            proc = spawn_service("resources", nats_server.url, log, FLIGHTDECK_MASTER_PORT_BASE=base,
                                 FLIGHTDECK_MASTER_PORT_SPAN=span)
            try:
                # Inputs stored before a start's CoreConfigured are decided with the settings before it (as a replay
                # decides them): this request is meant for the new range.
                async def configured(n: int = attempt + 1) -> bool:
                    return len(await settings_recorded(bus.store)) == n

                await eventually(configured, 60, f"start {attempt + 1}'s settings")
                await append_to_job(bus.store, AllocationRequested(job_id=JOB, slots=2, attempt=attempt))

                async def granted(n: int = attempt + 1) -> bool:
                    return len(await grants(bus.store)) == n

                await eventually(granted, 60, f"the grant of attempt {attempt}")
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(15) == 0, log.read_text()[-3000:]
            finally:
                if proc.poll() is None:
                    proc.kill()

        recorded = await settings_recorded(bus.store)
        named = {"denials": "named", "writers": "judged"}
        assert [c.settings for c in recorded] == [{"base": 40000, "span": 10, **named},
                                                  {"base": 41000, "span": 5, **named}]
        live = await grants(bus.store)
        assert [g.master_port in range(int(b), int(b) + int(s)) for g, (b, s) in zip(live, ranges, strict=True)] \
            == [True, True]

        replayed = [out.event async for step in replay(registry.build("resources", env={}), bus.store)
                    for out in step.outputs if isinstance(out.event, AllocationGranted)]
        assert [comparable(e) for e in replayed] == [comparable(e) for e in live]
