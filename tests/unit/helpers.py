"""Drive pure service cores by hand: fold events through one core, or route several over an in-memory log.

`Bus` plays the shell's part without NATS: one ordered log (FD_CONTROL), each service reading the
messages its control subjects match, in log order, with outputs stamped the way the shell stamps them
(event id = msg id, the input's time, causation, producer) and appended to the end of the log.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from flightdeck.events import subjects
from flightdeck.events.admission import versioned
from flightdeck.events.base import Event, JobEvent, NodeEvent
from flightdeck.events.clock import ClockTick, CoreConfigured
from flightdeck.events.commands import StopRequested
from flightdeck.events.fleet import NodeLost, NodeRegistered, NodeUncordoned
from flightdeck.events.history import append_to_job
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    CancelRequested,
    JobCancelled,
    JobPhaseChanged,
    JobSubmitted,
    WorkersExited,
    WorkersStarted,
)
from flightdeck.events.spec import JobSpec, PolicySpec, TrainSpec
from flightdeck.events.store import AppendResult, EventStore
from flightdeck.services.core import Emit, Service

S = TypeVar("S")
E = TypeVar("E", bound=Event)


def subject_of(event: Event) -> str:
    name = type(event).__name__
    if isinstance(event, ClockTick | CoreConfigured):
        return subjects.clock(event.service)
    if isinstance(event, JobEvent):
        return subjects.job(event.job_id, name)
    assert isinstance(event, NodeEvent), f"no subject rule for {name} in these tests"
    return subjects.node(event.node, name)


def check_emit(emit: Emit) -> None:
    """An output must stand under the subject its own fields give it, with the envelope left to the shell."""
    assert isinstance(emit, Emit), emit
    assert emit.subject == subject_of(emit.event), (emit.subject, emit.event)
    ev = emit.event
    assert (ev.event_id, ev.occurred_at, ev.causation_id, ev.producer) == ("", 0.0, "", ""), ev


def step(service: Service[S], state: S, event: Event) -> tuple[S, list[Emit]]:
    state, decided = service.transition(state, event)
    outs = list(decided)
    for out in outs:
        check_emit(out)  # type: ignore[arg-type]
    return state, outs  # type: ignore[return-value]


def fold(service: Service[S], events: Iterable[Event], state: S | None = None) -> tuple[S, list[Emit]]:
    """Fold `events` in order from `state` (default: the service's initial state); all outputs, in order."""
    current = service.initial if state is None else state
    collected: list[Emit] = []
    for ev in events:
        current, outs = step(service, current, ev)
        collected.extend(outs)
    return current, collected


def events_of(outs: Sequence[Emit], kind: type[Event] | None = None) -> list[Any]:
    return [o.event for o in outs if kind is None or isinstance(o.event, kind)]


def decided(outs: Sequence[Emit], kind: type[Event] | None = None) -> list[Any]:
    """The events in `outs` less the scheduler's phase records (JobPhaseChanged): its decisions."""
    return [e for e in events_of(outs, kind) if not isinstance(e, JobPhaseChanged)]


def phases(outs: Sequence[Emit]) -> list[tuple[str, str, str]]:
    """The scheduler's phase records in `outs`: (job, phase, reason) each."""
    return [(e.job_id, e.phase, e.reason) for e in events_of(outs, JobPhaseChanged)]


def spec(name: str = "job", *, slots: int = 1, priority: int = 50, max_restarts: int = 3,
         steps: int = 100) -> JobSpec:
    return JobSpec(name=name, slots=slots, priority=priority, train=TrainSpec(steps=steps, batch_size=max(8, slots)),
                   policy=PolicySpec(max_restarts=max_restarts))


def submit(job_id: str, *, slots: int = 1, priority: int = 50, max_restarts: int = 3, steps: int = 100,
           event_id: str = "") -> JobSubmitted:
    return JobSubmitted(job_id=job_id, spec=spec(job_id.split("-")[0], slots=slots, priority=priority,
                                                 max_restarts=max_restarts, steps=steps), event_id=event_id)


def register(node: str, slots: int, *, spare: bool = False) -> NodeRegistered:
    return NodeRegistered(node=node, kind="gpu", slots=slots, spare=spare, address=f"{node}.example")


@dataclass
class Bus:
    services: Sequence[Service[Any]]
    log: list[Event] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)
    read: list[int] = field(default_factory=list)  # how far each service has read the log
    clock: float = 1000.0
    limit: int = 20_000  # more messages than any test here needs: a loop between services fails, not hangs

    def __post_init__(self) -> None:
        self.states = [s.initial for s in self.services]
        self.read = [0 for _ in self.services]
        self.versions: dict[str, int] = {}  # per job, as events/history.py numbers a job's history

    def _append(self, ev: Event) -> None:
        if isinstance(ev, JobEvent):
            self.versions[ev.job_id] = version = self.versions.get(ev.job_id, 0) + 1
            ev = msgspec.structs.replace(ev, job_version=version)
        self.log.append(ev)

    def publish(self, *events: Event) -> None:
        """Append events from outside the services (CLI, agents, trainer), stamped as their producer would."""
        for ev in events:
            self.clock += 1.0
            self._append(msgspec.structs.replace(ev, event_id=ev.event_id or f"ext:{len(self.log) + 1}",
                                                 occurred_at=ev.occurred_at or self.clock))
        self.pump()

    def pump(self) -> None:
        """Let every service read the log to its end, outputs included, until nobody has anything left."""
        busy = True
        while busy:
            busy = False
            for i, service in enumerate(self.services):
                while self.read[i] < len(self.log):
                    seq = self.read[i] + 1
                    ev = self.log[seq - 1]
                    self.read[i] = seq
                    filters = (*service.control_subjects, subjects.clock(service.name))
                    if not any(subjects.matches(f, subject_of(ev)) for f in filters):
                        continue
                    busy = True
                    self.states[i], outs = step(service, self.states[i], ev)
                    assert len(self.log) + len(outs) <= self.limit, f"runaway: {len(self.log)} messages"
                    for n, out in enumerate(outs):
                        self._append(msgspec.structs.replace(
                            out.event, event_id=f"{service.name}:{seq}:{n}", occurred_at=ev.occurred_at,
                            causation_id=ev.event_id, producer=service.name))

    def state(self, name: str) -> Any:
        return self.states[[s.name for s in self.services].index(name)]

    def of(self, kind: type[Event], job_id: str | None = None) -> list[Any]:
        return [e for e in self.log if isinstance(e, kind) and (job_id is None or getattr(e, "job_id", None) == job_id)]

    def start_workers(self, grant: AllocationGranted) -> None:
        """What the node agents do with a grant: one WorkersStarted per node."""
        by_node: dict[str, list[int]] = {}
        for ref in grant.assignments:
            by_node.setdefault(ref.node, []).append(ref.rank)
        for node, ranks in sorted(by_node.items()):
            self.publish(WorkersStarted(job_id=grant.job_id, node=node, attempt=grant.attempt, ranks=ranks,
                                        pids=[1000 + r for r in ranks]))

    def exit_workers(self, grant: AllocationGranted, code: int = 0, ranks: Iterable[int] | None = None) -> None:
        chosen = set(ranks) if ranks is not None else {r.rank for r in grant.assignments}
        for ref in grant.assignments:
            if ref.rank in chosen:
                self.publish(WorkersExited(job_id=grant.job_id, node=ref.node, attempt=grant.attempt,
                                           rank=ref.rank, exit_code=code))

    def last_grant(self, job_id: str) -> AllocationGranted:
        grants = self.of(AllocationGranted, job_id)
        assert grants, f"{job_id} was never granted"
        return grants[-1]


class Agents:
    """Node agents and obedient ranks over a Bus: start the workers of every grant, and on a StopRequested
    have the job's running ranks exit 0. `running` holds the grants whose workers run, by job."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.seen = 0
        self.running: dict[str, AllocationGranted] = {}

    def __call__(self) -> None:
        while self.seen < len(self.bus.log):
            ev = self.bus.log[self.seen]
            self.seen += 1
            if isinstance(ev, AllocationGranted):
                self.running[ev.job_id] = ev
                self.bus.start_workers(ev)
            elif isinstance(ev, StopRequested) and ev.job_id in self.running:
                self.finish(ev.job_id)
            elif isinstance(ev, AllocationReleased) and ev.job_id in self.running:
                if self.running[ev.job_id].attempt == ev.attempt:
                    del self.running[ev.job_id]  # the agent kills what is left; nothing more is reported
            elif isinstance(ev, JobCancelled):
                self.running.pop(ev.job_id, None)

    def finish(self, job_id: str, code: int = 0) -> None:
        """The job's running ranks exit with `code`."""
        self.bus.exit_workers(self.running.pop(job_id), code)


class Fleet:
    """The random traffic the scheduler property tests share: jobs ending, cancels, and nodes lost, added and
    back, on a Bus with its Agents. `nodes` counts the nodes named n0, n1, ... so far."""

    def __init__(self, bus: Bus, agents: Agents, nodes: int) -> None:
        self.bus, self.agents, self.nodes = bus, agents, nodes

    def act(self, kind: str, x: int, y: int) -> bool:
        """Carry out one shared action; False when `kind` is none of them or has nothing to act on."""
        b, jobs, running = self.bus, sorted(self.bus.state("scheduler").jobs), sorted(self.agents.running)
        match kind:
            case "finish" | "crash" if running:
                self.agents.finish(running[x % len(running)], 0 if kind == "finish" else 1)
            case "cancel" if jobs:
                b.publish(CancelRequested(job_id=jobs[x % len(jobs)], reason="test"))
            case "lose":
                b.publish(NodeLost(node=f"n{x % self.nodes}", reason="test"))
            case "add":
                b.publish(register(f"n{self.nodes}", y))
                self.nodes += 1
            case "uncordon":
                b.publish(register(f"n{x % self.nodes}", 2), NodeUncordoned(node=f"n{x % self.nodes}"))
            case "tick":
                b.publish(ClockTick(service="scheduler", now=b.clock + 10.0, positions={}))
            case _:
                return False
        return True


def numbered(events: Iterable[E]) -> list[E]:
    """`events` with each job's events numbered 1, 2, ... as their history would (events/history.py): what a
    reader admits (events/admission.py)."""
    versions: dict[str, int] = {}
    out: list[E] = []
    for ev in events:
        if isinstance(ev, JobEvent):
            versions[ev.job_id] = versions.get(ev.job_id, 0) + 1
            ev = msgspec.structs.replace(ev, job_version=versions[ev.job_id])
        out.append(ev)
    return out


async def append(store: EventStore, subject: str, event: Event, msg_id: str = "") -> AppendResult:
    """As the shell appends: a job's versioned events through its history's fence, the rest as they are."""
    if versioned(subject):
        assert isinstance(event, JobEvent)
        return await append_to_job(store, event, msg_id=msg_id)
    return await store.append(subject, event, msg_id=msg_id)
