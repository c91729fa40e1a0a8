"""A Hugging Face Transformers causal LM kept alive by Flightdeck: GPT-2's architecture built from a small
config (nothing downloaded, GPT-2's dropout kept), trained byte-level on the corpus Flightdeck ships, under DDP,
with a warm-up and cosine learning-rate schedule. The lines marked `# flightdeck` are all it adds.

    flightdeck submit examples/hf_causal_lm/job.toml
    torchrun --nproc-per-node 2 examples/hf_causal_lm/train.py     # alone: no platform

Needs `transformers` (pip install "flightdeck[examples]"; `make install` includes it).
"""

import math

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel

import flightdeck  # flightdeck
from flightdeck.trainer.data import (
    CORPUS,  # the text Flightdeck installs with its trainer: any file of yours does as well
)

SEQ, GLOBAL_BATCH = 64, 8


def batch(tokens: torch.Tensor, index: int, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of global batch `index`: random windows of the byte stream, a pure function of `index`."""
    g = torch.Generator().manual_seed(index)
    starts = torch.randint(0, tokens.numel() - SEQ, (GLOBAL_BATCH,), generator=g)
    rows = torch.tensor_split(torch.arange(GLOBAL_BATCH), world)[rank]
    return tokens[starts[rows, None] + torch.arange(SEQ)]


def main() -> None:
    run = flightdeck.init()  # flightdeck
    tokens = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8).long()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2)  # GPT-2's dropout, 0.1
    model: torch.nn.Module = GPT2LMHeadModel(config)
    if run.world_size > 1:
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    total, warmup = run.spec.train.steps, max(1, run.spec.train.steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then cosine decay to a tenth
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * s / total)))
    run.register(model, opt, schedule=schedule)  # flightdeck: the scheduler's position is checkpointed too
    for step in run.steps():  # flightdeck
        ids = batch(tokens, step.batch, run.rank, run.world_size).to(run.device)
        out = model(input_ids=ids, labels=ids)  # the model shifts the labels itself
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        lr = float(schedule.get_last_lr()[0])
        opt.step()
        schedule.step()
        run.report(step, out.loss.detach(), grad_norm=grad_norm, lr=lr, tokens=ids.numel())  # flightdeck
    print(f"rank {run.rank}: done at step {run.step}")


if __name__ == "__main__":
    main()
