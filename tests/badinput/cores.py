"""Every service core the platform runs, each with a realistic history behind it, for fuzzing the fold.

The prefix is a real run of the scheduler and resources cores over one node and one two-rank job
(`hostile.JOB` on `hostile.NODE`), with workers started, telemetry and a committed checkpoint, so a
hostile input meets a core with a job in flight rather than an empty one.
"""

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from flightdeck.events import subjects
from flightdeck.events.base import Event
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointStaged, DataPosition, ShardInfo
from flightdeck.events.clock import ClockTick
from flightdeck.events.job import JobSubmitted
from flightdeck.events.store import Stored, decoded
from flightdeck.events.training import Heartbeat, RankStarted, StepCompleted
from flightdeck.services.agent.core import EFFECTS as AGENT_EFFECTS
from flightdeck.services.agent.core import core_service as agent
from flightdeck.services.checkpoints.core import core_service as checkpoints
from flightdeck.services.core import Emit, Service
from flightdeck.services.health.core import core_service as health
from flightdeck.services.resharder.core import core_service as resharder
from flightdeck.services.resources.core import core_service as resources
from flightdeck.services.scheduler.core import core_service as scheduler
from flightdeck.services.shell.fold import Folder
from tests.badinput.hostile import JOB, NODE
from tests.badinput.hostile import subject_for as subject_for
from tests.unit.helpers import Agents, Bus, register, submit


async def _never_run(args: object) -> list[Emit]:
    raise AssertionError("a fold never runs effects; the shell does")


def services() -> dict[str, Callable[[], Service[Any]]]:
    return {
        "scheduler": scheduler,
        "health": lambda: health(tick_s=0.5),
        "resources": resources,
        "resharder": resharder,
        "checkpoints": lambda: checkpoints({"commit": _never_run, "delete": _never_run, "scrub": _never_run}),
        "agent": lambda: agent(NODE, dict.fromkeys(AGENT_EFFECTS, _never_run)),
    }


def _prefix() -> list[Event]:
    """A running two-rank job with a commit: the control log of scheduler + resources, plus telemetry."""
    bus = Bus([scheduler(), resources()])
    agents = Agents(bus)
    bus.publish(register(NODE, 2))
    bus.publish(submit(JOB, slots=2, steps=1000))
    agents()
    grant = bus.last_grant(JOB)
    env = {"job_id": JOB, "attempt": grant.attempt, "node": NODE, "occurred_at": 2000.0}
    tel: list[Event] = []
    for r in (0, 1):
        tel += [RankStarted(rank=r, world_size=2, from_step=0, device="cpu", event_id=f"rs{r}", **env),
                StepCompleted(rank=r, step=10, loss=2.0, grad_norm=1.0, lr=1e-3, tokens_per_s=1.0, step_time_s=0.1,
                              event_id=f"sc{r}", **env),
                Heartbeat(rank=r, step=10, interval_s=1.0, event_id=f"hb{r}", **env),
                CheckpointStaged(rank=r, step=10, world_size=2, staging_dir="/tmp/staging", event_id=f"cs{r}",
                                 shards=[ShardInfo(path=f"r{r}.distcp", size=1, sha256="0" * 64)],
                                 data=DataPosition(next_batch=11), stall_s=0.0, write_s=0.0, **env)]
    commit = CheckpointCommitted(job_id=JOB, checkpoint_id="step000000010-a0", step=10, world_size=2,
                                 uri="file:///x/MANIFEST.json", bytes=2, data=DataPosition(next_batch=11),
                                 event_id="cc", occurred_at=2001.0, job_version=bus.versions[JOB] + 1)
    return [*bus.log, *tel, commit]


PREFIX = _prefix()


def stored(event: Event, seq: int, subject: str | None = None) -> Stored:
    from flightdeck.events.codec import encode

    subj = subject or subject_for(event)
    return decoded(subjects.stream_of(subj) if subj.startswith("fd.") else subjects.CONTROL, seq, subj,
                   encode(event), event.event_id)


def primed(name: str) -> Folder[Any]:
    """A folder of service `name` that has folded the prefix (telemetry folded directly, as a tick would)."""
    folder = Folder(services()[name]())
    for seq, ev in enumerate(PREFIX, start=1):
        s = stored(ev, seq)
        filters = (*folder.service.control_subjects, *folder.service.telemetry_subjects)
        if any(subjects.matches(f, s.subject) for f in filters):
            step = folder._fold(s)
            assert not step.error, (name, ev, step.error)
    folder.control_seq = len(PREFIX)
    return folder


def good_inputs(seq: int) -> list[Stored]:
    """Inputs every service reads something of, to show it still works after a hostile one."""
    return [stored(msgspec.structs.replace(submit(f"ok-{seq}", slots=1), job_version=1), seq),
            stored(ClockTick(service="x", now=3000.0, positions={}, event_id=f"t{seq}", occurred_at=3000.0), seq + 1)]


class TooSlow(Exception):
    pass


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Fail an input that keeps a core busy for `seconds` (a core that loops over a hostile count)."""
    def expire(signum: int, frame: object) -> None:
        raise TooSlow(f"a single input kept the core busy for over {seconds}s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


__all__ = ["JobSubmitted", "good_inputs", "primed", "services", "stored", "time_limit"]
