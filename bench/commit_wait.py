"""Steps redone after a crash that lands while a checkpoint is on its way: a restart that waits for the pending
commit (policy.commit_wait_s, the default 30 s) against one that restores the newest committed checkpoint at
once (commit_wait_s = 0), interleaved in the same run.

Each run starts a fresh nats-server, every service and one node agent (2 CPU slots), and runs a 2-rank tiny job
paced at ~10 steps/s that checkpoints every --every steps (20); rank 1 crashes at --crash-at (42: 0.2 s after the
step-40 checkpoint is staged, before the checkpoint service, which folds stagings once a second, has committed
it). From the job's history: the step the restart resumed from, the steps redone (crash step - resumed step),
how long the restart waited (its JobQueued "waits" to its AllocationRequested), and fault -> first step.

    .venv/bin/python bench/commit_wait.py --runs 3
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flightdeck.events import subjects  # noqa: E402
from flightdeck.events.checkpoint import CheckpointCommitted, CheckpointPending  # noqa: E402
from flightdeck.events.job import AllocationRequested, JobCompleted, JobFailed, JobQueued, JobResumed  # noqa: E402
from flightdeck.events.spec import FaultSpec, ModelSpec  # noqa: E402
from flightdeck.events.training import FaultInjected, StepCompleted  # noqa: E402
from flightdeck.services.shell import broker  # noqa: E402
from tests.e2e.drill_harness import drill_spec, paced, start_drill  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "cpu-commit-wait.json"


async def one_run(wait_s: float, crash_at: int, every: int, n: int, model: ModelSpec) -> dict[str, Any]:
    spec = drill_spec("cwait", steps=crash_at + every + 5, checkpoint_every=every, commit_wait_s=wait_s,
                      faults=[paced(0.1), FaultSpec(kind="crash", step=crash_at, rank=1, attempt=0)])
    spec = msgspec.structs.replace(spec, model=model)
    job = f"cwait-{n:06x}"
    offset = time.time() - time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fd-commit-wait-") as tmp:
        root = Path(tmp)
        b = broker.start(root / "nats")
        p = await start_drill(b.url, root)
        try:
            p.agent("n1", "--grace-s", "2")
            await p.ready("n1", within=120)
            await p.submit(spec, job)
            await p.until(lambda: bool(p.seen(JobCompleted, job) or p.seen(JobFailed, job)), 240, "the job to end", job)
            assert p.seen(JobCompleted, job), "the job did not complete"
            resumed = next(e for e in p.seen(JobResumed, job) if e.attempt == 1)
            (crash,) = [e for e in p.seen(FaultInjected, job, stream=subjects.TELEMETRY) if e.kind == "crash"]
            first = min(e.occurred_at for e in p.seen(StepCompleted, job, stream=subjects.TELEMETRY) if e.attempt == 1)
            waits = [s for s in p.control if isinstance(s.stored.event, JobQueued) and "waits" in s.stored.event.reason
                     and subjects.job_of(s.stored.subject) == job]
            asked = next(s for s in p.control if isinstance(s.stored.event, AllocationRequested)
                         and s.stored.event.attempt == 1 and subjects.job_of(s.stored.subject) == job)
            step = crash_at // every * every  # the checkpoint the crash came after
            pending = [s.at + offset - crash.occurred_at for s in p.control
                       if isinstance(s.stored.event, CheckpointPending) and s.stored.event.step == step]
            commits = [s for s in p.control if isinstance(s.stored.event, CheckpointCommitted)
                       and s.stored.event.step == step and subjects.job_of(s.stored.subject) == job]
            commit = commits[0] if commits else None
            return {"commit_wait_s": wait_s, "crash_step": crash.step,
                    "checkpoint_mb": round(commit.event.bytes / 1e6, 1) if commit else None,  # type: ignore[attr-defined]
                    "committed_after_crash_s": round(commit.at + offset - crash.occurred_at, 3) if commit else None,
                    "resumed_from": resumed.from_step,
                    "redone_steps": crash.step - resumed.from_step, "waited": bool(waits),
                    "wait_s": round(asked.at - waits[0].at, 3) if waits else 0.0,
                    "pending_after_crash_s": round(pending[0], 3) if pending else None,
                    "recover_s": round(first - crash.occurred_at, 3), "load_1m": round(os.getloadavg()[0], 2)}
        finally:
            await p.close()
            b.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--crash-at", type=int, default=42)
    ap.add_argument("--every", type=int, default=20, help="checkpoint every this many steps")
    ap.add_argument("--d-model", type=int, default=64, help="the model's width: its checkpoint's size")
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"wait": [], "no_wait": []}
    for n in range(args.runs):  # interleaved, so a busy spell of the box does not land on one side only
        for name, wait_s in (("wait", 30.0), ("no_wait", 0.0)):
            model = ModelSpec(d_model=args.d_model, n_layer=args.n_layer, n_head=2)
            r = asyncio.run(one_run(wait_s, args.crash_at, args.every, 2 * n + (name == "no_wait"), model))
            runs[name].append(r)
            print(f"{name} run {n + 1}: {json.dumps(r)}", flush=True)
    summary = {name: {"median_redone_steps": statistics.median(r["redone_steps"] for r in rs),
                      "median_recover_s": round(statistics.median(r["recover_s"] for r in rs), 3),
                      "waited": sum(r["waited"] for r in rs)} for name, rs in runs.items()}
    print(json.dumps(summary))
    entry = {"command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": platform.node(),
             "cpus": os.cpu_count(), "runs": runs, "summary": summary}
    previous = json.loads(args.out.read_text()) if args.out.exists() else {"sets": []}
    previous["sets"].append(entry)
    args.out.write_text(json.dumps(previous, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
