"""A node's self-check, run by the node agent before it reports ready: a matmul with a known answer
on every local device and an all-reduce across the local slots. Prints one JSON line; exit 0 = healthy.

    python -m flightdeck.trainer.selfcheck --slots 2 [--device cpu|cuda] [--timeout 60]
"""

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def matmul_check(device: torch.device) -> None:
    # (I * 2) @ B == 2B exactly in any float format: a wrong answer means broken hardware or drivers.
    n = 256
    b = torch.arange(n * n, dtype=torch.float32, device=device).reshape(n, n) % 7
    a = torch.eye(n, device=device) * 2
    got = a @ b
    if not torch.equal(got, b * 2):
        raise RuntimeError(f"matmul on {device} gave a wrong answer (max error {(got - 2 * b).abs().max().item()})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, use_cuda: bool) -> None:
    backend = "nccl" if use_cuda else "gloo"
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        matmul_check(device)
        t = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(t)
        expected = world * (world + 1) / 2
        if not bool((t == expected).all()):
            raise RuntimeError(f"all-reduce across {world} slots gave {t[0].item()}, expected {expected}")
    finally:
        dist.destroy_process_group()


def run(slots: int, use_cuda: bool) -> dict[str, object]:
    started = time.perf_counter()
    if use_cuda and torch.cuda.device_count() < slots:
        raise RuntimeError(f"{slots} slots asked for but only {torch.cuda.device_count()} CUDA devices are visible")
    devices = [torch.cuda.get_device_name(i) for i in range(slots)] if use_cuda else ["cpu"] * slots
    if slots == 1:
        matmul_check(torch.device("cuda", 0) if use_cuda else torch.device("cpu"))
    else:
        # CUDA cannot be initialised in a forked child; CPU ranks fork to start fast.
        method = "spawn" if use_cuda else "fork"
        mp.start_processes(_rank, args=(slots, _free_port(), use_cuda), nprocs=slots, start_method=method)
    return {"ok": True, "seconds": round(time.perf_counter() - started, 3), "devices": devices}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m flightdeck.trainer.selfcheck")
    parser.add_argument("--slots", type=int, default=1)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    use_cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    try:
        result = run(args.slots, use_cuda)
    except Exception as exc:  # any failure is the finding: report it, never crash without a verdict
        print(json.dumps({"ok": False, "reason": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
