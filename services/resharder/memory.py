"""Memory per GPU for one layout: parameters, gradients, optimizer states and activations.

Why it works this way: docs/internals.md, "4. Resources and the resharder".
"""

from dataclasses import dataclass

from flightdeck.services.resharder.gpus import GpuType
from flightdeck.services.resharder.shapes import ModelShape

GB = 1e9
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 2, 12
ACTIVATION_BYTES_PER_LAYER = 34  # per s·b·h, one transformer layer without recomputation (fused attention)
CHECKPOINT_BYTES = 2  # per s·b·h, the bf16 layer input kept for recomputation
LOGIT_BYTES = 4
ZERO3_LAYERS_GATHERED = 2
# CUDA context, NCCL buffers and allocator fragmentation take several GB that no formula here sees.
HEADROOM = 0.85


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    params_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float

    @property
    def total_gb(self) -> float:
        return self.params_gb + self.grads_gb + self.optimizer_gb + self.activations_gb

    def as_dict(self) -> dict[str, float]:
        return {"params_gb": self.params_gb, "grads_gb": self.grads_gb, "optimizer_gb": self.optimizer_gb,
                "activations_gb": self.activations_gb, "total_gb": self.total_gb}


class InvalidLayout(ValueError):
    """A layout that cannot hold the model as given; the message names the number to change."""


def stage_layers(layers: int, pp: int) -> int:
    """Layers on the heaviest pipeline stage: stages may be uneven (BLOOM ran 70 layers on 12 stages)."""
    return -(-layers // pp)


def check_layout(model: ModelShape, *, tp: int, pp: int, dp: int, zero_stage: int, micro_batch_size: int = 1,
                 micro_batches: int = 1) -> None:
    """InvalidLayout unless every size is positive, TP divides the heads and PP leaves every stage a layer."""
    sizes = {"TP": tp, "PP": pp, "DP": dp, "micro-batch size": micro_batch_size, "micro-batches": micro_batches}
    if bad := [f"{name} {value}" for name, value in sizes.items() if value < 1]:
        raise InvalidLayout(f"{', '.join(bad)}: every size of a layout is at least 1")
    if model.heads % tp:
        raise InvalidLayout(f"TP {tp} does not divide the model's {model.heads} attention heads: each TP rank "
                            "holds whole heads")
    if pp > model.layers:
        raise InvalidLayout(f"PP {pp} stages for {model.layers} layers: every stage needs at least one layer")
    if zero_stage not in (0, 1, 2, 3):
        raise InvalidLayout(f"ZeRO stage {zero_stage}: the stages are 0, 1, 2 and 3")


def usable_gb(gpu: GpuType) -> float:
    return gpu.memory_gb * HEADROOM


def estimate(model: ModelShape, *, tp: int, pp: int, dp: int, zero_stage: int, micro_batch_size: int,
             micro_batches: int) -> MemoryEstimate:
    """The heaviest GPU's memory (the first stage of an uneven pipeline); InvalidLayout for a layout that cannot
    hold the model."""
    check_layout(model, tp=tp, pp=pp, dp=dp, zero_stage=zero_stage, micro_batch_size=micro_batch_size,
                 micro_batches=micro_batches)
    layers = stage_layers(model.layers, pp)
    # parameters this GPU owns before ZeRO
    local = model.params / (tp * pp) if model.layers % pp == 0 else model.params * layers / (model.layers * tp)
    weights = WEIGHT_BYTES * local / (dp if zero_stage >= 3 else 1)
    if zero_stage >= 3 and dp > 1:
        weights += ZERO3_LAYERS_GATHERED * WEIGHT_BYTES * model.params / (model.layers * tp)
    grads = GRAD_BYTES * local / (dp if zero_stage >= 2 else 1)
    optimizer = OPTIMIZER_BYTES * local / (dp if zero_stage >= 1 else 1)
    sbh = model.seq_len * micro_batch_size * model.hidden / tp
    in_flight = min(pp, micro_batches)
    stored = CHECKPOINT_BYTES * sbh * layers * in_flight
    working = ACTIVATION_BYTES_PER_LAYER * sbh
    logits = LOGIT_BYTES * model.seq_len * micro_batch_size * model.vocab / tp
    return MemoryEstimate(weights / GB, grads / GB, optimizer / GB, (stored + working + logits) / GB)
