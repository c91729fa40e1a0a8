"""Scale simulation: thousands of simulated ranks (no torch) against the real health monitor, scheduler and
resource manager on a real nats-server with the shipped config (infra/nats/server.conf, sync_interval: always).

For each rank count: the health monitor's ingest (telemetry messages it folded per second, read from its
recorded ClockTicks, and the rank heartbeats they carried), its CPU (from /proc/<pid>/stat), the broker's and
the simulator's, and the detection latency of killed ranks (last heartbeat -> RankLost on the bus; p50/p99
over --kills kills, each on a fresh attempt after the scheduler's restart). The baseline measured in the same
run is the smallest rank count: the ratios say how cost grows with ranks.

    python bench/scale_sim.py --ranks 256 1024 2048 4096 --mode node --kills 10
    python bench/scale_sim.py --ranks 256 1024 --mode rank    # each rank publishing its own, as today
"""

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sim.harness import RunConfig, run

RESULTS = Path(__file__).resolve().parent / "results" / "cpu-scale-sim.json"


def row(r: dict[str, Any]) -> str:
    s, d = r["steady"], r["detection"]
    return (f"{r['mode']:>4} {r['ranks']:>5} ranks: health folds {s['health_folded_msgs_per_s']} msg/s "
            f"({s['health_rank_heartbeats_per_s']} rank beats/s, tick every {s['health_tick_interval_s']}s), "
            f"health CPU {s['cpu_percent']['health']:5.1f}%, "
            f"broker {s['cpu_percent']['nats-server']:5.1f}%, detect p50 {d['p50_s']:.2f}s p99 {d['p99_s']:.2f}s "
            f"(n={d['n']}, threshold {r['threshold_s']:g}s), load {s['load_avg_before'][0]:.1f}, "
            f"dropped {s['dropped']:.0f}, other findings {len(r['other_findings'])} {r['error']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    ap.add_argument("--mode", choices=("node", "rank"), default="node")
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--settle-s", type=float, default=8.0)
    ap.add_argument("--step-s", type=float, default=2.0)
    ap.add_argument("--processes", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--label", default="", help="a name for this set of runs in the results file")
    args = ap.parse_args()
    runs = []
    for n in args.ranks:
        config = RunConfig(num_ranks=n, mode=args.mode, kills=args.kills, window_s=args.window_s,
                           settle_s=args.settle_s, step_s=args.step_s, processes=args.processes)
        with tempfile.TemporaryDirectory(prefix=f"scale-sim-{n}-") as tmp:
            began = time.monotonic()
            try:
                result = asyncio.run(run(config, Path(tmp)))
            except TimeoutError as exc:
                result = {"ranks": n, "mode": args.mode, "fatal": str(exc)}
                print(f"{args.mode} {n} ranks: {exc}", flush=True)
            result["wall_s"] = round(time.monotonic() - began, 1)
        runs.append(result)
        if "fatal" not in result:
            print(row(result), flush=True)
    base = next((r for r in runs if "fatal" not in r), None)
    if base is not None:
        for r in runs:
            if "fatal" in r:
                continue
            scale = r["ranks"] / base["ranks"]
            cpu = r["steady"]["cpu_percent"]["health"] / max(base["steady"]["cpu_percent"]["health"], 0.1)
            r["vs_baseline"] = {"baseline_ranks": base["ranks"], "ranks_x": scale, "health_cpu_x": round(cpu, 2)}
    entry = {"label": args.label or f"{args.mode} {' '.join(map(str, args.ranks))}", "command": " ".join(sys.argv),
             "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(), "cpus": os.cpu_count(), "runs": runs}
    previous = json.loads(args.out.read_text()) if args.out.exists() else {"sets": []}
    previous["sets"].append(entry)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(previous, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
