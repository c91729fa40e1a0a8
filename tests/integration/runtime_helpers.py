"""What the runtime tests share: a store on a real broker, inputs, waiting, and the exactly-once check."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.js.client import JetStreamContext

from flightdeck.events import subjects
from flightdeck.events.fleet import NodeHeartbeat
from flightdeck.events.jetstream import JetStreamStore
from flightdeck.events.job import JobQueued, JobSubmitted
from flightdeck.events.spec import JobSpec
from flightdeck.events.store import Stored

ROOT = Path(__file__).resolve().parents[2]
SPEC = JobSpec(name="toy")


@dataclass
class Bus:
    """A test's own client of the broker: raw connection, JetStream context and the event store."""

    nc: Client
    js: JetStreamContext
    store: JetStreamStore


@asynccontextmanager
async def bus_at(url: str, **options: Any) -> AsyncIterator[Bus]:
    store = await JetStreamStore.connect(url, name="runtime-test", **options)
    try:
        yield Bus(store.nc, store.js, store)
    finally:
        await store.close()


def submissions(n: int, prefix: str = "j") -> list[tuple[str, JobSubmitted]]:
    """`n` new jobs, each the first event (version 1) of its own history."""
    return [(subjects.job(f"{prefix}{i}", "JobSubmitted"),
             JobSubmitted(job_id=f"{prefix}{i}", job_version=1, spec=SPEC, event_id=f"cli-{prefix}{i}",
                          occurred_at=1000.0 + i, producer="cli"))
            for i in range(n)]


async def read_all(store: JetStreamStore, stream: str, patterns: tuple[str, ...] = ()) -> list[Stored]:
    return [s async for batch in store.read(stream, patterns) for s in batch]


async def eventually(check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.1)


async def count(store: JetStreamStore, pattern: str) -> int:
    return len(await read_all(store, subjects.CONTROL, (pattern,)))


def assert_exactly_once(control: list[Stored], inputs: list[tuple[str, JobSubmitted]]) -> None:
    """Every input answered once: one JobQueued each (numbered 1..n, each number once: no input folded
    twice into state), one NodeHeartbeat per tenth job, and every job's history contiguous."""
    ids = {ev.event_id for _, ev in inputs}
    queued = [s.event for s in control if isinstance(s.event, JobQueued)]
    causes = Counter(e.causation_id for e in queued)
    assert set(causes) == ids and max(causes.values()) == 1, causes.most_common(3)
    assert sorted(e.priority for e in queued) == list(range(1, len(inputs) + 1))
    beats = [s.event for s in control if isinstance(s.event, NodeHeartbeat) and s.event.node == "toy-node"]
    assert len(beats) == len(inputs) // 10 and len({b.causation_id for b in beats}) == len(beats)
    versions: dict[str, list[int]] = {}
    for s in control:
        if s.subject.startswith("fd.ctl.job."):
            assert s.event is not None
            versions.setdefault(subjects.job_of(s.subject) or "", []).append(getattr(s.event, "job_version", 0))
    assert all(v == [1, 2] for v in versions.values()), {k: v for k, v in versions.items() if v != [1, 2]}


def spawn_service(name: str, url: str, log_path: Path, **env_extra: str) -> subprocess.Popen[bytes]:
    """`python -m flightdeck.services NAME` as its own process, the toy services registered through the environment."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tests' / 'integration'}{os.pathsep}{ROOT}",
           "FLIGHTDECK_EXTRA_SERVICES": "toy=toy_service:build,toytel=toy_service:build_telemetry", **env_extra}
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "flightdeck.services", name, "--nats", url], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


async def answered(bus: Bus, job: str) -> bool:
    return await bus.store.last(subjects.CONTROL, subjects.job(job, "JobQueued")) is not None


async def kill_mid_stream_and_restart(bus: Bus, url: str, log: Path, inputs: list[tuple[str, JobSubmitted]], *,
                                      kill_after: str, before_kill: Callable[[], Awaitable[object]] | None = None,
                                      **env: str) -> None:
    """The toy service answers `inputs`, is SIGKILLed once `kill_after` is answered (and `before_kill` holds),
    comes back, answers the rest and stops cleanly; every input must be answered exactly once."""
    last = inputs[-1][1].job_id
    proc = spawn_service("toy", url, log, **env)
    try:
        await bus.store.append_batch(inputs)
        await eventually(lambda: answered(bus, kill_after), 40, "some answers")
        if before_kill is not None:
            await eventually(before_kill, 20, "what must be there before the kill")  # type: ignore[arg-type]
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        assert not await answered(bus, last), "the kill came too late to test anything"
        proc = spawn_service("toy", url, log, **env)
        await eventually(lambda: answered(bus, last), 40, "the last answer after the restart")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, tail(log)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_exactly_once(await read_all(bus.store, subjects.CONTROL), inputs)


def tail(log: Path) -> str:
    return log.read_text()[-3000:]
