"""What rank 0 tells the planner of a script's model (trainer/modelinfo.py): every parameter counted once, the shape
from a model's config or its module tree, and the batch read off the first optimizer step, gradient accumulation
included; then the hooks are gone."""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flightdeck.events.spec import ModelSpec
from flightdeck.events.training import ModelRegistered
from flightdeck.trainer import modelinfo
from flightdeck.trainer.model import GPT


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x, x, x, need_weights=False)[0])


class Plain(nn.Module):
    """A language model with no config: its shape is read from its modules."""

    def __init__(self, vocab: int = 50, width: int = 16, layers: int = 3, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(8, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: counted once

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@dataclass
class Config:  # Hugging Face names
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    hidden_size: int = 768
    vocab_size: int = 32_000
    max_position_embeddings: int = 4096


class WithConfig(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = Config()
        self.lin = nn.Linear(4, 4)


def test_the_built_in_gpt_states_its_shape_in_its_spec() -> None:
    spec = ModelSpec(n_layer=3, n_head=4, d_model=32, seq_len=16, vocab_size=64)
    model = GPT(spec)
    got = modelinfo.describe(model)
    assert got.params == sum(p.numel() for p in model.parameters()) == got.trainable
    assert got.param_bytes == 4 * got.params
    assert (got.layers, got.heads, got.hidden, got.vocab, got.seq_len, got.source) == (3, 4, 32, 64, 16, "config")


def test_a_config_s_names_are_read_and_a_frozen_parameter_is_not_trainable() -> None:
    model = WithConfig()
    model.lin.bias.requires_grad_(False)
    got = modelinfo.describe(model)
    assert (got.params, got.trainable) == (20, 16)
    assert (got.layers, got.heads, got.hidden, got.vocab, got.seq_len, got.source) == (12, 12, 768, 32_000, 4096,
                                                                                          "config")


def test_a_model_without_a_config_is_read_from_its_modules_and_a_tied_weight_counted_once() -> None:
    model = Plain()
    got = modelinfo.describe(model)
    assert got.params == sum(p.numel() for p in model.parameters())  # .parameters() yields a tied one once
    assert got.params < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert (got.layers, got.heads, got.hidden, got.vocab, got.source) == (3, 4, 16, 50, "modules")


def test_a_model_with_nothing_to_read_is_counted_alone() -> None:
    got = modelinfo.describe(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    assert (got.params, got.layers, got.hidden, got.source) == (49, 0, 0, "")


def test_the_second_step_gives_the_batch_and_the_accumulation_then_the_hooks_are_gone() -> None:
    """Ours unhook at the next forward, never inside the optimizer's hooks: torch runs those from the live dict, and
    removing one there broke the next (the spike drills' high_lr hook: every step raised)."""
    model = Plain()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sent: list[Any] = []
    replicas = [4]  # the data-parallel size when the report goes: the plan the script built meanwhile
    watching = modelinfo.watch(model, opt, sent.append, {"job_id": "j", "rank": 0}, world_size=4,
                               replicas=lambda: replicas[0])
    replicas[0] = 2
    assert watching is not None and sent == []
    after: list[int] = []
    opt.register_step_post_hook(lambda *_: after.append(1))  # a hook of the script's (or a drill's) after ours
    opt.step()  # no forward before it: not the script's (DCP's get_state_dict steps so to make optimizer state)
    model.eval()
    model(torch.zeros(7, 5, dtype=torch.long))  # an evaluation forward is not a training one
    model.train()
    # a first step with a warm-up forward (a pipeline stage's shape inference), then steps of three micro-batches
    # of 6 sequences of 8 tokens; the third step's forward unhooks
    for forwards in (4, 3, 1):
        for _ in range(forwards):
            model(torch.randint(0, 50, (6, 8))).sum().backward()
        opt.step()
        opt.zero_grad()
    (report,) = sent
    assert isinstance(report, ModelRegistered)
    assert (report.job_id, report.rank, report.world_size, report.dp) == ("j", 0, 4, 2)
    assert (report.micro_batch, report.grad_accum, report.seq_len) == (6, 3, 8)  # the tokens fed, not a maximum
    assert report.params == modelinfo.describe(model).params and report.source == "modules"
    assert len(after) == 4  # every step ran the hooks after ours (the drill's high_lr restores its lr in one)
    assert not model._forward_pre_hooks  # ours, gone: only the script's is left
    assert [h.__name__ for h in opt._optimizer_step_post_hooks.values()] == ["<lambda>"]


def test_without_an_optimizer_it_is_sent_at_once_and_without_a_model_not_at_all() -> None:
    sent: list[Any] = []
    assert modelinfo.watch(nn.Linear(2, 2), None, sent.append, {"job_id": "j", "rank": 0}, world_size=1,
                           replicas=lambda: 1) is None
    assert modelinfo.watch(None, None, sent.append, {"job_id": "j", "rank": 0}, world_size=1,
                           replicas=lambda: 1) is None
    assert [(r.params, r.micro_batch, r.grad_accum) for r in sent] == [(6, 0, 0)]


def test_ddp_s_wrapper_is_looked_through() -> None:
    class Wrapper(nn.Module):  # DistributedDataParallel needs a process group; its name is what unwrap checks
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

    Wrapper.__name__ = "DistributedDataParallel"
    got = modelinfo.describe(Wrapper(GPT(ModelSpec(n_layer=2))))
    assert (got.layers, got.source) == (2, "config")
