"""How fast the health core folds telemetry, pure and in-process: 4,096 ranks at 1 Hz (a heartbeat and a step each
per second) against 256 ranks measured in the same run, so the ratio shows whether a beat's cost grows with the
job's size (an O(ranks) heartbeat would make it ~16x).

    python bench/health_ingest.py [--seconds 6] [--repeats 3]

Goals: >= 20,000 events/s at 4,096 ranks on a 2-core CPU box; per-event cost at 4,096 / at 256 <= 2 (O(ranks): ~16).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.events.clock import ClockTick
from flightdeck.events.spec import PolicySpec
from flightdeck.services.health.core import NAME
from tests.unit.health_synth import SERVICE, Cluster, steady_second


def fold(num_ranks: int, seconds: int) -> dict[str, float]:
    """Fold `seconds` of a healthy job's telemetry and ticks; events/s, the slowest tick, and the findings made."""
    c = Cluster(num_ranks=num_ranks, policy=PolicySpec(straggler_window=3))
    c.start()
    batches = [steady_second(c.job_id, num_ranks, s) for s in range(seconds)]
    ticks = [ClockTick(service=NAME, now=s + 1.0, positions={}, event_id=f"t{s}", occurred_at=s + 1.0)
             for s in range(seconds)]
    state = SERVICE.initial
    for ev in c.events:
        state, _ = SERVICE.transition(state, ev)
    folded = outputs = 0
    slowest_tick = 0.0
    began = time.perf_counter()
    for batch, tick in zip(batches, ticks, strict=True):
        for ev in batch:
            state, outs = SERVICE.transition(state, ev)
            outputs += len(outs)
        t0 = time.perf_counter()
        state, outs = SERVICE.transition(state, tick)
        outputs += len(outs)
        slowest_tick = max(slowest_tick, time.perf_counter() - t0)
        folded += len(batch) + 1
    elapsed = time.perf_counter() - began
    return {"events_per_s": folded / elapsed, "us_per_event": elapsed / folded * 1e6,
            "slowest_tick_ms": slowest_tick * 1e3, "findings": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu-health-ingest.json")
    args = ap.parse_args()
    runs: dict[int, list[dict[str, float]]] = {256: [], 4096: []}
    for _ in range(args.repeats):  # interleaved, so drift in the box's load hits both sizes alike
        for n in runs:
            runs[n].append(fold(n, args.seconds))
    summary: dict[str, Any] = {"load_1m": os.getloadavg()[0], "seconds": args.seconds, "repeats": args.repeats}
    for n, rs in runs.items():
        summary[str(n)] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    summary["cost_ratio_4096_vs_256"] = summary["4096"]["us_per_event"] / summary["256"]["us_per_event"]
    for n in runs:
        s = summary[str(n)]
        print(f"{n:>5} ranks: {s['events_per_s']:>9,.0f} events/s ({s['us_per_event']:.1f} us each), slowest tick "
              f"{s['slowest_tick_ms']:.1f} ms, findings {s['findings']:.0f}")
    print(f"per-event cost, 4,096 vs 256 ranks: {summary['cost_ratio_4096_vs_256']:.2f}x "
          f"(load {summary['load_1m']:.1f})")
    args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
