"""Reading a stream fast: an ephemeral push consumer delivered to a raw subscription.

A replay of a long history is CPU-bound in the client. nats-py spends most of each message building a
`Msg`, parsing its headers and passing it through a queue to a callback task; a replay needs none of
that. `StoreClient` hands the frames of a "sink" subscription straight to a plain function, and `Replay`
turns them into `Stored` records a batch at a time. It keeps an ordered consumer's guarantees: a gap
in consumer sequences, a consumer that vanished, or missed heartbeats recreate the consumer from the
next stream sequence wanted, so no message is skipped or repeated.
"""

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TypeVar

import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, ServerError, ServiceUnavailableError

from flightdeck.events.store import Stored, StoreUnavailable, decoded

log = structlog.get_logger(__name__)

T = TypeVar("T")

Frame = tuple[bytes, bytes, bytes, bytes]  # subject, reply, payload, raw headers (b"" when none)

_ACK = b"$JS.ACK."
_MSG_ID = b"Nats-Msg-Id:"
_STATUS = b"NATS/1.0 "


class StoreClient(Client):
    """nats-py's client, plus sink subscriptions whose frames bypass the per-message machinery, and requests that
    fail as soon as the connection they went out on is lost."""

    def __init__(self) -> None:
        super().__init__()
        self._sinks: dict[int, Callable[[Frame], None]] = {}
        self.requests_abandoned = 0  # requests failed because their connection was lost under them

    async def _attempt_reconnect(self) -> None:
        self._abandon_requests()
        await super()._attempt_reconnect()

    def _abandon_requests(self) -> None:
        """Fail every request still waiting for its answer: it was written to (or queued for) the connection just
        lost, and nats-py would leave it waiting its whole timeout (5 s) for an answer that cannot come. A broker
        restart then stalled whoever made it long after the reconnect (a service's ticks, for 4.5 s). The callers
        retry at once; a request that did land is answered again by its msg id, as after any timeout. Requests
        made from here on wait in nats-py's pending buffer and go out on the new connection."""
        for future in list(self._resp_map.values()):
            if not future.done():
                future.set_exception(nats.errors.ConnectionReconnectingError())
                self.requests_abandoned += 1

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes) -> None:
        sink = self._sinks.get(sid)
        if sink is None:
            await super()._process_msg(sid, subject, reply, data, headers)
        else:
            sink((subject, reply, data, headers or b""))

    async def sink_subscribe(self, subject: str, sink: Callable[[Frame], None]) -> Subscription:
        """Subscribe with `sink` called, in the read loop, with each raw frame: it must not block."""
        sub = await self.subscribe(subject)
        self._sinks[sub._id] = sink  # nats-py keeps a subscription's id across reconnects
        return sub

    async def sink_unsubscribe(self, sub: Subscription) -> None:
        self._sinks.pop(sub._id, None)
        await sub.unsubscribe()


def is_unavailable(exc: BaseException) -> bool:
    """Whether `exc` means the broker could not be reached or did not answer, rather than a refusal."""
    if isinstance(exc, APIError):  # an answer: only "JetStream not available" and server errors are outages
        return isinstance(exc, ServiceUnavailableError | ServerError)
    return isinstance(exc, nats.errors.Error | asyncio.TimeoutError | OSError)


async def cancellable(call: Awaitable[T]) -> T:
    """`await call` (a nats-py request), raising a cancel of this task that the request dropped.

    nats-py times its requests out with asyncio.wait_for, which on Python 3.11 returns the answer of a request
    answered just as its task was cancelled and drops the cancel (gh-86296). The caller's loop then runs on, and
    whoever cancelled it and waits for it waits forever: a test's telemetry publisher, cancelled mid-append, kept
    publishing while the test waited on it until its 180 s timeout. A dropped cancel still counts in
    `Task.cancelling()`, so a count higher after the call than before it is a cancel that arrived during the call and
    was lost; it is raised here (inside `asyncio.timeout` that becomes the timeout's TimeoutError, as it should)."""
    task = asyncio.current_task()
    before = task.cancelling() if task is not None else 0

    def dropped() -> bool:
        return task is not None and task.cancelling() > before

    try:
        result = await call
    except Exception as exc:  # wait_for re-raises the request's own error in place of the cancel, too
        if dropped():
            raise asyncio.CancelledError("cancelled during a NATS request (its cancel was dropped)") from exc
        raise
    if dropped():
        raise asyncio.CancelledError("cancelled during a NATS request (its cancel was dropped)")
    return result


def msg_id_of(headers: bytes) -> str:
    i = headers.find(_MSG_ID)
    if i < 0:
        return ""
    j = headers.find(b"\r\n", i)
    return headers[i + len(_MSG_ID) : j if j >= 0 else None].strip().decode()


def _header(headers: bytes, name: bytes) -> bytes:
    i = headers.find(name + b":")
    if i < 0:
        return b""
    j = headers.find(b"\r\n", i)
    return headers[i + len(name) + 1 : j if j >= 0 else None].strip()


class _Reset(Exception):
    """The consumer lost its place (gap, deleted, or silent): start again from `next_seq`."""


class Replay:
    """One ordered read of `stream` from `from_seq`; to `end` (inclusive) or, with end None, forever."""

    def __init__(self, nc: StoreClient, js: JetStreamContext, stream: str, subjects: Sequence[str], from_seq: int,
                 end: int | None, *, heartbeat_s: float = 2.0, timeout: float = 5.0) -> None:
        self._nc, self._js, self._stream = nc, js, stream
        self._subjects = list(subjects)
        self.next_seq = max(from_seq, 1)
        self._end = end
        self._heartbeat_s, self._timeout = heartbeat_s, timeout
        self._frames: list[Frame] = []
        self._wake = asyncio.Event()
        self._sub: Subscription | None = None
        self._consumer = ""
        self._dseq = 0  # consumer sequence of the last data message taken

    def _sink(self, frame: Frame) -> None:
        self._frames.append(frame)
        self._wake.set()

    async def _start(self) -> int:
        """A fresh consumer from `next_seq`; returns how many matching messages it has to deliver."""
        await self._stop()
        inbox = self._nc.new_inbox()
        self._frames, self._dseq = [], 0
        self._sub = await self._nc.sink_subscribe(inbox, self._sink)
        config = ConsumerConfig(
            deliver_subject=inbox, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.next_seq,
            ack_policy=AckPolicy.NONE, max_deliver=1, flow_control=True, idle_heartbeat=self._heartbeat_s,
            mem_storage=True, num_replicas=1, inactive_threshold=max(30.0, 5 * self._heartbeat_s),
            filter_subjects=self._subjects or None,
        )
        info = await cancellable(self._js.add_consumer(self._stream, config, timeout=self._timeout))
        self._consumer = info.name or ""
        return info.num_pending or 0

    async def _stop(self) -> None:
        sub, consumer, self._sub, self._consumer = self._sub, self._consumer, None, ""
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError, OSError):
            if sub is not None:
                await cancellable(self._nc.sink_unsubscribe(sub))
            if consumer and self._nc.is_connected:
                # an ephemeral consumer would also go by itself after inactive_threshold; this is sooner
                await cancellable(self._js.delete_consumer(self._stream, consumer))

    async def _restart(self, *, forever: bool) -> int:
        """`_start`, retried while the broker is unavailable: for `timeout` seconds, or forever."""
        delay = 0.1
        deadline = asyncio.get_running_loop().time() + self._timeout
        while True:
            try:
                return await self._start()
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                if not forever and asyncio.get_running_loop().time() > deadline:
                    raise StoreUnavailable(f"cannot read {self._stream}: {exc!r}") from exc
                log.warning("replay consumer start failed", stream=self._stream, next_seq=self.next_seq,
                            error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def batches(self) -> AsyncGenerator[list[Stored], None]:
        """Stored records in stream order, a batch per wake-up."""
        end = self._end
        following = end is None
        if end is not None and self.next_seq > end:
            return
        try:
            pending = await self._restart(forever=following)
            while end is None or (pending > 0 and self.next_seq <= end):
                try:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that lands as
                    # the inner wait completes (gh-86296), so a cancelled follower could run on.
                    async with asyncio.timeout(3 * self._heartbeat_s):
                        await self._wake.wait()
                except TimeoutError:
                    log.info("replay consumer silent, recreating", stream=self._stream, next_seq=self.next_seq)
                    pending = await self._restart(forever=following)
                    continue
                self._wake.clear()
                frames, self._frames = self._frames, []
                out: list[Stored] = []
                try:
                    done = await self._take(frames, out)
                except _Reset as reset:
                    log.info("replay consumer reset", stream=self._stream, next_seq=self.next_seq, why=str(reset))
                    done = False
                    pending = await self._restart(forever=following)
                if out:
                    yield out
                if done:
                    return
        finally:
            await self._stop()

    async def _take(self, frames: list[Frame], out: list[Stored]) -> bool:
        """Append the data frames to `out`, answer flow control; True once `end` is reached."""
        end = self._end
        for subject, reply, data, headers in frames:
            if reply.startswith(_ACK):
                tokens = reply.split(b".")
                base = 2 if len(tokens) == 9 else 4  # v1 ack subjects have 9 tokens, v2 add domain and account
                sseq, dseq, pending = int(tokens[base + 3]), int(tokens[base + 4]), int(tokens[base + 6])
                if dseq != self._dseq + 1:
                    raise _Reset(f"consumer sequence {dseq} after {self._dseq}")
                self._dseq = dseq
                if end is not None and sseq > end:
                    return True
                out.append(decoded(self._stream, sseq, subject.decode(), data, msg_id_of(headers)))
                self.next_seq = sseq + 1
                if end is not None and (sseq == end or pending == 0):
                    return True
            elif headers.startswith(_STATUS + b"100"):
                if reply:  # flow control request: answered once everything before it is taken
                    await self._nc.publish(reply.decode())
                stalled = _header(headers, b"Nats-Consumer-Stalled")
                if stalled:
                    await self._nc.publish(stalled.decode())
                last = _header(headers, b"Nats-Last-Consumer")
                if last and int(last) > self._dseq:
                    raise _Reset(f"heartbeat says consumer sequence {int(last)}, taken {self._dseq}")
            elif headers.startswith(_STATUS):
                raise _Reset(headers.split(b"\r\n", 1)[0].decode(errors="replace"))
        return False
