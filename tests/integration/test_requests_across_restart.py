"""Requests across a broker restart (events/jsreader.py StoreClient): a request already sent when the broker dies is
failed at once with ConnectionReconnectingError, not left waiting out its timeout (a service's ticks stalled 4.5 s
behind one such append); a request made while the broker is away waits and is answered on the new connection."""

import asyncio
import signal

import nats.errors
import pytest

from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.jsreader import StoreClient
from flightdeck.services.shell import broker as broker_mod

NEVER_S = 600.0  # longer than the test may run: only the lost connection can end a request sent with it


@pytest.mark.timeout(90)
async def test_a_request_lost_with_its_connection_fails_at_once_and_one_made_in_the_outage_is_answered(
        nats_server: broker_mod.Broker) -> None:
    broker = nats_server
    store = await JetStreamStore.connect(broker.url, name="requests-test")
    nc = store.nc
    assert isinstance(nc, StoreClient)
    heard: asyncio.Queue[str] = asyncio.Queue()

    async def silent(msg: nats.aio.msg.Msg) -> None:  # hears the request, never answers it
        heard.put_nowait(msg.data.decode())

    async def echo(msg: nats.aio.msg.Msg) -> None:
        await msg.respond(b"echo:" + msg.data)

    await nc.subscribe("test.silent", cb=silent)
    await nc.subscribe("test.echo", cb=echo)
    try:
        lost = asyncio.create_task(nc.request("test.silent", b"before", timeout=NEVER_S))
        assert await asyncio.wait_for(heard.get(), 30) == "before"  # on the wire, and unanswered
        broker.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(broker.proc.wait, 10)
        with pytest.raises(nats.errors.ConnectionReconnectingError):
            await asyncio.wait_for(lost, 30)
        assert nc.requests_abandoned == 1

        # Made while the broker is away: buffered, sent after the subscriptions are replayed, answered.
        during = asyncio.create_task(nc.request("test.echo", b"during", timeout=NEVER_S))
        await asyncio.sleep(0.2)
        assert not during.done()
        broker = await asyncio.to_thread(broker.restart)
        reply = await asyncio.wait_for(during, 60)
        assert reply.data == b"echo:during"
        assert nc.requests_abandoned == 1  # nothing made after the loss was failed
    finally:
        await store.close()
        if broker is not nats_server:
            broker.stop()
