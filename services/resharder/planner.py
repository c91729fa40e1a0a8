"""The 3D-parallel planner: DP x TP x PP, ZeRO stage, micro-batches and gradient accumulation for a model
on a set of slots, and the training-days estimate. Pure functions; memory.py holds the memory model.

Why it works this way: docs/internals.md, "4. Resources and the resharder".
"""

import math
from dataclasses import dataclass

from flightdeck.events.plan import MIN_MICRO_BATCHES_PER_STAGE, ParallelPlan, batch_splits, bubble, nearest_layouts
from flightdeck.services.resharder import memory
from flightdeck.services.resharder.gpus import GpuType
from flightdeck.services.resharder.memory import MemoryEstimate
from flightdeck.services.resharder.shapes import ModelShape

ZERO_STAGES = (0, 1, 2, 3)
SECONDS_PER_DAY = 86_400


class PlanError(ValueError):
    """No layout of these slots can train this model; the message says why and what to change."""


@dataclass(frozen=True, slots=True)
class Slots:
    world: int
    gpus_per_node: int
    gpu: GpuType

    def __post_init__(self) -> None:
        if self.world < 1 or self.gpus_per_node < 1:
            raise PlanError(f"need at least one GPU and one GPU per node, got {self.world} and {self.gpus_per_node}")

    @property
    def node_size(self) -> int:
        return math.gcd(self.gpus_per_node, self.world)


@dataclass(frozen=True, slots=True)
class Planned:
    plan: ParallelPlan
    memory: MemoryEstimate

    @property
    def bubble(self) -> float:
        return bubble(self.plan)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def layouts(model: ModelShape, slots: Slots, global_batch: int) -> list[tuple[int, int, int]]:
    """Every (tp, pp, dp) the rules allow, in search order."""
    found = []
    for tp in divisors(math.gcd(model.heads, slots.node_size)):
        for pp in divisors(model.layers):
            if slots.world % (tp * pp):
                continue
            dp = slots.world // (tp * pp)
            if global_batch % dp or (pp > 1 and global_batch // dp < MIN_MICRO_BATCHES_PER_STAGE * pp):
                continue
            found.append((tp, pp, dp))
    return sorted(found, key=lambda layout: (layout[0] * layout[1], layout[1]))


def plan(model: ModelShape, slots: Slots, global_batch: int, asked: tuple[int, int] = (1, 1)) -> Planned:
    """The first layout in search order that fits; PlanError if none does. `asked` (the spec's [parallel] TP x PP)
    narrows the search to that layout and the smaller ones nearest it (events/plan.py, nearest_layouts)."""
    if global_batch < 1:
        raise PlanError(f"the global batch must be at least one sequence, got {global_batch}")
    found = layouts(model, slots, global_batch)
    if asked != (1, 1):
        nearest = nearest_layouts(slots.world, *asked)
        found = sorted((f for f in found if f[:2] in nearest), key=lambda f: nearest.index(f[:2]))
    if not found:
        raise PlanError(_no_layout(model, slots, global_batch))
    usable = memory.usable_gb(slots.gpu)
    for tp, pp, dp in found:
        for zero in ZERO_STAGES if dp > 1 else (0,):  # ZeRO shards over DP: nothing to gain at DP = 1
            for size, micro, accum in batch_splits(global_batch // dp, pp):
                need = memory.estimate(model, tp=tp, pp=pp, dp=dp, zero_stage=zero, micro_batch_size=size,
                                       micro_batches=micro)
                if need.total_gb <= usable:
                    return Planned(ParallelPlan(world_size=slots.world, dp=dp, tp=tp, pp=pp, zero_stage=zero,
                                                micro_batches=micro, grad_accum=accum, micro_batch_size=size,
                                                memory_per_gpu_gb=round(need.total_gb, 3)), need)
    raise PlanError(_too_big(model, slots, global_batch, found))


def evaluate(model: ModelShape, slots: Slots, global_batch: int, *, dp: int, tp: int, pp: int,
             zero_stage: int | None = None, micro_batch_size: int | None = None) -> Planned:
    """A given layout (as a paper states it) checked and costed. Stages may be uneven; ZeRO, when not given, is
    the lowest stage that fits, and the micro-batch the largest that fits (the smallest when none does: the
    caller compares `memory.total_gb` with what the GPU holds). PlanError says what does not add up."""
    if dp * tp * pp != slots.world:
        raise PlanError(f"DP {dp} x TP {tp} x PP {pp} is {dp * tp * pp} GPUs, but there are {slots.world}: the "
                        "three sizes multiply to the number of GPUs")
    if global_batch % dp:
        raise PlanError(f"a global batch of {global_batch} sequences does not split over DP {dp}: use a multiple "
                        f"of {dp}")
    per_replica = global_batch // dp
    if micro_batch_size is not None and per_replica % micro_batch_size:
        raise PlanError(f"a micro-batch of {micro_batch_size} does not divide the {per_replica} sequences each "
                        f"replica takes per step ({global_batch} / DP {dp})")
    sizes = [micro_batch_size] if micro_batch_size is not None else list(reversed(divisors(per_replica)))
    zeros = [zero_stage] if zero_stage is not None else (list(ZERO_STAGES) if dp > 1 else [0])
    usable, tried = memory.usable_gb(slots.gpu), None
    try:
        for zero in zeros:
            for size in sizes:
                count = per_replica // size
                micro, accum = (1, count) if pp == 1 else (count, 1)
                need = memory.estimate(model, tp=tp, pp=pp, dp=dp, zero_stage=zero, micro_batch_size=size,
                                       micro_batches=micro)
                tried = Planned(ParallelPlan(world_size=slots.world, dp=dp, tp=tp, pp=pp, zero_stage=zero,
                                             micro_batches=micro, grad_accum=accum, micro_batch_size=size,
                                             memory_per_gpu_gb=round(need.total_gb, 3)), need)
                if need.total_gb <= usable:
                    return tried
    except memory.InvalidLayout as exc:
        raise PlanError(str(exc)) from None
    assert tried is not None
    return tried


def splitting_batches(model: ModelShape, slots: Slots, near: int, count: int = 3) -> list[int]:
    """Global batches closest to `near` that some layout of these slots splits (what to ask for instead)."""
    options: set[int] = set()
    for tp in divisors(math.gcd(model.heads, slots.node_size)):
        for pp in divisors(model.layers):
            if slots.world % (tp * pp):
                continue
            dp = slots.world // (tp * pp)
            for batch in (near // dp * dp, -(-near // dp) * dp):
                if batch >= 1 and (pp == 1 or batch // dp >= MIN_MICRO_BATCHES_PER_STAGE * pp):
                    options.add(batch)
    return sorted(options, key=lambda b: (abs(b - near), b))[:count]


def training_days(params: float, tokens: float, gpus: int, gpu: GpuType, mfu: float) -> float:
    """6 · params · tokens FLOPs (forward + backward) at `mfu` of the GPUs' dense bf16 peak, in days."""
    assert gpu.peak_flops > 0 and 0 < mfu <= 1, (gpu, mfu)
    return days_at(params, tokens, gpus, gpu.peak_flops * mfu)


def days_at(params: float, tokens: float, gpus: int, flops_per_gpu: float) -> float:
    """6 · params · tokens FLOPs at a sustained `flops_per_gpu` (what papers report as TFLOP/s per GPU), in days."""
    assert flops_per_gpu > 0, flops_per_gpu
    return 6 * params * tokens / (gpus * flops_per_gpu) / SECONDS_PER_DAY


def count(n: float) -> str:
    """175e9 -> "175B": a parameter or token count as people write it."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:.4g}"


def _no_layout(model: ModelShape, slots: Slots, global_batch: int) -> str:
    tps = divisors(math.gcd(model.heads, slots.node_size))
    return (f"no DP x TP x PP layout of {slots.world} GPUs splits a global batch of {global_batch} sequences: "
            f"DP = {slots.world} / (TP · PP) must divide the batch, TP from {tps} (within a node of "
            f"{slots.node_size}, dividing {model.heads} heads), PP dividing {model.layers} layers, and PP > 1 "
            f"needs at least {MIN_MICRO_BATCHES_PER_STAGE} · PP sequences per replica; use a global batch that "
            f"is a multiple of {slots.world}, or another number of GPUs")


def _too_big(model: ModelShape, slots: Slots, global_batch: int, found: list[tuple[int, int, int]]) -> str:
    def leanest(tp: int, pp: int, dp: int) -> MemoryEstimate:
        size, micro, _ = min(batch_splits(global_batch // dp, pp))
        return memory.estimate(model, tp=tp, pp=pp, dp=dp, zero_stage=3 if dp > 1 else 0, micro_batch_size=size,
                               micro_batches=micro)

    need, (tp, pp, dp) = min(((leanest(*layout), layout) for layout in found), key=lambda pair: pair[0].total_gb)
    parts = ", ".join(f"{name} {value:.1f}" for name, value in (
        ("params", need.params_gb), ("grads", need.grads_gb), ("optimizer", need.optimizer_gb),
        ("activations", need.activations_gb)))
    return (f"a {count(model.params)}-param model needs {need.total_gb:.1f} GB per GPU ({parts}) even with "
            f"TP={tp}, PP={pp}, DP={dp}, ZeRO-{3 if dp > 1 else 0}, micro-batch 1, on {slots.world} "
            f"{slots.gpu.name} GPUs with {slots.gpu.memory_gb:g} GB ({memory.usable_gb(slots.gpu):.0f} GB usable "
            f"after headroom): use more GPUs or GPUs with more memory")
