"""The same crash of the same training script under plain torchrun and under Flightdeck, with its ranks started cold
and from warm standbys: seconds from the crash to the first training step after the restart, and the ratios
(goal: Flightdeck clearly faster than torchrun).

    .venv/bin/python bench/vs_torchrun.py                         # 2 runs of each side, interleaved
    .venv/bin/python bench/vs_torchrun.py --runs 5 --out bench/results/cpu-vs-torchrun.json

The script is `python -m flightdeck.trainer` (2 CPU ranks, gloo, the tiny model of the drills) with a drill fault:
rank 1 crashes at step 160 of attempt 0 only; attempt 0 is paced at ~20 steps/s so checkpoints exist before the crash,
and (8 s) so the standbys refilled after attempt 0's start are warm when it comes, as on a job that has run a while.
    torchrun    `torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m flightdeck.trainer --spec S ...`
                (defaults: --monitor-interval 0.1 s), with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without which the
                restart fails here. On a worker failure it kills the whole group and starts every rank again; the
                trainer reads the restart count from TORCHELASTIC_RESTART_COUNT. It has no notion of a committed
                checkpoint, so the restart begins at step 0. Events go to a JSON-lines file (--events-log), no
                broker: no telemetry publishing in its ranks.
    flightdeck  every service and one node agent (2 CPU slots) on a fresh nats-server, the drill policy
                (tests/e2e/drill_harness.py); the agent records the exit, the scheduler restarts the job, the
                agent starts both ranks again, which restore the newest committed checkpoint. Two sides:
                `cold` (`--standby 0`: every rank a fresh `python -m flightdeck.trainer`) and `warm` (the default, one
                standby per slot: the restarted ranks are handed to processes that imported torch already;
                `standbys_ready` says how many of them had finished importing when handed a rank).
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

from flightdeck.events import subjects  # noqa: E402
from flightdeck.events.job import JobCompleted, JobFailed, WorkersStarted  # noqa: E402
from flightdeck.events.spec import FaultSpec, JobSpec  # noqa: E402
from flightdeck.events.training import FaultInjected, RankStarted, StepCompleted  # noqa: E402
from flightdeck.services import broker  # noqa: E402
from tests.e2e.drill_harness import drill_spec, start_drill  # noqa: E402

CRASH_AT = 160
PACE_S = 0.05
SIDES = ("torchrun", "flightdeck-cold", "flightdeck-warm")
TORCHRUN = Path(sys.executable).parent / "torchrun"


def spec() -> JobSpec:
    return drill_spec("vs", steps=200, faults=[FaultSpec(kind="slow", step=0, rank=0, seconds=PACE_S),
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
               "-m", "flightdeck.trainer", "--job-id", f"vs-torchrun-{n}",
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


async def flightdeck_once(n: int, standby: int) -> dict[str, float]:
    job = f"vs-{n:06x}"
    with tempfile.TemporaryDirectory(prefix="fd-vs-") as tmp:
        root = Path(tmp)
        b = broker.start(root / "nats")
        p = await start_drill(b.url, root)
        try:
            p.agent("n1", "--grace-s", "2", "--standby", str(standby))
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
            (restart,) = [e for e in p.seen(WorkersStarted, job) if e.attempt == 1]
            return {"recover": first - crash, "to_spawn": spawned - crash, "startup": ready - spawned,
                    "first_step": first - ready, "resumed_from_step": float(min(e.step for e in steps)),
                    "standbys_ready": float(ready_handoffs(p.root / "agent-n1.log", restart.pids))}
        finally:
            await p.close()
            b.stop()


def ready_handoffs(agent_log: Path, pids: list[int]) -> int:
    """How many of `pids` the agent handed to a standby that had finished its imports (its JSON log lines)."""
    count = 0
    for line in agent_log.read_text().splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            handed = row.get("event") == "rank handed to a standby" and row.get("pid") in pids
            count += handed and row.get("ready") is True
    return count


def once(side: str, n: int) -> dict[str, float]:
    if side == "torchrun":
        return torchrun_once(n)
    return asyncio.run(flightdeck_once(n, standby=0 if side == "flightdeck-cold" else 2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the runs, medians and ratio here as JSON")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for n in range(1, args.runs + 1):  # interleaved, so a busy spell of the box does not favour one side
        for side in SIDES:
            runs[side].append(once(side, n))
            print(f"{side} run {n}: {json.dumps({k: round(v, 3) for k, v in runs[side][-1].items()})}", flush=True)
    median = {side: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for side, rs in runs.items()}

    def ratio(a: str, b: str) -> float:
        return median[a]["recover"] / median[b]["recover"]

    def paired(a: str, b: str) -> list[float]:  # each round ran back to back: less exposed to the load drifting
        return [x["recover"] / y["recover"] for x, y in zip(runs[a], runs[b], strict=True)]

    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_avg_1m_at_end": os.getloadavg()[0]},
        "what": f"seconds from rank 1's crash at step {CRASH_AT} to the first step after the restart (2 CPU ranks, "
                "gloo); flightdeck-cold starts ranks as fresh processes, flightdeck-warm hands them to standbys",
        "command": " ".join(["bench/vs_torchrun.py", *sys.argv[1:]]),
        "runs": runs, "median": median,
        "ratio_warm_over_torchrun": ratio("flightdeck-warm", "torchrun"),
        "ratio_cold_over_torchrun": ratio("flightdeck-cold", "torchrun"),
        "ratio_warm_over_cold": ratio("flightdeck-warm", "flightdeck-cold"),
        "paired_warm_over_torchrun": paired("flightdeck-warm", "torchrun"),
        "paired_cold_over_torchrun": paired("flightdeck-cold", "torchrun"),
        "median_paired_warm_over_torchrun": statistics.median(paired("flightdeck-warm", "torchrun")),
        "median_paired_cold_over_torchrun": statistics.median(paired("flightdeck-cold", "torchrun")),
    }
    for side, m in median.items():
        print(f"{side:<16} recover {m['recover']:.3f} s = to_spawn {m['to_spawn']:.3f} + startup {m['startup']:.3f} "
              f"+ first_step {m['first_step']:.3f}  (from step {m['resumed_from_step']:.0f})")
    print(f"ratio over torchrun (below 1: Flightdeck is back sooner): warm {report['ratio_warm_over_torchrun']:.2f}, "
          f"cold {report['ratio_cold_over_torchrun']:.2f}; paired warm: "
          f"{', '.join(f'{r:.2f}' for r in report['paired_warm_over_torchrun'])}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
