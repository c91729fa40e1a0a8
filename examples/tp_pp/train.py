"""A transformer laid out in three dimensions from the plan Flightdeck recorded for this attempt's ranks: pipeline
stages (torch.distributed.pipelining, 1F1B over the planned micro-batches), tensor parallelism inside each block
(parallelize_module), FSDP2 over the data-parallel dimension. On 4 ranks the plan is TP 2 x PP 2 (job.toml asks for
it); after a lost node the 2 ranks left get TP 2 x PP 1 and restore the same checkpoint, which DCP reshards: every
block keeps its name (`layers.3`) whichever stage holds it. The lines marked `# flightdeck` are all it adds.

    flightdeck submit examples/tp_pp/job.toml
    FLIGHTDECK_SPEC=examples/tp_pp/job.toml torchrun --nproc-per-node 4 examples/tp_pp/train.py   # alone

Batch i is a pure function of i (sequences that follow a fixed rule); each data-parallel replica reads its share.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import flightdeck  # flightdeck


@dataclass(frozen=True)
class Config:  # the names the planner reads a model's shape from (trainer/modelinfo.py)
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 32
    vocab_size: int = 64
    block_size: int = 16


class Attention(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.head_dim = c.d_model // c.n_head
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(c.d_model, c.d_model, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # under tensor parallelism this rank's projections hold its share of the heads
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(c.d_model), nn.LayerNorm(c.d_model)
        self.attn = Attention(c)
        self.up, self.down = nn.Linear(c.d_model, 4 * c.d_model), nn.Linear(4 * c.d_model, c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


TP_PLAN = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
           "attn.wo": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


class Model(nn.Module):
    """The whole model, or one pipeline stage of it: the blocks it holds keep their names, the first stage holds
    the embedding and the last the head."""

    def __init__(self, c: Config, stage: int = 0, stages: int = 1) -> None:
        super().__init__()
        self.config = c
        per = c.n_layer // stages
        # Built whole from one seed on every stage, then cut: every layout starts from the same weights (an embedding
        # made only on stage 0 drew from the seed there alone, and every later stage's blocks started elsewhere).
        self.embed: nn.Embedding | None = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleDict({str(i): Block(c) for i in range(c.n_layer)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(c.d_model)
        self.head: nn.Linear | None = nn.Linear(c.d_model, c.vocab_size)
        for i in range(c.n_layer):
            if not stage * per <= i < (stage + 1) * per:
                del self.layers[str(i)]
        if stage != 0:
            self.embed = None
        if stage != stages - 1:
            self.norm = self.head = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        for block in self.layers.values():
            h = block(h)
        return self.head(self.norm(h)) if self.head is not None and self.norm is not None else h


def batch(index: int, c: Config, size: int) -> torch.Tensor:
    """`size` sequences where each token follows from the one before by a fixed rule, from seeded starts."""
    g = torch.Generator().manual_seed(index)
    start, stride = torch.randint(0, c.vocab_size, (size, 1), generator=g), torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(c.block_size + 1)) % c.vocab_size


def main() -> None:
    run = flightdeck.init()  # flightdeck
    plan, c = run.plan, Config()  # flightdeck: the layout recorded for this attempt's ranks
    stage = replica = 0
    if run.world_size > 1:
        mesh = init_device_mesh(run.device.type, (plan.pp, plan.dp, plan.tp), mesh_dim_names=("pp", "dp", "tp"))
        stage, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    model = Model(c, stage, plan.pp).to(run.device)
    if plan.tp > 1:
        for block in model.layers.values():
            parallelize_module(block, mesh["tp"], TP_PLAN)
    if plan.dp > 1:
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run.register(model, opt)  # flightdeck: each rank its stage's blocks, TP shards as DTensors

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, c.vocab_size), target.reshape(-1))

    schedule = None
    if plan.pp > 1:
        pipe = PipelineStage(model, stage, plan.pp, run.device, group=mesh["pp"].get_group())
        schedule = Schedule1F1B(pipe, n_microbatches=plan.micro_batches, loss_fn=loss_fn)
    global_batch = run.spec.train.batch_size
    for step in run.steps():  # flightdeck
        rows = batch(step.batch, c, global_batch).tensor_split(plan.dp)[replica].to(run.device)
        x, y = rows[:, :-1], rows[:, 1:]
        opt.zero_grad(set_to_none=True)
        if schedule is None:
            loss = loss_fn(model(x), y)
            loss.backward()
        else:
            losses: list[torch.Tensor] = []
            if stage == 0:
                schedule.step(x, target=y, losses=losses)
            else:
                schedule.step(target=y, losses=losses)
            loss = torch.stack(losses).mean() if losses else torch.zeros((), device=run.device)
        opt.step()
        # the last stage has the loss: every rank reports the mean over the replicas (each TP rank holds it once)
        mean = loss.detach().clone() if stage == plan.pp - 1 else torch.zeros((), device=run.device)
        if run.world_size > 1:
            dist.all_reduce(mean)
        run.report(step, mean / (plan.dp * plan.tp))  # flightdeck
    print(f"rank {run.rank}: done at step {run.step} as TP {plan.tp} x PP {plan.pp} x DP {plan.dp}")


if __name__ == "__main__":
    main()
