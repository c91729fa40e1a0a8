"""Faults a chaos drill inflicts on a running platform (every service and the node agent as processes,
tests/e2e/drill_harness.py), and the waits between them.

    p = chaos.platform                      # the `chaos` fixture: a Platform on a broker the test may kill
    await sigkill(p, "scheduler")           # the process is gone, nothing drained
    await restart(p, "scheduler")           # started again; returns once it has rebuilt its state

A service is ready again when it logs `rebuilt` (services/shell/runtime.py: its state folded up to its consumer's
ack floor, before it takes the next input).
"""

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flightdeck.events import subjects
from flightdeck.events.job import WorkersStarted
from flightdeck.events.spec import FaultSpec, JobSpec
from flightdeck.events.training import StepCompleted
from flightdeck.services.shell import broker as broker_mod
from tests.chaos.checks import Outcome, check, record
from tests.e2e.drill_harness import drill_spec, export, start_drill
from tests.integration.lifecycle_harness import Platform

PACE_S = 0.1  # attempt 0 steps about 10 times a second: the faults land while it runs
CHECKPOINT_EVERY = 10


def chaos_spec(name: str, steps: int, *, paced_attempts: int = 1, **policy: Any) -> JobSpec:
    """A tiny 2-rank job, paced in its first `paced_attempts` attempts, a checkpoint every 10 steps; the drill
    policy (tests/e2e/drill_harness.py) with 5 restarts, changed by `policy`."""
    pace = [FaultSpec(kind="slow", step=0, rank=0, seconds=PACE_S, attempt=a) for a in range(paced_attempts)]
    return drill_spec(name, slots=2, steps=steps, checkpoint_every=CHECKPOINT_EVERY, faults=pace,
                      **{"max_restarts": 5, **policy})


@dataclass
class Chaos:
    """The platform and the broker under it (`broker` is replaced when the test restarts it)."""

    platform: Platform
    broker: broker_mod.Broker
    started: float

    async def kill_broker(self, down_s: float) -> None:
        """SIGKILL the nats-server, leave it down `down_s`, start it again on the same port and store."""
        self.broker.proc.send_signal(signal.SIGKILL)
        self.broker.proc.wait(10)
        await asyncio.sleep(down_s)
        self.broker = await asyncio.to_thread(self.broker.restart)

    async def pause_broker(self, paused_s: float) -> None:
        """SIGSTOP the nats-server for `paused_s` (its sockets stay open, nothing answers), then SIGCONT."""
        os.kill(self.broker.proc.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(paused_s)
        finally:
            os.kill(self.broker.proc.pid, signal.SIGCONT)

    async def outcome(self, job_id: str, steps: int, drill: str, faults: list[str]) -> Outcome:
        """Wait for the job to end, check it from the stored streams, record and return what held."""
        p = self.platform
        await p.until(lambda: ended(p, job_id), 150, "the job to end", job_id)
        result = await check(p.store, job_id, steps=steps, drill=drill, faults=faults,
                             seconds=time.monotonic() - self.started)
        record(result)
        return result


@pytest.fixture
async def chaos(tmp_path: Path) -> AsyncIterator[Chaos]:
    """Every service on a fresh broker, no agent yet; everything stopped at the end (the broker last), after each
    job's history is kept in the test's tmp dir as `<job>.history.jsonl`."""
    broker = broker_mod.start(tmp_path / "nats")
    c: Chaos | None = None
    try:
        p = await start_drill(broker.url, tmp_path)
        c = Chaos(p, broker, time.monotonic())
        try:
            yield c
        finally:
            try:
                for job_id in sorted({j for s in p.control if (j := subjects.job_of(s.stored.subject))}):
                    await export(p, job_id, tmp_path / f"{job_id}.history.jsonl")
            finally:
                await p.close()
    finally:
        (c.broker if c else broker).stop()


def ended(p: Platform, job_id: str) -> bool:
    return any(type(e).__name__ in ("JobCompleted", "JobFailed", "JobCancelled") for e in p.job(job_id))


def rebuilds(p: Platform, name: str) -> int:
    """How often the service has logged `rebuilt` (started and caught up)."""
    log = p.root / f"{name}.log"
    return log.read_text(errors="replace").count('"rebuilt"') if log.exists() else 0


async def sigkill(p: Platform, name: str) -> None:
    proc = p.procs[name]
    proc.send_signal(signal.SIGKILL)
    await asyncio.to_thread(proc.wait, 10)


async def restart(p: Platform, name: str, within: float = 60.0) -> None:
    """Start service `name` again and wait until it has rebuilt its state."""
    before = rebuilds(p, name)
    p.service(name)
    await p.until(lambda: rebuilds(p, name) > before, within, f"{name} to rebuild after its restart")


def last_step(p: Platform, job_id: str, attempt: int) -> int:
    return max((e.step for e in p.seen(StepCompleted, job_id, stream=subjects.TELEMETRY) if e.attempt == attempt),
               default=-1)


async def step_reached(p: Platform, job_id: str, attempt: int, step: int, within: float = 90.0) -> None:
    await p.until(lambda: last_step(p, job_id, attempt) >= step, within, f"attempt {attempt} to reach step {step}",
                  job_id)


async def progress(p: Platform, job_id: str, attempt: int, steps: int, within: float = 60.0) -> None:
    """Wait until `attempt` has done `steps` more steps than now."""
    await step_reached(p, job_id, attempt, last_step(p, job_id, attempt) + steps, within)


def rank_pids(p: Platform, job_id: str, attempt: int) -> dict[int, int]:
    return {rank: pid for e in p.seen(WorkersStarted, job_id) if e.attempt == attempt
            for rank, pid in zip(e.ranks, e.pids, strict=True)}
