"""`flightdeck plan`: the 3D-parallel plan, memory per GPU and training days for a model on N GPUs.

Offline: no broker. Layers, heads and hidden size not given are derived from the parameter count with
GPT-3's proportions (services/resharder/shapes.py); the global batch defaults to ~4M tokens. A published setup
goes in as its paper states it: `--tflops` (sustained per GPU) instead of `--mfu`, and `--dp/--tp/--pp/--zero`
to evaluate its layout (uneven pipeline stages too) instead of searching for one. Days do not depend on the
layout: they are given even when no layout splits the batch (with the batches that would split).
"""

import argparse
import json
import math
import sys
from typing import Any

from flightdeck.services.resharder import gpus, planner, shapes
from flightdeck.services.resharder.memory import usable_gb
from flightdeck.services.tools.cli import Command, UserError

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
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--mfu", type=_fraction,
                       help=f"model FLOPs utilization, a fraction of dense bf16 peak (default {DEFAULT_MFU})")
    speed.add_argument("--tflops", type=_positive,
                       help="sustained TFLOP/s per GPU, as training reports state it (instead of --mfu)")
    parser.add_argument("--gpus-per-node", type=_count, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--layers", type=_count, help="transformer layers (default: derived from --params)")
    parser.add_argument("--heads", type=_count, help="attention heads (default: hidden / 128)")
    parser.add_argument("--hidden", type=_count, help="hidden size (default: derived from --params)")
    parser.add_argument("--seq-len", type=_count, help=f"sequence length (default {shapes.DEFAULT_SEQ_LEN})")
    parser.add_argument("--vocab", type=_count, help=f"vocabulary size (default {shapes.DEFAULT_VOCAB})")
    parser.add_argument("--global-batch", type=_count,
                        help="sequences per optimizer step (default: ~4M tokens' worth)")
    parser.add_argument("--dp", type=_count, help="evaluate this layout: data-parallel replicas (default: the GPUs "
                        "left by TP x PP)")
    parser.add_argument("--tp", type=_count, help="evaluate this layout: tensor-parallel size (default 1 when "
                        "--dp or --pp is given)")
    parser.add_argument("--pp", type=_count, help="evaluate this layout: pipeline stages, even or not (default 1 "
                        "when --dp or --tp is given)")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3),
                        help="evaluate with this ZeRO stage (default: the lowest that fits)")
    parser.add_argument("--micro-batch-size", type=_count,
                        help="evaluate with this micro-batch size (default: the largest that fits)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def given_layout(args: argparse.Namespace) -> tuple[int, int, int] | None:
    """(dp, tp, pp) when any of them, --zero or --micro-batch-size is given; the ones left out fill in."""
    if all(getattr(args, k) is None for k in ("dp", "tp", "pp", "zero", "micro_batch_size")):
        return None
    tp, pp = args.tp or 1, args.pp or 1
    if args.dp is None and args.gpus % (tp * pp):
        raise UserError(f"TP {tp} x PP {pp} does not divide {args.gpus} GPUs: give --dp, or sizes that divide",
                        EXIT_NO_PLAN)
    return args.dp or args.gpus // (tp * pp), tp, pp


def run(args: argparse.Namespace) -> int:
    try:
        gpu = gpus.lookup(args.gpu)
        model = shapes.derive(args.params, layers=args.layers, heads=args.heads, hidden=args.hidden,
                              seq_len=args.seq_len, vocab=args.vocab)
        batch = args.global_batch or shapes.default_global_batch(model.seq_len)
        slots = planner.Slots(args.gpus, args.gpus_per_node, gpu)
        layout = given_layout(args)
        speed = speed_of(args, gpu)
        no_layout, planned = "", None
        if layout is not None:
            dp, tp, pp = layout
            planned = planner.evaluate(model, slots, batch, dp=dp, tp=tp, pp=pp, zero_stage=args.zero,
                                       micro_batch_size=args.micro_batch_size)
        elif planner.layouts(model, slots, batch):
            planned = planner.plan(model, slots, batch)
        else:  # the days stand anyway; say which batches would split
            splits = planner.splitting_batches(model, slots, batch)
            no_layout = (f"no DP x TP x PP layout of {args.gpus} GPUs splits a global batch of {batch} sequences; "
                         f"ones that split: {', '.join(map(str, splits))} (--global-batch)")
    except (gpus.UnknownGpu, shapes.InvalidShape, planner.PlanError) as exc:
        raise UserError(str(exc), EXIT_NO_PLAN) from None
    report = summary(args, model, gpu, batch, planned, speed, no_layout, given=layout is not None)
    sys.stdout.write(json.dumps(report) + "\n" if args.json else human(report))
    if planned is not None and not report["fits"]:
        raise UserError(f"the given layout needs {planned.memory.total_gb:.1f} GB per GPU, more than the "
                        f"{usable_gb(gpu):.0f} GB usable on a {gpu.name}", EXIT_NO_PLAN)
    return 0


def speed_of(args: argparse.Namespace, gpu: gpus.GpuType) -> tuple[float, float | None]:
    """(sustained TFLOP/s per GPU, MFU) from --tflops or --mfu; MFU is None for a GPU without a rated peak."""
    if args.tflops is not None:
        return args.tflops, args.tflops / gpu.peak_tflops if gpu.peak_tflops else None
    mfu = args.mfu if args.mfu is not None else DEFAULT_MFU
    if not gpu.peak_tflops:
        raise planner.PlanError(f"{gpu.name} has no rated peak to take an MFU of: give --tflops")
    return gpu.peak_tflops * mfu, mfu


def summary(args: argparse.Namespace, model: shapes.ModelShape, gpu: gpus.GpuType, batch: int,
            planned: planner.Planned | None, speed: tuple[float, float | None], no_layout: str, *,
            given: bool) -> dict[str, Any]:
    derived = [name for name in ("layers", "heads", "hidden") if getattr(args, name) is None]
    tflops, mfu = speed
    report: dict[str, Any] = {
        "days": planner.days_at(model.params, args.tokens, args.gpus, tflops * 1e12),
        "sustained_tflops": tflops, "mfu": mfu, "global_batch": batch, "usable_gb": usable_gb(gpu),
        "gpu": {"key": gpu.key, "name": gpu.name, "memory_gb": gpu.memory_gb, "peak_tflops": gpu.peak_tflops},
        "model": {"params": model.params, "layers": model.layers, "heads": model.heads, "hidden": model.hidden,
                  "seq_len": model.seq_len, "vocab": model.vocab, "derived": derived},
        "tokens": args.tokens, "gpus_per_node": args.gpus_per_node, "world_size": args.gpus,
        "layout_given": given, "no_layout": no_layout,
    }
    if planned is None:
        return report
    p = planned.plan
    return report | {
        "dp": p.dp, "tp": p.tp, "pp": p.pp, "zero_stage": p.zero_stage, "stage_layers": stages(model.layers, p.pp),
        "micro_batches": p.micro_batches, "micro_batch_size": p.micro_batch_size, "grad_accum": p.grad_accum,
        "bubble": planned.bubble, "memory_per_gpu_gb": planned.memory.total_gb,
        "memory_gb": planned.memory.as_dict(), "fits": planned.memory.total_gb <= usable_gb(gpu),
    }


def stages(layers: int, pp: int) -> dict[int, int]:
    """Layers per stage -> how many stages hold that many (one entry when the split is even)."""
    heavy, light = -(-layers // pp), layers // pp
    n_heavy = layers - light * pp
    return {heavy: n_heavy, light: pp - n_heavy} if n_heavy else {light: pp}


def human(r: dict[str, Any]) -> str:
    m, g = r["model"], r["gpu"]
    derived = f"  ({', '.join(m['derived'])} derived from params, GPT-3-like)" if m["derived"] else ""
    speed = f"{r['sustained_tflops']:.4g} TFLOP/s per GPU" + (f" (MFU {r['mfu']:.2f})" if r["mfu"] else "")
    lines = [
        f"model       {planner.count(m['params'])} params: {m['layers']} layers, {m['heads']} heads, hidden "
        f"{m['hidden']}, seq {m['seq_len']}, vocab {m['vocab']}{derived}",
        f"gpus        {r['world_size']} x {g['name']} ({g['memory_gb']:g} GB, {g['peak_tflops']:g} TFLOP/s "
        f"dense bf16), {r['gpus_per_node']} per node",
    ]
    if r["no_layout"]:
        lines.append(f"layout      none: {r['no_layout']}")
    else:
        mem = r["memory_gb"]
        split = " + ".join(f"{n} x {k}" for k, n in sorted(r["stage_layers"].items(), reverse=True))
        uneven = f"; stages of uneven depth: {split} layers" if len(r["stage_layers"]) > 1 else ""
        fits = "" if r["fits"] else "  DOES NOT FIT"
        lines += [
            f"layout      DP {r['dp']} x TP {r['tp']} x PP {r['pp']}, ZeRO-{r['zero_stage']}"
            f"{' (as given)' if r['layout_given'] else ''}{uneven}",
            f"batch       {r['global_batch']} sequences = DP {r['dp']} x micro-batch {r['micro_batch_size']} x "
            f"{r['micro_batches']} micro-batches x grad-accum {r['grad_accum']}; pipeline bubble {r['bubble']:.0%}",
            f"memory/GPU  params {mem['params_gb']:.2f} + grads {mem['grads_gb']:.2f} + optimizer "
            f"{mem['optimizer_gb']:.2f} + activations {mem['activations_gb']:.2f} = {mem['total_gb']:.2f} GB "
            f"(of {r['usable_gb']:.0f} GB usable){fits}",
        ]
    lines.append(f"training    {planner.count(r['tokens'])} tokens at {speed}: {r['days']:.1f} days")
    return "\n".join(lines) + "\n"


COMMAND = Command("plan", "plan DP x TP x PP, ZeRO and micro-batches for a model on N GPUs, with memory and days",
                  add_arguments, run)
