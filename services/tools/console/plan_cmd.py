"""`flightdeck plan`: the 3D-parallel plan, memory per GPU and training days for a model on N GPUs.

Offline: no broker. Layers, heads and hidden size not given are derived from the parameter count with
GPT-3's proportions (services/resharder/shapes.py); the global batch defaults to ~4M tokens.
"""

import argparse
import json
import math
import sys
from typing import Any

from services.resharder import gpus, planner, shapes
from services.resharder.memory import usable_gb
from services.tools.cli import Command, UserError

EXIT_NO_PLAN = 2  # no layout fits, or a shape/GPU the planner cannot use: the request must change
DEFAULT_MFU = 0.4  # large dense runs report ~35-55% model FLOPs utilization


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def _count(text: str) -> int:
    """A whole number, written plainly or as 8e3."""
    value = _positive(text)
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number")
    return int(value)


def _fraction(text: str) -> float:
    value = _positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction in (0, 1]")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", type=_positive, required=True, help="model parameters, e.g. 175e9")
    parser.add_argument("--tokens", type=_positive, required=True, help="training tokens, e.g. 10e12")
    parser.add_argument("--gpus", type=_count, required=True, help="GPUs in all, e.g. 8192")
    parser.add_argument("--gpu", default="h100", help=f"GPU type: {', '.join(g.key for g in gpus.KNOWN)} "
                        "(default h100)")
    parser.add_argument("--mfu", type=_fraction, default=DEFAULT_MFU,
                        help=f"model FLOPs utilization, a fraction of dense bf16 peak (default {DEFAULT_MFU})")
    parser.add_argument("--gpus-per-node", type=_count, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--layers", type=_count, help="transformer layers (default: derived from --params)")
    parser.add_argument("--heads", type=_count, help="attention heads (default: hidden / 128)")
    parser.add_argument("--hidden", type=_count, help="hidden size (default: derived from --params)")
    parser.add_argument("--seq-len", type=_count, help=f"sequence length (default {shapes.DEFAULT_SEQ_LEN})")
    parser.add_argument("--vocab", type=_count, help=f"vocabulary size (default {shapes.DEFAULT_VOCAB})")
    parser.add_argument("--global-batch", type=_count,
                        help="sequences per optimizer step (default: ~4M tokens' worth)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        gpu = gpus.lookup(args.gpu)
        model = shapes.derive(args.params, layers=args.layers, heads=args.heads, hidden=args.hidden,
                              seq_len=args.seq_len, vocab=args.vocab)
        batch = args.global_batch or shapes.default_global_batch(model.seq_len)
        planned = planner.plan(model, planner.Slots(args.gpus, args.gpus_per_node, gpu), batch)
    except (gpus.UnknownGpu, shapes.InvalidShape, planner.PlanError) as exc:
        raise UserError(str(exc), EXIT_NO_PLAN) from None
    report = summary(args, model, gpu, batch, planned)
    sys.stdout.write(json.dumps(report) + "\n" if args.json else human(report))
    return 0


def summary(args: argparse.Namespace, model: shapes.ModelShape, gpu: gpus.GpuType, batch: int,
            planned: planner.Planned) -> dict[str, Any]:
    p = planned.plan
    derived = [name for name in ("layers", "heads", "hidden") if getattr(args, name) is None]
    return {
        "days": planner.training_days(model.params, args.tokens, args.gpus, gpu, args.mfu),
        "world_size": p.world_size, "dp": p.dp, "tp": p.tp, "pp": p.pp, "zero_stage": p.zero_stage,
        "micro_batches": p.micro_batches, "micro_batch_size": p.micro_batch_size, "grad_accum": p.grad_accum,
        "global_batch": batch, "bubble": planned.bubble,
        "memory_per_gpu_gb": planned.memory.total_gb, "memory_gb": planned.memory.as_dict(),
        "usable_gb": usable_gb(gpu),
        "gpu": {"key": gpu.key, "name": gpu.name, "memory_gb": gpu.memory_gb, "peak_tflops": gpu.peak_tflops},
        "model": {"params": model.params, "layers": model.layers, "heads": model.heads, "hidden": model.hidden,
                  "seq_len": model.seq_len, "vocab": model.vocab, "derived": derived},
        "tokens": args.tokens, "mfu": args.mfu, "gpus_per_node": args.gpus_per_node,
    }


def human(r: dict[str, Any]) -> str:
    m, g, mem = r["model"], r["gpu"], r["memory_gb"]
    derived = f"  ({', '.join(m['derived'])} derived from params, GPT-3-like)" if m["derived"] else ""
    lines = [
        f"model       {planner.count(m['params'])} params: {m['layers']} layers, {m['heads']} heads, hidden "
        f"{m['hidden']}, seq {m['seq_len']}, vocab {m['vocab']}{derived}",
        f"gpus        {r['world_size']} x {g['name']} ({g['memory_gb']:g} GB, {g['peak_tflops']:g} TFLOP/s "
        f"dense bf16), {r['gpus_per_node']} per node",
        f"layout      DP {r['dp']} x TP {r['tp']} x PP {r['pp']}, ZeRO-{r['zero_stage']}",
        f"batch       {r['global_batch']} sequences = DP {r['dp']} x micro-batch {r['micro_batch_size']} x "
        f"{r['micro_batches']} micro-batches x grad-accum {r['grad_accum']}; pipeline bubble {r['bubble']:.0%}",
        f"memory/GPU  params {mem['params_gb']:.2f} + grads {mem['grads_gb']:.2f} + optimizer "
        f"{mem['optimizer_gb']:.2f} + activations {mem['activations_gb']:.2f} = {mem['total_gb']:.2f} GB "
        f"(of {r['usable_gb']:.0f} GB usable)",
        f"training    {planner.count(r['tokens'])} tokens at MFU {r['mfu']:.2f}: {r['days']:.1f} days",
    ]
    return "\n".join(lines) + "\n"


COMMAND = Command("plan", "plan DP x TP x PP, ZeRO and micro-batches for a model on N GPUs, with memory and days",
                  add_arguments, run)
