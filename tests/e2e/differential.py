"""The differential harness: a script on the platform against the same script run alone (issue 52).

Alone is plain torchrun and the trainer API's no-platform mode: no agent, no broker, no snapshots, checkpoints in
local staging. On the platform the same spec runs as a job (snapshots on, as by default) through every service and a
node agent. The two must agree bitwise: every step's loss, the gradient norm where the script reports one, and the
final state. The final state is read back from each side's last checkpoint by DCP (the alone run's staged set, the
platform's committed one in the object store, whichever form it took there: a DCP set or snapshots persisted from
memory) and hashed item by item: parameters, optimizer state, RNG and extras."""

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from flightdeck.events import nodelocal as nl
from flightdeck.events import subjects
from flightdeck.events.checkpoint import CheckpointCommitted
from flightdeck.events.ranklink import LINK_ENV
from flightdeck.events.spec import JobSpec, parse_spec
from flightdeck.events.training import StepCompleted
from flightdeck.services.shell.objects import manifest as mf
from flightdeck.trainer import checkpointing, snapshots
from tests.integration.lifecycle_harness import Platform

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
BUILTIN = ""  # the built-in trainer (`python -m flightdeck.trainer`): no entrypoint, no folder shipped


@dataclass(frozen=True)
class Case:
    """One script and its spec: an example's folder, or the built-in trainer (`example` BUILTIN)."""

    name: str
    example: str
    spec: JobSpec
    ranks: int


@dataclass(frozen=True)
class Outcome:
    """What a run computed: each rank's (step, loss, grad norm) in step order, and its final state's item hashes."""

    steps: dict[int, list[tuple[int, float, float | None]]]
    final: dict[str, str]
    final_step: int


def example_case(example: str, steps: int, checkpoint_every: int) -> Case:
    spec = parse_spec((EXAMPLES / example / "job.toml").read_bytes())
    train = msgspec.structs.replace(spec.train, steps=steps, checkpoint_every=checkpoint_every)
    return Case(example, example, msgspec.structs.replace(spec, train=train), spec.slots)


def digest(folder: Path) -> dict[str, str]:
    """Every item of the checkpoint at `folder`, read by DCP (a set of snapshots through Flightdeck's reader), as
    sha256 of its bytes; tensors with their dtype and shape."""
    reader: dcp.StorageReader = snapshots.SnapshotReader(folder) if snapshots.is_snapshot(folder) \
        else dcp.FileSystemReader(folder)
    meta = reader.read_metadata().state_dict_metadata
    dest: dict[str, Any] = {}
    for key, md in meta.items():
        if isinstance(md, TensorStorageMetadata):
            dest[key] = torch.empty(md.size, dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            dest[key] = b""
    dcp.load(dest, storage_reader=reader, no_dist=True)
    out = {}
    for key, value in dest.items():
        if isinstance(value, torch.Tensor):
            raw = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b""
            out[key] = f"{value.dtype}{list(value.shape)}:{hashlib.sha256(raw).hexdigest()}"
        else:
            data = value if isinstance(value, bytes) else repr(value).encode()
            out[key] = hashlib.sha256(data).hexdigest()
    return out


def _without_none(value: Any) -> Any:
    """TOML has no null: a field left at None is left out (its default)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def run_alone(tmp: Path, case: Case, *, restore: Path | None = None, skips: tuple[int, int] | None = None) -> Outcome:
    """The case under plain torchrun, no platform; its events from the JSON-lines log, its last staged set. With
    `restore`, from that checkpoint, skipping the batches `skips` (a run that skips what a rollback skipped)."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec_path = tmp / "job.toml"
    spec_path.write_bytes(msgspec.toml.encode(_without_none(msgspec.to_builtins(case.spec))))
    target = ["-m", "flightdeck.trainer", "--device", "cpu"] if case.example == BUILTIN else \
        [str(EXAMPLES / case.example / "train.py")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(case.ranks), "--standalone",
           *target]
    env = {k: v for k, v in os.environ.items() if k not in (nl.JOB_ENV, LINK_ENV, nl.RESTORE_ENV)}
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", nl.SPEC_ENV: str(spec_path),
                nl.EVENTS_LOG_ENV: str(tmp / "events.jsonl"), nl.DEVICE_ENV: "cpu"})
    if restore is not None:
        env[nl.RESTORE_ENV] = str(restore)
    if skips is not None:
        env[nl.RESTORE_SKIPS_ENV] = f"{skips[0]}:{skips[1]}"
    for key, value in (case.spec.entrypoint.env.items() if case.spec.entrypoint is not None else ()):
        env[key] = value
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"{case.name} alone failed:\n{done.stderr[-4000:]}"
    rows = [json.loads(line) for line in (tmp / "events.jsonl").read_text().splitlines() if line.strip()]
    steps: dict[int, list[tuple[int, float, float | None]]] = {}
    for e in rows:
        if e["type"] == "StepCompleted":
            norm = e["grad_norm"]
            steps.setdefault(e["rank"], []).append((e["step"], float(e["loss"]),
                                                    None if norm is None else float(norm)))
    final_step = case.spec.train.steps
    return Outcome(steps, digest(tmp / ".flightdeck" / "staging" / "local" / f"step-{final_step}"), final_step)


def store_folder(p: Platform, job_id: str, checkpoint_id: str) -> Path:
    """A committed checkpoint's folder in the platform's local object store (its URL is the folder)."""
    return Path(p.objects.url) / mf.prefix(job_id, checkpoint_id)


def on_platform(p: Platform, job_id: str, case: Case) -> Outcome:
    """What the job computed: its ranks' step reports as the broker holds them, its last committed checkpoint."""
    newest: dict[tuple[int, int], StepCompleted] = {}  # a step redone (a restart, a rollback): the newest report
    for ev in p.seen(StepCompleted, job_id, stream=subjects.TELEMETRY):
        if (ev.rank, ev.step) not in newest or ev.attempt >= newest[(ev.rank, ev.step)].attempt:
            newest[(ev.rank, ev.step)] = ev  # a rank's reports arrive in its order: a later one of an attempt wins
    steps: dict[int, list[tuple[int, float, float | None]]] = {}
    for (rank, step), ev in sorted(newest.items()):
        steps.setdefault(rank, []).append((step, ev.loss, ev.grad_norm))
    last = max(p.seen(CheckpointCommitted, job_id), key=lambda c: c.step)
    folder = store_folder(p, job_id, last.checkpoint_id)
    manifest = checkpointing.manifest_in(folder)
    if manifest is not None:  # as a rank restores it: every file checked against its hash first
        checkpointing.verify(folder, checkpointing.read_manifest(manifest))
    return Outcome(steps, digest(folder), last.step)


def spliced(before: Outcome, after: Outcome, at: int) -> Outcome:
    """One run's steps before `at` and another's from `at` on (a restore at `at`), with the second one's end."""
    ranks = set(before.steps) | set(after.steps)
    steps = {r: [s for s in before.steps.get(r, []) if s[0] < at] + [s for s in after.steps.get(r, []) if s[0] >= at]
             for r in ranks}
    return Outcome(steps, after.final, after.final_step)


def differences(alone: Outcome, platform: Outcome) -> list[str]:
    """Where the two runs part, in words; none when they agree bitwise."""
    out = []
    for rank in sorted(set(alone.steps) | set(platform.steps)):
        a, b = alone.steps.get(rank, []), platform.steps.get(rank, [])
        if [s for s, _, _ in a] != [s for s, _, _ in b]:
            out.append(f"rank {rank}: steps {[s for s, _, _ in a]} alone, {[s for s, _, _ in b]} on the platform")
            continue
        for (step, la, ga), (_, lb, gb) in zip(a, b, strict=True):
            if la != lb or ga != gb:
                out.append(f"rank {rank} step {step}: loss {la!r} / grad norm {ga!r} alone, "
                           f"{lb!r} / {gb!r} on the platform")
                break
    if alone.final_step != platform.final_step:
        out.append(f"final checkpoint at step {alone.final_step} alone, {platform.final_step} on the platform")
    keys = set(alone.final) | set(platform.final)
    parted = sorted(k for k in keys if alone.final.get(k) != platform.final.get(k))
    if parted:
        out.append(f"final state parts in {len(parted)} of {len(keys)} items: {parted[:6]}")
    return out
