"""`flightdeck ui` stops when told, whole: an open event stream ends as a whole response, and a NATS request that
drops the cancel of its stop (nats-py answers a request that raced its cancel and loses the cancel: gh-86296) does
not hold it. Both were seen as 30 s teardowns of the /metrics tests."""

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.js.manager import JetStreamManager

from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.tools.web.server import serve
from tests.conftest import ensure_streams_at


@asynccontextmanager
async def serving(tmp_path: Path) -> AsyncIterator[tuple[asyncio.Event, "asyncio.Task[None]", int]]:
    """A broker with the platform's streams and `serve` on it: its stop event, its task and its port."""
    broker = broker_mod.start(tmp_path / "nats")
    try:
        await asyncio.to_thread(ensure_streams_at, broker.url)
        stop = asyncio.Event()
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(broker.url, "127.0.0.1", 0, stop, ready=ready))
        yield stop, task, await asyncio.wait_for(ready, 60)
    finally:
        broker.stop()


async def test_a_cancel_dropped_by_a_nats_request_does_not_hold_the_server_s_stop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked, released = asyncio.Event(), asyncio.Event()

    async def drops_its_cancel(self: Any, *args: Any, **kwargs: Any) -> Any:
        asked.set()
        try:
            await released.wait()  # an answer that does not come before the cancel
        except asyncio.CancelledError:
            pass  # ... and the cancel lost, as nats-py's wait_for loses it
        raise RuntimeError("consumer not found")

    monkeypatch.setattr(JetStreamManager, "consumer_info", drops_its_cancel)
    async with serving(tmp_path) as (stop, task, _):
        try:
            await asyncio.wait_for(asked.wait(), 60)  # the lag poller is inside the request
            stop.set()
            done, _ = await asyncio.wait({task}, timeout=60)  # not cancelled: it must end because it was told to
            assert task in done and task.exception() is None
        finally:
            released.set()  # a failed run's poller answers now, and its next cancel (in its sleep) is not lost


async def test_a_stopping_server_ends_an_open_event_stream_cleanly(tmp_path: Path) -> None:
    """`flightdeck ui` stopped while a page follows its events: the stream ends as a whole response, not cut off.
    It used to hold the shutdown until its next ping (a test's teardown took 30 s) and then be cancelled."""
    async with serving(tmp_path) as (stop, task, port), aiohttp.ClientSession() as http, \
            http.get(f"http://127.0.0.1:{port}/events") as stream:
        assert (await stream.content.readuntil(b"\n\n")).startswith(b"event: board\n")
        stop.set()
        rest = await stream.content.read()  # to the end of a whole response: a cut-off one raises here
        await task
    assert not rest or rest.endswith(b"\n\n")  # whatever came after is whole events
