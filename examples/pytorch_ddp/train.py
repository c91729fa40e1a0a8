"""A plain PyTorch script under DDP, kept alive by Flightdeck: the lines marked `# flightdeck` are all it adds.

    flightdeck submit examples/pytorch_ddp/job.toml               # on the platform
    torchrun --nproc-per-node 2 examples/pytorch_ddp/train.py     # alone: no platform, telemetry off

A small MLP learns to imitate a fixed random "teacher" network on a fixed synthetic dataset, read by torchdata's
StatefulDataLoader over a shuffling DistributedSampler (`run.batches` keeps its position with each checkpoint, and
tells the sampler each epoch), with dropout and two micro-batches of gradient accumulation per step.
"""

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import flightdeck  # flightdeck

FEATURES, CLASSES, GLOBAL_BATCH, SAMPLES, ACCUMULATE = 16, 4, 64, 4096, 2


def dataset() -> TensorDataset:
    """Inputs from a fixed seed, labelled by the teacher: the same data in every process."""
    torch.manual_seed(1234)
    teacher = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))
    x = torch.randn(SAMPLES, FEATURES, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return TensorDataset(x, teacher(x).argmax(dim=1))


def main() -> None:
    run = flightdeck.init()  # flightdeck: joins the job (and torch.distributed when there are several ranks)
    data = dataset()
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        data, num_replicas=run.world_size, rank=run.rank, shuffle=True, seed=0)
    loader = StatefulDataLoader(data, batch_size=GLOBAL_BATCH // run.world_size, sampler=sampler, drop_last=True)
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, CLASSES))
    if run.world_size > 1:
        model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run.register(model, opt)  # flightdeck: what a checkpoint holds
    for step, (x, y) in run.batches(loader):  # flightdeck: restores, obeys commands, checkpoints, preemption
        opt.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        for i, (xs, ys) in enumerate(zip(x.chunk(ACCUMULATE), y.chunk(ACCUMULATE), strict=True)):
            last = i == ACCUMULATE - 1
            sync = model.no_sync() if isinstance(model, DistributedDataParallel) and not last else nullcontext()
            with sync:  # DDP averages the gradients once, on the last micro-batch
                part = F.cross_entropy(model(xs), ys) / ACCUMULATE
                part.backward()
            loss += part.detach()
        opt.step()
        run.report(step, loss)  # flightdeck: no host sync
    print(f"rank {run.rank}: done at step {run.step}, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
