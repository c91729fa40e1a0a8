"""The shell every service runs: connect, rebuild state, then consume, fold, store outputs, ack (the loop itself,
shared with the fault explorer, is loop.py; this is its port on NATS JetStream).

The durable consumer `service-<name>` on FD_CONTROL has one input in flight at a time, so inputs are
folded in stream order even across crashes: an input a killed process held comes back (after the ack
wait) before anything later. Startup rebuilds state by folding everything up to the consumer's ack
floor without emitting. Every output carries the msg id `"{service}:{stream}:{seq}:{index}"`, so an
input folded twice stores nothing new the second time. An input that kills the process every time
is given up after `max_deliver` deliveries; the server's advisory is dead-lettered, and replays skip
that input as the live service did.
"""

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from flightdeck.events import subjects
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.jsreader import cancellable
from flightdeck.events.store import EventStore, Stored, decoded
from flightdeck.services.core import Effect, Emit, Service
from flightdeck.services.shell import deadletter, snapshots
from flightdeck.services.shell.connection import TRANSIENT, Connection, PublishDenied, sleep_or_stop
from flightdeck.services.shell.consumer import ConsumerPolicy, consumer_name, filters
from flightdeck.services.shell.fold import Folder, failure
from flightdeck.services.shell.loop import Delivery, Loop
from flightdeck.services.shell.tap import TelemetryTap

log = structlog.get_logger("flightdeck.shell")
T = TypeVar("T")
PROMPT_S = 0.05  # from a prompting telemetry message (Service.prompt_types) to the tick that folds it

async def run_service(service: Service[Any], url: str, *, stop_event: asyncio.Event | None = None,
                      policy: ConsumerPolicy | None = None) -> None:
    """Run `service` against the broker at `url` until `stop_event` is set (then drain and return)."""
    stop = stop_event or asyncio.Event()
    structlog.contextvars.bind_contextvars(service=service.name)
    conn = Connection(service.name)
    store = await conn.open(url, stop)
    if store is None:
        return
    try:
        await Shell(service, store, conn, policy or ConsumerPolicy(), stop).run()
    finally:
        # Flush (the last acks) and close. Not drain(): a pull subscription keeps the expiry notices of
        # timed-out fetches queued, and drain() would wait for them until its 30 s timeout.
        with contextlib.suppress(Exception):
            await store.nc.flush(timeout=5)
        conn.closing = True
        with contextlib.suppress(Exception):
            await store.nc.close()


class NatsDelivery:
    """An input a pull fetch handed over."""

    def __init__(self, msg: Msg) -> None:
        self.msg = msg
        self.stored = decoded(subjects.CONTROL, msg.metadata.sequence.stream, msg.subject, msg.data,
                              (msg.headers or {}).get("Nats-Msg-Id", ""))

    async def finish(self, refused: bool) -> None:
        await (self.msg.term() if refused else self.msg.ack())

    async def in_progress(self) -> None:
        await self.msg.in_progress()


class Shell:
    """The loop (loop.py) on NATS JetStream: this class is its port, and the consumer's and the ticker's tasks."""

    def __init__(self, service: Service[Any], store: JetStreamStore, conn: Connection, policy: ConsumerPolicy,
                 stop: asyncio.Event) -> None:
        self.service, self.conn, self.policy, self.stop = service, conn, policy, stop
        self.nc: Client = store.nc
        self.js = store.js
        self.store: EventStore = store
        self.consumer = consumer_name(service.name)
        self.loop = Loop(service, self)
        self.tap = TelemetryTap(self.store, service.telemetry_subjects, prompt_types=service.prompt_types)
        # Broker outages this process saw, for its ticks (ClockTick.recovered_at): while the broker is away ranks
        # cannot publish, so a monitor must not read their silence then as death.
        self.outage_at = 0.0  # when a call first went unanswered in the outage under way (0: none)
        self.recovered_at = 0.0  # when the broker last answered again after one
        self.reconnects = 0  # the client's reconnect count when last looked at
        self.detached: set[asyncio.Task[None]] = set()  # effects running in the background (Service.detached)
        self.saver = snapshots.Saver(self.store, 0)
        if service.bind is not None:
            service.bind(self.store)

    @property
    def folder(self) -> Folder[Any]:
        return self.loop.folder

    # -- the port (loop.Port) ------------------------------------------------------------------------------------

    def now(self) -> float:
        return time.time()

    def new_id(self) -> str:
        return str(time.time_ns())

    async def call(self, what: str, fn: Callable[[], Awaitable[T]], subject: str = "") -> T:
        """Run `fn` until it succeeds: the broker may be restarting. A denied publish is not retried."""
        delay = 0.1
        while True:
            try:
                result = await fn()
            except TRANSIENT as exc:
                if subject and self.conn.is_denied(subject):
                    raise PublishDenied(subject) from exc
                self._unanswered()
                log.warning(f"{what} failed; retrying", error=repr(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            self._answered()
            return result

    async def ack_floor(self) -> int:
        info = await cancellable(self.js.consumer_info(subjects.CONTROL, self.consumer))
        return info.ack_floor.stream_seq if info.ack_floor else 0

    async def telemetry(self, after: int, upto: int) -> list[Stored]:
        return await self.tap.take(after, upto)

    async def telemetry_position(self) -> int:
        return await self.tap.position()

    async def run_effect(self, effect: Effect, delivery: Delivery | None) -> Sequence[Emit]:
        """Run one effect, telling the server the input is still in progress so it is not redelivered."""
        if delivery is None:
            return await self.service.effects[effect.kind](effect.args)
        work = asyncio.ensure_future(self.service.effects[effect.kind](effect.args))
        while True:
            done, _ = await asyncio.wait({work}, timeout=self.policy.backoff[0] / 3)
            if done:
                return work.result()
            with contextlib.suppress(*TRANSIENT):
                await delivery.in_progress()

    async def detach(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self.detached.add(task)
        task.add_done_callback(self.detached.discard)

    async def folded(self, folder: Folder[Any], inputs: int) -> None:
        self.saver.folded(folder, inputs)

    def crash_point(self, point: str) -> None:
        pass  # a live process dies where it dies

    # -- outages -------------------------------------------------------------------------------------------------

    def _unanswered(self) -> None:
        if not self.outage_at:
            self.outage_at = time.time()

    def _answered(self) -> None:
        if self.outage_at:
            self.outage_at, self.recovered_at = 0.0, time.time()
            log.info("broker answering again", recovered_at=self.recovered_at)

    def _reconnected(self, now: float) -> None:
        """A reconnect since the last look is an outage too, even if no call of ours failed in it (an idle fetch
        times out quietly); `now` is when it was noticed, no earlier than it happened."""
        reconnects = self.nc.stats["reconnects"]
        if reconnects != self.reconnects:
            self.reconnects = reconnects
            self.recovered_at = max(self.recovered_at, now)

    # -- the tasks -----------------------------------------------------------------------------------------------

    async def run(self) -> None:
        floor = await self.call("creating the consumer", self._ensure_consumer)
        loaded = await self.loop.start(floor)
        self.saver = snapshots.Saver(self.store, snapshots.every_setting(), loaded)
        self.tap.start(self.folder.telemetry_seq)
        advisory = await self.nc.subscribe(deadletter.advisory_subject(subjects.CONTROL, self.consumer),
                                           cb=self._max_deliveries)
        sub = await self.call("binding the consumer",
                              lambda: self.js.pull_subscribe_bind(self.consumer, subjects.CONTROL))
        ticker = asyncio.create_task(self._ticker())
        consumer = asyncio.create_task(self._consume(sub))
        try:
            await asyncio.wait({ticker, consumer}, return_when=asyncio.FIRST_COMPLETED)
            failed = ticker.exception() if ticker.done() else None
            if failed is not None:
                self.stop.set()  # e.g. ticks denied: finish the input in hand, then fail with the ticker's error
            await consumer
            if failed is not None:
                raise failed
        finally:
            ticker.cancel()
            consumer.cancel()
            for task in self.detached:
                task.cancel()  # its outcome is never appended; the core asks again after its deadline
            if self.folder.control_seq == self.loop.stored_seq:  # not a state whose last input's outputs were cut short
                await self.saver.close(self.folder)
            await self.tap.stop()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await ticker
            with contextlib.suppress(Exception):
                await advisory.unsubscribe()
        log.info("stopped", control_seq=self.folder.control_seq)

    async def _ensure_consumer(self) -> int:
        """Create or update the durable consumer; return its ack floor (every input up to it is done)."""
        info = await self.js.add_consumer(subjects.CONTROL, ConsumerConfig(
            durable_name=self.consumer, ack_policy=AckPolicy.EXPLICIT, max_deliver=self.policy.max_deliver,
            backoff=list(self.policy.backoff),
            # One input in flight: a redelivered input can never be overtaken by a later one, which is
            # what keeps the live order equal to the stream order a replay folds.
            max_ack_pending=1,
            filter_subjects=filters([*self.service.control_subjects, self.folder.clock_subject]),
        ))
        return info.ack_floor.stream_seq if info.ack_floor else 0

    async def _consume(self, sub: Any) -> None:
        delay = 0.1
        while not self.stop.is_set():
            try:
                msgs = await sub.fetch(1, timeout=self.policy.fetch_s)
                delay = 0.1
                self._answered()
            except nats.errors.TimeoutError:
                continue
            except TRANSIENT as exc:
                self._unanswered()
                log.warning("fetch failed; retrying", error=repr(exc), retry_in_s=delay)
                await sleep_or_stop(self.stop, delay)
                delay = min(delay * 2, 5.0)
                continue
            for msg in msgs:
                await self.loop.handle(NatsDelivery(msg))

    async def _max_deliveries(self, msg: Msg) -> None:
        """The server gave up on an input: the loop records it (loop.Loop.given_up)."""
        try:
            advisory = deadletter.parse_advisory(msg.data)
            raw = await self.js.get_msg(advisory.stream, advisory.stream_seq)
            stored = decoded(advisory.stream, advisory.stream_seq, raw.subject or "", raw.data or b"", "")
            await self.loop.given_up(stored, advisory.deliveries)
        except Exception as exc:  # an advisory we cannot act on is logged; redelivery state is the server's
            log.error("max-deliveries advisory not recorded", error=failure(exc))

    async def _ticker(self) -> None:
        """A tick (loop.Loop.tick) every `tick_s` while the core wants one; sooner (PROMPT_S after it) when telemetry
        of one of the core's `prompt_types` arrives, wanted or not."""
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.service.tick_s):  # not wait_for: on 3.11 it can swallow a cancel
                    await self.tap.prompted.wait()
                await asyncio.sleep(PROMPT_S)  # the rest of what came together (every rank's staging) comes along
            now = time.time()
            self._reconnected(now)
            if self.loop.tick_in_flight:
                continue  # a prompt stays set: the next tick follows this one's fold
            prompted = self.tap.prompted.is_set()
            self.tap.prompted.clear()
            await self.loop.tick(now, prompted, self.recovered_at)
