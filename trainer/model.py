"""A small GPT (pre-norm transformer decoder) sized by flightdeck.events.spec.ModelSpec, whole or one pipeline stage.

Laid out so tensor parallelism splits it along heads (trainer/layout.py): the fused q/k/v projection keeps each
head's q, k and v rows together, so a contiguous row shard is whole heads; the output head is its own weight (a
pipeline's last stage holds it, the first the embedding).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from flightdeck.events.spec import ModelSpec


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.head_dim = d_model // n_head
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)  # rows per head: its q, k, v
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # under tensor parallelism the projection holds this rank's heads only: -1 counts them
        q, k, v = self.qkv(self.ln1(x)).view(b, t, -1, 3, self.head_dim).transpose(1, 2).unbind(dim=3)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """The whole model (stages = 1) or pipeline stage `stage`: its blocks keep their names (`blocks.3`) in any
    split, the first stage holds the embeddings and the last the final norm and the head."""

    def __init__(self, spec: ModelSpec, stage: int = 0, stages: int = 1) -> None:
        super().__init__()
        if spec.n_layer % stages or not 0 <= stage < stages:
            raise ValueError(f"{spec.n_layer} layers do not split into stage {stage} of {stages} equal stages")
        self.spec = spec
        self.tok = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos = nn.Embedding(spec.seq_len, spec.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(spec.d_model, spec.n_head) for i in range(spec.n_layer)})
        self.ln_f = nn.LayerNorm(spec.d_model)
        self.head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        self.apply(self._init)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat in depth.
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "out.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * spec.n_layer))
        # built whole from the seed, then cut: every layout starts from the same weights
        per = spec.n_layer // stages
        for i in range(spec.n_layer):
            if not stage * per <= i < (stage + 1) * per:
                del self.blocks[str(i)]
        self.first, self.last = stage == 0, stage == stages - 1
        if not self.first:
            del self.tok, self.pos
        if not self.last:
            del self.ln_f, self.head

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, vocab) for token ids (batch, time); a middle stage maps activations to activations."""
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build(spec: ModelSpec, seed: int, device: torch.device, stage: int = 0, stages: int = 1) -> GPT:
    """The same initial weights on every rank and every layout: built from the job's seed alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(spec, stage, stages)
    return model.to(device)
