"""What rank 0 tells the planner about the script's model (events.training.ModelRegistered): the parameters counted
at `register`, the transformer shape where the model says it, and the batch the script feeds read off its second
training step (the first may hold warm-up forwards: a pipeline stage's shape inference runs the stage once more):
sequences in one forward, and forwards per optimizer step (its gradient accumulation). Sent once; the hooks are
removed at the next forward, so later steps pay nothing."""

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from flightdeck.events.base import RankEvent
from flightdeck.events.training import ModelRegistered

# Where a model states its shape: a `config` (Hugging Face, nanoGPT) or a `spec` (the built-in GPT), by these names.
NAMES = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    "hidden": ("hidden_size", "n_embd", "d_model", "dim"),
    "vocab": ("vocab_size",),
    "seq_len": ("max_position_embeddings", "n_positions", "block_size", "seq_len", "max_seq_len"),
}
HEAD_ATTRS = ("num_heads", "n_head", "n_heads", "num_attention_heads")  # on an attention module


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP or torch.compile's wrapper (FSDP2 shards in place: nothing to unwrap)."""
    while True:
        inner = getattr(model, "_orig_mod", None) or (getattr(model, "module", None)
                                                     if type(model).__name__ in ("DistributedDataParallel",
                                                                                 "DataParallel") else None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def describe(model: nn.Module) -> ModelRegistered:
    """Counts every parameter once (a tied embedding once; FSDP2's DTensor at its full size, which numel gives);
    the report's envelope (job, rank) is the sender's to fill."""
    model = unwrap(model)
    params = list(model.parameters())
    found = ModelRegistered(job_id="", rank=0, params=sum(p.numel() for p in params),
                            trainable=sum(p.numel() for p in params if p.requires_grad),
                            param_bytes=sum(p.numel() * p.element_size() for p in params))
    stated = _stated(model)
    if stated:
        return msgspec.structs.replace(found, source="config", **stated)
    seen = _from_modules(model)
    return msgspec.structs.replace(found, source="modules", **seen) if seen else found


def _stated(model: nn.Module) -> dict[str, int]:
    for holder in (getattr(model, "config", None), getattr(model, "spec", None)):
        if holder is None:
            continue
        values = {field: next((v for n in names if isinstance(v := getattr(holder, n, None), int) and v > 0), 0)
                  for field, names in NAMES.items()}
        if values["layers"] and values["hidden"]:
            return values
    return {}


def _from_modules(model: nn.Module) -> dict[str, int]:
    """The token embedding (the one with the most rows) gives vocabulary and width; the longest list of blocks of
    one class the depth; an attention module its heads."""
    found: dict[str, int] = {}
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if embeddings:
        token = max(embeddings, key=lambda e: e.num_embeddings)
        found |= {"vocab": token.num_embeddings, "hidden": token.embedding_dim}
    stacks = [len(m) for m in model.modules() if isinstance(m, nn.ModuleList | nn.Sequential) and len(m) > 1
              and len({type(c) for c in m}) == 1 and any(True for _ in m[0].parameters())]
    if stacks:
        found["layers"] = max(stacks)
    heads = next((v for m in model.modules() for n in HEAD_ATTRS
                  if isinstance(v := getattr(m, n, None), int) and v > 0), 0)
    if heads:
        found["heads"] = heads
    return found


class StepWatch:
    """Watches the script's second optimizer step: how many training forwards it took and the batch the first one
    read (its first tensor argument: `input_ids` when named), then hands the description on and unhooks."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, described: ModelRegistered,
                 send: Callable[[ModelRegistered], None]) -> None:
        self.described, self.send = described, send
        self.forwards, self.micro_batch, self.seq_len = 0, 0, 0
        self.steps = 0  # the script's optimizer steps seen
        self.sent = False
        self.hooks: list[RemovableHandle] = [model.register_forward_pre_hook(self._forward, with_kwargs=True),
                                             optimizer.register_step_post_hook(self._stepped)]

    def _forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.sent:  # unhooked here, not in the optimizer's hook: torch iterates that dict live (the module's not)
            for hook in self.hooks:
                hook.remove()
            self.hooks = []
            return
        if not module.training:
            return
        batch = next(_tensors(kwargs.get("input_ids"), *args, *kwargs.values()), None)
        if batch is not None and batch.is_meta:  # a pipeline stage's shape inference, not a step's forward
            return
        self.forwards += 1
        if self.forwards == 1 and batch is not None and batch.dim() >= 1:
            self.micro_batch = int(batch.shape[0])
            if batch.dim() >= 2 and not batch.is_floating_point():  # token ids: (batch, sequence)
                self.seq_len = int(batch.shape[1])

    def _stepped(self, *_: Any) -> None:
        if self.sent or not self.forwards:  # not the script's: DCP's get_state_dict steps once with zero grads
            return
        self.steps += 1
        if self.steps == 1:
            self.forwards = 0  # the next step's are counted
            return
        self.sent = True
        seen = msgspec.structs.replace(self.described, micro_batch=self.micro_batch, grad_accum=self.forwards)
        self.send(msgspec.structs.replace(seen, seq_len=self.seq_len) if self.seq_len else seen)


def _tensors(*values: Any) -> Iterator[torch.Tensor]:
    return (v for v in values if isinstance(v, torch.Tensor))


def across_stages(found: ModelRegistered, counted: bool, group: dist.ProcessGroup) -> ModelRegistered:
    """A pipeline stage holds only its own blocks: the model's counts are the stages' summed, one rank of each
    (`counted`: this rank is its stage's). A collective: every rank of `group` calls it."""
    counts = torch.tensor([found.params, found.trainable, found.param_bytes] if counted else [0, 0, 0])
    dist.all_reduce(counts, group=group)
    params, trainable, param_bytes = (int(c) for c in counts)
    return msgspec.structs.replace(found, params=params, trainable=trainable, param_bytes=param_bytes)


def watch(model: nn.Module | None, optimizer: torch.optim.Optimizer | None, emit: Callable[[RankEvent], None],
          envelope: Mapping[str, Any], world_size: int, replicas: Callable[[], int],
          described: ModelRegistered | None = None) -> StepWatch | None:
    """Describe `model` now (or take `described`: a pipeline's, across its stages); send its ModelRegistered at once
    without an optimizer to watch, else after the optimizer's second step. `replicas`: the data-parallel size when
    it is sent (the plan the script built)."""
    if model is None:
        return None

    def send(d: ModelRegistered) -> None:
        emit(msgspec.structs.replace(d, world_size=world_size, dp=replicas(), **envelope))

    described = described or describe(model)
    if optimizer is None:
        send(described)
        return None
    return StepWatch(model, optimizer, described, send)
