"""The service shell on a real nats-server: exactly-once outputs under load, across SIGKILL and broker restarts;
poison quarantined; recorded ticks and telemetry replayed to the same decisions; denied publishes named."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from flightdeck.events import subjects
from flightdeck.events.clock import ClockTick, CoreConfigured, DeadLettered
from flightdeck.events.codec import encode
from flightdeck.events.commands import CheckpointRequested
from flightdeck.events.fleet import NodeHeartbeat
from flightdeck.events.job import CancelRequested, JobQueued, JobSubmitted
from flightdeck.events.store import StoreUnavailable
from flightdeck.events.training import StepCompleted
from flightdeck.services.core import Service
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.fold import comparable, outputs_of, replay
from flightdeck.services.shell.runtime import ConsumerPolicy, PublishDenied, consumer_name, run_service
from flightdeck.services.shell.security import credentials
from tests.conftest import restart_broker
from tests.integration import toy_service
from tests.integration.runtime_helpers import (
    Bus,
    answered,
    assert_exactly_once,
    bus_at,
    eventually,
    kill_mid_stream_and_restart,
    read_all,
    spawn_service,
    submissions,
)

pytestmark = pytest.mark.timeout(60)


def start(factory: Callable[[], Service[Any]], url: str, policy: ConsumerPolicy | None = None,
          ) -> tuple[asyncio.Task[None], asyncio.Event]:
    stop = asyncio.Event()
    return asyncio.create_task(run_service(factory(), url, stop_event=stop, policy=policy)), stop


async def stop_service(task: asyncio.Task[None], stop: asyncio.Event) -> None:
    stop.set()
    await asyncio.wait_for(task, 60)


async def test_under_load_every_input_is_answered_exactly_once(nats_server: broker_mod.Broker) -> None:
    inputs = submissions(2000)
    async with bus_at(nats_server.url) as bus:
        await bus.store.append_batch(inputs)
        began = time.monotonic()
        task, stop = start(toy_service.build, nats_server.url)
        await eventually(lambda: answered(bus, "j1999"), 40, "the last input's answer")
        elapsed = time.monotonic() - began
        await stop_service(task, stop)
        assert_exactly_once(await read_all(bus.store, subjects.CONTROL), inputs)
    print(f"\n2000 inputs -> 2200 outputs in {elapsed:.2f}s: {2000 / elapsed:.0f} inputs/s (start-up included)")


async def test_sigkill_mid_stream_then_restart_answers_every_input_exactly_once(
        nats_server: broker_mod.Broker, tmp_path: Path) -> None:
    inputs = submissions(1200)
    log = tmp_path / "toy.log"
    async with bus_at(nats_server.url) as bus:
        await kill_mid_stream_and_restart(bus, nats_server.url, log, inputs, kill_after="j150")
    lines = log.read_text().splitlines()
    assert sum('"event": "rebuilt"' in line and '"service": "toy"' in line for line in lines) == 2
    assert any('"event": "stopped"' in line for line in lines)


async def test_poison_is_dead_lettered_with_its_reason_and_the_service_goes_on(nats_server: broker_mod.Broker) -> None:
    future = msgspec.structs.replace(submissions(1, "p3")[0][1], schema_version=99)
    async with bus_at(nats_server.url) as bus:
        task, stop = start(toy_service.build, nats_server.url)
        await bus.js.publish("fd.ctl.job.p1.JobSubmitted", os.urandom(64))
        unknown = msgspec.msgpack.encode({"type": "NoSuchEvent", "job_id": "p2"})
        await bus.js.publish("fd.ctl.job.p2.JobSubmitted", unknown)
        await bus.js.publish("fd.ctl.job.p3.JobSubmitted", encode(future))
        await bus.js.publish("fd.ctl.job.p5.JobSubmitted", encode(submissions(1, "p4")[0][1]))  # another job's event
        await bus.store.append(subjects.job("p6", "CancelRequested"),
                               CancelRequested(job_id="p6", reason="boom", job_version=1))
        await bus.store.append_batch(submissions(1, "p7"))
        await eventually(lambda: answered(bus, "p70"), 20, "the valid input after the poison")
        assert not task.done()
        dead = [s.event for s in await read_all(bus.store, subjects.DEAD)]
        assert all(isinstance(d, DeadLettered) and d.service == "toy" for d in dead) and len(dead) == 5
        reasons = {d.subject: d.reason for d in dead if isinstance(d, DeadLettered)}
        assert reasons["fd.ctl.job.p1.JobSubmitted"].startswith("undecodable: ")
        assert "NoSuchEvent" in reasons["fd.ctl.job.p2.JobSubmitted"]
        assert "schema version 99" in reasons["fd.ctl.job.p3.JobSubmitted"]
        assert reasons["fd.ctl.job.p5.JobSubmitted"].startswith("invalid: ")
        assert reasons["fd.ctl.job.p6.CancelRequested"].startswith("core failed: RuntimeError: boom in p6 at ")
        async def settled() -> bool:  # the last input's answer is stored a moment before it is acked
            info = await bus.js.consumer_info(subjects.CONTROL, consumer_name("toy"))
            return info.num_pending == 0 and info.num_ack_pending == 0

        await eventually(settled, 10, "every input finished: poison terminated, not left to redeliver")
        await stop_service(task, stop)


async def test_an_input_that_kills_the_process_is_given_up_dead_lettered_and_skipped_by_replay(
        nats_server: broker_mod.Broker, tmp_path: Path) -> None:
    log = tmp_path / "toy.log"
    env = {"TOY_DIE": "1", "FLIGHTDECK_MAX_DELIVER": "2", "FLIGHTDECK_BACKOFF_S": "0.5"}
    async with bus_at(nats_server.url) as bus:
        await bus.store.append_batch(submissions(1, "d"))
        die = await bus.store.append(subjects.job("k", "CancelRequested"),
                                     CancelRequested(job_id="k", reason="die", job_version=1))
        await bus.store.append_batch(submissions(1, "e"))
        deaths = 0
        proc = spawn_service("toy", nats_server.url, log, **env)
        try:
            while not await answered(bus, "e0"):
                if proc.poll() is not None:
                    assert proc.returncode == 17, log.read_text()[-3000:]
                    deaths += 1
                    assert deaths <= 2, "the server kept delivering past max_deliver"
                    proc = spawn_service("toy", nats_server.url, log, **env)
                await asyncio.sleep(0.1)
            assert deaths == 2  # one death per delivery; the third process got the advisory instead

            async def recorded() -> bool:
                return any(isinstance(d.event, DeadLettered) and d.event.seq == die.seq and "given up" in d.event.reason
                           for d in await read_all(bus.store, subjects.DEAD))
            await eventually(recorded, 60, "the dead letter for the input the server gave up on")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        control = await read_all(bus.store, subjects.CONTROL)
        live = [s.event for s in control if isinstance(s.event, JobQueued)]
        assert [(e.job_id, e.priority) for e in live] == [("d0", 1), ("e0", 2)]
        steps = [s async for s in replay(toy_service.build(), bus.store)]
    assert die.seq not in [s.input.seq for s in steps]  # skipped as live, not folded (it would not kill this process)
    assert [comparable(o.event) for o in outputs_of(steps) if isinstance(o.event, JobQueued)] == \
        [comparable(e) for e in live]


async def test_a_broker_restart_mid_stream_loses_nothing(nats_server: broker_mod.Broker) -> None:
    inputs = submissions(1000)
    broker = nats_server
    async with bus_at(nats_server.url) as bus:
        task, stop = start(toy_service.build, nats_server.url)
        try:
            await bus.store.append_batch(inputs[:600])
            await eventually(lambda: answered(bus, "j100"), 30, "some answers")
            assert not await answered(bus, "j599"), "the restart came too late to test anything"
            broker = await asyncio.to_thread(restart_broker, nats_server)
            for attempt in range(50):
                try:
                    await bus.store.append_batch(inputs[600:])
                    break
                except (StoreUnavailable, TimeoutError) as exc:  # our own client is reconnecting too
                    print(f"append attempt {attempt}: {exc!r}")
                    await asyncio.sleep(0.2)
            await eventually(lambda: answered(bus, "j999"), 40, "the last answer after the restart")
            await stop_service(task, stop)
            assert_exactly_once(await read_all(bus.store, subjects.CONTROL), inputs)
        finally:
            if not task.done():
                task.cancel()
            if broker is not nats_server:
                broker.stop()


async def test_ticks_are_recorded_and_replay_reproduces_the_live_outputs(nats_server: broker_mod.Broker) -> None:
    async with bus_at(nats_server.url) as bus:
        task, stop = start(toy_service.build, nats_server.url)
        for burst in range(5):
            await bus.store.append_batch(submissions(10, f"t{burst}-"))
            await asyncio.sleep(0.3)
        await eventually(lambda: answered(bus, "t4-9"), 20, "the last answer")
        await asyncio.sleep(0.5)
        await stop_service(task, stop)
        control = await read_all(bus.store, subjects.CONTROL)
    ticks = [s.event for s in control if isinstance(s.event, ClockTick)]
    assert len(ticks) >= 4 and all(t.service == "toy" and subjects.CONTROL in t.positions for t in ticks)
    assert [t.now for t in ticks] == sorted(t.now for t in ticks)
    live = [s.event for s in control
            if s.event is not None and s.event.producer == "toy"
            and not isinstance(s.event, ClockTick | CoreConfigured)]
    assert sum(isinstance(e, NodeHeartbeat) and e.node == "toy-clock" for e in live) == len(ticks)
    async with bus_at(nats_server.url) as bus:
        replayed = outputs_of([s async for s in replay(toy_service.build(), bus.store)])
    assert [comparable(o.event) for o in replayed] == [comparable(e) for e in live]


async def test_telemetry_is_folded_in_the_recorded_order_across_a_restart(nats_server: broker_mod.Broker) -> None:
    def steps(first: int, last: int) -> list[tuple[str, StepCompleted]]:
        return [(subjects.telemetry("tel", rank, "StepCompleted"),
                 StepCompleted(job_id="tel", rank=rank, step=n, loss=1.0, grad_norm=1.0, lr=0.1, tokens_per_s=1.0,
                               step_time_s=0.1, event_id=f"tel-{rank}-{n}", occurred_at=float(n)))
                for n in range(first, last) for rank in (1, 0)]

    async def outputs(bus: Bus) -> list[CheckpointRequested]:
        return [s.event for s in await read_all(bus.store, subjects.CONTROL, ("fd.ctl.job.tel.CheckpointRequested",))
                if isinstance(s.event, CheckpointRequested)]

    def folded(bus: Bus, n: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return len(await outputs(bus)) >= n
        return check

    async with bus_at(nats_server.url) as bus:
        task, stop = start(toy_service.build_telemetry, nats_server.url)
        await bus.store.append_batch(steps(0, 40))
        await eventually(folded(bus, 80), 20, "the first burst folded")
        await stop_service(task, stop)
        await bus.store.append_batch(steps(40, 70))  # while the service is down
        task, stop = start(toy_service.build_telemetry, nats_server.url)
        await bus.store.append_batch(steps(70, 100))
        await eventually(folded(bus, 200), 20, "every step folded")
        await asyncio.sleep(0.3)
        await stop_service(task, stop)
        live = await outputs(bus)
        recorded = [s.event.event_id for s in await read_all(bus.store, subjects.TELEMETRY) if s.event is not None]
        assert [e.causation_id for e in live] == recorded
        assert [int(e.reason.split(":")[2]) for e in live] == list(range(200))
        replayed = outputs_of([s async for s in replay(toy_service.build_telemetry(), bus.store)])
    assert [comparable(o.event) for o in replayed] == [comparable(e) for e in live]


@pytest.mark.parametrize("build", [toy_service.build_prompted, toy_service.build_prompted_idle])
async def test_a_prompting_message_is_folded_at_a_tick_it_brings_forward(
        nats_server: broker_mod.Broker, build: Callable[[], Service[Any]]) -> None:
    # the service ticks once a minute; the test's 60 s timeout passes first unless the message brings a tick. One
    # whose core wants no ticks by now is prompted all the same: a final checkpoint's upload reported past the
    # checkpoint service's linger was folded only when something else brought a tick.
    name = build().name
    step = StepCompleted(job_id="pr", rank=0, step=7, loss=1.0, grad_norm=1.0, lr=0.1, tokens_per_s=1.0,
                         step_time_s=0.1, event_id="pr-0-7", occurred_at=7.0)
    async with bus_at(nats_server.url) as bus:
        task, stop = start(build, nats_server.url)
        await eventually(lambda: _configured(bus, name), 20, "the service to start")
        await bus.store.append(subjects.telemetry("pr", 0, "StepCompleted"), step, msg_id=step.event_id)

        async def folded() -> bool:
            return bool(await read_all(bus.store, subjects.CONTROL, ("fd.ctl.job.pr.CheckpointRequested",)))
        await eventually(folded, 40, "the step to be folded")
        await stop_service(task, stop)
        control = await read_all(bus.store, subjects.CONTROL)
    ticks = [s.event for s in control if isinstance(s.event, ClockTick) and s.event.service == name]
    (answer,) = [s.event for s in control if isinstance(s.event, CheckpointRequested)]
    assert len(ticks) == 1 and answer.causation_id == "pr-0-7"  # one tick, brought forward by the message


async def _configured(bus: Bus, service: str) -> bool:
    return any(isinstance(s.event, CoreConfigured) and s.event.service == service
               for s in await read_all(bus.store, subjects.CONTROL))


async def test_a_denied_publish_stops_the_service_naming_the_subject(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "denied.conf"
    config.write_text(  # the shipped config sizes the store: unset, it is 75% of whatever disk is free
        broker_mod.CONFIG.read_text() + "\n"
        "authorization { users = [ { user: toy, password: pw, permissions: {\n"
        '  publish: { allow: [">"], deny: ["fd.ctl.node.toy-node.>"] }, subscribe: { allow: [">"] } } } ] }\n'
    )
    broker = broker_mod.start(tmp_path / "nats", config=config)
    url = f"nats://127.0.0.1:{broker.port}"  # credentials come from files named in the environment, never the URL
    (tmp_path / "toy.password").write_text("pw\n")
    monkeypatch.setenv(credentials.USER, "toy")
    monkeypatch.setenv(credentials.PASSWORD_FILE, str(tmp_path / "toy.password"))
    try:
        async with bus_at(url, user="toy", password="pw") as bus:
            await bus.store.append_batch(submissions(10))  # the tenth answer goes to the denied node subject
            with pytest.raises(PublishDenied) as denied:
                await asyncio.wait_for(run_service(toy_service.build(), url), 30)
        assert denied.value.subject == "fd.ctl.node.toy-node.NodeHeartbeat"
        assert "fd.ctl.node.toy-node.NodeHeartbeat" in str(denied.value)
    finally:
        broker.stop()


async def test_effects_run_live_their_outcomes_recorded_and_replay_does_not_run_them(
        nats_server: broker_mod.Broker) -> None:
    inputs = [*submissions(1, "fx"), *submissions(1, "fxbad")]
    inputs[1] = (subjects.job("fxbad", "JobSubmitted"), msgspec.structs.replace(inputs[1][1], job_id="fxbad"))
    async with bus_at(nats_server.url) as bus:
        task, stop = start(toy_service.build_effects, nats_server.url)
        await bus.store.append_batch(inputs)

        async def finished() -> bool:
            return bool(await read_all(bus.store, subjects.DEAD))
        await eventually(finished, 20, "the failed effect's dead letter")
        await stop_service(task, stop)
        [submitted, queued, stamped] = [s for s in await read_all(bus.store, subjects.CONTROL, ("fd.ctl.job.fx0.>",))]
        [dead] = [s.event for s in await read_all(bus.store, subjects.DEAD)]
        steps = [s async for s in replay(toy_service.build_effects(), bus.store)]
        live_queued = [s.event for s in await read_all(bus.store, subjects.CONTROL, ("fd.ctl.job.*.JobQueued",))]
    assert queued.msg_id == f"toyfx:FD_CONTROL:{submitted.seq}:0"
    assert stamped.msg_id == f"toyfx:FD_CONTROL:{submitted.seq}:1"  # effect outcomes continue the input's indexes
    assert isinstance(stamped.event, CheckpointRequested) and stamped.event.job_version == 3
    assert stamped.event.causation_id == "cli-fx0" and stamped.event.occurred_at > 1_000_000  # when it happened
    assert isinstance(dead, DeadLettered) and dead.subject == "fd.ctl.job.fxbad.JobSubmitted"
    assert dead.reason.startswith("effect stamp failed: RuntimeError: cannot stamp fxbad")
    assert [len(s.effects) for s in steps if isinstance(s.input.event, JobSubmitted)] == [1, 1]
    assert [comparable(o.event) for o in outputs_of(steps)] == [comparable(e) for e in live_queued if e is not None]


async def test_a_service_started_before_its_broker_waits_for_it(tmp_path: Path) -> None:
    port = broker_mod.free_port()
    url = f"nats://127.0.0.1:{port}"
    task, stop = start(toy_service.build, url)
    await asyncio.sleep(1.0)
    assert not task.done()
    broker = await asyncio.to_thread(broker_mod.start, tmp_path / "nats", port)
    try:
        async with bus_at(url) as bus:
            await bus.store.append_batch(submissions(1, "late"))
            await eventually(lambda: answered(bus, "late0"), 20, "the answer")
        await stop_service(task, stop)
    finally:
        broker.stop()


def test_an_unknown_service_name_is_refused_with_the_choices(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "flightdeck.services", "nosuch", "--nats", "nats://127.0.0.1:1"],
                          capture_output=True, text=True, timeout=30, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2
    assert "no service called 'nosuch'" in proc.stderr and "scheduler" in proc.stderr
