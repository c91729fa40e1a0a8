"""Time to write the postmortem of a 1M-event job history (telemetry included), against reading the file raw.

A synthetic history (services/tools/postmortem/synthetic.py: N ranks' steps, heartbeats and checkpoints, the health
monitor's clock, a crash, a loss spike and a hang with their detections, decisions and recoveries) is written as
an .fdh file, then timed end to end as `flightdeck postmortem --from FILE` does it:

    load      flightdeck.services.tools.history.fdh.load: parse, check and decode every row
    analyse   flightdeck.services.tools.postmortem.analyse: the single pass, incidents, goodput, timeline
    plots     the three PNGs (curves reduced to at most 2,000 points)
    report    report.md and report.html (PNGs inlined)

Baseline, measured in the same run on the same file: the floor any reader pays, one msgspec JSON decode of
each line and one msgpack decode of its event, nothing kept. The ratio is total / baseline.

    .venv/bin/python bench/postmortem_time.py                     # 1M events, 8 ranks
    .venv/bin/python bench/postmortem_time.py --events 200000 --out /tmp/pm.json
"""

import argparse
import gc
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.events import codec
from flightdeck.services.tools.history import fdh
from flightdeck.services.tools.postmortem.analysis import analyse
from flightdeck.services.tools.postmortem.plots import draw_all
from flightdeck.services.tools.postmortem.report import blocks, html_page, markdown
from flightdeck.services.tools.postmortem.synthetic import Scenario, synthesise

RESULTS = Path(__file__).resolve().parent / "results" / "cpu-postmortem-time.json"


def scenario(events: int, ranks: int) -> Scenario:
    step_s, beat_s, tick_s, every = 0.1, 1.0, 1.0, 100
    per_step = ranks * (1 + step_s / beat_s) + step_s / tick_s + (ranks + 2) / every
    steps = int(events / per_step)
    faults = (("crash", int(steps * 0.1) + 37), ("spike", int(steps * 0.4) + 53), ("hang", int(steps * 0.7) + 71))
    return Scenario(job_id="bench-000001", ranks=ranks, steps=steps, step_s=step_s, heartbeat_s=beat_s, tick_s=tick_s,
                    checkpoint_every=every, startup_s=20.0, hang_s=30.0, obey_steps=20, skip=200, faults=faults)


class _Row(msgspec.Struct):
    data: bytes = b""


def raw_read(path: Path) -> tuple[float, float]:
    """Seconds (wall, CPU) to decode every line's JSON and every event's msgpack, keeping nothing."""
    decoder = msgspec.json.Decoder(_Row)
    started, cpu = time.perf_counter(), time.process_time()
    for line in path.read_bytes().splitlines():
        row = decoder.decode(line)
        if row.data:
            codec.decode(row.data)
    return time.perf_counter() - started, time.process_time() - cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--report-dir", type=Path, default=None, help="keep the report here (default: a temp dir)")
    args = ap.parse_args()

    sc = scenario(args.events, args.ranks)
    t = time.perf_counter()
    rows = synthesise(sc)
    made_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory(prefix="fd-pm-bench-") as tmp:
        path = Path(tmp) / "bench.fdh"
        fdh.write(path, fdh.dump(rows, job_id=sc.job_id, source="bench/postmortem_time.py"))
        size = path.stat().st_size
        n = len(rows)
        del rows
        gc.collect()
        baseline, baseline_cpu = raw_read(path)
        out = args.report_dir or Path(tmp) / "report"
        out.mkdir(parents=True, exist_ok=True)
        times: dict[str, float] = {}
        cpu: dict[str, float] = {}

        def timed(name: str, t: float, c: float) -> None:
            times[name], cpu[name] = time.perf_counter() - t, time.process_time() - c

        t, c = time.perf_counter(), time.process_time()
        loaded = fdh.load(path)
        timed("load", t, c)
        t, c = time.perf_counter(), time.process_time()
        pm = analyse(loaded, sc.job_id)
        timed("analyse", t, c)
        t, c = time.perf_counter(), time.process_time()
        pngs = draw_all(pm, out)
        timed("plots", t, c)
        t, c = time.perf_counter(), time.process_time()
        items = blocks(pm)
        (out / "report.md").write_text(markdown(items))
        (out / "report.html").write_text(html_page(items, {p.name: p.read_bytes() for p in pngs}, sc.job_id))
        timed("report", t, c)
    total, total_cpu = sum(times.values()), sum(cpu.values())
    result = {
        "benchmark": "postmortem of a synthetic job history, load + analysis + plots + report",
        "command": "python bench/postmortem_time.py " + " ".join(sys.argv[1:]),
        "events": n, "ranks": sc.ranks, "steps": sc.steps, "file_mb": round(size / 1e6, 1),
        "incidents": [(i.kind, i.decision) for i in pm.incidents],
        "goodput": round(pm.goodput.goodput, 4),
        "seconds": {k: round(v, 3) for k, v in times.items()} | {"total": round(total, 3)},
        "cpu_seconds": {k: round(v, 3) for k, v in cpu.items()} | {"total": round(total_cpu, 3)},
        "events_per_s": round(n / total),
        "events_per_cpu_s": round(n / total_cpu),
        "baseline_raw_decode_s": round(baseline, 3),
        "baseline_raw_decode_cpu_s": round(baseline_cpu, 3),
        "ratio_total_vs_raw_decode": round(total / baseline, 2),
        "ratio_cpu_total_vs_raw_decode": round(total_cpu / baseline_cpu, 2),
        "analysis_events_per_s": round(n / times["analyse"]),
        "synthesis_s": round(made_s, 1),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),  # synthesis included
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg": os.getloadavg()[0],
                    "note": "2 cores shared with other work: wall times inflate with load_avg, CPU seconds do not"},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
