"""How long the training loop is blocked per checkpoint: our two-phase snapshot against a synchronous
torch.save of the same state to the same disk and dcp.async_save's blocking part (default settings).
On CUDA it also times a plain pinned device-to-host copy of the same bytes, the snapshot's ceiling.

    python bench/checkpoint_stall.py                                  # CPU, ~25M params (300 MB of state)
    python bench/checkpoint_stall.py --device cuda --params 350e6     # ~4.2 GB of state on a GPU

State = parameters + AdamW's two moments, fp32: 12 bytes a parameter. Goals: CPU ours <= 0.25x torch.save;
CUDA ours <= 0.05x torch.save, <= 0.1x dcp.async_save blocking, snapshot bandwidth >= 0.8x pinned copy.
On CUDA the loop only queues the copies (side stream) and goes on; `ours_snapshot_complete` is when the
bytes are in host memory, and the next optimizer step waits for that on the GPU, never on the host.
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flightdeck.events.base import RankEvent
from flightdeck.trainer import distributed
from flightdeck.trainer.checkpointing import Checkpointer
from flightdeck.trainer.cursor import BatchCursor

CHUNK = 1 << 22  # elements per tensor: a model's state is many tensors, not one


def make_state(params: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    state = {}
    left, i = params, 0
    while left > 0:
        n = min(CHUNK, left)
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            state[f"{kind}.{i}"] = torch.randn(n, generator=g, device=device)
        left -= n
        i += 1
    return state


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ours(state: dict[str, torch.Tensor], root: Path, dist: distributed.Dist,
              repeats: int) -> tuple[list[float], list[float]]:
    staged: list[RankEvent] = []
    ckpt = Checkpointer(job_id="bench", staging=root, dist=dist, emit=staged.append,
                        envelope={"job_id": "bench", "rank": 0})
    ckpt.prepare(state)  # the loop allocates its pinned buffers once, before training
    position = BatchCursor().position()
    stalls, copies = [], []
    for step in range(repeats):
        sync(dist.device)
        t = time.perf_counter()
        stalls.append(ckpt.save(step, state, position))
        ckpt.snapshot_done()  # on CUDA the copy finishes behind the loop's back; how long it takes is bandwidth
        copies.append(time.perf_counter() - t)
        ckpt.before_update()
        ckpt.wait()  # the write is background work; not part of the stall
    # The next optimizer step must not change what the snapshot is still copying: update at once, then check.
    last = list(state)[-3:]
    before = {k: state[k].clone() for k in last}
    ckpt.save(repeats, state, position)
    ckpt.before_update()
    for tensor in state.values():
        tensor.add_(1.0)
    ckpt.wait()
    assert all(torch.equal(ckpt.buffers[k], before[k].cpu()) for k in last), "snapshot raced the update"
    for tensor in state.values():
        tensor.sub_(1.0)
    assert len(staged) == repeats + 1
    return stalls, copies


def time_torch_save(state: dict[str, torch.Tensor], root: Path, repeats: int, device: torch.device) -> list[float]:
    out = []
    for i in range(repeats):
        sync(device)
        t = time.perf_counter()
        torch.save(state, root / f"torch-{i}.pt")
        out.append(time.perf_counter() - t)
        (root / f"torch-{i}.pt").unlink()
    return out


def time_async_save(state: dict[str, torch.Tensor], root: Path, repeats: int, device: torch.device) -> list[float]:
    out = []
    for i in range(repeats):
        sync(device)
        t = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(root / f"async-{i}"))
        out.append(time.perf_counter() - t)
        fut.result()
        shutil.rmtree(root / f"async-{i}")
    return out


def time_pinned_copy(state: dict[str, torch.Tensor], repeats: int, device: torch.device) -> list[float]:
    host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=device.type == "cuda") for k, t in state.items()}
    out = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        for k, v in state.items():
            host[k].copy_(v, non_blocking=device.type == "cuda")
        sync(device)
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--params", type=float, default=25e6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=None, help="where checkpoints are written (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    args = p.parse_args()
    dist = distributed.init(0, 1, 0, args.device)
    state = make_state(int(args.params), dist.device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        stalls, copies = time_ours(state, root, dist, args.repeats)
        runs = {"ours_stall": stalls, "ours_snapshot_complete": copies,
                "torch_save": time_torch_save(state, root, args.repeats, dist.device),
                "dcp_async_save_blocking": time_async_save(state, root, args.repeats, dist.device),
                "plain_copy": time_pinned_copy(state, args.repeats, dist.device)}
        ours, snap, torch_save, async_save, pinned = (statistics.median(v) for v in runs.values())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "device": torch.cuda.get_device_name(dist.device) if args.device == "cuda" else "cpu",
        "torch": torch.__version__, "params": int(args.params), "state_bytes": nbytes, "repeats": args.repeats,
        "seconds": {"ours_stall": ours, "ours_snapshot_complete": snap, "torch_save": torch_save,
                    "dcp_async_save_blocking": async_save, "plain_copy": pinned},
        "each_run_s": runs,
        "ratios": {"ours_vs_torch_save": ours / torch_save, "ours_vs_dcp_async_save": ours / async_save,
                   "snapshot_bw_vs_plain_copy": pinned / snap},
        "snapshot_GBps": nbytes / snap / 1e9, "plain_copy_GBps": nbytes / pinned / 1e9,
        "goals": ({"ours_vs_torch_save": 0.05, "ours_vs_dcp_async_save": 0.1, "snapshot_bw_vs_plain_copy": 0.8}
                  if args.device == "cuda" else {"ours_vs_torch_save": 0.25}),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
