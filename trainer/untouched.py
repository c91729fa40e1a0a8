"""Reading and loading an optimizer's state without changing the script's training.

torch's `get_state_dict` and `set_state_dict` give an optimizer that has no state yet (before its first step) one by
stepping it on zero gradients with its learning rates at 0 (`_init_optim_state`). Left as it is, AdamW's `step` is 1
before the script's first step and every bias correction after it shifts; the step also runs the optimizer's hooks
(an LR scheduler's call counter, a script's EMA) and may move parameters whose update ignores the learning rate.
Snapshots taken at step 0 did exactly that: a job on the platform trained differently from the same script alone.

So every such call on the script's live objects goes through `untouched`: a fresh optimizer is given its state
here with every hook off, what the step moved is put back at once, and the state is emptied again afterwards
unless a load filled it."""

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.optim import optimizer as optim_module

STATE_PREFIX = "optim.state."  # the flat items of an optimizer's per-parameter state (DCP's names)
_UNSET = object()


def fresh(optimizer: torch.optim.Optimizer | None) -> bool:
    """The optimizer has no state and no gradients: torch's state-dict calls would step it to make some."""
    if optimizer is None or optimizer.state:
        return False
    return all(p.grad is None for group in optimizer.param_groups for p in group["params"])


@contextlib.contextmanager
def _hooks_off(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    own = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks)
    shared: tuple[dict[int, Any], ...] = (optim_module._global_optimizer_pre_hooks,
                                          optim_module._global_optimizer_post_hooks)
    held = [OrderedDict(d) for d in shared]
    called = optimizer.__dict__.get("_opt_called", _UNSET)  # an LR scheduler's wrapper of step() sets it
    optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
    for d in shared:
        d.clear()
    try:
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = own
        for d, kept in zip(shared, held, strict=True):
            d.update(kept)
        if called is _UNSET:
            optimizer.__dict__.pop("_opt_called", None)
        else:
            optimizer.__dict__["_opt_called"] = called


@contextlib.contextmanager
def untouched(optimizer: torch.optim.Optimizer | None, *, loading: bool = False) -> Iterator[bool]:
    """Run torch's state-dict calls on `optimizer` inside this; yields whether it was fresh. A fresh optimizer's
    state is emptied again on the way out, unless `loading` (a set_state_dict inside filled it from a checkpoint)."""
    if optimizer is None or not fresh(optimizer):
        yield False
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # Each rank's own shard of a DTensor: comparing whole DTensors is a collective, and ranks of other pipeline
    # stages hold other parameters (a pipeline hung on it, each stage in another collective)
    local = [getattr(p, "_local_tensor", p) for p in params]
    before = [t.detach().clone() for t in local]  # once per fresh optimizer's read: it is never stepped again
    with _hooks_off(optimizer):
        _init_optim_state(optimizer)
    with torch.no_grad():
        for t, was in zip(local, before, strict=True):
            if not torch.equal(t, was):  # an update that ignores the learning rate (a relative-step Adafactor)
                t.copy_(was)
    for p in params:
        p.grad = None  # they were (fresh() says so); torch's zero_grad leaves them so too
    try:
        yield True
    finally:
        if not loading:
            optimizer.state.clear()


def without_state(flat: dict[str, Any]) -> dict[str, Any]:
    """A fresh optimizer's flat items as saved: its groups (learning rates, betas), none of the state torch made."""
    return {k: v for k, v in flat.items() if not k.startswith(STATE_PREFIX)}


def set_groups(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Restore a checkpoint of a fresh optimizer: its groups' settings (each group's own parameters stay), no state."""
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(groups)} parameter groups, the registered one "
                         f"{len(optimizer.param_groups)}")
    optimizer.state.clear()
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
