"""The dashboard's operator actions against a real broker: without the server's token nothing is taken; with it each
action is the client's call, appended to the job's history as the CLI's would be (producer "dashboard"), and refused
as the CLI refuses it (a paused job's pause, a rollback with no checkpoint), with the client's words."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from flightdeck.events.commands import PauseRequested, ResumeRequested
from flightdeck.events.history import append_to_job, read_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import (
    AllocationGranted,
    AllocationRequested,
    CancelRequested,
    JobQueued,
    JobSubmitted,
    SlotRef,
    WorkersStarted,
)
from flightdeck.events.spec import JobSpec
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.tools.web.server import serve
from tests.conftest import ensure_streams_at

TOKEN = "a-long-enough-operator-token"
JOB = "acted-000001"


@dataclass
class Ui:
    url: str
    store: JetStreamStore


async def running_job(store: JetStreamStore) -> None:
    """A job whose history says it runs: what the scheduler, resources and an agent would have appended."""
    def ev(cls: type[Any], **fields: Any) -> Any:
        return cls(job_id=JOB, event_id=uuid.uuid4().hex, occurred_at=time.time(), **fields)
    for event in (ev(JobSubmitted, spec=JobSpec(name="acted", slots=1)), ev(JobQueued, priority=50, reason="submitted"),
                  ev(AllocationRequested, attempt=0, slots=1),
                  ev(AllocationGranted, attempt=0, assignments=[SlotRef(node="n1", slot=0, rank=0)]),
                  ev(WorkersStarted, node="n1", attempt=0, ranks=[0], pids=[1])):
        await append_to_job(store, event)


@pytest.fixture
async def ui(nats_server: broker_mod.Broker) -> AsyncIterator[Ui]:
    await asyncio.to_thread(ensure_streams_at, nats_server.url)
    store = await JetStreamStore.connect(nats_server.url)
    await running_job(store)
    stop = asyncio.Event()
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(nats_server.url, "127.0.0.1", 0, stop, ready=ready, token=TOKEN))
    try:
        yield Ui(f"http://127.0.0.1:{await asyncio.wait_for(ready, 60)}", store)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await store.close()


async def post(ui: Ui, action: str, body: dict[str, Any] | None = None, token: str | None = TOKEN,
               job: str = JOB) -> tuple[int, dict[str, str]]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with aiohttp.ClientSession() as http, http.post(f"{ui.url}/api/jobs/{job}/{action}", json=body or {},
                                                          headers=headers) as answer:
        return answer.status, await answer.json()


async def commands(ui: Ui) -> list[tuple[str, str]]:
    return [(type(s.event).__name__, s.event.producer) for s in await read_job(ui.store, JOB)
            if isinstance(s.event, PauseRequested | ResumeRequested | CancelRequested)]


@pytest.mark.timeout(120)
async def test_actions_take_the_token_and_are_the_clients_calls_refused_as_the_cli_refuses_them(ui: Ui) -> None:
    assert (await post(ui, "pause", token=None))[0] == 401
    assert (await post(ui, "pause", token="wrong-token-of-some-length"))[0] == 401
    assert await commands(ui) == []  # nothing taken without the token

    status, said = await post(ui, "pause", {"reason": "look at it"})
    assert (status, said["said"]) == (200, "PauseRequested sent; its ranks obey it at their next step boundary")
    status, said = await post(ui, "pause")
    assert status == 409 and said["error"] == f"{JOB} is paused already (look at it); nothing sent"
    status, said = await post(ui, "rollback", {"to_step": 5})
    assert status == 409 and f"{JOB} has no committed checkpoint at or before step 5" in said["error"]
    status, said = await post(ui, "rollback", {"to_step": 5, "skip_from": 9, "skip_to": 3})
    assert status == 400 and "skip_from < skip_to" in said["error"]
    assert (await post(ui, "resume"))[0] == 200
    assert (await post(ui, "explode"))[0] == 404
    assert (await post(ui, "pause", job="nope-000000"))[0] == 404
    assert (await post(ui, "cancel"))[0] == 200
    status, said = await post(ui, "cancel")
    assert (status, said["said"]) == (200, "a cancel was already requested (phase stopping)")
    assert await commands(ui) == [("PauseRequested", "dashboard"), ("ResumeRequested", "dashboard"),
                                  ("CancelRequested", "dashboard")]


@pytest.mark.timeout(120)
async def test_a_server_without_a_token_takes_no_action(nats_server: broker_mod.Broker) -> None:
    await asyncio.to_thread(ensure_streams_at, nats_server.url)
    stop = asyncio.Event()
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(nats_server.url, "127.0.0.1", 0, stop, ready=ready))
    try:
        url = f"http://127.0.0.1:{await asyncio.wait_for(ready, 60)}"
        async with aiohttp.ClientSession() as http, http.post(f"{url}/api/jobs/{JOB}/pause", json={},
                                                              headers={"Authorization": "Bearer x"}) as answer:
            assert answer.status == 403 and "without an operator token" in (await answer.json())["error"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
