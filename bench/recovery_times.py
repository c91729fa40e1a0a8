"""Recovery times on CPU: how long the platform takes to notice a fault and to have the job training again, for
a crashed rank, a hung rank, a lost node and a loss spike, split into the parts the event log can tell apart.
Each run starts a fresh nats-server, every service (`python -m flightdeck.services NAME`) and the drill's node
agents, runs a 2-rank tiny job (tests/e2e/drill_harness.py: the drill policy, heartbeats every 0.5 s, lost after 4
misses, hung after 3 s, a checkpoint every 5 steps) with the fault, and reads the job's history.

    .venv/bin/python bench/recovery_times.py                      # crash, hang, lost_node, spike; 2 runs each
    .venv/bin/python bench/recovery_times.py --faults crash --runs 3 --out bench/results/cpu-recovery.json
    .venv/bin/python bench/recovery_times.py --faults crash,hang --snapshot-every 0,1 --checkpoint-every 25
    .venv/bin/python bench/recovery_times.py --faults crash --envs none,HF_HUB_OFFLINE=1,PYTHONHASHSEED=0 --runs 3

`--envs` runs each fault as an entrypoint job (`python -m flightdeck.trainer`, the built-in trainer as a user's
command) once per setting, interleaved: `none` with no `entrypoint.env`, `NAME=VALUE` with that one variable. A
variable read only after the script starts keeps the warm standbys; one that acts before it (nodelocal.acts_early)
starts ranks cold.

`--snapshot-every 0,1` runs each fault without host snapshots and with one every step (train.snapshot_every),
interleaved; every run reports `redone`: the steps rank 0 had done before the fault that the job did again (its
newest step done + 1, less the step it resumed from).

Marks (one timeline: control events when the bench's recorder received them, rank events by their own clock,
which is this machine's):
    fault       crash/hang: the rank's FaultInjected; lost_node: the bench SIGKILLs agent n2 (its rank dies with it)
    detected    the first WorkersExited (non-zero), RankLost, RankHung or NodeLost of the faulted attempt
    granted     AllocationGranted of the attempt that recovers (lost_node: the shrunk one, after NodeLost)
    spawned     its WorkersStarted (the last node's): the agent killed what was left and started the ranks
    ready       the last of its RankStarted: interpreter, imports (torch), rendezvous, model, restore
    first step  its first StepCompleted
Parts: detect = detected - fault, decide = granted - detected (the scheduler's restart decision and the grant;
for lost_node also the wasted restart on both nodes and the wait for NodeLost), spawn, startup (ready - spawned)
and first_step; recover = first step - fault. For reference, `import_s` is `python -c "import flightdeck.trainer.loop"`
alone and `restore_s` one in-process load of the checkpoint the job resumed from (after imports): the parts of
`startup` that are importing and restoring.

A loss spike is healed without a restart, so it has parts of its own: detect (the rank's FaultInjected to
LossSpikeDetected), decide (to the scheduler's RollbackRequested), obey (to the last rank's RolledBack: the
command down to the ranks through their agents, agreed at a step boundary, the checkpoint loaded) and first_step
(to the first StepCompleted after it); recover = first step - fault.
"""

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flightdeck.events import subjects  # noqa: E402
from flightdeck.events.commands import RollbackRequested  # noqa: E402
from flightdeck.events.findings import LossSpikeDetected  # noqa: E402
from flightdeck.events.fleet import NodeLost  # noqa: E402
from flightdeck.events.job import AllocationGranted, JobCompleted, JobFailed, JobResumed, WorkersExited, WorkersStarted  # noqa: E402
from flightdeck.events.spec import EntrypointSpec, FaultSpec, JobSpec  # noqa: E402
from flightdeck.events.training import FaultInjected, RankStarted, RolledBack, StepCompleted  # noqa: E402
from flightdeck.services.shell import broker  # noqa: E402
from tests.e2e.drill_harness import (  # noqa: E402
    drill_spec,
    kill_agent_mid_run,
    lost_node_spec,
    spike_spec,
    start_drill,
    start_two_nodes,
)
from tests.integration.lifecycle_harness import Platform  # noqa: E402

FAULTS = ("crash", "hang", "lost_node", "spike")
PARTS = ("detect", "decide", "spawn", "startup", "first_step")
SPIKE_PARTS = ("detect", "decide", "obey", "first_step")
DETECTIONS = ("WorkersExited", "RankLost", "RankHung", "NodeLost")
FAULT_AT = 40
PACE_S = 0.05


def spec_for(fault: str, snapshot_every: int = 1, checkpoint_every: int = 5, overhead: float = 0.02) -> JobSpec:
    if fault == "lost_node":
        spec = lost_node_spec()
    elif fault == "spike":
        spec = spike_spec()
    else:
        # Paced at ~20 steps/s in attempt 0 (a `slow` fault), so checkpoints are committed before the fault.
        pace = FaultSpec(kind="slow", step=0, rank=0, seconds=PACE_S)
        rank = 1 if fault == "crash" else 0
        spec = drill_spec(f"b{fault}", steps=80, checkpoint_every=checkpoint_every,
                          faults=[pace, FaultSpec(kind=fault, step=FAULT_AT, rank=rank)])  # type: ignore[arg-type]
    return msgspec.structs.replace(spec, train=msgspec.structs.replace(spec.train, snapshot_every=snapshot_every,
                                                                       snapshot_max_overhead=overhead))


def import_seconds() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import flightdeck.trainer.loop"], cwd=ROOT, check=True)
    return time.perf_counter() - started


def restore_seconds(spec_file: Path, checkpoint: Path) -> float:
    """One in-process load of `checkpoint` into the job's model on one rank (torch already imported)."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "import torch\n"
        "from flightdeck.events.spec import parse_spec\n"
        "from flightdeck.trainer import checkpointing, model\n"
        "from flightdeck.trainer.distributed import Dist\n"
        "from flightdeck.trainer.state import TrainState\n"
        "spec = parse_spec(Path(sys.argv[1]).read_bytes())\n"
        "m = model.build(spec.model, spec.train.seed, torch.device('cpu'))\n"
        "opt = torch.optim.AdamW(m.parameters(), lr=spec.train.lr, fused=True)\n"
        "live = TrainState(m, opt, {}, rank=0, device=torch.device('cpu'))\n"
        "t = time.perf_counter()\n"
        "checkpointing.load(Path(sys.argv[2]), live, Dist(0, 1, torch.device('cpu'), None, None))\n"
        "print(time.perf_counter() - t)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(spec_file), str(checkpoint)], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


async def keep_restore_points(p: Platform, job_id: str, into: Path) -> None:
    """Copy each checkpoint a JobResumed names out of agent n1's cache as soon as it is there: the agent evicts
    its copies when the job ends, and retention deletes them from the store."""
    kept: set[str] = set()
    while True:
        for ev in p.seen(JobResumed, job_id):
            src = p.data / "cache" / job_id / ev.checkpoint_id
            if ev.checkpoint_id and ev.checkpoint_id not in kept and (src / ".metadata").exists():
                await asyncio.to_thread(shutil.copytree, src, into / ev.checkpoint_id)
                await asyncio.to_thread(shutil.copy, p.data / "jobs" / job_id / "spec.toml", into / "spec.toml")
                kept.add(ev.checkpoint_id)
        await asyncio.sleep(0.05)


def arrival(p: Platform, kind: type, job_id: str, pick: Any = lambda e: True) -> float:
    return next(s.at for s in p.control if isinstance(s.stored.event, kind)
                and subjects.job_of(s.stored.subject) == job_id and pick(s.stored.event))


def as_entrypoint(spec: JobSpec, setting: str) -> JobSpec:
    """`spec` run as a user's command would be: the built-in trainer named in [entrypoint], with `setting`
    ("NAME=VALUE", or "none") as its only `entrypoint.env`."""
    env = dict([setting.split("=", 1)]) if setting != "none" else {}
    entry = EntrypointSpec(command=["python", "-m", "flightdeck.trainer"], cwd=str(ROOT), env=env)
    return msgspec.structs.replace(spec, entrypoint=entry)


async def one_run(fault: str, n: int, standby: int | None = None, snapshot_every: int = 1,
                  checkpoint_every: int = 5, overhead: float = 0.02, env: str = "") -> dict[str, float]:
    spec = spec_for(fault, snapshot_every, checkpoint_every, overhead)
    if env:
        spec = as_entrypoint(spec, env)
    job = f"{spec.name}-{n:06x}"
    offset = time.time() - time.monotonic()  # rank clocks (wall) onto the bench's monotonic timeline
    with tempfile.TemporaryDirectory(prefix="fd-recovery-") as tmp:
        root = Path(tmp)
        b = broker.start(root / "nats")
        p = await start_drill(b.url, root)
        try:
            extra = ("--standby", str(standby)) if standby is not None else ()
            if fault == "lost_node":
                await start_two_nodes(p, *extra)
            else:
                p.agent("n1", "--grace-s", "2", *extra)
                await p.ready("n1", within=120)
            await p.submit(spec, job)
            keeper = asyncio.create_task(keep_restore_points(p, job, root / "kept"))
            killed = await kill_agent_mid_run(p, job) if fault == "lost_node" else 0.0
            await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 240, "the job to end", job)
            keeper.cancel()
            assert p.seen(JobCompleted, job), f"{fault}: the job did not complete"
            if fault == "spike":
                return spike_marks(p, job, offset)
            final = p.seen(JobResumed, job)[-1]
            a = final.attempt
            if fault == "lost_node":
                t_fault = killed
            else:
                (inj,) = [e for e in p.seen(FaultInjected, job, stream=subjects.TELEMETRY) if e.kind == fault]
                t_fault = inj.occurred_at - offset
            t_detect = min(s.at for s in p.control if subjects.job_of(s.stored.subject) in (job, None)
                           and type(s.stored.event).__name__ in DETECTIONS and s.at >= t_fault
                           and (not isinstance(s.stored.event, WorkersExited) or s.stored.event.exit_code != 0))
            t_granted = arrival(p, AllocationGranted, job, lambda e: e.attempt == a)
            t_spawned = max(s.at for s in p.control if isinstance(s.stored.event, WorkersStarted)
                            and s.stored.event.job_id == job and s.stored.event.attempt == a)
            tel = [e for e in p.seen(RankStarted, job, stream=subjects.TELEMETRY) if e.attempt == a]
            t_ready = max(e.occurred_at for e in tel) - offset
            t_first = min(e.occurred_at for e in p.seen(StepCompleted, job, stream=subjects.TELEMETRY)
                          if e.attempt == a) - offset
            marks = [t_fault, t_detect, t_granted, t_spawned, t_ready, t_first]
            out = {part: marks[i + 1] - marks[i] for i, part in enumerate(PARTS)}
            out["recover"] = t_first - t_fault
            if fault == "lost_node":
                out["node_lost"] = next(s.at for s in p.control if isinstance(s.stored.event, NodeLost)) - t_fault
            out["resumed_from_step"] = float(final.from_step)
            # steps done before the fault (rank 0's, in any attempt before the final one) that are done again
            done = max((e.step for e in p.seen(StepCompleted, job, stream=subjects.TELEMETRY)
                        if e.rank == 0 and e.attempt < a), default=-1)
            out["redone"] = float(max(done + 1 - final.from_step, 0))
            out["from_memory"] = float(all(e.restored_from == "memory" for e in tel))
            kept = root / "kept" / final.checkpoint_id
            out["restore_s"] = restore_seconds(root / "kept" / "spec.toml", kept) \
                if final.checkpoint_id and kept.exists() else 0.0  # a restore from memory: no copy to time
        finally:
            await p.close()
            b.stop()
    out["import_s"] = import_seconds()
    return out


def spike_marks(p: Platform, job: str, offset: float) -> dict[str, float]:
    """The spike's parts, from the first rollback the spike caused (the rank clocks put on the bench's timeline)."""
    (inj,) = [e for e in p.seen(FaultInjected, job, stream=subjects.TELEMETRY) if e.kind == "loss_spike"]
    t_fault = inj.occurred_at - offset
    t_detect = arrival(p, LossSpikeDetected, job)
    rollback = p.seen(RollbackRequested, job)[0]
    t_decide = arrival(p, RollbackRequested, job, lambda e: e.event_id == rollback.event_id)
    landed = [e for e in p.seen(RolledBack, job, stream=subjects.TELEMETRY)
              if e.checkpoint_id == rollback.checkpoint_id]
    t_obeyed = max(e.occurred_at for e in landed) - offset
    t_first = min(e.occurred_at for e in p.seen(StepCompleted, job, stream=subjects.TELEMETRY)
                  if e.occurred_at - offset > t_obeyed) - offset
    marks = [t_fault, t_detect, t_decide, t_obeyed, t_first]
    out = {part: marks[i + 1] - marks[i] for i, part in enumerate(SPIKE_PARTS)}
    out["recover"] = t_first - t_fault
    out["import_s"] = import_seconds()
    return out


async def bench(faults: list[str], runs: int, standby: int | None = None, snapshots: tuple[int, ...] = (1,),
                checkpoint_every: int = 5, overhead: float = 0.02,
                envs: tuple[str, ...] = ("",)) -> dict[str, list[dict[str, float]]]:
    def label(fault: str, every: int, env: str) -> str:
        return (fault if len(snapshots) == 1 else f"{fault}/snap{every}") + (f"/{env}" if env else "")

    results: dict[str, list[dict[str, float]]] = {label(f, s, e): [] for f in faults for s in snapshots for e in envs}
    for n in range(1, runs + 1):  # interleaved, so a busy spell of the box does not land on one fault only
        for fault in faults:
            for every, env in ((s, e) for s in snapshots for e in envs):
                key = label(fault, every, env)
                results[key].append(await one_run(fault, n, standby, every, checkpoint_every, overhead, env))
                print(f"{key} run {n}: " + json.dumps({k: round(v, 3) for k, v in results[key][-1].items()}),
                      flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--out", type=Path, default=None, help="write the runs and medians here as JSON")
    ap.add_argument("--standby", type=int, default=None,
                    help="warm standby ranks per agent (default: the agent's, one per slot)")
    ap.add_argument("--snapshot-every", default="1",
                    help="comma-separated train.snapshot_every values to run each fault with (0: none)")
    ap.add_argument("--checkpoint-every", type=int, default=5, help="train.checkpoint_every of the crash and hang jobs")
    ap.add_argument("--snapshot-max-overhead", type=float, default=0.02, help="train.snapshot_max_overhead (1: no cap)")
    ap.add_argument("--envs", default="", help="comma-separated entrypoint.env settings to run each fault with, as "
                    "an entrypoint job: 'none' or NAME=VALUE")
    args = ap.parse_args()
    snapshots = tuple(int(s) for s in args.snapshot_every.split(",") if s.strip())
    faults = [f for f in args.faults.split(",") if f]
    if args.runs < 1 or not faults or set(faults) - set(FAULTS):
        ap.error(f"--runs must be at least 1 and --faults a list of {', '.join(FAULTS)}")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    envs = tuple(e for e in args.envs.split(",") if e) or ("",)
    if any(e != "none" and "=" not in e for e in envs if e):
        ap.error("--envs takes 'none' or NAME=VALUE settings, comma-separated")
    results = asyncio.run(bench(faults, args.runs, args.standby, snapshots, args.checkpoint_every,
                                args.snapshot_max_overhead, envs))
    median = {f: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for f, rs in results.items()}
    report = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform()},
              "policy": {"heartbeat_interval_s": 0.5, "heartbeat_misses": 4, "hang_min_s": 3.0,
                         "checkpoint_every": args.checkpoint_every, "snapshot_every": list(snapshots),
                         "snapshot_max_overhead": args.snapshot_max_overhead, "envs": list(envs),
                         "health_tick_s": 0.5, "agent_grace_s": 2.0},
              "runs": results, "median": median}
    printed: set[str] = set()
    for names in ((*PARTS, "recover", "redone"), (*PARTS, "recover"), (*SPIKE_PARTS, "recover")):
        keys = list(names)
        shown = {f: m for f, m in median.items() if all(k in m for k in keys) and f not in printed}
        printed |= set(shown)
        if shown:
            print("median seconds " + " ".join(f"{k:>10}" for k in keys))
        for f, m in shown.items():
            print(f"{f:<14} " + " ".join(f"{m[k]:10.3f}" for k in keys))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
