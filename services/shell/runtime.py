"""The shell every service runs: connect, rebuild state, then consume, fold, store outputs, ack.

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
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, TypeVar

import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from flightdeck.events import subjects
from flightdeck.events.admission import mismatch
from flightdeck.events.base import JobEvent
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.history import append_to_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.jsreader import cancellable
from flightdeck.events.store import EventStore, Stored, decoded
from flightdeck.services.core import Effect, Emit, Service
from flightdeck.services.shell import deadletter, position, snapshots
from flightdeck.services.shell.connection import TRANSIENT, Connection, PublishDenied, sleep_or_stop
from flightdeck.services.shell.consumer import ConsumerPolicy, consumer_name, filters
from flightdeck.services.shell.fold import Folder, Output, Step, failure, rebuild, replay, stamp
from flightdeck.services.shell.tap import TelemetryTap

log = structlog.get_logger("flightdeck.shell")
T = TypeVar("T")
PROMPT_S = 0.05  # from a prompting telemetry message (Service.prompt_types) to the tick that folds it
DETACHED_INDEX = 1000  # a detached effect's outcome is stamped from output index 1000 x (its position + 1) on

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


class Shell:
    def __init__(self, service: Service[Any], store: JetStreamStore, conn: Connection, policy: ConsumerPolicy,
                 stop: asyncio.Event) -> None:
        self.service, self.conn, self.policy, self.stop = service, conn, policy, stop
        self.nc: Client = store.nc
        self.js = store.js
        self.store: EventStore = store
        self.consumer = consumer_name(service.name)
        self.folder: Folder[Any] = Folder(service)
        self.tap = TelemetryTap(self.store, service.telemetry_subjects, prompt_types=service.prompt_types)
        self.tick_in_flight = 0  # FD_CONTROL sequence of the last tick appended and not yet folded
        # Broker outages this process saw, for its ticks (ClockTick.recovered_at): while the broker is away ranks
        # cannot publish, so a monitor must not read their silence then as death.
        self.outage_at = 0.0  # when a call first went unanswered in the outage under way (0: none)
        self.recovered_at = 0.0  # when the broker last answered again after one
        self.reconnects = 0  # the client's reconnect count when last looked at
        self.handled: deque[int] = deque(maxlen=10_000)  # recent inputs folded, to answer advisories
        self.detached: set[asyncio.Task[None]] = set()  # effects running in the background (Service.detached)
        self.stored_seq = 0  # the last FD_CONTROL input whose outputs are all stored
        self.caught_up = False  # whether the first delivery since the start was checked against the rebuild
        self.saver = snapshots.Saver(self.store, 0)
        if service.bind is not None:
            service.bind(self.store)

    async def retrying(self, what: str, fn: Callable[[], Awaitable[T]], subject: str = "") -> T:
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

    async def run(self) -> None:
        floor = await self.retrying("creating the consumer", self._ensure_consumer)
        until = await self.retrying("reading where this service got to", partial(self._trusted_position, floor))
        loaded = await snapshots.load(self.store, self.service)  # its position was folded and stored too
        start = loaded.folder if loaded is not None else Folder(self.service)
        self.saver = snapshots.Saver(self.store, snapshots.every_setting(), loaded)
        self.folder = await self.retrying("rebuilding", partial(rebuild, self.service, self.store, until=until,
                                                                folder=start))
        self.stored_seq = self.folder.control_seq
        log.info("rebuilt", until_seq=until, ack_floor=floor, telemetry_seq=self.folder.telemetry_seq,
                 from_snapshot=loaded.head.control_seq if loaded is not None else 0)
        await self._record_settings()
        self.tap.start(self.folder.telemetry_seq)
        advisory = await self.nc.subscribe(deadletter.advisory_subject(subjects.CONTROL, self.consumer),
                                           cb=self._max_deliveries)
        sub = await self.retrying("binding the consumer",
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
            if self.folder.control_seq == self.stored_seq:  # not a state whose last input's outputs were cut short
                await self.saver.close(self.folder)
            await self.tap.stop()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await ticker
            with contextlib.suppress(Exception):
                await advisory.unsubscribe()
        log.info("stopped", control_seq=self.folder.control_seq)

    async def _record_settings(self) -> None:
        """Append what this core runs with: after the backlog, which was decided with the settings before it."""
        now = time.time()
        mid = f"{self.service.name}:configured:{time.time_ns()}"
        event = CoreConfigured(service=self.service.name, settings=dict(self.service.settings), event_id=mid,
                               occurred_at=now, producer=self.service.name)
        subject = self.folder.clock_subject
        await self.retrying("recording the core's settings", partial(self.store.append, subject, event, msg_id=mid),
                            subject)
        log.info("settings recorded", settings=event.settings)

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

    async def _trusted_position(self, floor: int) -> int:
        """Where to rebuild to, silently: every input up to it was folded and its outputs stored. The reply that
        created the consumer may be stale after a broker restart (an ack floor of 246 where the consumer said 258 a
        moment later: shared/FACTS.md), so it is only one lower bound; the consumer's info read again is another, and
        this service's own last tick, which records what it had folded and stored then, a third. A position still
        short of the consumer's is caught up at the first delivery (`_catch_up`)."""
        info = await cancellable(self.js.consumer_info(subjects.CONTROL, self.consumer))
        read = info.ack_floor.stream_seq if info.ack_floor else 0
        last = await self.store.last(subjects.CONTROL, self.folder.clock_subject)
        until = position.rebuild_until(self.service.name, floor, read, last)
        if until > floor:
            log.warning("the consumer's reply was behind this service's own records", reply_floor=floor,
                        info_floor=read, rebuild_until=until)
        return until

    async def _catch_up(self, seq: int) -> None:
        """The first input the consumer hands over after a start: the consumer has moved past everything before it.
        What it acked there, a previous run folded and stored: fold it silently (never act on it again, never
        leave it out of the state). Its position read now, while it delivers, is current; inputs between that and
        `seq` were given up (max_deliver), not done, and stay unfolded as the live service left them."""
        info = await cancellable(self.js.consumer_info(subjects.CONTROL, self.consumer))
        done = position.caught_up_until(seq, info.ack_floor.stream_seq if info.ack_floor else 0)
        before = self.folder.control_seq
        if done > before:
            async for _ in replay(self.service, self.store, until=done, folder=self.folder):
                pass
            log.warning("the rebuild fell short of the consumer: caught up silently", from_seq=before,
                        to_seq=self.folder.control_seq)
        self.stored_seq = max(self.stored_seq, self.folder.control_seq)

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
                await self._handle(msg)

    async def _handle(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        if not self.caught_up:
            self.caught_up = True
            if seq > self.folder.control_seq + 1:
                await self.retrying("catching up", partial(self._catch_up, seq))
        if seq <= self.folder.control_seq:  # a redelivery of an input already folded and stored
            await self.retrying("acking", msg.ack)
            return
        stored = decoded(subjects.CONTROL, seq, msg.subject, msg.data, (msg.headers or {}).get("Nats-Msg-Id", ""))
        position = self.folder.tick_position(stored)
        telemetry: list[Stored] = []
        if position is not None:
            take = partial(self.tap.take, self.folder.telemetry_seq, position)
            telemetry = await self.retrying("reading telemetry", take)
        with structlog.contextvars.bound_contextvars(
            seq=seq, subject=msg.subject, event_id=stored.event.event_id if stored.event else "",
            job=subjects.job_of(msg.subject) or "",
        ):
            steps = self.folder.apply(stored, telemetry)
            for step in steps:
                await self._store(step, msg)
            self.stored_seq = seq  # its outputs are stored: a tick may now record it as done
            # A refused input is terminated, not acked: the server then knows it was never used.
            await self.retrying("finishing", msg.term if steps[-1].error else msg.ack)
        self.handled.append(seq)
        self.saver.folded(self.folder, len(steps))
        if self.tick_in_flight and seq >= self.tick_in_flight:
            self.tick_in_flight = 0

    async def _store(self, step: Step, msg: Msg) -> None:
        for out in step.outputs:
            await self._append(out)
        index = len(step.outputs)
        for n, effect in enumerate(step.effects):
            if effect.kind in self.service.detached:
                task = asyncio.create_task(self._run_detached(effect, step.input, n, index + DETACHED_INDEX * (n + 1)))
                self.detached.add(task)
                task.add_done_callback(self.detached.discard)
                continue
            try:
                emits = await self._run_effect(effect, msg)
                outs = [stamp(self.service.name, step.input, index + i, e,
                              occurred_at=e.event.occurred_at or time.time()) for i, e in enumerate(emits)]
                if bad := next(filter(None, (mismatch(o.subject, o.event) for o in outs)), ""):
                    raise ValueError(f"effect {effect.kind!r} returned an output against the subject grammar: {bad}")
            except Exception as exc:  # an effect's failure costs that effect, recorded; the service goes on
                reason = f"effect {effect.kind} failed: {failure(exc)}"
                await self._dead_letter(step.input, reason, cause=f"effect{n}")
                continue
            index += len(outs)
            for out in outs:
                await self._append(out)
        if step.error:
            await self._dead_letter(step.input, step.error)

    async def _run_detached(self, effect: Effect, stored: Stored, n: int, index: int) -> None:
        """A detached effect: its outcome is stamped as the input's outputs from `index` on, so a run of the same
        input again (a redelivery) stores nothing twice."""
        try:
            emits = await self.service.effects[effect.kind](effect.args)
            outs = [stamp(self.service.name, stored, index + i, e, occurred_at=e.event.occurred_at or time.time())
                    for i, e in enumerate(emits)]
            if bad := next(filter(None, (mismatch(o.subject, o.event) for o in outs)), ""):
                raise ValueError(f"effect {effect.kind!r} returned an output against the subject grammar: {bad}")
            for out in outs:
                await self._append(out)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._dead_letter(stored, f"effect {effect.kind} failed: {failure(exc)}", cause=f"effect{n}")

    async def _run_effect(self, effect: Effect, msg: Msg) -> Sequence[Emit]:
        """Run one effect, telling the server the input is still in progress so it is not redelivered."""
        work = asyncio.ensure_future(self.service.effects[effect.kind](effect.args))
        while True:
            done, _ = await asyncio.wait({work}, timeout=self.policy.backoff[0] / 3)
            if done:
                return work.result()
            with contextlib.suppress(*TRANSIENT):
                await msg.in_progress()

    async def _append(self, out: Output) -> None:
        if out.subject.startswith("fd.ctl.job."):
            assert isinstance(out.event, JobEvent)  # the fold refuses anything else under a job subject
            await self.retrying(f"appending to {out.subject}",
                                partial(append_to_job, self.store, out.event, msg_id=out.msg_id), out.subject)
        else:
            await self.retrying(f"appending to {out.subject}",
                                partial(self.store.append, out.subject, out.event, msg_id=out.msg_id), out.subject)
        log.debug("stored", out_subject=out.subject, msg_id=out.msg_id)

    async def _dead_letter(self, stored: Stored, reason: str, *, cause: str = "input") -> None:
        dead = deadletter.letter(self.service.name, stored, reason, cause=cause)
        log.error("dead-lettered", reason=reason, dead_seq=stored.seq, stream=stored.stream)
        await self.retrying("dead-lettering", partial(self.store.append, dead.subject, dead.event, msg_id=dead.msg_id),
                            dead.subject)

    async def _max_deliveries(self, msg: Msg) -> None:
        """The server gave up on an input. Record it; unless this process folded it (its acks were lost),
        replays skip it, as the live service did."""
        try:
            advisory = deadletter.parse_advisory(msg.data)
            raw = await self.js.get_msg(advisory.stream, advisory.stream_seq)
            stored = decoded(advisory.stream, advisory.stream_seq, raw.subject or "", raw.data or b"", "")
            folded = advisory.stream_seq in self.handled
            outcome = "folded, but its acks were lost" if folded else "given up: the service crashed or stalled on it"
            reason = f"delivered {advisory.deliveries} times without an ack (max_deliver): {outcome}"
            await self._dead_letter(stored, reason, cause=deadletter.FOLDED_ANYWAY if folded else deadletter.GIVEN_UP)
        except Exception as exc:  # an advisory we cannot act on is logged; redelivery state is the server's
            log.error("max-deliveries advisory not recorded", error=failure(exc))

    async def _ticker(self) -> None:
        """Record time for the core: a ClockTick every `tick_s` while the core wants one, at most one in flight;
        sooner (PROMPT_S after it) when telemetry of one of the core's `prompt_types` arrives, wanted or not."""
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.service.tick_s):  # not wait_for: on 3.11 it can swallow a cancel
                    await self.tap.prompted.wait()
                await asyncio.sleep(PROMPT_S)  # the rest of what came together (every rank's staging) comes along
            now = time.time()
            self._reconnected(now)
            if self.tick_in_flight:
                continue  # a prompt stays set: the next tick follows this one's fold
            prompted = self.tap.prompted.is_set()
            self.tap.prompted.clear()
            # A prompt is telemetry the core asked to hear of: folded even where the core wants no ticks by now (a
            # final checkpoint's upload reported after the checkpoint service's linger waited for something else).
            if not prompted and not self.service.wants_tick(self.folder.state, now):
                continue
            # Not the folder's position: an input folded whose outputs are still being stored is not done yet.
            positions = {subjects.CONTROL: self.stored_seq}
            if self.service.telemetry_subjects:
                # Read after `now`: every message stored by then is at or below the position, so the tick names
                # all the telemetry the ranks had stored at its time, however far behind the tap's feed is.
                positions[subjects.TELEMETRY] = await self.retrying("reading the telemetry position",
                                                                    self.tap.position)
            mid = f"{self.service.name}:tick:{time.time_ns()}"
            tick = ClockTick(service=self.service.name, now=now, positions=positions, recovered_at=self.recovered_at,
                             event_id=mid, occurred_at=now, producer=self.service.name)
            subject = self.folder.clock_subject
            append = partial(self.store.append, subject, tick, msg_id=mid)
            res = await self.retrying("appending a tick", append, subject)
            if res.seq > self.folder.control_seq:
                self.tick_in_flight = res.seq
