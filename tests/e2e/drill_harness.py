"""Self-healing drills on a real broker: every service and the node agents as subprocesses (engineer J's
`Platform`, tests/integration/lifecycle_harness.py), a tiny job with a drill fault, and what the drills
assert and keep: the final lineage of steps, and the job's whole history as an export file.

    async def test_x(drill: Platform) -> None:
        drill.agent("n1")                       # agents are the test's to start (one, two, 1 slot each ...)
        await drill.ready("n1")
        await drill.submit(drill_spec("crash", faults=[...]), "crash-000001")

Policies are tuned short (heartbeats every 0.5 s, lost after 4 misses, hung after 3 s, a checkpoint every
5 steps) so a drill takes well under two minutes on a loaded 2-core box. The health monitor ticks every
0.5 s (FLIGHTDECK_HEALTH_TICK_S) in drills.
"""

import asyncio
import base64
import json
import signal
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from flightdeck.events import codec, subjects
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import JobResumed
from flightdeck.events.spec import FaultSpec, JobSpec, ModelSpec, PolicySpec, TrainSpec
from flightdeck.events.store import Stored
from flightdeck.events.training import StepCompleted
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.tools.audit.settle import verify_live
from flightdeck.services.tools.console import verify_cmd
from tests.integration.lifecycle_harness import SERVICES, Objects, Platform, open_platform

HEALTH_TICK_S = "0.5"
DRILL_POLICY = PolicySpec(heartbeat_interval_s=0.5, heartbeat_misses=4, hang_min_s=3.0, max_restarts=3,
                          spike_warmup=10, spike_window=20, rollback_steps_back=5, rollback_skip_batches=5,
                          max_skip_fraction=0.5)  # drills are short: 8 batches of 60 steps, rolled back all the same


def drill_spec(name: str, *, slots: int = 2, steps: int = 40, checkpoint_every: int = 5,
               faults: Sequence[FaultSpec] = (), **policy: Any) -> JobSpec:
    """A tiny job (d_model 32, synthetic tokens) with the drill policy, changed by `policy`."""
    return JobSpec(name=name, slots=slots, model=ModelSpec(d_model=32),
                   train=TrainSpec(steps=steps, checkpoint_every=checkpoint_every, data="synthetic", seed=1),
                   policy=msgspec.structs.replace(DRILL_POLICY, **policy), faults=list(faults))


CRASH_AT = 22  # rank 1 crashes here in the crash drill
SPIKE_AT = 30  # global batches [30, 33) are noise in the spike drill
KILL_AFTER_STEP = 12  # the lost-node drill kills agent n2 once this step is done


def paced(seconds: float = 0.1) -> FaultSpec:
    """Attempt 0 at about 1/seconds steps a second (a `slow` fault on rank 0; the other rank waits for it in
    every all-reduce), so checkpoints are committed before a later fault: a commit lands a second or so after
    its step, and the tiny model runs 20-100 steps a second."""
    return FaultSpec(kind="slow", step=0, rank=0, seconds=seconds)


def crash_spec() -> JobSpec:
    return drill_spec("crash", steps=40, faults=[paced(), FaultSpec(kind="crash", step=CRASH_AT, rank=1)])


def spike_spec() -> JobSpec:
    # A short baseline: on a loss still falling fast, 20 steps back spread the MAD enough to hide a 0.7 jump.
    return drill_spec("spike", steps=60, faults=[paced(), FaultSpec(kind="loss_spike", step=SPIKE_AT, rank=0)],
                      spike_window=10)


def lost_node_spec() -> JobSpec:
    """Two ranks that may shrink to one (policy.min_slots = 1), for two single-slot nodes."""
    return drill_spec("lostnode", slots=2, steps=40, faults=[paced()], min_slots=1)


GROW_STEPS = 100
GROW_PACE_S = 0.2


def grow_back_spec() -> JobSpec:
    """The lost-node job that then grows back, paced in every attempt (which attempt ends up shrunk depends on
    when n2 is found lost). A node started once the job has shrunk joins while the shrunk attempt still runs if
    its agent starts within GROW_STEPS x GROW_PACE_S (20 s) less the steps done; the drill's length after the
    shrink stays about that, however fast the node joins: what the shrunk attempt leaves, the grown one runs."""
    slow = [FaultSpec(kind="slow", step=0, rank=0, seconds=GROW_PACE_S, attempt=a) for a in range(6)]
    return drill_spec("growback", slots=2, steps=GROW_STEPS, faults=slow, min_slots=1)


DRILL_SPECS = {"crash": crash_spec, "spike": spike_spec}  # single-node drills by name (tests/fixtures/record_drill.py)


@dataclass(frozen=True)
class DrillObjects(Objects):
    """A local object store, and the drill's environment for every process the platform starts."""

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, "FLIGHTDECK_HEALTH_TICK_S": HEALTH_TICK_S}


async def start_drill(url: str, root: Path, services: tuple[str, ...] = SERVICES) -> Platform:
    """Every service on the broker at `url`, objects in a local folder under `root`; no agent yet."""
    p = await open_platform(url, root, DrillObjects(str(root / "objects")))
    for name in services:
        p.service(name)
    return p


@pytest.fixture
async def drill(nats_server: broker_mod.Broker, tmp_path: Path) -> AsyncIterator[Platform]:
    """Every service, no agent; all stopped at the end, after each job's history is kept in the test's tmp dir
    (`<job>.history.jsonl`), whether the drill passed or not."""
    p = await start_drill(nats_server.url, tmp_path)
    try:
        yield p
    finally:
        try:
            for job_id in sorted({j for s in p.control if (j := subjects.job_of(s.stored.subject))}):
                await export(p, job_id, tmp_path / f"{job_id}.history.jsonl")
                await assert_verified(p, job_id)  # each drill's history re-derives (flightdeck verify)
        finally:
            await p.close()


async def assert_verified(p: Platform, job_id: str) -> None:
    """`flightdeck verify` of the job on the drill's broker (services/tools/audit), once every service has folded its
    history: each recorded decision re-derives from the recorded inputs, or the drill fails with the divergence."""
    verdict = await verify_live(p.store, job_id)
    assert verdict.ok, "\n".join(verify_cmd.report(verdict, "the drill's broker", every=True))


async def start_two_nodes(p: Platform, *extra: str) -> None:
    """Agents n1 and n2, one CPU slot each, each with its own data dir as on two hosts; `extra` agent flags (e.g.
    `--standby 1`)."""
    p.agent("n1", "--slots", "1", "--grace-s", "2", *extra)
    p.agent("n2", "--slots", "1", "--grace-s", "2", "--data-dir", str(p.root / "data-n2"), *extra)
    await p.ready("n1")
    await p.ready("n2")


def join_node(p: Platform, node: str, *extra: str) -> None:
    """Another host's agent (one CPU slot, its own data dir) joins the fleet: a new node, or a lost one back."""
    p.agent(node, "--slots", "1", "--grace-s", "2", "--data-dir", str(p.root / f"data-{node}"), *extra)


async def kill_agent_mid_run(p: Platform, job_id: str, node: str = "n2", after_step: int = KILL_AFTER_STEP) -> float:
    """SIGKILL the node's agent (its ranks die with it) once the job has done `after_step` steps, in whichever
    attempt (on a box loaded enough to silence a rank for the drill's 2 s, attempt 0 may be restarted before it
    gets there); when, by time.monotonic()."""
    await p.until(lambda: any(e.step >= after_step for e in p.seen(StepCompleted, job_id, stream=subjects.TELEMETRY)),
                  90, f"step {after_step}", job_id)
    killed = time.monotonic()
    p.procs[f"agent-{node}"].send_signal(signal.SIGKILL)
    p.procs[f"agent-{node}"].wait(10)
    return killed


# -- what a drill asserts ------------------------------------------------------------------------------------

def steps_of(p: Platform, job_id: str) -> dict[int, set[int]]:
    """The steps each attempt reported (StepCompleted from any rank)."""
    out: dict[int, set[int]] = {}
    for e in p.seen(StepCompleted, job_id, stream=subjects.TELEMETRY):
        out.setdefault(e.attempt, set()).add(e.step)
    return out


def lineage_gaps(p: Platform, job_id: str, steps: int) -> list[int]:
    """Steps of the final lineage with no StepCompleted: attempt a owns [its from_step, the next resumed
    attempt's from_step), the last one up to `steps`. Empty when the lineage is whole."""
    starts = {0: 0} | {e.attempt: e.from_step for e in p.seen(JobResumed, job_id)}
    done = steps_of(p, job_id)
    order = sorted(starts)
    missing: list[int] = []
    for i, attempt in enumerate(order):
        end = starts[order[i + 1]] if i + 1 < len(order) else steps
        missing += [s for s in range(starts[attempt], end) if s not in done.get(attempt, set())]
    return missing


# -- what a drill keeps -------------------------------------------------------------------------------------

async def history(store: JetStreamStore, job_id: str) -> list[Stored]:
    """The job's control history and its telemetry, each stream in order (control first)."""
    out: list[Stored] = []
    for stream, subject in ((subjects.CONTROL, subjects.job_all(job_id)),
                            (subjects.TELEMETRY, subjects.telemetry_job(job_id))):
        async for batch in store.read(stream, [subject]):
            out += batch
    return out


async def everything(store: JetStreamStore) -> list[Stored]:
    """Every message of every stream, each stream in order: what a replay of all services needs (clock ticks,
    fleet events and telemetry included)."""
    out: list[Stored] = []
    for stream in (subjects.CONTROL, subjects.TELEMETRY, subjects.DEAD):
        async for batch in store.read(stream):
            out += batch
    return out


async def fleet(store: JetStreamStore) -> list[Stored]:
    """Fleet events (nodes registering, cordoned, lost): part of what a lost-node drill's decisions rest on."""
    out: list[Stored] = []
    async for batch in store.read(subjects.CONTROL, ["fd.ctl.node.>"]):
        out += batch
    return out


async def export(p: Platform, job_id: str, path: Path) -> Path:
    """The job's history (and the fleet's) as JSON lines for people: stream, seq, subject, event."""
    rows = [*await fleet(p.store), *await history(p.store, job_id)]
    with path.open("wb") as out:
        for s in rows:
            event = codec.to_builtins(s.event) if s.event is not None else {"error": s.error}
            out.write(codec.to_json({"stream": s.stream, "seq": s.seq, "subject": s.subject, "event": event}) + b"\n")
    return path


def record_lines(rows: Sequence[Stored]) -> list[bytes]:
    """Recorded messages as JSON lines that keep the wire bytes: stream, seq, subject, data (base64 msgpack)."""
    return [json.dumps({"stream": s.stream, "seq": s.seq, "subject": s.subject, "msg_id": s.msg_id,
                        "data": base64.b64encode(s.data).decode()}).encode() for s in rows]


async def wait_lineage(p: Platform, job_id: str, steps: int, within: float = 15.0) -> list[int]:
    """Telemetry trails the control history a little: wait until every step of the final lineage is in;
    the steps still missing then (empty: the lineage is whole)."""
    deadline = time.monotonic() + within
    gaps = lineage_gaps(p, job_id, steps)
    while gaps and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        gaps = lineage_gaps(p, job_id, steps)
    return gaps
