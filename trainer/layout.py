"""The built-in trainer's GPT laid out over its ranks: DDP over every rank (`Replicated`), or as the plan says
(`Laid`: pipeline stages over `pp`, 1F1B over the planned micro-batches; tensor parallelism over `tp` inside each
block; FSDP2 over `dp`). Both run a step the same way for trainer/loop.py. Written against public torch APIs, the
way examples/tp_pp is.

The loss of a replica's rows is a sum scaled by replicas / global tokens, so the gradient DDP or FSDP2 averages
over the replicas is the global batch's mean loss in any layout, even with uneven slices: a job resharded onto
another world size or layout continues the same run.
"""

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from flightdeck.events.plan import MESH_DIMS, ParallelPlan, coordinates
from flightdeck.events.spec import JobSpec
from flightdeck.trainer import model

# q/k/v and the MLP's first layer split by output (whole heads: model.Block), the projections back by input
TP_PLAN = {"qkv": ColwiseParallel(), "proj": RowwiseParallel(), "fc": ColwiseParallel(), "out": RowwiseParallel()}


class LayoutError(ValueError):
    """The plan does not fit this model or batch; the message says what to change."""


def check(spec: JobSpec, plan: ParallelPlan, rows: int) -> None:
    """What the built-in GPT needs of a plan: heads whole per TP rank, layers whole per stage, micro-batches even."""
    m = spec.model
    if m.n_head % plan.tp:
        raise LayoutError(f"TP {plan.tp} does not divide model.n_head ({m.n_head}): each TP rank holds whole heads")
    if m.n_layer % plan.pp:
        raise LayoutError(f"PP {plan.pp} does not divide model.n_layer ({m.n_layer}): stages hold equal layers")
    if plan.pp > 1 and rows % plan.micro_batches:
        raise LayoutError(f"a replica's {rows} sequences do not split into {plan.micro_batches} equal micro-batches "
                          f"(train.batch_size {spec.train.batch_size} over DP {plan.dp}): use a batch size that does")


def build(spec: JobSpec, plan: ParallelPlan | None, rank: int, world_size: int,
          device: torch.device) -> "Replicated | Laid":
    """The plan's layout when it has TP or PP; DDP otherwise (no plan, or data parallelism only)."""
    if plan is not None and (plan.tp > 1 or plan.pp > 1):
        return Laid(spec, plan, rank, device)
    return Replicated(spec, rank, world_size, device)


class Replicated:
    """The whole GPT on every rank, DDP averaging the gradients; each rank reads its slice of the batch."""

    def __init__(self, spec: JobSpec, rank: int, world_size: int, device: torch.device) -> None:
        self.module = model.build(spec.model, spec.train.seed, device)
        self.net: nn.Module = self.module
        if world_size > 1:
            self.net = DistributedDataParallel(self.module, device_ids=[device.index] if device.type == "cuda"
                                               else None)
        self.replica, self.replicas = rank, world_size

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
        """The rows' summed loss; gradients of it scaled by `scale`."""
        with _autocast(x.device):
            logits = self.net(x)
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        (loss_sum * scale).backward()
        return loss_sum.detach()

    def replica_loss(self, rows_loss: torch.Tensor, rows_tokens: int) -> torch.Tensor:
        return rows_loss / rows_tokens

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def found_inf(self, grad_norm: torch.Tensor) -> torch.Tensor:
        return (~torch.isfinite(grad_norm)).float()


class Laid:
    """One rank's stage of the GPT, sharded as planned, and how it runs a step."""

    def __init__(self, spec: JobSpec, plan: ParallelPlan, rank: int, device: torch.device) -> None:
        self.plan = plan
        place = coordinates(plan, rank)
        self.stage, self.replica = place["pp"], place["dp"]
        check(spec, plan, len(torch.arange(spec.train.batch_size).tensor_split(plan.dp)[self.replica]))
        self.mesh: DeviceMesh = init_device_mesh(device.type, tuple(getattr(plan, d) for d in MESH_DIMS),
                                                 mesh_dim_names=MESH_DIMS)
        self.module = model.build(spec.model, spec.train.seed, device, self.stage, plan.pp)
        self.net: nn.Module = self.module  # FSDP2 and TP shard it in place
        self.replicas = plan.dp
        if plan.tp > 1:
            for block in self.module.blocks.values():
                parallelize_module(block, self.mesh["tp"], TP_PLAN)
            _replicate_the_rest(self.module, self.mesh["tp"])
        if plan.dp > 1:
            for block in self.module.blocks.values():
                fully_shard(block, mesh=self.mesh["dp"], reshard_after_forward=plan.zero_stage >= 3)
            fully_shard(self.module, mesh=self.mesh["dp"], reshard_after_forward=plan.zero_stage >= 3)
        self.scale = 1.0
        self.schedule: Schedule1F1B | None = None
        if plan.pp > 1:
            pipe = PipelineStage(self.module, self.stage, plan.pp, device, group=self.mesh["pp"].get_group())
            self.schedule = Schedule1F1B(pipe, n_microbatches=plan.micro_batches, loss_fn=self._loss,
                                         scale_grads=False)

    @property
    def holds_loss(self) -> bool:
        return self.stage == self.plan.pp - 1

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="sum") * self.scale

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
        """Runs this replica's rows through the stages, gradients scaled by `scale`; on the last stage returns the
        rows' summed loss (0 elsewhere)."""
        self.scale = scale
        if self.schedule is None:  # the planned gradient accumulation: the rows a forward at a time
            total, forwards = torch.zeros((), device=y.device), max(1, min(self.plan.grad_accum, len(x)))
            for xs, ys in zip(x.tensor_split(forwards), y.tensor_split(forwards), strict=True):
                with _autocast(x.device):
                    logits = self.module(xs)
                loss = self._loss(logits, ys)
                loss.backward()
                total += loss.detach()
            return total / scale
        losses: list[torch.Tensor] = []
        with _autocast(x.device):  # the schedule runs the backward passes too, between its forwards
            if self.stage == 0:
                self.schedule.step(x, target=y, losses=losses)
            else:
                self.schedule.step(target=y, losses=losses)
        if not losses:
            return torch.zeros((), device=y.device)
        return torch.stack([loss.detach() for loss in losses]).sum() / scale

    def replica_loss(self, rows_loss: torch.Tensor, rows_tokens: int) -> torch.Tensor:
        """The mean loss of this replica's rows on each of its ranks (as DDP's ranks report their slice's): the
        last stage sends its sum down the pipeline."""
        if self.plan.pp > 1:
            rows_loss = rows_loss if self.holds_loss else torch.zeros_like(rows_loss)
            dist.all_reduce(rows_loss, group=self.mesh["pp"].get_group())
        return rows_loss / rows_tokens

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """clip_grad_norm_ across the layout: a sharded gradient's norm is its whole tensor's (DTensor), a stage's
        squares add over the pipeline's stages; the total norm, the same on every rank."""
        return clip_grad_norm(self.module.parameters(), max_norm, self.mesh["pp"].get_group() if self.plan.pp > 1
                              else None)

    def found_inf(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """1.0 where the step's gradient is not finite, on the parameters' mesh where they are DTensors (a fused
        optimizer step takes one kind of tensor)."""
        bad = (~torch.isfinite(grad_norm)).float()
        first = next(self.module.parameters())
        if isinstance(first, DTensor):
            return DTensor.from_local(bad, first.device_mesh, [Replicate()] * first.device_mesh.ndim,
                                      run_check=False)
        return bad


def _replicate_the_rest(module: nn.Module, mesh: DeviceMesh) -> None:
    """The norms, embeddings and head, which TP does not split, as DTensors replicated over the TP group: every
    parameter then lives on one mesh, as a fused optimizer step needs, and its norm counts once."""
    for leaf in module.modules():
        own = list(leaf.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            # torch annotates the hooks as returning None, yet uses what they return
            distribute_module(leaf, mesh, input_fn=_replicated, output_fn=_local)  # type: ignore[arg-type]


def _replicated(_: nn.Module, inputs: tuple[torch.Tensor, ...], mesh: DeviceMesh) -> tuple[torch.Tensor, ...]:
    return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in inputs)


def _local(_: nn.Module, output: torch.Tensor, __: DeviceMesh) -> torch.Tensor:
    return output.to_local() if isinstance(output, DTensor) else output


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float,
                   stages: dist.ProcessGroup | None) -> torch.Tensor:
    grads = [p.grad for p in params if p.grad is not None]
    squares = [_full(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2 for g in grads]
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    if stages is not None:
        dist.all_reduce(total, group=stages)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g
        local.mul_(coef.to(local.device, local.dtype))
    return norm


def _autocast(device: torch.device) -> torch.autocast:
    """bf16 matmuls on a GPU; CPU runs fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t

