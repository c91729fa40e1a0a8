"""The built-in trainer: a small GPT ([model] in the job spec) on the shipped corpus, written against the
public trainer API only (`flightdeck`), the way a user's script is.

DDP averages gradients over ranks; the loss is scaled by world/global tokens, so the gradient is the
global batch's mean loss at any world size, even with uneven slices: a resharded job continues the same run.
"""

import math

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import flightdeck
from flightdeck.trainer import model
from flightdeck.trainer.data import TokenStream, load_tokens

GRAD_CLIP = 1.0


def lr_at(step: int, total: int, base: float) -> float:
    """Linear warm-up, then cosine decay to a tenth: a pure function of the step, so nothing to checkpoint."""
    warmup = max(1, min(100, total // 10))
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def train(run: flightdeck.Run) -> int:
    spec = run.spec
    torch.manual_seed(spec.train.seed * 1000 + run.rank)
    gpt = model.build(spec.model, spec.train.seed, run.device)
    # Fused AdamW takes `found_inf` on the device: a non-finite step is skipped without a host sync.
    opt = torch.optim.AdamW(gpt.parameters(), lr=spec.train.lr, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    stream = TokenStream(load_tokens(spec.train.data, spec.model.vocab_size), seq_len=spec.model.seq_len,
                         batch_size=spec.train.batch_size, seed=spec.train.seed, rank=run.rank,
                         world_size=run.world_size, vocab_size=spec.model.vocab_size)
    net: torch.nn.Module = gpt
    if run.world_size > 1:
        net = DistributedDataParallel(gpt, device_ids=[run.device.index] if run.device.type == "cuda" else None)
    run.register(net, opt)
    global_tokens = spec.train.batch_size * spec.model.seq_len
    local_tokens = stream.local_batch * spec.model.seq_len
    cuda = run.device.type == "cuda"
    for step in run.steps():
        x, y = (t.to(run.device, non_blocking=True) for t in stream.batch(step.batch))
        lr = lr_at(step, spec.train.steps, spec.train.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = net(x)
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        opt.zero_grad(set_to_none=True)
        (loss_sum * (run.world_size / global_tokens)).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(gpt.parameters(), GRAD_CLIP)
        opt.found_inf = (~torch.isfinite(grad_norm)).float()  # type: ignore[attr-defined]
        opt.step()
        run.report(step, loss_sum.detach() / y.numel(), grad_norm=grad_norm.detach(), lr=lr, tokens=local_tokens)
    return 0
