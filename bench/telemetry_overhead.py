"""What the trainer API costs a training step: the built-in trainer's loop (a user of the API, trainer/loop.py)
with telemetry on (`run.steps()` + `run.report()`, the rank's link to a real node agent's end,
services/agent/links.py, publishing to a local nats-server) and off, against the same loop body with no Flightdeck
at all ("plain"). Runs alternate, so drift hits every side alike.

    python bench/telemetry_overhead.py                                  # CPU, a small GPT on the corpus
    python bench/telemetry_overhead.py --device cuda --params 350e6     # ~350M-param GPT, bf16 autocast

    python bench/telemetry_overhead.py --snapshot-every 1               # "on" also snapshots every step

Goals: on/plain <= 1.02 on CPU; <= 1.01 on CUDA with the ~350M model. With `--snapshot-every N` the "on" side
also takes a host snapshot into shared memory every N steps (train.snapshot_every, trainer/snapshots.py), as a
rank under a node agent does; the goal is the same.
"""

import argparse
import asyncio
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nats
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.nn.functional as F

from flightdeck.events.spec import JobSpec, ModelSpec, TrainSpec
from flightdeck.events.streams import ensure_streams
from flightdeck.services.shell import broker
from flightdeck.trainer import distributed
from flightdeck.trainer import model as model_mod
from flightdeck.trainer.config import RunConfig
from flightdeck.trainer.data import TokenStream, load_tokens
from flightdeck.trainer.link import AgentLink, Offline
from flightdeck.trainer.loop import GRAD_CLIP, lr_at, train
from flightdeck.trainer.model import num_params
from flightdeck.trainer.reports import Emitter
from flightdeck.trainer.session import Run
from tests.trainer.linkhost import NODE, LinkHost

WARMUP_STEPS = 10


Measured = tuple[list[float], int, float, tuple[float, float], float]  # times, published, background, snapshots


def one_run(spec: JobSpec, host: LinkHost | None, job_id: str, device: str, staging: Path,
            batch_s: float, snapshots: Path | None = None) -> Measured:
    cfg = RunConfig(job_id=job_id, spec=spec, attempt=0, node=NODE, agent=host.address if host else None,
                    staging=staging, restore=None, manifest=None, rank=0, world_size=1, local_rank=0, device=device,
                    sync_every=10, events_log=None, snapshots=snapshots)
    link: AgentLink | Offline = Offline()
    if host is not None:
        link = AgentLink(host.address, job_id, 0, 0, NODE, heartbeat_s=spec.policy.heartbeat_interval_s)
        link.connect()
        link.start()
    emitter = Emitter(link, {"job_id": job_id, "rank": 0, "attempt": 0, "node": NODE}, batch_s=batch_s)
    run = Run(cfg, distributed.init(0, 1, 0, device), emitter, link)
    cpu, main_cpu, wall = time.process_time(), time.thread_time(), time.perf_counter()
    assert train(run) == 0
    wall = time.perf_counter() - wall
    # CPU the process spent outside the training thread (the link's thread; here also the agent's end, which on a
    # node runs in the agent's process, so this over-counts): a noise-free upper
    # bound on what telemetry can take from the step, where the wall clock on a shared box cannot resolve 2%.
    background_cpu = (time.process_time() - cpu) - (time.thread_time() - main_cpu)
    cadence = run.snapshots
    run.close()
    # What the snapshots took, measured where it is spent (noise-free, unlike the step's wall clock): the
    # training thread's gather and copy, and the worker's CPU for the crc32s and the header.
    hold_s, beside_s, taken = 0.0, 0.0, 0
    if cadence is not None and cadence.snaps is not None:
        hold_s = cadence.gather_total_s + cadence.snaps.stall_total_s
        beside_s, taken = cadence.snaps.worker_cpu_total_s, cadence.snaps.taken
    published = 0 if host is None else host.call(lambda links: links.published)
    times = run.reporter.step_times[WARMUP_STEPS:]
    background_per_step = background_cpu / len(run.reporter.step_times)
    del run
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return times, published, background_per_step, (hold_s / wall, beside_s / wall), taken / spec.train.steps


def plain_run(spec: JobSpec, device: str) -> Measured:
    """trainer/loop.py's step body with no Flightdeck: the baseline a user compares with."""
    dev = torch.device(device)
    torch.manual_seed(spec.train.seed)
    gpt = model_mod.build(spec.model, spec.train.seed, dev)
    opt = torch.optim.AdamW(gpt.parameters(), lr=spec.train.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    stream = TokenStream(load_tokens(spec.train.data, spec.model.vocab_size), seq_len=spec.model.seq_len,
                         batch_size=spec.train.batch_size, seed=spec.train.seed, rank=0, world_size=1,
                         vocab_size=spec.model.vocab_size)
    global_tokens = spec.train.batch_size * spec.model.seq_len
    times: list[float] = []
    last = time.perf_counter()
    for step in range(spec.train.steps):
        x, y = (t.to(dev, non_blocking=True) for t in stream.batch(step))
        lr = lr_at(step, spec.train.steps, spec.train.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = gpt(x)
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        opt.zero_grad(set_to_none=True)
        (loss_sum / global_tokens).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(gpt.parameters(), GRAD_CLIP)
        opt.found_inf = (~torch.isfinite(grad_norm)).float()  # type: ignore[attr-defined]
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()  # the API side reads each step's loss one step later: the same wait
        now = time.perf_counter()
        times.append(now - last)
        last = now
    del gpt, opt
    gc.collect()
    return times[WARMUP_STEPS:], 0, 0.0, (0.0, 0.0), 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--params", type=float, default=None, help="pick n_layer for about this many parameters")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--n-head", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--emit-batch-s", type=float, default=0.25, help="Emitter batch_s (0: hand over every step)")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="the 'on' side takes a host snapshot in shared memory every N steps (0: none)")
    p.add_argument("--snapshot-max-overhead", type=float, default=TrainSpec().snapshot_max_overhead,
                   help="train.snapshot_max_overhead (1.0: a snapshot every N steps whatever it costs)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    cuda = args.device == "cuda"
    d_model = args.d_model or (1024 if cuda else 128)
    n_layer = max(1, round(args.params / (12 * d_model**2))) if args.params else args.n_layer
    model = ModelSpec(n_layer=n_layer, d_model=d_model, n_head=args.n_head or d_model // 64,
                      seq_len=args.seq_len or (1024 if cuda else 128), vocab_size=256)
    spec = JobSpec(name="bench", model=model, train=TrainSpec(steps=args.steps, batch_size=args.batch_size,
                                                               checkpoint_every=10**9, lr=3e-4,
                                                               snapshot_every=args.snapshot_every,
                                                               snapshot_max_overhead=args.snapshot_max_overhead))
    tmp = Path(tempfile.mkdtemp(prefix="tel-bench-"))
    shm = Path(tempfile.mkdtemp(prefix="tel-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)) \
        if args.snapshot_every > 0 else None
    b = broker.start(tmp / "nats")
    host: LinkHost | None = None
    try:
        async def streams() -> None:
            nc = await nats.connect(b.url)
            await ensure_streams(nc.jetstream())
            await nc.close()

        asyncio.run(streams())
        host = LinkHost(b.url).__enter__()
        times: dict[str, list[float]] = {"plain": [], "off": [], "on": []}
        paired: dict[str, list[float]] = {"on": [], "off": []}
        background: dict[str, list[float]] = {"on": [], "off": []}
        snapshot_share: list[tuple[float, float]] = []
        snapshot_rate: list[float] = []
        published = 0
        orders = [("plain", "off", "on"), ("on", "plain", "off"), ("off", "on", "plain")]
        for r in range(args.rounds):
            # Rotate which side goes first, so a slow drift (thermal, a neighbour's load) is shared.
            runs = {}
            for side in orders[r % 3]:
                if side == "plain":
                    runs[side] = plain_run(spec, args.device)
                else:
                    runs[side] = one_run(spec, host if side == "on" else None, f"{side}-{r}", args.device,
                                         tmp / "staging", args.emit_batch_s, shm if side == "on" else None)
            for side in times:
                times[side] += runs[side][0]
            published = runs["on"][1]  # the agent's running count
            for side in ("on", "off"):
                paired[side].append(statistics.median(runs[side][0]) / statistics.median(runs["plain"][0]))
                background[side].append(runs[side][2])
            if args.snapshot_every > 0:
                snapshot_share.append(runs["on"][3])
            snapshot_rate.append(runs["on"][4])
    finally:
        if host is not None:
            host.close()
        b.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
    from flightdeck.trainer.model import GPT

    with torch.device("meta"):
        n_params = num_params(GPT(model))
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
        "model": {"n_layer": model.n_layer, "d_model": model.d_model, "n_head": model.n_head,
                  "seq_len": model.seq_len, "params": n_params}, "batch_size": args.batch_size,
        "steps_per_run": args.steps, "emit_batch_s": args.emit_batch_s, "rounds": args.rounds,
        "snapshot_every_on": args.snapshot_every, "snapshot_max_overhead": args.snapshot_max_overhead,
        "events_published_on": published,
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
        "ratio_on_vs_plain": statistics.median(times["on"]) / statistics.median(times["plain"]),
        "ratio_off_vs_plain": statistics.median(times["off"]) / statistics.median(times["plain"]),
        "paired_ratios_vs_plain": paired,
        "paired_ratio_median": {k: statistics.median(v) for k, v in paired.items()},
        "background_cpu_s_per_step": {k: statistics.median(v) for k, v in background.items()},
        "background_cpu_vs_step": (statistics.median(background["on"]) - statistics.median(background["off"]))
        / statistics.median(times["plain"]),
        # The snapshots' own cost over the training time, measured where it is spent, without the wall clock's
        # noise: their hold of the training thread (gathering the items, the copy of what the forward pass writes,
        # starting the rest), and the CPU beside it (the copy's threads, the checksums), which costs training only
        # where no core is spare.
        "snapshot_hold_vs_training": statistics.median(h for h, _ in snapshot_share) if snapshot_share else 0.0,
        "snapshot_beside_vs_training": statistics.median(b for _, b in snapshot_share) if snapshot_share else 0.0,
        "snapshot_per_round": snapshot_share if args.snapshot_every > 0 else [],
        "snapshots_per_step": statistics.median(snapshot_rate) if args.snapshot_every > 0 else 0.0,
        "goal": 1.01 if cuda else 1.02,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
