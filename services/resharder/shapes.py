"""A model's shape as the planner sees it, from explicit numbers, a job spec, or a parameter count alone.

Shapes derived from a parameter count follow GPT-3 (Brown et al. 2020, table 2.1): a decoder where
params ≈ 12 · layers · hidden² (attention 4h², MLP 8h²; embeddings left out), hidden ≈ 128 · layers
(175B: 96 layers, hidden 12288, 96 heads of 128), so layers ≈ cbrt(params / (12 · 128²)). Layers are
rounded to a multiple of 4 from 8 up; hidden to a multiple of 1024 from 1024 up (so heads come in eights
and tensor parallelism up to 8 divides them), else of 128; a head is 128 wide.
"""

import math
from dataclasses import dataclass

from flightdeck.events.spec import ModelSpec
from flightdeck.events.training import ModelRegistered

HEAD_DIM = 128
ASPECT = 128  # hidden / layers in GPT-3's larger models
DEFAULT_SEQ_LEN = 2048
DEFAULT_VOCAB = 50_257  # GPT-2/3 BPE
DEFAULT_BATCH_TOKENS = 4 * 1024 * 1024  # a global batch of ~4M tokens (Llama 2/3; GPT-3 175B used 3.2M)


class InvalidShape(ValueError):
    """A model shape that cannot be laid out; the message names the number to change."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    params: float
    layers: int
    heads: int
    hidden: int
    seq_len: int = DEFAULT_SEQ_LEN
    vocab: int = DEFAULT_VOCAB

    def __post_init__(self) -> None:
        if not (self.params > 0 and math.isfinite(self.params)):
            raise InvalidShape(f"params must be a positive number, got {self.params}")
        for field in ("layers", "heads", "hidden", "seq_len", "vocab"):
            if getattr(self, field) < 1:
                raise InvalidShape(f"{field} must be at least 1, got {getattr(self, field)}")
        if self.hidden % self.heads:
            raise InvalidShape(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")


def _round_to(value: float, unit: int) -> int:
    return max(unit, round(value / unit) * unit)


def derive(params: float, *, layers: int | None = None, heads: int | None = None, hidden: int | None = None,
           seq_len: int | None = None, vocab: int | None = None) -> ModelShape:
    """A shape for `params` parameters; the numbers given are kept, the rest follow the GPT-3 rule above."""
    if not (params > 0 and math.isfinite(params)):
        raise InvalidShape(f"params must be a positive number, got {params}")
    if layers is None:
        if hidden is not None:
            layers = max(1, round(params / (12 * hidden * hidden)))
        else:
            raw = (params / (12 * ASPECT * ASPECT)) ** (1 / 3)
            layers = max(1, round(raw)) if raw < 8 else _round_to(raw, 4)
    if hidden is None:
        raw = math.sqrt(params / (12 * layers))
        unit = heads if heads is not None else (1024 if raw >= 1024 else HEAD_DIM)
        hidden = _round_to(raw, unit)
    if heads is None:
        heads = next((hidden // dim for dim in range(HEAD_DIM, hidden + 1) if hidden % dim == 0), 1)
    return ModelShape(params=params, layers=layers, heads=heads, hidden=hidden,
                      seq_len=seq_len or DEFAULT_SEQ_LEN, vocab=vocab or DEFAULT_VOCAB)


def spec_params(model: ModelSpec) -> float:
    """Parameters of the trainer's GPT for a job spec: blocks, token and position embeddings, and the head."""
    d = model.d_model
    return float(12 * model.n_layer * d * d + (2 * model.vocab_size + model.seq_len) * d)


def from_spec(model: ModelSpec) -> ModelShape:
    return ModelShape(params=spec_params(model), layers=model.n_layer, heads=model.n_head, hidden=model.d_model,
                      seq_len=model.seq_len, vocab=model.vocab_size)


def default_global_batch(seq_len: int) -> int:
    """Sequences per optimizer step when none is given: ~4M tokens."""
    return max(1, DEFAULT_BATCH_TOKENS // seq_len)


def reported(model: ModelRegistered) -> ModelShape:
    """The model a script registered (trainer/modelinfo.py): its parameter count, the shape it stated, the rest by
    the rule above. A model with no token embedding or token ids seen has no vocabulary or sequence to charge."""
    heads = model.heads if model.heads and model.hidden and model.hidden % model.heads == 0 else None
    return derive(float(model.params), layers=model.layers or None, heads=heads, hidden=model.hidden or None,
                  seq_len=model.seq_len or 1, vocab=model.vocab or 1)
