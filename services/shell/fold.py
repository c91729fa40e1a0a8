"""The fold every service runs live, on a restart's rebuild and in `verify` / `whatif`.

A `Folder` takes a service's inputs in recorded order (FD_CONTROL in stream order; telemetry only
when one of the service's own ClockTicks comes back, up to the position the tick recorded) and
returns, per input, the stamped outputs its core decided. No I/O here: `replay` reads an EventStore.
"""

import time
import traceback
from collections import deque
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from flightdeck.events import subjects
from flightdeck.events.admission import Admission, mismatch
from flightdeck.events.base import Event
from flightdeck.events.clock import ClockTick
from flightdeck.events.codec import type_name
from flightdeck.events.store import EventStore, Stored
from flightdeck.services.core import Effect, Emit, Service
from flightdeck.services.shell.deadletter import given_up

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Output:
    """A stamped output, ready to append under `subject` with `msg_id`."""

    subject: str
    event: Event
    msg_id: str


@dataclass(frozen=True, slots=True)
class Step:
    """One input folded. `outputs` are the core's decisions; `effects` the I/O it asked for (run live
    only, their outcome events numbered from `len(outputs)`); `error` is why the input was not used
    (undecodable, invalid, or the core raised): the shell dead-letters it, and state is unchanged."""

    input: Stored
    outputs: tuple[Output, ...]
    effects: tuple[Effect, ...] = ()
    error: str = ""


def msg_id(service: str, stored: Stored, index: int) -> str:
    return f"{service}:{stored.stream}:{stored.seq}:{index}"


def stamp(service: str, stored: Stored, index: int, emit: Emit, *, occurred_at: float | None = None) -> Output:
    """Stamp the envelope a core leaves empty. Decisions take the input's time (outputs are pure functions
    of inputs); effect outcomes pass the time they really happened."""
    assert stored.event is not None
    mid = msg_id(service, stored, index)
    event = msgspec.structs.replace(
        emit.event,
        event_id=mid,
        occurred_at=stored.event.occurred_at if occurred_at is None else occurred_at,
        causation_id=stored.event.event_id,
        producer=service,
    )
    return Output(emit.subject, event, mid)


def failure(exc: BaseException) -> str:
    """A one-line summary of an exception with the frame that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


# For a core that changes its state in place: a new copy once folding since the last one took COPY_EVERY times
# as long as making it (so copies cost at most ~5% of folding), or after MAX_SINCE inputs (memory).
COPY_EVERY = 20
MAX_SINCE = 65_536


class Folder(Generic[S]):
    """A service's state and the positions it has folded up to in each stream."""

    def __init__(self, service: Service[S]) -> None:
        self.service = service
        self.state: S = service.initial
        self.control_seq = 0  # last FD_CONTROL sequence applied
        self.telemetry_seq = 0  # FD_TELEMETRY is folded up to here
        self.clock_subject = subjects.clock(service.name)
        # In-place cores only: a copy of an earlier state and the events folded since, to undo a failed transition.
        self._base: S = service.initial
        self._since: list[Event] = []
        self._copy_cost_s = 0.0
        self._folding_s = 0.0
        self.num_refolded = 0  # events folded again to undo failed transitions
        self.admission = Admission()  # the rule every reader shares: events/admission.py

    def restore(self, state: S, control_seq: int, telemetry_seq: int, versions: dict[str, int]) -> None:
        """Start from a snapshot (services/shell/snapshots.py) instead of the first event."""
        self.state = state
        self._base = self.service.copy(state) if self.service.copy is not None else state
        self._since.clear()
        self.control_seq, self.telemetry_seq = control_seq, telemetry_seq
        self.admission.versions = dict(versions)

    def tick_position(self, stored: Stored) -> int | None:
        """The telemetry position an own, valid ClockTick recorded; None for any other input."""
        ev = stored.event
        if stored.subject != self.clock_subject or not isinstance(ev, ClockTick) or ev.service != self.service.name:
            return None
        return ev.positions.get(subjects.TELEMETRY, 0)

    def apply(self, stored: Stored, telemetry: Sequence[Stored] = ()) -> list[Step]:
        """Fold one FD_CONTROL input. For an own ClockTick, `telemetry` must be every message on the
        service's telemetry subjects after `telemetry_seq` up to the tick's position, in order; they
        are folded first, then the tick."""
        assert stored.stream == subjects.CONTROL and stored.seq > self.control_seq, (stored.stream, stored.seq)
        steps: list[Step] = []
        position = self.tick_position(stored)
        if position is not None:
            for item in telemetry:
                assert self.telemetry_seq < item.seq <= position, (self.telemetry_seq, item.seq, position)
                steps.append(self._fold(item))
                self.telemetry_seq = item.seq
            self.telemetry_seq = max(self.telemetry_seq, position)
        else:
            assert not telemetry, "telemetry is folded only at the service's own ticks"
        steps.append(self._fold(stored))
        self.control_seq = stored.seq
        return steps

    def _fold(self, stored: Stored) -> Step:
        if reason := self.admission.refusal(stored):
            return Step(stored, (), error=reason)
        event = stored.event
        assert event is not None
        name = self.service.name
        began = time.perf_counter()
        try:
            state, decided = self.service.transition(self.state, event)
            emits = [d for d in decided if isinstance(d, Emit)]
            effects = tuple(d for d in decided if isinstance(d, Effect))
            outputs = tuple(stamp(name, stored, i, e) for i, e in enumerate(emits))
            for out in outputs:
                subjects.stream_of(out.subject)
                if why := mismatch(out.subject, out.event):
                    raise ValueError(f"{name} decided an output that breaks the subject grammar: {why}")
            for effect in effects:
                if effect.kind not in self.service.effects:
                    raise ValueError(f"{name} asked for effect {effect.kind!r} but has no handler for it")
        except Exception as exc:  # a core bug costs one input, never the service
            self._undo()
            return Step(stored, (), error=f"core failed: {failure(exc)}")
        self.state = state
        self._remember(event, time.perf_counter() - began)
        return Step(stored, outputs, effects)

    def _remember(self, event: Event, took_s: float) -> None:
        copy = self.service.copy
        if copy is None:
            return
        self._since.append(event)
        self._folding_s += took_s
        if self._folding_s >= COPY_EVERY * self._copy_cost_s or len(self._since) >= MAX_SINCE:
            began = time.perf_counter()
            self._base = copy(self.state)
            self._copy_cost_s = time.perf_counter() - began
            self._since.clear()
            self._folding_s = 0.0

    def _undo(self) -> None:
        """The state before the failed input: a transition that raised may have changed it part-way. Cores are
        deterministic, so folding the same events from the kept copy again gives that state exactly."""
        copy = self.service.copy
        if copy is None:
            return  # the state it was given is unchanged
        state = copy(self._base)
        for event in self._since:
            state, _ = self.service.transition(state, event)
        self.state = state
        self.num_refolded += len(self._since)


class _Lookahead:
    """Reads one stream forward in batches and hands out messages up to a sequence."""

    def __init__(self, batches: AsyncIterator[list[Stored]]) -> None:
        self._batches = batches
        self._pending: deque[Stored] = deque()
        self._done = False

    async def upto(self, seq: int) -> list[Stored]:
        taken: list[Stored] = []
        while True:
            while self._pending and self._pending[0].seq <= seq:
                taken.append(self._pending.popleft())
            if self._pending or self._done:
                return taken
            try:
                self._pending.extend(await anext(self._batches))
            except StopAsyncIteration:
                self._done = True


async def replay(service: Service[S], store: EventStore, *, until: int = 0, folder: Folder[S] | None = None,
                 skip: Collection[int] | None = None) -> AsyncIterator[Step]:
    """Fold the recorded inputs of `service` up to FD_CONTROL sequence `until` (0: the end now) and yield
    every step, telemetry folded where the recorded ticks put it. Pass `folder` to keep the state.
    `skip`: FD_CONTROL sequences the live service never folded (default: those the server gave up on,
    as recorded in FD_DEAD)."""
    folder = folder if folder is not None else Folder(service)
    skipped = skip if skip is not None else await given_up(store, service.name)
    control = [*service.control_subjects, folder.clock_subject]
    telemetry: _Lookahead | None = None
    if service.telemetry_subjects:
        telemetry = _Lookahead(aiter(store.read(subjects.TELEMETRY, service.telemetry_subjects,
                                                from_seq=folder.telemetry_seq + 1)))
    async for batch in store.read(subjects.CONTROL, control, from_seq=folder.control_seq + 1, until_seq=until):
        for stored in batch:
            if until and stored.seq > until:
                return
            if stored.seq in skipped:
                continue
            position = folder.tick_position(stored)
            due: list[Stored] = []
            if position is not None and telemetry is not None:
                due = [t for t in await telemetry.upto(position) if t.seq > folder.telemetry_seq]
            for step in folder.apply(stored, due):
                yield step


async def rebuild(service: Service[S], store: EventStore, *, until: int, folder: Folder[S] | None = None) -> Folder[S]:
    """A folder holding the state after FD_CONTROL sequence `until`, nothing emitted; from `folder` (a snapshot's,
    or one a failed try left part-way) when given."""
    folder = folder if folder is not None else Folder(service)
    if until > folder.control_seq:
        async for _ in replay(service, store, until=until, folder=folder):
            pass
    return folder


def outputs_of(steps: Sequence[Step]) -> list[Output]:
    return [out for step in steps for out in step.outputs]


def comparable(event: Event, held: Collection[str] | None = None) -> dict[str, Any]:
    """An output as a replay can reproduce it: the history's `job_version` is assigned on append. `held`: the
    fields a recorded copy holds (`recorded_fields`); a field the catalog gained since was decided by no one then,
    so a replay's value of it is not compared."""
    fields = msgspec.structs.asdict(event)
    fields.pop("job_version", None)
    if held is not None:
        fields = {k: v for k, v in fields.items() if k in held}
    return {"type": type_name(event), **fields}


def recorded_fields(stored: Stored) -> frozenset[str] | None:
    """The fields a stored event's payload holds (every field of its type then: the codec omits none); None when
    the payload cannot be read as a map."""
    try:
        raw = msgspec.msgpack.decode(stored.data)
    except msgspec.DecodeError:
        return None
    return frozenset(raw) if isinstance(raw, dict) else None


def same_decision(recorded: Stored, replayed: Event) -> bool:
    """Whether a replay decided what `recorded` holds, over the fields it was recorded with."""
    assert recorded.event is not None
    held = recorded_fields(recorded)
    return _equal(comparable(recorded.event, held), comparable(replayed, held))


def _equal(a: Any, b: Any) -> bool:
    """Equality in which a NaN equals a NaN: a non-finite loss is data, and the same decision holds it both times."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, msgspec.Struct) and type(a) is type(b):
        return _equal(msgspec.structs.asdict(a), msgspec.structs.asdict(b))
    return bool(a == b)
