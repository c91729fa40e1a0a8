"""What a rank publishes on fd.tel.<job>.<rank>.<Type>: a bounded backlog the training step appends to
in microseconds, drained by a JetStream publisher on its own thread, plus a heartbeat thread.

The step never waits on the network. While the broker is away events wait in the backlog; when it is
full the oldest Heartbeat/StepCompleted go first, and facts a postmortem needs (faults, drills,
checkpoints staged, rollbacks, starts) are never dropped.

With a node agent's heartbeat socket (events/nodelocal.py) the heartbeat thread hands each beat to the agent,
which publishes one batch per node; if the agent stops listening the rank heartbeats through the broker."""

import asyncio
import contextlib
import os
import threading
import time
from collections import deque

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import PubAck

from events import codec, subjects
from events.base import Event, RankEvent
from events.heartbeats import LocalBeat
from events.nodelocal import BeatChannel
from events.training import Heartbeat, StepCompleted
from trainer import bus

DROPPABLE: tuple[type[Event], ...] = (Heartbeat, StepCompleted)  # superseded by the next one of their kind
BATCH = 256
ACK_TIMEOUT_S = 2.0
RETRY_WAIT_S = 0.2
IDLE_WAKE_S = 0.5  # the publisher also wakes on its own, to notice drops and close without a nudge
DROP_LOG_EVERY_S = 5.0


def uuid4_hex() -> str:
    """A random (version 4) UUID as 32 hex digits; `uuid.uuid4().hex` costs ~6 µs here, this ~1 µs."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    return b.hex()


class Backlog:
    """Events waiting to be published, in emit order, with a priority drop when full.

    Two deques (droppable and kept) tagged with one running sequence: dropping the oldest droppable
    is O(1), taking in emit order is a merge of the heads, and taking kept events first is trivial."""

    def __init__(self, capacity: int) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._lock = threading.Lock()
        self._droppable: deque[tuple[int, RankEvent]] = deque()
        self._kept: deque[tuple[int, RankEvent]] = deque()
        self._seq = 0
        self.num_dropped = 0

    def push(self, event: RankEvent) -> None:
        with self._lock:
            self._seq += 1
            (self._droppable if isinstance(event, DROPPABLE) else self._kept).append((self._seq, event))
            # Over capacity with nothing droppable left, a kept event still goes in: losing a fault is worse.
            if len(self._droppable) + len(self._kept) > self.capacity and self._droppable:
                self._droppable.popleft()
                self.num_dropped += 1

    def take(self, n: int, *, kept_first: bool = False) -> list[RankEvent]:
        out: list[RankEvent] = []
        with self._lock:
            d, k = self._droppable, self._kept
            while len(out) < n and (d or k):
                if k and (kept_first or not d or k[0][0] < d[0][0]):
                    out.append(k.popleft()[1])
                else:
                    out.append(d.popleft()[1])
        return out

    def __len__(self) -> int:
        return len(self._droppable) + len(self._kept)

    def count_kept(self) -> int:
        return len(self._kept)


class Telemetry:
    """One rank's telemetry publisher. `emit` from any thread; `close` once at the end."""

    def __init__(self, url: str | None, job_id: str, rank: int, attempt: int, node: str, *,
                 heartbeat_s: float = 1.0, capacity: int = 10_000, beats: BeatChannel | None = None) -> None:
        self._url = url
        self._job_id, self._rank, self._attempt, self._node = job_id, rank, attempt, node
        self._heartbeat_s = heartbeat_s
        self._backlog = Backlog(capacity)
        self._log = bus.logger("trainer.telemetry", job_id, rank, attempt)
        self._loop = bus.LoopThread(f"telemetry-{rank}")
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        # (last completed step, its duration): one value, so the heartbeat thread never pairs a step with the
        # time of the step before it; the duration rides beats through the agent
        self._progress = (0, 0.0)
        self._beats = beats
        self._closed = False
        self._subjects: dict[str, str] = {}
        self.num_published = 0
        self.num_rejected = 0  # refused by the broker for good (e.g. too large): retrying cannot help
        # Set by the publisher just before it sleeps, so `emit` pays for a cross-thread wake-up only then.
        self._sleeping = False
        self._wake: asyncio.Event | None = None
        self._closing = False
        # Closing with the broker away, or half the close timeout gone: spend the time left on what a
        # postmortem needs (faults and the other kept events) before steps and heartbeats. Otherwise
        # close keeps emit order. (With `sync_interval: always` a broker here stores ~2k msg/s.)
        self._hurry = False
        self._broker_away = False
        self._deadline = 0.0
        self._inflight: list[RankEvent] = []  # taken from the backlog, not yet acknowledged
        self._logged_drops = 0
        self._last_drop_log = 0.0

    @property
    def num_dropped(self) -> int:
        return self._backlog.num_dropped

    @property
    def num_pending(self) -> int:
        return len(self._backlog)

    def start(self) -> None:
        if self._url is None:
            return
        self._loop.start(self._main)
        self._beat_thread = threading.Thread(target=self._beat, name=f"heartbeat-{self._rank}", daemon=True)
        self._beat_thread.start()

    def emit(self, event: RankEvent) -> None:
        """Queue one event; never blocks. Stamps `event_id`, `occurred_at` and `producer` when empty."""
        if self._url is None or self._closed:
            return
        if not (event.event_id and event.occurred_at and event.producer):
            event = msgspec.structs.replace(
                event,
                event_id=event.event_id or uuid4_hex(),
                occurred_at=event.occurred_at or time.time(),
                producer=event.producer or "trainer",
            )
        self._backlog.push(event)
        if self._sleeping:
            self._sleeping = False
            wake = self._wake
            if wake is not None:
                self._loop.call_soon(wake.set)

    def set_step(self, step: int, step_time_s: float = 0.0) -> None:
        self._progress = (step, step_time_s)

    def close(self, timeout: float = 5.0) -> None:
        """Stop heartbeating, publish what is queued within `timeout`, stop the threads.

        Call it on every exit, a crash included, so the FaultInjected/RankFault just emitted lands: kept
        events jump the queue when the broker is away or half the timeout is gone."""
        if self._url is None or self._closed:
            return
        self._closed = True
        self._beat_stop.set()
        if self._beat_thread is not None:
            self._beat_thread.join(timeout)
        if not self._loop.running:
            if len(self._backlog):
                self._log.error("telemetry.closed_unstarted", lost=len(self._backlog))
            return
        deadline = time.monotonic() + timeout
        self._loop.call_soon(lambda: self._begin_close(deadline))
        if not self._loop.join(timeout + 1.0):
            self._log.error("telemetry.close_stuck", pending=len(self._backlog))

    def _beat(self) -> None:
        while True:
            if not self._beat_to_agent():
                self.emit(Heartbeat(job_id=self._job_id, rank=self._rank, attempt=self._attempt, node=self._node,
                                    step=self._progress[0], interval_s=self._heartbeat_s))
            if self._beat_stop.wait(self._heartbeat_s):
                return

    def _beat_to_agent(self) -> bool:
        if self._beats is None:
            return False
        step, step_time = self._progress
        beat = LocalBeat(job_id=self._job_id, attempt=self._attempt, rank=self._rank, step=step,
                         occurred_at=time.time(), interval_s=self._heartbeat_s,
                         step_time_s=max(step_time, 0.0) if step >= 0 else 0.0)
        if self._beats.send(beat):
            return True
        self._log.warning("telemetry.agent_gone", address=self._beats.address,
                          detail="the node agent's heartbeat socket does not answer: heartbeating through the broker")
        self._beats.close()
        self._beats = None
        return False

    def _begin_close(self, deadline: float) -> None:
        self._closing = True
        self._hurry = self._broker_away
        self._deadline = deadline
        if not len(self._backlog) and not self._inflight:
            self._loop.cancel()  # nothing to flush: do not wait for a broker that may be down
            return
        if self._wake is not None:
            self._wake.set()
        loop, left = asyncio.get_running_loop(), max(deadline - time.monotonic(), 0.0)
        loop.call_later(left / 2, self._start_hurrying)
        loop.call_later(left, self._loop.cancel)

    def _start_hurrying(self) -> None:
        self._hurry = True

    async def _main(self) -> None:
        self._wake = asyncio.Event()
        nc: NATS | None = None
        assert self._url is not None
        try:
            nc = await bus.connect(self._url, f"fd-trainer-{self._job_id}-{self._rank}", self._log, self._on_change)
            await self._publish_loop(nc, nc.jetstream())
        except asyncio.CancelledError:
            pass
        finally:
            self._log_drops(force=True)
            lost = len(self._backlog) + len(self._inflight)
            if lost:
                self._log.error("telemetry.lost_at_close", lost=lost, kept=self._backlog.count_kept())
            await bus.close_quietly(nc, 1.0)

    async def _on_change(self, up: bool) -> None:
        self._broker_away = not up
        if not up and self._closing:
            self._hurry = True

    async def _publish_loop(self, nc: NATS, js: JetStreamContext) -> None:
        assert self._wake is not None
        while True:
            self._log_drops()
            if not nc.is_connected:  # publishing now would only pile up in nats-py's reconnect buffer
                if self._closing:
                    if not self._inflight and not len(self._backlog):
                        return
                await asyncio.sleep(RETRY_WAIT_S / 4)
                continue
            if not self._inflight:
                self._inflight = self._backlog.take(BATCH, kept_first=self._hurry)
            if not self._inflight:
                if self._closing:
                    return
                self._wake.clear()
                self._sleeping = True
                if not len(self._backlog):  # an emit racing the flag above has either queued or will wake us
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(IDLE_WAKE_S):  # not wait_for: on 3.11 it can swallow a cancel
                            await self._wake.wait()
                self._sleeping = False
                continue
            self._inflight = await self._publish(js, self._inflight)
            if self._inflight:
                self._hurry = self._closing
                await asyncio.sleep(RETRY_WAIT_S)

    async def _publish(self, js: JetStreamContext, batch: list[RankEvent]) -> list[RankEvent]:
        """Pipeline a batch; returns the events to retry, in order. Retries reuse the event id as
        Nats-Msg-Id, so one whose ack was lost is stored once."""
        futures: list[asyncio.Future[PubAck]] = []
        for event in batch:
            try:
                fut = await js.publish_async(self._subject(event), codec.encode(event),
                                             headers={"Nats-Msg-Id": event.event_id})
            except (nats.errors.Error, OSError) as exc:
                self._log.debug("telemetry.publish_failed", error=f"{type(exc).__name__}: {exc}")
                break
            futures.append(fut)
        if futures:
            timeout = ACK_TIMEOUT_S
            if self._closing:
                timeout = min(timeout, max(self._deadline - time.monotonic(), 0.01))
            await asyncio.wait(futures, timeout=timeout)
        retry: list[RankEvent] = []
        for event, fut in zip(batch, futures, strict=False):
            if not fut.done() or fut.cancelled():
                fut.cancel()
                retry.append(event)
            elif fut.exception() is None:
                self.num_published += 1
            elif self._permanent(fut.exception()):
                self.num_rejected += 1
                self._log.error("telemetry.rejected", type=codec.type_name(event), event_id=event.event_id,
                                error=str(fut.exception()))
            else:
                retry.append(event)
        retry.extend(batch[len(futures):])
        return retry

    @staticmethod
    def _permanent(exc: BaseException | None) -> bool:
        # 400/404 from JetStream say this message will never be stored; 5xx and no-responders are outages.
        return isinstance(exc, nats.js.errors.BadRequestError | nats.js.errors.NotFoundError)

    def _subject(self, event: RankEvent) -> str:
        name = codec.type_name(event)
        subject = self._subjects.get(name)
        if subject is None:
            subject = self._subjects[name] = subjects.telemetry(self._job_id, self._rank, name)
        return subject

    def _log_drops(self, force: bool = False) -> None:
        dropped = self._backlog.num_dropped
        now = time.monotonic()
        if dropped > self._logged_drops and (force or now - self._last_drop_log >= DROP_LOG_EVERY_S):
            self._log.warning("telemetry.dropped", dropped=dropped - self._logged_drops, total_dropped=dropped,
                              pending=len(self._backlog))
            self._logged_drops, self._last_drop_log = dropped, now
