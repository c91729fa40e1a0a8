"""What one rank is told to do: command-line flags plus the torchrun environment, read once into a RunConfig."""

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from events.spec import JobSpec, parse_spec


@dataclass(frozen=True)
class RunConfig:
    job_id: str
    spec: JobSpec
    attempt: int
    node: str
    nats_url: str | None  # None: telemetry and commands off
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer", description="Run one training rank.")
    p.add_argument("--job-id", required=True)
    p.add_argument("--spec", required=True, type=Path, help="TOML job spec")
    p.add_argument("--attempt", type=int, default=None,
                   help="the job's attempt (default: torchrun's TORCHELASTIC_RESTART_COUNT, else 0)")
    p.add_argument("--node", default=socket.gethostname())
    p.add_argument("--nats", default=None, help="broker URL; absent: telemetry off")
    p.add_argument("--staging", type=Path, default=Path(".flightdeck/staging"))
    p.add_argument("--restore", type=Path, default=None, help="checkpoint directory to load first")
    p.add_argument("--manifest", type=Path, default=None,
                   help="JSON {'shards': [{path, size, sha256}]} to verify --restore against "
                        "(default: <restore>/MANIFEST.json when it exists)")
    p.add_argument("--checkpoints", type=Path, default=None,
                   help="the node's cache of committed checkpoints (<dir>/<job>/<checkpoint_id>/), for rollbacks")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--events-log", type=Path, default=None)
    return p


def from_args(argv: list[str] | None = None, env: dict[str, str] | None = None) -> RunConfig:
    args = parser().parse_args(argv)
    env = dict(os.environ) if env is None else env
    spec = parse_spec(args.spec.read_bytes())
    if args.sync_every < 1:
        raise ValueError(f"--sync-every must be at least 1, got {args.sync_every}")
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    manifest = args.manifest
    if manifest is None and args.restore is not None:
        manifest = next((args.restore / n for n in ("MANIFEST.json", "manifest.json")
                         if (args.restore / n).exists()), None)
    # Under plain torchrun a restart re-runs the same command line: its restart count is the attempt.
    attempt = args.attempt if args.attempt is not None else int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return RunConfig(
        job_id=args.job_id, spec=spec, attempt=attempt, node=args.node, nats_url=args.nats,
        staging=args.staging, restore=args.restore, manifest=manifest, checkpoints=args.checkpoints,
        rank=int(env.get("RANK", "0")), world_size=int(env.get("WORLD_SIZE", "1")),
        local_rank=int(env.get("LOCAL_RANK", "0")), device=device, sync_every=args.sync_every,
        events_log=args.events_log,
    )
