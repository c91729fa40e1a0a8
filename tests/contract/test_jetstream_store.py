"""What only the JetStream store has: stream provisioning, the server version gate, outages, broker restarts."""

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest
from nats.aio.client import ServerVersion
from nats.js.api import DiscardPolicy, StorageType

from flightdeck.events import subjects
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.store import StoreUnavailable
from flightdeck.events.streams import (
    LOGS_MAX_AGE_S,
    LOGS_MAX_BYTES,
    ServerTooOld,
    StorageRefused,
    check_server_version,
    ensure_streams,
)
from flightdeck.events.subjects import CONTROL, DEAD, LOGS, STATE, TELEMETRY
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.broker import Broker, free_port
from tests.conftest import restart_broker
from tests.contract.store_fixtures import collect, queued, read_all, within

pytestmark = pytest.mark.timeout(60)
T = TypeVar("T")


async def retrying(fn: Callable[[], Awaitable[T]], seconds: float = 15.0) -> T:
    """Call `fn` until the store is reachable again (a client reconnecting after a broker restart)."""
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        try:
            return await fn()
        except StoreUnavailable:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_streams_are_provisioned_as_designed(nats_server: Broker) -> None:
    store = await JetStreamStore.connect(nats_server.url, telemetry_max_bytes=10**8)
    try:
        control = (await store.js.stream_info(CONTROL)).config
        assert (control.subjects, control.deny_delete, control.deny_purge) == (["fd.ctl.>"], True, True)
        assert control.duplicate_window == 120 and StorageType(control.storage) == StorageType.FILE
        assert not control.max_age and control.max_bytes in (None, -1) and control.allow_direct
        telemetry = (await store.js.stream_info(TELEMETRY)).config
        assert telemetry.max_bytes == 10**8 and telemetry.max_age == 7 * 24 * 3600
        assert DiscardPolicy(telemetry.discard) == DiscardPolicy.OLD
        assert (await store.js.stream_info(DEAD)).config.subjects == ["fd.dead.>"]
        logs = (await store.js.stream_info(LOGS)).config  # what ranks print: limited apart from telemetry
        assert logs.subjects == ["fd.log.>"] and logs.max_bytes == LOGS_MAX_BYTES and logs.max_age == LOGS_MAX_AGE_S
        assert DiscardPolicy(logs.discard) == DiscardPolicy.OLD
    finally:
        await store.close()


async def test_ensure_streams_is_idempotent_and_updates_what_differs(nats_server: Broker) -> None:
    store = await JetStreamStore.connect(nats_server.url)
    try:
        await store.append(subjects.job("j", "JobQueued"), queued("j", 1, "kept"))
        racing = await asyncio.gather(ensure_streams(store.js), ensure_streams(store.js))  # two processes at once
        assert racing == [{CONTROL: "unchanged", TELEMETRY: "unchanged", DEAD: "unchanged", LOGS: "unchanged",
                           STATE: "unchanged"}] * 2
        changed = await ensure_streams(store.js, telemetry_max_bytes=12345678)
        assert changed == {CONTROL: "unchanged", TELEMETRY: "updated", DEAD: "unchanged", LOGS: "unchanged",
                           STATE: "unchanged"}
        assert (await store.js.stream_info(STATE)).config.max_msgs_per_subject == 1
        assert (await store.js.stream_info(TELEMETRY)).config.max_bytes == 12345678
        assert await store.last_seq(CONTROL) == 1  # an update never loses what is stored
    finally:
        await store.close()


def test_an_old_server_is_refused_with_a_reason() -> None:
    class OldServer:  # what a connected nats-py client reports, for a Debian 2.9 server
        connected_server_version = ServerVersion("2.9.10")

    class NewServer:
        connected_server_version = ServerVersion("2.12.7")

    with pytest.raises(ServerTooOld, match=r"2\.9\.10 is too old: Flightdeck needs 2\.12\.7"):
        check_server_version(OldServer())  # type: ignore[arg-type]
    check_server_version(NewServer())  # type: ignore[arg-type]


async def test_a_store_too_small_for_the_streams_is_refused_by_name_not_waited_out(tmp_path: Path) -> None:
    # JetStream reserves each stream's max_bytes; a server whose store is smaller (set, or 75% of a nearly full
    # disk when unset) answers "insufficient storage": a setting to change, which retrying would never mend
    config = tmp_path / "small.conf"
    config.write_text("jetstream { max_file_store: 2GB }\n")
    small = broker_mod.start(tmp_path / "nats", config=config)
    try:
        with pytest.raises(StorageRefused, match=r"cannot reserve 4\.00 GiB for stream FD_TELEMETRY .*max_file_store"):
            await JetStreamStore.connect(small.url, request_timeout_s=2.0)
        store = await JetStreamStore.connect(small.url, request_timeout_s=2.0, telemetry_max_bytes=256 * 1024**2)
        await store.close()  # with a telemetry limit that fits, the same server serves
        service = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flightdeck.services", "scheduler", "--nats", small.url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        said, _ = await service.communicate()
        assert service.returncode == 3, said.decode()  # stopped with the reason, not reconnecting forever
        assert b"cannot reserve 4.00 GiB for stream FD_TELEMETRY" in said
    finally:
        small.stop()


async def test_no_server_is_store_unavailable() -> None:
    with pytest.raises(StoreUnavailable, match="cannot connect"):
        await JetStreamStore.connect(f"nats://127.0.0.1:{free_port()}", request_timeout_s=0.5)


async def test_a_stopped_server_is_store_unavailable_then_the_store_recovers(nats_server: Broker) -> None:
    store = await JetStreamStore.connect(nats_server.url, request_timeout_s=0.5, heartbeat_s=0.5)
    try:
        await store.append(subjects.job("j", "JobQueued"), queued("j", 1, "a"))
        nats_server.stop()
        with pytest.raises(StoreUnavailable):
            await store.append(subjects.job("j", "JobQueued"), queued("j", 2, "b"))
        with pytest.raises(StoreUnavailable):
            await store.last(CONTROL, subjects.job_all("j"))
        with pytest.raises(StoreUnavailable):
            await store.append_batch([(subjects.job("j", "JobQueued"), queued("j", 3, "c"))])
        with pytest.raises(StoreUnavailable):
            await read_all(store, CONTROL, until_seq=5)
        server = restart_broker(nats_server)
        try:
            await retrying(lambda: store.append(subjects.job("j", "JobQueued"), queued("j", 4, "d")))
            ids = [s.msg_id for s in await read_all(store, CONTROL)]
            # an unavailable append's outcome is unknown: nats-py flushes what it buffered once reconnected
            assert ids[0] == "a" and ids[-1] == "d" and set(ids) <= {"a", "b", "c", "d"} and len(set(ids)) == len(ids)
        finally:
            server.stop()
    finally:
        await store.close()


async def test_follow_carries_on_across_a_broker_restart(nats_server: Broker) -> None:
    store = await JetStreamStore.connect(nats_server.url, request_timeout_s=1.0, heartbeat_s=0.3)
    server = nats_server
    try:
        for n in range(1, 4):
            await store.append(subjects.job("j", "JobQueued"), queued("j", n, f"before{n}"))
        follower = store.follow(CONTROL, [subjects.job_all("j")])
        async with contextlib.aclosing(follower):
            assert [s.seq for s in await within(10, collect(follower, 3))] == [1, 2, 3]
            server = restart_broker(server)
            for n in range(4, 7):
                await retrying(lambda n=n: store.append(subjects.job("j", "JobQueued"), queued("j", n, f"after{n}")))
            after = await within(20, collect(follower, 3))
        assert [s.msg_id for s in after] == ["after4", "after5", "after6"]
        assert [s.seq for s in after] == [4, 5, 6]
    finally:
        await store.close()
        server.stop()
