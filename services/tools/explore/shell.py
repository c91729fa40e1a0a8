"""One service under the simulated broker, run as services/shell/runtime.py runs it: rebuild from a trusted position
(services/shell/position.py), then per input fold, store the outputs (job events through the history's fence),
run the effects, ack; a ClockTick recording what is stored while the core wants one. A scheduled crash lands
before the outputs, between two of them, or before the ack; a lost ack redelivers the input."""

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from flightdeck.events import subjects
from flightdeck.events.base import JobEvent
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.history import append_to_job
from flightdeck.events.store import MemoryStore, Stored
from flightdeck.services.core import Effect, Emit, Service
from flightdeck.services.shell import deadletter, position, snapshots
from flightdeck.services.shell.fold import Folder, Output, rebuild, replay, stamp
from flightdeck.services.tools.explore.broker import SimBroker

CRASH_POINTS = ("before-outputs", "between-outputs", "before-ack")
SNAPSHOT_EVERY = 16  # inputs between state snapshots: often, so that most restarts start from one
EffectRunner = Callable[[str, Effect], Awaitable[Sequence[Emit]]]


async def store_output(store: MemoryStore, out: Output) -> None:
    """As Shell._append: a job's events through its history (the fence, or a node's record), the rest as they are."""
    if out.subject.startswith("fd.ctl.job."):
        assert isinstance(out.event, JobEvent)
        await append_to_job(store, out.event, msg_id=out.msg_id)
    else:
        await store.append(out.subject, out.event, msg_id=out.msg_id)


class SimShell:
    def __init__(self, build: Callable[[], Service[Any]], store: MemoryStore, broker: SimBroker,
                 now: Callable[[], float], effects: EffectRunner, ids: Callable[[], int]) -> None:
        self.build, self.store, self.broker, self.now, self.effects, self.ids = build, store, broker, now, effects, ids
        self.service = build()
        self.name = self.service.name
        self.up = False
        self.folder: Folder[Any] = Folder(self.service)
        self.stored_seq = 0
        self.caught_up = False
        self.tick_in_flight = 0
        self.last_tick_at = -1e9
        self.prompt_seen = 0  # telemetry rows looked at for the core's prompt_types
        self.crash_at: str = ""  # the crash point the next input meets
        self.lose_ack = False
        self.stale_start = False  # the next start's consumer reply is stale
        self.on_crash: Callable[[], None] = lambda: None  # what else ends with the process (an agent's ranks)
        self.num_starts = self.num_crashes = self.num_inputs = self.num_from_snapshot = 0
        self.generation = self.since_snapshot = 0
        self.snapshot_mismatches: list[str] = []  # a start from a snapshot that a refold to its position disagrees with

    @property
    def consumer(self) -> str:
        return f"service-{self.name}"

    async def start(self) -> None:
        self.service = self.build()
        self.folder = Folder(self.service)
        filters = (*self.service.control_subjects, self.folder.clock_subject)
        self.broker.consumer(self.consumer, filters)
        reply = self.broker.floor(self.consumer, stale=self.stale_start)
        info = self.broker.floor(self.consumer, stale=self.stale_start)  # both stale: only the catch-up saves it
        self.stale_start = False
        last = await self.store.last(subjects.CONTROL, self.folder.clock_subject)
        until = position.rebuild_until(self.name, reply, info, last)
        loaded = await snapshots.load(self.store, self.service)
        self.folder = await rebuild(self.service, self.store, until=until,
                                    folder=loaded.folder if loaded is not None else None)
        if loaded is not None:
            self.num_from_snapshot += 1
            self.generation = loaded.head.generation + 1
            await self._check_against_refold(loaded)
        self.stored_seq, self.caught_up, self.tick_in_flight, self.up = self.folder.control_seq, False, 0, True
        self.prompt_seen = len(self.broker.telemetry())
        self.num_starts += 1
        mid = f"{self.name}:configured:{self.ids()}"
        await self.store.append(self.folder.clock_subject, CoreConfigured(
            service=self.name, settings=dict(self.service.settings), event_id=mid, occurred_at=self.now(),
            producer=self.name), msg_id=mid)

    def crash(self) -> None:
        self.up = False
        self.num_crashes += 1
        self.on_crash()

    async def tick(self) -> None:
        now = self.now()
        if self.tick_in_flight or now - self.last_tick_at < self.service.tick_s:
            return
        if not self._prompted() and not self.service.wants_tick(self.folder.state, now):
            return  # as live: a prompt ticks whether or not the core wants ticks by now
        positions = {subjects.CONTROL: self.stored_seq}
        if self.service.telemetry_subjects:
            positions[subjects.TELEMETRY] = len(self.broker.telemetry())
        mid = f"{self.name}:tick:{self.ids()}"
        tick = ClockTick(service=self.name, now=now, positions=positions, event_id=mid, occurred_at=now,
                         producer=self.name)
        res = await self.store.append(self.folder.clock_subject, tick, msg_id=mid)
        self.last_tick_at = now
        if res.seq > self.folder.control_seq:
            self.tick_in_flight = res.seq

    def _prompted(self) -> bool:
        rows = self.broker.telemetry()
        new, self.prompt_seen = rows[self.prompt_seen:], len(rows)
        kinds = self.service.prompt_types
        return bool(kinds) and any(r.subject.rsplit(".", 1)[-1] in kinds for r in new)

    async def turn(self, budget: int = 4) -> None:
        """Take up to `budget` inputs, as the live shell would in that time."""
        if not self.up:
            return
        await self.tick()
        for _ in range(budget):
            if not self.up or not await self.one():
                return

    async def one(self) -> bool:
        stored, gave_up = self.broker.deliver(self.consumer)
        if gave_up is not None:  # the max-deliveries advisory
            folded = gave_up.seq <= self.folder.control_seq
            cause = deadletter.FOLDED_ANYWAY if folded else deadletter.GIVEN_UP
            await self._dead_letter(gave_up, "delivered too often without an ack (max_deliver)", cause)
            return True
        if stored is None:
            return False
        if not self.caught_up:
            self.caught_up = True
            if stored.seq > self.folder.control_seq + 1:
                target = position.caught_up_until(stored.seq, self.broker.floor(self.consumer))
                if target > self.folder.control_seq:
                    async for _ in replay(self.service, self.store, until=target, folder=self.folder):
                        pass
                self.stored_seq = max(self.stored_seq, self.folder.control_seq)
        if stored.seq <= self.folder.control_seq:
            self.broker.finish(self.consumer, stored.seq)
            return True
        self.num_inputs += 1
        telemetry: list[Stored] = []
        pos = self.folder.tick_position(stored)
        if pos is not None:
            telemetry = [t for t in self.broker.telemetry()[self.folder.telemetry_seq:pos]  # seq n at index n-1
                         if subjects.matches_any(tuple(self.service.telemetry_subjects), t.subject)]
        steps = self.folder.apply(stored, telemetry)
        if self._crashes("before-outputs"):
            return False
        for step in steps:
            for n, out in enumerate(step.outputs):
                if n == 1 and self._crashes("between-outputs"):
                    return False
                await store_output(self.store, out)
            index = len(step.outputs)
            for effect in step.effects:
                emits = await self.effects(self.name, effect)
                outs = [stamp(self.name, step.input, index + i, e, occurred_at=self.now())
                        for i, e in enumerate(emits)]
                index += len(outs)
                for out in outs:
                    await store_output(self.store, out)
            if step.error:
                await self._dead_letter(step.input, step.error, "input")
        self.stored_seq = stored.seq
        self.since_snapshot += 1
        if self.since_snapshot >= SNAPSHOT_EVERY:  # as snapshots.Saver does once the outputs are stored
            await snapshots.write(self.store, snapshots.take(self.folder, self.generation, self.now()))
            self.generation, self.since_snapshot = self.generation + 1, 0
        if self.tick_in_flight and stored.seq >= self.tick_in_flight:
            self.tick_in_flight = 0
        if self._crashes("before-ack"):
            return False
        if self.lose_ack:
            self.lose_ack = False  # redelivered: the shell must recognise it as folded
            return True
        self.broker.finish(self.consumer, stored.seq)
        return True

    def _crashes(self, point: str) -> bool:
        if self.crash_at != point:
            return False
        self.crash_at = ""
        self.crash()
        return True

    async def _dead_letter(self, stored: Stored, reason: str, cause: str) -> None:
        dead = deadletter.letter(self.name, stored, reason, cause=cause)
        await self.store.append(dead.subject, dead.event, msg_id=dead.msg_id)

    async def _check_against_refold(self, loaded: snapshots.Loaded) -> None:
        """The state a start built from a snapshot must be the one a fold from the first event gives."""
        refold = await rebuild(self.build(), self.store, until=self.folder.control_seq)
        ours, theirs = snapshots.digest(self.folder.state), snapshots.digest(refold.state)
        if ours != theirs or refold.telemetry_seq != self.folder.telemetry_seq \
                or refold.admission.versions != self.folder.admission.versions:
            self.snapshot_mismatches.append(
                f"{self.name} started from its snapshot at {loaded.head.control_seq} and rebuilt to "
                f"{self.folder.control_seq}: state {ours[:12]} vs refold {theirs[:12]} (telemetry "
                f"{self.folder.telemetry_seq} vs {refold.telemetry_seq}, admitted versions equal: "
                f"{refold.admission.versions == self.folder.admission.versions})")
