"""A job's whole lifecycle through running services on a real broker: the scheduler and the resource manager
as `python -m flightdeck.services NAME`, one node agent (`python -m flightdeck.services.agent`, 2 CPU slots) starting
real trainer ranks. `Cluster` is shared with test_agent.py."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.fleet import SelfCheckPassed
from flightdeck.events.history import append_to_job
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import (
    AllocationGranted,
    AllocationReleased,
    CancelRequested,
    JobCancelled,
    JobCompleted,
    JobPhaseChanged,
    JobResumed,
    JobSubmitted,
    WorkersExited,
    WorkersStarted,
)
from flightdeck.events.nodelocal import STOPPED_EXIT
from flightdeck.events.spec import FaultSpec, JobSpec, ModelSpec, TrainSpec
from flightdeck.events.store import Stored
from flightdeck.events.training import FaultInjected, RankStarted, StepCompleted
from flightdeck.services.checkpoints.core import core_service as checkpoints_core
from flightdeck.services.checkpoints.uploader import handlers as checkpoint_handlers
from flightdeck.services.shell import broker as broker_mod
from flightdeck.services.shell.objects.local import LocalStore
from flightdeck.services.shell.runtime import run_service

ROOT = Path(__file__).resolve().parents[2]
LOG_TAIL = 3000  # characters of each log shown with a failure
DUMP_SHOWN = 8000  # characters of a stack dump shown after them (dump_stacks)
DUMP_MARK = "(most recent call first):"  # faulthandler's first line: the dump starts on it
TINY = JobSpec(name="tiny", slots=2, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=20, checkpoint_every=10, data="synthetic"))
ENDLESS = JobSpec(name="endless", slots=2, model=ModelSpec(d_model=32),
                  train=TrainSpec(steps=1_000_000, checkpoint_every=1_000_000, data="synthetic"))


@dataclass(frozen=True)
class Exit:
    """One rank's exit, out of its node's WorkersExited record."""

    attempt: int
    node: str
    rank: int
    exit_code: int
    cause: str
    unrunnable: bool
    record: WorkersExited


@dataclass
class Seen:
    at: float  # time.monotonic() when the recorder read it
    stored: Stored

    @property
    def event(self) -> Event:
        assert self.stored.event is not None, self.stored.error
        return self.stored.event


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


@dataclass
class Cluster:
    url: str
    root: Path
    store: JetStreamStore
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    control: list[Seen] = field(default_factory=list)
    telemetry: list[Seen] = field(default_factory=list)
    output: list[Seen] = field(default_factory=list)  # FD_LOGS: what ranks printed
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def data(self) -> Path:
        return self.root / "data"

    def _start(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "FLIGHTDECK_LOG_LEVEL": "INFO"}
        with open(self.root / f"{name}.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def service(self, name: str) -> subprocess.Popen[bytes]:
        return self._start(name, ["-m", "flightdeck.services", name, "--nats", self.url])

    def agent(self, node: str = "n1", *extra: str) -> subprocess.Popen[bytes]:
        return self._start(f"agent-{node}", ["-m", "flightdeck.services.agent", "--nats", self.url, "--node", node,
                                             "--slots", "2", "--device", "cpu", "--data-dir", str(self.data),
                                             "--grace-s", "5", *extra])

    async def record(self) -> None:
        async def follow(stream: str, into: list[Seen]) -> None:
            async for stored in self.store.follow(stream, []):
                into.append(Seen(time.monotonic(), stored))
        self.tasks += [asyncio.create_task(follow(subjects.CONTROL, self.control)),
                       asyncio.create_task(follow(subjects.TELEMETRY, self.telemetry)),
                       asyncio.create_task(follow(subjects.LOGS, self.output))]

    def job(self, job_id: str) -> list[Event]:
        return [s.event for s in self.control if subjects.job_of(s.stored.subject) == job_id]

    def _pool(self, stream: str) -> list[Seen]:
        return {subjects.CONTROL: self.control, subjects.LOGS: self.output}.get(stream, self.telemetry)

    def seen(self, kind: type, job_id: str = "", *, stream: str = subjects.CONTROL) -> list[Any]:
        pool = self._pool(stream)
        return [s.event for s in pool if isinstance(s.stored.event, kind)
                and (not job_id or subjects.job_of(s.stored.subject) == job_id)]

    def rank_exits(self, job_id: str) -> list[Exit]:
        """Every rank's exit, in the order recorded (a node's record holds its ranks that ended together)."""
        return [Exit(attempt=e.attempt, node=e.node, rank=x.rank, exit_code=x.exit_code, cause=x.cause,
                     unrunnable=x.unrunnable, record=e)
                for e in self.seen(WorkersExited, job_id) for x in e.exits()]

    def first_at(self, kind: type, job_id: str, stream: str = subjects.CONTROL) -> float:
        pool = self._pool(stream)
        return next(s.at for s in pool
                    if isinstance(s.stored.event, kind) and subjects.job_of(s.stored.subject) == job_id)

    def logs(self) -> str:
        parts = []
        for path in sorted([*self.root.glob("*.log"), *self.data.glob("logs/*.log")]):
            text = path.read_text(errors="replace")
            dump = text.find(DUMP_MARK)
            dump = text.rfind("\n", 0, dump) + 1 if dump >= 0 else len(text)
            # The log's tail before a stack dump (dump_stacks), then the dump's start: threads, then tasks.
            parts.append(f"--- {path.name} ---\n{text[:dump][-LOG_TAIL:]}{text[dump:][:DUMP_SHOWN]}")
        return "\n".join(parts)

    async def dump_stacks(self) -> None:
        """Ask every process still running to write where it waits into its log (services/shell/stacks.py)."""
        live = [p for p in self.procs.values() if p.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGUSR1)
        if live:
            await asyncio.sleep(1.0)  # the tasks are logged from each process's loop, when it next runs

    async def until(self, check: Callable[[], bool], within: float, what: str, job_id: str = "") -> None:
        deadline = time.monotonic() + within
        while not check():
            if time.monotonic() > deadline:
                history = [type(e).__name__ for e in self.job(job_id)] if job_id else []
                await self.dump_stacks()
                raise AssertionError(f"timed out after {within}s waiting for {what}; job history {history}\n"
                                     f"{self.logs()}")
            await asyncio.sleep(0.1)

    async def caught_up(self, within: float = 60.0) -> None:
        """Until each stream's follower has read what the stream held when called: each follows on its own, and a
        test that saw the job end on one may read another that lags behind it (a loaded box: seconds)."""
        for stream in (subjects.CONTROL, subjects.TELEMETRY, subjects.LOGS):
            last, pool = await self.store.last_seq(stream), self._pool(stream)
            await self.until(lambda pool=pool, last=last: (bool(pool) and pool[-1].stored.seq >= last) or last == 0,
                             within, f"the {stream} follower to read up to {last}")

    async def ready(self, node: str = "n1", within: float = 60.0) -> None:
        await self.until(lambda: any(e.node == node for e in self.seen(SelfCheckPassed)), within,
                         f"agent {node} to pass its self-check")

    async def submit(self, spec: JobSpec, job_id: str) -> None:
        await append_to_job(self.store, JobSubmitted(job_id=job_id, spec=spec, event_id=f"cli-{job_id}",
                                                     occurred_at=time.time(), producer="cli"))

    async def cancel(self, job_id: str) -> None:
        await append_to_job(self.store, CancelRequested(job_id=job_id, reason="test", event_id=f"cli-cancel-{job_id}",
                                                        occurred_at=time.time(), producer="cli"))

    def pids(self, job_id: str) -> list[int]:
        return [pid for e in self.seen(WorkersStarted, job_id) for pid in e.pids]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for job_pids in {subjects.job_of(s.stored.subject) for s in self.control}:
            for pid in self.pids(job_pids or ""):
                if not gone(pid):  # a rank must never outlive its test
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await self.store.close()


@pytest.fixture
async def cluster(nats_server: broker_mod.Broker, tmp_path: Path) -> AsyncIterator[Cluster]:
    store = await JetStreamStore.connect(nats_server.url, name="lifecycle-test")
    c = Cluster(nats_server.url, tmp_path, store)
    await c.record()
    c.service("scheduler")
    c.service("resources")
    try:
        yield c
    finally:
        await c.close()


def kinds(events: list[Event]) -> list[str]:
    """The decisions' types, in order: the scheduler's phase records (JobPhaseChanged) are `phases`'."""
    return [type(e).__name__ for e in events if not isinstance(e, JobPhaseChanged)]


def phases(events: list[Event]) -> list[str]:
    return [e.phase for e in events if isinstance(e, JobPhaseChanged)]


def exits(c: Cluster, job_id: str, attempt: int) -> dict[int, int]:
    return {e.rank: e.exit_code for e in c.rank_exits(job_id) if e.attempt == attempt}


def starts(c: Cluster, job_id: str, attempt: int) -> float:
    """From the agent recording WorkersStarted to the last rank's RankStarted (interpreter, imports,
    rendezvous, model, restore) for one attempt, as the recorder saw them."""
    spawned = next(s.at for s in c.control if isinstance(s.stored.event, WorkersStarted)
                   and s.stored.event.job_id == job_id and s.stored.event.attempt == attempt)
    ready = max(s.at for s in c.telemetry if isinstance(s.stored.event, RankStarted)
                and s.stored.event.job_id == job_id and s.stored.event.attempt == attempt)
    return ready - spawned


@pytest.mark.timeout(120)
async def test_a_job_runs_to_completion_and_gives_its_slots_back(cluster: Cluster) -> None:
    c = cluster
    c.agent()
    await c.ready()
    submitted = time.monotonic()
    await c.submit(TINY, "tiny-000001")
    await c.until(lambda: bool(c.seen(JobCompleted, "tiny-000001")) and bool(c.seen(AllocationReleased, "tiny-000001"))
                  and phases(c.job("tiny-000001"))[-1:] == ["completed"], 90, "the job to complete", "tiny-000001")
    history = kinds(c.job("tiny-000001"))
    assert history[:5] == ["JobSubmitted", "JobQueued", "AllocationRequested", "AllocationGranted", "WorkersStarted"]
    records = len(c.seen(WorkersExited, "tiny-000001"))  # one per node, or one per rank that ended on its own
    assert 1 <= records <= 2 and history[5:5 + records] == ["WorkersExited"] * records
    assert history[5 + records:] == ["JobCompleted", "AllocationReleased"]
    assert phases(c.job("tiny-000001")) == ["placing", "running", "completed"]  # it found room when submitted
    assert exits(c, "tiny-000001", 0) == {0: 0, 1: 0}
    def steps() -> list[int]:
        return sorted({e.step for e in c.seen(StepCompleted, "tiny-000001", stream=subjects.TELEMETRY)})
    await c.until(lambda: steps() == list(range(20)), 60, "every step's telemetry")
    assert all(gone(pid) for pid in c.pids("tiny-000001"))
    spec_file = c.data / "jobs" / "tiny-000001" / "spec.toml"
    assert spec_file.exists() and (c.data / "logs" / "tiny-000001-a0-r1.log").exists()
    at = {name: c.first_at(kind, "tiny-000001", stream) - submitted for name, kind, stream in [
        ("granted", AllocationGranted, subjects.CONTROL), ("workers_started", WorkersStarted, subjects.CONTROL),
        ("rank_started", RankStarted, subjects.TELEMETRY), ("first_step", StepCompleted, subjects.TELEMETRY)]}
    print("\nfrom JobSubmitted, seconds:", {k: round(v, 3) for k, v in at.items()})


@pytest.mark.timeout(150)
async def test_a_crashed_rank_restarts_the_job_and_it_completes(cluster: Cluster) -> None:
    c = cluster
    c.agent()
    await c.ready()
    spec = JobSpec(name="crash", slots=2, model=TINY.model, train=TINY.train,
                   faults=[FaultSpec(kind="crash", step=8, rank=1)])
    await c.submit(spec, "crash-000001")
    await c.until(lambda: bool(c.seen(JobCompleted, "crash-000001")), 120, "the job to complete", "crash-000001")
    assert exits(c, "crash-000001", 0)[1] == 3  # the drill's crash code
    assert set(exits(c, "crash-000001", 0)) == {0, 1}  # the surviving rank's exit is recorded too, whatever it was
    assert exits(c, "crash-000001", 1) == {0: 0, 1: 0}
    granted = [e.attempt for e in c.seen(AllocationGranted, "crash-000001")]
    assert granted == [0, 1]
    history = kinds(c.job("crash-000001"))
    assert history.index("AllocationReleased") < len(history) - 2  # attempt 0's slots were given back first
    assert all(gone(pid) for pid in c.pids("crash-000001"))


@pytest.mark.timeout(180)
async def test_an_unpinned_fault_fires_once_in_the_first_attempt_that_reaches_its_step(cluster: Cluster) -> None:
    """Attempt 0 crashes at step 8 and never reaches step 12. Attempt 1 (no checkpoint: it starts over) passes
    step 8 quietly, since the agent read that fault's FaultInjected, and crashes at 12. Attempt 2 runs through."""
    c = cluster
    c.agent()
    await c.ready()
    spec = JobSpec(name="twice", slots=2, model=TINY.model, train=TINY.train,
                   faults=[FaultSpec(kind="crash", step=8, rank=1), FaultSpec(kind="crash", step=12, rank=0),
                           FaultSpec(kind="crash", step=4, rank=0, attempt=3)])  # pinned to an attempt never run
    await c.submit(spec, "twice-000001")
    await c.until(lambda: bool(c.seen(JobCompleted, "twice-000001")), 160, "the job to complete", "twice-000001")
    fired = [(e.attempt, e.fault, e.step, e.rank) for e in c.seen(FaultInjected, "twice-000001",
                                                                  stream=subjects.TELEMETRY)]
    assert fired == [(0, 0, 8, 1), (1, 1, 12, 0)]
    assert [e.attempt for e in c.seen(AllocationGranted, "twice-000001")] == [0, 1, 2]
    assert (exits(c, "twice-000001", 0)[1], exits(c, "twice-000001", 1)[0]) == (3, 3)
    assert exits(c, "twice-000001", 2) == {0: 0, 1: 0}
    steps = {e.step for e in c.seen(StepCompleted, "twice-000001", stream=subjects.TELEMETRY) if e.attempt == 1}
    assert set(range(12)) <= steps  # attempt 1 went past step 8


@pytest.mark.timeout(120)
async def test_a_cancel_stops_the_ranks_and_the_job_is_cancelled(cluster: Cluster) -> None:
    c = cluster
    c.agent()
    await c.ready()
    await c.submit(ENDLESS, "endless-000001")
    await c.until(lambda: len(c.seen(StepCompleted, "endless-000001", stream=subjects.TELEMETRY)) >= 5, 60,
                  "steps", "endless-000001")
    await c.cancel("endless-000001")
    # the scheduler appends both in one transition: the recorder may hold the first a moment before the second
    await c.until(lambda: bool(c.seen(JobCancelled, "endless-000001")) and bool(c.seen(AllocationReleased,
                                                                                     "endless-000001"))
                  and phases(c.job("endless-000001"))[-1:] == ["cancelled"],
                  60, "the cancel, the release and its record", "endless-000001")
    assert exits(c, "endless-000001", 0) == {0: STOPPED_EXIT, 1: STOPPED_EXIT}  # they obeyed StopRequested
    assert kinds(c.job("endless-000001"))[-2:] == ["JobCancelled", "AllocationReleased"]
    assert phases(c.job("endless-000001"))[-2:] == ["stopping", "cancelled"]
    await c.until(lambda: all(gone(pid) for pid in c.pids("endless-000001")), 60, "the ranks to be gone")


@pytest.mark.timeout(150)
async def test_a_restart_restores_the_newest_committed_checkpoint(cluster: Cluster) -> None:
    """With the checkpoint service committing into the agent's object store: attempt 1 loads what the
    scheduler says it resumes from, downloaded and verified by the agent."""
    c = cluster
    stop = asyncio.Event()
    checkpoints = asyncio.create_task(run_service(
        checkpoints_core(checkpoint_handlers(LocalStore(c.data / "objects"))), c.url, stop_event=stop))
    try:
        c.agent()
        await c.ready()
        spec = JobSpec(name="restore", slots=2, model=TINY.model,
                       train=TrainSpec(steps=40, checkpoint_every=10, data="synthetic"),
                       faults=[FaultSpec(kind="slow", step=0, rank=0, seconds=0.2),
                               FaultSpec(kind="crash", step=35, rank=1)])
        await c.submit(spec, "restore-000001")
        await c.until(lambda: bool(c.seen(JobCompleted, "restore-000001")), 130, "the job to complete",
                      "restore-000001")
        (resumed,) = c.seen(JobResumed, "restore-000001")
        assert resumed.attempt == 1 and resumed.from_step >= 10 and resumed.checkpoint_id
        assert resumed.checkpoint_id in {e.checkpoint_id for e in c.seen(CheckpointCommitted, "restore-000001")}
        started = [e for e in c.seen(RankStarted, "restore-000001", stream=subjects.TELEMETRY) if e.attempt == 1]
        assert sorted(e.rank for e in started) == [0, 1]
        assert {e.from_step for e in started} == {resumed.from_step}  # the agent restored what the scheduler chose
        cache = c.data / "cache" / "restore-000001"
        await c.until(lambda: not cache.exists(), 60, "the agent to evict the job's cached checkpoints")
        assert exits(c, "restore-000001", 1) == {0: 0, 1: 0}
        print("\nWorkersStarted -> RankStarted, seconds:",
              {a: round(starts(c, "restore-000001", a), 3) for a in (0, 1)})
    finally:
        stop.set()
        await checkpoints
