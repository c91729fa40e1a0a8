"""Host snapshots in shared memory against checkpoints, for one rank's state (a GPT and its AdamW moments):

  stall     the step loop blocked per snapshot (trainer/snapshots.py `take`: the host copy; checksums and header
            on a worker), and per snapshot whose parameters and optimizer state are copied beside training (as a
            rank with an optimizer does: `settled`), against per checkpoint (trainer/checkpointing.py `save`: the
            host copy, DCP write in the background), the same state, alternating
  restore   a restart's load of a set persisted from memory, from the node's memory (the slot itself, what a rank
            on the node that holds it loads) against from the store (the agent's download from a local object
            store into its cache, checked against the manifest's sha256s, then the same load), the same set

    .venv/bin/python bench/snapshot_restore.py                       # ~100M-param state on CPU
    .venv/bin/python bench/snapshot_restore.py --d-model 512 --n-layer 8 --rounds 5 --out bench/results/x.json

Ratios are against the baseline measured in the same run (checkpoint stall; restore from the store).
"""

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.events import snapshot as fmt
from flightdeck.events.checkpoint import DataPosition, ShardInfo
from flightdeck.events.spec import ModelSpec
from flightdeck.services.agent.snapshots import _sha256
from flightdeck.services.shell.objects import manifest as mf
from flightdeck.services.shell.objects.open import open_store
from flightdeck.trainer import checkpointing, distributed, model, snapshots
from flightdeck.trainer.state import TrainState


def state_of(spec: ModelSpec, seed: int) -> TrainState:
    m = model.build(spec, seed, torch.device("cpu"))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    for p in m.parameters():  # the moments exist, as after a first step
        p.grad = torch.zeros_like(p)
    opt.step()
    return TrainState(m, opt, {}, rank=0, device=torch.device("cpu"))


async def store_copy(objects_dir: Path, slot: Path, cache: Path) -> float:
    """Upload the slot's two files and a manifest (as the agent and the checkpoint service do), then time what a
    restart on another node does before loading: download into its cache, verified against the manifest."""
    async with open_store(str(objects_dir)) as store:
        shards = [_sha256(slot / fmt.bin_name(0)), _sha256(slot / fmt.header_name(0))]
        for s in shards:
            await store.put_file(mf.shard_key("j", "c", s.path), slot / s.path)
        manifest = mf.Manifest(job_id="j", checkpoint_id="c", step=1, world_size=1, attempt=0, created_at=0.0,
                               data=DataPosition(next_batch=1),
                               shards=[ShardInfo(path=s.path, size=s.size, sha256=s.sha256) for s in shards])
        body = mf.encode(manifest)
        await store.put_bytes(mf.manifest_key("j", "c"), body)
        started = time.perf_counter()
        await mf.download(store, "j", "c", cache, expected_sha256=mf.sha256(body))
        return time.perf_counter() - started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    spec = ModelSpec(n_layer=args.n_layer, d_model=args.d_model, n_head=max(1, args.d_model // 64), seq_len=128,
                     vocab_size=256)
    live = state_of(spec, 1)
    nbytes = sum(t.numel() * t.element_size() for t in live.live().values() if isinstance(t, torch.Tensor))
    dist = distributed.init(0, 1, 0, "cpu")
    shm = Path(tempfile.mkdtemp(prefix="snap-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    disk = Path(tempfile.mkdtemp(prefix="snap-bench-"))
    stalls: dict[str, list[float]] = {"snapshot": [], "snapshot_beside": [], "checkpoint": []}
    restores: dict[str, list[float]] = {"memory": [], "store": [], "download": []}
    try:
        snaps = snapshots.Snapshots(shm, job_id="j", attempt=0, rank=0, world_size=1)
        ckpt = checkpointing.Checkpointer(job_id="j", staging=disk / "staging", dist=dist, emit=lambda e: None,
                                          envelope={"job_id": "j", "rank": 0, "attempt": 0, "node": "n"})
        position = DataPosition(next_batch=1)
        for r in range(args.rounds + 1):  # the first round faults pages in and warms the thread pools: not counted
            for side in (("snapshot", "snapshot_beside", "checkpoint") if r % 2
                         else ("checkpoint", "snapshot_beside", "snapshot")):
                items = live.live()
                items[checkpointing.META_KEY] = checkpointing.meta_item(1, position, 1)
                if side.startswith("snapshot"):
                    # beside: the parameters and optimizer state copied on the copier's threads, as a rank does
                    # with an optimizer registered (trainer/session.py); the loop is held for the rest
                    settled = live.settled(items) if side == "snapshot_beside" else frozenset()
                    stall = snaps.take(1, items, position, timeline=0, checkpointing=False, replicated=True,
                                       settled=settled)
                    snaps.wait()
                else:
                    stall = ckpt.save(1, live.live(), position)
                    ckpt.wait()
                if r:
                    stalls[side].append(stall)
        snaps.close()
        (header, slot), *_ = fmt.complete_slots(shm, "j", 0, 0)
        for r in range(args.rounds):
            cache = disk / f"cache-{r}"
            download = asyncio.run(store_copy(disk / f"objects-{r}", slot, cache))
            for side in (("memory", "store") if r % 2 else ("store", "memory")):
                target = state_of(spec, 2)
                started = time.perf_counter()
                step, _ = checkpointing.load(slot if side == "memory" else cache, target, dist)
                took = time.perf_counter() - started
                assert step == header.step
                restores[side].append(took + (download if side == "store" else 0.0))
            restores["download"].append(download)
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(disk / f"objects-{r}", ignore_errors=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in {**stalls, **restores}.items()}
    result = {"state_bytes": nbytes, "model": {"d_model": spec.d_model, "n_layer": spec.n_layer},
              "rounds": args.rounds, "stall_s": stalls, "restore_s": restores, "median_s": med,
              "snapshot_vs_checkpoint_stall": med["snapshot"] / med["checkpoint"],
              "snapshot_beside_vs_checkpoint_stall": med["snapshot_beside"] / med["checkpoint"],
              "memory_vs_store_restore": med["memory"] / med["store"]}
    print(f"state {nbytes / 1e6:.0f} MB: stall per snapshot {med['snapshot'] * 1e3:.1f} ms (copied beside "
          f"training: {med['snapshot_beside'] * 1e3:.1f} ms), per checkpoint "
          f"{med['checkpoint'] * 1e3:.1f} ms ({result['snapshot_vs_checkpoint_stall']:.2f}x); restore from memory "
          f"{med['memory']:.3f} s, from the store {med['store']:.3f} s (download and check {med['download']:.3f} s):"
          f" {result['memory_vs_store_restore']:.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
