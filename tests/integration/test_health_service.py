"""The health service on a real nats-server: synthetic rank telemetry on FD_TELEMETRY and job events in
the job's history; RankLost when a rank's heartbeats stop, RankHung when its steps freeze under live
heartbeats, a lost rank from a non-zero exit through `python -m flightdeck.services health`; and a replay of what
was recorded gives the findings that were stored."""

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from flightdeck.events import subjects
from flightdeck.events.base import JobEvent
from flightdeck.events.findings import Finding, RankHung, RankLost
from flightdeck.events.history import append_to_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import AllocationGranted, JobSubmitted, SlotRef, WorkersExited, WorkersStarted
from flightdeck.events.spec import JobSpec, PolicySpec
from flightdeck.events.training import Heartbeat, RankStarted, StepCompleted
from flightdeck.services.health.core import core_service
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.fold import comparable, outputs_of, replay
from flightdeck.services.shell.runtime import run_service
from tests.integration.runtime_helpers import bus_at, eventually, read_all, spawn_service

pytestmark = pytest.mark.timeout(180)  # starts real ranks: a minute on a loaded 2-core box

# Deadlines well above a scheduling hiccup of this shared box (the publisher shares the service's loop).
POLICY = PolicySpec(heartbeat_interval_s=0.1, heartbeat_misses=15, hang_min_s=2.5, hang_factor=5.0)
BEAT_S = 0.1


async def start_job(store: JetStreamStore, job_id: str, num_ranks: int) -> None:
    refs = [SlotRef(node="n1", slot=r, rank=r) for r in range(num_ranks)]
    now = time.time()
    events: list[JobEvent] = [
        JobSubmitted(job_id=job_id, spec=JobSpec(name="hm", slots=num_ranks, policy=POLICY)),
        AllocationGranted(job_id=job_id, attempt=0, assignments=refs),
        WorkersStarted(job_id=job_id, node="n1", attempt=0, ranks=list(range(num_ranks)),
                       pids=list(range(num_ranks))),
    ]
    for i, ev in enumerate(events):
        await append_to_job(store, ev.__class__(**{**_fields(ev), "event_id": f"{job_id}-ctl-{i}", "occurred_at": now}))


def _fields(ev: JobEvent) -> dict[str, object]:
    return {f: getattr(ev, f) for f in ev.__struct_fields__}


class Ranks:
    """Publishes what a job's ranks would: RankStarted, then a step and a heartbeat every BEAT_S."""

    def __init__(self, store: JetStreamStore, job_id: str, num_ranks: int) -> None:
        self.store, self.job_id = store, job_id
        self.dead: set[int] = set()
        self.frozen: set[int] = set()
        self.steps = dict.fromkeys(range(num_ranks), -1)
        self.n = 0

    async def emit(self, rank: int, ev_type: type, **fields: object) -> None:
        self.n += 1
        ev = ev_type(job_id=self.job_id, rank=rank, attempt=0, node="n1", event_id=f"{self.job_id}-t{self.n}",
                     occurred_at=time.time(), **fields)
        await self.store.append(subjects.telemetry(self.job_id, rank, ev_type.__name__), ev)

    async def run(self) -> None:
        for rank in self.steps:
            await self.emit(rank, RankStarted, world_size=len(self.steps), from_step=0, device="cpu")
        while True:
            for rank in self.steps:
                if rank in self.dead:
                    continue
                if rank not in self.frozen:
                    self.steps[rank] += 1
                    await self.emit(rank, StepCompleted, step=self.steps[rank], loss=2.0, grad_norm=1.0, lr=1e-3,
                                    tokens_per_s=1.0, step_time_s=BEAT_S)
                await self.emit(rank, Heartbeat, step=self.steps[rank], interval_s=BEAT_S)
            await asyncio.sleep(BEAT_S)


async def ended(task: asyncio.Task[None], within: float, what: str) -> None:
    """Wait for `task` to end (a cancel included), failing rather than hanging if it has not within `within` s: a
    cancel dropped inside a NATS call once left the publisher running and this file waiting out its 180 s timeout
    (events/jsreader.py `cancellable`). What the task raised is raised here."""
    done, _ = await asyncio.wait({task}, timeout=within)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=5)
        raise AssertionError(f"{what} still running {within}s after it was told to stop")
    with contextlib.suppress(asyncio.CancelledError):
        task.result()


async def findings(store: JetStreamStore, job_id: str) -> list[Finding]:
    return [s.event for s in await read_all(store, subjects.CONTROL, (subjects.job_all(job_id),))
            if isinstance(s.event, Finding)]


async def test_heartbeats_stopping_is_rank_lost_and_frozen_steps_are_rank_hung(nats_server: broker_mod.Broker) -> None:
    service = core_service(tick_s=0.2)
    stop = asyncio.Event()
    async with bus_at(nats_server.url) as bus:
        task = asyncio.create_task(run_service(service, nats_server.url, stop_event=stop))
        await start_job(bus.store, "hm-1", 3)
        ranks = Ranks(bus.store, "hm-1", 3)
        publisher = asyncio.create_task(ranks.run())
        try:
            await asyncio.sleep(1.0)
            assert await findings(bus.store, "hm-1") == []  # healthy ranks: nothing to say
            ranks.dead.add(1)
            ranks.frozen.add(2)

            async def both() -> bool:
                return {type(f) for f in await findings(bus.store, "hm-1")} == {RankLost, RankHung}

            await eventually(both, 60, "RankLost for rank 1 and RankHung for rank 2")
            found = await findings(bus.store, "hm-1")
        finally:
            publisher.cancel()
            await ended(publisher, 10, "the telemetry publisher")
            stop.set()
            await ended(task, 15, "the health service")
        lost = next(f for f in found if isinstance(f, RankLost))
        hung = next(f for f in found if isinstance(f, RankHung))
        assert (lost.rank, lost.reason, hung.rank, len(found)) == (1, "heartbeats stopped", 2, 2)
        assert hung.deadline_s == POLICY.hang_min_s and hung.step == ranks.steps[2]
        detect_s = lost.occurred_at - lost.last_seen  # a tick-decided finding carries the tick's time
        print(f"\nRankLost {detect_s:.2f}s after the rank's last heartbeat (deadline "
              f"{POLICY.heartbeat_misses * POLICY.heartbeat_interval_s:.1f}s, tick 0.2s); "
              f"RankHung after {hung.stalled_s:.2f}s stalled (deadline {hung.deadline_s:.1f}s)")
        # Never before the deadline (exact). How long after it depends on when the ticks ran and folded, which a
        # loaded box delays by seconds; the replay below pins that the decision follows from those ticks exactly.
        assert POLICY.heartbeat_misses * POLICY.heartbeat_interval_s < detect_s < 15.0
        telemetry_ids = {s.event.event_id for s in await read_all(bus.store, subjects.TELEMETRY) if s.event}
        assert set(lost.evidence) | set(hung.evidence) <= telemetry_ids

        # What `flightdeck verify` does: the recorded inputs replay to the recorded decisions.
        replayed = outputs_of([s async for s in replay(core_service(tick_s=0.2), bus.store)])
        assert [comparable(o.event) for o in replayed] == [comparable(f) for f in found]


async def test_python_m_services_health_reports_a_crashed_rank(nats_server: broker_mod.Broker, tmp_path: Path) -> None:
    proc = spawn_service("health", nats_server.url, tmp_path / "health.log", FLIGHTDECK_HEALTH_TICK_S="0.2")
    try:
        async with bus_at(nats_server.url) as bus:
            await start_job(bus.store, "hm-2", 2)
            ranks = Ranks(bus.store, "hm-2", 2)
            publisher = asyncio.create_task(ranks.run())
            try:
                await asyncio.sleep(0.5)
                ranks.dead.add(0)
                await append_to_job(bus.store, WorkersExited(job_id="hm-2", node="n1", attempt=0, rank=0, exit_code=3,
                                                             event_id="hm-2-exit", occurred_at=time.time()))

                async def reported() -> bool:
                    return bool(await findings(bus.store, "hm-2"))

                await eventually(reported, 30, "the crashed rank reported")
                await asyncio.sleep(1.0)  # and nothing more: its silence afterwards is the same loss
            finally:
                publisher.cancel()
                await ended(publisher, 10, "the telemetry publisher")
            (lost,) = await findings(bus.store, "hm-2")
            assert isinstance(lost, RankLost) and lost.reason == "exited with code 3" and lost.rank == 0
            assert lost.evidence[0] == "hm-2-exit" and lost.causation_id == "hm-2-exit"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
