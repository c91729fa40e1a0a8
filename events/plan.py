"""Parallel plans: how a job's model is laid out over the slots it has."""

from collections.abc import Iterator

import msgspec

from flightdeck.events.base import JobEvent


class ParallelPlan(msgspec.Struct, frozen=True, kw_only=True):
    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    micro_batches: int = 1
    grad_accum: int = 1
    micro_batch_size: int = 1
    memory_per_gpu_gb: float = 0.0


MESH_DIMS = ("pp", "dp", "tp")  # a script's mesh, outermost first: TP innermost keeps a TP group on one node


def coordinates(plan: ParallelPlan, rank: int) -> dict[str, int]:
    """Where `rank` sits in a mesh built as MESH_DIMS (examples/tp_pp): its pipeline stage, replica and TP rank."""
    return dict(zip(MESH_DIMS, (rank // (plan.tp * plan.dp), rank // plan.tp % plan.dp, rank % plan.tp), strict=True))


def bubble(plan: ParallelPlan) -> float:
    """The share of a 1F1B pipeline's time its stages idle: (stages - 1) / micro-batches; 0 without a pipeline."""
    return (plan.pp - 1) / max(1, plan.micro_batches)


def described(plan: ParallelPlan) -> str:
    """The layout in words, as status and the dashboard show it."""
    words = f"TP {plan.tp} x PP {plan.pp} x DP {plan.dp} on {plan.world_size} ranks"
    if plan.pp > 1:
        words += f", {plan.micro_batches} micro-batches (pipeline bubble {bubble(plan):.0%})"
    if plan.memory_per_gpu_gb > 0:
        words += f", {plan.memory_per_gpu_gb:.3g} GB planned per rank"
    return words


def nearest_layouts(world: int, tp: int, pp: int) -> list[tuple[int, int]]:
    """The (tp, pp) a job that asked for `tp` x `pp` may run on `world` ranks, nearest first: the asked sizes or
    smaller ones dividing them, the most model parallelism first and TP kept before PP (its groups stay in a node,
    and a smaller TP group would need the same heads split anew). (1, 1) is always last, plain data parallelism."""
    found = [(t, p) for t in range(tp, 0, -1) if tp % t == 0 for p in range(pp, 0, -1)
             if pp % p == 0 and world % (t * p) == 0]
    return sorted(found, key=lambda layout: (-layout[0] * layout[1], -layout[0]))


MIN_MICRO_BATCHES_PER_STAGE = 4  # a pipeline's micro-batches per stage, at least: its bubble stays small


def batch_splits(per_replica: int, pp: int) -> Iterator[tuple[int, int, int]]:
    """(micro_batch_size, micro_batches, grad_accum) for one replica's share, largest micro-batch first."""
    divisors = [d for d in range(per_replica, 0, -1) if per_replica % d == 0]
    for size in divisors:
        count = per_replica // size
        if pp == 1:
            yield size, 1, count
        elif count >= MIN_MICRO_BATCHES_PER_STAGE * pp:
            yield size, count, 1


def unplanned(world: int, tp: int = 1, pp: int = 1, global_batch: int = 0) -> ParallelPlan:
    """A rank's layout when no plan was recorded (no resharder, or no platform): the asked TP x PP nearest to what
    the world holds, data parallelism over the rest, and the batch split as the planner splits it when the layout
    fits (services/resharder/planner.py): a script run alone then sums its micro-batches as on the platform, and
    trains bitwise alike. Without a `global_batch` it splits over, as many micro-batches as stages."""
    t, p = nearest_layouts(world, tp, pp)[0]
    dp = world // (t * p)
    if global_batch > 0 and global_batch % dp == 0:
        for size, micro, accum in batch_splits(global_batch // dp, p):
            return ParallelPlan(world_size=world, dp=dp, tp=t, pp=p, micro_batches=micro, grad_accum=accum,
                                micro_batch_size=size)
    return ParallelPlan(world_size=world, dp=dp, tp=t, pp=p, micro_batches=max(1, p))


class ReshardPlanned(JobEvent, frozen=True, kw_only=True):
    old: ParallelPlan | None
    new: ParallelPlan
    reason: str
