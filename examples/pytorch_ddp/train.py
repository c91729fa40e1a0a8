"""A plain PyTorch script under DDP, kept alive by Flightdeck: the lines marked `# flightdeck` are all it adds.

    flightdeck submit examples/pytorch_ddp/job.toml               # on the platform
    torchrun --nproc-per-node 2 examples/pytorch_ddp/train.py     # alone: no platform, telemetry off

A small MLP learns to imitate a fixed random "teacher" network on synthetic inputs. Batch `i` is a pure
function of `i`, so reading batch `step.batch` makes restarts and rollbacks exact.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import flightdeck  # flightdeck

FEATURES, CLASSES, GLOBAL_BATCH = 16, 4, 64


def teacher() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))


def batch(index: int, rank: int, world: int, label: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of global batch `index`."""
    g = torch.Generator().manual_seed(index)
    x = torch.randn(GLOBAL_BATCH, FEATURES, generator=g)
    with torch.no_grad():
        y = label(x).argmax(dim=1)
    rows = torch.tensor_split(torch.arange(GLOBAL_BATCH), world)[rank]
    return x[rows], y[rows]


def main() -> None:
    run = flightdeck.init()  # flightdeck: joins the job (and torch.distributed when there are several ranks)
    label = teacher()
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))
    if run.world_size > 1:
        model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run.register(model, opt)  # flightdeck: what a checkpoint holds
    for step in run.steps():  # flightdeck: restores, obeys commands, checkpoints, preemption
        x, y = batch(step.batch, run.rank, run.world_size, label)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        accuracy = (logits.argmax(dim=1) == y).float().mean()
        run.report(step, loss.detach(), accuracy=accuracy)  # flightdeck: no host sync
    print(f"rank {run.rank}: done at step {run.step}, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
