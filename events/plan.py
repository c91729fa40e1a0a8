"""Parallel plans: how a job's model is laid out over the slots it has."""

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


class ReshardPlanned(JobEvent, frozen=True, kw_only=True):
    old: ParallelPlan | None
    new: ParallelPlan
    reason: str
