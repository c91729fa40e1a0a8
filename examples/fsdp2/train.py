"""An FSDP2 model (`fully_shard`) kept alive by Flightdeck: each rank holds a shard of every weight and of its
optimizer state; checkpoints are DCP shards, so a job restored at another world size (one rank, say) reshards
them on load. The lines marked `# flightdeck` are all it adds.

    flightdeck submit examples/fsdp2/job.toml
    torchrun --nproc-per-node 2 examples/fsdp2/train.py      # alone: no platform

A small residual MLP regresses a fixed random function; batch `i` is a pure function of `i`.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import flightdeck  # flightdeck

WIDTH, DEPTH, GLOBAL_BATCH = 64, 4, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def batch(index: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    x = torch.randn(GLOBAL_BATCH, WIDTH, generator=g)
    y = torch.sin(x.cumsum(dim=1) / 4)
    rows = torch.tensor_split(torch.arange(GLOBAL_BATCH), world)[rank]
    return x[rows], y[rows]


def main() -> None:
    run = flightdeck.init()  # flightdeck
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(DEPTH)), nn.Linear(WIDTH, WIDTH))
    if run.world_size > 1:
        mesh = init_device_mesh(run.device.type, (run.plan.dp,))  # the data-parallel size Flightdeck planned
        for block in model[:DEPTH]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run.register(model, opt)  # flightdeck: DTensor shards, resharded on restore
    for step in run.steps():  # flightdeck
        x, y = batch(step.batch, run.rank, run.world_size)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run.report(step, loss.detach())  # flightdeck
    print(f"rank {run.rank}: done at step {run.step}")


if __name__ == "__main__":
    main()
