"""What one rank is told to do, read once into a RunConfig: the variables the node agent sets
(events/nodelocal.py) plus torchrun's. Without a job id a script runs in no-platform mode: job "local",
telemetry off (or to $FLIGHTDECK_EVENTS_LOG), checkpoints under .flightdeck/staging/local/, and a torchrun
restart resumes from the newest one there."""

import argparse
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec

from flightdeck.events import nodelocal as nl
from flightdeck.events import ranklink
from flightdeck.events.plan import ParallelPlan
from flightdeck.events.snapshot import SNAPSHOTS_ENV, SNAPSHOTS_OFF_ENV
from flightdeck.events.spec import JobSpec, check, parse_spec

LOCAL_JOB = "local"


@dataclass(frozen=True)
class RunConfig:
    job_id: str
    spec: JobSpec
    attempt: int
    node: str
    agent: str | None  # the node agent's link (events/ranklink.py); None: telemetry and commands off
    staging: Path  # checkpoints go to <staging>/<job_id>/step-<N>/
    restore: Path | None  # a checkpoint directory to load before the first step
    manifest: Path | None  # JSON with the shards' sha256s, checked before loading `restore`
    rank: int
    world_size: int
    local_rank: int
    device: str  # "cpu" or "cuda"
    sync_every: int  # steps between the collectives that agree on commands and SIGTERM
    events_log: Path | None  # every emitted event also appended here as a JSON line
    checkpoints: Path | None = None  # the node's cache of committed checkpoints: <dir>/<job>/<checkpoint_id>/
    plan: ParallelPlan | None = None  # None: plain data parallel over the world
    fired: frozenset[int] = frozenset()  # the spec's unpinned drill faults an earlier attempt fired (trainer/faults.py)
    platform: bool = True  # started by a node agent (a job id was given)
    resume_local: bool = False  # no-platform mode after a torchrun restart: resume from the newest staged set
    restore_skips: tuple[tuple[int, int], ...] = ()  # batch windows to skip beyond what `restore` recorded
    restore_model_only: bool = False  # `restore` is another job's: its weights only, from step 0 (init_from)
    snapshots: Path | None = None  # the node's snapshot root (events/snapshot.py); None: no host snapshots
    snapshots_off: str = ""  # why none: its node's snapshot memory has no room for them (AllocationGranted)


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {raw!r}") from None


def from_env(env: Mapping[str, str] | None = None) -> RunConfig:
    env = os.environ if env is None else env
    job_id = env.get(nl.JOB_ENV, "")
    world_size = _int(env, "WORLD_SIZE", 1)
    spec_path = env.get(nl.SPEC_ENV, "")
    spec = parse_spec(Path(spec_path).read_bytes()) if spec_path else check(JobSpec(name="local", slots=world_size))
    sync_every = _int(env, nl.SYNC_EVERY_ENV, 10)
    if sync_every < 1:
        raise ValueError(f"${nl.SYNC_EVERY_ENV} must be at least 1, got {sync_every}")
    device = env.get(nl.DEVICE_ENV, "") or "auto"
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"${nl.DEVICE_ENV} must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    restore = Path(env[nl.RESTORE_ENV]) if env.get(nl.RESTORE_ENV) else None
    try:
        skips = tuple((int(a), int(b)) for a, b in (w.split(":") for w in env.get(nl.RESTORE_SKIPS_ENV, "").split(",")
                                                    if w.strip()))
    except ValueError:
        raise ValueError(f"${nl.RESTORE_SKIPS_ENV} must list batch windows like 40:45,50:60, "
                         f"got {env[nl.RESTORE_SKIPS_ENV]!r}") from None
    manifest = Path(env[nl.MANIFEST_ENV]) if env.get(nl.MANIFEST_ENV) else None
    if manifest is None and restore is not None:
        manifest = next((restore / n for n in ("MANIFEST.json", "manifest.json") if (restore / n).exists()), None)
    plan = None
    if raw := env.get(nl.PLAN_ENV, ""):
        try:
            plan = msgspec.json.decode(raw, type=ParallelPlan)
        except msgspec.DecodeError as exc:
            raise ValueError(f"${nl.PLAN_ENV} is not a parallel plan: {exc}") from None
    try:
        fired = frozenset(int(i) for i in env.get(nl.FIRED_ENV, "").split(",") if i.strip())
    except ValueError:
        raise ValueError(f"${nl.FIRED_ENV} must list fault indices like 0,3, got {env[nl.FIRED_ENV]!r}") from None
    restarts = _int(env, "TORCHELASTIC_RESTART_COUNT", 0)
    # Under plain torchrun a restart re-runs the same command line: its restart count is the attempt.
    attempt = _int(env, nl.ATTEMPT_ENV, restarts)
    if not job_id and attempt > 0:  # no agent to say which unpinned faults fired: they had their first run
        fired = frozenset(i for i, f in enumerate(spec.faults) if f.attempt is None)
    return RunConfig(
        job_id=job_id or LOCAL_JOB, spec=spec, attempt=attempt, node=env.get(nl.NODE_ENV, "") or socket.gethostname(),
        agent=env.get(ranklink.LINK_ENV) or None if job_id else None,
        staging=Path(env.get(nl.STAGING_ENV, "") or ".flightdeck/staging"), restore=restore, manifest=manifest,
        restore_skips=skips, restore_model_only=env.get(nl.RESTORE_ONLY_ENV, "") == "model" and restore is not None,
        checkpoints=Path(env[nl.CACHE_ENV]) if env.get(nl.CACHE_ENV) else None,
        rank=_int(env, "RANK", 0), world_size=world_size, local_rank=_int(env, "LOCAL_RANK", 0), device=device,
        sync_every=sync_every, events_log=Path(env[nl.EVENTS_LOG_ENV]) if env.get(nl.EVENTS_LOG_ENV) else None,
        plan=plan, fired=fired, platform=bool(job_id), resume_local=not job_id and restore is None and restarts > 0,
        snapshots=Path(env[SNAPSHOTS_ENV]) if env.get(SNAPSHOTS_ENV) and job_id else None,
        snapshots_off=env.get(SNAPSHOTS_OFF_ENV, "") if job_id else "",
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m flightdeck.trainer",
        description="Run one rank of the built-in trainer. The node agent sets these through the environment "
                    "(events/nodelocal.py); the flags are for running it by hand, and override the environment.")
    p.add_argument("--job-id")
    p.add_argument("--spec", type=Path, help="TOML job spec")
    p.add_argument("--attempt", type=int, help="the job's attempt (default: torchrun's TORCHELASTIC_RESTART_COUNT)")
    p.add_argument("--node")
    p.add_argument("--agent", help="the node agent's link socket (@name or a path); absent: telemetry off")
    p.add_argument("--staging", type=Path)
    p.add_argument("--restore", type=Path, help="checkpoint directory to load first")
    p.add_argument("--manifest", type=Path, help="JSON {'shards': [{path, size, sha256}]} to verify --restore "
                                                 "against (default: <restore>/MANIFEST.json when it exists)")
    p.add_argument("--checkpoints", type=Path,
                   help="the node's cache of committed checkpoints (<dir>/<job>/<checkpoint_id>/), for rollbacks")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--sync-every", type=int)
    p.add_argument("--events-log", type=Path)
    return p


FLAG_ENV = {"job_id": nl.JOB_ENV, "spec": nl.SPEC_ENV, "attempt": nl.ATTEMPT_ENV, "node": nl.NODE_ENV,
            "agent": ranklink.LINK_ENV, "staging": nl.STAGING_ENV, "restore": nl.RESTORE_ENV,
            "manifest": nl.MANIFEST_ENV,
            "checkpoints": nl.CACHE_ENV, "device": nl.DEVICE_ENV, "sync_every": nl.SYNC_EVERY_ENV,
            "events_log": nl.EVENTS_LOG_ENV}


def flags_to_env(argv: list[str] | None, env: dict[str, str] | os._Environ[str]) -> None:
    """Put `python -m flightdeck.trainer`'s flags into `env`, where the trainer API reads them."""
    args = parser().parse_args(argv)
    for name, var in FLAG_ENV.items():
        value = getattr(args, name)
        if value is not None:
            env[var] = str(value)
    if args.agent is None and args.job_id is not None:
        env.pop(ranklink.LINK_ENV, None)  # a job id without --agent: telemetry off, as the flags always meant
