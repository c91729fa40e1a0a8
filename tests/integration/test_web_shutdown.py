"""The web server stops when told even if a NATS request drops the cancel of its stop (nats-py answers a request
that raced its cancel and loses the cancel: gh-86296). Seen in CI as a 30 s teardown of the /metrics test: the
server's lag poller, cancelled inside `consumer_info`, polled on and held `serve` until the fixture's wait ran out."""

import asyncio
from pathlib import Path
from typing import Any

import pytest
from nats.js.manager import JetStreamManager

from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.tools.web.server import serve
from tests.conftest import ensure_streams_at


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
    broker = broker_mod.start(tmp_path / "nats")
    try:
        await asyncio.to_thread(ensure_streams_at, broker.url)
        stop = asyncio.Event()
        ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(broker.url, "127.0.0.1", 0, stop, ready=ready))
        await asyncio.wait_for(ready, 60)
        await asyncio.wait_for(asked.wait(), 60)  # the lag poller is inside the request
        stop.set()
        done, _ = await asyncio.wait({task}, timeout=60)  # not cancelled: it must end because it was told to
        assert task in done and task.exception() is None
    finally:
        released.set()  # a failed run's poller answers now, and its next cancel (in its sleep) is not lost
        broker.stop()
