"""The same crash of the same training script under plain torchrun and under Flightdeck: seconds from the crash to
the first training step after the restart, and their ratio (goal: Flightdeck no slower than torchrun).

    .venv/bin/python bench/vs_torchrun.py                         # 2 runs each, interleaved
    .venv/bin/python bench/vs_torchrun.py --runs 3 --out bench/results/cpu-vs-torchrun.json

The script is `python -m trainer` (2 CPU ranks, gloo, the tiny model of the drills) with a drill fault: rank 1
crashes at step 40 of attempt 0 only; attempt 0 is paced at ~20 steps/s so checkpoints exist before the crash.
    torchrun    `torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m trainer --spec S ...` (defaults:
                --monitor-interval 0.1 s), with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without which the restart
                fails here. On a worker failure it kills the whole group and starts every rank again; the
                trainer reads the restart count from TORCHELASTIC_RESTART_COUNT. It has no notion of a committed
                checkpoint, so the restart begins at step 0. Events go to a JSON-lines file (--events-log), no
                broker: no telemetry publishing in its ranks.
    flightdeck  every service and one node agent (2 CPU slots) on a fresh nats-server, the drill policy
                (tests/e2e/drill_harness.py); the agent records the exit, the scheduler restarts the job, the
                agent starts both ranks again, which restore the newest committed checkpoint.
Both: crash = the crashing rank's FaultInjected, first step = the earliest StepCompleted of attempt 1, each by
the rank's own clock (one machine). Parts: `to_spawn` from the crash to the restarted ranks' spawn (Flightdeck:
WorkersStarted; torchrun: its INFO log's second "Starting worker group"), `startup` from there to their last
RankStarted (interpreter, imports, rendezvous, model, restore), `first_step` from there to the first step.
"""

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog
import tomli_w

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from events import subjects  # noqa: E402
from events.job import JobCompleted, JobFailed, WorkersStarted  # noqa: E402
from events.spec import FaultSpec, JobSpec  # noqa: E402
from events.training import FaultInjected, RankStarted, StepCompleted  # noqa: E402
from services import broker  # noqa: E402
from tests.e2e.drill_harness import drill_spec, start_drill  # noqa: E402

CRASH_AT = 40
PACE_S = 0.05
TORCHRUN = Path(sys.executable).parent / "torchrun"


def spec() -> JobSpec:
    return drill_spec("vs", steps=80, faults=[FaultSpec(kind="slow", step=0, rank=0, seconds=PACE_S),
                                             FaultSpec(kind="crash", step=CRASH_AT, rank=1)])


def torchrun_once(n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="fd-torchrun-") as tmp:
        root = Path(tmp)
        spec_file = root / "spec.toml"
        spec_file.write_text(tomli_w.dumps(msgspec.to_builtins(spec())))
        events = root / "events.jsonl"
        # --standalone: c10d rendezvous on a free port. Its store is shared with the ranks' init_process_group by
        # default, and the restarted round then read the first round's gloo addresses and failed to connect
        # ("connectFullMesh ... Connection refused"; pytorch/pytorch#135712): TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
        # is the documented way out. A static --master-port failed the same way.
        cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
               "-m", "trainer", "--job-id", f"vs-torchrun-{n}",
               "--spec", str(spec_file), "--staging", str(root / "staging"), "--device", "cpu",
               "--events-log", str(events)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),  # OMP: as the node agent sets it
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "LOGLEVEL": "INFO"}  # INFO: when it starts a group
        with open(root / "torchrun.log", "wb") as log:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun exited {proc.returncode}:\n{(root / 'torchrun.log').read_text()[-3000:]}")
        rows = [json.loads(line) for line in events.read_bytes().splitlines()]
        spawned = group_starts((root / "torchrun.log").read_text())[1]
    crash = next(r["occurred_at"] for r in rows if r["type"] == "FaultInjected" and r["kind"] == "crash")
    ready = max(r["occurred_at"] for r in rows if r["type"] == "RankStarted" and r["attempt"] == 1)
    first = min(r["occurred_at"] for r in rows if r["type"] == "StepCompleted" and r["attempt"] == 1)
    first_step = min(r["step"] for r in rows if r["type"] == "StepCompleted" and r["attempt"] == 1)
    return {"recover": first - crash, "to_spawn": spawned - crash, "startup": ready - spawned,
            "first_step": first - ready, "resumed_from_step": float(first_step)}


def group_starts(log: str) -> list[float]:
    """When torchrun's agent started each worker group, from its INFO log ("I1122 20:53:08.016000 ... [default]
    Starting worker group"; local time, this year)."""
    year = time.localtime().tm_year
    out = []
    for m in re.finditer(r"^I(\d{4}) (\d\d:\d\d:\d\d)(\.\d+) .*\[default\] Starting worker group", log, re.M):
        stamp = time.mktime(time.strptime(f"{year}{m[1]} {m[2]}", "%Y%m%d %H:%M:%S"))
        out.append(stamp + float(m[3]))
    return out


async def flightdeck_once(n: int) -> dict[str, float]:
    job = f"vs-{n:06x}"
    with tempfile.TemporaryDirectory(prefix="fd-vs-") as tmp:
        root = Path(tmp)
        b = broker.start(root / "nats")
        p = await start_drill(b.url, root)
        try:
            p.agent("n1", "--grace-s", "2")
            await p.ready("n1", within=120)
            await p.submit(spec(), job)
            await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 240, "the job to end", job)
            assert p.seen(JobCompleted, job), "the job did not complete"
            tel = subjects.TELEMETRY
            (crash,) = [e.occurred_at for e in p.seen(FaultInjected, job, stream=tel) if e.kind == "crash"]
            spawned = max(e.occurred_at for e in p.seen(WorkersStarted, job) if e.attempt == 1)
            ready = max(e.occurred_at for e in p.seen(RankStarted, job, stream=tel) if e.attempt == 1)
            steps = [e for e in p.seen(StepCompleted, job, stream=tel) if e.attempt == 1]
            first = min(e.occurred_at for e in steps)
            return {"recover": first - crash, "to_spawn": spawned - crash, "startup": ready - spawned,
                    "first_step": first - ready, "resumed_from_step": float(min(e.step for e in steps))}
        finally:
            await p.close()
            b.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the runs, medians and ratio here as JSON")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    runs: dict[str, list[dict[str, float]]] = {"torchrun": [], "flightdeck": []}
    for n in range(1, args.runs + 1):  # interleaved, so a busy spell of the box does not favour one side
        runs["torchrun"].append(torchrun_once(n))
        print(f"torchrun run {n}: {json.dumps({k: round(v, 3) for k, v in runs['torchrun'][-1].items()})}", flush=True)
        runs["flightdeck"].append(asyncio.run(flightdeck_once(n)))
        print(f"flightdeck run {n}: {json.dumps({k: round(v, 3) for k, v in runs['flightdeck'][-1].items()})}",
              flush=True)
    median = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}
    ratio = median["flightdeck"]["recover"] / median["torchrun"]["recover"]
    # Paired by run (each pair ran back to back): less exposed to the box's load drifting between runs.
    paired = [f["recover"] / t["recover"] for f, t in zip(runs["flightdeck"], runs["torchrun"], strict=True)]
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "what": "seconds from rank 1's crash at step 40 to the first step after the restart (2 CPU ranks, gloo)",
        "runs": runs, "median": median, "ratio_flightdeck_over_torchrun": ratio,
        "paired_ratios": paired, "median_paired_ratio": statistics.median(paired),
        "to_spawn_ratio": median["flightdeck"]["to_spawn"] / median["torchrun"]["to_spawn"],
    }
    for side, m in median.items():
        print(f"{side:<11} recover {m['recover']:.3f} s  (from step {m['resumed_from_step']:.0f})")
    print(f"ratio flightdeck / torchrun: {ratio:.2f} (below 1: Flightdeck is back sooner); paired by run: "
          f"{', '.join(f'{r:.2f}' for r in paired)}; crash to respawn: {report['to_spawn_ratio']:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
