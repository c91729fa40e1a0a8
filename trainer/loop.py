"""The built-in trainer: a small GPT ([model] in the job spec) on the shipped corpus, written against the
public trainer API only (`flightdeck`), the way a user's script is.

Its ranks run DDP, or the TP x PP layout the plan records when the spec asks for one (trainer/layout.py); in
either, the gradient is the global batch's mean loss, so a resharded job continues the same run.
"""

import math

import torch

import flightdeck
from flightdeck.trainer import layout
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
    # Asked for TP or PP ([parallel]), it runs the layout recorded for its ranks; else DDP over every rank, which
    # takes any batch (a plan needs one its DP divides) and so waits for no plan.
    plan = run.plan if spec.parallel.tp * spec.parallel.pp > 1 else None
    laid = layout.build(spec, plan, run.rank, run.world_size, run.device)
    # Fused AdamW takes `found_inf` on the device: a non-finite step is skipped without a host sync.
    opt = torch.optim.AdamW(laid.module.parameters(), lr=spec.train.lr, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=True)
    stream = TokenStream(load_tokens(spec.train.data, spec.model.vocab_size), seq_len=spec.model.seq_len,
                         batch_size=spec.train.batch_size, seed=spec.train.seed, rank=laid.replica,
                         world_size=laid.replicas, vocab_size=spec.model.vocab_size)
    run.register(laid.net, opt)
    global_tokens = spec.train.batch_size * spec.model.seq_len
    local_tokens = stream.local_batch * spec.model.seq_len
    for step in run.steps():
        x, y = (t.to(run.device, non_blocking=True) for t in stream.batch(step.batch))
        lr = lr_at(step, spec.train.steps, spec.train.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad(set_to_none=True)
        rows_loss = laid.forward_backward(x, y, laid.replicas / global_tokens)
        grad_norm = laid.clip_grad_norm(GRAD_CLIP)
        opt.found_inf = laid.found_inf(grad_norm)  # type: ignore[attr-defined]
        opt.step()
        run.report(step, laid.replica_loss(rows_loss, local_tokens), grad_norm=grad_norm.detach(), lr=lr,
                   tokens=local_tokens)
    return 0
