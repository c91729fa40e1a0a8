"""Submit to first step: how long a 2-rank tiny job waits between `JobSubmitted` and its first
`StepCompleted`, split into the parts the event log can tell apart. A fresh nats-server, every service
(`python -m flightdeck.services NAME`) and one node agent (2 CPU slots) are started once; N jobs then run one after
another on them, and the median of each part is printed.

    python bench/submit_to_first_step.py              # 3 runs
    python bench/submit_to_first_step.py --runs 5 --json

Parts (each from the previous mark):
    scheduling  JobSubmitted -> AllocationGranted   scheduler queues and asks, resources grants
    spawn       -> WorkersStarted                   the agent writes the spec and starts both rank processes
    startup     -> RankStarted (the later rank)     interpreter, imports (torch), gloo rendezvous, model, restore
    first step  -> first StepCompleted              the first forward/backward/all-reduce/optimizer step
For reference, `import_s` is how long `python -c "import flightdeck.trainer.loop"` (torch and the trainer's imports)
takes alone on this machine, measured after each run: the part of `startup` that is importing.

Times: JobSubmitted, WorkersStarted, RankStarted and StepCompleted carry their producer's wall clock
(one machine); AllocationGranted carries its input's time (service outputs are stamped for
determinism), so it is timed when the test's live recorder receives it.
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.events import subjects
from flightdeck.events.job import AllocationGranted, JobCompleted, JobSubmitted, WorkersStarted
from flightdeck.events.spec import JobSpec, ModelSpec, TrainSpec
from flightdeck.events.training import RankStarted, StepCompleted
from flightdeck.services.shell import broker
from tests.integration.lifecycle_harness import Objects, Platform, open_platform

PARTS = ("scheduling", "spawn", "startup", "first_step")
SPEC = JobSpec(name="bench", slots=2, model=ModelSpec(d_model=32),
               train=TrainSpec(steps=5, checkpoint_every=1000, data="synthetic"))


def import_seconds() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import flightdeck.trainer.loop"], cwd=Path(__file__).resolve().parent.parent,
                   check=True)
    return time.perf_counter() - started


async def one_run(c: Platform, n: int, wall_offset: float) -> dict[str, float]:
    job = f"bench-{n:06x}"
    submitted = time.time()
    await c.submit(SPEC, job)
    await c.until(lambda: bool(c.seen(JobCompleted, job)), 120, "the job to complete", job)
    (sub,) = c.seen(JobSubmitted, job)
    granted = wall_offset + c.first_at(AllocationGranted, job)
    (workers,) = c.seen(WorkersStarted, job)
    await c.until(lambda: len(c.seen(RankStarted, job, stream=subjects.TELEMETRY)) == 2
                  and any(e.step == 0 for e in c.seen(StepCompleted, job, stream=subjects.TELEMETRY)), 10,
                  "the ranks' telemetry", job)
    ranks_up = max(e.occurred_at for e in c.seen(RankStarted, job, stream=subjects.TELEMETRY))
    first = min(e.occurred_at for e in c.seen(StepCompleted, job, stream=subjects.TELEMETRY) if e.step == 0)
    assert abs(sub.occurred_at - submitted) < 1.0
    marks = [sub.occurred_at, granted, workers.occurred_at, ranks_up, first]
    out = {part: marks[i + 1] - marks[i] for i, part in enumerate(PARTS)}
    out["total"] = first - sub.occurred_at
    out["import_s"] = await asyncio.to_thread(import_seconds)
    return out


async def bench(runs: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="fd-bench-") as tmp:
        root = Path(tmp)
        b = broker.start(root / "nats")
        c = await open_platform(b.url, root, Objects(str(root / "objects")))
        try:
            c.start_all()
            await c.ready(within=120)
            wall_offset = time.time() - time.monotonic()
            return [await one_run(c, n, wall_offset) for n in range(1, runs + 1)]
        finally:
            await c.close()
            b.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print the runs and medians as JSON")
    args = p.parse_args()
    if args.runs < 1:
        p.error("--runs must be at least 1")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    results = asyncio.run(bench(args.runs))
    keys = [*PARTS, "total", "import_s"]
    median = {k: statistics.median(r[k] for r in results) for k in keys}
    if args.json:
        print(json.dumps({"runs": results, "median": median}, indent=2))
        return 0
    print("seconds " + " ".join(f"{k:>11}" for k in keys))
    for i, r in enumerate(results, 1):
        print(f"run {i:<3} " + " ".join(f"{r[k]:11.3f}" for k in keys))
    print("median  " + " ".join(f"{median[k]:11.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
