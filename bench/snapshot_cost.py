"""What a host snapshot costs the step it is taken at, against the steps beside it in the same run: the built-in
trainer's loop (trainer/loop.py, a user of the API) with `train.snapshot_every = 1`, its snapshots made due in
alternate blocks of `--block` steps. Each block with snapshots is compared with the block without them just before
or after it (the median of their step times, hold included), so a drift of this shared box (run-to-run medians here
wander by 20%) cancels out; bench/telemetry_overhead.py compares whole runs instead.

    OMP_NUM_THREADS=1 python bench/snapshot_cost.py                 # CPU, the telemetry bench's GPT
    OMP_NUM_THREADS=1 python bench/snapshot_cost.py --steps 400 --block 4 --rounds 3

Goal: <= 1.02x (a snapshot every step within the 2% its cap allows). Also reported: the hold of the training
thread per snapshot (gathering the items, copying what the forward pass writes, queueing the rest) and the CPU
beside training (the copy of the parameters and optimizer state, the checksums in the rank's helper process).
"""

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.events.spec import JobSpec, ModelSpec, TrainSpec
from flightdeck.trainer import distributed
from flightdeck.trainer.config import RunConfig
from flightdeck.trainer.cursor import Step
from flightdeck.trainer.link import Offline
from flightdeck.trainer.loop import train
from flightdeck.trainer.reports import Emitter
from flightdeck.trainer.session import Run

WARMUP_STEPS = 20


def one_round(spec: JobSpec, block: int, round_: int) -> dict[str, Any]:
    shm = Path(tempfile.mkdtemp(prefix="snap-cost-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    staging = Path(tempfile.mkdtemp(prefix="snap-cost-"))
    job = f"cost-{round_}"
    cfg = RunConfig(job_id=job, spec=spec, attempt=0, node="n", agent=None, staging=staging, restore=None,
                    manifest=None, rank=0, world_size=1, local_rank=0, device="cpu", sync_every=10, events_log=None,
                    snapshots=shm)
    link = Offline()
    run = Run(cfg, distributed.init(0, 1, 0, "cpu"), Emitter(link, {"job_id": job, "rank": 0, "attempt": 0,
                                                                   "node": "n"}, None), link)
    cadence = run.snapshots
    assert cadence is not None and cadence.snaps is not None
    snaps = cadence.snaps
    due = cadence.due
    cadence.due = lambda step: (step // block) % 2 == 1 and due(step)  # type: ignore[method-assign]
    stamps: list[float] = []
    steps = run.steps

    def timed(total: int | None = None) -> Iterator[Step]:
        for step in steps(total):
            stamps.append(time.perf_counter())  # after the boundary's snapshot: a step's time holds its own
            yield step
        stamps.append(time.perf_counter())

    run.steps = timed  # type: ignore[method-assign]
    try:
        assert train(run) == 0
    finally:
        run.close()
    took = [b - a for a, b in itertools.pairwise(stamps)]
    # step k's time runs from the boundary after step k-1's snapshot to the one after its own: a snapshot taken
    # at boundary k is held inside step k-1's time, with its copy beside step k
    blocks: dict[int, list[float]] = {}
    for step, t in enumerate(took[WARMUP_STEPS:], start=WARMUP_STEPS):
        blocks.setdefault((step + 1) // block, []).append(t)
    medians = {b: statistics.median(ts) for b, ts in blocks.items() if len(ts) == block}
    ratios = [medians[b] / medians[n] for b in medians if b % 2 == 1 for n in (b - 1, b + 1) if n in medians]
    training = sum(took)
    return {"paired_block_ratio": statistics.median(ratios), "pairs": len(ratios),
            "median_step_s": statistics.median(took[WARMUP_STEPS:]),
            "snapshots": snaps.taken,
            "hold_per_snapshot_s": (cadence.gather_total_s + snaps.stall_total_s) / snaps.taken,
            "hold_vs_training_if_every_step": (cadence.gather_total_s + snaps.stall_total_s) / snaps.taken
            / statistics.median(took[WARMUP_STEPS:]),
            "beside_cpu_per_snapshot_s": snaps.worker_cpu_total_s / snaps.taken,
            "training_s": training}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--block", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = ModelSpec(n_layer=4, d_model=128, n_head=2, seq_len=128, vocab_size=256)  # telemetry_overhead's
    spec = JobSpec(name="bench", model=model, train=TrainSpec(steps=args.steps, batch_size=8, checkpoint_every=10**9,
                                                               lr=3e-4, snapshot_every=1, snapshot_max_overhead=1.0))
    rounds = [one_round(spec, args.block, r) for r in range(args.rounds)]
    result = {"device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(),
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""), "steps": args.steps, "block": args.block,
              "rounds": rounds,
              "paired_block_ratio_median": statistics.median(r["paired_block_ratio"] for r in rounds),
              "hold_vs_training_median": statistics.median(r["hold_vs_training_if_every_step"] for r in rounds),
              "goal": 1.02}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
