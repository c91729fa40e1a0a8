"""One service under the simulated broker: the live shell's own loop (services/shell/loop.py), with this class as its
port. A scheduled crash ends the process at one of the loop's crash points (before the outputs, between two of them,
before the ack); a lost ack redelivers the input; a stale start is given the ack floor the broker's disk held."""

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from flightdeck.events import subjects
from flightdeck.events.store import MemoryStore, Stored
from flightdeck.services.core import Effect, Emit, Service
from flightdeck.services.shell import snapshots
from flightdeck.services.shell.fold import Folder, rebuild
from flightdeck.services.shell.loop import CRASH_POINTS, Crashed, Delivery, Loop
from flightdeck.services.tools.explore.broker import SimBroker

__all__ = ["CRASH_POINTS", "SimShell"]
SNAPSHOT_EVERY = 16  # inputs between state snapshots: often, so that most restarts start from one
EffectRunner = Callable[[str, Effect], Awaitable[Sequence[Emit]]]
T = TypeVar("T")


class SimDelivery:
    def __init__(self, shell: "SimShell", stored: Stored) -> None:
        self.shell, self.stored = shell, stored

    async def finish(self, refused: bool) -> None:
        if self.shell.lose_ack:
            self.shell.lose_ack = False  # redelivered: the loop must recognise it as folded
            return
        self.shell.broker.finish(self.shell.consumer, self.stored.seq)

    async def in_progress(self) -> None:
        pass  # simulated effects take no time


class SimShell:
    def __init__(self, build: Callable[[], Service[Any]], store: MemoryStore, broker: SimBroker,
                 now: Callable[[], float], effects: EffectRunner, ids: Callable[[], int]) -> None:
        self.build, self.store, self.broker, self.clock = build, store, broker, now
        self.effects, self.ids = effects, ids
        self.service = build()
        self.name = self.service.name
        self.loop = Loop(self.service, self)
        self.up = False
        self.last_tick_at = -1e9
        self.prompt_seen = 0  # telemetry rows looked at for the core's prompt_types
        self.crash_at: str = ""  # the crash point the next input meets
        self.lose_ack = False
        self.stale_start = False  # the next start's consumer replies are stale
        self.stale = False  # ... while it starts
        self.on_crash: Callable[[], None] = lambda: None  # what else ends with the process (an agent's ranks)
        self.num_starts = self.num_crashes = self.num_inputs = self.num_from_snapshot = 0
        self.generation = self.since_snapshot = 0
        self.snapshot_mismatches: list[str] = []  # a start from a snapshot that a refold to its position disagrees with

    @property
    def consumer(self) -> str:
        return f"service-{self.name}"

    @property
    def folder(self) -> Folder[Any]:
        return self.loop.folder

    # -- the port (services/shell/loop.Port) ---------------------------------------------------------------------

    def now(self) -> float:
        return self.clock()

    def new_id(self) -> str:
        return str(self.ids())

    async def call(self, what: str, fn: Callable[[], Awaitable[T]], subject: str = "") -> T:
        return await fn()  # the simulated broker always answers; its restarts lose positions, not calls

    async def ack_floor(self) -> int:
        return self.broker.floor(self.consumer, stale=self.stale)

    async def telemetry(self, after: int, upto: int) -> list[Stored]:
        patterns = tuple(self.service.telemetry_subjects)
        return [t for t in self.broker.telemetry()[after:upto] if subjects.matches_any(patterns, t.subject)]

    async def telemetry_position(self) -> int:
        return len(self.broker.telemetry())  # seq n at index n-1

    async def run_effect(self, effect: Effect, delivery: Delivery | None) -> Sequence[Emit]:
        return await self.effects(self.name, effect)

    async def detach(self, work: Coroutine[Any, Any, None]) -> None:
        await work  # at once: the simulated I/O takes no time, and a seed must run the same every time

    async def folded(self, folder: Folder[Any], inputs: int) -> None:
        """As snapshots.Saver, every SNAPSHOT_EVERY inputs, written before the next input."""
        self.since_snapshot += inputs
        if self.since_snapshot >= SNAPSHOT_EVERY:
            await snapshots.write(self.store, snapshots.take(folder, self.generation, self.now()))
            self.generation, self.since_snapshot = self.generation + 1, 0

    def crash_point(self, point: str) -> None:
        if self.crash_at == point:
            self.crash_at = ""
            self.crash()
            raise Crashed(point)

    # -- the process ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.service = self.build()
        self.loop = Loop(self.service, self)
        self.broker.consumer(self.consumer, (*self.service.control_subjects, self.folder.clock_subject))
        self.stale, self.stale_start = self.stale_start, False  # both the reply and the floor read again: only the
        reply = self.broker.floor(self.consumer, stale=self.stale)  # catch-up saves it
        loaded = await self.loop.start(reply)
        self.stale = False
        if loaded is not None:
            self.num_from_snapshot += 1
            self.generation = loaded.head.generation + 1
            await self._check_against_refold(loaded)
        self.up = True
        self.prompt_seen = len(self.broker.telemetry())
        self.num_starts += 1

    def crash(self) -> None:
        self.up = False
        self.num_crashes += 1
        self.on_crash()

    async def tick(self) -> None:
        """As the live ticker: once a `tick_s` has passed since the last (a prompt ticks wanted or not)."""
        now = self.now()
        if self.loop.tick_in_flight or now - self.last_tick_at < self.service.tick_s:
            return
        if await self.loop.tick(now, self._prompted()):
            self.last_tick_at = now

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
            await self.loop.given_up(gave_up, self.broker.consumers[self.consumer].deliveries.get(gave_up.seq, 0))
            return True
        if stored is None:
            return False
        if stored.seq > self.folder.control_seq:
            self.num_inputs += 1
        try:
            await self.loop.handle(SimDelivery(self, stored))
        except Crashed:
            return False
        return True

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
