"""The EventStore on NATS JetStream (nats-py): fenced, de-duplicated appends, fast ordered reads."""

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import BadRequestError

from flightdeck.events import codec
from flightdeck.events.base import Event
from flightdeck.events.jsreader import Replay, StoreClient, cancellable, is_unavailable
from flightdeck.events.store import AppendResult, ConcurrencyConflict, Stored, StoreUnavailable, decoded
from flightdeck.events.streams import check_server_version, ensure_streams, server_list
from flightdeck.events.subjects import stream_of

log = structlog.get_logger(__name__)

T = TypeVar("T")
# A fence that did not hold: 10071 carries the subject's last sequence; a replicated stream answers 10164 when the
# check cannot be made yet (another message on the subject is in flight, e.g. our own timed-out first try).
_WRONG_LAST_SEQUENCE = (10071, 10164)
READ_PATIENCE_S = 10.0  # how long a read is asked again while the broker does not answer (JetStreamStore._read)


class JetStreamStore:
    """An EventStore over one nats-py connection. Build it with `await JetStreamStore.connect(url)`."""

    def __init__(self, nc: StoreClient, *, timeout: float = 5.0, heartbeat_s: float = 2.0) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=timeout)
        self._timeout = timeout
        self._heartbeat_s = heartbeat_s

    @classmethod
    async def connect(cls, url: str, *, name: str = "flightdeck", request_timeout_s: float = 5.0, replicas: int = 0,
                      telemetry_max_bytes: int | None = None, provision: bool = True,
                      heartbeat_s: float = 2.0, connect_attempts: int = 3, **options: Any) -> "JetStreamStore":
        """Connect (`connect_attempts` tries; once connected, reconnecting forever), check the server version,
        provision the streams (`replicas` 0: $FLIGHTDECK_REPLICAS, else from the cluster's size). `url` may name
        several servers, comma-separated. `options` go to nats-py's `connect` (credentials, TLS)."""
        nc = StoreClient()
        bound = log.bind(nats=url, client=name)

        async def on_error(exc: Exception) -> None:
            bound.warning("nats error", error=repr(exc))

        async def on_disconnect() -> None:
            bound.warning("nats disconnected")

        async def on_reconnect() -> None:
            bound.info("nats reconnected")

        settings: dict[str, Any] = dict(
            name=name, connect_timeout=request_timeout_s, allow_reconnect=True, max_reconnect_attempts=connect_attempts,
            reconnect_time_wait=0.5, error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
        )
        settings.update(options)
        try:
            await nc.connect(servers=server_list(url), **settings)  # one URL or several, comma-separated
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            raise StoreUnavailable(f"cannot connect to NATS at {url}: {exc!r}") from exc
        if "max_reconnect_attempts" not in options:
            # nats-py applies this limit to the first connect too; once connected, a service rides out any outage
            nc.options["max_reconnect_attempts"] = -1
        store = cls(nc, timeout=request_timeout_s, heartbeat_s=heartbeat_s)
        try:
            check_server_version(nc)
            if provision:
                await store._call(lambda: ensure_streams(store.js, replicas, telemetry_max_bytes=telemetry_max_bytes))
        except BaseException:
            await nc.close()
            raise
        return store

    async def close(self) -> None:
        await self.nc.close()

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            return await cancellable(fn())  # a cancel nats-py dropped is raised, not lost
        except Exception as exc:
            if is_unavailable(exc):
                raise StoreUnavailable(f"NATS did not answer: {exc!r}") from exc
            raise

    async def _read(self, fn: Callable[[], Awaitable[T]]) -> T:
        """`_call` for a stream's bounds, asked again while the broker does not answer, up to READ_PATIENCE_S: a
        cluster that lost a stream's leader answers again once it has elected one (seconds on a loaded box), and a
        history reader (verify, status, export) should not fail for that (a chaos test's verify did)."""
        deadline = asyncio.get_running_loop().time() + READ_PATIENCE_S
        while True:
            try:
                return await self._call(fn)
            except StoreUnavailable:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
                log.info("broker did not answer a read: asking again")
                await asyncio.sleep(0.5)

    async def append(self, subject: str, event: Event, *, msg_id: str = "", expected_last_seq: int | None = None,
                     fence: str = "") -> AppendResult:
        return await self.append_bytes(subject, codec.encode(event), msg_id=msg_id or event.event_id,
                                       expected_last_seq=expected_last_seq, fence=fence)

    async def append_bytes(self, subject: str, data: bytes, *, msg_id: str = "", expected_last_seq: int | None = None,
                           fence: str = "") -> AppendResult:
        """`append` for bytes already encoded (or, in tests, deliberately not an event)."""
        headers = {"Nats-Msg-Id": msg_id} if msg_id else {}
        if expected_last_seq is not None:
            headers["Nats-Expected-Last-Subject-Sequence"] = str(expected_last_seq)
            if fence and fence != subject:
                headers["Nats-Expected-Last-Subject-Sequence-Subject"] = fence
        stream = stream_of(subject)
        try:
            ack = await self._call(lambda: self.js.publish(subject, data, headers=headers or None))
        except BadRequestError as exc:
            if exc.err_code not in _WRONG_LAST_SEQUENCE or expected_last_seq is None:
                raise
            # The server checks the fence before the msg id, so a retry whose first try landed lands here.
            last = await self.last(stream, fence or subject)
            if last is not None and msg_id and last.msg_id == msg_id:
                return AppendResult(stream, last.seq, True)
            raise ConcurrencyConflict(fence or subject, expected_last_seq, last.seq if last else 0) from None
        return AppendResult(ack.stream, ack.seq, bool(ack.duplicate))

    async def append_batch(self, items: Sequence[tuple[str, Event]]) -> list[AppendResult]:
        """Pipelined publishes (each with its event id as msg id); waits for every ack."""

        async def run() -> list[PubAck]:
            futures = []
            for subject, event in items:
                headers = {"Nats-Msg-Id": event.event_id} if event.event_id else None
                futures.append(await self.js.publish_async(subject, codec.encode(event), headers=headers))
            # nats-py never times these futures out: a dropped connection would leave them waiting forever
            async with asyncio.timeout(self._timeout + 0.01 * len(futures)):
                return await asyncio.gather(*futures)

        acks = await self._call(run)
        return [AppendResult(a.stream, a.seq, bool(a.duplicate)) for a in acks]

    async def read(self, stream: str, subjects: Sequence[str] = (), *, from_seq: int = 1,
                   until_seq: int = 0) -> AsyncIterator[list[Stored]]:
        end = until_seq or await self.last_seq(stream)
        replay = Replay(self.nc, self.js, stream, subjects, from_seq, end, heartbeat_s=self._heartbeat_s,
                        timeout=self._timeout)
        async with contextlib.aclosing(replay.batches()) as batches:  # its consumer goes when this read does
            async for batch in batches:
                yield batch

    async def follow(self, stream: str, subjects: Sequence[str] = (), *, from_seq: int = 1) -> AsyncIterator[Stored]:
        replay = Replay(self.nc, self.js, stream, subjects, from_seq, None, heartbeat_s=self._heartbeat_s,
                        timeout=self._timeout)
        async with contextlib.aclosing(replay.batches()) as batches:
            async for batch in batches:
                for stored in batch:
                    yield stored

    async def last(self, stream: str, subject: str) -> Stored | None:
        request = json.dumps({"last_by_subj": subject}).encode()
        msg: Msg = await self._call(
            lambda: self.nc.request(f"$JS.API.DIRECT.GET.{stream}", request, timeout=self._timeout))
        headers = msg.headers or {}
        status = headers.get("Status")
        if status == "404":
            return None
        if status:
            raise StoreUnavailable(f"last message of {subject} in {stream}: status {status} {headers}")
        return decoded(stream, int(headers["Nats-Sequence"]), headers["Nats-Subject"], msg.data,
                       headers.get("Nats-Msg-Id", ""))

    async def last_seq(self, stream: str) -> int:
        info = await self._read(lambda: self.js.stream_info(stream))
        return info.state.last_seq

    async def bounds(self, stream: str) -> tuple[int, float, int]:
        info = await self._read(lambda: self.js.stream_info(stream))
        first, last = info.state.first_seq, info.state.last_seq
        if not info.state.messages:
            return max(first, last + 1), float("inf"), last
        request = json.dumps({"seq": first}).encode()
        msg: Msg = await self._read(
            lambda: self.nc.request(f"$JS.API.DIRECT.GET.{stream}", request, timeout=self._timeout))
        status = (msg.headers or {}).get("Status")
        if status:  # aged out between the two calls: the next message is as young or younger
            return first + 1, float("inf"), last
        ev = decoded(stream, first, "", msg.data, "").event
        return first, ev.occurred_at if ev is not None else 0.0, last

