"""What every chaos drill checks once its job has ended, read back from the broker rather than from what the
test saw live: `flightdeck verify` passes (services/tools/audit: the pure cores decide again exactly what was recorded),
every step of the final lineage reported exactly once by every rank, and no decision taken twice.

    outcome = await check(store, job_id, steps=..., drill="services", faults=[...])
    assert outcome.held, outcome

`Outcome` is also what a drill records for the README's reliability table (`record`).
"""

import asyncio
import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointDeleted
from flightdeck.events.commands import RollbackRequested
from flightdeck.events.findings import RankHung, RankLost
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import (
    AllocationDenied,
    AllocationGranted,
    AllocationReleased,
    AllocationRequested,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobResumed,
    WorkersExited,
    WorkersStarted,
)
from flightdeck.events.store import EventStore, Stored, StoreUnavailable
from flightdeck.events.training import StepCompleted
from flightdeck.services.tools.audit.settle import verify_live

RECORD_ENV = "FLIGHTDECK_CHAOS_RECORD"  # a JSON-lines file each drill's outcome is appended to (optional)


@dataclass
class Outcome:
    """What held after one drill: each list empty and `completed` true when everything did."""

    drill: str
    faults: list[str]
    completed: bool = False
    decisions_verified: dict[str, int] = field(default_factory=dict)  # per core: recorded decisions reproduced
    divergences: list[str] = field(default_factory=list)  # verify: the first few differences
    missing_steps: list[int] = field(default_factory=list)  # lineage steps without a StepCompleted from every rank
    repeated_steps: list[str] = field(default_factory=list)  # (attempt, rank, step) reported more than once
    repeated_decisions: list[str] = field(default_factory=list)  # one decision identity recorded twice
    attempts: int = 0
    findings: list[str] = field(default_factory=list)  # RankLost/RankHung raised (a restart each): for the record
    seconds: float = 0.0

    @property
    def held(self) -> bool:
        return (self.completed and not self.divergences and not self.missing_steps and not self.repeated_steps
                and not self.repeated_decisions and sum(self.decisions_verified.values()) > 0)


READ_TRIES = 4  # a cluster whose stream leader was just killed may still be electing when the job has ended
TELEMETRY_SETTLE_S = 60.0  # how long a rank's reports held by its agent may take to be stored after the job's end


async def read_all(store: EventStore, stream: str, filters: Iterable[str] = ()) -> list[Stored]:
    for attempt in range(READ_TRIES):
        out: list[Stored] = []
        try:
            async for batch in store.read(stream, list(filters)):
                out += batch
            return out
        except StoreUnavailable:
            if attempt == READ_TRIES - 1:
                raise
            await asyncio.sleep(2.0)
    raise AssertionError("unreachable")


def identities(event: Event) -> list[tuple[Any, ...]]:
    """What makes a control event one decision (or several: a node's exit record holds each of its ranks' exits):
    two recorded events sharing one are a decision taken twice (each restart is resumed once, each finding rolled
    back once, each attempt granted and released once, each rank's exit recorded once)."""
    if isinstance(event, WorkersExited):
        return [("WorkersExited", event.job_id, event.attempt, event.node, x.rank) for x in event.exits()]
    key = identity(event)
    return [] if key is None else [key]


def identity(event: Event) -> tuple[Any, ...] | None:
    match event:
        case JobResumed() | AllocationRequested() | AllocationGranted() | AllocationReleased():
            return type(event).__name__, event.job_id, event.attempt
        case WorkersStarted():
            return "WorkersStarted", event.job_id, event.attempt, event.node
        case JobCompleted() | JobFailed() | JobCancelled():
            return "JobEnded", event.job_id
        case RollbackRequested():
            return "RollbackRequested", event.job_id, event.trigger_id
        case CheckpointCommitted() | CheckpointDeleted():
            return type(event).__name__, event.job_id, event.checkpoint_id
        case RankLost() | RankHung():
            return type(event).__name__, event.job_id, event.attempt, event.rank
    return None


def repeated_decisions(control: list[Stored]) -> list[str]:
    events = [s.event for s in control if s.event is not None]
    ids = Counter(e.event_id for e in events)
    found = [f"event id {i} stored {n} times" for i, n in ids.items() if n > 1]
    # A request the resource manager denied is asked again once capacity returns (a node back from its cordon): a
    # new decision, told apart by how many denials of that attempt came before it.
    denials: Counter[tuple[str, int]] = Counter()
    keys: Counter[tuple[Any, ...]] = Counter()
    for e in events:
        if isinstance(e, AllocationDenied):
            denials[(e.job_id, e.attempt)] += 1
        for k in identities(e):
            keys[(*k, denials[(e.job_id, e.attempt)]) if isinstance(e, AllocationRequested) else k] += 1
    return found + [f"{k} decided {n} times" for k, n in keys.items() if n > 1]


def lineage(control: list[Stored], telemetry: list[Stored], steps: int) -> tuple[list[int], list[str]]:
    """The steps of the final lineage some rank never reported, and the (attempt, rank, step) reported more than
    once. Attempt a owns steps [its from_step, the next resumed attempt's from_step); attempt 0 starts at 0.

    A rank killed by a signal after its last report may have taken part in the next steps' collectives before it
    died, its reports of them unsent: a peer's report of such a step says it was trained (a nemesis run restored a
    survivor's snapshot of step 37, and the killed rank's report of 36 had died with it)."""
    events = [s.event for s in control if s.event is not None]
    starts = {0: 0} | {e.attempt: e.from_step for e in events if isinstance(e, JobResumed)}
    world = {e.attempt: len(e.assignments) for e in events if isinstance(e, AllocationGranted)}
    seen = Counter((e.attempt, e.rank, e.step) for s in telemetry if isinstance(e := s.event, StepCompleted))
    last: dict[tuple[int, int], int] = {}
    for attempt, rank, step in seen:
        last[(attempt, rank)] = max(last.get((attempt, rank), -1), step)
    killed = {(e.attempt, x.rank) for e in events if isinstance(e, WorkersExited) for x in e.exits() if x.exit_code < 0}

    def reported(attempt: int, rank: int, step: int) -> bool:
        if seen[(attempt, rank, step)]:
            return True
        return ((attempt, rank) in killed and step > last.get((attempt, rank), -1)
                and any(seen[(attempt, peer, step)] for peer in range(world.get(attempt, 1))))

    order = sorted(starts)
    missing: list[int] = []
    for i, attempt in enumerate(order):
        end = starts[order[i + 1]] if i + 1 < len(order) else steps
        missing += [s for s in range(starts[attempt], end)
                    if not all(reported(attempt, rank, s) for rank in range(world.get(attempt, 1)))]
    repeated = [f"attempt {a} rank {r} step {s}: {n} times" for (a, r, s), n in sorted(seen.items()) if n > 1]
    return missing, repeated


async def check(store: JetStreamStore, job_id: str, *, steps: int, drill: str, faults: list[str],
                seconds: float = 0.0) -> Outcome:
    """Everything a drill asserts, from the stored streams."""
    control = await read_all(store, subjects.CONTROL, [subjects.job_all(job_id)])
    events = [s.event for s in control if s.event is not None]
    verdict = await verify_live(store, job_id)  # `flightdeck verify`, once every service has folded the job
    # A rank's reports reach the broker through its agent, which holds them until the broker takes them: after a
    # leader's loss they may be stored after the job's end. Wait for them (bounded); a lost one stays missing.
    loop = asyncio.get_running_loop()
    settle_by = loop.time() + TELEMETRY_SETTLE_S
    while True:
        telemetry = await read_all(store, subjects.TELEMETRY, [subjects.telemetry_job(job_id)])
        missing, repeated = lineage(control, telemetry, steps)
        if not missing or loop.time() > settle_by:
            break
        await asyncio.sleep(1.0)
    return Outcome(
        drill=drill, faults=faults, seconds=round(seconds, 1),
        completed=any(isinstance(e, JobCompleted) for e in events),
        decisions_verified={c.service: c.decisions for c in verdict.checks},
        divergences=[f"{d.service} {d.kind} {d.msg_id} {d.detail}" for d in verdict.divergences[:10]],
        missing_steps=missing[:20], repeated_steps=repeated[:20],
        repeated_decisions=repeated_decisions(control),
        attempts=len({e.attempt for e in events if isinstance(e, AllocationGranted)}),
        findings=[finding(e) for e in events if isinstance(e, RankLost | RankHung)],
    )


def finding(e: RankLost | RankHung) -> str:
    """One finding for the record, with why it was raised, so a failed drill says what it saw."""
    why = e.reason if isinstance(e, RankLost) else f"stalled {e.stalled_s:.1f} s at step {e.step}"
    return f"{type(e).__name__} attempt {e.attempt} rank {e.rank} ({why})"


def record(outcome: Outcome) -> None:
    """Print the outcome as one JSON line, and append it to $FLIGHTDECK_CHAOS_RECORD when that is set."""
    line = json.dumps({**asdict(outcome), "held": outcome.held})
    print(f"\nchaos outcome: {line}")
    path = os.environ.get(RECORD_ENV)
    if path:
        with Path(path).open("a") as out:
            out.write(line + "\n")
