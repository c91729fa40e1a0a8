"""What one dashboard update costs the server, pure and in-process: a job's telemetry at 4,096 ranks as a fleet
sends it (rank 0's StepCompleted per step, the others' steps in one RankHeartbeats batch per 8-rank node per step)
folded into the board (its 512 nodes registered), then the snapshot a page is pushed built and encoded, against
2 ranks (both ranks' steps, one node) measured in the same run over the same steps. The page's curve is thinned on
the server, so a push grows only with the fleet table (512 rows), not with the ranks' telemetry.

    python bench/dashboard_update.py [--steps 1000] [--repeats 3]

Goals: a push under 20 ms and under 200 KB at 4,096 ranks.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.events.fleet import NodeRegistered
from flightdeck.events.heartbeats import RankBeat, RankHeartbeats
from flightdeck.events.job import JobSubmitted
from flightdeck.events.spec import JobSpec, TrainSpec
from flightdeck.events.store import Stored
from flightdeck.events.training import StepCompleted
from flightdeck.services.tools.web.figures import Figures
from flightdeck.services.tools.web.metrics import Live
from flightdeck.services.tools.web.page import snapshot

JOB = "big-000001"
PER_NODE = 8


def rows(ranks: int, steps: int) -> list[Stored]:
    spec = JobSpec(name="big", slots=ranks, train=TrainSpec(steps=steps))
    out = [Stored("FD_CONTROL", 1, f"fd.ctl.job.{JOB}.JobSubmitted", b"", "s",
                  JobSubmitted(job_id=JOB, spec=spec, event_id="s", occurred_at=0.0))]
    out += [Stored("FD_CONTROL", 2 + n, f"fd.ctl.node.n{n}.NodeRegistered", b"", "", NodeRegistered(
        node=f"n{n}", kind="gpu", slots=PER_NODE, event_id="", occurred_at=0.0)) for n in range(-(-ranks // PER_NODE))]
    seq = 0
    for step in range(steps):
        t = 1.0 + step * 0.1
        for rank in range(ranks if ranks <= PER_NODE else 1):  # at fleet scale only rank 0 reports steps itself
            seq += 1
            out.append(Stored("FD_TELEMETRY", seq, f"fd.tel.{JOB}.{rank}.StepCompleted", b"", "", StepCompleted(
                job_id=JOB, rank=rank, step=step, loss=3.0 / (1 + step), grad_norm=1.0, lr=1e-3,
                tokens_per_s=1e5, step_time_s=0.1, event_id="", occurred_at=t)))
        for first in range(0, ranks, PER_NODE):
            seq += 1
            beats = [RankBeat(rank=r, step=step, occurred_at=t, step_time_s=0.1)
                     for r in range(first, min(first + PER_NODE, ranks))]
            out.append(Stored("FD_TELEMETRY", seq, f"fd.tel.{JOB}.{first}.RankHeartbeats", b"", "", RankHeartbeats(
                job_id=JOB, rank=first, node=f"n{first // PER_NODE}", beats=beats, interval_s=1.0, event_id="",
                occurred_at=t)))
    return out


def measure(ranks: int, steps: int) -> dict[str, float]:
    stream = rows(ranks, steps)
    figures = Figures()
    began = time.perf_counter()
    for stored in stream:
        figures.fold(stored)
    folded = time.perf_counter() - began
    pushes = []
    for _ in range(20):
        t0 = time.perf_counter()
        data = msgspec.json.encode(snapshot(figures, Live(broker_up=True), JOB, time.time()))
        pushes.append(time.perf_counter() - t0)
    return {"events": len(stream), "fold_events_per_s": len(stream) / folded,
            "push_ms": statistics.median(pushes) * 1e3, "push_kb": len(data) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu-dashboard-update.json")
    args = ap.parse_args()
    runs: dict[int, list[dict[str, float]]] = {2: [], 4096: []}
    for _ in range(args.repeats):  # interleaved, so drift in the box's load hits both sizes alike
        for n in runs:
            runs[n].append(measure(n, args.steps))
    summary: dict[str, Any] = {"load_1m": os.getloadavg()[0], "steps": args.steps, "repeats": args.repeats}
    for n, rs in runs.items():
        summary[str(n)] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    summary["push_ratio_4096_vs_2"] = summary["4096"]["push_ms"] / summary["2"]["push_ms"]
    for n in runs:
        s = summary[str(n)]
        print(f"{n:>5} ranks: folded {s['events']:,.0f} events at {s['fold_events_per_s']:,.0f}/s; a push "
              f"{s['push_ms']:.2f} ms, {s['push_kb']:.1f} KB")
    print(f"push cost, 4,096 vs 2 ranks: {summary['push_ratio_4096_vs_2']:.2f}x (load {summary['load_1m']:.1f})")
    args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
