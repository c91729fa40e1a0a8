"""The commands a rank obeys at step boundaries, read from its job's history on FD_CONTROL.

A background thread keeps an ephemeral push consumer on `fd.ctl.job.<job>.>` (commands picked out) that delivers
only what was appended after the inbox started. It is ordered by hand rather than with nats-py's
ordered consumer: that one restarts from stream sequence 1 when it resets before its first message,
which would replay a previous attempt's StopRequested into this one."""

import asyncio
import contextlib
import threading
import time
import uuid
from datetime import UTC, datetime

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from events import codec, subjects
from events.admission import Admission
from events.base import Event
from events.catalog import COMMAND_TYPES
from events.store import Stored
from trainer import bus

CHECK_S = 2.0  # how often the consumer is checked to still exist on the server
RETRY_WAIT_S = 0.5
INACTIVE_S = 60.0  # the server forgets the consumer of a rank that vanished


class CommandInbox:
    """Commands for one job, collected in the background; `poll` at a step boundary hands them over."""

    def __init__(self, url: str | None, job_id: str, rank: int, attempt: int) -> None:
        self._url = url
        self._job_id = job_id
        self._log = bus.logger("trainer.commands", job_id, rank, attempt)
        self._loop = bus.LoopThread(f"commands-{rank}")
        self._lock = threading.Lock()
        self._received: list[Event] = []
        self._started_at: datetime | None = None
        self._last_seq = 0  # stream sequence of the last message seen: where a new consumer resumes
        self._admission = Admission()  # the rule every reader of a job's history shares (events/admission.py)
        self._generation = 0  # messages from a replaced subscription are ignored
        self._next_dseq = 1
        self._resubscribe: asyncio.Event | None = None

    def start(self) -> None:
        if self._url is None:
            return
        self._started_at = datetime.fromtimestamp(time.time(), UTC)
        self._loop.start(self._main)

    def poll(self) -> list[Event]:
        """Commands received since the last poll, in history order."""
        if not self._received:  # unlocked peek: the common step has nothing to hand over
            return []
        with self._lock:
            out, self._received = self._received, []
        return out

    def close(self) -> None:
        if self._url is None:
            return
        self._loop.cancel()
        self._loop.join(3.0)

    async def _main(self) -> None:
        assert self._url is not None
        self._resubscribe = asyncio.Event()
        nc: NATS | None = None

        async def on_change(up: bool) -> None:
            # A restarted server may have lost the consumer (it lives in memory): make a new one from
            # where we were as soon as the broker is back, instead of waiting for a check to notice.
            if up:
                assert self._resubscribe is not None
                self._resubscribe.set()

        try:
            nc = await bus.connect(self._url, f"fd-inbox-{self._job_id}", self._log, on_change)
            await self._consume(nc.jetstream())
        except asyncio.CancelledError:
            pass
        finally:
            await bus.close_quietly(nc, 1.0)

    async def _consume(self, js: JetStreamContext) -> None:
        assert self._resubscribe is not None
        while True:
            self._resubscribe.clear()
            try:
                sub = await self._subscribe(js)
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                self._log.warning("inbox.subscribe_failed", error=f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(RETRY_WAIT_S)
                continue
            await self._watch(sub)
            try:
                await sub.unsubscribe()
            except (nats.errors.Error, OSError):
                pass

    async def _watch(self, sub: JetStreamContext.PushSubscription) -> None:
        """Return when the subscription must be replaced: a reconnect, a gap, or the consumer gone."""
        assert self._resubscribe is not None
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CHECK_S):  # not wait_for: on 3.11 it can swallow a cancel
                    await self._resubscribe.wait()
                return
            try:
                await sub.consumer_info()
            except nats.js.errors.NotFoundError:
                self._log.warning("inbox.consumer_lost")
                return
            except (nats.errors.Error, OSError, TimeoutError):
                pass  # a broker outage: the reconnect will tell us

    async def _subscribe(self, js: JetStreamContext) -> JetStreamContext.PushSubscription:
        self._generation += 1
        self._next_dseq = 1
        generation = self._generation
        config = ConsumerConfig(
            # Named, with the job's history as its one filter: nats-py then puts the filter in the API
            # subject ($JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>), which is how the broker's
            # permissions confine a job's ranks to their own job (services/shell/security/permissions.py).
            # Commands are picked out of the job's events in _take.
            name=f"inbox-{uuid.uuid4().hex}",
            ack_policy=AckPolicy.NONE,
            inactive_threshold=INACTIVE_S,
            mem_storage=True,
            num_replicas=1,
        )
        if self._last_seq:
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, self._last_seq + 1
        else:
            # By time, not "new": the broker may have been down when the inbox started, and a command
            # appended in between is still meant for this attempt.
            config.deliver_policy, config.opt_start_time = DeliverPolicy.BY_START_TIME, self._started_at

        async def on_msg(msg: Msg) -> None:
            if generation == self._generation:
                self._take(msg)

        sub = await js.subscribe(subjects.job_all(self._job_id), stream=subjects.CONTROL, config=config, cb=on_msg)
        self._log.debug("inbox.subscribed", from_seq=self._last_seq + 1 if self._last_seq else None)
        return sub

    def _take(self, msg: Msg) -> None:
        meta = msg.metadata
        if meta.sequence.stream <= self._last_seq:
            return  # already seen through an earlier consumer
        if meta.sequence.consumer != self._next_dseq:
            self._log.warning("inbox.gap", expected=self._next_dseq, got=meta.sequence.consumer)
            assert self._resubscribe is not None
            self._resubscribe.set()
            self._generation += 1  # ignore the rest of this consumer's deliveries until replaced
            return
        self._next_dseq += 1
        self._last_seq = meta.sequence.stream
        try:
            event = codec.admit(msg.data)  # the bounds too: a checkpoint id becomes a cache path
        except codec.UndecodableEvent as exc:
            self._log.error("inbox.undecodable", seq=meta.sequence.stream, subject=msg.subject, error=str(exc))
            return
        stored = Stored(subjects.CONTROL, meta.sequence.stream, msg.subject, msg.data, "", event)
        if why := self._admission.refusal(stored):  # what the services would refuse is no command either
            self._log.error("inbox.refused", seq=meta.sequence.stream, subject=msg.subject, error=why)
            return
        if isinstance(event, COMMAND_TYPES):
            with self._lock:
                self._received.append(event)
