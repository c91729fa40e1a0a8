"""The store under test, one of each implementation, and small event builders the contract tests share."""

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import pytest

from flightdeck.events import subjects
from flightdeck.events.clock import ClockTick
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import JobQueued
from flightdeck.events.store import MemoryStore, Stored
from flightdeck.events.training import StepCompleted

AnyStore = MemoryStore | JetStreamStore
T = TypeVar("T")


@pytest.fixture(params=["memory", "jetstream"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[AnyStore]:
    if request.param == "memory":
        yield MemoryStore(batch=100)
        return
    server = request.getfixturevalue("nats_server")
    js = await JetStreamStore.connect(server.url, heartbeat_s=0.5, request_timeout_s=2.0)
    try:
        yield js
    finally:
        await js.close()


def queued(job: str, n: int, event_id: str = "") -> JobQueued:
    return JobQueued(job_id=job, priority=n, reason=f"r{n}", event_id=event_id)


def step(job: str, rank: int, n: int, loss: float = 1.0) -> StepCompleted:
    return StepCompleted(job_id=job, rank=rank, step=n, loss=loss, grad_norm=0.5, lr=1e-3, tokens_per_s=10.0,
                         step_time_s=0.1, event_id=f"{job}-{rank}-{n}")


def tick(service: str, n: int) -> tuple[str, ClockTick]:
    return subjects.clock(service), ClockTick(service=service, now=float(n), positions={}, event_id=f"{service}-{n}")


async def read_all(store: AnyStore, stream: str, subjects_: tuple[str, ...] = (), **kw: int) -> list[Stored]:
    out: list[Stored] = []
    async for batch in store.read(stream, subjects_, **kw):
        assert batch, "a batch is never empty"
        out.extend(batch)
    return out


async def within(seconds: float, awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, seconds)


async def collect(it: AsyncIterator[Stored], n: int) -> list[Stored]:
    out: list[Stored] = []
    async for stored in it:
        out.append(stored)
        if len(out) == n:
            break
    return out

