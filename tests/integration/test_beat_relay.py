"""The node agent's heartbeat relay on real sockets and a real broker: a rank's Telemetry hands its beats to
the relay, which publishes one RankHeartbeats per interval; a beat from a process that is not the rank it
names, or bytes that are not a beat, are refused and counted; when the relay goes away the rank heartbeats
through the broker again."""

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flightdeck.events import codec, subjects
from flightdeck.events.heartbeats import LocalBeat, RankHeartbeats
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.nodelocal import BeatChannel, sockaddr
from flightdeck.events.training import Heartbeat
from flightdeck.services.agent.beats import BeatRelay, store_publisher
from flightdeck.services.agent.links import RankLinks
from flightdeck.services.shell import broker as broker_mod
from flightdeck.trainer.link import AgentLink
from tests.conftest import ensure_streams_at

JOB = "beats-000001"
ROOT = Path(__file__).resolve().parents[2]

FORGER = """
import sys
from flightdeck.events.heartbeats import LocalBeat
from flightdeck.events.nodelocal import BeatChannel
ch = BeatChannel(sys.argv[1])
ch.send(LocalBeat(job_id="beats-000001", attempt=0, rank=0, step=5, occurred_at=1.0, interval_s=0.2))
"""


async def _telemetry(store: JetStreamStore, type_name: str) -> list[object]:
    out: list[object] = []
    async for batch in store.read(subjects.TELEMETRY, [f"fd.tel.{JOB}.*.{type_name}"]):
        out += [s.event for s in batch]
    return out


@pytest.mark.timeout(150)  # a hang guard: a loaded 2-core box has taken over 60 s here
async def test_a_ranks_beats_reach_the_broker_in_batches_and_impostors_do_not(nats_server: broker_mod.Broker) -> None:
    await asyncio.to_thread(ensure_streams_at, nats_server.url)
    store = await JetStreamStore.connect(nats_server.url)
    me = os.getpid()
    relay = BeatRelay(node="n1", producer="agent-n1", publish=store_publisher(store),  # the agent's publisher
                      admit=lambda b, pid: pid == me and (b.job_id, b.attempt, b.rank) == (JOB, 0, 0))
    relay.start()
    links = RankLinks(node="n1", store=store)  # the rank's own link: its Heartbeat events when the relay is gone
    links.start()
    tel = AgentLink(links.address, JOB, 0, 0, "n1", heartbeat_s=0.2, beats=BeatChannel(relay.address))
    try:
        await asyncio.to_thread(tel.connect, 30.0)
        tel.start()
        began = time.monotonic()
        tel.set_step(4, 0.05)
        # another local process claiming to be rank 0, and bytes that are no beat
        await asyncio.to_thread(subprocess.run, [sys.executable, "-c", FORGER, relay.address], cwd=ROOT,
                                check=True, timeout=30)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
            raw.sendto(b"\x93not a beat", sockaddr(relay.address))
        await asyncio.sleep(1.5)
        assert relay.rejected == 1 and relay.invalid == 1
        published = [e for e in await _telemetry(store, "RankHeartbeats") if isinstance(e, RankHeartbeats)]
        # One beat, and at most one batch, per 0.2 s of the time this took (+2: the first beat and batch go out at
        # once); the forger's start-up makes that longer on a loaded box (a fixed 10 failed at 11 under a CPU hog).
        most = (time.monotonic() - began) / 0.2 + 2
        assert 4 <= relay.received <= most and 3 <= len(published) <= most, (relay.received, len(published), most)
        assert all(e.producer == "agent-n1" and e.node == "n1" and e.rank == 0 for e in published)
        entries = [b for batch in published for b in batch.beats]
        assert {b.rank for b in entries} == {0} and all(b.step in (0, 4) for b in entries)  # never the forged 5
        assert entries[-1].step == 4 and entries[-1].step_time_s == 0.05
        assert await _telemetry(store, "Heartbeat") == []  # no beat of its own while the agent relays them

        await relay.close()  # the relay is gone: the rank heartbeats on its link
        await asyncio.sleep(1.0)
        own = await _telemetry(store, "Heartbeat")
        assert len(own) >= 3 and all(isinstance(e, Heartbeat) and e.step == 4 for e in own)
    finally:
        await asyncio.to_thread(tel.close)
        await relay.close()
        await links.close()
        await store.close()


def test_a_channel_nobody_listens_on_says_so_and_an_empty_address_is_refused() -> None:
    ch = BeatChannel(f"@flightdeck-beats-test-{os.getpid()}-{time.monotonic_ns()}")
    beat = LocalBeat(job_id=JOB, attempt=0, rank=0, step=1, occurred_at=time.time(), interval_s=1.0)
    assert ch.send(beat) is False
    ch.close()
    with pytest.raises(ValueError, match="FLIGHTDECK_BEATS is empty"):
        BeatChannel("@")
    assert "LocalBeat" not in {t.__name__ for t in codec.ALL_TYPES}  # never on the broker: no event
