"""How a node agent starts ranks: its data dir's layout (Paths), the settings every rank of the node gets
(Launch), a rank's base environment, and the parent-death signal that makes a rank die with its agent.

Why it works this way: docs/internals.md, "7. The node agent and the ranks it runs".
"""

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog

from flightdeck.events import nodelocal as nl
from flightdeck.events import ranklink, subjects
from flightdeck.events.job import SlotRef
from flightdeck.events.store import EventStore
from flightdeck.events.training import FaultInjected
from flightdeck.services.agent.core import SpawnArgs
from flightdeck.services.shell.objects import manifest
from flightdeck.services.shell.security.credentials import rank_env

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


@dataclass(frozen=True)
class Paths:
    root: Path  # absolute
    snapshots: Path | None = None  # the node's snapshot root (services/agent/snapshots.py); None: ranks take none

    def spec(self, job_id: str) -> Path:
        return self.root / "jobs" / job_id / "spec.toml"

    def cache(self, job_id: str, checkpoint_id: str = "") -> Path:
        base = self.root / "cache" / job_id
        return base / checkpoint_id if checkpoint_id else base

    @property
    def staging(self) -> Path:
        return self.root / "staging"

    def log(self, job_id: str, attempt: int, rank: int) -> Path:
        return self.root / "logs" / f"{job_id}-a{attempt}-r{rank}.log"

    @property
    def standby_log(self) -> Path:
        return self.root / "logs" / "standby.log"  # what standbys print before they become ranks


@dataclass(frozen=True)
class Launch:
    """How ranks are started on this node."""

    device: str  # "cpu" or "cuda"
    grace_s: float  # SIGTERM, then this long, then SIGKILL
    python: str = sys.executable
    beats: str = ""  # the agent's heartbeat socket (services/agent/beats.py); "": ranks publish their own
    step_reports: str = "all"  # "rank0": ranks > 0 leave their steps to the agent's batches (trainer/beats.py)


def exit_msg_id(producer: str, job_id: str, attempt: int, rank: int) -> str:
    return f"{producer}:exit:{job_id}:{attempt}:{rank}"


def rank_base_env() -> dict[str, str]:
    """What every rank's environment holds besides its rendezvous variables (a standby starts with this): the
    agent's, less anything of the broker (security/credentials.rank_env)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # a rank's lines reach its log as printed
    return dict(rank_env(env))


def standby_env() -> dict[str, str]:
    """A standby's environment: a rank's base (a standby becomes a rank)."""
    return rank_base_env()


def die_with_agent(agent_pid: int) -> Callable[[], None]:
    def preexec() -> None:  # runs in the child between fork and exec
        if _LIBC is not None:
            _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != agent_pid:  # the agent died before prctl took effect
            os._exit(1)
    return preexec


def detached(producer: str, **context: Any) -> None:
    """Give a task started while an input was in hand a log context of its own: it outlives that input."""
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=producer, **context)


def rank_command(args: SpawnArgs, launch: Launch, code_dir: Path | None = None,
                 python: str | None = None) -> tuple[list[str], Path]:
    """What a rank runs, and where: the job's entrypoint, or the built-in trainer. "python" is `python` (the job's
    own, envs.py), else this node's Python (the one with torch and Flightdeck). A job that shipped its code runs in
    `code_dir` (this node's copy, codecache.py); one that did not, in its cwd on the node (relative: to the agent's
    working directory)."""
    entry = args.spec.entrypoint
    if entry is None:
        return [launch.python, "-m", "flightdeck.trainer"], Path.cwd()
    argv = list(entry.command)
    if argv[0] in ("python", "python3"):
        argv[0] = python or launch.python
    if code_dir is not None:
        return argv, code_dir
    return argv, Path.cwd() / entry.cwd if entry.cwd else Path.cwd()


def rank_env_of(args: SpawnArgs, ref: SlotRef, spec_file: Path, restore: Path | None, fired: frozenset[int], *,
                node: str, paths: Paths, launch: Launch, link: str) -> dict[str, str]:
    """A rank's whole environment (events/nodelocal.py): torchrun's variables, the job's, its restore, its link."""
    entry = args.spec.entrypoint
    env = {**rank_base_env(), **(entry.env if entry is not None else {}),
           "RANK": str(ref.rank), "WORLD_SIZE": str(args.world_size),
           # the slot is the device index: two jobs on one node never share a GPU
           "LOCAL_RANK": str(ref.slot), "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port),
           nl.JOB_ENV: args.job_id, nl.ATTEMPT_ENV: str(args.attempt), nl.NODE_ENV: node,
           nl.SPEC_ENV: str(spec_file), nl.STAGING_ENV: str(paths.staging),
           nl.CACHE_ENV: str(paths.root / "cache"), nl.DEVICE_ENV: launch.device}
    for stale in (nl.RESTORE_ENV, nl.RESTORE_ONLY_ENV, nl.MANIFEST_ENV, nl.RESTORE_SKIPS_ENV, nl.PLAN_ENV, nl.FIRED_ENV,
                  nl.EVENTS_LOG_ENV, nl.SYNC_EVERY_ENV, nl.SNAPSHOTS_ENV, nl.SNAPSHOTS_OFF_ENV):
        env.pop(stale, None)  # never inherited from the agent's own environment
    if fired:
        env[nl.FIRED_ENV] = ",".join(map(str, sorted(fired)))
    if paths.snapshots is not None and args.snapshots_off:
        env[nl.SNAPSHOTS_OFF_ENV] = args.snapshots_off[:2000]
    elif paths.snapshots is not None:
        env[nl.SNAPSHOTS_ENV] = str(paths.snapshots)
    if restore is not None:
        env[nl.RESTORE_ENV] = str(restore)
        if args.restore is not None and args.restore.model_only:
            env[nl.RESTORE_ONLY_ENV] = "model"
        if paths.snapshots is None or not restore.is_relative_to(paths.snapshots):  # a slot: its crc32s, no manifest
            env[nl.MANIFEST_ENV] = str(restore / manifest.MANIFEST)
        if args.skips:
            env[nl.RESTORE_SKIPS_ENV] = ",".join(f"{a}:{b}" for a, b in args.skips)
    if args.plan is not None and args.plan.world_size == args.world_size:  # known at start: no wait for it
        env[nl.PLAN_ENV] = msgspec.json.encode(args.plan).decode()
    if link:
        env[ranklink.LINK_ENV] = link  # the rank's only link to the platform: no broker, no secret
    if launch.beats:
        env[nl.BEATS_ENV], env[nl.STEP_REPORTS_ENV] = launch.beats, launch.step_reports
    return env


async def fired_faults(store: EventStore, args: SpawnArgs) -> frozenset[int]:
    """The spec's unpinned drill faults that an earlier attempt fired, by index (trainer/faults.py): read
    from the job's FaultInjected events, which a rank stores before it acts on the fault, so before the
    exit or finding that led to this attempt."""
    if args.attempt == 0 or all(f.attempt is not None for f in args.spec.faults):
        return frozenset()
    fired: set[int] = set()
    async for batch in store.read(subjects.TELEMETRY, [subjects.telemetry_of(args.job_id, "FaultInjected")]):
        for stored in batch:
            ev = stored.event
            if isinstance(ev, FaultInjected) and ev.attempt < args.attempt and ev.fault >= 0:
                fired.add(ev.fault)
    return frozenset(fired)
