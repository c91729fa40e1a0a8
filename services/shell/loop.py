"""What a service's shell does at a start, with each input and at each tick, behind a port to its broker and store.

The live shell (runtime.py) runs this loop on NATS JetStream; the fault explorer (services/tools/explore/shell.py)
runs the same loop on its simulated broker, where a process may die at the crash points named here. One loop for
both, as FoundationDB and TigerBeetle do it, so a bug in it (the stale ack floor found before it was shared) is
within the explorer's reach. Nothing here reads a clock or the network: the port does.
"""

from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

import structlog

from flightdeck.events import subjects
from flightdeck.events.admission import mismatch
from flightdeck.events.base import JobEvent
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.history import append_to_job
from flightdeck.events.store import EventStore, Stored
from flightdeck.services.core import Effect, Emit, Service
from flightdeck.services.shell import deadletter, position, snapshots
from flightdeck.services.shell.fold import Folder, Output, Step, failure, rebuild, replay, stamp

log = structlog.get_logger("flightdeck.shell")
T = TypeVar("T")
DETACHED_INDEX = 1000  # a detached effect's outcome is stamped from output index 1000 x (its position + 1) on
CRASH_POINTS = ("before-outputs", "between-outputs", "before-ack")  # where Port.crash_point may end the process


class Crashed(Exception):
    """Raised by a port's crash point: the process ended there (the explorer's; the live port never raises it)."""


class Delivery(Protocol):
    """One input the durable consumer handed over."""

    stored: Stored

    async def finish(self, refused: bool) -> None:
        """Ack it, or terminate it when the fold refused it (the server then knows it was never used)."""

    async def in_progress(self) -> None:
        """Tell the server it is still being worked on, so that it is not redelivered meanwhile."""


class Port(Protocol):
    """The shell's I/O: the broker, the store, the clock and the effects' running."""

    @property
    def store(self) -> EventStore: ...

    def now(self) -> float: ...

    def new_id(self) -> str:
        """A suffix no other of this service's ticks or settings records has."""

    async def call(self, what: str, fn: Callable[[], Awaitable[T]], subject: str = "") -> T:
        """Run `fn`, live retried while the broker is away (a denied publish to `subject` is not)."""

    async def ack_floor(self) -> int:
        """The durable consumer's ack floor, read now."""

    async def telemetry(self, after: int, upto: int) -> list[Stored]:
        """The service's telemetry with `after < seq <= upto`, in order."""

    async def telemetry_position(self) -> int:
        """The telemetry stream's last sequence: everything stored before the call is at or below it."""

    async def run_effect(self, effect: Effect, delivery: Delivery | None) -> Sequence[Emit]:
        """Run one effect's I/O; `delivery` (None for a detached one) is kept from redelivery while it runs."""

    async def detach(self, work: Coroutine[Any, Any, None]) -> None:
        """Run a detached effect (Service.detached) beside the loop."""

    async def folded(self, folder: Folder[Any], inputs: int) -> None:
        """An input's outputs are stored and it is acked: its state may be snapshotted."""

    def crash_point(self, point: str) -> None:
        """The explorer's process may end here (raising Crashed); live, nothing happens."""


class Loop:
    def __init__(self, service: Service[Any], port: Port) -> None:
        self.service, self.port = service, port
        self.name = service.name
        self.folder: Folder[Any] = Folder(service)
        self.stored_seq = 0  # the last FD_CONTROL input whose outputs are all stored
        self.caught_up = False  # whether the first delivery since the start was checked against the rebuild
        self.tick_in_flight = 0  # FD_CONTROL sequence of the last tick appended and not yet folded
        self.handled: deque[int] = deque(maxlen=10_000)  # recent inputs folded by this process
        self.skipped = (0, 0)  # inputs strictly between were given up before this start and stay unfolded

    # -- a start -------------------------------------------------------------------------------------------------

    async def start(self, reply_floor: int) -> snapshots.Loaded | None:
        """Rebuild silently to the trusted position (services/shell/position.py: the consumer-creating reply's ack
        floor `reply_floor`, the floor read again, this service's own last tick), from its newest snapshot, and
        record the settings the core runs with."""
        until = await self.port.call("reading where this service got to", partial(self._trusted, reply_floor))
        loaded = await snapshots.load(self.port.store, self.service)  # its position was folded and stored too
        start = loaded.folder if loaded is not None else Folder(self.service)
        self.folder = await self.port.call("rebuilding", partial(rebuild, self.service, self.port.store, until=until,
                                                                 folder=start))
        self.stored_seq, self.caught_up, self.tick_in_flight = self.folder.control_seq, False, 0
        log.info("rebuilt", until_seq=until, ack_floor=reply_floor, telemetry_seq=self.folder.telemetry_seq,
                 from_snapshot=loaded.head.control_seq if loaded is not None else 0)
        await self._record_settings()
        return loaded

    async def _trusted(self, reply_floor: int) -> int:
        read = await self.port.ack_floor()
        last = await self.port.store.last(subjects.CONTROL, self.folder.clock_subject)
        until = position.rebuild_until(self.name, reply_floor, read, last)
        if until > reply_floor:
            log.warning("the consumer's reply was behind this service's own records", reply_floor=reply_floor,
                        info_floor=read, rebuild_until=until)
        return until

    async def _record_settings(self) -> None:
        """Append what this core runs with: after the backlog, which was decided with the settings before it."""
        mid = f"{self.name}:configured:{self.port.new_id()}"
        event = CoreConfigured(service=self.name, settings=dict(self.service.settings), event_id=mid,
                               occurred_at=self.port.now(), producer=self.name)
        subject = self.folder.clock_subject
        await self.port.call("recording the core's settings",
                             partial(self.port.store.append, subject, event, msg_id=mid), subject)
        log.info("settings recorded", settings=event.settings)

    async def _catch_up(self, seq: int) -> None:
        """The first input the consumer hands over after a start: the consumer has moved past everything before it.
        What it acked there, a previous run folded and stored: fold it silently (never act on it again, never
        leave it out of the state). Its position read now, while it delivers, is current; inputs between that and
        `seq` were given up (max_deliver), not done, and stay unfolded as the live service left them."""
        done = position.caught_up_until(seq, await self.port.ack_floor())
        before = self.folder.control_seq
        if done > before:
            async for _ in replay(self.service, self.port.store, until=done, folder=self.folder):
                pass
            log.warning("the rebuild fell short of the consumer: caught up silently", from_seq=before,
                        to_seq=self.folder.control_seq)
        self.skipped = (self.folder.control_seq, seq)
        self.stored_seq = max(self.stored_seq, self.folder.control_seq)

    # -- an input ------------------------------------------------------------------------------------------------

    async def handle(self, delivery: Delivery) -> None:
        """Fold one input, store its outputs, run its effects, then ack it (terminate it when refused)."""
        stored = delivery.stored
        seq = stored.seq
        if not self.caught_up:
            self.caught_up = True
            if seq > self.folder.control_seq + 1:
                await self.port.call("catching up", partial(self._catch_up, seq))
        if seq <= self.folder.control_seq:  # a redelivery of an input already folded and stored
            await self.port.call("acking", partial(delivery.finish, False))
            return
        at = self.folder.tick_position(stored)
        telemetry: list[Stored] = []
        if at is not None:
            telemetry = await self.port.call("reading telemetry",
                                             partial(self.port.telemetry, self.folder.telemetry_seq, at))
        with structlog.contextvars.bound_contextvars(
            seq=seq, subject=stored.subject, event_id=stored.event.event_id if stored.event else "",
            job=subjects.job_of(stored.subject) or "",
        ):
            steps = self.folder.apply(stored, telemetry)
            self.port.crash_point("before-outputs")
            for step in steps:
                await self._store(step, delivery)
            self.stored_seq = seq  # its outputs are stored: a tick may now record it as done
            self.port.crash_point("before-ack")
            await self.port.call("finishing", partial(delivery.finish, bool(steps[-1].error)))
        self.handled.append(seq)
        await self.port.folded(self.folder, len(steps))
        if self.tick_in_flight and seq >= self.tick_in_flight:
            self.tick_in_flight = 0

    async def _store(self, step: Step, delivery: Delivery) -> None:
        for n, out in enumerate(step.outputs):
            if n == 1:
                self.port.crash_point("between-outputs")
            await self.append(out)
        index = len(step.outputs)
        for n, effect in enumerate(step.effects):
            if effect.kind in self.service.detached:
                await self.port.detach(self._run_detached(effect, step.input, n, index + DETACHED_INDEX * (n + 1)))
                continue
            try:
                outs = self._stamped(effect, step.input, index, await self.port.run_effect(effect, delivery))
            except Crashed:
                raise
            except Exception as exc:  # an effect's failure costs that effect, recorded; the service goes on
                await self.dead_letter(step.input, f"effect {effect.kind} failed: {failure(exc)}", cause=f"effect{n}")
                continue
            index += len(outs)
            for out in outs:
                await self.append(out)
        if step.error:
            await self.dead_letter(step.input, step.error)

    def _stamped(self, effect: Effect, stored: Stored, index: int, emits: Sequence[Emit]) -> list[Output]:
        """An effect's outcome as the input's outputs from `index` on, at the time it really happened."""
        outs = [stamp(self.name, stored, index + i, e, occurred_at=e.event.occurred_at or self.port.now())
                for i, e in enumerate(emits)]
        if bad := next(filter(None, (mismatch(o.subject, o.event) for o in outs)), ""):
            raise ValueError(f"effect {effect.kind!r} returned an output against the subject grammar: {bad}")
        return outs

    async def _run_detached(self, effect: Effect, stored: Stored, n: int, index: int) -> None:
        """A detached effect: its outcome is stamped as the input's outputs from `index` on, so a run of the same
        input again (a redelivery) stores nothing twice."""
        try:
            for out in self._stamped(effect, stored, index, await self.port.run_effect(effect, None)):
                await self.append(out)
        except Exception as exc:
            await self.dead_letter(stored, f"effect {effect.kind} failed: {failure(exc)}", cause=f"effect{n}")

    async def append(self, out: Output) -> None:
        """A job's events through its history (the fence, or a node's record), the rest as they are."""
        if out.subject.startswith("fd.ctl.job."):
            assert isinstance(out.event, JobEvent)  # the fold refuses anything else under a job subject
            await self.port.call(f"appending to {out.subject}",
                                 partial(append_to_job, self.port.store, out.event, msg_id=out.msg_id), out.subject)
        else:
            await self.port.call(f"appending to {out.subject}",
                                 partial(self.port.store.append, out.subject, out.event, msg_id=out.msg_id),
                                 out.subject)
        log.debug("stored", out_subject=out.subject, msg_id=out.msg_id)

    async def dead_letter(self, stored: Stored, reason: str, *, cause: str = "input") -> None:
        dead = deadletter.letter(self.name, stored, reason, cause=cause)
        log.error("dead-lettered", reason=reason, dead_seq=stored.seq, stream=stored.stream)
        await self.port.call("dead-lettering",
                             partial(self.port.store.append, dead.subject, dead.event, msg_id=dead.msg_id),
                             dead.subject)

    async def given_up(self, stored: Stored, deliveries: int) -> None:
        """The server gave up on an input (its max-deliveries advisory). Recorded; unless it is in this state (its
        acks were lost, or a rebuild folded it), replays skip it, as the live service did."""
        folded = stored.seq in self.handled or (
            stored.seq <= self.folder.control_seq and not self.skipped[0] < stored.seq < self.skipped[1])
        outcome = "folded, but its acks were lost" if folded else "given up: the service crashed or stalled on it"
        await self.dead_letter(stored, f"delivered {deliveries} times without an ack (max_deliver): {outcome}",
                               cause=deadletter.FOLDED_ANYWAY if folded else deadletter.GIVEN_UP)

    # -- a tick --------------------------------------------------------------------------------------------------

    async def tick(self, now: float, prompted: bool, recovered_at: float = 0.0) -> bool:
        """Record time for the core, at most one tick in flight: when the core wants one by `now`, or telemetry
        it asked to hear of came (`prompted`: folded even where the core wants no ticks by now, such as a final
        checkpoint's upload reported after the checkpoint service's linger waited for something else). Whether one
        was appended."""
        if self.tick_in_flight or (not prompted and not self.service.wants_tick(self.folder.state, now)):
            return False
        # Not the folder's position: an input folded whose outputs are still being stored is not done yet.
        positions = {subjects.CONTROL: self.stored_seq}
        if self.service.telemetry_subjects:
            # Read after `now`: every message stored by then is at or below the position, so the tick names all the
            # telemetry the ranks had stored at its time, however far behind the feed is.
            positions[subjects.TELEMETRY] = await self.port.call("reading the telemetry position",
                                                                 self.port.telemetry_position)
        mid = f"{self.name}:tick:{self.port.new_id()}"
        tick = ClockTick(service=self.name, now=now, positions=positions, recovered_at=recovered_at, event_id=mid,
                         occurred_at=now, producer=self.name)
        subject = self.folder.clock_subject
        res = await self.port.call("appending a tick", partial(self.port.store.append, subject, tick, msg_id=mid),
                                   subject)
        if res.seq > self.folder.control_seq:
            self.tick_in_flight = res.seq
        return True
